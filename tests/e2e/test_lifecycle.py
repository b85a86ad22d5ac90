"""Deployments under stress and at their ends: overload, a graceful shutdown, shards that fail to load.

The 429 test leaves its deployment to the SIGTERM test, which ends it. A shard dying mid-stream past
--max-restarts is tests/faults/test_crash_recovery.py's, on the deployment that spent its restarts there.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import Server, StreamWatcher, free_port, greedy_reference, start_server, wait_for

LONG = {"inputs": "def forever():", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def capped(tiny_model: Path) -> Iterator[Callable[[], Server]]:
    """A deployment with --max-concurrent-requests 2, for the 429 test, which leaves it healthy, and then the
    SIGTERM test, which ends it (a start takes many seconds on 2 cores). Started at first use, and again for a test
    that finds it ended, so neither depends on the other's running first."""
    servers: list[Server] = []

    def get() -> Server:
        if not servers or servers[-1].process.poll() is not None:
            servers.append(start_server(tiny_model, "--max-concurrent-requests", "2"))
        return servers[-1]

    yield get
    codes = [server.stop() for server in servers]
    assert codes == [0] * len(codes)


def _refused_while_two_in_flight(server: Server) -> tuple[httpx.Response, httpx.Response] | None:
    """Two long streams hold both slots; a third request meanwhile is answered. Returns None if a stream
    ended before the answers came (a race a loaded machine can lose), so the caller tries again."""
    watchers = [StreamWatcher(server, LONG) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(w.run) for w in watchers]
        wait_for(lambda: all(w.received(1) for w in watchers), 120, "both streams to start")
        with server.client() as client:
            refused = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
            refused_stream = client.post("/generate_stream", json={"inputs": "x"})
        held = not any(w.finished for w in watchers)
        for w in watchers:
            w.hang_up.set()
        for f in futures:
            f.result()
    return (refused, refused_stream) if held else None


def test_over_max_concurrent_requests_is_429_and_the_slots_come_back(capped: Callable[[], Server]) -> None:
    server = capped()
    for _ in range(5):
        if (answers := _refused_while_two_in_flight(server)) is not None:
            break
    else:
        raise AssertionError("the long streams always finished before the third request was answered")
    for refused in answers:
        assert refused.status_code == 429 and refused.json()["error_type"] == "overloaded"
    # Disconnected clients give their slots back: a request is served again.
    with server.client() as client:
        wait_for(
            lambda: (
                client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}).status_code == 200
            ),
            60,
            "a slot to come back",
        )


def _draining(server) -> bool:
    """Both doors say so during a drain: /health (for load balancers) and a new request."""
    with server.client() as client:
        health = client.get("/health")
        refused = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
    return health.status_code == 503 and health.json()["error_type"] == "unavailable" and refused.status_code == 503


def test_sigterm_lets_in_flight_requests_finish_then_exits_cleanly(
    capped: Callable[[], Server], tiny_model: Path
) -> None:
    server = capped()  # one stream: the cap of 2 leaves room for the requests the drain refuses
    # Long enough that the drain outlasts a few polls of /health even on a fast machine.
    body = {"inputs": "x = 1", "parameters": {"max_new_tokens": 400, "details": True, "ignore_eos": True}}
    watcher = StreamWatcher(server, body)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(watcher.run)
        wait_for(lambda: watcher.received(2), 120, "the stream to start")
        children = [c.pid for c in server.children()]
        socket_dir = server.socket_dir()
        assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700  # private: not a guessable name in shared /tmp
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: _draining(server), 60, "/health and new requests to answer 503 during the drain")
        future.result(timeout=120)
    assert server.process.wait(timeout=120) == 0
    assert watcher.events[-1]["details"]["finish_reason"] == "length"
    ids = [e["token"]["id"] for e in watcher.events]
    reference = greedy_reference(tiny_model, "x = 1", 400)  # stops at an EOS the request ignored, if any
    assert len(ids) == 400 and ids[: len(reference)] == reference
    assert len(children) == 2  # a shard and the router, both stopped by the launcher
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in children), 30, "the children to be gone")
    assert not os.path.exists(socket_dir)  # no socket file, nor its directory, is left behind


def test_a_shard_that_dies_while_loading_fails_the_launcher_clearly(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    launcher = subprocess.run(
        [sys.executable, "-m", "conveyor.launcher.main", "--model-id", str(broken), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launcher.returncode != 0
    assert "shard 0 exited with code" in launcher.stderr


def test_a_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    launcher = subprocess.run(
        [sys.executable, "-m", "conveyor.launcher.main", "--model-id", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launcher.returncode != 0 and "no config.json" in launcher.stderr
