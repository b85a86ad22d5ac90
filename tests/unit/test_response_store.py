"""The Responses API's store (router/frontends/response_store.py): bounded, expiring, and each key's own."""

from __future__ import annotations

from conveyor.router.frontends.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(n: int) -> dict:
    return {"id": f"resp_{n}", "object": "response"}


def test_a_response_is_its_keys_alone() -> None:
    store = ResponseStore()
    store.put("alice", response(1), [{"role": "user", "content": "hi"}])
    assert store.get("alice", "resp_1").messages == [{"role": "user", "content": "hi"}]
    assert store.get("bob", "resp_1") is None
    assert not store.delete("bob", "resp_1")
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None


def test_the_oldest_go_first_past_the_limit() -> None:
    store = ResponseStore(limit=2)
    for n in range(3):
        store.put("alice", response(n), [])
    assert store.get("alice", "resp_0") is None and len(store) == 2
    assert store.get("alice", "resp_2") is not None


def test_responses_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ttl=60.0, clock=clock)
    store.put("alice", response(1), [])
    clock.now = 59.0
    assert store.get("alice", "resp_1") is not None
    clock.now = 61.0
    assert store.get("alice", "resp_1") is None and len(store) == 0


def test_one_keys_responses_never_push_out_anothers() -> None:
    """Each key has caps of its own: alice's flood drops alice's oldest, and bob's one response stays."""
    store = ResponseStore(limit=3)
    store.put("bob", response(0), [])
    for n in range(1, 100):
        store.put("alice", response(n), [])
    assert store.get("bob", "resp_0") is not None
    assert store.kept_by("alice")[0] == 3 and store.get("alice", "resp_99") is not None
    assert store.get("alice", "resp_96") is None and len(store) == 4


def test_a_keys_bytes_are_capped_too() -> None:
    """Big responses count by their bytes: past the cap the key's oldest go, down to the newest alone."""
    big = [{"role": "user", "content": "x" * 1000}]
    store = ResponseStore(max_bytes=3000)
    for n in range(5):
        store.put("alice", response(n), big)
    count, nbytes = store.kept_by("alice")
    assert count == 2 and nbytes <= 3000 and store.get("alice", "resp_4") is not None
    store.put("alice", response(9), [{"role": "user", "content": "x" * 5000}])  # over the cap alone: kept alone
    assert store.kept_by("alice")[0] == 1 and store.get("alice", "resp_9") is not None
    assert store.delete("alice", "resp_9") and store.kept_by("alice") == (0, 0)
