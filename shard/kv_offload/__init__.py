"""The prefix cache's disk tier (`--kv-offload-dir`): which prompt blocks to write and read, and their files."""
