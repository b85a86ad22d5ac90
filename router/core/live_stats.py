"""The last minute of output, for the dashboard: when tokens went out, times to first token and gaps between tokens.

Prometheus histograms (router/metrics.py) count since the start in fixed buckets, which a scraper turns into rates
and quantiles; the dashboard has no scraper behind it, so the router keeps this short window itself. Recording is
an append and a prune on each token; percentiles are computed only when `/dashboard/state` is read.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0  # how far back the percentiles look
RATE_WINDOW_S = 5.0  # how far back tokens/s looks: short, so that the figure follows the load
# At most this many latency samples each: a busy server's minute (thousands of tokens/s) stays cheap to sort.
MAX_SAMPLES = 20_000


class LiveStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # the clock `now` values come from (Infer's events use time.monotonic)
        self._tokens: deque[float] = deque()  # when each token of the last RATE_WINDOW_S went out
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, seconds)
        self._itl: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def first_token(self, now: float, ttft: float) -> None:
        """A stream's first token went out `ttft` seconds after its request arrived."""
        self._token(now)
        _keep(self._ttft, now, (now, ttft))

    def next_token(self, now: float, gap: float) -> None:
        """A later token went out `gap` seconds after the stream's previous one."""
        self._token(now)
        _keep(self._itl, now, (now, gap))

    def _token(self, now: float) -> None:
        self._tokens.append(now)
        while self._tokens and self._tokens[0] < now - RATE_WINDOW_S:
            self._tokens.popleft()

    def tokens_per_s(self) -> float:
        """Tokens sent per second, over the last RATE_WINDOW_S seconds (all streams together)."""
        since = self.clock() - RATE_WINDOW_S
        return sum(1 for t in self._tokens if t >= since) / RATE_WINDOW_S

    def ttft(self) -> dict[str, float | None]:
        return self._percentiles(self._ttft)

    def itl(self) -> dict[str, float | None]:
        return self._percentiles(self._itl)

    def _percentiles(self, samples: deque[tuple[float, float]]) -> dict[str, float | None]:
        """p50, p90 and p99 in seconds of the last minute's samples; None where there was none."""
        since = self.clock() - WINDOW_S
        values = sorted(value for when, value in samples if when >= since)
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def _keep(samples: deque[tuple[float, float]], now: float, sample: tuple[float, float]) -> None:
    samples.append(sample)
    while samples and samples[0][0] < now - WINDOW_S:
        samples.popleft()


def percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted values: a value that was observed, never an interpolation."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
