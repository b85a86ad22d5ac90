"""The model code per architecture, and the one place that says which `model_type` runs on which."""

from __future__ import annotations

import torch

from conveyor.shard.models import gemma, gemma3_vision, idefics3_vision, llama
from conveyor.shard.runtime.weights import WeightError, Weights

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    **dict.fromkeys(llama.MODEL_TYPES, llama.LlamaForCausalLM),
    **dict.fromkeys(gemma.MODEL_TYPES, gemma.GemmaForCausalLM),
}
# Image-text checkpoints whose text model is served alone: where each one keeps the text weights, as the names
# the text model's own checkpoint gives them (Hub checkpoints write `language_model.model.`; transformers 5 reads
# and may write `model.language_model.`). Their other tensors (vision tower, projector) are never read.
WRAPPERS: dict[str, dict[str, str]] = {
    "gemma3": {
        "language_model.model.": "model.",
        "model.language_model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "lm_head.": "lm_head.",
    },
    "idefics3": {  # SmolVLM: a Llama text model
        "model.text_model.": "model.",
        "lm_head.": "lm_head.",
    },
}
# Each image-text family's vision encoder (tower and projector, whole on every rank), by the wrapper's model_type.
VISION_ENCODERS = {"gemma3": gemma3_vision.VisionEncoder, "idefics3": idefics3_vision.VisionEncoder}
MODEL_TYPES = (*ARCHITECTURES, *WRAPPERS)


def language_config(config):
    """The config of the network Conveyor runs: a wrapper's `text_config` (with the wrapper's dtype and EOS where
    the text config leaves them unset), else the config itself."""
    if config.model_type not in WRAPPERS:
        return config
    text = config.text_config
    for field in ("dtype", "eos_token_id"):
        if getattr(text, field, None) is None and getattr(config, field, None) is not None:
            setattr(text, field, getattr(config, field))
    return text


def weight_names(config) -> dict[str, str] | None:
    """Checkpoint name prefixes to the text model's own, for a wrapper; None: the names are the model's."""
    return WRAPPERS.get(config.model_type)


def vision_encoder_for(model_dir: str, config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module | None:
    """The checkpoint's vision encoder, loaded whole on this rank; None for a model that takes no images. Its
    `bidirectional`: whether an image's tokens see each other both ways in the language model."""
    encoder = VISION_ENCODERS.get(getattr(config, "model_type", None))
    return None if encoder is None else encoder.load(model_dir, config, dtype, device)


def model_for(config, weights: Weights) -> torch.nn.Module:
    """The network for this config, its weights read for this rank."""
    if config.model_type not in ARCHITECTURES:
        raise WeightError(f"model type {config.model_type!r} is not one of {MODEL_TYPES}")
    # A wrapper's config is read through language_config first, so only text model types arrive here.
    return ARCHITECTURES[config.model_type](config, weights)
