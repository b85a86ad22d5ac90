"""A shard group that crashes or hangs under load loses no request: the launcher restarts the group, the router
replays what was running, and every stream goes on where it stopped. The oracle is transformers' own
`generate()` for each prompt alone: a token repeated, skipped or changed by the replay would show there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from conftest import (
    ORACLE_PROMPTS,
    Deployments,
    Server,
    StreamWatcher,
    free_port,
    greedy_reference,
    start_server,
    used,
    wait_for,
)

# 16 greedy streams, long enough to be mid-way when the shards die; at most 8 run at once, so 8 are queued.
STREAMS = [(prompt, 24 + 2 * i) for i, (prompt, _) in enumerate(ORACLE_PROMPTS + ORACLE_PROMPTS[:2])]
MAX_BATCH = "8"
# A sampled stream: its replay must go on with the same random draws (each is seeded by position).
SEEDED = {
    "inputs": "def sample():",
    "parameters": {"max_new_tokens": 40, "do_sample": True, "seed": 7, "ignore_eos": True},
}
# Group restarts the kill-then-hang deployment allows: it heals from both, and the next death is one too many.
MAX_RESTARTS = 2
# The request that kills the shard every time, and those running when it first does.
CRASHER = "zebra quartz jukebox"
CRASHER_OTHERS = STREAMS[:6]


def _idle_and_whole(server: Server) -> bool:
    info = server.info()
    return info["status"] == "serving" and info["kv_blocks_free"] == info["kv_blocks_total"]


def _serve_through(server: Server, fault: Callable[[], None], restarts: int) -> None:
    """Starts every stream, injects `fault` once 8 are running, and checks the deployment heals: /health 503
    while the shards are down, 200 after, every stream complete and exact, every KV block free."""
    watchers = [StreamWatcher(server, {"inputs": p, "parameters": {"max_new_tokens": n}}) for p, n in STREAMS]
    seeded = StreamWatcher(server, SEEDED)
    watchers.insert(1, seeded)  # among the first admitted, so it is running when the fault comes
    with ThreadPoolExecutor(len(watchers)) as pool:
        futures = [pool.submit(w.run) for w in watchers]
        wait_for(lambda: sum(w.received(1) for w in watchers) >= 8, 120, "8 streams to be running")
        at_fault = [len(w.token_ids()) for w in watchers]
        fault()
        wait_for(lambda: server.health() == 503, 60, "/health to answer 503 while the shards are down")
        wait_for(lambda: server.health() == 200, 300, "/health to answer 200 again")
        for future in futures:
            future.result(timeout=300)
    greedy = [w for w in watchers if w is not seeded]
    for watcher, (prompt, max_new_tokens) in zip(greedy, STREAMS):
        assert watcher.token_ids() == greedy_reference(server.model_dir, prompt, max_new_tokens), prompt
        assert watcher.events[-1]["generated_text"] is not None
    alone = StreamWatcher(server, SEEDED)
    alone.run()
    assert seeded.token_ids() == alone.token_ids() and len(alone.token_ids()) == 40
    # The fault cut some streams mid-way (they had tokens and more were to come): those were replayed.
    assert any(0 < before < len(w.token_ids()) for w, before in zip(watchers, at_fault))
    assert server.metric("conveyor_shard_restarts_total") == restarts
    assert server.metric("conveyor_requests_replayed_total") >= restarts
    wait_for(lambda: _idle_and_whole(server), 60, "every KV block to be free")


def _crasher_token(model_dir: Path, crasher: str, others: list[tuple[str, int]]) -> int:
    """A token of the crasher's prompt found in no other prompt nor in any of their greedy continuations
    (replays send those back as input), so that only the crasher trips the failpoint."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seen = set()
    for prompt, n in others:
        seen.update(tokenizer(prompt).input_ids, greedy_reference(model_dir, prompt, n))
    return next(t for t in tokenizer(crasher).input_ids if t not in seen)


@pytest.fixture(scope="module")
def deployments(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Deployments]:
    """The module's deployments (a start takes many seconds on 2 cores): those the selected tests use start
    together."""
    wanted = used(request, ["restarting", "two_ranks", "crasher"], module=True)
    flags = ("--max-batch-size", MAX_BATCH, "--shard-step-timeout", "5", "--max-restarts", str(MAX_RESTARTS))
    starts = {
        "restarting": functools.partial(start_server, tiny_model, *flags),
        "two_ranks": functools.partial(
            start_server,
            tiny_model,
            "--num-shard",
            "2",
            "--master-port",
            str(free_port()),
            "--max-batch-size",
            MAX_BATCH,
        ),
    }
    if "crasher" in wanted:
        token = _crasher_token(tiny_model, CRASHER, CRASHER_OTHERS)
        # --max-request-retries 1, not the default 2: each replay costs a group restart, many seconds.
        env = {"CONVEYOR_FAILPOINT_EXIT_ON_TOKEN": str(token)}
        starts["crasher"] = functools.partial(start_server, tiny_model, "--max-request-retries", "1", env=env)
    deployments = Deployments(starts, wanted)
    yield deployments
    codes = deployments.stop()  # a test that ended one checked its exit code
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def restarting(deployments: Deployments) -> Callable[[], Server]:
    """A deployment that allows MAX_RESTARTS group restarts, shared by the kill-then-hang test (which spends them)
    and the past-max-restarts test (which ends it). Started again for a test that finds it ended, so neither
    depends on the other's running first."""
    return lambda: deployments.get("restarting")


@pytest.fixture(scope="module")
def two_ranks(deployments: Deployments) -> Server:
    return deployments.get("two_ranks")


