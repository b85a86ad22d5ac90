"""A step's result handed over: each new token to its sequence (recorded, for the planner's prefix cache, and
streamed at once), a prompt-only request's pooled answer, what each sequence's drafts and disk-tier hits count
towards its usage, and the step's timings to the metrics. The scheduler (router/core/scheduler.py) delivers every
step it applies."""

from __future__ import annotations

from conveyor.router.core.events import events_from_generation, pooled_event
from conveyor.router.core.sequence import Sequence, SequenceStatus
from conveyor.router.core.step_planner import StepPlanner
from conveyor.router.metrics import Metrics
from conveyor.router.transport.records import StepResult


class Delivery:
    """Delivers the results of one group's steps to the sequences its planner runs, and to the metrics."""

    def __init__(self, planner: StepPlanner, metrics: Metrics, group: int) -> None:
        self.planner = planner
        self.metrics = metrics
        self.group = group  # the label of the group's speculative acceptance gauge

    def deliver(self, result: StepResult) -> None:
        """Records each running sequence's new tokens and streams them; a generation for a sequence no longer
        running (it left the batch meanwhile) is dropped. A cancelled sequence records its tokens, streams none."""
        by_id = {s.id: s for s in self.planner.running}
        for generation in result.generations:
            sequence = by_id.get(generation.request_id)
            if sequence is None:
                continue
            if not sequence.generated_ids:
                _count_disk_hits(sequence, generation.disk_cached_tokens)
            if generation.pooled:  # a prompt-only request, finished: no tokens, no drafts
                if not sequence.cancelled:
                    sequence.events.put_nowait(pooled_event(generation, sequence.cached_prompt_tokens))
                    sequence.status = SequenceStatus.FINISHED
                continue
            sequence.generated_ids.extend(generation.tokens.ids)
            self._count_drafts(sequence, generation.drafted, len(generation.tokens.ids) - 1)
            if sequence.cancelled:
                continue
            counts = (sequence.drafted_tokens, sequence.accepted_tokens, sequence.cached_prompt_tokens)
            for event in events_from_generation(generation, *counts):
                sequence.events.put_nowait(event)
                if event.finished is not None:
                    sequence.status = SequenceStatus.FINISHED

    def observe(self, result: StepResult, method: str = "decode") -> None:
        """The step's time inside the slowest shard, its token masks' share, and its disk tier's reads and size."""
        metrics, timings = self.metrics, result.timings
        metrics.shard_step.observe(timings.total_ns / 1e9)
        metrics.tgi.forward.labels(method).observe(timings.total_ns / 1e9)
        if timings.mask_ns:
            metrics.grammar_mask.observe(timings.mask_ns / 1e9)
        if timings.disk_loaded_tokens:
            metrics.prefix_cache_disk_hits.inc(timings.disk_loaded_tokens)
            metrics.prefix_cache_disk_load.observe(timings.disk_load_ns / 1e9)
        if timings.disk_bytes is not None:
            metrics.kv_offload_bytes.set(timings.disk_bytes)
            metrics.kv_offload_skipped.set(timings.disk_skipped_files)

    def _count_drafts(self, sequence: Sequence, drafted: int, accepted: int) -> None:
        """Every step a sequence made tokens in: what it drafted feeds its acceptance record (a step without
        drafts counts towards its next probe)."""
        drafts = self.planner.drafts
        if drafts is not None:
            drafts.record(sequence.draft_record, drafted, accepted)
            self.metrics.speculative_acceptance.labels(group=str(self.group)).set(drafts.pooled_rate)
        if not drafted:
            return
        sequence.drafted_tokens += drafted
        sequence.accepted_tokens += accepted
        self.metrics.speculative_drafted.inc(drafted)
        self.metrics.speculative_accepted.inc(accepted)
        self.metrics.speculative_steps.inc()


def _count_disk_hits(sequence: Sequence, disk_tokens: int) -> None:
    """Its first token came: the prompt tokens the shards read from their disk tier for it come with it (the
    planner counted those it found in memory), so usage reports both tiers' hits."""
    sequence.cached_prompt_tokens = min(sequence.num_prompt_tokens, sequence.cached_prompt_tokens + disk_tokens)
