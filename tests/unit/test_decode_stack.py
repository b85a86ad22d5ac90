"""The decode step in one C++ call (shard/layers/decode_stack.py) against the model's own modules, which stay the
reference: the same logits bit for bit, step after step, for every Llama-family architecture, weight kind and KV
dtype, at row counts on both sides of the small-rows kernel's limit; and the steps it must leave to the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import cpu
from conveyor.shard import offline
from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import decode_stack, gemm
from conveyor.shard.layers.attention import build_per_window

ARCHITECTURES = ["tiny_model", "qwen2_model", "qwen3_model", "mistral_model", "phi3_model"]
VARIANTS = [  # dtype, --quantize, --kv-cache-dtype
    ("float32", None, "auto"),
    ("bfloat16", None, "auto"),
    ("float32", "int8", "auto"),
    ("float32", "int4", "auto"),
    ("float32", None, "int8"),
    ("bfloat16", "int8", "int8"),
]
BLOCKS_PER_ROW = 8


@pytest.fixture(scope="module")
def built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here (the modules serve every step)")


def _decode_logits(engine: offline.Engine, rows: int, fused: bool, steps: int = 4) -> torch.Tensor:
    """Each row's logits over `steps` greedy decode steps after its own prompt, on a fresh pool."""
    stack = engine.model.decode_stack
    engine.model.decode_stack = stack if fused else None
    try:
        cache = engine.allocate(BLOCKS_PER_ROW * rows)
        tables = [list(range(r * BLOCKS_PER_ROW, (r + 1) * BLOCKS_PER_ROW)) for r in range(rows)]
        prompts = [engine.tokenizer(f"def row_{r}(x):\n    return x * {r}").input_ids for r in range(rows)]
        for r, prompt in enumerate(prompts):
            offline.forward(engine, cache, [(prompt, tables[r], 0)], torch.tensor([len(prompt) - 1]))
        lengths, tokens, out = [len(p) for p in prompts], [p[-1] for p in prompts], []
        for _ in range(steps):
            feed = [([tokens[r]], tables[r], lengths[r]) for r in range(rows)]
            logits = offline.forward(engine, cache, feed, torch.arange(rows))
            out.append(logits)
            tokens, lengths = logits.argmax(-1).tolist(), [n + 1 for n in lengths]
        return torch.stack(out)
    finally:
        engine.model.decode_stack = stack


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(x or "float" for x in v))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_one_call_gives_the_modules_bits(built, request, architecture: str, variant: tuple, monkeypatch) -> None:
    dtype, quantize, kv = variant
    engine = offline.load(request.getfixturevalue(architecture), dtype, quantize, kv)
    stack = engine.model.decode_stack
    assert stack is not None, "the stack binds every Llama-family model"
    calls = []
    monkeypatch.setattr(type(stack), "__call__", _counting(type(stack).__call__, calls))
    for rows in (1, 3, gemm.small_rows(cpu.probe()) + 1):  # the last past the small-rows kernel: oneDNN's
        fused = _decode_logits(engine, rows, fused=True)
        # bf16 past the small-rows kernel on a CPU without avx512_bf16: the float32 copies', through the modules
        widened = stack.widen_rows is not None and rows >= stack.widen_rows
        assert bool(calls) is not widened, "the fused step serves the decode rows the stack takes"
        calls.clear()
        assert torch.equal(fused, _decode_logits(engine, rows, fused=False))
        assert not calls


def _counting(call, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    return counted


def test_prompts_lora_and_wide_rows_stay_with_the_modules(built, tiny_model: Path) -> None:
    engine = offline.load(tiny_model)
    stack = engine.model.decode_stack
    size = engine.block_size

    def groups(query_lens: list[int]) -> list:
        tables = [[i] for i in range(len(query_lens))]
        metas = build_per_window((None,), tables, [q + 2 for q in query_lens], query_lens, size, engine.device)
        return metas[None].groups

    assert stack.serves(2, groups([1, 1]))
    assert not stack.serves(5, groups([4, 1]))  # a prompt chunk joins the step
    assert not stack.serves(3, groups([3]))
    stack.widen_rows = 64
    assert stack.serves(2, groups([1, 1]))
    assert not stack.serves(64, groups([1] * 64))  # bf16 widening to float32 at many rows: the modules'
    stack.widen_rows = None
    linear = engine.model.layers[1].mlp.down
    linear.lora = object()  # a resident adapter's site
    try:
        assert not stack.serves(2, groups([1, 1]))
    finally:
        linear.lora = None


def test_the_switch_turns_it_off(built, tiny_model: Path, monkeypatch) -> None:
    monkeypatch.setenv(decode_stack.SWITCH, "layers")
    assert offline.load(tiny_model).model.decode_stack is None
    monkeypatch.setenv(decode_stack.SWITCH, "sideways")
    with pytest.raises(ValueError, match="CONVEYOR_DECODE"):
        offline.load(tiny_model)


def test_the_stack_refuses_what_does_not_fit(built, tiny_model: Path) -> None:
    engine = offline.load(tiny_model)
    native = engine.model.decode_stack.stack
    hidden = torch.zeros(1, engine.model.config.hidden_size)
    cache = engine.allocate(2)
    args = (torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), cache.keys, cache.values, torch.zeros(1, dtype=torch.long))
    tables = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="half layers"):
        native.run(hidden, None, *args, *tables, 0, native.halves() + 1)
    with pytest.raises(RuntimeError, match="a cache per layer"):
        native.run(hidden, None, *args[:2], cache.keys[:1], cache.values[:1], args[4], *tables, 0, 2)
