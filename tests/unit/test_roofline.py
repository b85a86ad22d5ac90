"""The one-stream roofline's arithmetic (benchmarks/roofline.py): the weights a decode step reads, counted from the
config, equal the checkpoint's own projection and LM-head tensors; each width divides them by the bandwidth."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from benchmarks import roofline


def test_streamed_weights_are_the_checkpoints_projections_and_head(tiny_model: Path) -> None:
    counted = 0
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                counted += f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1]
    assert roofline.streamed_weights(tiny_model) == counted


def test_each_width_takes_its_bytes_over_the_bandwidth(tiny_model: Path) -> None:
    weights = roofline.streamed_weights(tiny_model)
    ms = roofline.roofline(tiny_model, bandwidth=1e9)
    assert ms["float32"] == weights * 4 / 1e9 * 1000
    assert ms["float32"] == 2 * ms["bfloat16"]
    assert ms["int4"] < ms["int8"] < ms["bfloat16"]
