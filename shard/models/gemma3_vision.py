"""Gemma 3's image encoder: the SigLIP vision tower and the multi-modal projector, run by the shard at prefill.

An image's pixel values (as the checkpoint's processor prepared them in the router) go through transformers' own
SigLIP tower and Gemma 3 projector, loaded with the checkpoint's weights: they run once per image, at the chunk that
first reads its tokens, and are not the hot path, so the reference code is the code. What they make, one embedding
per soft token, stands in for the image's placeholder tokens' embeddings in the language model (`gemma.py`), which
stays Conveyor's own. Every rank holds the whole tower and runs it (it is small beside the language model): the
embeddings are then on every rank with no communication, and each rank's slice of the language model reads them.
"""

from __future__ import annotations

import torch

from conveyor.shard.models.vision_weights import read_whole

# Where checkpoints keep the tower and the projector, as this module's own names: Google's Hub checkpoints (saved by
# transformers 4) under `vision_tower.vision_model.`, transformers 5 under `vision_tower.` or `model.vision_tower.`
# (its SiglipVisionModel holds the layers itself). The first prefix that matches wins, so the longer ones go first.
VISION_NAMES = {
    "model.vision_tower.vision_model.": "tower.",
    "vision_tower.vision_model.": "tower.",
    "model.vision_tower.": "tower.",
    "vision_tower.": "tower.",
    "model.multi_modal_projector.": "projector.",
    "multi_modal_projector.": "projector.",
}


class VisionEncoder(torch.nn.Module):
    """Pixel values [N, C, H, W] to soft-token embeddings [N, mm_tokens_per_image, hidden] in the model's dtype."""

    bidirectional = True  # an image's soft tokens see each other both ways in the language model

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.tower = SiglipVisionModel(config.vision_config)
        self.projector = Gemma3MultiModalProjector(config)
        self.tokens_per_image = int(config.mm_tokens_per_image)

    @classmethod
    def load(cls, model_dir: str, config, dtype: torch.dtype, device: torch.device) -> VisionEncoder | None:
        """The checkpoint's encoder, whole on this rank; None for a checkpoint without one (a text model)."""
        if getattr(config, "model_type", None) != "gemma3" or getattr(config, "vision_config", None) is None:
            return None
        return read_whole(cls(config), model_dir, VISION_NAMES, dtype, device)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.tower(pixel_values=pixel_values).last_hidden_state
        return self.projector(hidden)
