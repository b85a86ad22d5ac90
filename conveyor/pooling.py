"""What a checkpoint says about embedding it: pooling, normalization and its default task.

Both the router (to choose the routes it answers) and the shard (to pool hidden states) need the same reading of
sentence-transformers' `modules.json` and `1_Pooling/config.json`, so it lives in the common package. Plain JSON
reading only: the router never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TASKS = ("generate", "embed", "rerank")
POOLING_MODES = ("last", "mean", "cls")

_POOLING_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"
# sentence-transformers' flag for each mode we pool; max pooling and weighted mean are refused, not guessed.
_MODE_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


class PoolingConfigError(ValueError):
    """The checkpoint asks for a pooling this server does not implement: refusing beats wrong vectors."""


@dataclass(frozen=True)
class PoolingSpec:
    """How one prompt's hidden states become its embedding.

    `mode` picks the rows pooled (the last token, the mean of all, or the first); `normalize` is whether the
    checkpoint ends with a Normalize module, so that its vectors have unit length as sentence-transformers gives them.
    """

    mode: str = "last"
    normalize: bool = True


def _modules(model_dir: Path) -> list[dict] | None:
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{path}: expected a list of modules")
    return modules


def read_pooling(model_dir: Path) -> PoolingSpec:
    """The checkpoint's pooling; a checkpoint without `modules.json` pools the last token, normalized.

    Last-token pooling with normalization is what decoder embedding models (Qwen3-Embedding, gte-Qwen2) ship, so it
    is the default when a checkpoint says nothing.
    """
    modules = _modules(Path(model_dir))
    if modules is None:
        return PoolingSpec()
    normalize = any(m.get("type") == _NORMALIZE_TYPE for m in modules)
    pooling = [m for m in modules if m.get("type") == _POOLING_TYPE]
    if not pooling:
        return PoolingSpec(normalize=normalize)
    config_path = Path(model_dir) / pooling[0].get("path", "1_Pooling") / "config.json"
    config = json.loads(config_path.read_text())
    modes = [mode for flag, mode in _MODE_FLAGS.items() if config.get(flag)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _MODE_FLAGS]
    if others or len(modes) != 1:
        raise PoolingConfigError(f"{config_path}: exactly one of {sorted(_MODE_FLAGS)} is served, got {modes + others}")
    return PoolingSpec(mode=modes[0], normalize=normalize)


def default_task(model_dir: Path) -> str:
    """`--task` when it is not given: a sentence-transformers checkpoint embeds, any other generates."""
    return "embed" if (Path(model_dir) / "modules.json").is_file() else "generate"


def resolve_tasks(flag: str | None, model_dir: Path) -> tuple[str, ...]:
    """The deployment's tasks, in TASKS' order: the flag's (one task, or several comma-separated) when given, else
    the checkpoint's one."""
    if flag is None:
        return (default_task(model_dir),)
    asked = {t.strip() for t in flag.split(",") if t.strip()}
    if not asked or asked - set(TASKS):
        raise ValueError(f"--task takes {', '.join(TASKS)} or several of them comma-separated, got {flag!r}")
    return tuple(t for t in TASKS if t in asked)
