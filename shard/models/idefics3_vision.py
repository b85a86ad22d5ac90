"""SmolVLM's (Idefics3's) image encoder: the SigLIP-style vision tower and the connector, run by the shard at prefill.

Each tile of an image (the router splits an image as the checkpoint's processor does, and sends every tile, the
whole image at a tile's size last, as an image of its own) goes through transformers' own Idefics3 vision
transformer and connector (pixel shuffle, then the projection), loaded with the checkpoint's weights, as
`gemma3_vision.py` runs Gemma 3's: once per tile, at the chunk that first reads its tokens. What they make, one
embedding per `<image>` token, stands in for those tokens' embeddings in Conveyor's own Llama model (`llama.py`),
whose attention over them stays causal, as Idefics3's is. Every rank holds the whole encoder and runs it.

A tile always fills the tower's input (the processor resizes or splits to `max_image_size` squares), so every patch
is real and the patch mask transformers builds from the processor's pixel mask is all ones: none is passed.
"""

from __future__ import annotations

import torch

from conveyor.shard.models.vision_weights import read_whole

# Where SmolVLM checkpoints keep the tower and the connector (Hub checkpoints and transformers 5 alike), as this
# module's own names.
VISION_NAMES = {"model.vision_model.": "tower.", "model.connector.": "connector."}


class VisionEncoder(torch.nn.Module):
    """Tile pixel values [N, C, H, W] to image-token embeddings [N, image_seq_len, hidden] in the model's dtype."""

    bidirectional = False  # Idefics3's language model attends to image tokens causally, like any other

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        self.tower = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)

    @classmethod
    def load(cls, model_dir: str, config, dtype: torch.dtype, device: torch.device) -> VisionEncoder | None:
        """The checkpoint's encoder, whole on this rank; None for a checkpoint without one."""
        if getattr(config, "model_type", None) != "idefics3" or getattr(config, "vision_config", None) is None:
            return None
        return read_whole(cls(config), model_dir, VISION_NAMES, dtype, device)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.tower(pixel_values=pixel_values).last_hidden_state
        return self.connector(hidden)
