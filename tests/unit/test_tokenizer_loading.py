"""The router's tokenizer is AutoTokenizer's, and a start that knows the checkpoint gets it without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conveyor.router.pipeline import tokenizer_loading
from conveyor.router.pipeline.tokenizer_loading import load_tokenizer

TEXTS = ["def add(a, b):\n    return a + b", "  two  spaces, <s> a special token, and ünïcode"]

# (declared tokenizer class, the config's model type): AutoTokenizer takes a different branch for each.
DECLARED = [
    ("TokenizersBackend", "llama"),
    ("LlamaTokenizerFast", "llama"),
    ("GPT2Tokenizer", "llama"),
    ("PreTrainedTokenizerFast", "qwen2"),
    ("Qwen2Tokenizer", "qwen2"),
    (None, "llama"),
    (None, "gemma3_text"),
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-classes"


def checkpoint(source: Path, to: Path, declared: str | None, model_type: str) -> Path:
    """The tiny model's tokenizer files with another declared class and model type (no weights: none are read)."""
    to.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, to / name)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    if declared is None:
        tokenizer_config.pop("tokenizer_class")
    else:
        tokenizer_config["tokenizer_class"] = declared
    (to / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((source / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return to


def same(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids
    assert a.all_special_ids == b.all_special_ids
    chat = [{"role": "user", "content": TEXTS[0]}]
    assert a.apply_chat_template(chat, tokenize=False) == b.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("declared, model_type", DECLARED)
def test_the_tokenizer_is_autotokenizers_when_first_seen_and_when_known(
    tiny_model: Path, tmp_path: Path, cache: Path, declared: str | None, model_type: str
) -> None:
    model = checkpoint(tiny_model, tmp_path / "model", declared, model_type)
    reference = AutoTokenizer.from_pretrained(model)
    first = load_tokenizer(model)
    assert len(list(cache.iterdir())) == 1
    known = load_tokenizer(model)
    same(first, reference)
    same(known, reference)


def test_a_known_checkpoint_loads_without_torch_or_autotokenizer(tiny_model: Path, cache: Path) -> None:
    load_tokenizer(tiny_model)
    probe = (
        "import sys\n"
        "from conveyor.router.pipeline.tokenizer_loading import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(tiny_model)!r})\n"
        "print(type(tokenizer).__name__, 'torch' in sys.modules,"
        " 'transformers.models.auto.tokenization_auto' in sys.modules)\n"
    )
    env = {"CONVEYOR_CACHE": str(cache.parent), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [type(AutoTokenizer.from_pretrained(tiny_model)).__name__, "False", "False"]


def test_an_edited_checkpoint_is_a_new_entry(tiny_model: Path, tmp_path: Path, cache: Path) -> None:
    model = checkpoint(tiny_model, tmp_path / "model", "TokenizersBackend", "llama")
    load_tokenizer(model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "GPT2Tokenizer"}))
    same(load_tokenizer(model), AutoTokenizer.from_pretrained(model))
    assert len(list(cache.iterdir())) == 2


@pytest.mark.parametrize(
    "recorded", ["os:system", "transformers.nothing_here:Tokenizer", "transformers:AutoConfig", ""]
)
def test_an_entry_that_names_no_tokenizer_class_is_ignored(tiny_model: Path, cache: Path, recorded: str) -> None:
    cache.mkdir(parents=True)
    tokenizer_loading.cache_entry(tiny_model).write_text(recorded)
    same(load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model))
    assert tokenizer_loading.cache_entry(tiny_model).read_text().startswith("transformers.")
