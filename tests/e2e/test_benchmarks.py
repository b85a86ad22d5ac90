"""The benchmarks run end to end against live servers on the tiny model (nothing is timed here), and the load
generator's parts (workload, stream reading, metrics) are checked on known inputs."""

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Server

from benchmarks.backends import RequestOptions, backend
from benchmarks.client import RequestRecord, sse_data
from benchmarks.metrics import LATENCIES, STATISTICS, BenchmarkResult, summarize
from benchmarks.serve import load_tokenizer
from benchmarks.workload import LengthSpec, Prompt, arrival_offsets, build_prompts, count_tokens

ROOT = Path(__file__).resolve().parents[2]


# --- the load generator and compare (benchmarks/serve.py, benchmarks/compare.py) ------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ["request_throughput", "output_throughput", "total_token_throughput", "request_goodput"] + [
    f"{stat}_{name}_ms" for name in LATENCIES for stat in STATISTICS
]


def benchmark_command() -> list[str]:
    """The load generator as a user runs it, from the checkout (the benchmarks are not installed with the server)."""
    return [sys.executable, "-m", "benchmarks.serve"]


@pytest.mark.parametrize("api", ["openai-completions", "tgi"])
def test_load_generator_measures_every_request(server: Server, tmp_path: Path, api: str) -> None:
    out_json, out_png = tmp_path / "result.json", tmp_path / "result.png"
    done = subprocess.run(
        [
            *benchmark_command(),
            "--base-url",
            server.url,
            "--backend",
            api,
            "--label",
            f"conveyor-{api}",
            "--num-prompts",
            "6",
            "--input-len-range",
            "8,24",
            "--output-len",
            "4",
            "--ignore-eos",
            "--request-rate",
            "inf,4",
            "--tokenizer",
            str(server.model_dir),
            "--goodput",
            "ttft:600000",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out_json.read_text())
    assert result["label"] == f"conveyor-{api}" and result["backend"] == api
    assert [run["request_rate"] for run in result["runs"]] == ["inf", 4.0]
    for run in result["runs"]:
        assert (run["completed"], run["failed"], run["errors"]) == (6, 0, {})
        assert run["total_output_tokens"] == 6 * 4
        assert all(run[key] is not None for key in METRICS), [k for k in METRICS if run[k] is None]
        assert run["request_goodput"] <= run["request_throughput"]
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    table = {line[:27].strip(): line[27:].split() for line in done.stdout.splitlines()}
    assert table["completed / failed"] == ["6", "/", "0", "6", "/", "0"]
    assert "at rate inf: 6/6 requests done" in done.stderr and "at rate 4: 6/6 requests done" in done.stderr


def test_prompts_are_seeded_and_token_exact(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    inputs, outputs = LengthSpec("uniform", low=5, high=60), LengthSpec("normal", mean=16, std=4)
    prompts = build_prompts(10, inputs, outputs, 3, tokenizer)
    assert prompts == build_prompts(10, inputs, outputs, 3, tokenizer)
    assert prompts != build_prompts(10, inputs, outputs, 4, tokenizer)
    assert all(5 <= p.prompt_len <= 60 and p.prompt_len == count_tokens(tokenizer, p.text) for p in prompts)
    assert all(p.exact and p.output_len >= 1 for p in prompts)
    # Without a tokenizer the same seed draws the same lengths (as words).
    assert [p.prompt_len for p in build_prompts(10, inputs, outputs, 3)] == [p.prompt_len for p in prompts]


def test_arrivals_follow_the_rate() -> None:
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = arrival_offsets(20, 4.0, 1.0, 7)
    assert poisson == arrival_offsets(20, 4.0, 1.0, 7)
    assert poisson == sorted(poisson) and poisson[-1] == pytest.approx(20 / 4.0)
    assert arrival_offsets(4, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])


async def _events(lines: list[bytes]) -> list[str]:
    async def body():
        for line in lines:
            yield line

    return [payload async for payload in sse_data(body())]


def test_sse_reader_stops_at_done_or_at_the_end() -> None:
    with_done = [b'data: {"a": 1}\n', b"\n", b": a comment\n", b"data: [DONE]\n", b"\n", b'data: {"late": 1}\n']
    assert asyncio.run(_events(with_done)) == ['{"a": 1}']
    without_done = [b"event: x\n", b'data: {"b":\n', b"data: 2}\n", b"\n", b'data: {"c": 3}\n']
    assert asyncio.run(_events(without_done)) == ['{"b":\n2}', '{"c": 3}']


def test_backends_count_only_content_chunks() -> None:
    chat, completions = backend("openai-chat"), backend("openai-completions")
    assert not chat.read({"choices": [{"delta": {"role": "assistant", "content": ""}}]}).token
    assert chat.read({"choices": [{"delta": {"content": "x"}}]}).token
    closing = completions.read(
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}
    )
    assert (closing.token, closing.prompt_tokens, closing.completion_tokens) == (False, 7, 4)
    assert completions.read({"error": {"message": "boom"}}).error == "boom"
    assert backend("tgi").read({"token": {"text": ""}, "details": {"generated_tokens": 3}}).completion_tokens == 3


