"""One router in front of two shard groups (router/core/groups.py), through the real launcher, router and shards.

Two deployments of the tiny model, each with two groups of one shard:
- `blind`: `--replicas 2 --placement round-robin`, every request to the next group in turn, on unix sockets. The
  oracle runs here (staggered joins, a cancelled stream): round-robin puts every other request on the other group,
  so both groups serve each test's requests, and each must be exact.
- `aware`: cache-aware placement, its groups on TCP with the shared token and mutual TLS: the launcher's own group
  (`--listen`) and a group it did not start, a lone shard joined with `--shard-groups` as one on another machine
  would be. Here a multi-turn workload finds more of its prompts cached than on `blind`; a drained group gets
  nothing new; and a SIGKILLed group's streams replay on the other one, exactly, while it restarts and rejoins.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import (
    ORACLE_PROMPTS,
    Deployments,
    Server,
    Tls,
    free_port,
    greedy_reference,
    start_server,
    wait_for,
)
from test_oracle import Stream, run_staggered, run_with_a_cancelled_stream

TOKEN = "test-replicas-token"
SYSTEM_WORDS = ["river", "stone", "lamp", "orbit", "cedar", "violet", "harbor", "quartz", "meadow", "signal"]


@dataclass
class Remote:
    """A shard group this test starts itself, on TCP: what another machine would run."""

    process: subprocess.Popen
    port: int


@pytest.fixture(scope="module")
def remote(tiny_model: Path, tls: Tls) -> Iterator[Remote]:
    port = free_port()
    env = {**os.environ, "CONVEYOR_SHARD_TOKEN": TOKEN, "CONVEYOR_LOG_LEVEL": "WARNING", "RANK": "0"}
    env.update(WORLD_SIZE="1", OMP_NUM_THREADS="1")
    args = ["--model-id", str(tiny_model), "--listen", f"tcp://127.0.0.1:{port}", *tls.flags]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([sys.executable, "-m", "conveyor.shard.main", *args], env=env, stderr=log)
        yield Remote(process, port)
        process.terminate()
        code = process.wait(60)
        log.seek(0)
        assert code == 0, log.read().decode()


@pytest.fixture(scope="module")
def deployments(tiny_model: Path, tls: Tls, remote: Remote) -> Iterator[Deployments]:
    common = ("--max-total-tokens", "512", "--replicas", "2", "--speculate", "0")
    starts = {
        "blind": lambda: start_server(
            tiny_model, *common, "--placement", "round-robin", "--master-port", str(free_port())
        ),
        "aware": lambda: start_server(
            tiny_model,
            *("--max-total-tokens", "512", "--speculate", "0", "--master-port", str(free_port())),
            *("--listen", f"tcp://127.0.0.1:{free_port()}", *tls.flags),
            *("--shard-groups", f"tcp://127.0.0.1:{remote.port}"),
            env={"CONVEYOR_SHARD_TOKEN": TOKEN},
        ),
    }
    deployments = Deployments(starts)
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


def two_groups_serving(deployments: Deployments, name: str, placement: str) -> Server:
    server = deployments.get(name)
    info = server.info()
    assert info["placement"] == placement and [g["status"] for g in info["groups"]] == ["serving"] * 2
    return server


@pytest.fixture(scope="module")
def blind(deployments: Deployments) -> Server:
    return two_groups_serving(deployments, "blind", "round-robin")


@pytest.fixture(scope="module")
def aware(deployments: Deployments) -> Server:
    return two_groups_serving(deployments, "aware", "cache-aware")


def placed(server: Server) -> list[int]:
    return [g["placed"] for g in server.info()["groups"]]


def test_staggered_requests_across_two_groups_match_transformers(blind: Server) -> None:
    before = placed(blind)
    streams = [Stream(p, n) for p, n in ORACLE_PROMPTS]
    run_staggered(blind, streams, after_tokens=2)
    for s in streams:
        assert s.ids == greedy_reference(blind.model_dir, s.prompt, s.max_new_tokens), f"prompt {s.prompt!r}"
    counts = [after - b for after, b in zip(placed(blind), before)]
    assert counts == [len(streams) // 2, len(streams) - len(streams) // 2]  # both groups served half


def test_a_cancelled_stream_on_one_group_leaves_both_exact(blind: Server) -> None:
    run_with_a_cancelled_stream(blind)


def conversations(server: Server, systems: int = 2, per_system: int = 2, turns: int = 3) -> None:
    """Multi-turn chats, one request at a time: each turn's prompt is the last one, its answer and a new question,
    behind one of `systems` long system prompts that several conversations share."""
    for c in range(systems * per_system):
        words = SYSTEM_WORDS[c % systems :] + SYSTEM_WORDS[: c % systems]
        prompt = "System: " + " ".join(words * 6) + "\n"
        for turn in range(turns):
            prompt += f"User: question {turn} of chat {c}?\nAssistant:"
            with server.client() as client:
                r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 6}})
            assert r.status_code == 200, r.text
            prompt += r.json()["generated_text"] + "\n"


def test_cache_aware_placement_finds_more_of_a_conversation_cached_than_round_robin(
    blind: Server, aware: Server
) -> None:
    hits = {}
    for name, server in (("blind", blind), ("aware", aware)):
        before = server.metric("conveyor_prefix_cache_hits_total")
        conversations(server)
        hits[name] = server.metric("conveyor_prefix_cache_hits_total") - before
    assert hits["aware"] > hits["blind"], hits


def serving_gauges(server: Server) -> dict[str, float]:
    """conveyor_group_serving by group, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {g: float(v) for g, v in re.findall(r'^conveyor_group_serving\{group="(\d+)"\} (\S+)$', text, re.M)}


