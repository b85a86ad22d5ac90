"""The paged engine's scheduler, end to end: chunked prefill, the prefix cache, preemption, scheduling modes.

Each of these changes *when* and *in which forward* a token is computed, never *which* token: every request
must still get exactly the greedy token ids transformers' `generate()` gives for its prompt alone (the oracle),
and the counters at /metrics must show that the mechanism under test really ran.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import ORACLE_PROMPTS, Deployments, Server, free_port, greedy_reference, start_server, used, wait_for
from test_lifecycle import StreamWatcher
from test_oracle import Stream, run_staggered

BLOCK = 16  # tokens per KV block

# Prompts of 60-150 tokens (asserted against the tokenizer): with a 16-token step budget they need several steps.
LONG_PROMPTS = [
    "def handle(request, response):\n    return response.send(request.body)\n\n" * 3,
    "class Node:\n    def __init__(self, value):\n        self.value = value\n        self.next = None\n\n" * 3,
]

# A prefix of at least 4 whole blocks shared by prompts with different tails (asserted against the tokenizer).
COMMON_PREFIX = (
    "import sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n" * 2
)
TAILS = [
    "def first(x):\n    return x + 1\n",
    "def second(items):\n    return sorted(items)\n",
    "class Third:\n    pass\n",
    "print(load(sys.argv[1]))",
]
PREFIX_NEW_TOKENS = 12

# Each request may fill ceil((~10 + 149) / 16) = 10 blocks and 32 blocks hold 3 of them: 8 must preempt.
PREEMPT_REQUESTS = 8
PREEMPT_NEW_TOKENS = 150


# ---------------------------------------------------------------------------------------------------- helpers


@functools.cache
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def token_ids(model_dir: Path, text: str) -> list[int]:
    """The prompt as the router sees it (BOS included), to measure lengths and shared prefixes in tokens."""
    return tokenizer(model_dir)(text).input_ids


def common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def reusable_tokens(cached: list[int], prompt: list[int]) -> int:
    """Tokens of `prompt` a block-granular prefix cache holding `cached` must serve: whole shared blocks, less
    the last prompt token, whose logits have to be computed anyway."""
    return min(common_length(cached, prompt), len(prompt) - 1) // BLOCK * BLOCK


def counter(server: Server, name: str, missing: float | None = None) -> float:
    """One Prometheus sample: the value on the line `name value` of /metrics (`missing` if there is none yet, as
    for a labelled child never observed; None: an error)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    if missing is not None:
        return missing
    raise AssertionError(f"{name} is not in /metrics")


def cache_counts(server: Server) -> tuple[float, float]:
    """(prompt tokens found in the prefix cache, prompt tokens looked up) so far."""
    return counter(server, "conveyor_prefix_cache_hits_total"), counter(server, "conveyor_prefix_cache_queries_total")


def info(server: Server) -> dict:
    return httpx.get(f"{server.url}/info", timeout=10).json()


def all_blocks_free(server: Server) -> bool:
    now = info(server)
    return now["kv_blocks_free"] == now["kv_blocks_total"]


def generate(server: Server, prompt: str, max_new_tokens: int, **parameters: object) -> dict:
    """A non-streaming /generate with details, asserted successful."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **parameters}}
    with server.client() as client:
        r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def generated_ids(server: Server, prompt: str, max_new_tokens: int) -> list[int]:
    return [t["id"] for t in generate(server, prompt, max_new_tokens)["details"]["tokens"]]


def assert_exact(model_dir: Path, prompt: str, ids: list[int], max_new_tokens: int) -> None:
    assert ids == greedy_reference(model_dir, prompt, max_new_tokens), f"prompt {prompt!r}"


def prompt_logprobs_reference(model_dir: Path, prompt: str) -> list[float]:
    """log p(token k | tokens < k) for k >= 1, from transformers over the whole prompt at once."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids(model_dir, prompt)])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()


