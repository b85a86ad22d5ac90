"""Block accounting through a live paged deployment whose KV holds only a few requests at a time."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from conftest import Server, free_port, greedy_reference, wait_for
from test_lifecycle import StreamWatcher

PROMPTS = [f"def step_{n}(x):" for n in range(10)]
MAX_NEW = 150  # each request may fill ceil((~7 + 149) / 16) = 10 blocks: 3 of them fit 32 blocks at once


def info(server: Server) -> dict:
    return httpx.get(f"{server.url}/info", timeout=10).json()


def test_every_block_comes_back_after_a_burst_with_cancellations(small_kv: Server, tiny_model: Path) -> None:
    assert info(small_kv)["kv_blocks_total"] == 32
    watchers = [StreamWatcher(small_kv, {"inputs": p, "parameters": {"max_new_tokens": MAX_NEW}}) for p in PROMPTS]
    cancelled = {1, 4, 7}
    with ThreadPoolExecutor(len(watchers)) as pool:
        futures = [pool.submit(w.run) for w in watchers]
        for n in sorted(cancelled):
            wait_for(lambda n=n: watchers[n].received(2) or futures[n].done(), 120, f"request {n} to start")
            watchers[n].hang_up.set()
        for f in futures:
            f.result()
    for n, w in enumerate(watchers):
        ids = [e["token"]["id"] for e in w.events]
        reference = greedy_reference(tiny_model, PROMPTS[n], MAX_NEW)
        if n in cancelled:
            assert ids == reference[: len(ids)]
        else:
            assert ids == reference and w.events[-1]["generated_text"] is not None
    wait_for(lambda: info(small_kv)["kv_blocks_free"] == 32, 60, "every block to be free again")


def test_a_request_that_can_never_fit_is_422(small_kv: Server) -> None:
    r = httpx.post(f"{small_kv.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 300}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert info(small_kv)["kv_blocks_free"] == 32


def test_a_kv_budget_below_one_request_is_refused_at_startup(tiny_model: Path) -> None:
    launcher = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor.launcher.main",
            "--model-id",
            str(tiny_model),
            "--port",
            str(free_port()),
            "--max-batch-total-tokens",
            "128",
            "--max-total-tokens",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launcher.returncode != 0
    assert "--max-batch-total-tokens (128) must be >= --max-total-tokens (256)" in launcher.stderr
    assert "Traceback" not in launcher.stderr  # a configuration mistake is a message, not a crash
