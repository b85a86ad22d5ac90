"""A prompt's hidden states made into its embedding, and a reranker's yes/no logits made into its score.

Embedding and rerank requests are prompt-only: the prefill's last-layer states (or its last logits) are all they
need, so the engine hands each such row's slice here instead of sampling a token.
"""

from __future__ import annotations

import torch

from conveyor.pooling import PoolingSpec
from conveyor.shard.batch.prompt_pooling import PoolingError, PromptPooling


def pool(hidden: torch.Tensor, spec: PoolingSpec) -> torch.Tensor:
    """One prompt's vector from its final-norm hidden states [T, H], in float32 as sentence-transformers gives it.

    `last` takes the final position (the only one that has seen the whole prompt in a causal model), `mean`
    averages all, `cls` takes the first; normalization is the checkpoint's Normalize module (L2, as torch's
    `normalize` computes it, so a zero vector stays zero rather than becoming NaN).
    """
    states = hidden.float()
    if spec.mode == "last":
        vector = states[-1]
    elif spec.mode == "mean":
        vector = states.mean(dim=0)
    elif spec.mode == "cls":
        vector = states[0]
    else:
        raise ValueError(f"unknown pooling mode {spec.mode!r}")
    return _normalized(vector) if spec.normalize else vector


def _normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, p=2.0, dim=0)


def pooled(pooling: PromptPooling, prompt_len: int) -> torch.Tensor:
    """A request's vector once its whole prompt was read chunk by chunk (`pool` of its states, from what each chunk
    kept): sentence-transformers' mean is the sum over the count, as here."""
    if pooling.total is None:
        raise PoolingError("no hidden states were kept for this prompt")
    vector = pooling.total / prompt_len if pooling.mode == "mean" else pooling.total
    return _normalized(vector) if pooling.normalize else vector


def pool_rows(hidden: torch.Tensor, lengths: list[int], spec: PoolingSpec) -> list[torch.Tensor]:
    """Each prompt's vector from a flat forward's states [sum(lengths), H], rows in order."""
    return [pool(rows, spec) for rows in torch.split(hidden, lengths)]


def yes_no_score(logits: torch.Tensor, yes_id: int, no_id: int, raw: bool = False) -> float:
    """Qwen3-Reranker's relevance: P("yes") of the softmax over just the "yes" and "no" logits at the last position.
    `raw` gives the logit difference instead (TEI's `raw_scores`), whose sigmoid is that probability."""
    pair = logits.float()[[no_id, yes_id]]
    if raw:
        return float(pair[1] - pair[0])
    return float(torch.softmax(pair, dim=0)[1])
