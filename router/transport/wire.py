"""The shard protocol's records (records.py) to its protobuf messages and back: the only place in the router that
builds or reads a `shard_pb2` message, the shard client's calls aside.

Reading a step's answer copies fields, never tokens: a record's token lists are the message's repeated fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from conveyor.router.pipeline.request import Parameters, Pooling
from conveyor.router.transport.records import (
    Batch,
    CachedBatch,
    GeneratedText,
    Generation,
    NewRequest,
    RequestUpdate,
    ShardAdapter,
    ShardInfo,
    StepResult,
    Timings,
    Tokens,
    Warmup,
)
from conveyor.v1 import shard_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}
NO_TOKENS = Tokens()  # a generation's prefill tokens, unless it asked for them at its first step

# --- to the shards ------------------------------------------------------------------------------------------------


def sampling_pb(p: Parameters) -> pb.SamplingParameters:
    """Every sampling field under its own name (the proto uses the router's names, so a new sampling parameter
    needs nothing here); `do_sample` is the resolved rule, and a greedy request's seed is 0."""
    values = {f.name: getattr(p.sampling, f.name) for f in pb.SamplingParameters.DESCRIPTOR.fields}
    values.update(do_sample=p.sampling.samples, seed=p.seed or 0)
    return pb.SamplingParameters(**values)


def request_pb(r: NewRequest) -> pb.Request:
    p = r.parameters
    return pb.Request(
        id=r.id,
        input_ids=r.input_ids,
        resumed_tokens=r.resumed_tokens,
        parameters=sampling_pb(p),
        stopping_parameters=pb.StoppingParameters(
            max_new_tokens=p.max_new_tokens, stop_sequences=p.stop, ignore_eos_token=p.ignore_eos
        ),
        prefill_logprobs=r.prefill_logprobs,
        top_n_tokens=p.top_n_tokens,
        blocks=r.blocks,
        cache_len=r.cache_len,
        chunk_len=r.chunk_len,  # None leaves it unset: the whole prompt
        grammar=p.grammar.grammar if p.grammar is not None else "",
        adapter=p.adapter or "",
        cache_scope=r.cache_scope,
        pooling=None if r.pooling is None else pooling_pb(r.pooling),
        images=[
            pb.Image(offset=i.offset, length=i.length, pixel_values=i.pixel_values, shape=i.shape) for i in p.images
        ],
    )


def pooling_pb(p: Pooling) -> pb.Pooling:
    if p.task == "rerank":
        return pb.Pooling(score=pb.Pooling.Score(yes_token_id=p.yes_token_id, no_token_id=p.no_token_id))
    return pb.Pooling(embed=pb.Pooling.Embed(mode=p.mode, normalize=p.normalize))


def batch_pb(batch: Batch) -> pb.Batch:
    requests = [request_pb(r) for r in batch.requests]
    return pb.Batch(id=batch.id, requests=requests, size=len(requests))


def cached_batch_pb(batch: CachedBatch) -> pb.CachedBatch:
    return pb.CachedBatch(id=batch.id, request_ids=batch.request_ids, size=batch.size)


def updates_pb(updates: Iterable[RequestUpdate]) -> list[pb.RequestUpdate]:
    return [
        pb.RequestUpdate(request_id=u.request_id, new_blocks=u.new_blocks, chunk_len=u.chunk_len, speculate=u.speculate)
        for u in updates
    ]


def prefill_pb(batch: Batch, cached_batch: CachedBatch | None, updates: Iterable[RequestUpdate]) -> pb.PrefillRequest:
    cached = None if cached_batch is None else cached_batch_pb(cached_batch)
    return pb.PrefillRequest(batch=batch_pb(batch), cached_batch=cached, updates=updates_pb(updates))


def decode_pb(batches: Iterable[CachedBatch], updates: Iterable[RequestUpdate]) -> pb.DecodeRequest:
    return pb.DecodeRequest(batches=[cached_batch_pb(b) for b in batches], updates=updates_pb(updates))


def warmup_pb(warmup: Warmup) -> pb.WarmupRequest:
    return pb.WarmupRequest(
        batch=batch_pb(warmup.batch),
        max_batch_total_tokens=warmup.max_batch_total_tokens,
        step_timeout=warmup.step_timeout,
        calibrate_rows=warmup.calibrate_rows,
    )


# --- from the shards ----------------------------------------------------------------------------------------------


def tokens(t: pb.Tokens) -> Tokens:
    return Tokens(t.ids, t.logprobs, t.texts, t.is_special)


def generation(g: pb.Generation) -> Generation:
    finished = None
    if g.HasField("finished"):
        f = g.finished
        seed = f.seed if f.HasField("seed") else None
        finished = GeneratedText(f.text, f.generated_tokens, FINISH_REASONS[f.finish_reason], seed)
    return Generation(
        request_id=g.request_id,
        tokens=tokens(g.tokens),
        prefill_tokens=tokens(g.prefill_tokens) if g.HasField("prefill_tokens") else NO_TOKENS,
        top_tokens=[tokens(t) for t in g.top_tokens],
        finished=finished,
        drafted=g.drafted,
        disk_cached_tokens=g.disk_cached_tokens,
        embedding=g.embedding,
        score=g.score if g.HasField("score") else None,
    )


def cached_batch(batch: pb.CachedBatch) -> CachedBatch:
    return CachedBatch(batch.id, list(batch.request_ids), batch.size)


def timings(t: pb.Timings) -> Timings:
    return Timings(
        total_ns=t.total_ns,
        mask_ns=t.mask_ns,
        disk_loaded_tokens=t.disk_loaded_tokens,
        disk_load_ns=t.disk_load_ns,
        disk_bytes=t.disk_bytes if t.HasField("disk_bytes") else None,
        disk_skipped_files=t.disk_skipped_files,
    )


def step_result(responses: list[Any]) -> StepResult:
    """Every rank's answer to one step (a PrefillResponse or DecodeResponse each): rank 0's tokens and batch, the
    slowest rank's timings."""
    first = responses[0]
    slowest = max(responses, key=lambda r: r.timings.total_ns)
    return StepResult(
        generations=[generation(g) for g in first.generations],
        batch=cached_batch(first.batch) if first.HasField("batch") else None,
        timings=timings(slowest.timings),
    )


def adapter(a: pb.Adapter) -> ShardAdapter:
    return ShardAdapter(a.name, a.source, a.rank, a.weight_bytes)


def shard_info(info: pb.InfoResponse) -> ShardInfo:
    return ShardInfo(
        dtype=info.dtype,
        device_type=info.device_type,
        block_size=info.block_size,
        engine=info.engine,
        model_type=info.model_type,
        max_position_embeddings=info.max_position_embeddings,
        world_size=info.world_size,
        pid=info.pid,
        rank=info.rank,
        instance=info.instance,
        weight_bytes=info.weight_bytes,
        quantize=info.quantize,
        adapters=tuple(adapter(a) for a in info.adapters),
        max_loras=info.max_loras,
        kv_cache_dtype=info.kv_cache_dtype,
        kv_offload_max_bytes=info.kv_offload_max_bytes,
    )
