"""`--quantize int8`: weights stored as int8 with a scale per output row, the kernel against the dequantized
reference, the bytes really saved, and serving end to end within a stated distance of float32's log-probabilities."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from conftest import Server, free_port, start_server
from conveyor.shard.distributed import ProcessGroup
from conveyor.shard.kernels import build as kernels
from conveyor.shard.layers.embedding import VocabParallelEmbedding
from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.layers.quantize import Int8Weight

# Mean absolute difference of prompt-token log-probabilities, int8 against float32, on the tiny test model.
INT8_LOGPROB_BOUND = 0.05


@pytest.fixture(scope="module")
def built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here")


def test_quantization_rounds_each_row_to_its_own_scale() -> None:
    weight = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    weight[3] = 0
    q = Int8Weight.quantize(weight)
    assert q.values.dtype == torch.int8 and q.scales.dtype == torch.float32
    assert q.values.abs().max() <= 127 and torch.equal(q.values[3], torch.zeros(40, dtype=torch.int8))
    error = (q.dequantize() - weight).abs()
    assert (error <= q.scales[:, None] / 2 + 1e-7).all()  # rounding: at most half a step
    assert q.nbytes == 6 * 40 + 6 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_kernel_equals_the_dequantized_product(built, dtype: torch.dtype, rows: int) -> None:
    """Every row count (the kernel dots four rows of x at a time, then the rest one by one), odd sizes."""
    generator = torch.Generator().manual_seed(rows)
    q = Int8Weight.quantize(torch.randn(37, 131, generator=generator))
    x = torch.randn(rows, 131, generator=generator).to(dtype)
    bias = torch.randn(37, generator=generator).to(dtype)
    got = torch.ops.conveyor.int8_gemm(x, q.values, q.scales, bias)
    want = F.linear(x.double(), q.dequantize().double(), bias.double())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()


def test_a_quantized_layer_keeps_int8_only(built) -> None:
    weight = torch.randn(96, 64)
    layer = Gemm(weight, quantize="int8")
    assert layer.int8 is not None and layer.int8.values.dtype == torch.int8
    assert layer.weight is None and layer.plain is None  # no float copy left behind
    assert layer.nbytes == 96 * 64 + 96 * 4 <= 0.3 * weight.nbytes
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.int8.dequantize()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.dense(), layer.int8.dequantize())


def test_a_quantized_embedding_looks_up_its_rows() -> None:
    table = torch.randn(50, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    embedding = VocabParallelEmbedding(table, ProcessGroup(0, 1), quantize="int8")
    ids = torch.tensor([0, 7, 49, 7])
    q = Int8Weight.quantize(table)
    got = embedding(ids)
    assert got.dtype == torch.bfloat16 and embedding.weight is None
    torch.testing.assert_close(got, q.dequantize()[ids].bfloat16())


@pytest.fixture(scope="module")
def pair(tiny_model: Path) -> Iterator[tuple[Server, Server]]:
    """The tiny model served twice: float32 and int8."""
    full = start_server(tiny_model, "--master-port", str(free_port()))
    try:
        int8 = start_server(tiny_model, "--master-port", str(free_port()), "--quantize", "int8")
    except BaseException:
        full.stop()
        raise
    yield full, int8
    assert full.stop() == 0 and int8.stop() == 0


def prompt_logprobs(server: Server, prompt: str) -> list[float]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 1, "decoder_input_details": True, "details": True}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [t["logprob"] for t in response.json()["details"]["prefill"][1:]]


def test_int8_serves_within_the_bound_of_float32(built, pair: tuple[Server, Server]) -> None:
    full, int8 = pair
    info = int8.info()
    assert info["quantize"] == "int8" and full.info()["quantize"] is None
    assert info["weight_bytes"] <= 0.3 * full.info()["weight_bytes"]
    prompts = ["def add(a, b):\n    return a + b\n", "class Queue:\n    def __init__(self):\n        self.items = []"]
    differences = []
    for prompt in prompts:
        a, b = prompt_logprobs(full, prompt), prompt_logprobs(int8, prompt)
        assert len(a) == len(b) > 10
        differences += [abs(x - y) for x, y in zip(a, b)]
    mean = sum(differences) / len(differences)
    assert 0 < mean <= INT8_LOGPROB_BOUND, mean
    body = {"inputs": prompts[0], "parameters": {"max_new_tokens": 8}}
    assert httpx.post(f"{int8.url}/generate", json=body, timeout=120).json()["generated_text"]