@pytest.fixture(scope="module")
def crasher(deployments: Deployments) -> Server:
    """The shard dies at every step that reads a token of CRASHER's prompt that the others never send."""
    return deployments.get("crasher")


def test_a_killed_then_a_hung_shard_lose_no_request(restarting: Callable[[], Server]) -> None:
    """SIGKILL, then SIGSTOP (the shard neither answers nor dies: the step deadline catches it, and the router
    kills the group), on one deployment that heals from both."""
    server = restarting()
    assert server.metric("conveyor_shard_restarts_total") == 0
    stopped: list[int] = []

    def hang() -> None:
        stopped.append(server.shard_pid(0))
        os.kill(stopped[0], signal.SIGSTOP)

    try:
        _serve_through(server, lambda: os.kill(server.shard_pid(0), signal.SIGKILL), restarts=1)
        _serve_through(server, hang, restarts=MAX_RESTARTS)
        assert stopped[0] not in server.shard_pids()
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped[0], signal.SIGKILL)


def test_past_max_restarts_a_killed_shard_ends_the_stream_with_an_error_and_the_launcher_fails(
    restarting: Callable[[], Server],
) -> None:
    """Once --max-restarts are spent (by the test above; alone, this test spends them first), the next death is
    the last: the stream ends with an error event at once (not after the graceful timeout) and the launcher exits
    non-zero with nothing left running."""
    server = restarting()
    try:
        with server.client() as client:
            for _ in range(MAX_RESTARTS - int(server.metric("conveyor_shard_restarts_total"))):
                os.kill(server.shard_pid(0), signal.SIGKILL)
                # The step finds the shards gone, waits for the restarted ones, and replays the request.
                body = {"inputs": "x", "parameters": {"max_new_tokens": 2}}
                assert client.post("/generate", json=body).status_code == 200
        long = {"inputs": "def forever():", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
        watcher = StreamWatcher(server, long)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(watcher.run)
            wait_for(lambda: watcher.received(3), 120, "the stream to start")
            children = [c.pid for c in server.children()]
            os.kill(server.shard_pid(0), signal.SIGKILL)
            future.result(timeout=120)
        last = watcher.events[-1]
        assert last.get("error_type") == "unavailable" and last["error"]
        assert len(watcher.events) < 1000
        assert server.process.wait(timeout=120) != 0
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in children), 30, "the children to be gone")
    finally:
        server.stop()


def test_two_ranks_one_killed_lose_no_request(two_ranks: Server) -> None:
    """A tensor-parallel group cannot lose one rank: rank 1 dies, rank 0 is killed with it, both restart."""
    _serve_through(two_ranks, lambda: os.kill(two_ranks.shard_pid(1), signal.SIGKILL), restarts=1)


def test_an_idle_router_reconnects_to_a_restarted_group_before_a_request_comes(two_ranks: Server) -> None:
    """A group restarted while nothing runs (here a rank SIGKILLed; in a split deployment, a shard container
    restarted) is found by the idle router, reconnected and warmed up: the next request runs no failed step and
    is not replayed."""
    server = two_ranks
    wait_for(lambda: _idle_and_whole(server), 60, "the deployment to be idle")
    restarts = server.metric("conveyor_shard_restarts_total")
    replayed = server.metric("conveyor_requests_replayed_total")
    os.kill(server.shard_pid(1), signal.SIGKILL)
    wait_for(lambda: server.metric("conveyor_shard_restarts_total") == restarts + 1, 120, "the router to reconnect")
    wait_for(lambda: server.health() == 200, 60, "/health to answer 200")
    prompt, n = ORACLE_PROMPTS[0]
    watcher = StreamWatcher(server, {"inputs": prompt, "parameters": {"max_new_tokens": n}})
    watcher.run()
    assert watcher.token_ids() == greedy_reference(server.model_dir, prompt, n)
    assert server.metric("conveyor_requests_replayed_total") == replayed
    assert server.metric("conveyor_shard_restarts_total") == restarts + 1


def test_a_request_that_kills_the_shard_every_time_fails_alone(crasher: Server, tiny_model: Path) -> None:
    """The shard dies at every step that reads the crasher's prompt. After --max-request-retries replays (1 here)
    the crasher ends with an error event; the requests that were in the failed steps with it, blamed once too,
    complete exactly."""
    bodies = [{"inputs": p, "parameters": {"max_new_tokens": n}} for p, n in CRASHER_OTHERS]
    watchers = [StreamWatcher(crasher, b) for b in bodies]
    doomed = StreamWatcher(crasher, {"inputs": CRASHER, "parameters": {"max_new_tokens": 20}})
    with ThreadPoolExecutor(len(watchers) + 1) as pool:
        futures = [pool.submit(w.run) for w in watchers]
        wait_for(lambda: all(w.received(1) for w in watchers), 120, "the other streams to start")
        futures.append(pool.submit(doomed.run))
        for future in futures:
            future.result(timeout=300)
    assert doomed.events[-1]["error_type"] == "generation"
    assert "2 failed steps" in doomed.events[-1]["error"]
    for watcher, (prompt, n) in zip(watchers, CRASHER_OTHERS):
        assert watcher.token_ids() == greedy_reference(tiny_model, prompt, n), prompt
    # The crasher's error is sent when its second step fails, before the router reconnects: wait for that.
    wait_for(lambda: crasher.metric("conveyor_shard_restarts_total") == 2, 120, "the second reconnect")
    wait_for(lambda: crasher.health() == 200, 120, "the deployment to be healthy")
    assert crasher.metric("conveyor_shard_restarts_total") == 2  # the first try and one replay, no more
    wait_for(lambda: _idle_and_whole(crasher), 60, "every KV block to be free")
