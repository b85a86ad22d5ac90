"""Draft tokens from a second model on the shard: a smaller sibling with the same tokenizer, or the target itself
loaded again quantized (`--speculate-model self --speculate-quantize int4`: the same answers mostly, a quarter of
the bytes to read per drafted token).

The draft keeps its own KV pool over the same block ids as the target's, so one block table (the router's) serves
both and the router's pool accounting counts both (the shard sizes its pool by their bytes per block together).
Each request remembers how far the draft's KV has got (`RequestState.draft_len`): a proposal first feeds the draft
what it has not seen (the whole prompt the first time, after a preemption or a cached prefix; usually the one or two
tokens the last step accepted), then one token per draft position, always its greedy choice. A greedy draft is a
point mass, which is what keeps verification exact (see `verification.verify`). Draft KV is only ever a guess: a wrong
value can cost acceptances, never a wrong token.
"""

from __future__ import annotations

import torch

from conveyor.shard.batch.request_state import RequestState
from conveyor.shard.layers.attention import KVCache
from conveyor.shard.sampling.sampler import greedy


class DraftModel:
    def __init__(
        self,
        model: torch.nn.Module,
        forward,
        cache_shape: tuple[int, int, int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`forward`: the engine's flat forward (`Engine.forward`, given this model and pool); `cache_shape`:
        (layers, KV heads on this rank, head dim)."""
        self.model, self.forward, self._cache_shape = model, forward, cache_shape
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.cache: KVCache | None = None

    def bytes_per_block(self) -> int:
        layers, kv_heads, head_dim = self._cache_shape
        return KVCache.bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        layers, kv_heads, head_dim = self._cache_shape
        self.cache = KVCache.allocate(layers, num_blocks, self.block_size, kv_heads, head_dim, self.dtype, self.device)

    def propose(self, states: list[RequestState], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy draft tokens for each state (all decoding, their blocks reserved for them)."""
        drafts: list[list[int]] = [[] for _ in states]
        rows = [i for i, k in enumerate(limits) if k > 0]
        if not rows:
            return drafts
        feeds = {i: states[i].token_ids[states[i].draft_len :] for i in rows}  # ends with the row's next token
        while rows:
            chosen = self._step([states[i] for i in rows], [feeds[i] for i in rows])
            for i, token in zip(rows, chosen):
                drafts[i].append(token)
                feeds[i] = [token]
            rows = [i for i in rows if len(drafts[i]) < limits[i]]
        return drafts

    def _step(self, states: list[RequestState], feeds: list[list[int]]) -> list[int]:
        starts = [s.draft_len for s in states]
        lengths = [start + len(feed) for start, feed in zip(starts, feeds)]
        blocks, counts = [s.block_table for s in states], [1] * len(states)
        logits = self.forward(feeds, starts, blocks, lengths, counts, model=self.model, cache=self.cache)
        for state, length in zip(states, lengths):
            state.draft_len = length
        return greedy(logits)[0].tolist()


def settle(state: RequestState) -> None:
    """After verification: the draft's KV holds good only up to the tokens the target kept."""
    state.draft_len = min(state.draft_len, state.num_computed_tokens)
