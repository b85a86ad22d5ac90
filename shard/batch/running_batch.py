"""A cached batch: the requests of one running batch, in row order, and the sampler of its decoding rows. No KV.

Decoding rows come first and share one `Sampler`; prefilling rows (still reading their prompt in chunks) come
last and join the sampler at the step that ends their prompt. Keeping that order makes the sampler's rows the
batch's first rows at every moment, so neither filtering nor joining ever touches KV or penalty counts out of
line. Everything else about a request (its block table, its KV length, its chunk) is on its `RequestState`.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.shard.batch.request_state import BadRequest, RequestState
from conveyor.shard.sampling.sampler import Sampler
from conveyor.v1 import shard_pb2 as pb


@dataclass
class RunningBatch:
    id: int
    requests: list[RequestState]  # decoding rows, then prefilling rows
    sampler: Sampler | None  # decoding rows only; None when there are none

    @classmethod
    def from_pb(cls, batch: pb.Batch, states: list[RequestState]) -> RunningBatch:
        """New requests: all prefilling, from their cached prefix on."""
        return cls(batch.id, states, None)

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def decoding(self) -> list[RequestState]:
        return [r for r in self.requests if r.is_decoding]

    @property
    def prefilling(self) -> list[RequestState]:
        return [r for r in self.requests if not r.is_decoding]

    def to_pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(id=self.id, request_ids=[r.id for r in self.requests], size=self.size)

    def update(self, updates: list[pb.RequestUpdate]) -> None:
        """Grows block tables and sets this step's prompt chunks and draft budgets; rows not named read nothing
        and draft nothing."""
        index = {r.id: r for r in self.requests}
        for state in self.requests:
            state.chunk_len = state.speculate = 0
        for update in updates:
            if (state := index.get(update.request_id)) is None:
                raise BadRequest(f"batch {self.id} has no request {update.request_id} to update")
            state.update(update)

    def filter(self, request_ids: list[int]) -> RunningBatch:
        """Keeps the listed requests (decoding ones first, as always); KeyError names any the batch lacks."""
        index = {r.id: row for row, r in enumerate(self.requests)}
        missing = [i for i in request_ids if i not in index]
        if missing:
            raise KeyError(f"batch {self.id} has no requests {missing}")
        rows = sorted(index[i] for i in request_ids)
        decoding = [row for row in rows if self.requests[row].is_decoding]
        sampler = self.sampler.filter(decoding) if decoding and self.sampler is not None else None
        return RunningBatch(self.id, [self.requests[row] for row in rows], sampler)

    @classmethod
    def concatenate(cls, batches: list[RunningBatch]) -> RunningBatch:
        """Decoding rows of every batch, then prefilling rows of every batch; the id is the first batch's."""
        if len(batches) == 1:
            return batches[0]
        samplers = [b.sampler for b in batches if b.sampler is not None]
        return cls(
            batches[0].id,
            [r for b in batches for r in b.decoding] + [r for b in batches for r in b.prefilling],
            Sampler.concatenate(samplers) if samplers else None,
        )

    def start_decoding(self, ending: list[RequestState], sampler: Sampler) -> None:
        """Requests that read the end of their prompt this step (their `next_token` now set) move to the end of
        the decoding rows, and their sampler joins the batch's."""
        moving = {id(r) for r in ending}
        decoding = [r for r in self.requests if r.is_decoding and id(r) not in moving]
        staying = [r for r in self.requests if not r.is_decoding]
        self.requests = decoding + ending + staying
        self.sampler = sampler if self.sampler is None else Sampler.concatenate([self.sampler, sampler])
