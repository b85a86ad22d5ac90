"""Per-request sampling inside a batch: each row has its own parameters, penalties and random stream.

Logits processing is vectorised over the batch with per-row parameter columns; a row whose warper is off gets
that warper's neutral value, so it comes out bit-for-bit unchanged. Only the final draw loops over rows, each
with its own seeded random stream: that is what makes a seeded request's tokens independent of its batch
mates, and lets it keep its random stream when its batch is filtered or merged with another. A row's k-th draw
is seeded from (seed, k), so a request recomputed after a preemption, which brings its k generated tokens,
draws exactly what it would have drawn had it never been preempted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.shard.kernels import library as kernels

if TYPE_CHECKING:
    from conveyor.v1.shard_pb2 import SamplingParameters

NEG_INF = float("-inf")
# Dividing by a smaller temperature would overflow float32 logits to inf, and inf - inf is NaN in softmax.
# At this floor the distribution is already a one-hot argmax for any realistic logit gap.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    typical_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0  # CTRL's: seen tokens' positive logits divided, negative ones multiplied
    frequency_penalty: float = 0.0  # OpenAI's: minus penalty * times generated
    presence_penalty: float = 0.0  # OpenAI's: minus penalty if generated at all

    @classmethod
    def from_pb(cls, pb: SamplingParameters) -> SamplingParams:
        """Proto3 cannot tell 0 from unset; for the multiplicative parameters 0 is meaningless, so it means off."""
        return cls(
            temperature=pb.temperature or 1.0,
            top_k=pb.top_k,
            top_p=pb.top_p or 1.0,
            typical_p=pb.typical_p or 1.0,
            min_p=pb.min_p,
            do_sample=pb.do_sample,
            seed=pb.seed,
            repetition_penalty=pb.repetition_penalty or 1.0,
            frequency_penalty=pb.frequency_penalty,
            presence_penalty=pb.presence_penalty,
        )

    @property
    def sampling(self) -> bool:
        """TGI's rule: asking to reshape the distribution only makes sense if we then draw from it."""
        return (
            self.do_sample
            or self.temperature != 1.0
            or self.top_k > 0
            or self.top_p < 1.0
            or self.typical_p < 1.0
            or self.min_p > 0.0
        )

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_generated_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class Sample(tuple):
    """Unpacks as `(ids, logprobs)`, and also carries the log-distribution the ids were drawn from, because
    the engine reports each request's top-n alternatives from exactly that distribution. A greedy batch never
    computes it unless asked (`greedy` finds each row's token and log-probability without it)."""

    def __new__(cls, ids: torch.Tensor, logprobs: torch.Tensor, scores: torch.Tensor, normalized: bool) -> Sample:
        """`scores` [B, V]: the log-distribution itself when `normalized`, else the scores it normalizes."""
        sample = super().__new__(cls, (ids, logprobs))
        sample._scores, sample._normalized = scores, normalized
        return sample

    @property
    def ids(self) -> torch.Tensor:
        """[B] the chosen tokens."""
        return self[0]

    @property
    def logprobs(self) -> torch.Tensor:
        """[B] their log-probabilities under the distribution they were drawn from."""
        return self[1]

    @property
    def distribution(self) -> torch.Tensor:
        """[B, V] log-probabilities after penalties and (sampling rows) warpers."""
        if not self._normalized:
            self._scores, self._normalized = torch.log_softmax(self._scores.float(), dim=-1), True
        return self._scores


def greedy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best token (the first of equals, as argmax) and its log-probability under softmax(scores):
    [B] ids and [B] float32 logprobs. On CPU the kernel (shard/kernels/greedy.cpp) reads each row twice and
    writes nothing; elsewhere torch's log_softmax is the path, and the reference."""
    if kernels.serves(scores.device):
        return torch.ops.conveyor.greedy(scores.contiguous())
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    ids = logprobs.argmax(dim=-1)
    return ids, logprobs.gather(1, ids.view(-1, 1)).view(-1)


@dataclass
class RowStream:
    """One sampling row's random stream: draw k comes from a generator seeded with (seed, k)."""

    seed: int
    generator: torch.Generator
    draws: int = 0

    def next_generator(self) -> torch.Generator:
        # Tuples of ints hash the same in every process (no hash randomisation for ints).
        self.generator.manual_seed(hash((self.seed, self.draws)) & (2**63 - 1))
        self.draws += 1
        return self.generator


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)


