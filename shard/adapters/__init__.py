"""LoRA adapters: reading and checking an adapter's files, and serving several beside the base model in one forward."""