def launch(model_dir: Path, *flags: str) -> Server:
    return start_server(model_dir, "--master-port", str(free_port()), *flags)


# ---------------------------------------------------------------------------------------------------- deployments


# Launcher flags of each scheduling mode. The sequential deployment runs without the prefix cache too, for
# test_without_prefix_caching_...: a start less, and the two do not meet (that test's requests come one after the
# other anyway, and the mode test reads its decode steps as a difference).
MODES = {
    # One decode step per token (no drafts): the test counts them.
    "sequential": ["--scheduling", "sequential", "--no-prefix-caching", "--speculate", "0"],
    "static": ["--scheduling", "static", "--max-batch-size", "4", "--static-batch-timeout", "0.5"],
}
# A 16-token step budget far below the longest prompt allowed: long prompts must be chunked. The prefix cache is
# on by default, so the prefix tests share this deployment (and chunk their prompts too).
CHUNKING = ["--max-batch-prefill-tokens", "16"]


@pytest.fixture(scope="module")
def deployments(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Deployments]:
    """The chunking deployment and one per scheduling mode; those the selected tests use start together."""
    flags = {"chunking": CHUNKING, **MODES}
    starts = {name: functools.partial(launch, tiny_model, "--max-total-tokens", "512", *f) for name, f in flags.items()}
    fixtures = used(request, ["chunking", "mode_server"], module=True)
    wanted = (["chunking"] if "chunking" in fixtures else []) + (list(MODES) if "mode_server" in fixtures else [])
    deployments = Deployments(starts, wanted)
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def chunking(deployments: Deployments) -> Server:
    return deployments.get("chunking")


@pytest.fixture(scope="module")
def mode_server(deployments: Deployments) -> Callable[[str], Server]:
    """The deployment of a scheduling mode (MODES)."""
    return deployments.get


@pytest.fixture(scope="module")
def long_runners(tiny_model: Path) -> list[str]:
    """Prompts whose greedy continuation runs the full PREEMPT_NEW_TOKENS: the test model's extra EOS id ends
    some others early (conftest keeps it out of the oracle prompts' continuations only), and short requests
    would neither press on the pool nor show every request getting all its tokens."""
    chosen: list[str] = []
    for prompt in (f"def step_{n}(x):" for n in range(64)):
        if len(greedy_reference(tiny_model, prompt, PREEMPT_NEW_TOKENS)) == PREEMPT_NEW_TOKENS:
            chosen.append(prompt)
        if len(chosen) == PREEMPT_REQUESTS:
            return chosen
    raise AssertionError("too few prompts run to max_new_tokens on the test model")


# ---------------------------------------------------------------------------------------------------- chunked prefill


def test_long_prompts_join_a_decoding_batch_in_chunks_exactly(chunking: Server, tiny_model: Path) -> None:
    assert info(chunking)["chunked_prefill"] is True
    for prompt in LONG_PROMPTS:
        assert 60 <= len(token_ids(tiny_model, prompt)) <= 150, "a long prompt must span several 16-token steps"
    chunks_before = counter(chunking, "conveyor_prefill_chunks_total")
    streams = [Stream(p, n) for p, n in ORACLE_PROMPTS]
    # Each long prompt starts once the request before it streams, so it is chunked beside running decodes.
    streams.insert(3, Stream(LONG_PROMPTS[0], 20))
    streams.insert(8, Stream(LONG_PROMPTS[1], 25))
    run_staggered(chunking, streams, after_tokens=2)
    for s in streams:
        assert_exact(tiny_model, s.prompt, s.ids, s.max_new_tokens)
        assert s.final is not None and s.final["details"]["generated_tokens"] == s.max_new_tokens
    assert counter(chunking, "conveyor_prefill_chunks_total") > chunks_before
    wait_for(lambda: all_blocks_free(chunking), 60, "every block to be free again")


