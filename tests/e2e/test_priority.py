"""`priority` through the real processes: on a one-row batch, a request of a lower priority value sent after four
others waiting is served before the ones still waiting, on TGI's and OpenAI's routes and over gRPC.

(Admission and preemption by priority, step by step, are in tests/unit/test_step_planner.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server, start_server, wait_for

from conveyor.client import Client

LONG = 200  # tokens each low-priority request generates


@pytest.fixture(scope="module")
def one_row(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--max-batch-size", "1", "--max-total-tokens", "512")
    yield server
    assert server.stop() == 0


def _states(server: Server) -> list[str]:
    """Each request's state (running or queued), as GET /v1/requests lists them."""
    return sorted(row["state"] for row in httpx.get(f"{server.url}/v1/requests").json()["data"])


def _served_in_order(server: Server, urgent: Callable[[], None]) -> list[str]:
    """Four low-priority requests (one admitted, its step held by the paused shard; three waiting), then `urgent`:
    the order in which they finished. Served first come, first served, `urgent` would finish last; by priority it
    finishes second, right after the one admitted before it came."""
    finished: list[str] = []
    lock = threading.Lock()

    def low(name: str) -> None:
        body = {"inputs": "x", "parameters": {"max_new_tokens": LONG, "ignore_eos": True, "priority": 5}}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=300).status_code == 200
        with lock:
            finished.append(name)

    def high() -> None:
        urgent()
        with lock:
            finished.append("urgent")

    threads = [threading.Thread(target=low, args=(f"low{i}",)) for i in range(4)]
    with server.shards_paused():
        for thread in threads:
            thread.start()
        one_admitted = ["queued"] * 3 + ["running"]
        wait_for(lambda: _states(server) == one_admitted, 120, "one low-priority request admitted, three waiting")
        threads.append(threading.Thread(target=high))
        threads[-1].start()
        wait_for(lambda: _states(server) == ["queued"] + one_admitted, 120, "the urgent request waiting with them")
    for thread in threads:
        thread.join(300)
    return finished


def test_tgi_route(one_row: Server) -> None:
    def urgent() -> None:
        body = {"inputs": "y", "parameters": {"max_new_tokens": 4, "priority": -1}}
        assert httpx.post(f"{one_row.url}/generate", json=body, timeout=300).status_code == 200

    order = _served_in_order(one_row, urgent)
    assert len(order) == 5 and order.index("urgent") == 1, order


def test_openai_route(one_row: Server) -> None:
    def urgent() -> None:
        body = {"prompt": "y", "max_tokens": 4, "priority": -1}
        assert httpx.post(f"{one_row.url}/v1/completions", json=body, timeout=300).status_code == 200

    order = _served_in_order(one_row, urgent)
    assert len(order) == 5 and order.index("urgent") == 1, order


def test_grpc_front_door(one_row: Server) -> None:
    def urgent() -> None:
        with Client(one_row.grpc, timeout=300) as client:
            client.generate("y", max_new_tokens=4, priority=-1)

    order = _served_in_order(one_row, urgent)
    assert len(order) == 5 and order.index("urgent") == 1, order


def test_a_priority_out_of_range_is_a_422(one_row: Server) -> None:
    body = {"inputs": "y", "parameters": {"priority": 2**31}}
    response = httpx.post(f"{one_row.url}/generate", json=body)
    assert response.status_code == 422 and "priority" in response.json()["error"]
