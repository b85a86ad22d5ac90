"""An image-text checkpoint's vision encoder read whole on this rank: every family's encoder (`gemma3_vision.py`,
`idefics3_vision.py`) is transformers' own modules, loaded with the checkpoint's tensors under the module's names.
"""

from __future__ import annotations

import torch

from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import WeightError, Weights


def read_whole(
    encoder: torch.nn.Module, model_dir: str, names: dict[str, str], dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """`encoder` with the checkpoint's tensors whose names start with a key of `names` (that prefix read as its
    value), every one of its own filled; in `dtype` on `device`, for inference."""
    weights = Weights(model_dir, ProcessGroup(0, 1), dtype, device, names)
    state = {name: weights.get(name) for name in weights.names()}
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise WeightError(f"the vision tower's tensors do not match: missing {missing[:3]}, unknown {unexpected[:3]}")
    return encoder.to(dtype=dtype, device=device).eval()