class Sampler:
    """Holds, for each row of a batch, its parameters, its own random stream (`RowStream`) and the
    token counts penalties need."""

    def __init__(
        self,
        params: list[SamplingParams],
        generators: list[RowStream | None],
        seen: torch.Tensor | None,
        generated: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        self.params = params
        self.generators = generators  # None for greedy rows: they never draw
        # [B, V] token counts, allocated only when some row needs them: prompt + generated for the repetition
        # penalty, generated only for frequency/presence. Rows whose penalty is off keep zeros there.
        self.seen = seen
        self.generated = generated
        self.device = device
        self._set_columns()

    def _set_columns(self) -> None:
        """Per-row parameter columns, built once per batch shape rather than on every step."""
        p, d = self.params, self.device
        self.repetition = _column([x.repetition_penalty for x in p], d)
        self.frequency = _column([x.frequency_penalty for x in p], d)
        self.presence = _column([x.presence_penalty for x in p], d)
        self.temperature = _column([max(x.temperature, MIN_TEMPERATURE) for x in p], d)
        self.top_k = torch.tensor([max(x.top_k, 0) for x in p], dtype=torch.long, device=d)
        self.top_p = _column([x.top_p for x in p], d)
        self.typical_p = _column([x.typical_p for x in p], d)
        self.min_p = _column([x.min_p for x in p], d)
        self.sampling_rows = [i for i, x in enumerate(p) if x.sampling]
        self.any_temperature = any(x.temperature != 1.0 for x in p)
        self.any_top_k = any(x.top_k > 0 for x in p)
        self.any_top_p = any(x.top_p < 1.0 for x in p)
        self.any_typical_p = any(x.typical_p < 1.0 for x in p)
        self.any_min_p = any(x.min_p > 0.0 for x in p)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompts: list[list[int]],
        vocab_size: int,
        device: torch.device,
        generated_ids: list[list[int]] | None = None,
    ) -> Sampler:
        """`prompts` are every token each row has seen; `generated_ids` the part of them it generated itself (a
        request resumed after a preemption brings tokens it generated before)."""
        drawn = [len(ids) for ids in generated_ids] if generated_ids else [0] * len(params)
        generators = [_generator(x, device, n) for x, n in zip(params, drawn)]
        seen = None
        if any(x.uses_repetition_penalty for x in params):
            seen = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
            for row, prompt in enumerate(prompts):
                _count(seen[row], prompt)
        generated = None
        if any(x.uses_generated_penalty for x in params):
            counts = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
            for row, ids in enumerate(generated_ids or ()):
                _count(counts[row], ids)
            generated = counts
        return cls(list(params), generators, seen, generated, device)

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits: [B, V] (each row's last position). Returns the next ids [B] and their logprobs [B], and
        records the ids in the penalty counts. A batch with no sampling row takes `greedy`'s path (the warpers
        are all off then): logits in the model's dtype, no [B, V] log-distribution unless top-n asks for it."""
        penalised = self.seen is not None or self.generated is not None
        if not self.sampling_rows:
            scores = self._penalise(logits.float()) if penalised else logits
            next_ids, chosen = greedy(scores)
            self._record(next_ids)
            return Sample(next_ids, chosen, scores, normalized=False)
        scores = self._warp(self._penalise(logits.float()))
        logprobs = torch.log_softmax(scores, dim=-1)
        next_ids = self._choose(logprobs)
        self._record(next_ids)
        return Sample(next_ids, logprobs.gather(1, next_ids.view(-1, 1)).view(-1), logprobs, normalized=True)

    def _penalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Penalties apply to greedy rows too: they change which token is best, not how we choose."""
        if self.seen is not None:
            penalised = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
            scores = torch.where(self.seen > 0, penalised, scores)
        if self.generated is not None:
            scores = scores - self.frequency * self.generated - self.presence * (self.generated > 0).float()
        return scores

    def _warp(self, scores: torch.Tensor) -> torch.Tensor:
        """HF's warper order. Greedy rows have every warper off (else they would be sampling rows), so the
        neutral values leave them untouched; each warper is skipped when no row uses it."""
        if self.any_temperature:
            scores = scores / self.temperature
        if self.any_top_k:
            scores = _top_k(scores, self.top_k)
        if self.any_top_p:
            scores = _top_p(scores, self.top_p)
        if self.any_min_p:
            scores = _min_p(scores, self.min_p)
        if self.any_typical_p:
            scores = _typical_p(scores, self.typical_p)
        return scores

    def _choose(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Argmax for every row, then a draw from each sampling row's own generator, so that what one row
        draws never depends on how many numbers its batch mates consumed."""
        next_ids = logprobs.argmax(dim=-1)
        if self.sampling_rows:
            probs = logprobs.exp()
            for row in self.sampling_rows:
                next_ids[row] = torch.multinomial(probs[row], 1, generator=self.generators[row].next_generator())[0]
        return next_ids

    def _record(self, next_ids: torch.Tensor) -> None:
        rows = torch.arange(len(next_ids), device=self.device)
        if self.seen is not None:
            self.seen[rows, next_ids] += 1
        if self.generated is not None:
            self.generated[rows, next_ids] += 1

    def filter(self, indices: list[int]) -> Sampler:
        """Keeps these rows in this order; the generator objects move along, so no stream is restarted."""
        params = [self.params[i] for i in indices]
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        seen = self.seen if any(p.uses_repetition_penalty for p in params) else None
        generated = self.generated if any(p.uses_generated_penalty for p in params) else None
        return Sampler(
            params,
            [self.generators[i] for i in indices],
            None if seen is None else seen[index],
            None if generated is None else generated[index],
            self.device,
        )

    @classmethod
    def concatenate(cls, samplers: list[Sampler]) -> Sampler:
        sizes = [len(s.params) for s in samplers]
        return cls(
            [p for s in samplers for p in s.params],
            [g for s in samplers for g in s.generators],
            _cat_counts([s.seen for s in samplers], sizes),
            _cat_counts([s.generated for s in samplers], sizes),
            samplers[0].device,
        )