def test_a_workload_may_ask_conveyor_for_no_drafts() -> None:
    prompt = Prompt(0, "hello", 1, 4, exact=True)
    off, schema_only = RequestOptions("m", speculate=0), RequestOptions("m", extra_fields=False, speculate=0)
    assert backend("openai-completions").body(prompt, off)["speculate"] == 0
    assert backend("tgi").body(prompt, off)["parameters"]["speculate"] == 0
    assert "speculate" not in backend("openai-chat").body(prompt, RequestOptions("m"))
    assert "speculate" not in backend("openai-completions").body(prompt, schema_only)  # a peer's schema


def test_metrics_follow_vllm_definitions(tmp_path: Path) -> None:
    ok = RequestRecord(0, 10, 5, True, ttft=0.1, itl=[0.05, 0.05, 0.1, 0.1], e2el=0.5)
    slow = RequestRecord(1, 20, 1, True, ttft=0.9, itl=[], e2el=0.9)
    failed = RequestRecord(2, 30, error="HTTP 429: overloaded")
    run = summarize([ok, slow, failed], 2.0, math.inf, 1.0, None, {"ttft": 500.0})
    assert (run.completed, run.failed, run.errors) == (2, 1, {"HTTP 429: overloaded": 1})
    assert (run.total_input_tokens, run.total_output_tokens) == (30, 6)
    assert (run.request_throughput, run.output_throughput, run.total_token_throughput) == (1.0, 3.0, 18.0)
    assert run.request_goodput == 0.5  # only the first meets TTFT <= 500 ms
    assert run.latencies["tpot"].mean == pytest.approx(100.0)  # (0.5 - 0.1) / (5 - 1); none for one token
    assert run.latencies["itl"].median == pytest.approx(75.0)
    assert run.latencies["e2el"].mean == pytest.approx(700.0)
    # Two stored results draw into one plot, one line per system.
    paths = []
    for label in ("a", "b"):
        paths.append(tmp_path / f"{label}.json")
        BenchmarkResult(label, "tgi", "http://x", "m", {}, [run]).write(paths[-1])
    out = tmp_path / "both.png"
    subprocess.run(
        [*benchmark_command(), "plot", *map(str, paths), "--out", str(out)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_compare_quick_runs_and_reports_what_it_skipped(tiny_model: Path, tmp_path: Path) -> None:
    """One Conveyor mode only (each costs a deployment, many seconds of CI), and int8 beside it;
    tests/e2e/test_scheduling.py serves every mode. float32 only, on any CPU: which systems a default run adds where
    oneDNN has bf16 is tests/unit/test_cpu.py's."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--quick",
            "--model-id",
            str(tiny_model),
            "--skip-transformers",
            "--skip-vllm",
            "--skip-llamacpp",
            "--systems",
            "continuous",
            "--dtypes",
            "float32",
            "--quantized",
            "int8",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert out.startswith(f"model: {tiny_model.name} ({tiny_model})\n"), out
    throughput = out.split("throughput workload (latencies in ms)")[1].split("\n\n")[0]
    rows = {line.split()[0]: line.split()[1:] for line in throughput.splitlines()[2:]}
    assert rows["conveyor-continuous"][0] == "8/0", out
    assert "skipped" in rows["transformers-serve"]
    results = tmp_path / tiny_model.name  # the model's own folder under --out
    summary = json.loads((results / "summary.json").read_text())
    assert summary["model"] == tiny_model.name
    sitting = json.loads((results / "sitting.json").read_text())  # what docs_tables needs beside the JSON
    assert sitting["command"].startswith(f".venv/bin/python -m benchmarks.compare --quick --model-id {tiny_model} ")
    assert str(tmp_path) in sitting["command"] and sitting["note"].startswith("One sitting at commit ")
    assert {s: v["status"] for s, v in summary["systems"].items()} == {
        "conveyor-continuous": "ok",
        "vllm-cpu": "skipped",
        "llama.cpp": "skipped",
        "transformers-serve": "skipped",
        "conveyor-continuous-int8": "ok",  # --quantized int8: Conveyor --quantize int8 against llama.cpp q8_0
        "llama.cpp-int8": "skipped",
    }
    assert (
        summary["bare_forward"]["bare forward"]["output_tokens"]
        == summary["systems"]["conveyor-continuous"]["throughput"]["total_output_tokens"]
    )
    verdicts = {t["name"]: t["passed"] for t in summary["targets"]}
    assert verdicts["continuous / transformers serve, output tok/s"] is None
    assert verdicts["continuous / vLLM-CPU, output tok/s"] is None
    assert verdicts["continuous / best of vLLM-CPU and llama.cpp, out tok/s"] is None
    assert verdicts["one stream: continuous / llama.cpp, median ITL"] is None
    assert verdicts["continuous / sequential, output tok/s"] is None  # not measured
    assert verdicts["bare decode step at the full batch / 82 ms"] is not None
    assert verdicts["one stream: continuous-int8 / best float dtype, out tok/s"] is not None  # both measured
    assert verdicts["one stream: continuous-int8 / llama.cpp-int8, median ITL"] is None
    bandwidth = summary["one_stream_bandwidth"]  # each one stream's weight reads against this sitting's plain read
    assert bandwidth["read_gb_s"] > 0 and bandwidth["weights"] > 0
    widths = {row["system"]: row["width"] for row in bandwidth["systems"]}
    assert widths == {"conveyor-continuous": "float32", "conveyor-continuous-int8": "int8"}
    assert all(0 < row["of_read"] for row in bandwidth["systems"])
    assert "one stream, drafts off, against a plain read of" in out
    # The single workload again with drafts off, against the bare forward at batch 1 in the same weights.
    for suffix in ("", "-int8"):
        assert (
            verdicts[f"one stream, drafts off: continuous{suffix} / bare forward at batch 1, decode tok/s"] is not None
        )
        no_drafts = json.loads((results / f"conveyor-continuous{suffix}-single-no-drafts.json").read_text())
        assert no_drafts["workload"]["speculate"] == 0
        one = summary["bare_forward"][f"bare forward, batch 1{suffix}"]
        assert (one["batch"], one["output_tokens"]) == (1, no_drafts["runs"][0]["total_output_tokens"])
    assert summary["long_prompts_short_streams"]["gaps"] > 0
    assert (results / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    assert (results / "conveyor-continuous-long.json").exists()


def test_compare_runs_the_real_model_then_the_demo_each_in_its_folder(tiny_model: Path, tmp_path: Path) -> None:
    """The default compares the real model first; a model's options differ from the run's only in its id, its
    directory and its folder. A directory given as --model-id is used as it is (nothing is prepared here)."""
    from benchmarks import compare

    assert compare.parse_args([]).model_id == ["real", "demo"]
    args = compare.parse_args(["--quick", "--model-id", f"{tiny_model},demo", "--out", str(tmp_path)])
    assert args.model_id == [str(tiny_model), "demo"]
    one = compare.for_model(args, str(tiny_model))
    assert (one.model_id, one.model_dir, one.out) == (str(tiny_model), tiny_model, tmp_path / tiny_model.name)
    assert {k: v for k, v in vars(one).items() if k not in ("model_id", "model_dir", "out")} == {
        k: v for k, v in vars(args).items() if k not in ("model_id", "out")
    }
    with pytest.raises(SystemExit):
        compare.parse_args(["--model-id", "demo,demo"])


def test_the_model_check_fails_loudly_on_a_model_that_cannot_answer(server: Server) -> None:
    """The benchmark's check before it times the real model, against the random-weight tiny model (a stand-in
    for a conversion that broke the weights): it stops the run, saying what was asked and answered."""
    from benchmarks import compare

    with pytest.raises(SystemExit, match="the model check failed: asked 'What is the capital of France"):
        compare.check_answer(server.url, str(server.model_dir))


# --- structured output (benchmarks/grammar.py) -------------------------------------------------------------------


def test_grammar_benchmark_prints_both_tables(tiny_model: Path) -> None:
    """Tiny sizes: both tables come out, one row per batch size and one per engine, and an engine that is not
    installed is listed as skipped (CI has only llguidance). Constrained rows are cut after 6 tokens, so that
    running them to their end costs nothing; whether they end in valid JSON is tests/e2e/test_structured_output.py's."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.grammar",
            "--model-id",
            str(tiny_model),
            "--batch-sizes",
            "1,2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--walk-steps",
            "2",
            "--large-properties",
            "2",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    decode, engines = out.split("\n\n")[:2]
    rows = {cells[0]: cells[1:] for cells in map(str.split, decode.splitlines()[2:-1])}
    assert set(rows) == {"1", "2"}
    for batch, cells in rows.items():
        admitted = int(batch) + int(cells[5])  # the first batch plus the rows readmitted into it
        assert cells[6].endswith(f"/{admitted}"), decode
    assert decode.splitlines()[-1].startswith("target: mask <= 10% of the step at batch 2:")
    lines = {line.split()[0]: line.split()[1:] for line in engines.splitlines()[2:]}
    assert set(lines) == {"llguidance", "xgrammar", "outlines-core"}
    assert len(lines["llguidance"]) == 5 and all(float(c) >= 0 for c in lines["llguidance"])
    for name in ("xgrammar", "outlines-core"):
        assert len(lines[name]) == 5 or lines[name][0] == "skipped:", engines


def test_gguf_declares_gpt2_splitting_only_for_plain_byte_level_tokenizers(tmp_path: Path) -> None:
    from benchmarks import gguf

    def tokenizer(pre: dict | None, normalizer: dict | None = None) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre, "normalizer": normalizer}))
        return folder

    assert gguf.byte_level(tokenizer({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}))
    assert not gguf.byte_level(tokenizer({"type": "ByteLevel", "use_regex": False}))
    assert not gguf.byte_level(tokenizer({"type": "Metaspace"}))
    assert not gguf.byte_level(tokenizer({"type": "ByteLevel"}, {"type": "NFC"}))
    assert not gguf.byte_level(tmp_path / "absent")


