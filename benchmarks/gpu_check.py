"""`python -m benchmarks.gpu_check --device cuda --out DIR`: the GPU path measured in one call.

A lent GPU machine gives about 15 minutes, all tries together, and reaches nothing outside it, so this is prepared
here and run there by `benchmarks/gpu/run.sh` (`make gpu-check`), after the CUDA test subset (the oracle and the
features through the server). CI runs it with `--device cpu --quick` on the tiny model, so that it cannot rot.

Each section below is one entry of DIR/gpu_check.json, its figures or the error that stopped it, so that one failure
does not hide the rest; DIR/gpu_check.md is the same as a table.

- device: what torch sees; bandwidth: a device-to-device copy, bytes read and written per second;
- serving: a ~1B random-weight Llama (the `1b` demo model) through the launcher: a saturated run and one stream,
  output tok/s and TPOT, read by the load generator (benchmarks/serve.py);
- bare: the same model's bare forward (benchmarks/bare.py, through conveyor.shard.offline) at both batch sizes;
- transformers: its own `generate()`, batched and alone, on the same device and dtype;
- roofline: the weights' bytes over the copy bandwidth, the least time per token one stream can take;
- launch: the engine captures no CUDA graphs, so a decode step at batch 1 pays a launch per kernel: its wall time
  against the time its kernels ran (torch.profiler), the share a graph could win back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import bare, deploy
from benchmarks.progress import note

PREFILL_BUDGET = 8192  # prompt tokens per bare step: a saturated batch's prompts join in one or two steps


@dataclass(frozen=True)
class Plan:
    """How big each part is: the GPU's sizes, or the quick ones CI can afford on a CPU."""

    size: str  # the demo model's size
    dtype: str
    batch: int  # the saturated run's concurrency, and the bare and batched generate() batch
    prompts: int  # requests of the saturated run
    input_len: int
    output_len: int
    copy_bytes: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls("tiny", "float32", 4, 8, 16, 8, 16 << 20)
        return cls("1b", "bfloat16", 64, 256, 128, 128, 1 << 30)


def section(results: dict[str, Any], name: str, work: Callable[[], dict[str, Any]], out: Path) -> None:
    """Runs one section; its figures, or the error that stopped it, go under `name`, and the results so far are
    written at once: a run cut short by its time limit still brings back what it measured."""
    note(f"gpu check: {name}")
    start = time.perf_counter()
    try:
        results[name] = {"ok": True, **work()}
    except Exception as exc:  # noqa: BLE001 - a failed section is a result, and the next sections still run
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - start, 1)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "gpu_check.md").write_text(report(results))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = round(props.total_memory / 2**30, 1)
        facts.update(name=props.name, memory_gib=memory, capability=[props.major, props.minor])
        facts["cuda"] = torch.version.cuda
    return facts


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Bytes read plus bytes written per second by a device-to-device copy (the figure a roofline divides by)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"bytes": nbytes, "gb_per_s": round(2 * nbytes * repeats / seconds / 1e9, 1)}