def test_prompt_logprobs_of_a_long_prompt_cover_every_prompt_token(chunking: Server, tiny_model: Path) -> None:
    prompt = LONG_PROMPTS[0]
    generate(chunking, prompt, 1)  # now its blocks are cached, yet their logprobs must still be computed
    details = generate(chunking, prompt, 8, decoder_input_details=True)["details"]
    prompt_ids = token_ids(tiny_model, prompt)
    assert len(prompt_ids) > BLOCK
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    assert details["prefill"][0]["logprob"] is None
    served = [t["logprob"] for t in details["prefill"][1:]]
    assert served == pytest.approx(prompt_logprobs_reference(tiny_model, prompt), abs=1e-4)
    assert_exact(tiny_model, prompt, [t["id"] for t in details["tokens"]], 8)


# ---------------------------------------------------------------------------------------------------- prefix cache


def test_requests_sharing_a_prefix_reuse_its_blocks_exactly(chunking: Server, tiny_model: Path) -> None:
    assert info(chunking)["prefix_caching"] is True
    prompts = [COMMON_PREFIX + tail for tail in TAILS]
    first = token_ids(tiny_model, prompts[0])
    for p in prompts[1:]:
        assert common_length(first, token_ids(tiny_model, p)) >= 4 * BLOCK, "the prompts must share 4+ blocks"

    # The first request alone fills the cache; its blocks stay cached (and count as free) once it ends.
    assert_exact(tiny_model, prompts[0], generated_ids(chunking, prompts[0], PREFIX_NEW_TOKENS), PREFIX_NEW_TOKENS)
    wait_for(lambda: all_blocks_free(chunking), 60, "every block to be free again")
    assert info(chunking)["kv_blocks_cached"] >= 4

    # The very same prompt again, alone: every whole block but the one holding its last token is reused.
    before = cache_counts(chunking)
    assert_exact(tiny_model, prompts[0], generated_ids(chunking, prompts[0], PREFIX_NEW_TOKENS), PREFIX_NEW_TOKENS)
    hits, queries = (now - then for now, then in zip(cache_counts(chunking), before))
    assert reusable_tokens(first, first) <= hits <= queries

    # The other tails together, in one burst: each reuses the shared prefix and prefills only its own tail.
    before = cache_counts(chunking)
    with ThreadPoolExecutor(len(prompts) - 1) as pool:
        results = list(pool.map(lambda p: generated_ids(chunking, p, PREFIX_NEW_TOKENS), prompts[1:]))
    for prompt, ids in zip(prompts[1:], results):
        assert_exact(tiny_model, prompt, ids, PREFIX_NEW_TOKENS)
    hits, queries = (now - then for now, then in zip(cache_counts(chunking), before))
    assert sum(reusable_tokens(first, token_ids(tiny_model, p)) for p in prompts[1:]) <= hits <= queries
    wait_for(lambda: all_blocks_free(chunking), 60, "every block to be free again")


def test_without_prefix_caching_the_same_prompts_give_the_same_tokens_and_no_hits(
    mode_server: Callable[[str], Server], tiny_model: Path
) -> None:
    server = mode_server("sequential")  # started with --no-prefix-caching (see MODES)
    assert info(server)["prefix_caching"] is False
    prompt = COMMON_PREFIX + TAILS[0]
    for _ in range(2):  # the second would hit the first's blocks, were they cached
        assert_exact(tiny_model, prompt, generated_ids(server, prompt, PREFIX_NEW_TOKENS), PREFIX_NEW_TOKENS)
    assert counter(server, "conveyor_prefix_cache_hits_total") == 0
    wait_for(lambda: all_blocks_free(server), 60, "every block to be free again")
    assert info(server)["kv_blocks_cached"] == 0


# ---------------------------------------------------------------------------------------------------- preemption