def test_llamacpp_is_skipped_with_the_reason_where_its_venv_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from benchmarks import deploy

    monkeypatch.setenv("CONVEYOR_LLAMACPP_PYTHON", str(tmp_path / "bin" / "python"))
    assert "make bench" in deploy.llamacpp_problem()


def test_speculation_benchmark_measures_drafts_off_and_on(tiny_model: Path, tmp_path: Path) -> None:
    """One round on the tiny model without llama.cpp: a row per Conveyor system, workload and concurrency, every
    request served, and drafts verified only where they are on (their acceptance is the real model's business)."""
    results = tmp_path / "speculation.json"
    flags = ["--rounds", "1", "--concurrency", "1", "--max-tokens", "8", "--skip-llamacpp", "--draft-quantize", "float"]
    flags += ["--no-fixed"]  # one deployment fewer: the fixed policy is the same server with one flag more
    flags += ["--json", str(results)]
    command = [sys.executable, "-m", "benchmarks.speculation", "--model-id", str(tiny_model), *flags]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.splitlines()[0].startswith("| system | workload | streams |")
    rows = json.loads(results.read_text())
    assert set(rows) == {f"conveyor-{s}/{w}/1" for s in ("off", "ngram", "draft-float") for w in ("chat", "edit")}
    for key, row in rows.items():
        assert row["failed"] == 0 and row["tok_s"] > 0, (key, row)
    assert rows["conveyor-off/chat/1"]["drafted"] == rows["conveyor-off/edit/1"]["drafted"] == 0


