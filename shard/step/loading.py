"""What an engine loads besides its own model: the draft model beside it, the prefix cache's disk tier, and the
facts read from the checkpoint on the way (the dtype `auto` resolves to, the EOS ids)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from conveyor.shard.kv_offload import block_files, prefix_offload
from conveyor.shard.kv_offload.prefix_offload import PrefixOffload
from conveyor.shard.layers.attention import KVCache
from conveyor.shard.models import language_config, model_for, weight_names
from conveyor.shard.runtime import host_memory
from conveyor.shard.runtime.device import checkpoint_dtype, choose_dtype, device_bf16
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights
from conveyor.shard.speculation.draft_model import DraftModel

log = logging.getLogger(__name__)


class EngineFacts(Protocol):
    """What loading reads of the engine it loads for (the engine itself)."""

    vocab_size: int
    group: ProcessGroup
    dtype: torch.dtype
    dtype_name: str
    kv_dtype: torch.dtype
    device: torch.device
    block_size: int
    cache_shape: tuple[int, int, int]  # layers, KV heads on this rank, head dim
    forward: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Draft:
    """The draft model's choice (--speculate-model, --speculate-quantize)."""

    model: str  # a model directory, or "self": the target's own checkpoint
    quantize: str | None = None


def load_draft(engine: EngineFacts, model_dir: str | Path, draft: Draft) -> DraftModel:
    """The draft model: the target's own checkpoint (`self`) or another with the same vocabulary, read for
    this rank as the target is, quantized if asked."""
    from transformers import AutoConfig

    source = model_dir if draft.model == "self" else draft.model
    checkpoint_config = AutoConfig.from_pretrained(source)
    config = language_config(checkpoint_config)
    if config.vocab_size != engine.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({config.vocab_size}) is not the target's ({engine.vocab_size})"
        )
    weights = Weights(source, engine.group, engine.dtype, engine.device, weight_names(checkpoint_config))
    weights.quantize = draft.quantize
    model = model_for(config, weights).eval()
    shape = model.shape
    cache_shape = (config.num_hidden_layers, shape.kv_heads_per_rank, shape.head_dim)
    log.info(
        "draft model",
        extra={"model": str(source), "quantize": draft.quantize or "none", "bytes": host_memory.model_bytes(model)},
    )
    return DraftModel(model, engine.forward, cache_shape, engine.block_size, engine.dtype, engine.device)


def disk_tier(
    engine: EngineFacts, model_dir: Path, folder: Path, max_bytes: int, quantize: str | None
) -> PrefixOffload:
    """The disk tier for this rank: its files' fingerprint says everything their KV depends on but tokens."""
    layers, kv_heads, head_dim = engine.cache_shape
    facts = {
        "dtype": engine.dtype_name,
        "kv_dtype": str(engine.kv_dtype),
        "block_size": engine.block_size,
        "rank": engine.group.rank,
        "world_size": engine.group.world_size,
        "quantize": quantize or "",
        "format": block_files.MAGIC.hex(),
    }
    block_bytes = KVCache.bytes_per_block(layers, engine.block_size, kv_heads, head_dim, engine.kv_dtype)
    tier = block_files.DiskTier(folder, prefix_offload.fingerprint(model_dir, facts), max_bytes, block_bytes)
    log.info("kv offload", extra={"folder": str(folder), "files_bytes": tier.stats.bytes_on_disk})
    return PrefixOffload(tier, engine.block_size, engine.group)


def resolve_dtype(asked: str, config, device: torch.device) -> str:
    """`--dtype`, with auto worked out from the checkpoint and the device (every rank reaches the same answer)."""
    if asked != "auto":
        return asked
    return choose_dtype("auto", checkpoint_dtype(config), device, device_bf16(device))


def eos_token_ids(model_dir, config, tokenizer, generation_config_cls) -> frozenset[int]:
    """EOS ids as `generate()` sees them: generation_config first (it may list several), then config, tokenizer."""
    try:
        found = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:
        found = None
    for source in (found, getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            return frozenset(source if isinstance(source, (list, tuple)) else [source])
    return frozenset()
