"""The shard protocol's messages as the router reads and writes them: plain records, no protobuf.

The shard client takes and returns these, and `wire.py` turns them into the proto's messages and back, so the core
(and anything else above the transport) never sees the wire format. They live here rather than in the core because
the core stands on the transport: the transport's own words are the ones both can import.

A step's records are built once per step and their token lists are the messages' own (no copy): what a step costs
per token is what reading the message costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.router.pipeline.request import Parameters, Pooling


@dataclass(slots=True)
class NewRequest:
    """A request as a shard gets it when it joins the batch: a resumed one (after a preemption) brings the tokens it
    generated at the end of `input_ids`; its prefix-cache hit is the KV it starts with (`cache_len`), and
    `chunk_len` the first chunk it reads (None: the whole prompt)."""

    id: int
    input_ids: Sequence[int]
    parameters: Parameters  # sampling, stopping, top-n tokens, grammar and adapter
    resumed_tokens: int = 0
    prefill_logprobs: bool = False
    blocks: Sequence[int] = ()
    cache_len: int = 0
    chunk_len: int | None = None
    cache_scope: str = ""  # CacheScope.digest(): whose cached KV it may share
    pooling: Pooling | None = None  # a prompt-only request: a vector or a score instead of tokens


@dataclass(slots=True)
class Batch:
    """Requests joining at one step, under a new batch id."""

    id: int
    requests: list[NewRequest]


@dataclass(slots=True)
class CachedBatch:
    """A batch the shards hold: its id and its requests, in the shards' row order."""

    id: int
    request_ids: list[int]
    size: int


@dataclass(slots=True)
class RequestUpdate:
    """What the shards learn with a step of a running request: the blocks it grew into, the chunk of its prompt it
    reads (0: it decodes), the most draft tokens it may have verified."""

    request_id: int
    new_blocks: Sequence[int] = ()
    chunk_len: int = 0
    speculate: int = 0


@dataclass(slots=True)
class Tokens:
    """Parallel lists, one entry per token."""

    ids: Sequence[int] = ()
    logprobs: Sequence[float] = ()
    texts: Sequence[str] = ()
    is_special: Sequence[bool] = ()


@dataclass(slots=True)
class GeneratedText:
    """A request's end, on its last generation."""

    text: str
    generated_tokens: int
    finish_reason: str  # length | eos_token | stop_sequence
    seed: int | None


@dataclass(slots=True)
class Generation:
    """One request's tokens from one step: usually one; with drafts, the accepted ones and the next."""

    request_id: int
    tokens: Tokens
    prefill_tokens: Tokens = field(default_factory=Tokens)  # the prompt's logprobs, at its first step if asked
    top_tokens: list[Tokens] = field(default_factory=list)  # per token, the most likely alternatives if asked
    finished: GeneratedText | None = None
    drafted: int = 0  # draft tokens verified at this step
    disk_cached_tokens: int = 0  # with the prompt's first token: prompt tokens the shards read from the disk tier
    embedding: Sequence[float] = ()  # a prompt-only request's answer, when it finishes: its pooled vector...
    score: float | None = None  # ...or its score (the reranker's yes-minus-no logit)

    @property
    def pooled(self) -> bool:
        """Whether it is a prompt-only request's answer (no tokens)."""
        return bool(self.embedding) or self.score is not None


@dataclass(slots=True)
class Timings:
    """The step inside the slowest rank."""

    total_ns: int = 0
    mask_ns: int = 0  # building grammar token masks
    disk_loaded_tokens: int = 0  # prefix-cache hits read from the disk tier...
    disk_load_ns: int = 0  # ...and the time they took
    disk_bytes: int | None = None  # the disk tier's size, when the step looked at it
    disk_skipped_files: int = 0


@dataclass(slots=True)
class StepResult:
    generations: list[Generation]
    batch: CachedBatch | None  # None: every request of the batch finished
    timings: Timings


@dataclass(slots=True)
class Warmup:
    """The largest step the limits allow, which sizes the KV pool (`max_batch_total_tokens`: 0 lets the shards
    choose), the step deadline asked for (0.0: the shards choose), and the row counts at which to time a decode
    step (none: no timing)."""

    batch: Batch
    max_batch_total_tokens: int = 0
    step_timeout: float = 0.0
    calibrate_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class Calibration:
    """A decode step's seconds at each of `rows` (one sequence, rows-1 drafts verified) and a draft-model step's
    (0.0: prompt lookup), as the shards timed them at warmup."""

    rows: tuple[int, ...]
    step_seconds: tuple[float, ...]
    draft_step_seconds: float = 0.0


@dataclass(frozen=True)
class Warmed:
    """What the shards' warmup found: the KV capacity in tokens the smallest rank supports, the step deadline
    (the longest any rank chose), and, when asked, a decode step's seconds at each row count and a draft-model
    step's (the slowest rank's)."""

    capacity: int
    step_timeout: float
    step_seconds: tuple[float, ...] = ()
    draft_step_seconds: float = 0.0


@dataclass(frozen=True)
class ShardAdapter:
    """A LoRA adapter a rank holds."""

    name: str
    source: str
    rank: int
    weight_bytes: int


@dataclass(frozen=True)
class ShardInfo:
    """What a rank says of itself and its model (`Info`)."""

    dtype: str = ""
    device_type: str = ""
    block_size: int = 0  # tokens per KV block
    engine: str = ""
    model_type: str = ""
    max_position_embeddings: int = 0
    world_size: int = 0
    pid: int = 0
    rank: int = 0
    instance: str = ""  # changes when the process does: another means the rank was restarted
    weight_bytes: int = 0
    quantize: str = ""
    adapters: tuple[ShardAdapter, ...] = ()
    max_loras: int = 0
    kv_cache_dtype: str = ""
    kv_offload_max_bytes: int = 0
