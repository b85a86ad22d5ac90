"""Reads a PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`) and refuses what Conveyor cannot
serve exactly, each with one line that names it.

What is read is the adapter alone, whole and unsliced: which decoder-layer projections it changes and the
matrices of each, A [r, in] and B [out, r], with the scale its config gives (alpha / r, or alpha / sqrt(r) with
rsLoRA). Checking them against the served model and slicing them for a rank is `served_adapters.py`'s part.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor import adapter_sources, hub
from conveyor.shard.batch.request_state import BadRequest


class AdapterError(BadRequest):
    """An adapter this shard cannot serve: one line naming the mismatch. A BadRequest, so that a live load is
    answered INVALID_ARGUMENT and the shard serves on; at start it ends the shard with that line."""


# PEFT config fields that change what the adapter computes in ways a plain `x A^T B^T` does not: any of them set
# (truthy) refuses the adapter, rather than serve something other than what was trained.
REFUSED_FIELDS = {
    "use_dora": "uses DoRA (use_dora)",
    "lora_bias": "trains a bias with lora_B (lora_bias)",
    "modules_to_save": "saves whole modules beside its LoRA matrices (modules_to_save)",
    "fan_in_fan_out": "stores its matrices transposed (fan_in_fan_out), a layout this model's layers do not have",
    "rank_pattern": "sets a rank per module (rank_pattern)",
    "alpha_pattern": "sets an alpha per module (alpha_pattern)",
    "layer_replication": "replicates layers (layer_replication)",
    "target_parameters": "targets parameters rather than modules (target_parameters)",
    "alora_invocation_tokens": "is an activated LoRA (alora_invocation_tokens)",
    "trainable_token_indices": "trains token embeddings (trainable_token_indices)",
    "use_qalora": "is a QALoRA adapter (use_qalora)",
}
UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
# A LoRA matrix of a decoder layer's projection, under the names PEFT saves for a causal LM (`base_model.model.`
# then the model's own names), a multimodal wrapper's text model included (Gemma 3's `language_model`, SmolVLM's
# `text_model`); `.weight` is absent in old adapters.
KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.|model\.language_model\.|language_model\.model\.|model\.text_model\.)"
    r"layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\.(?P<module>\w+)\.lora_(?P<matrix>[AB])(?:\.weight)?$"
)
# Tensors of a multimodal wrapper's vision side (tower, projector, SmolVLM's connector): an adapter changes the
# language model only, so these are never read.
SKIPPED = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|multi_modal_projector|connector)\.")


@dataclass(frozen=True)
class Target:
    """One projection an adapter changes: `group` (self_attn or mlp) and `module` (q_proj, ..., qkv_proj)."""

    layer: int
    group: str
    module: str

    def __str__(self) -> str:
        return f"layers.{self.layer}.{self.group}.{self.module}"


@dataclass
class AdapterFiles:
    """An adapter as PEFT saved it: its rank, its scale, and A [r, in], B [out, r] per target, unscaled."""

    name: str
    rank: int
    scale: float
    matrices: dict[Target, tuple[torch.Tensor, torch.Tensor]]


def resolve_source(name: str, source: str) -> Path:
    """The adapter's local folder (a Hub id downloaded first), any failure as an AdapterError: a live load must
    not end the shard, and hub.HubError is a SystemExit."""
    try:
        adapter_sources.check_name(name)
        return adapter_sources.resolve(source)
    except (adapter_sources.AdapterSourceError, hub.HubError) as exc:
        raise AdapterError(f"adapter {name!r}: {exc}") from None


READ_TIMEOUT_SWITCH = "CONVEYOR_ADAPTER_READ_TIMEOUT"
DEFAULT_READ_TIMEOUT_S = 120.0


def read_timeout() -> float:
    """Seconds a live load may spend reading an adapter's files (CONVEYOR_ADAPTER_READ_TIMEOUT, default 120):
    bounded, since a file that blocks on read (a FIFO, a hung network filesystem) would hold the load for ever."""
    return float(os.environ.get(READ_TIMEOUT_SWITCH) or DEFAULT_READ_TIMEOUT_S)


def read(name: str, folder: Path, served_names: list[str]) -> AdapterFiles:
    """The adapter in `folder`, its config checked (and its base model's name against `served_names`, the names
    the served model goes by); its matrices are checked against the model by the caller."""
    config = _config(name, folder)
    _check_config(name, config)
    _check_base(name, config.get("base_model_name_or_path"), served_names)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {name!r}: r={rank!r} and lora_alpha={alpha!r} are not a rank and a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterFiles(name, rank, scale, _matrices(name, folder / adapter_sources.WEIGHTS_FILE))


def _config(name: str, folder: Path) -> dict:
    path = folder / adapter_sources.CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {path} cannot be read: {_line(exc)}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {path} is not a JSON object")
    return config


def _check_config(name: str, config: dict) -> None:
    """Refuses every PEFT option that a plain low-rank update per projection does not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r} is a {config['peft_type']} adapter, not LoRA")
    for field, what in REFUSED_FIELDS.items():
        if config.get(field):
            raise AdapterError(f"adapter {name!r} {what}, which Conveyor does not serve")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r} trains biases (bias={config['bias']!r}), which Conveyor does not serve")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in UNSUPPORTED_TARGETS:
        if target in names:
            raise AdapterError(f"adapter {name!r} targets {target}: embedding and LM-head adapters are not served")