def run_streams(server: Server, prompts: list[str], hang_up: dict[int, int] | None = None) -> list[StreamWatcher]:
    """Streams every prompt at once; request n of `hang_up` disconnects once it has hang_up[n] tokens."""
    body = {"max_new_tokens": PREEMPT_NEW_TOKENS, "details": True}
    watchers = [StreamWatcher(server, {"inputs": p, "parameters": body}) for p in prompts]
    with ThreadPoolExecutor(len(watchers)) as pool:
        futures = [pool.submit(w.run) for w in watchers]
        for n, after in sorted((hang_up or {}).items()):
            wait_for(
                lambda n=n, after=after: watchers[n].received(after) or futures[n].done(), 300, f"request {n} to stream"
            )
            watchers[n].hang_up.set()
        for f in futures:
            f.result()
    return watchers


def test_requests_outgrowing_the_kv_pool_are_preempted_and_resume_exactly(
    small_kv: Server, tiny_model: Path, long_runners: list[str]
) -> None:
    preemptions_before = counter(small_kv, "conveyor_preemptions_total")
    watchers = run_streams(small_kv, long_runners)
    for prompt, w in zip(long_runners, watchers):
        assert all("error" not in e for e in w.events), w.events[-1]
        # One event per token, no gap and no duplicate across a preemption: the full list is the reference.
        assert_exact(tiny_model, prompt, [e["token"]["id"] for e in w.events], PREEMPT_NEW_TOKENS)
        assert w.events[-1]["details"]["generated_tokens"] == PREEMPT_NEW_TOKENS
    assert counter(small_kv, "conveyor_preemptions_total") > preemptions_before
    wait_for(lambda: all_blocks_free(small_kv), 60, "every block to be free again")


def test_a_client_hanging_up_under_preemption_leaves_the_others_exact(
    small_kv: Server, tiny_model: Path, long_runners: list[str]
) -> None:
    cancelled = 5
    watchers = run_streams(small_kv, long_runners, hang_up={cancelled: 20})
    for n, (prompt, w) in enumerate(zip(long_runners, watchers)):
        assert all("error" not in e for e in w.events), w.events[-1]
        ids = [e["token"]["id"] for e in w.events]
        reference = greedy_reference(tiny_model, prompt, PREEMPT_NEW_TOKENS)
        if n == cancelled:
            assert ids == reference[: len(ids)] and not w.finished
        else:
            assert ids == reference, f"prompt {prompt!r}"
            assert w.events[-1]["details"]["generated_tokens"] == PREEMPT_NEW_TOKENS
    wait_for(lambda: all_blocks_free(small_kv), 60, "every block to be free again")


# ---------------------------------------------------------------------------------------------------- modes


@pytest.mark.parametrize("mode", list(MODES))
def test_each_scheduling_mode_serves_a_burst_exactly(
    mode: str, mode_server: Callable[[str], Server], tiny_model: Path
) -> None:
    server = mode_server(mode)
    assert info(server)["scheduling"] == mode
    decodes = 'conveyor_batch_step_duration_seconds_count{method="decode"}'
    decodes_before = counter(server, decodes, missing=0.0)
    burst = ORACLE_PROMPTS[:6]
    with ThreadPoolExecutor(len(burst)) as pool:
        results = list(pool.map(lambda pn: generated_ids(server, *pn), burst))
    for (prompt, n), ids in zip(burst, results):
        assert_exact(tiny_model, prompt, ids, n)
    if mode == "sequential":  # one request at a time: no decode step is ever shared
        assert counter(server, decodes) - decodes_before == sum(n - 1 for _, n in burst)


def test_an_unknown_scheduling_mode_is_refused_at_startup(tiny_model: Path) -> None:
    launcher = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor.launcher.main",
            "--model-id",
            str(tiny_model),
            "--port",
            str(free_port()),
            "--scheduling",
            "bogus",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launcher.returncode != 0
    assert "--scheduling" in launcher.stderr and "bogus" in launcher.stderr
    assert "Traceback" not in launcher.stderr  # a configuration mistake is a message, not a crash