def test_a_drained_group_gets_nothing_new_and_the_tcp_group_serves_exactly(aware: Server) -> None:
    with aware.client() as client:
        assert client.post("/admin/groups/7/drain").status_code == 404
        drained = client.post("/admin/groups/0/drain")
        assert drained.status_code == 200 and drained.json()["status"] == "draining"
        assert serving_gauges(aware) == {"0": 0.0, "1": 1.0}  # at once, without a step on the idle group
        before = placed(aware)
        for prompt, n in ORACLE_PROMPTS[:3]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
            r = client.post("/generate", json=body)
            assert [t["id"] for t in r.json()["details"]["tokens"]] == greedy_reference(aware.model_dir, prompt, n)
        assert aware.health() == 200  # the other group serves
        assert client.post("/admin/groups/1/drain").status_code == 409  # the last one serving: refused
        assert placed(aware) == [before[0], before[1] + 3]  # all on the remote group, over TCP with mutual TLS
        assert client.post("/admin/groups/0/resume").json()["status"] == "serving"
        assert serving_gauges(aware) == {"0": 1.0, "1": 1.0}


def launcher_shard(server: Server) -> psutil.Process:
    """Group 0's shard: the launcher's child (group 1 is the test's own remote shard)."""
    (pid,) = server.shard_pids()
    return psutil.Process(pid)


def test_a_killed_group_replays_its_streams_on_the_other_exactly_and_rejoins(aware: Server) -> None:
    replayed = aware.metric("conveyor_requests_replayed_total")
    restarts = aware.metric("conveyor_shard_restarts_total")
    prompts = [(f"{p} # stream {k}", 120) for k, (p, _) in enumerate(ORACLE_PROMPTS[:12])]
    streams = [Stream(p, n) for p, n in prompts]
    start = threading.Event()
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.run, aware.url, start) for s in streams]
        start.set()
        shard = launcher_shard(aware)
        wait_for(lambda: all(s.tokens_received(1) for s in streams), 120, "every stream's first token")
        shard.suspend()  # holds group 0's step where it is: what it runs now is what the kill interrupts
        try:
            running = aware.info()["groups"][0]["running"]
        finally:
            shard.kill()
        for f in futures:
            f.result()
    assert running > 0, "group 0 ran nothing when it was killed"
    for s in streams:
        assert s.ids == greedy_reference(aware.model_dir, s.prompt, s.max_new_tokens), f"prompt {s.prompt!r}"
    assert aware.metric("conveyor_requests_replayed_total") - replayed >= running
    wait_for(lambda: aware.info()["groups"][0]["status"] == "serving", 180, "group 0 to rejoin")
    assert aware.metric("conveyor_shard_restarts_total") == restarts + 1
    assert launcher_shard(aware).pid != shard.pid
