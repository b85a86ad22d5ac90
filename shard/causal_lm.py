"""The padded engine: any transformers `AutoModelForCausalLM`, with TGI's left-padded `CausalLM` batch.

Each batch keeps one KV cache of shape [B, kv_heads, L, head_dim] per layer, left-padded to the longest row.
Joining batches pads the shorter ones on the left; filtering slices rows and trims padding columns that no
row needs any more. It is the fallback for architectures the paged engine does not implement, and the
reference the paged engine is compared with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from conveyor.shard.engine import Engine, all_finished, timings
from conveyor.shard.requests import RequestState, rows_of
from conveyor.shard.sampling import Sampler
from conveyor.v1 import shard_pb2 as pb

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, kv_heads, L, head_dim]


@dataclass
class CausalLMBatch:
    """The state of one cached batch between steps.

    `attention_mask` covers exactly the tokens whose KV is cached; `next_ids` are the tokens the next forward
    feeds (one per row), whose KV is not cached yet.
    """

    id: int
    requests: list[RequestState]
    next_ids: torch.Tensor  # [B, 1]
    attention_mask: torch.Tensor  # [B, L]
    kv: KV
    sampler: Sampler

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def kv_len(self) -> int:
        return self.attention_mask.shape[1]

    @property
    def max_tokens(self) -> int:
        """Padded KV tokens this batch may grow to: every row is as long as the longest will get."""
        return self.size * (self.kv_len + max(r.remaining_tokens for r in self.requests))

    def to_pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(
            id=self.id,
            request_ids=[r.id for r in self.requests],
            size=self.size,
            max_tokens=self.max_tokens,
            current_tokens=self.size,
        )

    def filter(self, request_ids: list[int]) -> "CausalLMBatch":
        """Keeps the listed requests; drops the others' KV rows and padding columns no kept row needs."""
        rows = rows_of(self.requests, request_ids, self.id)
        rows_t = torch.tensor(rows, dtype=torch.long)
        mask = self.attention_mask[rows_t]
        first = _first_real_column(mask)
        return CausalLMBatch(
            id=self.id,
            requests=[self.requests[i] for i in rows],
            next_ids=self.next_ids[rows_t],
            attention_mask=mask[:, first:],
            kv=[(k[rows_t, :, first:], v[rows_t, :, first:]) for k, v in self.kv],
            sampler=self.sampler.filter(rows),
        )

    @classmethod
    def concatenate(cls, batches: list["CausalLMBatch"]) -> "CausalLMBatch":
        """Joins batches into the first one's id, left-padding shorter caches to the longest."""
        if len(batches) == 1:
            return batches[0]
        length = max(b.kv_len for b in batches)
        kv: KV = []
        for layer in range(len(batches[0].kv)):
            keys = [_left_pad(b.kv[layer][0], length) for b in batches]
            values = [_left_pad(b.kv[layer][1], length) for b in batches]
            kv.append((torch.cat(keys), torch.cat(values)))
        return cls(
            id=batches[0].id,
            requests=[r for b in batches for r in b.requests],
            next_ids=torch.cat([b.next_ids for b in batches]),
            attention_mask=torch.cat([_left_pad(b.attention_mask, length) for b in batches]),
            kv=kv,
            sampler=Sampler.concatenate([b.sampler for b in batches]),
        )


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zeros on the left of the sequence axis: the last of a [B, L] mask, the third of [B, H, L, D] KV."""
    mask = t.dim() == 2
    missing = length - t.shape[-1 if mask else -2]
    if missing == 0:
        return t
    return F.pad(t, [missing, 0] if mask else [0, 0, missing, 0])


def _first_real_column(mask: torch.Tensor) -> int:
    """The first column any row attends to; columns before it are padding for every row."""
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if len(used) else mask.shape[1]


class CausalLM(Engine):
    """Loads a model directory with transformers and runs padded batches through it."""

    engine = "padded"

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: torch.device | None = None) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(model_dir, dtype, device or torch.device("cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()

    def info(self) -> pb.InfoResponse:
        return super().info(requires_padding=True)

    def warmup(self, request: pb.WarmupRequest) -> int | None:
        """Runs the largest prefill and a decode step, so first requests do not pay for cold memory.
        The padded engine sizes no KV pool: the router keeps its own token budget."""
        _, batch, _ = self.prefill(request.batch)
        if batch is not None:
            self.decode([batch])
        return None

    @torch.inference_mode()
    def prefill(self, batch_pb: pb.Batch) -> tuple[list[pb.Generation], CausalLMBatch | None, pb.Timings]:
        """Builds a left-padded batch from new requests, runs the prompt forward, samples the first tokens."""
        start = time.perf_counter_ns()
        states = self.states(batch_pb)
        length = max(len(s.input_ids) for s in states)
        input_ids = torch.full((len(states), length), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(states), length), dtype=torch.long)
        for row, state in enumerate(states):
            input_ids[row, length - len(state.input_ids) :] = torch.tensor(state.input_ids)
            mask[row, length - len(state.input_ids) :] = 1
        logits, kv = self._forward(input_ids, mask, kv=None, all_logits=any(s.prefill_logprobs for s in states))
        forward_done = time.perf_counter_ns()
        batch = CausalLMBatch(batch_pb.id, states, input_ids[:, -1:], mask, kv, self.sampler(states))
        generations = self._sample(batch, logits[:, -1])
        for row, (generation, state) in enumerate(zip(generations, states)):
            if state.prefill_logprobs:
                prompt_logits = logits[row, length - len(state.input_ids) :]
                generation.prefill_tokens.CopyFrom(self.prefill_tokens(state, prompt_logits))
        return generations, None if all_finished(generations) else batch, timings(start, forward_done)

    @torch.inference_mode()
    def decode(self, batches: list[CausalLMBatch]) -> tuple[list[pb.Generation], CausalLMBatch | None, pb.Timings]:
        """Runs one step of the concatenation of `batches`, feeding each row the token it sampled last."""
        start = time.perf_counter_ns()
        batch = CausalLMBatch.concatenate(batches)
        concat_done = time.perf_counter_ns()
        mask = torch.cat([batch.attention_mask, torch.ones((batch.size, 1), dtype=torch.long)], dim=1)
        logits, kv = self._forward(batch.next_ids, mask, batch.kv, all_logits=False)
        forward_done = time.perf_counter_ns()
        batch.attention_mask, batch.kv = mask, kv
        generations = self._sample(batch, logits[:, -1])
        step_timings = timings(start, forward_done)
        step_timings.concat_ns = concat_done - start
        return generations, None if all_finished(generations) else batch, step_timings

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, kv: KV | None, all_logits: bool
    ) -> tuple[torch.Tensor, KV]:
        from transformers import DynamicCache

        new_len = input_ids.shape[1]
        # Positions count real tokens only, so a left-padded row sees the positions it would see alone.
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -new_len:]
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=DynamicCache(kv) if kv else DynamicCache(),
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        cache = out.past_key_values
        return out.logits.float(), [(layer.keys, layer.values) for layer in cache.layers]

    def _sample(self, batch: CausalLMBatch, logits: torch.Tensor) -> list[pb.Generation]:
        generations, ids = self.generations(batch.requests, batch.sampler, logits)
        batch.next_ids = torch.tensor(ids, dtype=torch.long).view(-1, 1)
        return generations
