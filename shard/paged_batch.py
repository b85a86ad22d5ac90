"""The paged engine's batch state: plain bookkeeping per request, no KV.

A batch holds two kinds of rows. *Decoding* rows have read their whole prompt and feed one token per step;
they come first and share one `Sampler`. *Prefilling* rows are still reading their prompt in chunks (chunked
prefill) and sample nothing until the chunk that ends the prompt; they come last and join the sampler then.
Keeping that order makes the sampler's rows the first `decoding` rows of the batch at every moment, so neither
filtering nor joining ever touches KV or penalty counts out of line.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.shard.requests import BadRequest, RequestState, rows_of
from conveyor.shard.sampling import Sampler
from conveyor.v1 import shard_pb2 as pb


@dataclass
class PagedBatch:
    id: int
    requests: list[RequestState]
    blocks: list[list[int]]  # each request's block table, as the router allocated it
    lengths: list[int]  # tokens whose KV is in the cache, per request
    next_ids: list[int]  # decoding rows: the token fed next
    sampler: Sampler | None  # decoding rows only; None when there are none
    block_size: int
    chunks: list[int]  # prefilling rows: prompt tokens to read at the next step

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def decoding(self) -> int:
        return len(self.next_ids)

    def to_pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(
            id=self.id,
            request_ids=[r.id for r in self.requests],
            size=self.size,
            max_tokens=sum(len(b) for b in self.blocks) * self.block_size,
            current_tokens=self.decoding + sum(self.chunks),
        )

    @classmethod
    def prefilling(cls, batch_id: int, states: list[RequestState], batch_pb: pb.Batch, block_size: int) -> "PagedBatch":
        """New requests: all prefilling, from their cached prefix on, reading `chunk_len` (or all) at first."""
        lengths, chunks = [], []
        for state, request in zip(states, batch_pb.requests):
            start, prompt = request.cache_len, len(state.input_ids)
            chunk = request.chunk_len if request.HasField("chunk_len") else prompt - start
            if not 0 <= start < prompt or not 0 < chunk <= prompt - start:
                raise BadRequest(f"request {state.id}: cache_len {start} and chunk_len {chunk} do not fit "
                                 f"its {prompt} input tokens")  # fmt: skip
            if state.prefill_logprobs and (start or chunk < prompt):
                raise BadRequest(f"request {state.id}: prompt logprobs need the whole prompt in one chunk")
            lengths.append(start)
            chunks.append(chunk)
        blocks = [list(r.blocks) for r in batch_pb.requests]
        return cls(batch_id, states, blocks, lengths, [], None, block_size, chunks)

    def update(self, updates: list[pb.RequestUpdate]) -> None:
        """Grows block tables and sets this step's prompt chunks; prefilling rows not named read nothing."""
        index = {r.id: i for i, r in enumerate(self.requests)}
        self.chunks = [0] * (self.size - self.decoding)
        for update in updates:
            row = index.get(update.request_id)
            if row is None:
                raise BadRequest(f"batch {self.id} has no request {update.request_id} to update")
            self.blocks[row].extend(update.new_blocks)
            if update.chunk_len:
                if row < self.decoding:
                    raise BadRequest(f"request {update.request_id} has read its prompt: no chunk to give it")
                if self.lengths[row] + update.chunk_len > len(self.requests[row].input_ids):
                    raise BadRequest(f"request {update.request_id}: chunk_len {update.chunk_len} runs past its prompt")
                self.chunks[row - self.decoding] = update.chunk_len

    def filter(self, request_ids: list[int]) -> "PagedBatch":
        rows = rows_of(self.requests, request_ids, self.id)
        decoding = [r for r in rows if r < self.decoding]
        prefilling = [r for r in rows if r >= self.decoding]
        order = decoding + prefilling
        return PagedBatch(
            self.id,
            [self.requests[r] for r in order],
            [self.blocks[r] for r in order],
            [self.lengths[r] for r in order],
            [self.next_ids[r] for r in decoding],
            self.sampler.filter(decoding) if decoding and self.sampler is not None else None,
            self.block_size,
            [self.chunks[r - self.decoding] for r in prefilling],
        )

    @classmethod
    def concatenate(cls, batches: list["PagedBatch"]) -> "PagedBatch":
        """Decoding rows of every batch, then prefilling rows of every batch; the id is the first batch's."""
        if len(batches) == 1:
            return batches[0]

        def rows(b: "PagedBatch", decoding: bool) -> range:
            return range(b.decoding) if decoding else range(b.decoding, b.size)

        parts = [(b, r) for decoding in (True, False) for b in batches for r in rows(b, decoding)]
        samplers = [b.sampler for b in batches if b.sampler is not None]
        return cls(
            batches[0].id,
            [b.requests[r] for b, r in parts],
            [b.blocks[r] for b, r in parts],
            [b.lengths[r] for b, r in parts],
            [t for b in batches for t in b.next_ids],
            Sampler.concatenate(samplers) if samplers else None,
            batches[0].block_size,
            [c for b in batches for c in b.chunks],
        )

    def start_decoding(self, rows: list[int], next_ids: list[int], sampler: Sampler) -> None:
        """Prefilling rows that read the end of their prompt this step move to the end of the decoding rows."""
        moving = set(rows)
        staying = [r for r in range(self.decoding, self.size) if r not in moving]
        order = list(range(self.decoding)) + rows + staying
        self.requests = [self.requests[r] for r in order]
        self.blocks = [self.blocks[r] for r in order]
        self.lengths = [self.lengths[r] for r in order]
        self.next_ids = self.next_ids + next_ids
        self.sampler = sampler if self.sampler is None else Sampler.concatenate([self.sampler, sampler])
        self.chunks = [0] * len(staying)
