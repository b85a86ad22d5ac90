"""Rotary position embeddings, with the frequency scalings Llama 3 (`llama3`), long-context Qwen2 (`yarn`),
Phi-3 and Phi-4-mini (`longrope`) and older fine-tunes (`linear`) declare in their configs, over the whole head
or its first part (`partial_rotary_factor`: Phi-4-mini rotates three quarters of each head).

LongRoPE has two sets of frequencies: `short_factor` for sequences within the pretraining context
(`original_max_position_embeddings`), `long_factor` past it. transformers' `generate()` switches a sequence to the
long set once it is longer than that, and then computes its whole cache again with them. Conveyor decides per
sequence, from the longer of its prompt and its length so far: a prompt longer than the original context is
served with the long set from its first token (exactly as `generate()`), and a sequence that grows past it
during decoding takes the long set for its new tokens while the tokens already cached keep the short set's
rotation (where `generate()` would compute them again).

The frequencies are computed with the published formulas in float32, the way the reference implementations
compute them, so our logits agree with transformers' to the last bits that matter for greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")


class UnsupportedRope(ValueError):
    pass


def rope_parameters(config) -> dict:
    """`rope_type`, `rope_theta` and the scaling fields, from transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelength < old_context / high) * ~(wavelength > old_context / low)
    return torch.where(middle, blended, scaled)


def _yarn(theta: float, dim: int, p: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """NTK-by-parts interpolation with YaRN's attention temperature folded into cos/sin."""
    factor = p.get("factor") or max_positions / p["original_max_position_embeddings"]
    original = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * positions)) * (1 - extrapolation) + (1.0 / positions) * extrapolation
    return inv_freq, attention


def rotary_dim(config, head_dim: int) -> int:
    """How much of each head rotates: all of it, or its first `partial_rotary_factor`."""
    factor = rope_parameters(config).get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0)
    return int(head_dim * factor)


def _longrope(config, theta: float, dim: int, p: dict) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Short and long inverse frequencies, the attention factor (from the ratio of the context to the original
    one, as Phi-3 declares it) and the original context."""
    original = p.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = p.get("factor") or config.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short, long = (1.0 / (torch.tensor(p[k], dtype=torch.float32) * base) for k in ("short_factor", "long_factor"))
    return short, long, attention, original


def frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos/sin are multiplied by, for this config's rope type (LongRoPE:
    its short set; `RotaryEmbedding.from_config` keeps both)."""
    p = rope_parameters(config)
    kind, theta = p["rope_type"], p["rope_theta"]
    dim = rotary_dim(config, head_dim)
    if kind not in SUPPORTED:
        raise UnsupportedRope(f"rope type {kind!r} is not supported by the paged engine (supported: {SUPPORTED})")
    if kind == "yarn":
        return _yarn(theta, dim, p, config.max_position_embeddings)
    if kind == "longrope":
        short, _, attention, _ = _longrope(config, theta, dim, p)
        return short, attention
    inv_freq = _base_frequencies(theta, dim)
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, p)
    return inv_freq, 1.0


@dataclass
class RotaryEmbedding:
    inv_freq: torch.Tensor  # [rotary dim / 2]
    attention_scaling: float
    long_inv_freq: torch.Tensor | None = None  # LongRoPE's set for sequences past `original_context`
    original_context: int = 0

    @classmethod
    def from_config(cls, config, head_dim: int, device: torch.device) -> RotaryEmbedding:
        p = rope_parameters(config)
        if p["rope_type"] == "longrope":
            short, long, attention, original = _longrope(config, p["rope_theta"], rotary_dim(config, head_dim), p)
            return cls(short.to(device), attention, long.to(device), original)
        inv_freq, scaling = frequencies(config, head_dim)
        return cls(inv_freq.to(device), scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, reach: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, [T, 1, rotary dim], computed once per forward and shared by all layers.
        `reach` (LongRoPE only): for each token, the longer of its sequence's prompt and its length so far."""
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None and reach is not None:
            inv_freq = torch.where((reach > self.original_context)[:, None], self.long_inv_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool) -> torch.Tensor:
    """`apply_rotary`, in place in one C++ pass where the kernels serve (`shard/kernels/rotary.cpp`, torch's bits
    exactly), else the torch reference below. x [T, heads, head_dim] is the caller's to overwrite."""
    if kernel and x.is_contiguous() and cos.dtype == x.dtype:
        torch.ops.conveyor.rotary_(x, cos, sin)
        return x
    return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each head of x [T, heads, head_dim] by its token's angles (the half-split convention); where cos is
    narrower than the head (partial rotary), only the head's first part turns."""
    turning = cos.shape[-1]
    if turning < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :turning], cos, sin), x[..., turning:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _LayerKind:
    """A config as one kind of layer sees it: its own rope parameters, everything else shared."""

    def __init__(self, config, rope: dict) -> None:
        self._config = config
        self.rope_parameters = rope
        self.rope_scaling = None  # the layer kind's parameters are complete: no legacy fields to merge

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def for_layer_kind(config, kind: str):
    """The config for layers of `kind`: Gemma 3 nests its rope parameters by layer kind (a local base for its
    sliding-window layers, another base and scaling for the global ones); other models have one set for all."""
    params = getattr(config, "rope_parameters", None) or {}
    return _LayerKind(config, params[kind]) if isinstance(params.get(kind), dict) else config
