"""A Hugging Face model directory as GGUF, for the llama.cpp peer, by llama.cpp's own `convert_hf_to_gguf.py`.

Run by path with the llama.cpp venv's Python, which has the converter's source and its `gguf` package (`make
bench` puts them there) and no conveyor:

    .venv-llamacpp/bin/python benchmarks/gguf.py CONVERTER MODEL_DIR OUT.gguf --outtype f32

One thing is ours: the converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test string,
and refuses hashes it has no entry for, which every tokenizer trained here (the demo and test models) is. Such a
tokenizer whose tokenizer.json says plain byte-level splitting (GPT-2's regex) is declared `gpt-2`, the
pre-tokenizer llama.cpp then applies; anything else is still refused, as the converter would. A tokenizer llama.cpp
knows keeps the converter's own answer: the real model's (benchmarks/real_model.py), as transformers' GGUF reader
rebuilds it, encodes the test string exactly as SmolLM's does, so it is recognised as `smollm`.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def byte_level(model_dir: Path) -> bool:
    """Whether the tokenizer splits as GPT-2 does: a ByteLevel pre-tokenizer with its regex and nothing before."""
    try:
        spec = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    pre = spec.get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and spec.get("normalizer") is None


def convert(converter: Path, model_dir: Path, out: Path, outtype: str) -> None:
    sys.path.insert(0, str(converter.parent))
    from conversion import base  # the converter's own package, beside it

    recognise = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            if byte_level(model_dir):
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(converter), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(converter), run_name="__main__")


def main() -> None:
    converter, model_dir, out = (Path(a) for a in sys.argv[1:4])
    outtype = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--outtype" else "f32"
    convert(converter, model_dir, out, outtype)


if __name__ == "__main__":
    main()
