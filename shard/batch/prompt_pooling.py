"""A prompt-only request's pooling while its prompt is read (embeddings, rerank): which final hidden states each
chunk keeps, and what they add up to so far. The step turns the total into the vector (shard/step/pooling.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.pooling import POOLING_MODES
from conveyor.v1 import shard_pb2 as pb


class PoolingError(ValueError):
    """A pooling this shard does not serve (an unknown mode)."""


@dataclass
class PromptPooling:
    """`mode` is a pooling mode (conveyor/pooling.py) or "score", the reranker's, which keeps no states: it reads
    the logits of the prompt's last position."""

    mode: str
    normalize: bool = False
    yes_token_id: int = 0
    no_token_id: int = 0
    total: torch.Tensor | None = None  # mean: the sum of the states kept so far; last and cls: the one state kept

    @classmethod
    def from_pb(cls, pooling: pb.Pooling) -> PromptPooling:
        if pooling.WhichOneof("output") == "score":
            return cls("score", yes_token_id=pooling.score.yes_token_id, no_token_id=pooling.score.no_token_id)
        embed = pooling.embed
        if embed.mode not in POOLING_MODES:
            raise PoolingError(f"pooling mode {embed.mode!r} is not one of {', '.join(POOLING_MODES)}")
        return cls(embed.mode, normalize=embed.normalize)

    @property
    def scores(self) -> bool:
        return self.mode == "score"

    @property
    def every_position(self) -> bool:
        """Whether every position of the prompt must be computed at this request: no cached prefix (the router's
        or the disk tier's) can stand in for the states of the positions it covers."""
        return self.mode in ("mean", "cls")

    def span(self, start: int, length: int, ends_prompt: bool) -> tuple[int, int]:
        """(first, count): which positions of a chunk of `length` tokens, from prompt position `start`, the step
        keeps the final states of."""
        if self.mode == "mean":
            return 0, length
        if self.mode == "cls":
            return (0, 1) if start == 0 else (0, 0)
        if self.mode == "last" and ends_prompt:
            return length - 1, 1
        return 0, 0

    def take(self, states: torch.Tensor) -> None:
        """The states [count, H] the step kept of this chunk (its `span`), in float32."""
        if not len(states):
            return
        if self.mode == "mean":
            chunk = states.sum(dim=0)
            self.total = chunk if self.total is None else self.total + chunk
        else:
            self.total = states[-1]
