"""Rotary embeddings against transformers' own: the frequencies of every supported scaling, and the rotation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conveyor.shard.layers.rotary import RotaryEmbedding, UnsupportedRope, apply_rotary, frequencies

HEAD_DIM = 64

CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 4096),
    "default-500k": ({"rope_type": "default", "rope_theta": 500000.0}, 4096),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 4096),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
    "yarn": ({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768}, 131072),
    "yarn-attention-factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 1.3,
                               "original_max_position_embeddings": 4096}, 8192),
    "yarn-betas": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                    "original_max_position_embeddings": 2048}, 16384),
}  # fmt: skip


def config(rope: dict, max_positions: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=max_positions,
                       rope_parameters=dict(rope))  # fmt: skip


def reference(c: LlamaConfig) -> tuple[torch.Tensor, float]:
    kind = c.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(c)
    return ROPE_INIT_FUNCTIONS[kind](c)


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_match_transformers(case: str) -> None:
    c = config(*CASES[case])
    ours, ours_scale = frequencies(c, HEAD_DIM)
    theirs, their_scale = reference(c)
    assert torch.equal(ours, theirs.float())
    assert ours_scale == pytest.approx(their_scale, rel=1e-12)


def test_legacy_rope_scaling_field_is_read() -> None:
    class Legacy:  # a config from before transformers 5: rope_theta and rope_scaling beside each other
        rope_theta = 10000.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        max_position_embeddings = 4096

    ours, _ = frequencies(Legacy(), HEAD_DIM)
    expected, _ = frequencies(config({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 4096), HEAD_DIM)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_unsupported_scalings_are_refused(kind: str) -> None:
    c = config({"rope_type": "default", "rope_theta": 10000.0}, 4096)
    c.rope_parameters = {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedRope, match=kind):
        frequencies(c, HEAD_DIM)


@pytest.mark.parametrize("case", ["default", "llama3", "yarn"])
def test_rotation_matches_transformers(case: str) -> None:
    c = config(*CASES[case])
    positions = torch.tensor([0, 5, 17, 300])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 4, HEAD_DIM, generator=g), torch.randn(4, 2, HEAD_DIM, generator=g)

    rotary = RotaryEmbedding.from_config(c, HEAD_DIM, torch.device("cpu"))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    ours_q, ours_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    hf_cos, hf_sin = LlamaRotaryEmbedding(c)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)