def test_embeddings_benchmark_serves_every_input(tmp_path: Path) -> None:
    """benchmarks/embeddings.py on a tiny embedder, Conveyor alone: every input embedded (a failed request fails
    the run), a rate per round."""
    from benchmarks import embedding_model

    model = embedding_model.ensure(tmp_path / "embedder", "tiny")
    results = tmp_path / "embeddings.json"
    flags = ["--model-dir", str(model), "--systems", "conveyor", "--inputs", "3", "--tokens", "24", "--rounds", "1"]
    command = [sys.executable, "-m", "benchmarks.embeddings", *flags, "--json", str(results)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "inputs of 24 tokens" in out and "conveyor" in out
    result = json.loads(results.read_text())
    assert list(result["inputs_per_second"]) == ["conveyor"] and result["inputs_per_second"]["conveyor"][0] > 0
    assert result["tokens"] == 24 and result["vectors"] == {}


def test_long_context_runs_both_workloads_and_reports_missing_peers(tiny_model: Path, tmp_path: Path) -> None:
    """benchmarks/long_context.py on the tiny model, small, Conveyor's weights in int8: Conveyor (and over an int8
    KV cache) serves every document and question, a peer
    that is not installed is reported as skipped, and the targets are stated against what was measured."""
    env = dict(
        os.environ, CONVEYOR_VLLM_PYTHON=str(tmp_path / "no-vllm"), CONVEYOR_LLAMACPP_PYTHON=str(tmp_path / "no")
    )
    # fmt: off
    flags = [
        "--model-id", str(tiny_model), "--documents", "3", "--document-len", "120", "--document-output", "8",
        "--in-flight", "2", "--prefix-len", "100", "--questions", "3", "--question-len", "6", "--prefix-output", "4",
        "--quantize", "int8", "--out", str(tmp_path),
    ]
    # fmt: on
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.long_context", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=env,
    ).stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quantize"] == "int8" and "Conveyor's weights int8" in out  # Conveyor's, as its launcher took
    for system in ("conveyor", "conveyor-kv-int8"):  # the second over an 8-bit KV cache
        ours = summary["systems"][system]
        assert ours["documents"]["failed"] == 0 and ours["prefix"]["failed"] == 0
        assert ours["documents"]["prefill_tok_s"] > 0 and ours["prefix"]["ttft_cold_ms"] > 0
    assert "make bench" in summary["systems"]["vllm-cpu"]["skipped"]
    assert "make bench" in summary["systems"]["llama.cpp"]["skipped"]
    documents = json.loads((tmp_path / "conveyor-documents.json").read_text())
    assert documents["runs"][0]["completed"] == 3
    assert "prefix: cached TTFT / cold TTFT" in out
    assert "documents wall time" not in out  # no peer measured: no ratio against one


