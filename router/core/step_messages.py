"""What the shards learn of each sequence at a step: a joining one as a `NewRequest`, a running one's growth as a
`RequestUpdate`. The scheduler (router/core/scheduler.py) puts them into the step's one RPC."""

from __future__ import annotations

from conveyor.router.core.sequence import Sequence
from conveyor.router.core.step_planner import StepPlan
from conveyor.router.transport.records import NewRequest, RequestUpdate


def new_request(sequence: Sequence) -> NewRequest:
    """The sequence as a shard gets it when it joins: a resumed one (after a preemption) brings the tokens it
    generated; its prefix-cache hit is the KV it starts with, and `step_tokens` the first chunk it reads."""
    p = sequence.request.parameters
    return NewRequest(
        id=sequence.id,
        input_ids=sequence.token_ids,
        parameters=p,
        resumed_tokens=len(sequence.generated_ids),
        prefill_logprobs=p.decoder_input_details and not sequence.generated_ids,
        blocks=sequence.block_table,
        cache_len=sequence.num_computed_tokens,
        chunk_len=sequence.step_tokens,
        cache_scope=sequence.cache_scope.digest(),
        pooling=sequence.request.pooling,
    )


def step_updates(plan: StepPlan) -> list[RequestUpdate]:
    """What the shards learn with the step of each running sequence: blocks it grew into, the chunk it reads, the
    drafts it may have verified. A sequence with none of those is left out (the shards keep what they know)."""
    return [_update(s) for s in plan.running if s.step_new_blocks or s.is_prefilling or s.step_drafts]


def _update(sequence: Sequence) -> RequestUpdate:
    chunk = sequence.step_tokens if sequence.is_prefilling else 0
    return RequestUpdate(
        request_id=sequence.id, new_blocks=sequence.step_new_blocks, chunk_len=chunk, speculate=sequence.step_drafts
    )
