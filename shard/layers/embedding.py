"""Vocabulary-parallel embedding and LM head: each rank holds an equal slice of the vocabulary's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.layers.quantize import Int8Weight
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights


class VocabParallelEmbedding(torch.nn.Module):
    """Each rank looks up the ids in its slice and writes zeros for the others; an all-reduce fills the gaps."""

    def __init__(self, weight: torch.Tensor, group: ProcessGroup, quantize: str | None = None) -> None:
        super().__init__()
        self.dtype = weight.dtype
        # --quantize: the table as int8 rows with a scale each (int4 too: a lookup reads a handful of rows, and
        # int8 keeps them closer); a lookup widens only the rows it reads.
        self.int8 = Int8Weight.quantize(weight) if quantize in ("int8", "int4") else None
        self.weight = weight if self.int8 is None else None
        self.group = group
        self.start = group.rank * weight.shape[0]
        self.end = self.start + weight.shape[0]

    @classmethod
    def load(cls, weights: Weights, name: str) -> VocabParallelEmbedding:
        return cls(weights.get_sharded(name, dim=0), weights.group, weights.quantize)

    @property
    def nbytes(self) -> int:
        return self.int8.nbytes if self.int8 is not None else self.weight.nbytes

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.int8.values).float() * self.int8.scales[ids].unsqueeze(-1)
        return rows.to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self._lookup(ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local) * mine.unsqueeze(-1).to(self.dtype)
        return self.group.all_reduce(out)


# Under int4 the head stays 8-bit, as llama.cpp's q4_0 keeps its output tensor wider: every logit goes through it,
# and on SmolLM2-135M-Instruct an 8-bit head brought the mean KL from float32 well below a 4-bit one's, level with
# llama.cpp q4_0's on the same text and windows (`python -m benchmarks.accuracy --quantize int4`, the whole
# text; llama.cpp's `llama-perplexity --kl-divergence` for its own).
HEAD_QUANTIZE = {"int4": "int8"}


class ParallelLMHead(torch.nn.Module):
    """Column-parallel over the vocabulary: each rank scores its slice, an all-gather joins the logits."""

    def __init__(
        self, weight: torch.Tensor, group: ProcessGroup, plain_copy: bool = True, quantize: str | None = None
    ) -> None:
        super().__init__()
        self.gemm = Gemm(weight, plain_copy, HEAD_QUANTIZE.get(quantize, quantize))
        self.group = group

    @classmethod
    def load(cls, weights: Weights, name: str) -> ParallelLMHead:
        return cls(weights.get_sharded(name, dim=0), weights.group, weights.plain_copies, weights.quantize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.gemm(hidden), dim=-1)
