"""Token limits: defaults from the model, and checks that they are consistent (the warmup batch they imply is the
transport's: router/transport/connect.py).

Every valid request must fit an empty server on its own (input ≤ prefill budget, input + new tokens ≤ total
budget); otherwise it would wait in the queue for ever. The checks here make that true at startup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from conveyor.config import Config

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


def resolve_limits(args: Config, max_position_embeddings: int, tokenizer) -> ResolvedLimits:
    """`max_position_embeddings`: the model's, as rank 0 reports it (0: unknown, the tokenizer's then)."""
    model_max = max_position_embeddings or getattr(tokenizer, "model_max_length", 0) or 0
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
