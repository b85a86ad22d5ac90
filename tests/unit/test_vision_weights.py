"""A vision tower reads the same tensors whichever way its checkpoint names them: Google's Hub checkpoints of Gemma
3 (saved by transformers 4: `vision_tower.vision_model.*`) and transformers 5's own saves (`vision_tower.*`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conveyor.shard.models.gemma3_vision import VisionEncoder

HUB_TOWER = "vision_tower.vision_model."


def hub_layout(model_dir: Path, out: Path) -> Path:
    """The checkpoint again with its tower's tensors under the Hub's names."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        renamed = {
            HUB_TOWER + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k: v
            for k, v in tensors.items()
        }
        save_file(renamed, out / file.name, metadata={"format": "pt"})
    return out


def test_a_hub_checkpoints_tower_reads_as_a_transformers_5_one(gemma3_multimodal_model: Path, tmp_path: Path) -> None:
    hub = hub_layout(gemma3_multimodal_model, tmp_path / "hub")
    names = set().union(*(load_file(f).keys() for f in hub.glob("*.safetensors")))
    assert any(n.startswith(HUB_TOWER) for n in names)  # the layout under test, not the original again
    config = AutoConfig.from_pretrained(gemma3_multimodal_model)
    ours = VisionEncoder.load(str(gemma3_multimodal_model), config, torch.float32, torch.device("cpu"))
    theirs = VisionEncoder.load(str(hub), config, torch.float32, torch.device("cpu"))
    mine, other = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == other.keys()
    assert all(torch.equal(mine[k], other[k]) for k in mine)
