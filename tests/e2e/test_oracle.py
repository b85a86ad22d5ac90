"""The correctness oracle, through the real launcher, router and shard processes.

Greedy float32 requests that join and leave a running batch at staggered moments, and one whose client
disconnects mid-stream, must each yield exactly the token ids transformers' `generate()` yields for that
prompt alone.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import sseclient
from conftest import ORACLE_PROMPTS, Deployments, Server, free_port, greedy_reference, start_server, wait_for

# A prompt that repeats itself, so that prompt-lookup drafts are proposed and accepted (for the deployments that
# speculate; with the others its generation would cross the Phi-3 test model's LongRoPE switch at 100 tokens,
# where Conveyor and transformers' generate() part ways: a case the oracle prompts leave out).
REPEATING = ("one two three four five six seven eight. " * 3 + "one two three", 40)
PROMPTS = ORACLE_PROMPTS
SPECULATE = ["--speculate", "4", "--speculate-max-batch", "64"]  # drafts at every decode step, in any batch

# (model fixture, launcher flags): every engine and sharding must pass the same oracle. None: conftest's session
# deployment of the tiny model (--max-total-tokens 512 as here; its prefill budget of 2048 tokens is more than
# these prompts take together), which saves a start of the same thing.
DEPLOYMENTS = {
    "llama-gqa": ("tiny_model", None),
    "qwen2-bias": ("qwen2_model", []),
    "qwen2-2-shards": ("qwen2_model", ["--num-shard", "2"]),
    "qwen3-qk-norm": ("qwen3_model", []),
    "qwen3-2-shards": ("qwen3_model", ["--num-shard", "2"]),
    "mistral-window": ("mistral_model", []),
    "mistral-2-shards": ("mistral_model", ["--num-shard", "2"]),
    "phi3-longrope": ("phi3_model", []),
    "phi3-2-shards": ("phi3_model", ["--num-shard", "2"]),
    "gemma3-windows": ("gemma3_model", []),
    "gemma3-multimodal-checkpoint": ("gemma3_multimodal_model", []),
    "gemma3-2-shards": ("gemma3_model", ["--num-shard", "2"]),
    "gemma2-softcap": ("gemma2_model", []),
    "gemma2-2-shards": ("gemma2_model", ["--num-shard", "2"]),
    "llama-2-shards": ("tiny_model", ["--num-shard", "2"]),
    "llama-speculate": ("tiny_model", SPECULATE),
    "llama-speculate-2-shards": ("tiny_model", ["--num-shard", "2", *SPECULATE]),
    # Drafts from a draft model: the target itself, 4-bit (drafts that are often wrong), and in float on 2 ranks.
    "llama-draft-self-int4": ("tiny_model", [*SPECULATE, "--speculate-model", "self", "--speculate-quantize", "int4"]),
    "llama-draft-self-2-shards": ("tiny_model", ["--num-shard", "2", *SPECULATE, "--speculate-model", "self"]),
}


# This module's own deployments decode in runs of several steps per call where they can (off by default on CPU),
# with no drafts (a speculating step is never part of a run): the oracle holds for runs too, across every model
# type and two ranks. The speculating deployments come after them, and the session's server speculates by default.
RUNS = ("--max-decode-steps", "8", "--speculate", "0")


@pytest.fixture(scope="module")
def own_deployments(request: pytest.FixtureRequest) -> Iterator[Deployments]:
    """The deployments this module starts itself: those of the selected cases start together."""
    items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    selected = {i.callspec.params.get("deployment") for i in items if hasattr(i, "callspec")}
    starts = {
        name: functools.partial(
            start_server,
            request.getfixturevalue(model_fixture),
            "--max-total-tokens",
            "512",
            "--master-port",
            str(free_port()),
            *RUNS,
            *flags,
        )
        for name, (model_fixture, flags) in DEPLOYMENTS.items()
        if flags is not None and name in selected
    }
    deployments = Deployments(starts)
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def deployment(request: pytest.FixtureRequest) -> Server:
    flags = DEPLOYMENTS[request.param][1]
    if flags is None:
        return request.getfixturevalue("server")
    server = request.getfixturevalue("own_deployments").get(request.param)
    assert server.info()["num_shard"] == (2 if "--num-shard" in flags else 1)
    return server


@dataclass
class Stream:
    """One streaming request run on its own thread; `progress` lets other requests start relative to it."""

    prompt: str
    max_new_tokens: int
    cancel_after: int | None = None
    ids: list[int] = field(default_factory=list)
    final: dict | None = None
    progress: threading.Condition = field(default_factory=threading.Condition)

    def body(self) -> dict:
        return {"inputs": self.prompt, "parameters": {"max_new_tokens": self.max_new_tokens, "details": True}}

    def run(self, url: str, start: threading.Event) -> None:
        start.wait(120)
        body = self.body()
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{url}/generate_stream", json=body) as response:
                assert response.status_code == 200, response.read()
                for event in sseclient.SSEClient(response.iter_bytes()).events():
                    payload = json.loads(event.data)
                    assert "error" not in payload, payload
                    with self.progress:
                        self.ids.append(payload["token"]["id"])
                        self.progress.notify_all()
                    if payload["generated_text"] is not None:
                        self.final = payload
                    if self.cancel_after is not None and len(self.ids) >= self.cancel_after:
                        return  # leaving the block closes the connection: the client is gone

    def tokens_received(self, n: int) -> bool:
        with self.progress:
            return len(self.ids) >= n or self.final is not None


def run_staggered(server: Server, streams: list[Stream], after_tokens: int) -> None:
    """Starts stream k once stream k-1 has received `after_tokens` tokens (or finished), so each new request
    joins a batch that is already decoding; a few start together to exercise multi-request prefills."""
    starts = [threading.Event() for _ in streams]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.run, server.url, e) for s, e in zip(streams, starts)]
        starts[0].set()
        for k in range(1, len(streams)):
            if k % 5 != 0:  # every fifth request starts together with the one before it
                previous = streams[k - 1]
                wait_for(
                    lambda previous=previous, k=k: previous.tokens_received(after_tokens) or futures[k - 1].done(),
                    120,
                    f"request {k - 1} to stream {after_tokens} tokens",
                )
            starts[k].set()
        for f in futures:
            f.result()


def test_staggered_greedy_requests_match_transformers(deployment: Server) -> None:
    runs = deployment.metric("conveyor_decode_runs_total")
    accepted = deployment.metric("conveyor_speculative_accepted_tokens_total")
    speculating = deployment.info()["speculate"] > 0
    streams = [Stream(p, n) for p, n in PROMPTS + ([REPEATING] if speculating else [])]
    run_staggered(deployment, streams, after_tokens=2)
    if speculating:  # drafts were accepted: the oracle did not hold only because speculation was silently off
        assert deployment.metric("conveyor_speculative_accepted_tokens_total") > accepted
    elif deployment.info()["max_decode_steps"] > 1:  # runs while nobody waited (the last requests decoded alone)
        assert deployment.metric("conveyor_decode_runs_total") > runs
    for s in streams:
        expected = greedy_reference(deployment.model_dir, s.prompt, s.max_new_tokens)
        assert s.ids == expected, f"prompt {s.prompt!r}"
        assert s.final is not None and s.final["details"]["generated_tokens"] == len(expected)


def run_with_a_cancelled_stream(server: Server) -> None:
    """Eight staggered streams, the third of which disconnects after 3 tokens, mid-batch: the others must be exact,
    and it the start of its own (tests/e2e/test_replicas.py runs it across two shard groups)."""
    streams = [Stream(p, n) for p, n in ORACLE_PROMPTS[:8]]
    streams[2] = Stream(ORACLE_PROMPTS[2][0], 200, cancel_after=3)
    run_staggered(server, streams, after_tokens=3)
    for s in streams:
        expected = greedy_reference(server.model_dir, s.prompt, s.max_new_tokens)
        if s.cancel_after is None:
            assert s.ids == expected, f"prompt {s.prompt!r}"
        else:
            assert s.ids == expected[: len(s.ids)] and len(s.ids) == s.cancel_after


def test_a_cancelled_stream_leaves_the_others_exact(deployment: Server) -> None:
    run_with_a_cancelled_stream(deployment)
    # The deployment is still healthy and serves the next request exactly.
    with deployment.client() as client:
        response = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 5, "details": True}})
    assert [t["id"] for t in response.json()["details"]["tokens"]] == greedy_reference(deployment.model_dir, "x", 5)


def test_non_streaming_requests_in_a_burst_match_transformers(deployment: Server) -> None:
    def generate(prompt: str, n: int) -> list[int]:
        with deployment.client() as client:
            r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}})
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda pn: generate(*pn), PROMPTS))
    for (prompt, n), ids in zip(PROMPTS, results):
        assert ids == greedy_reference(deployment.model_dir, prompt, n), f"prompt {prompt!r}"
