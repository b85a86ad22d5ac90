"""LoRA adapters under load: saturated output tokens per second with every request on a different one of four
adapters, against the base model alone, on one deployment and the same workload.

Four random PEFT adapters are built for the model once (rank 16 on every projection, cached under
CONVEYOR_CACHE/lora), served with `--lora-adapters`. The workload is the comparison's saturated one (64
requests of 16-64 prompt tokens and 128 output tokens, `ignore_eos`, 32 in flight, through /v1/completions).
The base cell names the model; the adapters cell names adapter i % 4 for request i, so every decode step mixes
all four. Cells alternate (base, adapters, adapters, base, ...) against the VM's drift.

    python -m benchmarks.lora [--model-id real|demo|DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import deploy
from benchmarks.backends import CompletionsBackend, RequestOptions
from benchmarks.client import RequestRecord, send
from benchmarks.compare import resolve
from benchmarks.progress import note
from benchmarks.workload import LengthSpec, Prompt, build_prompts
from conveyor import cpu
from conveyor.paths import cache_root

ADAPTERS = 4
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(model_dir: Path) -> dict[str, Path]:
    """Four random adapters for `model_dir`, built the first time (peft's own save format)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = cache_root() / "lora" / model_dir.name
    adapters = {f"bench{i}": folder / f"bench{i}" for i in range(ADAPTERS)}
    for i, (name, path) in enumerate(adapters.items()):
        if (path / "adapter_model.safetensors").exists():
            continue
        note(f"building adapter {name} for {model_dir.name}")
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(path)
    return adapters


class PerRequestModel(CompletionsBackend):
    """Completions whose `model` is chosen per request: request i names models[i % len(models)]."""

    def __init__(self, models: list[str]) -> None:
        self.models = models

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        return {**super().body(prompt, options), "model": self.models[prompt.index % len(self.models)]}


async def run_cell(url: str, backend: PerRequestModel, prompts: list[Prompt], concurrency: int) -> dict[str, float]:
    options = RequestOptions(model="", ignore_eos=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: Prompt) -> RequestRecord:
            async with gate:
                return await send(session, url, backend, prompt, options)

        start = time.monotonic()
        records = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.monotonic() - start
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    return {"output_tokens": sum(r.output_len for r in records), "seconds": elapsed}


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    adapters = build_adapters(model_dir)
    flag = ",".join(f"{name}={path}" for name, path in adapters.items())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = build_prompts(
        args.requests, LengthSpec("uniform", low=16, high=64), LengthSpec("fixed", 128), 0, tokenizer
    )
    cells: dict[str, list[float]] = {"base": [], "adapters": []}
    flags = ["--lora-adapters", flag, "--max-loras", str(ADAPTERS), *args.launcher_arg]
    with deploy.conveyor(deploy.ConveyorSpec("conveyor-lora", model_dir, flags), args.timeout) as url:
        backends = {"base": PerRequestModel([str(model_dir)]), "adapters": PerRequestModel(list(adapters))}
        asyncio.run(run_cell(url, backends["adapters"], prompts[:4], 4))  # warm: every adapter once
        for round_ in range(args.rounds):
            order = ["base", "adapters"] if round_ % 2 == 0 else ["adapters", "base"]
            for name in order:
                note(f"round {round_ + 1}: {name}")
                cell = asyncio.run(run_cell(url, backends[name], prompts, args.concurrency))
                cells[name].append(cell["output_tokens"] / cell["seconds"])
    base, mixed = statistics.median(cells["base"]), statistics.median(cells["adapters"])
    here = cpu.probe()
    return {
        "model": model_dir.name,
        "cpu": {"model": here.model, "cores": here.cores, "avx512": here.avx512, "amx": here.amx},
        "workload": {"requests": args.requests, "output_tokens": 128, "concurrency": args.concurrency},
        "adapters": {"count": ADAPTERS, "rank": RANK, "targets": TARGETS},
        "tok_s": {name: [round(v, 1) for v in values] for name, values in cells.items()},
        "median_tok_s": {"base": round(base, 1), "adapters": round(mixed, 1)},
        "ratio": round(mixed / base, 3),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default="real", help="real (SmolLM2-135M-Instruct), demo, or a model directory")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--launcher-arg", action="append", default=[], help="a further launcher flag, e.g. --dtype=bfloat16")
    p.add_argument("--output", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = resolve(args.model_id, "small")
    results = measure(Path(model_dir), args)
    print(json.dumps(results, indent=2))
    print(
        f"| {results['model']} | base {results['median_tok_s']['base']} tok/s | 4 adapters "
        f"{results['median_tok_s']['adapters']} tok/s | {results['ratio']}x |"
    )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
