"""Reading a checkpoint's tensors by the names the model code asks for, including a multimodal wrapper's text
weights, which live under another prefix beside tensors that are never read, and a bare base model's (as
sentence-transformers saves an embedding checkpoint), whose names lack the `model.` prefix."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from conveyor.shard.models import language_config, weight_names
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights


def test_a_wrappers_text_weights_are_read_under_the_text_models_names(gemma3_multimodal_model: Path) -> None:
    config = AutoConfig.from_pretrained(gemma3_multimodal_model)
    assert config.model_type == "gemma3" and language_config(config).model_type == "gemma3_text"
    cpu = torch.device("cpu")
    weights = Weights(gemma3_multimodal_model, ProcessGroup(0, 1), torch.float32, cpu, weight_names(config))
    with safe_open(gemma3_multimodal_model / "model.safetensors", framework="pt") as stored:
        names = list(stored.keys())
        embedding = stored.get_tensor("language_model.model.embed_tokens.weight")
        text_only = sum(math.prod(stored.get_slice(n).get_shape()) for n in names if n.startswith("language_model."))
    assert any(n.startswith("vision_tower.") for n in names)
    assert torch.equal(weights.get("model.embed_tokens.weight"), embedding)
    assert "language_model.model.embed_tokens.weight" not in weights
    assert not any("vision" in n or "projector" in n for n in weights.names())
    assert weights.nbytes() == text_only * 4  # float32: the vision tower is not counted


def test_a_text_checkpoint_keeps_its_own_names(tiny_model: Path) -> None:
    weights = Weights(tiny_model, ProcessGroup(0, 1), torch.float32, torch.device("cpu"))
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights


def test_a_bare_base_models_weights_are_read_under_model(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModel

    AutoModel.from_pretrained(tiny_model).save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as stored:
        assert "embed_tokens.weight" in stored.keys() and "lm_head.weight" not in stored.keys()
        embedding = stored.get_tensor("embed_tokens.weight")
    weights = Weights(tmp_path, ProcessGroup(0, 1), torch.float32, torch.device("cpu"))
    assert torch.equal(weights.get("model.embed_tokens.weight"), embedding)
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "lm_head.weight" not in weights
