"""Per-request sampling inside a batch: each row has its own parameters, penalties and random stream.

The logits processing is vectorised over the batch with per-row parameter tensors. Only the final draw loops
over rows, each with its own seeded `torch.Generator`, so a seeded request draws the same numbers whatever
its batch mates are, and keeps its stream when its batch is filtered or joined with another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0  # CTRL's: seen tokens' logits are divided (positive) or multiplied (negative)
    frequency_penalty: float = 0.0  # OpenAI's: minus penalty * times generated
    presence_penalty: float = 0.0  # OpenAI's: minus penalty if generated at all

    @classmethod
    def from_pb(cls, pb) -> "SamplingParams":
        """Proto3 zeros mean unset for the multiplicative parameters."""
        return cls(
            temperature=pb.temperature or 1.0,
            top_k=pb.top_k,
            top_p=pb.top_p or 1.0,
            typical_p=pb.typical_p or 1.0,
            do_sample=pb.do_sample,
            seed=pb.seed,
            repetition_penalty=pb.repetition_penalty or 1.0,
            frequency_penalty=pb.frequency_penalty,
            presence_penalty=pb.presence_penalty,
        )

    @property
    def sampling(self) -> bool:
        """The router decides (TGI's rule, in validation); a row that does not sample ignores its warpers."""
        return self.do_sample


class Sample(NamedTuple):
    ids: torch.Tensor  # [B] the chosen tokens
    logprobs: torch.Tensor  # [B] their log-probabilities
    distribution: torch.Tensor  # [B, V] the log-probabilities they were drawn from (for top-n alternatives)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)


class Sampler:
    """Sampling state for the rows of one batch, in row order."""

    def __init__(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        seen: torch.Tensor | None,
        generated: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        self.params = params
        self.generators = generators
        # [B, V] counts: prompt + generated tokens (repetition penalty), generated only (frequency/presence).
        self.seen = seen
        self.generated = generated
        self.device = device
        self._tensors()

    def _tensors(self) -> None:
        p, d = self.params, self.device
        self.repetition = _column([x.repetition_penalty for x in p], d)
        self.frequency = _column([x.frequency_penalty for x in p], d)
        self.presence = _column([x.presence_penalty for x in p], d)
        # Warpers act on sampling rows only: a greedy row beside a sampling one keeps its argmax.
        self.temperature = _column([x.temperature if x.sampling else 1.0 for x in p], d)
        self.top_k = [x.top_k if x.sampling else 0 for x in p]
        self.top_p = _column([x.top_p if x.sampling else 1.0 for x in p], d)
        self.typical_p = _column([x.typical_p if x.sampling else 1.0 for x in p], d)
        self.sampling_rows = [i for i, x in enumerate(p) if x.sampling]

    @classmethod
    def build(
        cls, params: list[SamplingParams], prompts: list[list[int]], vocab_size: int, device: torch.device
    ) -> "Sampler":
        generators = [_generator(x, device) for x in params]
        seen = generated = None
        if any(x.repetition_penalty != 1.0 for x in params):
            seen = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
            for row, prompt in enumerate(prompts):
                ids = torch.tensor(prompt, dtype=torch.long, device=device)
                seen[row].index_add_(0, ids, torch.ones(len(prompt), device=device))
        if any(x.frequency_penalty or x.presence_penalty for x in params):
            generated = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
        return cls(params, generators, seen, generated, device)

    def __call__(self, logits: torch.Tensor) -> Sample:
        """From the last position's logits [B, V] to the next tokens and their log-probabilities."""
        scores = self._penalise(logits.float())
        if self.sampling_rows:
            scores = self._warp(scores)
        logprobs = torch.log_softmax(scores, dim=-1)
        next_ids = scores.argmax(dim=-1)
        if self.sampling_rows:
            probs = logprobs.exp()
            for row in self.sampling_rows:
                next_ids[row] = torch.multinomial(probs[row], 1, generator=self.generators[row])[0]
        self._record(next_ids)
        return Sample(next_ids, logprobs.gather(1, next_ids.view(-1, 1)).view(-1), logprobs)

    def _penalise(self, scores: torch.Tensor) -> torch.Tensor:
        if self.seen is not None:
            penalised = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
            scores = torch.where(self.seen > 0, penalised, scores)
        if self.generated is not None:
            scores = scores - self.frequency * self.generated - self.presence * (self.generated > 0).float()
        return scores

    def _warp(self, scores: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, typical-p, as HF applies them; rows with a warper off are unchanged."""
        scores = scores / self.temperature
        if any(self.top_k):
            scores = _top_k(scores, self.top_k)
        if (self.top_p < 1.0).any():
            scores = _top_p(scores, self.top_p)
        if (self.typical_p < 1.0).any():
            scores = _typical_p(scores, self.typical_p)
        return scores

    def _record(self, next_ids: torch.Tensor) -> None:
        rows = torch.arange(len(next_ids), device=self.device)
        if self.seen is not None:
            self.seen[rows, next_ids] += 1
        if self.generated is not None:
            self.generated[rows, next_ids] += 1

    def filter(self, rows: list[int]) -> "Sampler":
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return Sampler(
            [self.params[r] for r in rows],
            [self.generators[r] for r in rows],
            None if self.seen is None else self.seen[index],
            None if self.generated is None else self.generated[index],
            self.device,
        )

    @classmethod
    def concatenate(cls, samplers: list["Sampler"]) -> "Sampler":
        return cls(
            [p for s in samplers for p in s.params],
            [g for s in samplers for g in s.generators],
            _cat_counts([s.seen for s in samplers], [len(s.params) for s in samplers]),
            _cat_counts([s.generated for s in samplers], [len(s.params) for s in samplers]),
            samplers[0].device,
        )


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if not params.sampling:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def _cat_counts(counts: list[torch.Tensor | None], sizes: list[int]) -> torch.Tensor | None:
    """Joins count tensors; a batch that needed none contributes zero rows (its requests use no penalty)."""
    present = [c for c in counts if c is not None]
    if not present:
        return None
    template = present[0]
    return torch.cat(
        [c if c is not None else template.new_zeros((n, template.shape[1])) for c, n in zip(counts, sizes)]
    )


def _top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keeps each row's k best (ties at the k-th kept); k = 0 keeps everything."""
    vocab = scores.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=scores.device)
    sorted_scores = scores.sort(dim=-1, descending=True).values
    kth = sorted_scores.gather(1, (k - 1).view(-1, 1))
    return scores.masked_fill(scores < kth, NEG_INF)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of best tokens whose probability reaches p (always at least the best one)."""
    sorted_scores, order = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[:, -1] = False
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def _typical_p(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Keeps the tokens whose surprise is closest to the distribution's entropy, up to mass p."""
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    entropy = -(torch.nan_to_num(logp) * p).sum(dim=-1, keepdim=True)
    shifted = (-torch.nan_to_num(logp, neginf=-1e9) - entropy).abs()
    sorted_shift, order = shifted.sort(dim=-1)
    cumulative = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical_p).sum(dim=1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    drop_sorted = sorted_shift > sorted_shift.gather(1, last)
    drop = drop_sorted.scatter(1, order, drop_sorted) & (typical_p < 1.0)  # rows with p = 1 keep everything
    return scores.masked_fill(drop, NEG_INF)
