"""Where LoRA adapters come from: `--lora-adapters NAME=SOURCE,...` read once, and a source made a local folder.

Every process reads the flag the same way: the launcher to download Hub adapters before the shards start (one
progress bar, one failure line), the shards to load them, the router to know their names before the shards
report them. A source is a directory holding PEFT's `adapter_config.json` and `adapter_model.safetensors`, or a
Hub id, fetched into the Hub's cache like a model (`conveyor/hub.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

from conveyor import hub

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A name travels as an OpenAI `model` and in metric labels: letters, digits and a few separators, no slash (it
# could not be told from a Hub id) and no spaces.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


class AdapterSourceError(ValueError):
    """A `--lora-adapters` value or a source that cannot be an adapter: one line that says why."""


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise AdapterSourceError(
            f"adapter name {name!r}: 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
        )
    return name


def parse(text: str | None) -> list[tuple[str, str]]:
    """`NAME=SOURCE[,NAME=SOURCE...]` as (name, source) pairs, names unique."""
    pairs: list[tuple[str, str]] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, equals, source = item.strip().partition("=")
        if not equals or not source.strip():
            raise AdapterSourceError(f"--lora-adapters {item.strip()!r}: expected NAME=SOURCE (a directory or Hub id)")
        pairs.append((check_name(name.strip()), source.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise AdapterSourceError(
            f"--lora-adapters names an adapter twice: {sorted(n for n in names if names.count(n) > 1)[0]}"
        )
    return pairs


def resolve(source: str) -> Path:
    """The local folder of an adapter: a directory as it is, else a Hub id downloaded (hub.HubError on failure,
    which the caller turns into its own error where a process must not exit)."""
    path = Path(source)
    if (path / CONFIG_FILE).exists():
        return path
    if not hub.is_repo_id(source):
        raise AdapterSourceError(f"adapter {source!r}: no {CONFIG_FILE} there, and not a Hub id (org/name)")
    # Shaped like a Hub id and no adapter here: the Hub's, whether or not such a relative path exists (answering
    # otherwise would tell a caller which paths exist on the server).
    return hub.download(source, patterns=[CONFIG_FILE, WEIGHTS_FILE], needs=CONFIG_FILE, what="a PEFT adapter")
