"""Where a deployment's model comes from: the built-in demo, a local directory, or the Hugging Face Hub by id."""

from __future__ import annotations

import sys
from pathlib import Path

from conveyor import hub
from conveyor.demo_model import DEMO_MODEL, DEMO_VISION_ARCH, DEMO_VISION_MODEL, ensure
from conveyor.paths import cache_root


def resolve_model(model_id: str, demo_size: str, revision: str | None = None) -> Path:
    """A model directory: 'demo' (or 'demo-vision', its image-text sibling) is built into the cache folder the
    first time it is asked for, a local directory is used as it is, and an `org/name` that is not one is fetched
    from the Hub (`hub.download`)."""
    if model_id in (DEMO_MODEL, DEMO_VISION_MODEL):
        arch = DEMO_VISION_ARCH if model_id == DEMO_VISION_MODEL else "llama"
        target = cache_root() / f"{model_id}-{demo_size}"
        if not (target / "conveyor_demo.json").exists():
            print(f"building the {demo_size} {model_id} model into {target} (first use only)...", file=sys.stderr)
        return ensure(target, demo_size, arch=arch)
    path = Path(model_id)
    if (path / "config.json").exists():
        return path
    if path.exists() or not hub.is_repo_id(model_id):
        raise SystemExit(f"--model-id {model_id!r}: no config.json there, and not a Hub id (org/name)")
    return hub.download(model_id, revision)
