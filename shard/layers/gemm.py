"""The matrix multiply behind every linear layer and the LM head: `x @ W.T (+ b)` by the fastest kernel at hand.

On CPU, torch's `F.linear` goes to MKL's sgemm, which on AMD processors takes a generic path, slower than oneDNN
with the weight packed once into its blocked layout (the same kernels vLLM's CPU build dispatches its linear layers
to): `make bench` runs the bare forward on both (benchmarks/bare.py; compare's target "bare forward: oneDNN GEMM /
F.linear (MKL)"). So a CPU weight is packed for oneDNN at load time, when oneDNN supports its dtype here (float32
always; bfloat16 only where oneDNN has bf16 kernels for the CPU, `conveyor.cpu.onednn_bf16`, else it refuses to
pack it). Everything else (CUDA, half types oneDNN can't pack, or `CONVEYOR_GEMM=torch`, the switch the benchmark
uses to measure the difference) keeps `F.linear`.

A step with a few rows (one person chatting, or a few at once) is nearly a matrix-vector product, bound by reading each
weight once. oneDNN's kernels for a packed weight read it there well below the memory bandwidth, so on CPU those
rows go to Conveyor's own `small_gemm` kernel (`shard/kernels/small_gemm.cpp`) over the plain [out, in] weight.
Where the weight is packed that is a second copy of it: kept only while both copies fit in a share of the memory
(`plain_copy_fits`, decided once per model by the engine). A model too large for both keeps the plain weight alone,
the one every decode step reads, and its prompts go through F.linear: a 1B Llama on a 24 GiB Intel Xeon (AVX-512,
2 vCPUs) had kept the packed copy alone, and its bf16 bare decode step took 115 ms through oneDNN against 108 ms
through the kernel (float32 184 -> 179 ms), where F.linear over 512 rows of its gate/up weight costs what oneDNN's
packed weight does (float32 62 vs 59 ms, bf16 293 vs 301). How many rows the kernel takes depends on its loop
(`small_rows`): the AVX-512 one, which prefetches the weight and dots bfloat16 natively, shortens the bare decode
step up to 4 rows in float32 and bfloat16 (measured on Intel Xeon and AMD Zen 4/5), and up to the kernel's 8 on an
Intel Xeon whose AVX-512 lacks avx512_bf16 (2 vCPUs, SmolLM2-135M-Instruct, one sequence's verify step over k rows
against one row, `time_decode_rows`): float32 5 rows 1.42-1.59x -> 1.26x, 8 rows 1.70-1.85x -> 1.35x; bf16, which
oneDNN computes slowly there, 5 rows 3.9x -> 1.57x, 8 rows 4.9-5.5x -> 1.89x. (Zen 4/5 past 4 rows: unmeasured.)
The AVX2 one, which blocks 2-4 weight rows against 4 rows of x in registers, up to the kernel's most rows, 8: on an
AMD EPYC Zen 3 (AVX2 only, 2 vCPUs, SmolLM2-135M-Instruct's bare decode step, `SMALL_ROWS_AVX2` 8 against oneDNN
from 3 rows, 2 interleaved rounds) float32 at 4 rows took 30-36 ms instead of 41-42, at 5 rows 29-34 instead of
41-46, at 8 rows 37-41 instead of 47-54 (1 row: 24-25 either way), and bfloat16, which oneDNN computes slowly on
such a CPU, 20 ms instead of 94 at 4 rows and 30 instead of 128 at 8. The portable loop (no AVX2) only at 1 and 2,
oneDNN being as fast or faster from 3 there. The bare forward measures it (benchmarks/bare.py's loop at batch 1 to 8,
or `gemm="auto"` against `gemm="onednn"`, its median full decode step).

bfloat16 halves what a step reads, which is what a decode step is bound by, but on an Intel Xeon without AMX's
tiles it computes no faster: where a step is bound by computing (a prompt), oneDNN's avx512_core_bf16 matmuls run
well behind its float32 ones there, and on a CPU without avx512_bf16 torch's bf16 matmul is a scalar fallback. So
where the CPU widens (`widens`), a bf16 layer that keeps its plain copy also packs a float32 copy, and a step of at
least `WIDE_ROWS` tokens goes through it: x widened to float32 on the way in, the output rounded back to bf16 (as
oneDNN's bf16 kernel rounds its float32 sums). Decode steps stay in bf16: a float32 weight is twice the bytes to
read, which cost batch 8 and 16 (25% and 12% longer steps) and saved nothing at 32. SmolLM2-135M-Instruct, Intel
Xeon Emerald Rapids, 2 vCPUs, the bare forward in bf16, 4 interleaved rounds: a 512-token prompt 856-903 -> 585-707
ms, 4 x 256 tokens 1,541-1,785 -> 1,050-1,262 ms, 8 x 64 tokens 741-780 -> 489-504 ms. That is four bf16 copies'
worth of memory instead of two (`weight_copies`), allowed under the same share as the plain copy. A model too large
for them keeps its bf16 weight alone and widens it for such steps on every call, a chunk at a time
(`widened_linear`): a 1B Llama's 180-token bf16 prompt, same CPU, 6.4 -> 2.2 s (float32's own: 1.8 s).

Those figures are from a CPU with avx512_bf16, where oneDNN's bf16 matmul is native. One without it (an AVX-512 Xeon
that lacks the flag, as Ice Lake and some VMs of later Xeons do, or an AVX2 CPU) has oneDNN convert every product:
SmolLM2's layer shapes at 9-63 rows ran 2-4x behind the float32 copy's, its LM head at 9 rows 14.6 ms against 7.7,
though float32 reads twice the bytes (Intel Xeon, AVX-512 and VNNI without avx512_bf16, 2 vCPUs). There a layer
with its float32 copy takes it from the first row past the small-rows kernel (`wide_rows`), and the bare bf16
decode step of SmolLM2 at batch 16 went 120-186 -> 63-73 ms, at 32 222 -> 82-95 ms (two interleaved rounds).
Per-call widening keeps WIDE_ROWS: on the 1B model's 28-token prompt it measured slower from fewer rows. Below it,
such a layer (a model too large for its copies) takes the small-rows kernel for every row count, eight rows a pass
over its weight, rather than torch's bf16 matmul: a 1B Llama's four bf16 GEMMs of a layer on the Xeon above took
14.0 ms at 9 rows (bf16 F.linear 35.6, `widened_linear` 29.2), 17.4 at 16 (43.5, 30.9), 31.7 at 32 (75.0, 37.4) and
45.6 at 48 (106.6, 43.0), so a 16-stream bf16 decode step of that model no longer runs at half float32's speed.

On a CPU with AMX (Intel Xeons from Sapphire Rapids on) oneDNN multiplies bf16 in tile units, several times
faster than AVX-512 once a product has rows enough to fill them: decode batches, draft verification, the LM head,
prompts. There every bf16 and int8 layer goes through oneDNN from `TILE_ROWS` rows: a bf16 weight is packed for it
already, and an int8 layer keeps a second, dequantized copy in the model's dtype, packed (x is never rounded to
int8: issue 68's answers stay the same; the tiles compute it in bf16 where the model is bf16). Below that row count
the bandwidth-bound GEMV of Conveyor's kernels reads the fewest bytes. `CONVEYOR_ONEDNN_ROWS` sets that row count
on any CPU (float32 layers obey it too), so it can be measured on an AMX machine and the path tested on every
other: oneDNN there picks AVX-512 or AVX2.

An AMD CPU with avx512_bf16 (Zen 4 and later) is the opposite case, and does not widen: its bf16 dot products
(vdpbf16ps) run far ahead of its float32 FMAs, and the same prompts took about 40% less in bf16 than through the
float32 copy (AMD EPYC Zen 4, 2 vCPUs, 4 interleaved rounds: 512 tokens 845-910 -> 520-566 ms, 4 x 256 tokens
1,426-1,537 -> 829-897, 8 x 64 tokens 712-729 -> 358-407, 32 x 40 tokens 1,607-1,794 -> 887-948). An AMX Xeon
computes bf16 on its tiles and does not widen either.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from conveyor import cpu
from conveyor.shard.layers.quantize import Int4Weight, Int8BlockWeight, QuantizationUnavailable

BACKENDS = ("auto", "onednn", "torch")
SMALL_ROWS_AVX512 = 8  # rows up to which the kernel's AVX-512 loop beats oneDNN (see above)
SMALL_ROWS_AVX2 = 8  # ...its AVX2 loop, on a CPU without AVX-512: all the kernel takes
SMALL_ROWS_PORTABLE = 2  # ...and its portable loop, on a CPU without AVX2
PLAIN_COPY_SHARE = 0.25  # of the available memory, that a model's weights twice over may take
WIDE_ROWS = 64  # tokens from which bf16 layers compute in float32 where the CPU widens, with avx512_bf16 (see above)
WIDEN_CHUNK = 1 << 21  # floats of a bf16 weight widened at a time where it keeps no float32 copy (widened_linear)
# Rows from which bf16 and int8 layers go through oneDNN on an AMX CPU (see above). Not yet measured on one: the
# AVX-512 small-rows loop's limit as it was measured on AMX Xeons (4 rows) plus one; `ONEDNN_ROWS_VARIABLE` overrides
# it (on any CPU) so that an AMX machine can find the row count where the tiles overtake the GEMV.
TILE_ROWS = 5
ONEDNN_ROWS_VARIABLE = "CONVEYOR_ONEDNN_ROWS"


def backend() -> str:
    """`CONVEYOR_GEMM`: auto (oneDNN where it can pack the weight, the small-rows kernel for a few rows),
    onednn (oneDNN alone), or torch (plain F.linear alone)."""
    chosen = os.environ.get("CONVEYOR_GEMM", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"CONVEYOR_GEMM must be one of {BACKENDS}, not {chosen!r}")
    return chosen


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack this weight on this machine."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu.onednn_bf16()


def kernel(weight: torch.Tensor) -> str:
    """Which kernel this weight gets, 'onednn' or 'torch' (F.linear), decided apart from the packing so that the
    tests can ask it for every CPU kind without packing a weight the real CPU could not."""
    chosen = backend()
    packs = chosen != "torch" and onednn_packs(weight)
    if chosen == "onednn" and not packs:
        raise ValueError(f"CONVEYOR_GEMM=onednn, but oneDNN cannot pack a {weight.dtype} weight on {weight.device}")
    return "onednn" if packs else "torch"


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The small-rows kernel's product of a few rows with a plain weight (the one call a layer makes into it)."""
    return torch.ops.conveyor.small_gemm(x, weight, bias)


