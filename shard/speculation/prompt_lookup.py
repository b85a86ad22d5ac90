"""Draft tokens for speculative decoding, proposed without a second model: prompt lookup (n-gram).

The last n tokens of a sequence are looked for earlier in it (prompt and generated text alike); the tokens that
followed their latest earlier occurrence are the draft. Text that quotes, edits or repeats what came before (code
edits, summaries, structured answers) is drafted well; free text rarely matches and costs nothing then. Longer
n-grams are tried first: a longer match predicts its continuation better. The draft is deterministic (a point
mass), which is what lets verification keep the target's distribution exactly (see `verification.verify`).
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 4
MIN_NGRAM = 2


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens, for the
    longest n in [min_ngram, max_ngram] that occurs earlier; [] when none does."""
    if k <= 0 or len(tokens) <= min_ngram:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        # Windows that start early enough to have a token after them (the suffix itself does not).
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        found = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if found.size:
            start = int(found[-1]) + n
            return seq[start : start + k].tolist()
    return []
