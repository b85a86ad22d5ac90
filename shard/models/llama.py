"""The Llama family (Llama, Mistral, Qwen2, Qwen3) with tensor-parallel layers and a paged KV cache.

They differ only in their configs: Qwen2 has biases on q/k/v, Llama may have biases everywhere
(`attention_bias`, `mlp_bias`), Mistral may have a sliding window, Qwen3 normalises each query and key head
(RMSNorm over the head, before the rotation) and states its head size apart from the hidden size, Phi-3 and
Phi-4-mini store q/k/v and gate/up already fused, may rotate part of each head only and scale the rotation with
LongRoPE (`layers/rotary.py`). Everything runs on a flat, ragged batch of tokens: no padding between sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers.attention import AttentionMetadata, KVCache, Metadatas, attend, paged_attention
from conveyor.shard.layers.decode_stack import DecodeStack, LayerParts, StackShape
from conveyor.shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.shard.layers.norm import RMSNorm
from conveyor.shard.layers.rotary import RotaryEmbedding, rotate
from conveyor.shard.runtime.weights import WeightError, Weights

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class Shape:
    """Head counts per rank, with a clear error when the model does not split over the ranks."""

    def __init__(self, config, world_size: int) -> None:
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        for name, count in (("attention heads", self.heads), ("key-value heads", self.kv_heads)):
            if count % world_size:
                raise WeightError(f"the model's {count} {name} do not divide by {world_size} shards")
        self.heads_per_rank = self.heads // world_size
        self.kv_heads_per_rank = self.kv_heads // world_size


class Attention(torch.nn.Module):
    def __init__(self, config, shape: Shape, weights: Weights, prefix: str) -> None:
        super().__init__()
        qwen2 = config.model_type == "qwen2"
        qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
        out_bias = not qwen2 and bool(getattr(config, "attention_bias", False))
        if f"{prefix}.qkv_proj.weight" in weights:  # Phi-3: fused in the checkpoint
            sizes = [shape.heads * shape.head_dim] + [shape.kv_heads * shape.head_dim] * 2
            self.qkv = ColumnParallelLinear.load_fused(weights, f"{prefix}.qkv_proj", sizes)
        else:
            self.qkv = ColumnParallelLinear.load(weights, [f"{prefix}.{p}_proj" for p in "qkv"], bias=qkv_bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=out_bias)
        self.heads, self.kv_heads, self.head_dim = shape.heads_per_rank, shape.kv_heads_per_rank, shape.head_dim
        self.scale = self.head_dim**-0.5
        self.qk_norms: torch.nn.ModuleList | None = None
        if config.model_type == "qwen3":
            eps = config.rms_norm_eps
            self.qk_norms = torch.nn.ModuleList(RMSNorm(weights.get(f"{prefix}.{n}_norm.weight"), eps) for n in "qk")
        self.kernel = kernels.serves(weights.device)  # the fused rotation and K/V write (shard/kernels/rotary.cpp)

    def forward(self, hidden, cos, sin, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv(hidden)
        if self.kernel and self.qk_norms is None and qkv.is_contiguous() and cos.dtype == qkv.dtype == key_cache.dtype:
            # One C++ pass rotates q and k in place and writes k and v to their cache slots.
            torch.ops.conveyor.rotary_kv_(qkv, self.heads, self.kv_heads, cos, sin, key_cache, value_cache, meta.slots)
            q = qkv.view(qkv.shape[0], -1, self.head_dim)[:, : self.heads]
            return self.o_proj(attend(q, key_cache, value_cache, meta, self.scale))
        qk_size = (self.heads + self.kv_heads) * self.head_dim
        qk, v = qkv.split([qk_size, self.kv_heads * self.head_dim], dim=-1)
        qk = qk.reshape(-1, self.heads + self.kv_heads, self.head_dim)
        if self.qk_norms is not None:
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            qk = torch.cat([self.qk_norms[0](q), self.qk_norms[1](k)], dim=1)
        # q and k sit side by side in the fused projection: one rotation covers both heads' sets.
        qk = rotate(qk, cos, sin, self.kernel)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        v = v.view(-1, self.kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, key_cache, value_cache, meta, self.scale))


class MLP(torch.nn.Module):
    def __init__(self, config, weights: Weights, prefix: str) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise WeightError(f"activation {config.hidden_act!r} is not supported by the paged engine")
        bias = bool(getattr(config, "mlp_bias", False))
        if f"{prefix}.gate_up_proj.weight" in weights:  # Phi-3: fused in the checkpoint
            sizes = [config.intermediate_size] * 2
            self.gate_up = ColumnParallelLinear.load_fused(weights, f"{prefix}.gate_up_proj", sizes)
        else:
            self.gate_up = ColumnParallelLinear.load(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=bias)
        self.down = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=bias)
        self.kernel = kernels.serves(weights.device)  # silu(gate) * up in one pass (shard/kernels/silu_mul.cpp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.kernel and gate_up.is_contiguous():
            return self.down(torch.ops.conveyor.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config, shape: Shape, weights: Weights, prefix: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(weights.get(f"{prefix}.input_layernorm.weight"), eps)
        self.attention = Attention(config, shape, weights, f"{prefix}.self_attn")
        self.post_attention_norm = RMSNorm(weights.get(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = MLP(config, weights, f"{prefix}.mlp")

    def forward(self, hidden, delta, cos, sin, key_cache, value_cache, meta) -> torch.Tensor:
        """The residual stream `hidden` still owes the previous layer's MLP output `delta` (None before the first
        layer): each residual add happens in place inside the norm that follows it (`RMSNorm.add_forward`), so
        `hidden` is updated where it lies and the layer returns its own MLP output, the next one's delta."""
        normed = self.input_norm(hidden) if delta is None else self.input_norm.add_forward(hidden, delta)
        attended = self.attention(normed, cos, sin, key_cache, value_cache, meta)
        return self.mlp(self.post_attention_norm.add_forward(hidden, attended))

    def parts(self) -> LayerParts:
        """What the decode stack binds of this layer."""
        attention, mlp = self.attention, self.mlp
        qk = None if attention.qk_norms is None else tuple(norm.weight for norm in attention.qk_norms)
        norms = (self.input_norm.weight, self.post_attention_norm.weight, qk)
        return LayerParts(*norms, attention.qkv, attention.o_proj, mlp.gate_up, mlp.down)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        if config.model_type not in MODEL_TYPES:
            raise WeightError(f"model type {config.model_type!r} is not one of {MODEL_TYPES}")
        self.config = config
        self.shape = Shape(config, weights.group.world_size)
        self.embed = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, self.shape, weights, f"model.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # tied
        self.lm_head = ParallelLMHead.load(weights, head)
        self.rotary = RotaryEmbedding.from_config(config, self.shape.head_dim, weights.device)
        self.needs_reach = self.rotary.long_inv_freq is not None
        window = getattr(config, "sliding_window", None)
        uses_window = window and getattr(config, "use_sliding_window", True) and config.model_type != "llama"
        kinds = set(getattr(config, "layer_types", None) or [])
        if uses_window and len(kinds) > 1:
            raise WeightError(f"layers of several attention kinds ({sorted(kinds)}) are not supported yet")
        self.sliding_window: int | None = window if uses_window else None
        self.windows: tuple[int | None, ...] = (self.sliding_window,)  # the attention metadata the engine builds
        self.decode_stack = self._decode_stack(weights)

    def _decode_stack(self, weights: Weights) -> DecodeStack | None:
        """The layers bound for decode steps in one C++ call (shard/layers/decode_stack.py), where it serves."""
        shape = self.shape
        stack_shape = StackShape(
            shape.heads_per_rank,
            shape.kv_heads_per_rank,
            shape.head_dim,
            self.config.rms_norm_eps,
            self.layers[0].attention.scale,
        )
        parts = [layer.parts() for layer in self.layers]
        return DecodeStack.build(parts, stack_shape, weights.group, weights.device)

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
        """Logits [N, vocab] for the flat tokens at `logits_index` (usually each sequence's last). `reach`: for
        LongRoPE (`needs_reach`), each token's sequence's longer of prompt and length so far. With `states_index`,
        also the final-norm hidden states [M, hidden] (float32) of those tokens (embeddings). `image_embeds`:
        (flat indices, embeddings) of image tokens, which replace those tokens' embeddings, as transformers'
        Idefics3 (SmolVLM) puts its connector's output in place of its `<image>` tokens."""
        hidden, delta = self.embed(input_ids), None  # the residual stream is added to in place from here on
        if image_embeds is not None:
            index, values = image_embeds
            hidden[index] = values.to(hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, reach)
        meta = metas[self.sliding_window]
        if self.decode_stack is not None and self.decode_stack.serves(hidden.shape[0], meta.groups):
            delta = self.decode_stack(hidden, cos, sin, cache, meta.slots, meta.groups[0])
        else:
            for layer, key_cache, value_cache in zip(self.layers, cache.keys, cache.values):
                delta = layer(hidden, delta, cos, sin, key_cache, value_cache, meta)
        logits = self.lm_head(self.norm(hidden[logits_index] + delta[logits_index])).float()
        if states_index is None:
            return logits
        return logits, self.norm(hidden[states_index] + delta[states_index]).float()
