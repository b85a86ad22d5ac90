"""Where the row count says so (`gemm.onednn_rows`: an AMX CPU's TILE_ROWS, or CONVEYOR_ONEDNN_ROWS on any CPU),
bf16 and int8 layers go through oneDNN rather than Conveyor's own kernels: which CPU kinds take that path, and that
forced on here (oneDNN then picks this CPU's AVX-512 or AVX2) it gives the numbers the kernels give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conveyor import cpu
from conveyor.shard import offline
from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import gemm
from conveyor.shard.layers.gemm import Gemm

kind = lambda *flags: cpu.Cpu("fake", 2, frozenset(flags), False)  # noqa: E731
AVX512 = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl")


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch):
    """Sets CONVEYOR_ONEDNN_ROWS to a row count for the test (the machine's answers are cached per process)."""

    def force(rows: int) -> None:
        monkeypatch.setenv(gemm.ONEDNN_ROWS_VARIABLE, str(rows))
        gemm.machine_onednn_rows.cache_clear()
        gemm.machine_small_rows.cache_clear()
        gemm.machine_wide_rows.cache_clear()  # past the small rows where the CPU lacks avx512_bf16

    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    yield force
    monkeypatch.delenv(gemm.ONEDNN_ROWS_VARIABLE, raising=False)
    gemm.machine_onednn_rows.cache_clear()
    gemm.machine_small_rows.cache_clear()
    gemm.machine_wide_rows.cache_clear()


def test_only_an_amx_cpu_sends_rows_to_onednn_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gemm.ONEDNN_ROWS_VARIABLE, raising=False)
    amx = kind(*AVX512, "amx_bf16", "amx_int8")
    assert gemm.onednn_rows(amx) == gemm.TILE_ROWS == 5
    assert gemm.small_rows(amx) == gemm.TILE_ROWS - 1  # the tiles from 5 rows, the GEMV below
    assert gemm.onednn_rows(kind(*AVX512)) is None and gemm.onednn_rows(kind("avx2", "fma")) is None
    monkeypatch.setenv(gemm.ONEDNN_ROWS_VARIABLE, "3")
    assert gemm.onednn_rows(kind("avx2", "fma")) == gemm.onednn_rows(amx) == 3
    assert gemm.small_rows(kind("avx2", "fma")) == gemm.small_rows(amx) == 2  # the kernels stop below it
    monkeypatch.setenv(gemm.ONEDNN_ROWS_VARIABLE, "20")
    assert gemm.small_rows(kind("avx2", "fma")) == gemm.SMALL_ROWS_AVX2  # never more than a kernel takes
    for wrong in ("0", "many", "-2"):
        monkeypatch.setenv(gemm.ONEDNN_ROWS_VARIABLE, wrong)
        with pytest.raises(ValueError, match=gemm.ONEDNN_ROWS_VARIABLE):
            gemm.onednn_rows(amx)


def test_an_int8_layer_takes_its_onednn_copy_from_the_row_count(forced, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels.load():
        pytest.skip("int8 layers need the C++ kernels")
    forced(3)
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = Gemm(weight, quantize="int8")
    assert layer.tiles is not None and layer.tile_rows == 3
    assert layer.nbytes == layer.int8.nbytes + weight.nbytes  # the copy counts in the model's bytes
    dense = layer.dense()
    for rows in range(1, 7):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x, bias), F.linear(x, dense, bias), rtol=1e-5, atol=1e-4)
    assert calls == [3, 4, 5, 6]
    assert Gemm(weight, plain_copy=False, quantize="int8").tiles is None  # no room for a second copy


def test_without_the_variable_int8_layers_keep_their_kernel_here(forced, monkeypatch) -> None:
    if not kernels.load() or cpu.probe().amx:
        pytest.skip("needs the C++ kernels, on a CPU without AMX")
    monkeypatch.delenv(gemm.ONEDNN_ROWS_VARIABLE, raising=False)
    gemm.machine_onednn_rows.cache_clear()
    assert Gemm(torch.randn(8, 32), quantize="int8").tiles is None


def test_a_model_forced_onto_onednn_decodes_as_its_kernels_do(forced, tiny_model: Path) -> None:
    """The whole int8 model: from the row count on, its decode steps leave the one-call stack for the modules and
    oneDNN, and their logits stay the kernels' (the same dequantized weights, summed in another order)."""
    if not kernels.load():
        pytest.skip("int8 layers need the C++ kernels")
    prompts = [f"def row_{r}(x):\n    return x * {r}" for r in range(5)]
    plain = offline.load(tiny_model, "float32", "int8")
    forced(3)
    tiled = offline.load(tiny_model, "float32", "int8")
    assert tiled.model.decode_stack.tile_rows == 3 and plain.model.decode_stack.tile_rows is None
    for rows in (2, 5):
        want = _last_logits(plain, prompts[:rows])
        got = _last_logits(tiled, prompts[:rows])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _last_logits(engine: offline.Engine, prompts: list[str]) -> torch.Tensor:
    """Each prompt read alone, then one decode step of all of them together: that step's logits."""
    blocks = 8
    cache = engine.allocate(blocks * len(prompts))
    feed = []
    for r, text in enumerate(prompts):
        ids = engine.tokenizer(text).input_ids
        table = list(range(r * blocks, (r + 1) * blocks))
        offline.forward(engine, cache, [(ids[:-1], table, 0)], torch.tensor([len(ids) - 2]))
        feed.append(([ids[-1]], table, len(ids) - 1))
    return offline.forward(engine, cache, feed, torch.arange(len(prompts)))
