"""The small-rows GEMM kernel (one or two rows of a linear layer) against F.linear, and which rows take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conveyor import cpu
from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import gemm
from conveyor.shard.layers.gemm import Gemm, plain_copy_fits
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here (the fallback test below covers that)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape", [(48, 64), (37, 131), (1000, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("op", ["small_gemm", "small_gemm_portable", "small_gemm_widening", "small_gemm_avx2"])
def test_kernel_equals_f_linear(
    built, dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool, op: str
) -> None:
    """Odd sizes leave a remainder past the vector width (and out rows past the AVX-512 path's blocks of four);
    each output row is a sum in float of widened products, so it matches float64 up to the output dtype's
    rounding. `small_gemm_portable` is the plain C++ loop, which a CPU without AVX2 runs, `small_gemm_avx2` the AVX2
    loop a CPU without AVX-512 runs (float16 takes the plain loop there), and `small_gemm_widening` the AVX-512 loop a
    CPU without the bfloat16 dot product runs: all tested here too."""
    generator = torch.Generator().manual_seed(rows * 1000 + shape[1])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    got = getattr(torch.ops.conveyor, op)(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, out_features)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["small_gemm", "small_gemm_widening", "small_gemm_avx2"])
def test_a_rows_output_does_not_depend_on_its_batch(built, dtype: torch.dtype, op: str) -> None:
    """The same bits for a row whatever rows share its call: the row counts take different register blocks (chunks
    of four, one chunk of five or six, a widening split into pairs), and each keeps the order of a row's sums, as
    the float32 oracle's batch invariance needs. 131 inputs leave a tail past the blocks of 32."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 131, generator=generator).to(dtype)
    x = torch.randn(21, 131, generator=generator).to(dtype)
    kernel = getattr(torch.ops.conveyor, op)
    alone = torch.cat([kernel(x[m : m + 1], weight, None) for m in range(21)])
    for rows in [*range(2, 10), 16, 21]:  # past eight, in passes of eight rows and a remainder
        assert torch.equal(kernel(x[:rows], weight, None), alone[:rows]), rows


def test_kernel_refuses_what_it_does_not_compute(built) -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="at least one row"):
        torch.ops.conveyor.small_gemm(torch.randn(0, 16), weight, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.conveyor.small_gemm(torch.randn(1, 16, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match=r"x \[M, in\]"):
        torch.ops.conveyor.small_gemm(torch.randn(1, 15), weight, None)


@pytest.mark.parametrize("plain_copy", [True, False], ids=["both-copies", "plain-only"])
def test_gemm_sends_few_rows_to_the_kernel(built, monkeypatch: pytest.MonkeyPatch, plain_copy: bool) -> None:
    """Rows up to the machine's small_rows take the kernel; more rows take oneDNN's packed weight where both copies
    fit, else F.linear on the plain weight, which is then the only copy (a model too large for two keeps the one
    every decode step reads fastest). Every route gives F.linear's numbers."""
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    calls: list[int] = []
    real = torch.ops.conveyor.small_gemm
    monkeypatch.setattr(gemm, "small_gemm", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = Gemm(weight, plain_copy)
    assert layer.packed is plain_copy  # float32 on CPU: oneDNN packs it everywhere, where both copies fit
    assert layer.plain is not None and (layer.plain is layer.weight) is not plain_copy
    for rows in range(1, 10):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == list(range(1, gemm.small_rows(cpu.probe()) + 1))
    # Leading dimensions fold into rows, as for F.linear.
    x = torch.randn(1, 2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert layer.nbytes == weight.nbytes * (2 if plain_copy else 1)


def test_the_kernel_takes_as_many_rows_as_its_loop_wins() -> None:
    """Every CPU kind's answer, on any machine: the AVX-512 loop needs F, BW and VL, as the kernel's build does, the
    AVX2 one AVX2 and FMA."""
    kind = lambda *flags: cpu.Cpu("fake", 2, frozenset(flags), False)  # noqa: E731
    assert gemm.small_rows(kind("sse4_2")) == gemm.SMALL_ROWS_PORTABLE == 2
    assert gemm.small_rows(kind("avx2", "fma")) == gemm.SMALL_ROWS_AVX2 == 8
    assert gemm.small_rows(kind("avx2", "fma", "avx512f")) == gemm.SMALL_ROWS_AVX2
    assert gemm.small_rows(kind("avx2", "avx512f", "avx512bw", "avx512vl")) == gemm.SMALL_ROWS_AVX512 == 8


@pytest.mark.parametrize("chosen", ["onednn", "torch"])
def test_the_other_backends_never_take_the_kernel(monkeypatch: pytest.MonkeyPatch, chosen: str) -> None:
    """CONVEYOR_GEMM=onednn or torch measure those backends alone: no plain copy, no kernel, nothing built."""
    monkeypatch.setenv("CONVEYOR_GEMM", chosen)
    monkeypatch.setattr(kernels, "load", lambda: pytest.fail("asked for the kernels"))
    assert Gemm(torch.randn(8, 4)).plain is None


def test_without_the_kernels_every_row_takes_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    monkeypatch.setattr(kernels, "load", lambda: False)
    layer = Gemm(torch.randn(8, 4))
    assert layer.plain is None
    x = torch.randn(1, 4)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dense()))


@pytest.mark.parametrize("widens", [True, False], ids=["widening-cpu", "bf16-cpu"])
def test_a_bf16_layer_without_its_float32_copy_widens_a_prompt_per_call(
    built, monkeypatch: pytest.MonkeyPatch, widens: bool
) -> None:
    """A bf16 model too large for its copies keeps the plain weight alone. Where the CPU widens, a prompt's rows are
    computed in float32 from the weight widened a chunk at a time (the last chunk short here), as the float32 copy
    would compute them; elsewhere they stay in bf16."""
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    monkeypatch.setattr(gemm, "machine_widens", lambda: widens)
    monkeypatch.setattr(gemm, "WIDEN_CHUNK", 64 * 7)  # 7 weight rows a chunk: 96 rows in 14 chunks
    calls: list[int] = []
    real = gemm.widened_linear
    monkeypatch.setattr(gemm, "widened_linear", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    layer = Gemm(weight, plain_copy=False)
    assert layer.wide is None and layer.plain is layer.weight and not layer.packed
    assert layer.widen_rows == (gemm.WIDE_ROWS if widens else None)
    assert layer.small_rows == (gemm.WIDE_ROWS - 1 if widens else gemm.machine_small_rows())
    x = torch.randn(gemm.WIDE_ROWS, 64).bfloat16()
    got = layer(x, bias)
    assert got.dtype == torch.bfloat16 and calls == ([gemm.WIDE_ROWS] if widens else [])
    if widens:
        want = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        assert (got == want).float().mean() > 0.99  # the same float32 sums, rounded once to bf16
    layer(x[:3], bias)  # a few rows take the small-rows kernel, never the widening
    assert len(calls) == (1 if widens else 0)


@pytest.mark.parametrize("rows", [9, 16, gemm.WIDE_ROWS - 1])
def test_a_bf16_layer_widening_alone_takes_the_kernel_short_of_widening(
    built, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """Where the CPU widens, a bf16 layer with its plain weight alone sends every step short of WIDE_ROWS to the
    small-rows kernel (eight rows a pass over the weight) instead of torch's bf16 matmul, which converts every
    product on such a CPU: each row gets the bits it gets alone."""
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    monkeypatch.setattr(gemm, "machine_widens", lambda: True)
    calls: list[int] = []
    real = torch.ops.conveyor.small_gemm
    monkeypatch.setattr(gemm, "small_gemm", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    layer = Gemm(weight, plain_copy=False)
    got = layer(x, bias)
    assert calls == [rows]
    assert torch.equal(got, torch.cat([real(x[m : m + 1], weight, bias) for m in range(rows)]))
    want = F.linear(x.double(), weight.double(), bias.double())
    assert (got.double() - want).abs().max().item() <= TOLERANCE[torch.bfloat16] * want.abs().max().item()


def test_a_plain_weight_is_its_own_copy(built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN does not pack (here: float16), the kernel reads the one weight there is, copy or not."""
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    weight = torch.randn(8, 4, dtype=torch.float16)
    layer = Gemm(weight, plain_copy=False)
    assert not layer.packed and layer.plain is layer.weight


def test_plain_copies_only_where_memory_allows(tmp_path: Path) -> None:
    """The engine keeps plain copies when twice the weights fit in PLAIN_COPY_SHARE of the memory, judged from
    the checkpoint's headers in the serving dtype, per rank."""
    save_file({"a": torch.zeros(100, 10), "b": torch.zeros(50, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    assert Weights(tmp_path, ProcessGroup(0, 1), torch.float32, torch.device("cpu")).nbytes() == 1050 * 4
    assert Weights(tmp_path, ProcessGroup(0, 2), torch.bfloat16, torch.device("cpu")).nbytes() == 1050
    share = gemm.PLAIN_COPY_SHARE
    assert plain_copy_fits(1000, 2000 / share)
    assert not plain_copy_fits(1001, 2000 / share)


@pytest.mark.parametrize("widens", [True, False], ids=["widens", "amx"])
def test_weight_copies_count_the_float32_copy(monkeypatch: pytest.MonkeyPatch, widens: bool) -> None:
    monkeypatch.setattr(gemm, "machine_widens", lambda: widens)
    assert gemm.weight_copies(torch.float32) == 2
    assert gemm.weight_copies(torch.bfloat16) == (4 if widens else 2)
    assert plain_copy_fits(1000, 4000 / gemm.PLAIN_COPY_SHARE, gemm.weight_copies(torch.bfloat16))
    assert plain_copy_fits(1001, 4000 / gemm.PLAIN_COPY_SHARE, gemm.weight_copies(torch.bfloat16)) == (not widens)


@pytest.mark.parametrize("widens", [True, False], ids=["widens", "amx"])
@pytest.mark.parametrize("rows", [1, 8, 9, gemm.WIDE_ROWS - 1, gemm.WIDE_ROWS, 200])
def test_bf16_steps_of_wide_rows_compute_in_float32(
    built, monkeypatch: pytest.MonkeyPatch, widens: bool, rows: int
) -> None:
    """A bf16 layer with a plain copy packs a float32 one where the CPU widens, and steps of `machine_wide_rows`
    tokens or more (past the small-rows kernel without avx512_bf16, WIDE_ROWS with it) go through it: their output
    is the float32 product of the same bf16 values, rounded once to bf16. Fewer rows stay on the bf16 kernels, within
    their tolerance of it. Either branch runs on any machine, and on an AVX2 CPU too, where oneDNN packs no bf16
    weight: the plain weight is then the only bf16 copy."""
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    monkeypatch.setattr(gemm, "machine_widens", lambda: widens)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias, x = torch.randn(96, generator=gen).bfloat16(), torch.randn(rows, 64, generator=gen).bfloat16()
    layer = Gemm(weight)
    wide_rows = gemm.wide_rows(cpu.probe())
    assert (layer.wide is not None) == widens and layer.widen_rows == (wide_rows if widens else None)
    assert layer.packed is cpu.onednn_bf16()
    bf16_copies = 2 if layer.packed else 1  # packed and plain, or the plain weight alone
    assert layer.nbytes == weight.nbytes * (bf16_copies + (2 if widens else 0))  # the float32 copy: two bf16's worth
    assert torch.equal(layer.dense(), weight)
    calls = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", _counting(torch.ops.mkldnn._linear_pointwise, calls))
    out = layer(x, bias)
    exact = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16
    if widens and rows >= wide_rows:
        assert calls == [torch.float32]
        torch.testing.assert_close(out, exact.bfloat16(), rtol=1e-2, atol=1e-2)  # one rounding, as oneDNN's
    else:
        assert torch.float32 not in calls
        torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=5e-2)
    assert Gemm(weight, plain_copy=False).wide is None  # no copies allowed: no float32 one either


def _counting(op, calls: list):
    def counted(x, *args):
        calls.append(x.dtype)
        return op(x, *args)

    return counted
