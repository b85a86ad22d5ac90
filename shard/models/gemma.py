"""Gemma 2 and Gemma 3 (text) with tensor-parallel layers and a paged KV cache.

Gemma 3 keeps the Llama skeleton and changes most details, each one here: the embeddings are scaled by
sqrt(hidden); every norm is Gemma's (1 + w) RMSNorm, and each block has four of them (before and after attention,
before and after the MLP); queries and keys are normalised per head (as Qwen3) and scaled by
`query_pre_attn_scalar`, not the head size; the MLP is GeLU (tanh) gated; and layers interleave sliding-window
attention (a local rope base, `rope_local_base_freq` or the `sliding_attention` rope parameters) with global
attention (its own base and scaling), as `layer_types` lists them. Gemma 2 has no q/k norms and one rope for
every layer, and soft-caps its attention scores (`attn_logit_softcapping`) and its logits
(`final_logit_softcapping`): cap * tanh(x / cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.shard.layers.attention import KVCache, Metadatas, paged_attention
from conveyor.shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.shard.layers.norm import GemmaRMSNorm
from conveyor.shard.layers.rotary import RotaryEmbedding, apply_rotary, for_layer_kind
from conveyor.shard.models.llama import Shape
from conveyor.shard.runtime.weights import WeightError, Weights

MODEL_TYPES = ("gemma2", "gemma3_text")
SLIDING, GLOBAL = "sliding_attention", "full_attention"


class Attention(torch.nn.Module):
    def __init__(self, config, shape: Shape, weights: Weights, prefix: str, window: int | None) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv = ColumnParallelLinear.load(weights, [f"{prefix}.{p}_proj" for p in "qkv"], bias=bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=bias)
        self.qk_norms: torch.nn.ModuleList | None = None
        if f"{prefix}.q_norm.weight" in weights:  # Gemma 3
            eps = config.rms_norm_eps
            self.qk_norms = torch.nn.ModuleList(
                GemmaRMSNorm(weights.get(f"{prefix}.{n}_norm.weight"), eps) for n in "qk"
            )
        self.softcap = getattr(config, "attn_logit_softcapping", None) or 0.0
        self.heads, self.kv_heads, self.head_dim = shape.heads_per_rank, shape.kv_heads_per_rank, shape.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.window = window

    def forward(self, hidden, cos, sin, key_cache, value_cache, metas: Metadatas) -> torch.Tensor:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.reshape(-1, self.heads, self.head_dim), k.reshape(-1, self.kv_heads, self.head_dim)
        if self.qk_norms is not None:
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.reshape(-1, self.kv_heads, self.head_dim)
        out = paged_attention(q, k, v, key_cache, value_cache, metas[self.window], self.scale, self.softcap)
        return self.o_proj(out)


class MLP(torch.nn.Module):
    def __init__(self, config, weights: Weights, prefix: str) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise WeightError(f"activation {activation!r} is not supported for Gemma")
        self.gate_up = ColumnParallelLinear.load(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=False)
        self.down = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config, shape: Shape, weights: Weights, prefix: str, kind: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.kind = kind
        window = config.sliding_window if kind == SLIDING else None
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        self.norms = torch.nn.ModuleList(GemmaRMSNorm(weights.get(f"{prefix}.{n}.weight"), eps) for n in norms)
        self.attention = Attention(config, shape, weights, f"{prefix}.self_attn", window)
        self.mlp = MLP(config, weights, f"{prefix}.mlp")

    def forward(self, hidden, rotations, key_cache, value_cache, metas: Metadatas) -> torch.Tensor:
        before_attention, after_attention, before_mlp, after_mlp = self.norms
        cos, sin = rotations[self.kind]
        attended = self.attention(before_attention(hidden), cos, sin, key_cache, value_cache, metas)
        hidden = hidden + after_attention(attended)
        return hidden + after_mlp(self.mlp(before_mlp(hidden)))


class GemmaForCausalLM(torch.nn.Module):
    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        kinds = list(getattr(config, "layer_types", None) or [GLOBAL] * config.num_hidden_layers)
        if set(kinds) - {SLIDING, GLOBAL}:
            raise WeightError(f"layer kinds {sorted(set(kinds))} are not all known ({SLIDING}, {GLOBAL})")
        self.config = config
        self.shape = Shape(config, weights.group.world_size)
        self.embed = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        # As transformers: the scale rounded to the model's dtype, then multiplied in that dtype.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(weights.dtype)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, self.shape, weights, f"model.layers.{i}", kind) for i, kind in enumerate(kinds)
        )
        self.norm = GemmaRMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # tied
        self.lm_head = ParallelLMHead.load(weights, head)
        self.rotaries = {
            kind: RotaryEmbedding.from_config(for_layer_kind(config, kind), self.shape.head_dim, weights.device)
            for kind in set(kinds)
        }
        self.windows = tuple({config.sliding_window if k == SLIDING else None for k in kinds})
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.needs_reach = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        metas: Metadatas,
        logits_index: torch.Tensor,
        reach: torch.Tensor | None = None,
        states_index: torch.Tensor | None = None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, vocab] for the flat tokens at `logits_index` (usually each sequence's last); with
        `states_index`, also the final-norm hidden states [M, hidden] (float32) of those tokens (embeddings).
        `image_embeds`: (flat indices, embeddings) of image soft tokens, which replace those tokens' (scaled)
        embeddings, as transformers' Gemma 3 puts its vision tower's output in place of its placeholders."""
        hidden = self.embed(input_ids) * self.embed_scale
        if image_embeds is not None:
            index, values = image_embeds
            hidden[index] = values.to(hidden.dtype)
        rotations = {kind: rotary.cos_sin(positions, hidden.dtype) for kind, rotary in self.rotaries.items()}
        for layer, key_cache, value_cache in zip(self.layers, cache.keys, cache.values):
            hidden = layer(hidden, rotations, key_cache, value_cache, metas)
        logits = self.lm_head(self.norm(hidden[logits_index])).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits if states_index is None else (logits, self.norm(hidden[states_index]).float())
