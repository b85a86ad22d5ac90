"""Token masks of constrained requests (structured output), applied to a step's logits before sampling.

One bitmask tensor for the constrained rows of a step, filled by llguidance on its own threads (the GIL is
released), unpacked to booleans on the logits' device and applied with one masked fill. Unconstrained rows are
never touched, so they stay bit-for-bit what they would be in a batch without constraints. Every tensor-parallel
rank holds the same matchers and the same logits, so every rank masks alike and samples the same token.
"""

from __future__ import annotations

import time
from typing import Any

import torch

_BITS = torch.arange(32, dtype=torch.int32)


class Masks:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self._executor = None  # llguidance's thread pool, started at the first constrained step
        self._eos = sorted(eos_token_ids)

    def apply(self, logits: torch.Tensor, matchers: list[Any | None]) -> int:
        """Masks, in place, every row of `logits` [B, V] whose matcher is set; returns the nanoseconds spent."""
        rows = [row for row, m in enumerate(matchers) if m is not None]
        if not rows:
            return 0
        start = time.perf_counter_ns()
        if self._executor is None:
            # Not llguidance.torch: importing it compiles a kernel with torch.compile, a wait of seconds at the first
            # request.
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(matchers[row], n) for n, row in enumerate(rows)], bitmask.data_ptr(), words * 4, len(rows)
        )
        allowed = unpack(bitmask.to(logits.device), vocab)
        stuck = ~allowed.any(dim=-1)
        if stuck.any() and self._eos:
            # A matcher in an error state (a grammar past llguidance's limits) allows nothing; all -inf logits
            # would be NaN probabilities. EOS ends the request instead, and nobody else notices.
            allowed[stuck.nonzero().view(-1, 1), torch.tensor(self._eos, device=logits.device)] = True
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return time.perf_counter_ns() - start


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, ceil(V / 32)] int32 words, token t at bit t % 32 of word t // 32, to [N, V] booleans."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
