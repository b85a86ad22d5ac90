"""The fused C++ ops of a decode step (residual add + RMSNorm, silu(gate) * up, the rotation, the greedy sampler's
choice) against the torch code they replace, which stays the reference path: the same bits where the kernel rounds
as torch does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import cpu
from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers.norm import RMSNorm
from conveyor.shard.layers.rotary import apply_rotary, rotate
from conveyor.shard.sampling.sampler import greedy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here (the layers keep their torch paths)")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 48], ids=["whole-head", "partial"])
def test_rotation_is_torch_bit_for_bit(built, dtype: torch.dtype, rotary_dim: int) -> None:
    """Each product rounded, then the sum, as torch's muls and add round them (no fused multiply-add)."""
    g = _generator(rotary_dim)
    x = torch.randn(7, 12, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(7, 1, rotary_dim, generator=g).to(dtype) for _ in range(2))
    want = apply_rotary(x, cos, sin)
    got = x.clone()
    torch.ops.conveyor.rotary_(got, cos, sin)
    assert torch.equal(got, want)


def test_rotate_takes_the_kernel_in_place_or_the_reference(built) -> None:
    g = _generator(1)
    x = torch.randn(3, 4, 32, generator=g)
    cos, sin = torch.randn(3, 1, 32, generator=g), torch.randn(3, 1, 32, generator=g)
    want = apply_rotary(x, cos, sin)
    turned = x.clone()
    assert rotate(turned, cos, sin, kernel=True) is turned  # in place
    assert torch.equal(turned, want)
    untouched = x.clone()
    assert torch.equal(rotate(untouched, cos, sin, kernel=False), want)
    assert torch.equal(untouched, x)  # the reference path leaves its input alone
    strided = torch.randn(3, 4, 64, generator=g)[..., :32]  # not contiguous: the reference path
    assert torch.equal(rotate(strided, cos, sin, kernel=True), apply_rotary(strided, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_mul_matches_torch(built, dtype: torch.dtype, rows: int) -> None:
    """silu rounded to the dtype, then the product, on rows whose width leaves a short last block: torch's bits in
    every dtype where torch dispatches to the same vector width as the kernel's build (the same SLEEF exp); where
    it does not, float32 may differ in the last bit."""
    gate_up = 4 * torch.randn(rows, 2 * 100, generator=_generator(rows)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = torch.ops.conveyor.silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    same_width = (torch.backends.cpu.get_cpu_capability() == "AVX512") == cpu.probe().avx512
    if dtype == torch.float32 and not same_width:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_silu_mul_refuses_an_odd_width(built) -> None:
    with pytest.raises(RuntimeError, match="even last dimension"):
        torch.ops.conveyor.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_adds_in_place_then_normalises(built, dtype: torch.dtype) -> None:
    g = _generator(3)
    hidden, delta = torch.randn(4, 96, generator=g).to(dtype), torch.randn(4, 96, generator=g).to(dtype)
    norm = RMSNorm(torch.randn(96, generator=g).to(dtype), 1e-5)
    original = hidden.clone()
    want_hidden = hidden + delta
    want = norm(want_hidden)
    got = norm.add_forward(hidden, delta)
    assert torch.equal(hidden, want_hidden)  # the residual stream took the add
    assert torch.equal(got, want)
    norm.kernel = False  # the torch path: the same add, the reference norm
    torch.testing.assert_close(norm.add_forward(original, delta), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(original, want_hidden)


def test_bfloat16_rounding_is_torchs_at_ties_infinities_and_nans(built) -> None:
    """The kernels' branch-free rounding to bfloat16 (float_types.h, narrow) against torch's add: sums that fall
    exactly between two bfloat16 values go to the even one, and infinities and NaNs survive."""
    tie = 2.0**-8  # half of bfloat16's step just above 1
    x = torch.tensor([[1.0, 1.0 + 2 * tie, -1.0, 3.0, float("inf"), float("nan"), 1.0, -0.0]]).bfloat16()
    delta = torch.tensor([[tie, tie, -tie, 1e-3, 1.0, 1.0, float("-inf"), 0.0]]).bfloat16()
    want = x + delta
    torch.ops.conveyor.add_rms_norm_(x, delta, torch.ones(8).bfloat16(), 1e-5, False)
    assert torch.equal(x.isnan(), want.isnan())
    assert torch.equal(x[~x.isnan()], want[~want.isnan()])


def test_add_rms_norm_refuses_a_mismatched_delta(built) -> None:
    with pytest.raises(RuntimeError, match="delta shaped as x"):
        torch.ops.conveyor.add_rms_norm_(torch.randn(2, 8), torch.randn(2, 4), torch.randn(8), 1e-5, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_kv_rotates_in_place_and_writes_the_caches(built, dtype: torch.dtype) -> None:
    """The fused prologue equals the torch path: split, rotate q and k, index_copy_ k and v to their slots."""
    g = _generator(4)
    tokens, heads, kv_heads, head_dim = 3, 6, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(tokens, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([5, 0, 17])
    caches = [torch.zeros(3, 8, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    turned = apply_rotary(qk.reshape(tokens, heads + kv_heads, head_dim), cos, sin)
    caches[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, turned[:, heads:])
    caches[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.reshape(tokens, kv_heads, head_dim))
    fused = qkv.clone()
    torch.ops.conveyor.rotary_kv_(fused, heads, kv_heads, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(fused.view(tokens, -1, head_dim)[:, :heads], turned[:, :heads])
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    with pytest.raises(RuntimeError, match="a slot beyond the caches"):
        torch.ops.conveyor.rotary_kv_(fused, heads, kv_heads, cos, sin, caches[2], caches[3], torch.tensor([0, 1, 24]))


GREEDY_OPS = ["greedy", "greedy_avx2", "greedy_portable"]  # the widest loops, AVX2's, the portable ones


def _greedy_reference(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    ids = logprobs.argmax(dim=-1)
    return ids, logprobs.gather(1, ids.view(-1, 1)).view(-1)


def _assert_greedy(op: str, scores: torch.Tensor) -> None:
    ids, logprobs = getattr(torch.ops.conveyor, op)(scores)
    want_ids, want_logprobs = _greedy_reference(scores)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-6, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("op", GREEDY_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [49152, 1003, 5], ids=lambda v: f"vocab{v}")  # whole vectors, a tail, a tail alone
def test_greedy_equals_log_softmax_then_argmax(built, op: str, dtype: torch.dtype, vocab: int) -> None:
    g = _generator(vocab)
    _assert_greedy(op, (torch.randn(9, vocab, generator=g) * 4).to(dtype))
    _assert_greedy(op, (torch.randn(1, vocab, generator=g) * 4).to(dtype))


@pytest.mark.parametrize("op", GREEDY_OPS)
def test_greedy_takes_the_first_of_equal_bests_wherever_they_lie(built, op: str) -> None:
    """torch's argmax picks the first maximum: in the same vector, in a later vector, or in the tail."""
    g = _generator(3)
    vocab = 1003  # 62 vectors of 16 (125 of 8) and a tail
    scores = torch.randn(5, vocab, generator=g)
    for row, places in enumerate([(2, 5, 9), (40, 999), (995, 1001), (1002,), (0, 1002)]):
        scores[row, list(places)] = 9.0
    _assert_greedy(op, scores)
    assert getattr(torch.ops.conveyor, op)(scores)[0].tolist() == [2, 40, 995, 1002, 0]


@pytest.mark.parametrize("op", GREEDY_OPS)
def test_greedy_reads_masked_rows(built, op: str) -> None:
    """A grammar leaves a few tokens of -inf rows; a row masked entirely answers token 0 and NaN, as torch does."""
    scores = torch.full((3, 1003), float("-inf"))
    scores[0, [5, 700]] = torch.tensor([1.0, 2.0])
    scores[1, 1001] = -3.0  # the only token left, in the tail
    _assert_greedy(op, scores)
    ids, logprobs = getattr(torch.ops.conveyor, op)(scores)
    assert ids.tolist() == [700, 1001, 0]
    assert logprobs[1].item() == 0.0 and logprobs[2].isnan()


def test_greedy_refuses_what_it_cannot_read(built) -> None:
    with pytest.raises(RuntimeError, match="batch, vocab"):
        torch.ops.conveyor.greedy(torch.randn(4))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.conveyor.greedy(torch.randn(8, 6)[:, :3])


def test_the_sampler_greedy_path_is_the_kernel_where_it_serves_or_the_reference(built, monkeypatch) -> None:
    scores = torch.randn(4, 300, generator=_generator(5)).to(torch.bfloat16)
    want_ids, want_logprobs = _greedy_reference(scores)
    for backend in ("auto", "torch"):
        monkeypatch.setenv("CONVEYOR_ATTENTION", backend)
        ids, logprobs = greedy(scores)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-6, atol=1e-5)
