"""A real `conveyor-shard` process driven over gRPC with the router's sharded client.

Prefill, Decode over joined batches and FilterBatch must keep every request exactly on its greedy path, and a
bad call must come back as a gRPC error while the shard keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import greedy_reference, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.launcher.processes import shard_healthy
from conveyor.router.pipeline.request import Parameters
from conveyor.router.transport import wire
from conveyor.router.transport.records import Batch, CachedBatch, NewRequest, RequestUpdate, Warmup
from conveyor.router.transport.shard_client import ShardedClient, ShardError
from conveyor.shard.service.watchdog import MIN_STEP_TIMEOUT
from conveyor.shard_channels import Security
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

BLOCKS_PER_REQUEST = 8  # request n gets blocks [8n, 8n + 8), 128 tokens with 16-token blocks


def start_shard(model: Path, uds: str, **env: str) -> subprocess.Popen:
    """A shard on its own (rank 0 of 1) at unix://{uds}-0, once it answers Health."""
    process = subprocess.Popen(
        [sys.executable, "-m", "conveyor.shard.main", "--model-id", str(model), "--shard-uds-path", uds],
        env=dict(os.environ, RANK="0", WORLD_SIZE="1", **env),
    )

    def healthy() -> bool:
        assert process.poll() is None, "the shard exited while loading"
        return shard_healthy(f"unix://{uds}-0", Security())

    try:
        wait_for(healthy, 120, "the shard to answer Health")
    except BaseException:
        process.kill()
        raise
    return process


