"""`--kv-offload-dir`: a prefix cached on disk outlives the shard. The shard is SIGKILLed with three streams in
flight, then stopped cleanly; after each restart a request sharing the cached prefix reads it from the disk tier
(counted in /metrics, and in the request's `details.prefill_cached_tokens`) and every request yields exactly
transformers' greedy tokens."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import Server, free_port, greedy_reference, start_server, wait_for

PREFIX = "# A shared system prompt that every request of this test starts with, long enough for many blocks. " * 6
DISK_HITS = "conveyor_prefix_cache_disk_hits_total"


@pytest.fixture(scope="module", params=[1, 2], ids=["1-shard", "2-shards"])
def offloading(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Path]]:
    """With two ranks each keeps its own files, and they agree on how many blocks a request takes from disk."""
    folder = tmp_path_factory.mktemp("kv-offload")
    flags = ["--num-shard", str(request.param), "--kv-offload-dir", str(folder)]
    server = start_server(tiny_model, "--master-port", str(free_port()), *flags)
    yield server, folder
    assert server.stop() == 0


def generate_details(server: Server, prompt: str, tokens: int, **parameters) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "details": True, **parameters}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()["details"]


def generate_ids(server: Server, prompt: str, tokens: int) -> list[int]:
    return [t["id"] for t in generate_details(server, prompt, tokens)["tokens"]]


def files(folder: Path) -> list[Path]:
    return list(folder.glob("*/*.kv"))  # one folder per rank (its fingerprint)


def restart(server: Server, sig: signal.Signals) -> None:
    """Kills or stops the shard; returns once the launcher's new one serves."""
    ranks, old = len(server.shard_pids()), server.shard_pid(0)
    os.kill(old, sig)

    def back() -> bool:
        try:
            pids = server.shard_pids()
        except psutil.Error:  # the old one, not yet reaped
            return False
        return len(pids) == ranks and old not in pids and server.health() == 200

    wait_for(back, 240, "the shard's restart")


def test_a_cached_prefix_outlives_a_killed_and_a_stopped_shard(tiny_model: Path, offloading) -> None:
    server, folder = offloading
    first = PREFIX + "question one:"
    want = greedy_reference(tiny_model, first, 12)
    assert generate_ids(server, first, 12) == want
    wait_for(lambda: len(files(folder)) >= 5, 60, "the prefix's blocks on disk")
    assert server.metric(DISK_HITS) == 0  # so far everything came from memory or was computed

    # SIGKILL under load, three requests of the prefix in flight: each is replayed exactly.
    others = [PREFIX + f"question two, part {i}:" for i in range(3)]
    with ThreadPoolExecutor(len(others)) as pool:
        running = [pool.submit(generate_ids, server, prompt, 120) for prompt in others]
        wait_for(lambda: server.metric("conveyor_generated_tokens_total") > 12, 120, "the streams to start")
        restart(server, signal.SIGKILL)
        for prompt, result in zip(others, running):
            assert result.result() == greedy_reference(tiny_model, prompt, 120)
    before = server.metric(DISK_HITS)
    details = generate_details(server, first, 12)
    assert [t["id"] for t in details["tokens"]] == want
    hits = server.metric(DISK_HITS)
    assert hits > 0  # the restarted shard's memory held nothing: the prefix came from disk
    # Its answer counts both tiers: the prefix the replayed requests put back in memory, its own blocks from disk.
    assert details["prefill_cached_tokens"] > 0 and details["prefill_cached_tokens"] >= hits - before

    # A clean stop: the files are the same folder's, so the next prefix read is from disk again.
    restart(server, signal.SIGTERM)
    third = PREFIX + "question three:"
    details = generate_details(server, third, 12)
    assert [t["id"] for t in details["tokens"]] == greedy_reference(tiny_model, third, 12)
    assert server.metric(DISK_HITS) > hits
    assert details["prefill_cached_tokens"] == server.metric(DISK_HITS) - hits  # memory was empty: all from disk


def test_a_damaged_file_is_never_served(tiny_model: Path, offloading) -> None:
    """Every block file on disk damaged, then the shard restarted: the prefix is computed again, exactly."""
    server, folder = offloading
    for path in files(folder):
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    restart(server, signal.SIGKILL)
    hits = server.metric(DISK_HITS)
    fourth = PREFIX + "question four:"
    assert generate_ids(server, fourth, 12) == greedy_reference(tiny_model, fourth, 12)
    assert server.metric(DISK_HITS) == hits  # nothing read from the damaged files
    assert server.metric("conveyor_kv_offload_skipped_files") >= 1
    wait_for(lambda: len(files(folder)) >= 5, 60, "the prefix's blocks written again")
    on_disk = sum(p.stat().st_size for p in files(folder))
    generate_ids(server, fourth, 1)  # a step after the writes: its timings carry the folder's size
    assert server.metric("conveyor_kv_offload_bytes") == on_disk / len(server.shard_pids())  # each rank as much
    assert server.info()["kv_offload_max_bytes"] == 10 * 2**30  # --kv-offload-max-gb's default


def salted_ids(server: Server, prompt: str, salt: str, cached: Callable[[int], bool]) -> list[int]:
    """The tokens of a salted request, whose `details.prefill_cached_tokens` must satisfy `cached`."""
    details = generate_details(server, prompt, 8, cache_salt=salt)
    assert cached(details.get("prefill_cached_tokens", 0)), details  # absent when 0: TGI's shape
    return [t["id"] for t in details["tokens"]]


def test_one_scope_never_reads_another_scopes_blocks_from_disk(tiny_model: Path, offloading) -> None:
    """Salt a's prefix goes to disk; after a restart salt b's identical prompt reads nothing from it (no memory
    cache either: the restart emptied it), and salt a's reads it."""
    server, folder = offloading
    prompt = "# Another shared prompt, this one for salted users only, of many blocks too. " * 5 + "Go:"
    want = greedy_reference(tiny_model, prompt, 8)
    before = len(files(folder))
    assert salted_ids(server, prompt, "user-a", lambda n: n == 0) == want
    wait_for(lambda: len(files(folder)) >= before + 5, 60, "salt a's blocks on disk")
    restart(server, signal.SIGKILL)
    hits = server.metric(DISK_HITS)
    assert salted_ids(server, prompt, "user-b", lambda n: n == 0) == want
    assert server.metric(DISK_HITS) == hits  # another scope's blocks are not its own
    assert salted_ids(server, prompt, "user-a", lambda n: n > 0) == want
    assert server.metric(DISK_HITS) > hits
