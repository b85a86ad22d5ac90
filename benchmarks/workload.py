"""The seeded synthetic workload: prompts of chosen token lengths, their output lengths, and when each is sent.

Everything here is a pure function of the seed (and of the tokenizer, when one is given), so that every system
in a comparison, and every request rate of one run, gets exactly the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Python-flavoured words: the demo models' tokenizers were trained on Python's sources, so most are one token.
WORDS = tuple(
    """def class return import self value data list dict for while if else elif print yield lambda
async await with open range len str int float None True False try except raise finally from as pass break
continue global assert del in is not and or result items key index count name path text line file args kwargs
node parent child left right start stop step size total first last next prev cache queue batch token""".split()
)

KINDS = ("fixed", "uniform", "normal", "exponential")


@dataclass(frozen=True)
class LengthSpec:
    """How one kind of length is drawn: fixed at `mean`, uniform over [low, high], normal(mean, std), or
    exponential with that mean (as Anyscale's continuous-batching benchmark drew output lengths): rounded, at
    least 1, and within [low, high] where those are set."""

    kind: str = "fixed"
    mean: int = 128
    std: float = 0.0
    low: int = 0
    high: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"length distribution must be one of {KINDS}, not {self.kind!r}")
        if self.kind == "uniform" and not 1 <= self.low <= self.high:
            raise ValueError(f"a uniform length range needs 1 <= low <= high (got {self.low}, {self.high})")
        if self.kind != "uniform" and self.mean < 1:
            raise ValueError(f"lengths must be at least 1 (got {self.mean})")

    def sample(self, rng: random.Random, count: int) -> list[int]:
        if self.kind == "uniform":
            return [rng.randint(self.low, self.high) for _ in range(count)]
        if self.kind == "normal":
            return [self._clip(rng.gauss(self.mean, self.std)) for _ in range(count)]
        if self.kind == "exponential":
            return [self._clip(rng.expovariate(1 / self.mean)) for _ in range(count)]
        return [self.mean] * count

    def _clip(self, value: float) -> int:
        return min(max(1, self.low, round(value)), self.high or 1 << 30)

    def describe(self) -> str:
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        if self.kind == "normal":
            return f"normal mean {self.mean} std {self.std:g}"
        if self.kind == "exponential":
            return f"exponential mean {self.mean} in [{max(1, self.low)}, {self.high or 'inf'}]"
        return f"fixed {self.mean}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mean": self.mean, "std": self.std, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    prompt_len: int  # tokens as the tokenizer counts them (special tokens included); words when there is none
    output_len: int  # what the request asks for (max_tokens / max_new_tokens)
    exact: bool  # prompt_len was counted by the tokenizer


def build_prompts(
    count: int, inputs: LengthSpec, outputs: LengthSpec, seed: int, tokenizer: Any = None, first_index: int = 0
) -> list[Prompt]:
    """`count` prompts; with a tokenizer each is fitted to its drawn token length, otherwise it has that many
    words. Lengths and words come from separate seeded streams, so a tokenizer changes the text, not the lengths."""
    lengths = random.Random(f"lengths-{seed}")
    input_lens, output_lens = inputs.sample(lengths, count), outputs.sample(lengths, count)
    words = random.Random(f"words-{seed}")
    prompts = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
        if tokenizer is None:
            text, n = " ".join(words.choice(WORDS) for _ in range(n_in)), n_in
        else:
            text, n = fit_tokens(tokenizer, words, n_in)
        prompts.append(Prompt(first_index + i, text, n, n_out, tokenizer is not None))
    return prompts


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens as a server counts a completion prompt: with the special tokens the tokenizer adds (BOS)."""
    return len(tokenizer(text).input_ids)


def fit_tokens(tokenizer: Any, rng: random.Random, target: int) -> tuple[str, int]:
    """Text of exactly `target` tokens where the tokenizer allows: the longest run of random words that fits,
    then one-token words appended one at a time. Returns the text and its real token count."""
    words = [rng.choice(WORDS) for _ in range(target)]
    while count_tokens(tokenizer, " ".join(words)) < target:
        words += [rng.choice(WORDS) for _ in range(target)]
    low, high = 1, len(words)  # the largest k whose first k words fit (at least one word, whatever it costs)
    while low < high:
        mid = (low + high + 1) // 2
        if count_tokens(tokenizer, " ".join(words[:mid])) <= target:
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    n = count_tokens(tokenizer, text)
    fillers = list(WORDS)
    while n < target:
        rng.shuffle(fillers)
        extended = next((f"{text} {w}" for w in fillers if count_tokens(tokenizer, f"{text} {w}") == n + 1), None)
        if extended is None:  # no single word adds exactly one token here: keep the closest length below
            break
        text, n = extended, n + 1
    return text, n


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent, as vLLM's benchmark schedules them: gaps drawn
    from a gamma distribution of shape `burstiness` (1 is a Poisson process; below 1 burstier) and mean 1/rate,
    the whole schedule then scaled to span exactly count/rate. An infinite rate sends everything at once."""
    if count == 0 or math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"a request rate must be positive (got {rate})")
    if math.isinf(burstiness):
        gaps = np.full(count, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    times = np.cumsum(gaps)
    return (times * (count / rate / times[-1])).tolist()


@dataclass
class Workload:
    """One named workload of a comparison: its prompts, the rates to offer them at, and its concurrency cap."""

    name: str
    prompts: list[Prompt]
    rates: list[float]
    max_concurrency: int | None
    seed: int
    short: set[int] = field(default_factory=set)  # long-prompt workload: indexes of the short streams
    speculate: int | None = None  # draft tokens per step each request asks Conveyor for (None: the server's)
