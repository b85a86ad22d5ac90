"""LoRA adapters served beside the base model: requests for different adapters and for the base model share one
forward.

An adapter changes some projections' weights by `scale * B @ A` (rank r). Merging it would take a copy of the
model per adapter; instead each LoRA-capable layer (a `Site`: a decoder layer's fused q/k/v, attention output, fused
gate/up and down projections) keeps every resident adapter's A side by side, `a` [in, C], and their B with the
scale folded in, `b` [C, out]. A step computes, per layer, `t = x @ a`, zeroes the columns of each token that are
not its own adapter's (`t *= mask`), and adds `t @ b` to the layer's output: three small operations per layer,
whatever the mix of adapters in the batch. The mask [T, C] depends only on each token's adapter and the layer's
*kind*, so it is built once per kind per step: every layer of one kind shares one column layout (per adapter, in
slot order, r columns for each module of that kind it targets anywhere; a layer it leaves alone holds zeros there).
For the fused q/k/v and gate/up layers, a column block's B rows fill its module's part of the output, zeros
elsewhere (a Phi-3 adapter's `qkv_proj` fills every part). A step with no adapter token builds no mask and every
site returns at once; a kind no resident adapter targets has no mask either.

Tensor parallelism follows the base layers' split. Column-parallel layers (q/k/v, gate/up) keep A whole and this
rank's rows of B, part by part as `Weights.get_sharded_parts` slices the weight. Row-parallel layers (attention
output, down) keep this rank's columns of A, the input features their weight slice reads, and B whole; the update is
added to the rank's partial output before the all-reduce, since the sum over ranks of x_r A_r^T B^T is x A^T B^T.

The registry (`ServedAdapters`, one per engine) loads and unloads adapters between steps, at most `max_loras` at
once, and rebuilds the concatenations as it does; requests name an adapter, and a step turns the names into masks.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.shard.adapters import adapter_files
from conveyor.shard.adapters.adapter_files import AdapterError, AdapterFiles, Target
from conveyor.shard.batch.request_state import BadRequest, RequestState
from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

BASE = -1  # the slot of a token that goes through no adapter


@dataclass(frozen=True)
class Kind:
    """One kind of LoRA-capable layer: the block its modules sit in (`group`, PEFT's names), the modules its parts
    are in the checkpoint, the name of them all where the checkpoint stores them fused, and where the layer is in a
    decoder layer of our model code."""

    group: str
    modules: tuple[str, ...]
    fused: str
    path: tuple[str, str]
    row_parallel: bool


KINDS = {
    "qkv": Kind("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj", ("attention", "qkv"), False),
    "o": Kind("self_attn", ("o_proj",), "", ("attention", "o_proj"), True),
    "gate_up": Kind("mlp", ("gate_proj", "up_proj"), "gate_up_proj", ("mlp", "gate_up"), False),
    "down": Kind("mlp", ("down_proj",), "", ("mlp", "down"), True),
}


def column_rows(b: torch.Tensor, sizes: Sequence[int], rank: int, world: int) -> torch.Tensor:
    """This rank's rows of B [out, r] for a column-parallel layer: its equal share of each part (`sizes`, the
    parts' full row counts), joined in order, exactly as `Weights.get_sharded_parts` slices the layer's weight."""
    parts, start = [], 0
    for size in sizes:
        share = size // world
        parts.append(b[start + rank * share : start + (rank + 1) * share])
        start += size
    return torch.cat(parts)


def row_columns(a: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's columns of A [r, in] for a row-parallel layer: the input features its weight slice reads."""
    share = a.shape[1] // world
    return a[:, rank * share : (rank + 1) * share]


@dataclass
class Step:
    """This step's masks, one per layer kind with columns: [T, C], 1 where the column is the token's adapter's.
    Empty when no token of the step goes through an adapter. `ops`: LoRA updates run so far (for the tests)."""

    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    ops: int = 0


class Site:
    """One LoRA-capable layer on this rank: every resident adapter's A^T side by side, `a` [in, C], and their scaled
    B^T, `b` [C, out]; adds each token's own adapter's update to the layer's output."""

    def __init__(self, layer: int, kind: str, linear: ColumnParallelLinear | RowParallelLinear, group: ProcessGroup):
        self.layer, self.kind, self.linear = layer, kind, linear
        self.rank, self.world = group.rank, group.world_size
        self.row_parallel = isinstance(linear, RowParallelLinear)
        self.in_features, self.out_features = linear.gemm.in_features, linear.gemm.out_features
        self.parts: tuple[int, ...] = getattr(linear, "parts", (self.out_features,))  # rows of each part, here
        self.fused: bool = getattr(linear, "fused", False)
        self.step = Step()  # replaced by the registry's, which all sites share
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the update of each token's adapter (nothing for base tokens, or a step without adapters)."""
        mask = self.step.masks.get(self.kind)
        if mask is None or self.a is None:
            return
        t = x.reshape(-1, self.in_features) @ self.a
        t.mul_(mask)
        out.view(-1, self.out_features).addmm_(t, self.b)
        self.step.ops += 1

    def modules(self) -> dict[str, tuple[int, int]]:
        """The modules an adapter may target here, each with the parts it covers (first, count)."""
        kind = KINDS[self.kind]
        if self.fused:
            return {kind.fused: (0, len(self.parts))}
        return {module: (i, 1) for i, module in enumerate(kind.modules)}

    def full_sizes(self, first: int, count: int) -> list[int]:
        """The unsliced row counts of parts first..first+count (a row-parallel layer's output is not split)."""
        per_rank = self.parts[first : first + count]
        return list(per_rank) if self.row_parallel else [p * self.world for p in per_rank]

    def full_in(self) -> int:
        return self.in_features * self.world if self.row_parallel else self.in_features

    def check(self, name: str, target: Target, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
        """Refuses matrices that do not fit this layer, naming the first mismatch."""
        first, count = self.modules()[target.module]
        out, module = sum(self.full_sizes(first, count)), target.module
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            shapes = f"lora_A is {list(a.shape)} and lora_B {list(b.shape)}"
            raise AdapterError(f"adapter {name!r}: at {target} {shapes}, not rank {rank} as adapter_config.json says")
        if a.shape[1] != self.full_in():
            raise AdapterError(
                f"adapter {name!r}: lora_A of {target} is {list(a.shape)}, the base model's {module} has "
                f"{self.full_in()} input features"
            )
        if b.shape[0] != out:
            raise AdapterError(
                f"adapter {name!r}: lora_B of {target} is {list(b.shape)}, the base model's {module} has {out} "
                "output features"
            )

    def block(self, module: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's columns on this rank: A^T [in, r] (this rank's inputs) and scale * B^T [r, out], its rows
        (this rank's share of them) at its parts' place in the layer's output, zeros elsewhere."""
        first, count = self.modules()[module]
        a = row_columns(a, self.rank, self.world) if self.row_parallel else a
        b = b if self.row_parallel else column_rows(b, self.full_sizes(first, count), self.rank, self.world)
        placed = torch.zeros(b.shape[1], self.out_features)
        start = sum(self.parts[:first])
        placed[:, start : start + b.shape[0]] = b.float().T * scale
        return a.float().T, placed

    def append(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a = a if self.a is None else torch.cat([self.a, a], dim=1)
        self.b = b if self.b is None else torch.cat([self.b, b])

    def keep(self, columns: torch.Tensor) -> None:
        """Keeps the columns marked True (an adapter unloaded)."""
        if self.a is None:
            return
        self.a, self.b = self.a[:, columns], self.b[columns]
        if self.a.shape[1] == 0:
            self.a = self.b = None


def _targeted(placed: dict[tuple[int, str], dict], kind: str) -> list[str]:
    """The modules of this kind an adapter targets in any layer, in the layer's part order."""
    names = {m for (_, k), modules in placed.items() if k == kind for m in modules}
    return [m for m in (KINDS[kind].fused, *KINDS[kind].modules) if m in names]


def find_sites(model: torch.nn.Module, group: ProcessGroup) -> list[Site]:
    """Every LoRA-capable layer, decoder layer by decoder layer (the Llama family and Gemma name them alike); none
    for a model whose layers are not those."""
    sites = []
    for i, layer in enumerate(getattr(model, "layers", None) or []):
        for kind, spec in KINDS.items():
            owner, attr = spec.path
            linear = getattr(getattr(layer, owner, None), attr, None)
            expected = RowParallelLinear if spec.row_parallel else ColumnParallelLinear
            if not isinstance(linear, expected):
                return []
            sites.append(Site(i, kind, linear, group))
    return sites


@dataclass
class Resident:
    """A loaded adapter: its slot is its place in `ServedAdapters.resident`; `widths`: its columns per layer kind."""

    name: str
    source: str
    rank: int
    widths: dict[str, int]
    weight_bytes: int

    def describe(self) -> pb.Adapter:
        return pb.Adapter(name=self.name, source=self.source, rank=self.rank, weight_bytes=self.weight_bytes)


Blocks = dict[Site, tuple[torch.Tensor, torch.Tensor]]


class ServedAdapters:
    """The adapters resident on this rank, in slot order, and the model's sites they live in."""

    def __init__(
        self,
        model: torch.nn.Module,
        group: ProcessGroup,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        served_names: list[str],
    ) -> None:
        """`served_names`: what the served model is called (its id, its folder, its config's name), for the check
        of an adapter's base model."""
        self.dtype, self.device, self.max_loras, self.served_names = dtype, device, max_loras, served_names
        self.model_type = getattr(getattr(model, "config", None), "model_type", "?")
        self.step = Step()
        self.sites = find_sites(model, group)
        for site in self.sites:
            site.step = self.step
        self.resident: list[Resident] = []
        self.columns: dict[str, torch.Tensor] = {}  # per kind with columns: each column's slot
        self._users: dict[str, weakref.WeakValueDictionary[int, RequestState]] = {}

    # --- loading and unloading, between steps --------------------------------------------------------------

    def describe(self) -> list[pb.Adapter]:
        return [r.describe() for r in self.resident]

    def load(self, name: str, source: str, folder: Path) -> pb.Adapter:
        """Reads, checks and installs an adapter (a refused one leaves nothing behind)."""
        return self.install(source, self.read(name, folder))

    def read(self, name: str, folder: Path) -> adapter_files.AdapterFiles:
        """The adapter's files, read and checked: file work only, which a live load does off the torch thread (a
        file that blocks on read, a hung network filesystem, must not stall every tenant's steps)."""
        return adapter_files.read(name, folder, self.served_names)

    def install(self, source: str, files: adapter_files.AdapterFiles) -> pb.Adapter:
        """Installs an adapter read by `read`, between steps. Loading the same name from the same source again
        answers the one loaded: a rank that succeeded where another failed can be retried."""
        name = files.name
        if (known := self._find(name)) is not None:
            if known.source == source:
                return known.describe()
            raise AdapterError(f"adapter {name!r} is already loaded from {known.source!r}: unload it first")
        if len(self.resident) >= self.max_loras:
            raise AdapterError(
                f"adapter {name!r}: {len(self.resident)} adapters are loaded, the most --max-loras allows: unload one"
            )
        if not self.sites:
            raise AdapterError(f"adapter {name!r}: adapters are not served for model type {self.model_type!r}")
        blocks, widths = self._blocks(files)
        for site, (a, b) in blocks.items():
            site.append(a, b)
        nbytes = sum(a.nbytes + b.nbytes for a, b in blocks.values())
        self.resident.append(Resident(name, source, files.rank, widths, nbytes))
        self._layout()
        return self.resident[-1].describe()

    def unload(self, name: str) -> None:
        """Drops an adapter, refused while a live request still names it (a cached batch holds it)."""
        known = self._find(name)
        if known is None:
            raise AdapterError(f"adapter {name!r} is not loaded")
        if self._in_use(name):
            raise AdapterError(f"adapter {name!r} is still used by a request of a cached batch")
        slot = self.resident.index(known)
        for site in self.sites:
            if site.kind in self.columns:
                site.keep(self.columns[site.kind] != slot)
        del self.resident[slot]
        self._users.pop(name, None)
        self._layout()

    def _find(self, name: str) -> Resident | None:
        return next((r for r in self.resident if r.name == name), None)

    def _in_use(self, name: str) -> bool:
        users = self._users.get(name)
        if users:
            gc.collect()  # a request in a reference cycle may be gone already
        return bool(users)

    def _blocks(self, files: AdapterFiles) -> tuple[Blocks, dict[str, int]]:
        """Each site's new columns for this adapter (checked against every layer before anything changes), and
        their count per kind."""
        by_place = {(s.layer, s.kind): s for s in self.sites}
        placed: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for target, (a, b) in files.matrices.items():
            site = self._site(files.name, target, by_place)
            site.check(files.name, target, a, b, files.rank)
            placed.setdefault((site.layer, site.kind), {})[target.module] = site.block(target.module, a, b, files.scale)
        modules = {kind: _targeted(placed, kind) for kind in KINDS}
        blocks: Blocks = {}
        for site in self.sites:
            if modules[site.kind]:
                blocks[site] = self._columns(site, modules[site.kind], placed.get((site.layer, site.kind), {}), files)
        return blocks, {kind: len(names) * files.rank for kind, names in modules.items() if names}

    def _site(self, name: str, target: Target, by_place: dict[tuple[int, str], Site]) -> Site:
        layers = len({s.layer for s in self.sites})
        if target.layer >= layers:
            raise AdapterError(f"adapter {name!r}: it changes {target}, and the model has {layers} layers")
        for kind, spec in KINDS.items():
            site = by_place[(target.layer, kind)]
            if spec.group == target.group and target.module in site.modules():
                return site
        known = ", ".join(m for s in self.sites if s.layer == 0 for m in s.modules())
        raise AdapterError(
            f"adapter {name!r} targets {target.group}.{target.module}, which this model does not have (it has {known})"
        )

    def _columns(
        self, site: Site, modules: list[str], here: dict[str, tuple[torch.Tensor, torch.Tensor]], files: AdapterFiles
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's columns for the adapter: its modules' blocks in order, zeros for one it leaves alone here."""
        empty = (torch.zeros(site.in_features, files.rank), torch.zeros(files.rank, site.out_features))
        pairs = [here.get(m, empty) for m in modules]
        a, b = torch.cat([p[0] for p in pairs], dim=1), torch.cat([p[1] for p in pairs])
        return a.to(self.device, self.dtype), b.to(self.device, self.dtype)

    def _layout(self) -> None:
        """Each kind's column slots, from the resident adapters' widths in slot order; a layer carries its site
        only while it has columns, so that a model serving no adapter runs exactly as without this module."""
        for site in self.sites:
            site.linear.lora = site if site.a is not None else None
        self.columns = {}
        for kind in KINDS:
            widths = torch.tensor([r.widths.get(kind, 0) for r in self.resident], dtype=torch.long)
            if int(widths.sum()):
                slots = torch.arange(len(self.resident))
                self.columns[kind] = torch.repeat_interleave(slots, widths).to(self.device)

    # --- requests and steps --------------------------------------------------------------------------------

    def slot(self, name: str) -> int:
        """The slot of the adapter a request names ("" is the base model); BadRequest when none is loaded so."""
        if not name:
            return BASE
        for slot, resident in enumerate(self.resident):
            if resident.name == name:
                return slot
        raise BadRequest(f"adapter {name!r} is not loaded on this shard")

    def track(self, state: RequestState) -> None:
        """Checks the adapter a new request names, and notes the request: unloading that adapter is refused while
        the request lives (held weakly: a batch dropped lets it go)."""
        if state.adapter:
            self.slot(state.adapter)
            self._users.setdefault(state.adapter, weakref.WeakValueDictionary())[id(state)] = state

    def begin(self, adapters: list[str] | None, query_lens: list[int]) -> None:
        """This step's masks, one per kind that an adapter of the step targets (kinds with the same column layout
        share one), from each sequence's adapter and its count of new tokens; none when no sequence names one."""
        self.step.masks.clear()
        if not adapters or not any(adapters):
            return
        slots = [self.slot(name) for name in adapters]
        present = [self.resident[s] for s in set(slots) if s != BASE]
        tokens = torch.repeat_interleave(torch.tensor(slots), torch.tensor(query_lens)).to(self.device)
        shared: dict[tuple[int, ...], torch.Tensor] = {}
        for kind, columns in self.columns.items():
            if not any(r.widths.get(kind) for r in present):
                continue
            layout = tuple(r.widths.get(kind, 0) for r in self.resident)
            if layout not in shared:
                shared[layout] = (tokens[:, None] == columns[None, :]).to(self.dtype)
            self.step.masks[kind] = shared[layout]

    def end(self) -> None:
        self.step.masks.clear()