def _generator(params: SamplingParams, device: torch.device, drawn: int) -> RowStream | None:
    """`drawn`: draws the request made before (a request resumed after a preemption)."""
    if not params.sampling:
        return None
    return RowStream(params.seed, torch.Generator(device=device), drawn)


def _count(counts: torch.Tensor, ids: list[int]) -> None:
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=counts.device)
        counts.index_add_(0, index, torch.ones(len(ids), dtype=counts.dtype, device=counts.device))


def _cat_counts(counts: list[torch.Tensor | None], sizes: list[int]) -> torch.Tensor | None:
    """A sampler without a count tensor had no row using that penalty, and its rows' neutral penalty makes
    their counts irrelevant: zero rows stand in for them."""
    template = next((c for c in counts if c is not None), None)
    if template is None:
        return None
    return torch.cat(
        [c if c is not None else template.new_zeros((n, template.shape[1])) for c, n in zip(counts, sizes)]
    )


def _top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k best (ties with the k-th kept, as HF does); k = 0 keeps everything."""
    k = top_k.clamp(max=scores.shape[-1])
    best = scores.topk(int(k.max()), dim=-1).values
    kth = best.gather(1, (k.clamp(min=1) - 1).view(-1, 1))
    kth = torch.where(k.view(-1, 1) > 0, kth, torch.full_like(kth, NEG_INF))
    return scores.masked_fill(scores < kth, NEG_INF)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of best tokens whose probability reaches p, never fewer than the best one."""
    ascending, order = scores.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[:, -1] = False
    drop &= top_p < 1.0  # rows with the warper off stay bit-for-bit untouched
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keeps the tokens at least min_p times as likely as the best one: unlike a fixed top-k or top-p, the cut
    scales with the model's confidence, so a flat distribution keeps many tokens and a peaked one few. The best
    token is kept explicitly, as HF does, so even a min_p above 1 cannot leave a row with nothing to draw."""
    probs = scores.softmax(dim=-1)
    best, argmax = probs.max(dim=-1, keepdim=True)
    drop = probs < min_p * best
    drop.scatter_(1, argmax, False)
    drop &= min_p > 0.0  # rows with the warper off stay bit-for-bit untouched
    return scores.masked_fill(drop, NEG_INF)


def _typical_p(scores: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Keeps the tokens whose surprise is closest to the entropy, until their mass reaches p (HF's typical
    decoding); always at least one."""
    logp = torch.log_softmax(scores, dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)  # -inf * 0 is NaN for masked tokens
    distance = (-logp - entropy).abs()
    closest, order = distance.sort(dim=-1)
    cumulative = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical_p).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    drop = closest > closest.gather(1, last)
    drop &= typical_p < 1.0
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)
