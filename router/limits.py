"""Token limits: defaults from the model, checks that they are consistent, and the warmup batch they imply.

Every valid request must fit an empty server on its own (input ≤ prefill budget, input + new tokens ≤ total
budget); otherwise it would wait in the queue for ever. The checks here make that true at startup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from conveyor.config import Config
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096
DEFAULT_PREFILL_TOKENS = 4096


@dataclass(frozen=True)
class Limits:
    """The token limits every request is validated against."""

    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_new_tokens_default: int | None = None  # None: default max_new_tokens = max_total_tokens - input_length


class LimitError(ValueError):
    pass


@dataclass(frozen=True)
class ResolvedLimits:
    validation: Limits
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int  # the KV pool's capacity: 0 until the warmup has sized it
    user_batch_total_tokens: int | None

    def with_capacity(self, capacity: int) -> ResolvedLimits:
        """Takes the KV capacity the shards measured at warmup as the token budget."""
        if self.user_batch_total_tokens is not None and self.user_batch_total_tokens != capacity:
            log.warning("using the warmup's KV capacity", extra={"capacity": capacity})
        if capacity < self.validation.max_total_tokens:
            raise LimitError(
                f"the KV cache holds {capacity} tokens, fewer than --max-total-tokens "
                f"{self.validation.max_total_tokens}"
            )
        return replace(self, max_batch_total_tokens=capacity)


def resolve_limits(args: Config, info: pb.InfoResponse, tokenizer) -> ResolvedLimits:
    model_max = info.max_position_embeddings or getattr(tokenizer, "model_max_length", 0) or 0
    max_total = args.max_total_tokens or min(model_max or DEFAULT_MAX_TOTAL_TOKENS, DEFAULT_MAX_TOTAL_TOKENS)
    max_input = args.max_input_tokens or max_total - 1
    prefill = args.max_batch_prefill_tokens or max(max_input, DEFAULT_PREFILL_TOKENS)
    if not 0 < max_input < max_total:
        raise LimitError(f"--max-input-tokens ({max_input}) must be below --max-total-tokens ({max_total})")
    if model_max and max_total > model_max:
        raise LimitError(f"--max-total-tokens ({max_total}) exceeds the model's {model_max} positions")
    if prefill < 1:
        raise LimitError(f"--max-batch-prefill-tokens ({prefill}) must be positive")
    if args.max_batch_total_tokens is not None and args.max_batch_total_tokens < max_total:
        raise LimitError(
            f"--max-batch-total-tokens ({args.max_batch_total_tokens}) must be >= --max-total-tokens ({max_total})"
        )
    return ResolvedLimits(
        validation=Limits(
            max_input_tokens=max_input,
            max_total_tokens=max_total,
            max_stop_sequences=args.max_stop_sequences,
            max_top_n_tokens=args.max_top_n_tokens,
        ),
        max_batch_prefill_tokens=prefill,
        max_batch_total_tokens=args.max_batch_total_tokens or 0,
        user_batch_total_tokens=args.max_batch_total_tokens,
    )


def warmup_request(limits: ResolvedLimits, tokenizer, again: bool = False) -> pb.WarmupRequest:
    """As many longest prompts as the prefill budget admits, each asking for two new tokens. `again`, after the
    shards restarted: one short prompt, and the pool asked for at the size the first warmup measured (the
    largest prefill takes many seconds on a CPU, and every stream waits for it)."""
    max_input = min(16, limits.validation.max_input_tokens) if again else limits.validation.max_input_tokens
    count = 1 if again else max(1, limits.max_batch_prefill_tokens // max_input)
    token = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[0]
    requests = [
        pb.Request(
            id=n,
            input_ids=[token] * max_input,
            parameters=pb.SamplingParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0),
            stopping_parameters=pb.StoppingParameters(max_new_tokens=2, ignore_eos_token=True),
        )
        for n in range(count)
    ]
    return pb.WarmupRequest(
        batch=pb.Batch(id=0, requests=requests, size=count),
        max_batch_total_tokens=limits.max_batch_total_tokens if again else limits.user_batch_total_tokens or 0,
    )