def load_run(url: str, model_dir: Path, concurrency: int, prompts: int, plan: Plan, out: Path) -> dict[str, Any]:
    """One run of the load generator: every request streams `output_len` tokens, EOS ignored."""
    command = [sys.executable, "-m", "benchmarks.serve", "--base-url", url, "--backend", "tgi", "--quiet"]
    command += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf"]
    command += ["--input-len-range", f"{plan.input_len},{plan.input_len}", "--output-len", str(plan.output_len)]
    command += ["--ignore-eos", "--tokenizer", str(model_dir), "--json", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    run = json.loads(out.read_text())["runs"][0]
    keys = ("completed", "failed", "output_throughput", "median_tpot_ms", "median_ttft_ms")
    return {key: round(run[key], 2) if isinstance(run[key], float) else run[key] for key in keys}


def serving(model_dir: Path, device: torch.device, plan: Plan, scratch: Path) -> dict[str, Any]:
    flags = ["--dtype", plan.dtype, "--device", device.type, "--max-batch-size", str(plan.batch)]
    spec = deploy.ConveyorSpec("conveyor-gpu-check", model_dir, flags)
    with deploy.conveyor(spec, timeout=600) as url:
        load_run(url, model_dir, 1, 1, plan, scratch / "warmup.json")
        saturated = load_run(url, model_dir, plan.batch, plan.prompts, plan, scratch / "saturated.json")
        alone = load_run(url, model_dir, 1, 4, plan, scratch / "one_stream.json")
    return {"saturated": saturated, "one_stream": alone}


def texts(count: int, words: int) -> list[str]:
    return [" ".join(f"word{(i * 7 + j) % 97}" for j in range(words)) for i in range(count)]


def bare_forward(model_dir: Path, device: torch.device, plan: Plan, kept: dict[str, Any]) -> dict[str, Any]:
    """The bare loop (benchmarks/bare.py) at the saturated batch and at 1, on one load of the model, which the launch
    section uses next (`kept`): a 1B model loads in seconds, and the call has minutes."""
    loop = bare.BareLoop(model_dir, plan.batch, plan.dtype, device=str(device))
    kept["engine"] = loop.engine
    figures = {}
    for batch in (plan.batch, 1):
        loop.batch = batch
        prompts = [loop.tokenize(text) for text in texts(2 * batch, plan.input_len)]
        loop.run([(prompt, 2) for prompt in prompts[:batch]], PREFILL_BUDGET)  # warm
        result = loop.run([(prompt, plan.output_len) for prompt in prompts], PREFILL_BUDGET)
        figures[f"batch_{batch}"] = {
            "output_throughput": round(result.output_throughput, 1),
            "median_decode_step_ms": round(result.median_full_decode_step_ms or 0.0, 3),
        }
    return figures


def transformers_generate(model_dir: Path, device: torch.device, plan: Plan) -> dict[str, Any]:
    """generate() on prompts of one length (no padding), greedy, every row to `output_len` tokens."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, plan.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    figures: dict[str, Any] = {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    vocab = model.config.vocab_size
    for batch in (plan.batch, 1):
        ids = torch.randint(100, vocab, (batch, plan.input_len), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        kwargs = {"max_new_tokens": plan.output_len, "min_new_tokens": plan.output_len, "do_sample": False}
        with torch.inference_mode():
            warm = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
            model.generate(ids, attention_mask=torch.ones_like(ids), **warm)
            synchronize(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            synchronize(device)
        seconds = time.perf_counter() - start
        figures[f"batch_{batch}"] = {
            "output_throughput": round(batch * plan.output_len / seconds, 1),
            "ms_per_token": round(seconds / plan.output_len * 1000, 2),  # the prompt's prefill included
        }
    return figures


def roofline(weight_bytes: int, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """One stream reads every weight once per token: that many bytes at the copy's rate is its floor."""
    step_ms = weight_bytes / (bandwidth["gb_per_s"] * 1e9) * 1000
    return {"weight_bytes": weight_bytes, "min_ms_per_token": round(step_ms, 3), "max_tok_s": round(1000 / step_ms, 1)}


def launch_cost(
    model_dir: Path, device: torch.device, plan: Plan, kept: dict[str, Any], steps: int = 20
) -> dict[str, Any]:
    """A decode step at batch 1 on the bare forward: wall time against its kernels' own time."""
    from conveyor.shard import offline

    engine = kept.get("engine") or offline.load(model_dir, plan.dtype, device=str(device))
    prompt = list(range(100, 100 + plan.input_len))
    blocks = -(-(len(prompt) + 2 * steps + 3) // engine.block_size)
    cache, table = engine.allocate(blocks), list(range(blocks))
    last = torch.tensor([len(prompt) - 1])
    token = offline.greedy(offline.forward(engine, cache, [(prompt, table, 0)], last))[0].tolist()

    def decode(position: int) -> None:
        offline.greedy(offline.forward(engine, cache, [(token, table, position)], torch.tensor([0])))
        synchronize(device)

    for k in range(3):
        decode(len(prompt) + k)
    start = time.perf_counter()
    for k in range(steps):
        decode(len(prompt) + k)
    wall_ms = (time.perf_counter() - start) / steps * 1000
    figures: dict[str, Any] = {"cuda_graphs": False, "wall_ms_per_step": round(wall_ms, 3)}
    if device.type != "cuda":
        return {**figures, "kernel_ms_per_step": None}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            decode(len(prompt) + k)
    kernel_us = sum(event.self_device_time_total for event in prof.key_averages())
    kernel_ms = kernel_us / 1000 / steps
    return {**figures, "kernel_ms_per_step": round(kernel_ms, 3), "launch_share": round(1 - kernel_ms / wall_ms, 3)}


def report(results: dict[str, Any]) -> str:
    """The figures as a markdown list, a line a section."""
    lines = ["# GPU check", ""]
    for name, figures in results.items():
        shown = {k: v for k, v in figures.items() if k != "trace"}
        lines.append(f"- **{name}**: `{json.dumps(shown)}`")
    return "\n".join(lines) + "\n"


def run(device: torch.device, plan: Plan, out: Path) -> dict[str, Any]:
    from conveyor import demo_model
    from conveyor.paths import cache_root

    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "scratch"
    scratch.mkdir(exist_ok=True)
    results: dict[str, Any] = {"plan": {"ok": True, **plan.__dict__}}
    section(results, "device", lambda: device_facts(device), out)
    model_dir = demo_model.ensure(cache_root() / f"demo-{plan.size}", plan.size)
    section(results, "bandwidth", lambda: copy_bandwidth(device, plan.copy_bytes), out)
    section(results, "serving", lambda: serving(model_dir, device, plan, scratch), out)
    kept: dict[str, Any] = {}  # the bare loop's engine, for the launch section
    section(results, "bare", lambda: bare_forward(model_dir, device, plan, kept), out)
    section(results, "transformers", lambda: transformers_generate(model_dir, device, plan), out)
    if results["bandwidth"]["ok"] and results["transformers"]["ok"]:
        weights = results["transformers"]["weight_bytes"]
        section(results, "roofline", lambda: roofline(weights, results["bandwidth"]), out)
    section(results, "launch", lambda: launch_cost(model_dir, device, plan, kept), out)
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (a lent GPU) or cpu (the dry run)")
    parser.add_argument("--quick", action="store_true", help="the tiny model and small runs: CI's dry run")
    parser.add_argument("--out", type=Path, required=True, help="the folder for gpu_check.json and gpu_check.md")
    args = parser.parse_args(argv)
    results = run(torch.device(args.device), Plan.of(args.quick), args.out)
    failed = [name for name, figures in results.items() if not figures["ok"]]
    print(report(results), end="")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
