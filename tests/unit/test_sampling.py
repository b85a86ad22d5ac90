"""Per-request sampling in a batch: each warper's definition, the penalties, and seeded streams that do not
depend on batch mates, filtering or merging."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from conveyor.shard.sampling.sampler import Sampler, SamplingParams
from conveyor.v1 import shard_pb2 as pb

CPU = torch.device("cpu")
VOCAB = 16


def sampler(*params: SamplingParams, prompts: list[list[int]] | None = None) -> Sampler:
    return Sampler.build(list(params), prompts or [[0]] * len(params), VOCAB, CPU)


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((rows, VOCAB), generator=generator) * 3


def from_probs(*probs: float) -> torch.Tensor:
    """One row of logits with these leading probabilities, the rest of the vocabulary (near) impossible."""
    return torch.log(torch.tensor([list(probs) + [1e-9] * (VOCAB - len(probs))]))


def draws(s: Sampler, scores: torch.Tensor, steps: int) -> list[list[int]]:
    """Per row, the ids drawn over `steps` steps from the same logits."""
    steps_ids = [s(scores)[0].tolist() for _ in range(steps)]
    return [list(row) for row in zip(*steps_ids)]


def sampled(params: SamplingParams, scores: torch.Tensor, steps: int = 300) -> set[int]:
    return set(draws(sampler(params), scores, steps)[0])


# Parameters


def test_from_pb_reads_proto_zeros_as_unset() -> None:
    params = SamplingParams.from_pb(pb.SamplingParameters(top_k=3, seed=9, frequency_penalty=0.5))
    assert params == SamplingParams(top_k=3, seed=9, frequency_penalty=0.5)
    # Values float32 holds exactly: the proto fields are floats.
    full = pb.SamplingParameters(
        temperature=0.5, top_p=0.75, typical_p=0.875, min_p=0.125, do_sample=True, repetition_penalty=1.25
    )
    assert SamplingParams.from_pb(full) == SamplingParams(
        temperature=0.5, top_p=0.75, typical_p=0.875, min_p=0.125, do_sample=True, repetition_penalty=1.25
    )
    # min_p's off value is 0, which proto3 sends as unset: nothing to map.
    assert SamplingParams.from_pb(pb.SamplingParameters(min_p=0.0)) == SamplingParams()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), False),
        (SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0), False),
        (SamplingParams(do_sample=True), True),
        (SamplingParams(temperature=0.7), True),
        (SamplingParams(top_k=5), True),
        (SamplingParams(top_p=0.9), True),
        (SamplingParams(typical_p=0.9), True),
        (SamplingParams(min_p=0.1), True),
        (SamplingParams(min_p=0.0), False),
    ],
)
def test_any_warper_means_sampling(params: SamplingParams, expected: bool) -> None:
    assert params.sampling is expected


# Greedy


def test_greedy_rows_take_the_argmax_with_its_logprob() -> None:
    scores = logits(3)
    sample = sampler(SamplingParams(), SamplingParams(), SamplingParams())(scores)
    ids, logprobs = sample
    assert ids.dtype == torch.long and ids.tolist() == scores.argmax(-1).tolist()
    expected = torch.log_softmax(scores, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)
    assert torch.allclose(sample.distribution, torch.log_softmax(scores, -1))


def test_greedy_rows_beside_sampling_rows_keep_their_argmax() -> None:
    scores = logits(2, seed=3)
    s = sampler(SamplingParams(), SamplingParams(do_sample=True, temperature=5.0, seed=1))
    assert set(draws(s, scores, 50)[0]) == {int(scores[0].argmax())}


# Warpers


def test_top_k_one_is_the_argmax() -> None:
    scores = logits(seed=1)
    assert sampled(SamplingParams(top_k=1, seed=3), scores, 30) == {int(scores.argmax())}


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_draws_only_the_k_best(k: int) -> None:
    scores = logits(seed=1) / 3  # flat enough that every kept token gets drawn
    assert sampled(SamplingParams(top_k=k, seed=5), scores) == set(scores[0].topk(k).indices.tolist())


def test_top_k_larger_than_the_vocabulary_keeps_everything() -> None:
    scores = torch.zeros((1, VOCAB))
    assert sampled(SamplingParams(top_k=VOCAB * 2, seed=2), scores, 400) == set(range(VOCAB))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert sampled(SamplingParams(top_p=0.75, seed=7), from_probs(0.5, 0.3, 0.15, 0.05)) == {0, 1}
    assert sampled(SamplingParams(top_p=0.85, seed=7), from_probs(0.5, 0.3, 0.15, 0.05)) == {0, 1, 2}


def test_tiny_top_p_is_the_argmax() -> None:
    scores = logits(seed=2)
    assert sampled(SamplingParams(top_p=1e-6, seed=1), scores, 30) == {int(scores.argmax())}


def test_typical_p_drops_atypical_tokens() -> None:
    # Entropy is about 2.2 nats: the 0.07 tokens (surprise 2.66) are typical; the 0.3 token (surprise 1.20)
    # and the near-impossible ones (surprise ~20) are not.
    drawn = sampled(SamplingParams(typical_p=0.3, seed=11), from_probs(0.3, *[0.07] * 10), 200)
    assert drawn <= set(range(1, 11)) and len(drawn) > 3


def test_typical_p_near_one_keeps_the_likely_tokens() -> None:
    assert sampled(SamplingParams(typical_p=0.999, seed=4), from_probs(0.4, 0.3, 0.3)) == {0, 1, 2}


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best() -> None:
    scores = from_probs(0.4, 0.25, 0.15, 0.12, 0.08)
    assert sampled(SamplingParams(min_p=0.5, seed=7), scores) == {0, 1}  # cut at 0.2
    assert sampled(SamplingParams(min_p=0.25, seed=7), scores) == {0, 1, 2, 3}  # cut at 0.1


def test_min_p_one_is_the_argmax() -> None:
    scores = logits(seed=1)
    assert sampled(SamplingParams(min_p=1.0, seed=3), scores, 30) == {int(scores.argmax())}


def test_min_p_above_one_still_keeps_the_best_token() -> None:
    scores = logits(seed=5)
    assert sampled(SamplingParams(min_p=1.5, seed=2), scores, 30) == {int(scores.argmax())}


def test_min_p_masks_its_row_only() -> None:
    scores = logits(2, seed=15) / 3  # flat enough that min_p keeps several tokens
    plain = SamplingParams(do_sample=True, seed=2)
    s = sampler(plain, SamplingParams(min_p=0.3, seed=1))
    first = s(scores)
    plain_rows, min_p_rows = draws(s, scores, 300)
    probs = scores[1].softmax(-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().view(-1).tolist())
    assert 1 < len(allowed) < VOCAB and set(min_p_rows) <= allowed
    # The row without min_p is bit-for-bit what it is alone: same distribution, same draws.
    alone_sampler = sampler(plain)
    assert torch.equal(first.distribution[0], alone_sampler(scores[:1]).distribution[0])
    assert plain_rows == draws(alone_sampler, scores[:1], 300)[0]
    assert len(set(plain_rows)) > len(allowed)


def test_min_p_keeps_what_transformers_min_p_warper_keeps() -> None:
    generator = torch.Generator().manual_seed(16)
    vocab = 1000
    scores = torch.randn((8, vocab), generator=generator) * 2
    # The proto carries min_p as a float32: give transformers the very same values.
    min_ps = [float(torch.tensor(m, dtype=torch.float32)) for m in (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 1.0)]
    s = Sampler.build([SamplingParams(min_p=m, seed=1) for m in min_ps], [[0]] * 8, vocab, CPU)
    kept = s(scores).distribution.isfinite()
    for row, m in enumerate(min_ps):
        assert torch.equal(kept[row], MinPLogitsWarper(m)(None, scores[row : row + 1]).isfinite()[0]), f"min_p={m}"
    counts = kept.sum(-1).tolist()
    assert counts[0] == vocab and all(1 < n < vocab for n in counts[1:6]), counts  # real cuts were compared


def test_min_p_sits_in_transformers_warper_order() -> None:
    """`generate()` applies temperature, top-k, top-p, min-p, then typical-p; typical-p's entropy depends on what
    min-p left, so the order shows."""
    generator = torch.Generator().manual_seed(17)
    vocab = 200
    scores = torch.randn((4, vocab), generator=generator) * 2
    temperature, top_k, top_p, min_p, typical_p = 0.75, 50, 0.875, 0.125, 0.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, seed=1)
    kept = Sampler.build([params] * 4, [[0]] * 4, vocab, CPU)(scores).distribution.isfinite()
    theirs = LogitsProcessorList(
        [
            TemperatureLogitsWarper(temperature),
            TopKLogitsWarper(top_k),
            TopPLogitsWarper(top_p),
            MinPLogitsWarper(min_p),
            TypicalLogitsWarper(typical_p),
        ]
    )(None, scores).isfinite()
    assert torch.equal(kept, theirs)


def test_temperature_reshapes_the_distribution_the_logprob_comes_from() -> None:
    scores = logits(seed=6)
    ids, logprobs = sampler(SamplingParams(temperature=2.0, seed=1))(scores)
    assert torch.allclose(logprobs, torch.log_softmax(scores / 2.0, -1)[0, ids])


@pytest.mark.parametrize("temperature", [1e-4, 1e-30, 0.0])
def test_tiny_temperature_is_the_argmax_and_never_nan(temperature: float) -> None:
    scores = logits(seed=4)
    s = sampler(SamplingParams(temperature=temperature, seed=1))
    for _ in range(10):
        sample = s(scores)
        assert int(sample.ids) == int(scores.argmax()) and math.isfinite(float(sample.logprobs))
        assert not sample.distribution.isnan().any()


def test_warpers_leaving_one_candidate_still_draw_it() -> None:
    scores = logits(seed=8)
    params = SamplingParams(top_k=1, top_p=0.01, typical_p=0.01, temperature=0.5, seed=3)
    ids, logprobs = sampler(params)(scores)
    assert int(ids) == int(scores.argmax()) and float(logprobs) == 0.0


def test_masked_tokens_are_never_drawn_in_a_mixed_batch() -> None:
    scores = logits(3, seed=12) / 3
    s = sampler(
        SamplingParams(top_k=3, seed=1), SamplingParams(top_p=0.5, seed=2), SamplingParams(do_sample=True, seed=3)
    )
    top_k_rows, top_p_rows, free_rows = draws(s, scores, 300)
    assert set(top_k_rows) == set(scores[0].topk(3).indices.tolist())
    order = scores[1].softmax(-1).sort(descending=True)
    nucleus = int((order.values.cumsum(0) < 0.5).sum()) + 1
    assert set(top_p_rows) == set(order.indices[:nucleus].tolist())
    assert len(set(free_rows)) > nucleus  # the unwarped row ranges wider


# Penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 1], scores[0, 2], scores[0, 3], scores[0, 4] = 4.0, -1.0, 3.0, -0.5
    s = sampler(SamplingParams(repetition_penalty=2.0), prompts=[[1, 2, 1]])
    sample = s(scores)
    expected = scores.clone()
    expected[0, 1], expected[0, 2] = 2.0, -2.0  # once seen is enough: the count does not compound it
    assert torch.allclose(sample.distribution, torch.log_softmax(expected, -1))
    assert int(sample.ids) == 3  # the seen token 1 lost its lead
    # The generated 3 now counts as seen too: 3 / 2 = 1.5 < 2.0.
    assert int(s(scores).ids) == 1


def test_repetition_penalty_applies_to_sampling_rows_before_the_warpers() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 1], scores[0, 2] = 4.0, 3.0
    s = sampler(SamplingParams(repetition_penalty=4.0, top_k=1, seed=1), prompts=[[1]])
    assert int(s(scores).ids) == 2


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 5] = 10.0
    s = sampler(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), prompts=[[5, 5, 5]])
    first = s(scores)
    assert int(first.ids) == 5 and torch.allclose(first.distribution, torch.log_softmax(scores, -1))
    for _ in range(3):
        s(scores)
    expected = scores.clone()
    expected[0, 5] = 10.0 - 4 * 1.0 - 0.5
    assert torch.allclose(s(scores).distribution, torch.log_softmax(expected, -1))


def test_frequency_penalty_grows_with_each_repeat() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 5], scores[0, 6] = 3.0, 1.5
    s = sampler(SamplingParams(frequency_penalty=1.0))
    assert [int(s(scores).ids) for _ in range(3)] == [5, 5, 6]  # 3 -> 2 -> 1 < 1.5


def test_presence_penalty_does_not_grow() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 5], scores[0, 6] = 3.0, 1.5
    s = sampler(SamplingParams(presence_penalty=1.0))
    assert [int(s(scores).ids) for _ in range(4)] == [5, 5, 5, 5]  # 3 - 1 = 2 > 1.5, every time


def test_penalties_stay_on_their_own_row() -> None:
    scores = logits(2, seed=13)
    s = sampler(SamplingParams(), SamplingParams(repetition_penalty=3.0, frequency_penalty=2.0), prompts=[[0], [1]])
    for _ in range(5):
        assert int(s(scores).ids[0]) == int(scores[0].argmax())
    assert s.seen is not None and s.seen[0].sum() == 6 and s.seen[1, 1] == 1


# Seeds, filter, concatenate


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(do_sample=True, temperature=0.9, top_k=8, seed=seed)


FIXED = logits(seed=9)


def alone(seed: int = 42, steps: int = 20) -> list[int]:
    return draws(sampler(seeded(seed)), FIXED, steps)[0]


def test_the_same_seed_draws_the_same_tokens() -> None:
    assert alone() == alone()
    assert alone() != alone(seed=43)
    assert len(set(alone())) > 1  # really sampling, not collapsed onto one token


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch_of_five() -> None:
    batch = sampler(
        SamplingParams(do_sample=True, top_p=0.8, seed=1),
        SamplingParams(),
        seeded(42),
        SamplingParams(repetition_penalty=1.3, typical_p=0.9, seed=5),
        SamplingParams(temperature=1.7, frequency_penalty=0.4, seed=2),
    )
    scores = torch.cat([logits(seed=10), logits(seed=11), FIXED, logits(seed=12), FIXED])
    rows = draws(batch, scores, 20)
    assert rows[2] == alone()
    assert rows[4] != alone()  # same logits, another seed: another stream


def test_filter_and_concatenate_midway_keep_the_rows_random_stream() -> None:
    s = sampler(seeded(7), seeded(42))
    first = draws(s, torch.cat([logits(seed=3), FIXED]), 8)[1]
    s = s.filter([1])  # its batch mate finished
    second = draws(s, FIXED, 6)[0]
    others = sampler(seeded(5), SamplingParams(repetition_penalty=1.2, presence_penalty=0.3))
    s = Sampler.concatenate([others, s])  # others joined in front
    third = draws(s, torch.cat([logits(seed=4), logits(seed=5), FIXED]), 6)[2]
    assert first + second + third == alone()


def test_filter_keeps_rows_in_the_order_asked() -> None:
    s = sampler(SamplingParams(seed=0, top_k=2), SamplingParams(), SamplingParams(repetition_penalty=2.0))
    kept = s.filter([2, 0])
    assert kept.params == [s.params[2], s.params[0]]
    assert kept.generators == [s.generators[2], s.generators[0]]
    assert kept.seen is not None and torch.equal(kept.seen, s.seen[[2, 0]])


def test_filter_drops_counts_no_remaining_row_needs() -> None:
    s = sampler(SamplingParams(), SamplingParams(repetition_penalty=2.0, presence_penalty=1.0))
    kept = s.filter([0])
    assert kept.seen is None and kept.generated is None
    scores = logits(seed=14)
    assert int(kept(scores).ids) == int(scores.argmax())


def test_penalty_counts_survive_filter_and_concatenate() -> None:
    s = sampler(SamplingParams(), SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompts=[[3], [1]])
    s(torch.nn.functional.one_hot(torch.tensor([0, 4]), VOCAB).float() * 5)
    joined = Sampler.concatenate([sampler(SamplingParams()), s.filter([1])])
    assert joined.seen is not None and joined.generated is not None
    assert joined.seen.shape == joined.generated.shape == (2, VOCAB)
    assert joined.seen[0].sum() == 0 and joined.generated[0].sum() == 0
    assert (
        joined.seen[1, 1] == 1 and joined.seen[1, 4] == 1 and joined.generated[1].tolist() == [0] * 4 + [1] + [0] * 11
    )


def test_concatenate_of_plain_samplers_allocates_no_counts() -> None:
    joined = Sampler.concatenate([sampler(SamplingParams()), sampler(seeded(1))])
    assert joined.seen is None and joined.generated is None and len(joined.params) == 2


def test_a_resumed_row_draws_what_it_would_have_drawn_without_a_preemption() -> None:
    """A request recomputed after a preemption brings its generated tokens; its next draws go on unchanged."""
    params = SamplingParams(do_sample=True, temperature=1.5, seed=21)
    steps = [logits(seed=30 + k) for k in range(8)]
    whole = sampler(params)
    uninterrupted = [int(whole(s).ids) for s in steps]
    resumed = Sampler.build([params], [[0]], VOCAB, torch.device("cpu"), generated_ids=[uninterrupted[:5]])
    assert [int(resumed(s).ids) for s in steps[5:]] == uninterrupted[5:]
