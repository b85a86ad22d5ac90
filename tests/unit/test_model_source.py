"""`--model-id demo` and `demo-vision`: the built-in demo models, each built into the cache on first use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.model_source import resolve_model


@pytest.mark.parametrize(
    ("model_id", "model_type", "images"), [("demo", "llama", False), ("demo-vision", "gemma3", True)]
)
def test_each_demo_is_built_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_id: str, model_type: str, images: bool
) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    built = resolve_model(model_id, "tiny")
    assert built == tmp_path / f"{model_id}-tiny"
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == model_type
    assert ("vision_config" in config) == images
    assert (built / "processor_config.json").exists() == images  # what the router reads an image with
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(model_id, "tiny") == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # found, not built again
