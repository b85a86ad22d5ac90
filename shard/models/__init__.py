"""The model code per architecture, and the one place that says which `model_type` runs on which."""

from __future__ import annotations

import torch
from conveyor.shard.models import gemma, llama
from conveyor.shard.weights import WeightError, Weights

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    **dict.fromkeys(llama.MODEL_TYPES, llama.LlamaForCausalLM),
    **dict.fromkeys(gemma.MODEL_TYPES, gemma.GemmaForCausalLM),
}
MODEL_TYPES = tuple(ARCHITECTURES)


def model_for(config, weights: Weights) -> torch.nn.Module:
    """The network for this config, its weights read for this rank."""
    if config.model_type not in ARCHITECTURES:
        raise WeightError(f"model type {config.model_type!r} is not one of {MODEL_TYPES}")
    return ARCHITECTURES[config.model_type](config, weights)
