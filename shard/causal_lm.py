"""The padded engine: any transformers `AutoModelForCausalLM`, with TGI's left-padded `CausalLM` batch.

Each batch keeps one KV cache of shape [B, kv_heads, L, head_dim] per layer, left-padded to the longest row.
Joining batches pads the shorter ones on the left; filtering slices rows and trims padding columns that no
row needs any more. It is the fallback for architectures the paged engine does not implement, and the
reference the paged engine is compared with.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from conveyor.shard.requests import RequestState, prefill_tokens_pb
from conveyor.shard.sampling import Sampler
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, kv_heads, L, head_dim]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        index = {r.id: i for i, r in enumerate(self.requests)}
        missing = [i for i in request_ids if i not in index]
        if missing:
            raise KeyError(f"batch {self.id} has no requests {missing}")
        rows = [index[i] for i in request_ids]
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


class CausalLM:
    """Loads a model directory with transformers and runs padded batches through it."""

    engine = "padded"

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.dtype_name = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        self.config = self.model.config
        self.eos_token_ids = _eos_token_ids(model_dir, self.config, self.tokenizer, GenerationConfig)
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.vocab_size = self.config.vocab_size

    def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(
            requires_padding=True,
            dtype=self.dtype_name,
            device_type=self.device.type,
            block_size=0,
            support_chunking=False,
            use_prefix_caching=False,
            engine=self.engine,
            model_type=self.config.model_type,
            max_position_embeddings=getattr(self.config, "max_position_embeddings", 0) or 0,
            world_size=1,
        )

    @torch.inference_mode()
    def prefill(self, batch_pb: pb.Batch) -> tuple[list[pb.Generation], CausalLMBatch | None, pb.Timings]:
        """Builds a left-padded batch from new requests, runs the prompt forward, samples the first tokens."""
        start = time.perf_counter_ns()
        states = [
            RequestState.from_pb(r, self.tokenizer, self.eos_token_ids, self.vocab_size) for r in batch_pb.requests
        ]
        length = max(len(s.input_ids) for s in states)
        input_ids = torch.full((len(states), length), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(states), length), dtype=torch.long)
        for row, state in enumerate(states):
            input_ids[row, length - len(state.input_ids) :] = torch.tensor(state.input_ids)
            mask[row, length - len(state.input_ids) :] = 1
        sampler = Sampler.build(
            [s.params for s in states], [s.input_ids for s in states], self.vocab_size, self.device
        )
        logits, kv = self._forward(input_ids, mask, kv=None, all_logits=any(s.prefill_logprobs for s in states))
        forward_done = time.perf_counter_ns()
        batch = CausalLMBatch(batch_pb.id, states, input_ids[:, -1:], mask, kv, sampler)
        generations = self._sample(batch, logits[:, -1])
        for row, (generation, state) in enumerate(zip(generations, states)):
            if state.prefill_logprobs:
                generation.prefill_tokens.CopyFrom(self._prefill_tokens(state, logits[row]))
        return generations, _alive(batch, generations), _timings(start, forward_done)

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
        timings = _timings(start, forward_done)
        timings.concat_ns = concat_done - start
        return generations, _alive(batch, generations), timings

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
        next_ids, logprobs = batch.sampler(logits)
        batch.next_ids = next_ids.view(-1, 1).cpu()
        ids, lps = next_ids.tolist(), logprobs.tolist()
        return [
            state.step(token, lp, self.tokenizer, self.special_ids)
            for state, token, lp in zip(batch.requests, ids, lps)
        ]

    def _prefill_tokens(self, state: RequestState, logits: torch.Tensor) -> pb.Tokens:
        """Log-probabilities of each prompt token under the model, from the positions before it."""
        n = len(state.input_ids)
        row_logits = logits[-n:-1]  # the real positions of this row, last one excluded
        targets = torch.tensor(state.input_ids[1:], dtype=torch.long)
        logprobs = torch.log_softmax(row_logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
        return prefill_tokens_pb(state.input_ids, logprobs.tolist(), self.tokenizer)


def _alive(batch: CausalLMBatch, generations: list[pb.Generation]) -> CausalLMBatch | None:
    """The batch to cache, or None when every request finished at this step (the router frees nothing then)."""
    return None if all(g.HasField("finished") for g in generations) else batch


def _timings(start: int, forward_done: int) -> pb.Timings:
    end = time.perf_counter_ns()
    return pb.Timings(forward_ns=forward_done - start, decode_ns=end - forward_done, total_ns=end - start)


def _eos_token_ids(model_dir, config, tokenizer, generation_config_cls) -> frozenset[int]:
    """EOS ids as `generate()` sees them: generation_config first (it may list several), then config, tokenizer."""
    ids: set[int] = set()
    try:
        found = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:
        found = None
    for source in (found, getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
            break
    return frozenset(ids)