def small_rows_kernel(weight: torch.Tensor) -> bool:
    """Whether a few rows go to the small-rows kernel: on CPU under `auto`, where the kernels build."""
    if weight.device.type != "cpu" or backend() != "auto" or weight.dim() != 2:
        return False
    from conveyor.shard.kernels import library

    return library.load()


def small_rows(found: cpu.Cpu) -> int:
    """Rows up to which a layer takes the small-rows kernel on this kind of CPU (the kernel's AVX-512 loop needs
    AVX512F, BW and VL, as the library of each AVX-512 kind is built with, its AVX2 loop AVX2 and FMA; `found` is
    what `cpu.probe` reports, so CONVEYOR_CPU_VARIANT=avx2 gives the AVX2 library's answer), and below the row
    count from which oneDNN takes every layer where one is set (`onednn_rows`)."""
    if {"avx512f", "avx512bw", "avx512vl"} <= found.flags:
        most = SMALL_ROWS_AVX512
    else:
        most = SMALL_ROWS_AVX2 if {"avx2", "fma"} <= found.flags else SMALL_ROWS_PORTABLE
    tiles = onednn_rows(found)
    return most if tiles is None else min(most, tiles - 1)


def onednn_rows(found: cpu.Cpu) -> int | None:
    """Rows from which bf16 and int8 layers go through oneDNN (`TILE_ROWS` on an AMX CPU, the variable's value on
    any), or None: each layer's own kernel at every row count it serves."""
    value = os.environ.get(ONEDNN_ROWS_VARIABLE)
    if value is None:
        return TILE_ROWS if found.amx else None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ONEDNN_ROWS_VARIABLE} must be a row count of at least 1, not {value!r}")
    return int(value)