def test_prefix_restart_measures_both_modes(tiny_model: Path, tmp_path: Path) -> None:
    """benchmarks/prefix_restart.py on the tiny model with a short prefix: both deployments are started, their
    shard killed and restarted, and every request answered (the figures themselves are the benchmark's to judge)."""
    out = tmp_path / "restart.json"
    flags = ["--model-id", str(tiny_model), "--prefix-len", "80", "--out", str(out)]
    subprocess.run(
        [sys.executable, "-m", "benchmarks.prefix_restart", *flags],
        check=True,
        timeout=600,
        capture_output=True,
    )
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"memory only", "disk tier"}
    for figures in modes.values():
        assert set(figures) == {"cold_ms", "cached_ms", "after_restart_ms", "next_ms"}
        assert all(v > 0 for v in figures.values())


def test_placement_measures_both_placements(tiny_model: Path, tmp_path: Path) -> None:
    """benchmarks/placement.py on the tiny model, quick: a two-group deployment of each placement answers every
    turn of every conversation, and the report names the CPU and gives each one's hit rate, TTFT and tok/s (which
    placement wins is the benchmark's to say, on a quiet machine)."""
    flags = ["--model-id", str(tiny_model), "--quick", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.placement", *flags], check=True, timeout=600, capture_output=True, text=True
    ).stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    requests = summary["workload"]["conversations"] * summary["workload"]["turns"]
    assert [r["placement"] for r in summary["rounds"]] == ["cache-aware", "round-robin"]
    for run in summary["rounds"]:
        assert run["requests"] == requests and run["failed"] == 0, run
        assert 0 <= run["hit_rate"] <= 1 and run["query_tokens"] > 0
        assert run["ttft_p50_ms"] > 0 and run["output_tok_s"] > 0
        reasons = {key.split("/")[1] for key in run["placed"]}  # each run placed by its own --placement
        assert reasons <= ({"round_robin"} if run["placement"] == "round-robin" else {"prefix", "load"}), run
    assert set(summary["median"]) == {"cache-aware", "round-robin"}
    for text in (out, (tmp_path / "summary.md").read_text()):
        assert summary["machine"]["cpu"] in text
        assert all(column in text for column in ("hit rate", "TTFT p50 ms", "out tok/s"))


def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py as a lent GPU runs it, on the CPU and small (--quick): every section gives its
    figures, so the script a GPU machine gets one call to run has run here first."""
    out = tmp_path / "gpu-check"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    results = json.loads((out / "gpu_check.json").read_text())
    failed = {name: figures.get("error") for name, figures in results.items() if not figures["ok"]}
    assert done.returncode == 0 and not failed, (failed, done.stderr[-3000:])
    sections = {"plan", "device", "bandwidth", "serving", "bare", "transformers", "roofline", "launch"}
    assert set(results) == sections and sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    for run in results["serving"].values():
        if isinstance(run, dict):
            assert run["completed"] > 0 and run["failed"] == 0 and run["output_throughput"] > 0, run
    assert results["bare"]["batch_1"]["output_throughput"] > 0 and results["transformers"]["batch_4"]["ms_per_token"]
    assert results["roofline"]["min_ms_per_token"] > 0 and results["launch"]["cuda_graphs"] is False
