"""The router's tokenizer: the class AutoTokenizer picks, without AutoTokenizer's import cost on a known checkpoint.

AutoTokenizer decides the class from the checkpoint's files (the model type's registered class, the declared one,
byte-level checks), and deciding imports every model configuration, torch and torch.distributed.tensor: ~3 s of CPU
at every router start, for a process that uses none of them (the shards start on the same cores). The class it
chose is remembered per checkpoint, keyed by the contents of its small files (configs, vocabularies, templates) and
transformers' version, in CONVEYOR_CACHE; a later start imports that class alone and loads it as AutoTokenizer
would have. A missing, unreadable or stale entry means AutoTokenizer, as before.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from pathlib import Path

from conveyor.paths import cache_root

log = logging.getLogger(__name__)

# The files a tokenizer class choice can depend on: everything but the weights (which can be large) qualifies.
KEY_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".tiktoken")


def load_tokenizer(model_dir: Path | str):
    """The tokenizer AutoTokenizer.from_pretrained(model_dir) gives."""
    model_dir = Path(model_dir)
    entry = cache_entry(model_dir)
    cls = _remembered(entry)
    if cls is not None:
        return cls.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _remember(entry, type(tokenizer))
    return tokenizer


def cache_entry(model_dir: Path) -> Path:
    """Where the class AutoTokenizer picks for this checkpoint is remembered."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    for path in sorted(p for p in model_dir.iterdir() if p.suffix in KEY_SUFFIXES and p.is_file()):
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return cache_root() / "tokenizer-classes" / digest.hexdigest()


def _remembered(entry: Path) -> type | None:
    """The class recorded in `entry`, if it is one of transformers' tokenizer classes."""
    try:
        module, _, name = entry.read_text().strip().partition(":")
    except OSError:
        return None
    if not module.startswith("transformers."):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _remember(entry: Path, cls: type) -> None:
    if "." in cls.__qualname__ or not cls.__module__.startswith("transformers."):
        return  # only a module-level class of transformers' own can be found again
    staging = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(f"{cls.__module__}:{cls.__qualname__}\n")
        os.replace(staging, entry)  # whole or absent, for every reader
    except OSError as exc:
        log.info("tokenizer class not remembered", extra={"error": str(exc)})
