"""Rotary embeddings against transformers' own: the inverse frequencies and attention factor of every rope type
the engine supports, and cos/sin applied to q and k at scattered positions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conveyor.shard.layers.rotary import RotaryEmbedding, UnsupportedRope, apply_rotary, frequencies

YARN = dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

# name: (rope_parameters, max_position_embeddings)
CASES = {
    "default-10k": (dict(rope_type="default", rope_theta=10000.0), 4096),
    "default-500k": (dict(rope_type="default", rope_theta=500000.0), 4096),
    "linear": (dict(rope_type="linear", rope_theta=10000.0, factor=4.0), 16384),
    "llama3": (LLAMA3, 131072),
    "yarn": (YARN, 131072),
    "yarn-attention-factor": ({**YARN, "attention_factor": 0.8}, 131072),
    "yarn-betas": ({**YARN, "beta_fast": 16.0, "beta_slow": 2.0}, 131072),
    "yarn-mscale": ({**YARN, "mscale": 0.8, "mscale_all_dim": 0.6}, 131072),
    "yarn-no-truncate": ({**YARN, "truncate": False}, 131072),
}


def _config(name: str, head_dim: int = 128, heads: int = 4) -> LlamaConfig:
    params, max_positions = CASES[name]
    return LlamaConfig(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        rope_parameters=dict(params),
    )


def _reference(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_match_transformers(name: str, head_dim: int):
    inv_freq, scaling = frequencies(_config(name, head_dim), head_dim)
    expected, expected_scaling = _reference(_config(name, head_dim))  # a fresh config: transformers may edit it
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (head_dim // 2,)
    # Exact: the same formulas evaluated in float32 in the same order.
    assert torch.equal(inv_freq, expected)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)


def test_the_scaled_cases_are_not_the_default():
    """Guards the comparisons above: each scaling must change something, or the case would test nothing new."""
    base, _ = frequencies(_config("default-10k"), 128)
    yarn, yarn_scaling = frequencies(_config("yarn"), 128)
    unscaled_yarn = 1.0 / (YARN["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
    assert not torch.allclose(yarn, unscaled_yarn)
    assert not torch.equal(frequencies(_config("linear"), 128)[0], base)
    assert not torch.equal(frequencies(_config("llama3"), 128)[0], frequencies(_config("default-500k"), 128)[0])
    assert not torch.equal(frequencies(_config("yarn-betas"), 128)[0], yarn)
    assert not torch.equal(frequencies(_config("yarn-no-truncate"), 128)[0], yarn)
    assert yarn_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert frequencies(_config("yarn-attention-factor"), 128)[1] == 0.8
    assert frequencies(_config("yarn-mscale"), 128)[1] != pytest.approx(yarn_scaling)


def test_legacy_rope_scaling_is_understood():
    """A config that still carries `rope_theta` + `rope_scaling` (with the old `type` key)."""
    legacy = SimpleNamespace(
        rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}, max_position_embeddings=16384
    )
    expected, expected_scaling = _reference(_config("linear"))
    inv_freq, scaling = frequencies(legacy, 128)
    assert torch.equal(inv_freq, expected) and scaling == expected_scaling
    # transformers 5 still accepts the old keywords and folds them into rope_parameters.
    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3),
        max_position_embeddings=131072,
    )
    assert torch.equal(frequencies(config, 128)[0], _reference(_config("llama3"))[0])


def test_no_rope_settings_means_default_theta_10000():
    inv_freq, scaling = frequencies(SimpleNamespace(max_position_embeddings=4096), 128)
    assert torch.equal(inv_freq, _reference(_config("default-10k"))[0]) and scaling == 1.0


@pytest.mark.parametrize("kind", ["dynamic", "su-without-factors"])
def test_unsupported_rope_types_raise(kind: str):
    config = SimpleNamespace(
        rope_parameters={"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}, max_position_embeddings=4096
    )
    with pytest.raises(UnsupportedRope, match=kind):
        frequencies(config, 128)


def test_dynamic_from_a_transformers_config_raises():
    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(UnsupportedRope):
        frequencies(config, 128)


def phi3_config(partial: float):
    from transformers import Phi3Config

    rotating = int(16 * partial) // 2
    gen = torch.Generator().manual_seed(5)
    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        original_max_position_embeddings=100,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "short_factor": (1 + torch.rand(rotating, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rotating, generator=gen)).tolist(),
        },
    )


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["whole-head", "half-head"])
@pytest.mark.parametrize("longest", [60, 150], ids=["short", "long"])
def test_longrope_and_partial_rotary_match_phi3(partial: float, longest: int) -> None:
    """Phi-3's LongRoPE: the short set while the sequence is within the original context, the long one past it
    (transformers decides by the longest position of the forward; Conveyor by each sequence's reach, the same for
    one sequence), over the whole head or its first part."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

    config = phi3_config(partial)
    positions = torch.tensor([0, 5, 17, longest - 1])
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 4, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    rotary = RotaryEmbedding.from_config(config, 16, torch.device("cpu"))
    cos, sin = rotary.cos_sin(positions, torch.float32, reach=torch.full((4,), longest))
    reference = Phi3RotaryEmbedding(config)
    ref_cos, ref_sin = reference(q[None], positions[None])
    ref_q, ref_k = phi3_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    if partial < 1:
        torch.testing.assert_close(apply_rotary(q, cos, sin)[..., 8:], q[..., 8:])  # the rest of the head stays


@pytest.mark.parametrize("name", ["default-10k", "llama3", "yarn", "yarn-attention-factor"])
def test_cos_sin_and_apply_rotary_match_transformers(name: str):
    head_dim, heads = 32, 3
    positions = torch.tensor([0, 5, 17, 300])
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(positions), heads, head_dim, generator=gen)
    k = torch.randn(len(positions), heads, head_dim, generator=gen)

    rotary = RotaryEmbedding.from_config(_config(name, head_dim, heads), head_dim, torch.device("cpu"))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert cos.shape == sin.shape == (len(positions), 1, head_dim)
    q_out, k_out = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    reference = LlamaRotaryEmbedding(_config(name, head_dim, heads))
    ref_cos, ref_sin = reference(q, positions[None, :])  # [1, T, head_dim]
    # transformers wants [B, heads, T, head_dim]; ours is [T, heads, head_dim].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(cos[:, 0, :], ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, :], ref_sin[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(q_out, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)
    # Position 0 is the identity rotation scaled by the attention factor; later positions really rotate.
    torch.testing.assert_close(q_out[0], q[0] * rotary.attention_scaling, rtol=0, atol=1e-6)
    assert not torch.allclose(q_out[3], q[3] * rotary.attention_scaling, atol=1e-2)


def test_apply_rotary_uses_the_half_split_convention():
    """A hand-checked rotation: head_dim 2 pairs x[0] with x[1], angle = position * inv_freq."""
    rotary = RotaryEmbedding(inv_freq=torch.tensor([0.5]), attention_scaling=1.0)
    cos, sin = rotary.cos_sin(torch.tensor([2]), torch.float32)  # angle 1 radian
    x = torch.tensor([[[3.0, 4.0]]])
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    expected = torch.stack([3 * c - 4 * s, 4 * c + 3 * s])
    torch.testing.assert_close(apply_rotary(x, cos, sin)[0, 0], expected, rtol=0, atol=1e-6)
