"""Time to first token for one 896 x 896 image: Conveyor beside llama.cpp's server (libmtmd), on the same
random-weight Gemma 3 image-text checkpoint, in one sitting.

The checkpoint pairs Gemma 3 4B's vision tower shape (SigLIP so400m at 896 pixels: 27 layers of width 1152 over
4,096 patches, pooled to 256 soft tokens) with the demo's small text model, so the figure is the image's cost, as
a user of Gemma 3 pays it, with nothing downloaded. It is written in the Hub's layout (the tower under
`vision_tower.vision_model.`, as Google's checkpoints are), which llama.cpp's converter reads into a text GGUF and
an `--mmproj` one; both servers run float32 on every core.

Each request is one OpenAI chat with a fresh JPEG (so no cache of either server can answer it) and a line of text,
`max_tokens` 1: its latency is the time to first token. Systems alternate within each round after an untimed
request each.

    python -m benchmarks.image_ttft [--rounds 2]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import deploy
from benchmarks.compare_report import machine, machine_line
from benchmarks.progress import note
from conveyor import paths

START_TIMEOUT = 900.0
REQUEST_TIMEOUT = 900.0
# Gemma 3 4B's vision tower (its config.json's vision_config) and its soft tokens per image.
TOWER = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 896,
    "patch_size": 14,
    "vision_use_head": False,
}
SOFT_TOKENS = 256
HUB_TOWER = "vision_tower.vision_model."


def build(out: Path) -> Path:
    """The checkpoint (once): the demo's small Gemma 3 image-text model with Gemma 3 4B's tower, random weights."""
    return paths.build_once(out, _write_checkpoint, "the image benchmark's Gemma 3 checkpoint")


def _write_checkpoint(model: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from conveyor import demo_model

    with tempfile.TemporaryDirectory() as scratch:
        base = demo_model.build(Path(scratch) / "base", "small", arch="gemma3-multimodal")
        fields = json.loads((base / "config.json").read_text())
        fields["vision_config"].update(TOWER)
        fields["mm_tokens_per_image"] = SOFT_TOKENS
        config = Gemma3Config(**{k: v for k, v in fields.items() if k not in ("architectures", "transformers_version")})
        note("image_ttft: writing a random-weight Gemma 3 with Gemma 3 4B's vision tower")
        torch.manual_seed(0)
        Gemma3ForConditionalGeneration(config).save_pretrained(model)
        for file in base.iterdir():
            if file.is_file() and file.name not in ("config.json", "model.safetensors", "conveyor_demo.json"):
                shutil.copy(file, model / file.name)
        processor = json.loads((base / "processor_config.json").read_text())
    processor["image_processor"]["size"] = {"height": TOWER["image_size"], "width": TOWER["image_size"]}
    processor["image_seq_length"] = SOFT_TOKENS
    (model / "processor_config.json").write_text(json.dumps(processor, indent=2))
    weights = model / "model.safetensors"
    tensors = {_hub_name(name): t for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})


def _hub_name(name: str) -> str:
    return HUB_TOWER + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") else name


def mmproj(model_dir: Path) -> Path:
    """The vision tower and projector as llama.cpp's `--mmproj` GGUF, by its own converter (once)."""
    out = model_dir.with_name(model_dir.name + "-mmproj-f32.gguf")
    if not out.exists():
        note("image_ttft: converting the vision tower with llama.cpp's converter (--mmproj)")
        partial = out.with_suffix(".partial")
        command = [str(deploy.llamacpp_python()), str(deploy.llamacpp_converter()), str(model_dir), "--mmproj"]
        command += ["--outfile", str(partial), "--outtype", "f32"]
        subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, **deploy.OFFLINE))
        partial.rename(out)
    return out


def jpeg(seed: int) -> str:
    """A photo-sized 896 x 896 JPEG data URL, different for every seed."""
    from PIL import Image

    rng = random.Random(seed)
    small = Image.new("RGB", (56, 56))
    small.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(56 * 56)])
    buffer = io.BytesIO()
    small.resize((896, 896), Image.BICUBIC).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def first_token_seconds(url: str, model: str, seed: int) -> float:
    content = [{"type": "image_url", "image_url": {"url": jpeg(seed)}}, {"type": "text", "text": "Describe this."}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as answer:
        json.loads(answer.read())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time to first token for one 896 x 896 image, beside llama.cpp.")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model_dir = build(paths.cache_root() / "image-ttft-gemma3")
    with contextlib.ExitStack() as stack:
        urls = {
            "conveyor": stack.enter_context(deploy.conveyor(deploy.ConveyorSpec("conveyor", model_dir), START_TIMEOUT))
        }
        if isinstance(problem := deploy.llamacpp_server(), Path):
            extra = ["--mmproj", str(mmproj(model_dir))]
            urls["llama.cpp"] = stack.enter_context(
                deploy.llamacpp_serve(model_dir, "float32", 1, 2048, START_TIMEOUT, extra)
            )
        else:
            note(f"image_ttft: llama.cpp skipped ({problem})")
        for url in urls.values():  # untimed: each server's first image
            first_token_seconds(url, str(model_dir), seed=1000)
        times: dict[str, list[float]] = {name: [] for name in urls}
        for round_ in range(1, args.rounds + 1):
            for name, url in urls.items():
                times[name].append(first_token_seconds(url, str(model_dir), seed=round_ * 10 + len(name)))
                note(f"image_ttft: round {round_} {name} {times[name][-1]:.2f} s")
    print(machine_line(machine()))
    print(f"{'system':<10} {'TTFT s (each round)':<24} median")
    for name, each in times.items():
        print(f"{name:<10} {' / '.join(f'{s:.2f}' for s in each):<24} {statistics.median(each):.2f}")


if __name__ == "__main__":
    main()
