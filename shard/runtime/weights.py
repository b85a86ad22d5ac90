"""Reads a model directory's safetensors, each rank only the slice of each tensor it holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from conveyor.shard.runtime.process_group import ProcessGroup


class WeightError(ValueError):
    """A tensor is missing, or does not split across the ranks."""


class Weights:
    def __init__(
        self,
        model_dir: str | Path,
        group: ProcessGroup,
        dtype: torch.dtype,
        device: torch.device,
        renames: dict[str, str] | None = None,
    ) -> None:
        """`renames`: checkpoint name prefixes to the names the model asks for (a multimodal wrapper's text
        weights); tensors under no such prefix are left out. None: every tensor under its own name, or under
        `model.` for a bare base model (sentence-transformers' embedding checkpoints are saved so, without the LM
        head: a tied head is the embedding's, as the model code takes it)."""
        self.group = group
        self.dtype = dtype
        self.device = device
        self._files: dict[str, Path] = {}
        self._names: dict[str, str] = {}  # the model's name to the checkpoint's
        stored_names = _weight_map(Path(model_dir))
        if renames is None and _bare(stored_names):
            renames = {"": "model."}
        for stored, file in stored_names.items():
            name = _renamed(stored, renames)
            if name is not None:
                self._files[name], self._names[name] = Path(model_dir) / file, stored
        self._handles: dict[Path, object] = {}
        # Whether a layer whose weight is packed for oneDNN may keep a plain copy for the small-rows kernel
        # (`layers/gemm.py`): the engine decides it for the whole model, from `nbytes` and the memory there is.
        self.plain_copies = True
        self.quantize: str | None = None  # `--quantize`: the linear layers' weights, quantized as they load

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        """Every tensor's name as the model asks for it (a tower read whole lists its own)."""
        return list(self._files)

    def _handle(self, name: str):
        if name not in self._files:
            raise WeightError(f"tensor {name!r} is missing from the checkpoint")
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path]

    def _slice(self, name: str):
        return self._handle(name).get_slice(self._names[name])

    def _finish(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype=self.dtype, device=self.device).contiguous()

    def nbytes(self) -> int:
        """About what this rank's weights take once loaded (in `dtype`, split across the ranks), from the
        checkpoint's headers alone."""
        count = 0
        for name in self._files:
            shape = self._slice(name).get_shape()
            count += math.prod(shape)
        return count * self.dtype.itemsize // self.group.world_size

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (norms, biases of row-parallel layers): every rank holds it."""
        return self._finish(self._handle(name).get_tensor(self._names[name]))

    def get_sharded(self, name: str, dim: int) -> torch.Tensor:
        """This rank's equal part of `name` along `dim`, read without loading the rest."""
        piece = self._slice(name)
        size = piece.get_shape()[dim]
        if size % self.group.world_size:
            raise WeightError(f"{name}: dimension {dim} of size {size} does not split into {self.group.world_size}")
        part = size // self.group.world_size
        start, stop = self.group.rank * part, (self.group.rank + 1) * part
        tensor = piece[start:stop] if dim == 0 else piece[:, start:stop]
        return self._finish(tensor)

    def get_sharded_parts(self, name: str, sizes: list[int]) -> torch.Tensor:
        """This rank's part of each of the row blocks `sizes` that `name` stacks (a fused projection such as
        Phi-3's qkv_proj: [q rows | k rows | v rows]), joined in order: the layout a rank's fused layer has."""
        piece = self._slice(name)
        parts, start = [], 0
        for size in sizes:
            if size % self.group.world_size:
                raise WeightError(f"{name}: a part of {size} rows does not split into {self.group.world_size}")
            part = size // self.group.world_size
            first = start + self.group.rank * part
            parts.append(piece[first : first + part])
            start += size
        if start != piece.get_shape()[0]:
            raise WeightError(f"{name}: {piece.get_shape()[0]} rows, not the {start} its parts add up to")
        return self._finish(torch.cat(parts))


def _renamed(stored: str, renames: dict[str, str] | None) -> str | None:
    if renames is None:
        return stored
    for prefix, to in renames.items():
        if stored.startswith(prefix):
            return to + stored[len(prefix) :]
    return None


def _bare(names: dict[str, str]) -> bool:
    """Whether the checkpoint is a base model's alone (`embed_tokens.weight`, no `model.` names)."""
    return "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name to file, from the index when the checkpoint is split in several files."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no .safetensors files in {model_dir}")
    names: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            names.update({name: file.name for name in handle.keys()})
    return names
