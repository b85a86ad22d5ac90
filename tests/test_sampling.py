"""Per-request sampling in a batch: each warper's definition, penalties, and seeds independent of batch mates."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.shard.sampling import Sampler, SamplingParams

CPU = torch.device("cpu")
VOCAB = 16


def sampler(*params: SamplingParams, prompts: list[list[int]] | None = None) -> Sampler:
    return Sampler.build(list(params), prompts or [[0]] * len(params), VOCAB, CPU)


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, VOCAB), generator=g) * 3


def draws(s: Sampler, scores: torch.Tensor, steps: int) -> list[list[int]]:
    """Per row, the ids drawn over `steps` steps from the same logits."""
    out = [s(scores)[0].tolist() for _ in range(steps)]
    return [list(col) for col in zip(*out)]


def test_greedy_rows_take_the_argmax_with_its_logprob() -> None:
    scores = logits(3)
    ids, logprobs, distribution = sampler(SamplingParams(), SamplingParams(), SamplingParams())(scores)
    assert torch.allclose(distribution, torch.log_softmax(scores, -1))
    assert ids.tolist() == scores.argmax(-1).tolist()
    expected = torch.log_softmax(scores, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)


def test_greedy_rows_ignore_warpers_even_beside_sampling_rows() -> None:
    # Typical-p would drop this argmax (it is far more likely than the entropy says is typical).
    probs = torch.tensor([[0.6] + [0.4 / (VOCAB - 1)] * (VOCAB - 1)] * 2)
    s = sampler(SamplingParams(typical_p=0.2, top_k=3, temperature=0.1), SamplingParams(do_sample=True, seed=1))
    assert int(s(probs.log())[0][0]) == 0


def test_top_k_one_is_the_argmax() -> None:
    scores = logits(1)
    drawn = draws(sampler(SamplingParams(do_sample=True, top_k=1, seed=3)), scores, 30)[0]
    assert set(drawn) == {int(scores.argmax())}


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_draws_only_the_k_best(k: int) -> None:
    scores = logits(1, seed=1)
    best = set(scores[0].topk(k).indices.tolist())
    drawn = draws(sampler(SamplingParams(do_sample=True, top_k=k, seed=5)), scores, 300)[0]
    assert set(drawn) <= best and len(set(drawn)) > 1


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    drawn = draws(sampler(SamplingParams(do_sample=True, top_p=0.75, seed=7)), scores, 300)[0]
    assert set(drawn) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_tiny_top_p_is_the_argmax() -> None:
    scores = logits(1, seed=2)
    drawn = draws(sampler(SamplingParams(do_sample=True, top_p=1e-6, seed=1)), scores, 30)[0]
    assert set(drawn) == {int(scores.argmax())}


def test_typical_p_drops_atypical_tokens() -> None:
    # Entropy is about 2.2 nats: the 0.07 tokens (surprise 2.66) are typical, the 0.3 token (1.20) is not,
    # and the near-impossible ones (surprise ~20) are not either.
    probs = torch.tensor([[0.3] + [0.07] * 10 + [1e-9] * (VOCAB - 11)])
    drawn = draws(sampler(SamplingParams(do_sample=True, typical_p=0.3, seed=11)), probs.log(), 200)[0]
    assert set(drawn) <= set(range(1, 11)) and len(set(drawn)) > 3


def test_low_temperature_is_not_nan_and_sharpens() -> None:
    scores = logits(1, seed=4)
    ids, logprobs, _ = sampler(SamplingParams(do_sample=True, temperature=1e-4, seed=1))(scores)
    assert int(ids) == int(scores.argmax()) and math.isfinite(float(logprobs))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 1], scores[0, 2], scores[0, 3] = 4.0, -1.0, 3.0
    s = sampler(SamplingParams(repetition_penalty=2.0), prompts=[[1, 2]])
    penalised = s._penalise(scores)
    assert penalised[0, 1] == 2.0 and penalised[0, 2] == -2.0 and penalised[0, 3] == 3.0
    assert int(s(scores)[0]) == 3  # the seen token 1 lost its lead


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    scores = torch.zeros((1, VOCAB))
    scores[0, 5] = 10.0
    s = sampler(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), prompts=[[5, 5, 5]])
    assert int(s(scores)[0]) == 5  # the prompt's 5s are not penalised
    for _ in range(3):
        s(scores)
    penalised = s._penalise(scores)
    assert penalised[0, 5] == pytest.approx(10.0 - 4 * 1.0 - 0.5)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(do_sample=True, temperature=0.9, top_k=8, seed=seed)


def test_a_seeded_row_draws_the_same_alone_and_among_others() -> None:
    scores = logits(1, seed=9)
    alone = draws(sampler(seeded(42)), scores, 20)[0]
    batch = sampler(seeded(1), SamplingParams(), seeded(42), SamplingParams(repetition_penalty=1.3), seeded(2))
    batch_scores = torch.cat([logits(1, seed=10), logits(1, seed=11), scores, logits(1, seed=12), scores])
    crowded = draws(batch, batch_scores, 20)
    assert crowded[2] == alone
    assert crowded[4] != alone  # same logits, another seed: another stream


def test_filter_and_concatenate_keep_each_rows_random_stream() -> None:
    scores = logits(1, seed=9)
    alone = draws(sampler(seeded(42)), scores, 20)[0]

    s = sampler(seeded(7), seeded(42))
    first = draws(s, torch.cat([logits(1, seed=3), scores]), 8)[1]
    s = s.filter([1])  # the other request finished
    second = draws(s, scores, 6)[0]
    s = Sampler.concatenate([sampler(seeded(5), SamplingParams(repetition_penalty=1.2)), s])  # others joined
    third = draws(s, torch.cat([logits(1, seed=4), logits(1, seed=5), scores]), 6)[2]
    assert first + second + third == alone


def test_concatenate_mixes_batches_with_and_without_penalties() -> None:
    plain = sampler(SamplingParams())
    penalised = sampler(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompts=[[1]])
    joined = Sampler.concatenate([plain, penalised])
    assert joined.seen is not None and joined.seen.shape == (2, VOCAB)
    assert joined.seen[0].sum() == 0 and joined.seen[1, 1] == 1
    scores = logits(2)
    ids = joined(scores).ids
    assert int(ids[0]) == int(scores[0].argmax())  # the plain row is untouched by the others' penalties