@functools.cache
def machine_onednn_rows() -> int | None:
    """`onednn_rows` for this machine, asked once per process (tests that set the variable clear the cache)."""
    return onednn_rows(cpu.probe())


@functools.cache
def machine_small_rows() -> int:
    """`small_rows` for this machine, asked once per process."""
    return small_rows(cpu.probe())


def widens(found: cpu.Cpu) -> bool:
    """Whether bf16 layers compute many rows in float32 on this kind of CPU: all but those with AMX and AMD's with
    avx512_bf16, where bf16 computes faster than float32 (see above)."""
    return not (found.amx or (found.amd and found.avx512_bf16))


def wide_rows(found: cpu.Cpu) -> int:
    """Rows from which a bf16 layer with a float32 copy computes through it, where this kind of CPU widens: past the
    small-rows kernel without avx512_bf16 (oneDNN's bf16 runs far behind float32 there), from WIDE_ROWS with it
    (oneDNN's native bf16 kept decode batches ahead of the copy's twice the bytes); see above."""
    return WIDE_ROWS if found.avx512_bf16 else small_rows(found) + 1


@functools.cache
def machine_wide_rows() -> int:
    """`wide_rows` for this machine, asked once per process."""
    return wide_rows(cpu.probe())


@functools.cache
def machine_widens() -> bool:
    """`widens` for this machine, asked once per process."""
    return widens(cpu.probe())