@pytest.fixture(scope="module")
def shard(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    uds = str(tmp_path_factory.mktemp("uds") / "shard")
    process = start_shard(tiny_model, uds)
    yield f"unix://{uds}-0"
    process.terminate()
    assert process.wait(30) == 0


@pytest.fixture
async def client(shard: str, tokenizer) -> AsyncIterator[ShardedClient]:
    client = await ShardedClient.connect(shard)
    await client.clear_cache()
    rows = (1, 2, 5)
    warmup = Warmup(
        batch=batch(0, request(tokenizer, 0, "warm up", 2)), max_batch_total_tokens=1024, calibrate_rows=rows
    )
    warmed = await client.warmup(warmup)
    assert warmed.capacity == 1024  # the KV pool the router asked for, in 16-token blocks
    assert warmed.step_timeout == MIN_STEP_TIMEOUT  # none asked for: the shard's own choice, from a short warmup
    assert len(warmed.step_seconds) == len(rows) and min(warmed.step_seconds) > 0  # a decode step timed per count
    assert warmed.draft_step_seconds == 0.0  # no draft model
    yield client
    await client.close()


def request(tokenizer, n: int, prompt: str, max_new_tokens: int) -> NewRequest:
    """Request n, greedy; its KV blocks are the n-th run of BLOCKS_PER_REQUEST."""
    return NewRequest(
        id=n,
        input_ids=tokenizer(prompt).input_ids,
        parameters=Parameters(max_new_tokens=max_new_tokens, ignore_eos=True),
        blocks=range(n * BLOCKS_PER_REQUEST, (n + 1) * BLOCKS_PER_REQUEST),
    )


def batch(batch_id: int, *requests: NewRequest) -> Batch:
    return Batch(id=batch_id, requests=list(requests))


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


async def test_info_and_discovery(client: ShardedClient, shard: str) -> None:
    info = await client.info()
    assert info.engine == "paged" and info.dtype == "float32"
    assert info.block_size == 16
    assert info.model_type == "llama" and info.world_size == 1
    assert client.urls == [shard]


async def test_join_filter_and_decode_keep_each_request_on_its_greedy_path(
    client: ShardedClient, tokenizer, tiny_model: Path
) -> None:
    prompts = {0: ("def f(x):", 9), 1: ("import os\nimport sys", 9), 2: ("x", 9), 3: ("class A:\n    pass", 9)}
    got: dict[int, list[int]] = {n: [] for n in prompts}

    def record(result) -> CachedBatch | None:
        for g in result.generations:
            got[g.request_id].extend(g.tokens.ids)
        return result.batch

    first = record(await client.prefill(batch(1, *(request(tokenizer, n, *prompts[n]) for n in (0, 1)))))
    first = record(await client.decode([first]))
    second = record(await client.prefill(batch(2, *(request(tokenizer, n, *prompts[n]) for n in (2, 3)))))
    joined = record(await client.decode([first, second]))  # two cached batches, rows of different lengths, one step
    assert list(joined.request_ids) == [0, 1, 2, 3] and joined.id == 1
    kept = await client.filter_batch(joined.id, [3, 0])  # request 1 and 2 leave
    assert list(kept.request_ids) == [0, 3] and kept.size == 2  # rows keep the batch's order, not the call's
    for _ in range(3):
        kept = record(await client.decode([kept]))
    assert len(got[0]) == 6 and len(got[3]) == 5
    for n in (0, 3):
        reference = greedy_reference(tiny_model, *prompts[n])  # may end early on an EOS the requests ignore
        assert got[n][: len(reference)] == reference[: len(got[n])]
    await client.clear_cache(kept.id)


async def run_to_end(run, got: dict[int, list[int]], stop_after: int | None = None) -> list:
    """Reads a decode run to its end, recording tokens; asks it to stop after `stop_after` results."""
    results = []
    while (result := await run.next()) is not None:
        results.append(result)
        for g in result.generations:
            got[g.request_id].extend(g.tokens.ids)
        if stop_after is not None and len(results) == stop_after:
            await run.stop()
    run.close()
    return results


async def test_a_decode_run_steps_until_its_requests_finish_each_on_its_greedy_path(
    client: ShardedClient, tokenizer, tiny_model: Path
) -> None:
    prompts = {0: ("def f(x):", 4), 1: ("import os\nimport sys", 9)}
    got: dict[int, list[int]] = {n: [] for n in prompts}
    first = await client.prefill(batch(5, *(request(tokenizer, n, *prompts[n]) for n in prompts)))
    for g in first.generations:
        got[g.request_id].extend(g.tokens.ids)
    results = await run_to_end(await client.decode_run([first.batch], 50), got)
    assert len(results) == 8  # request 1's 8 tokens after its first; request 0 left after 3
    assert [list(r.batch.request_ids) for r in results[:3]] == [[0, 1], [0, 1], [1]]  # it left as it finished
    assert results[-1].batch is None  # all done: nothing left cached
    for n in prompts:
        assert len(got[n]) == prompts[n][1]
        reference = greedy_reference(tiny_model, *prompts[n])
        assert got[n][: len(reference)] == reference[: len(got[n])]


async def test_a_decode_run_ends_at_its_cap_or_when_asked_and_the_batch_decodes_on(
    client: ShardedClient, tokenizer, tiny_model: Path
) -> None:
    prompt = ("class A:\n    pass", 40)
    got: dict[int, list[int]] = {3: []}
    first = await client.prefill(batch(6, request(tokenizer, 3, *prompt)))
    got[3].extend(first.generations[0].tokens.ids)
    capped = await run_to_end(await client.decode_run([first.batch], 3), got)
    assert len(capped) == 3 and capped[-1].batch.request_ids == [3]
    stopped = await run_to_end(await client.decode_run([capped[-1].batch], 30), got, stop_after=1)
    assert 1 <= len(stopped) < 30  # it ended after the step in progress when the stop came, long before its cap
    after = await client.decode([stopped[-1].batch])  # still cached, and where the run left it
    got[3].extend(after.generations[0].tokens.ids)
    assert len(got[3]) == 1 + 3 + len(stopped) + 1
    reference = greedy_reference(tiny_model, *prompt)
    assert got[3][: len(reference)] == reference[: len(got[3])]
    await client.clear_cache(after.batch.id)


async def test_bad_calls_are_grpc_errors_and_the_shard_serves_on(client: ShardedClient, tokenizer) -> None:
    with pytest.raises(ShardError, match="not cached"):
        await client.decode([CachedBatch(id=999, request_ids=[1], size=1)])
    with pytest.raises(ShardError, match="no input tokens"):
        await client.prefill(batch(5, NewRequest(id=1, input_ids=[], parameters=Parameters(max_new_tokens=1))))
    with pytest.raises(ShardError, match="outside the vocabulary"):
        await client.prefill(batch(6, NewRequest(id=1, input_ids=[10**6], parameters=Parameters())))
    too_long = request(tokenizer, 1, "x", 5)
    too_long.input_ids = [too_long.input_ids[-1]] * 130  # a prompt of 130 tokens > 8 blocks of 16
    with pytest.raises(ShardError, match="needs 130 KV slots"):
        await client.prefill(batch(8, too_long))
    with pytest.raises(ShardError, match="cache_len 9 and chunk_len 3"):
        await client.prefill(batch(9, NewRequest(1, [5] * 10, Parameters(), cache_len=9, chunk_len=3)))
    cached = (await client.prefill(batch(7, request(tokenizer, 1, "x", 5)))).batch
    with pytest.raises(ShardError, match="has no request 77"):
        await client.decode([cached], updates=[RequestUpdate(request_id=77)])
    with pytest.raises(ShardError, match="no requests"):
        await client.filter_batch(cached.id, [42])
    # The batch survived the bad filter, and the shard still generates.
    result = await client.decode([cached])
    assert [g.request_id for g in result.generations] == [1]
    await client.health()


async def test_steps_answer_each_message_as_its_unary_rpc_and_go_on_after_an_error(
    client: ShardedClient, shard: str, tokenizer, tiny_model: Path
) -> None:
    """The router's one open call for every step: a refused step is an error message with the unary RPC's status,
    a message that is neither step is refused, and the same call then serves a request on its greedy path."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    got: list[int] = []
    async with grpc.aio.insecure_channel(shard) as channel:
        call = pb_grpc.ShardStub(channel).Steps()
        await call.write(pb.StepRequest(decode=pb.DecodeRequest(batches=[pb.CachedBatch(id=999, request_ids=[1])])))
        refused = await call.read()
        assert refused.error.code == invalid and "not cached" in refused.error.message
        await call.write(pb.StepRequest())
        neither = await call.read()
        assert neither.error.code == invalid and "a prefill or a decode" in neither.error.message
        prefill = pb.PrefillRequest(batch=wire.batch_pb(batch(11, request(tokenizer, 2, "x", 4))))
        await call.write(pb.StepRequest(prefill=prefill))
        answer = (await call.read()).prefill
        while True:
            got.extend(t for g in answer.generations for t in g.tokens.ids)
            if not answer.HasField("batch"):
                break
            await call.write(pb.StepRequest(decode=pb.DecodeRequest(batches=[answer.batch])))
            answer = (await call.read()).decode
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    reference = greedy_reference(tiny_model, "x", 4)
    assert len(got) == 4 and got[: len(reference)] == reference
    with pytest.raises(ShardError) as error:  # the router's client reads the error message as the unary status
        await client.decode([CachedBatch(id=998, request_ids=[1], size=1)])
    assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT


async def test_a_stopping_shard_ends_an_open_steps_call_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    """The router keeps its Steps call open between steps; a shard told to stop ends that call between two messages
    (status OK) instead of holding it, and itself, until the server's grace runs out and cancels it."""
    uds = str(tmp_path / "shard")
    process = start_shard(tiny_model, uds)
    try:
        async with grpc.aio.insecure_channel(f"unix://{uds}-0") as channel:
            call = pb_grpc.ShardStub(channel).Steps()
            await call.write(pb.StepRequest())
            assert (await call.read()).error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # the call is open
            process.send_signal(signal.SIGTERM)
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        assert process.wait(60) == 0
    finally:
        process.kill()


async def test_a_failed_grpc_call_has_invalid_argument_status(shard: str, tokenizer) -> None:
    warmup = Warmup(batch=batch(0, request(tokenizer, 0, "warm up", 2)), calibrate_rows=(1, 100_000))
    async with grpc.aio.insecure_channel(shard) as channel:
        stub = pb_grpc.ShardStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.FilterBatch(pb.FilterBatchRequest(batch_id=12345))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Warmup(wire.warmup_pb(warmup))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "calibrate_rows" in error.value.details()


HANG_PROMPT = "stuck forever"


def health_status(url: str, service: str = "") -> int:
    with Security().channel(url) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def probe(url: str, *flags: str) -> int:
    return subprocess.run([sys.executable, "-m", "conveyor.shard.probe", url, *flags], timeout=60).returncode


async def test_a_stuck_forward_turns_health_not_serving_and_the_probe_kills_it(
    tiny_model: Path, tokenizer, tmp_path: Path
) -> None:
    """The event loop answers while the forward thread is stuck (a failpoint hangs it): past the step deadline the
    shard must stop saying SERVING, on both health services, so that a supervisor restarts it."""
    hang_token = tokenizer(HANG_PROMPT).input_ids[-1]
    uds = str(tmp_path / "shard")
    process = start_shard(tiny_model, uds, CONVEYOR_FAILPOINT_HANG_ON_TOKEN=str(hang_token))
    url = f"unix://{uds}-0"
    client = await ShardedClient.connect(url)
    try:
        warmup = Warmup(batch=batch(0, request(tokenizer, 0, "warm up", 2)), step_timeout=1.0)
        warmed = await client.warmup(warmup)
        assert warmed.step_timeout == 1.0 and warmed.step_seconds == ()  # the deadline asked for; no timing asked
        await client.health()
        assert health_status(url) == health_status(url, "conveyor.v1.Shard") == health_pb2.HealthCheckResponse.SERVING
        assert probe(url) == 0 and probe(url, "--stuck-only") == 0

        stuck = asyncio.create_task(client.prefill(batch(1, request(tokenizer, 1, HANG_PROMPT, 4))))
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        # In a thread: the event loop must go on, to send the prefill.
        await asyncio.to_thread(wait_for, lambda: health_status(url) == not_serving, 60, "health to turn NOT_SERVING")
        assert health_status(url, "conveyor.v1.Shard") == not_serving
        with pytest.raises(ShardError, match="past the step timeout of 1 s"):
            await client.health()
        assert not stuck.done()  # still stuck: only a restart helps

        assert probe(url) == 1 and probe(url, "--stuck-only") == 1
        assert process.poll() is None
        assert probe(url, "--kill-if-stuck") == 1
        assert process.wait(30) == -signal.SIGKILL
        with pytest.raises(ShardError):
            await stuck
    finally:
        process.kill()
        process.wait()
        await client.close()


async def test_a_shard_that_does_not_answer_fails_the_probe_unless_stuck_only(tmp_path: Path) -> None:
    """Still loading, or being restarted: not ready, but not stuck either (a liveness probe must not kill it)."""
    nowhere = f"unix://{tmp_path / 'nobody'}"
    assert probe(nowhere) == 1
    assert probe(nowhere, "--stuck-only", "--kill-if-stuck") == 0