def _check_base(name: str, base: str | None, served_names: list[str]) -> None:
    """An adapter trained on another model: refused when its base's last path component is none of the served
    model's names (compared without case: a mirror or a local copy keeps the name)."""
    if not base:
        return
    wanted = _last(base)
    served = {_last(s) for s in served_names if s}
    if wanted not in served:
        raise AdapterError(
            f"adapter {name!r} was trained on {base!r}, and the served model is {sorted(served)[0] if served else '?'}"
        )


def _last(path: str) -> str:
    return str(path).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()


def _matrices(name: str, path: Path) -> dict[Target, tuple[torch.Tensor, torch.Tensor]]:
    """A and B per target, from the safetensors file; a tensor that is no decoder-layer projection's is refused."""
    pairs: dict[Target, dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(name, path).items():
        if SKIPPED.search(key):
            continue
        match = KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: {_stray(key)}")
        target = Target(int(match["layer"]), match["group"], match["module"])
        pairs.setdefault(target, {})[match["matrix"]] = tensor
    for target, pair in pairs.items():
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"adapter {name!r}: {target} has no {missing}")
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {path.name} holds no LoRA matrices")
    return {target: (pair["A"], pair["B"]) for target, pair in pairs.items()}


def _stray(key: str) -> str:
    for target in UNSUPPORTED_TARGETS:
        if f".{target}." in f".{key}":
            return f"tensor {key} targets {target}: embedding and LM-head adapters are not served"
    return f"tensor {key} is no LoRA matrix of a decoder layer's projection"


MAX_WEIGHTS_BYTES = 4 * 1024**3  # an adapter's weights file past this is refused, not read into memory


def _tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    """The file is read by Python's own I/O, which lets go of the GIL while a read blocks (a FIFO, a hung network
    filesystem), and parsed from memory: safetensors' own open holds the GIL, and a blocked read there stopped every
    thread of the shard, the one running the steps included."""
    from safetensors.torch import load

    if not path.exists():
        other = " (a .bin adapter: save it with safe_serialization)" if path.with_suffix(".bin").exists() else ""
        raise AdapterError(f"adapter {name!r}: no {path.name} in {path.parent}{other}")
    with path.open("rb") as file:
        data = file.read(MAX_WEIGHTS_BYTES + 1)
    if len(data) > MAX_WEIGHTS_BYTES:
        raise AdapterError(f"adapter {name!r}: {path.name} is over {MAX_WEIGHTS_BYTES} bytes")
    try:
        return dict(sorted(load(data).items()))  # by name, as safetensors' load_file lists them
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a truncated or garbled file
        raise AdapterError(f"adapter {name!r}: {path} cannot be read: {_line(exc)}") from None


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