def _widens_here(dtype: torch.dtype) -> bool:
    """Whether layers of this dtype pack a float32 copy on this machine (where they keep copies at all)."""
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and machine_widens()


def weight_copies(dtype: torch.dtype) -> int:
    """How many copies' worth of its weight (in `dtype`) a layer with plain copies keeps: packed and plain, and for
    bf16 where it widens, a float32 packed weight too (two bf16 copies' worth)."""
    return 4 if _widens_here(dtype) else 2


def plain_copy_fits(weight_bytes: int, available: float, copies: int = 2) -> bool:
    """Whether a packed model may keep a plain copy of its weights for the small-rows kernel as well (`copies`:
    `weight_copies` of its dtype)."""
    return copies * weight_bytes <= PLAIN_COPY_SHARE * available


def _widened(weight: torch.Tensor, plain_copy: bool) -> bool:
    """Whether this bf16 layer packs a float32 copy for many rows too."""
    return _widens_here(weight.dtype) and plain_copy and small_rows_kernel(weight)


class Gemm:
    """One weight [out, in], ready for `x [T, in] -> [T, out]`: packed for oneDNN, or plain for F.linear, and plain
    for the small-rows kernel where it serves (`plain_copy`: whether a packed weight may keep a plain copy too)."""

    def __init__(self, weight: torch.Tensor, plain_copy: bool = True, quantize: str | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.int8: Int8BlockWeight | None = None
        self.int4: Int4Weight | None = None
        self.tiles: torch.Tensor | None = None  # int8: a dequantized copy packed for oneDNN, from `tile_rows` rows
        self.tile_rows = 0
        if quantize is not None:
            self._quantize(weight, quantize)
            self.tiles = self._tile_copy(plain_copy)
            return
        # Packed for oneDNN only where the plain copy is kept beside it, or where the small-rows kernel does not
        # serve: a model too large for both copies keeps the plain weight alone (see `plain_copy_fits`).
        self.packed = kernel(weight) == "onednn" and (plain_copy or not small_rows_kernel(weight))
        weight = weight.contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight
        # Many tokens in float32 (see widens and wide_rows)
        wide = _widened(weight, plain_copy)
        self.wide: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(weight.float()) if wide else None
        few = small_rows_kernel(weight) and (plain_copy or not self.packed)
        self.plain: torch.Tensor | None = weight if few else None
        # Rows from which this bf16 layer computes in float32 (see `widens`): through its float32 copy, or, too large
        # to keep one, through its plain weight widened per call (`widened_linear`); None where it never does.
        widens_alone = not wide and not self.packed and few and _widens_here(weight.dtype)
        self.widen_rows: int | None = machine_wide_rows() if wide else WIDE_ROWS if widens_alone else None
        # Rows up to which the plain copy serves: the kernel's own, or, for a bf16 layer widening alone, every row
        # short of widening, in passes of the kernel's rows (see above).
        self.small_rows = (WIDE_ROWS - 1 if widens_alone else machine_small_rows()) if few else 0

    def _quantize(self, weight: torch.Tensor, quantize: str) -> None:
        if quantize not in ("int8", "int4"):
            raise ValueError(f"unknown quantization {quantize!r}")
        if weight.device.type != "cpu":
            raise QuantizationUnavailable(f"--quantize {quantize} runs on CPU only (no CUDA kernel yet)")
        from conveyor.shard.kernels import library

        if not library.load():
            raise QuantizationUnavailable(f"--quantize {quantize} needs Conveyor's C++ kernels, which did not build")
        if quantize == "int8":
            self.int8 = Int8BlockWeight.quantize(weight)
        else:
            self.int4 = Int4Weight.quantize(weight)
        self.packed, self.plain, self.weight, self.wide = False, None, None, None
        self.small_rows, self.widen_rows = 0, None

    def _tile_copy(self, plain_copy: bool) -> torch.Tensor | None:
        """An int8 layer's dequantized weight packed for oneDNN, for `onednn_rows` rows and more, where one is set,
        the copy fits (`plain_copy`) and oneDNN packs the model's dtype here; else None."""
        rows = machine_onednn_rows()
        if self.int8 is None or rows is None or not plain_copy or backend() != "auto":
            return None
        dense = self.int8.dequantize().to(self.dtype)
        if not onednn_packs(dense):
            return None
        self.tile_rows = rows
        return torch.ops.mkldnn._reorder_linear_weight(dense.contiguous())

    @property
    def nbytes(self) -> int:
        """What this layer's weight takes in memory (both copies where a plain one is kept)."""
        if self.int8 is not None or self.int4 is not None:
            tiles = self.out_features * self.in_features * self.dtype.itemsize if self.tiles is not None else 0
            return (self.int8 or self.int4).nbytes + tiles
        plain = self.plain.nbytes if self.plain is not None and self.plain is not self.weight else 0
        wide = self.out_features * self.in_features * 4 if self.wide is not None else 0
        return self.out_features * self.in_features * self.dtype.itemsize + plain + wide

    def dense(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor, whatever its layout (dequantized where quantized)."""
        if self.int8 is not None or self.int4 is not None:
            return (self.int8 or self.int4).dequantize().to(self.dtype)
        return self.weight.to_dense() if self.packed else self.weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], self.out_features)
        if self.tiles is not None and x.shape[0] >= self.tile_rows:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.tiles, bias, "none", [], "")
        if self.int8 is not None:
            return torch.ops.conveyor.int8_gemm(x.contiguous(), self.int8.values, self.int8.scales, bias)
        if self.int4 is not None:
            return torch.ops.conveyor.int4_gemm(x.contiguous(), self.int4.packed, self.int4.scales, bias)
        if self.plain is not None and 0 < x.shape[0] <= self.small_rows:
            return small_gemm(x.contiguous(), self.plain, bias)
        if self.widen_rows is not None and x.shape[0] >= self.widen_rows:
            if self.wide is None:
                return widened_linear(x, self.plain, bias)
            wide_bias = None if bias is None else bias.float()
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.wide, wide_bias, "none", [], "").to(self.dtype)
        if not self.packed:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, bias, "none", [], "")


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` in float32 for a bf16 layer too large to keep its float32 copy (see `widens`): the weight widened
    WIDEN_CHUNK floats at a time, which stay in the allocator's reach (widening it whole faulted in fresh pages on
    every call), and the output rounded back to bf16. A 1B Llama's 8192 x 2048 gate/up weight on an Intel Xeon
    without avx512_bf16 (2 vCPUs): 64 rows 46 -> 17 ms, 180 rows 111 -> 33, 512 rows 300 -> 79 against bf16 F.linear;
    widening it whole took 36, 52 and 100."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    x_wide, bias_wide = x.float(), None if bias is None else bias.float()
    rows = max(1, WIDEN_CHUNK // weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        chunk_bias = None if bias_wide is None else bias_wide[part]
        out[:, part] = F.linear(x_wide, weight[part].float(), chunk_bias)
    return out
