"""What both engines share: the tokenizer and EOS ids a model directory declares, and turning a step's sampled
tokens into the `Generation` records the router streams."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from conveyor.shard.requests import RequestState, prefill_tokens_pb
from conveyor.shard.sampling import Sampler
from conveyor.v1 import shard_pb2 as pb

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    engine = "base"

    def __init__(self, model_dir: str | Path, dtype: str, device: torch.device, world_size: int = 1) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_dir = Path(model_dir)
        self.device = device
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.world_size = world_size
        self.config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, self.config, self.tokenizer, GenerationConfig)
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.vocab_size = self.config.vocab_size

    def info(self, **engine_fields) -> pb.InfoResponse:
        return pb.InfoResponse(
            dtype=self.dtype_name,
            device_type=self.device.type,
            engine=self.engine,
            model_type=self.config.model_type,
            max_position_embeddings=getattr(self.config, "max_position_embeddings", 0) or 0,
            world_size=self.world_size,
            **engine_fields,
        )

    def states(self, batch: pb.Batch) -> list[RequestState]:
        return [RequestState.from_pb(r, self.tokenizer, self.eos_token_ids, self.vocab_size) for r in batch.requests]

    def sampler(self, states: list[RequestState]) -> Sampler:
        return Sampler.build([s.params for s in states], [s.input_ids for s in states], self.vocab_size, self.device,
                             [s.generated_ids for s in states])  # fmt: skip

    def generations(
        self, states: list[RequestState], sampler: Sampler, logits: torch.Tensor
    ) -> tuple[list[pb.Generation], list[int]]:
        """Samples one token per row of `logits` [B, V] and records it in each request's state."""
        sample = sampler(logits)
        ids = sample.ids.tolist()
        generations = [
            state.step(token, lp, self.tokenizer, self.special_ids)
            for state, token, lp in zip(states, ids, sample.logprobs.tolist())
        ]
        if any(s.top_n_tokens for s in states):
            for generation, top in zip(generations, self._top_tokens(states, sample.distribution)):
                if top is not None:
                    generation.top_tokens.append(top)
        return generations, ids

    def _top_tokens(self, states: list[RequestState], distribution: torch.Tensor) -> list[pb.Tokens | None]:
        """Each request's `top_n_tokens` most likely tokens at this step, from the distribution it drew from."""
        values, indices = distribution.topk(max(s.top_n_tokens for s in states), dim=-1)
        tops: list[pb.Tokens | None] = []
        for state, row_values, row_ids in zip(states, values.tolist(), indices.tolist()):
            n = state.top_n_tokens
            if not n:
                tops.append(None)
                continue
            ids = row_ids[:n]
            tops.append(pb.Tokens(
                ids=ids,
                logprobs=row_values[:n],
                texts=[self.tokenizer.decode([i], skip_special_tokens=False) for i in ids],
                is_special=[i in self.special_ids for i in ids],
            ))  # fmt: skip
        return tops

    def prefill_tokens(self, state: RequestState, prompt_logits: torch.Tensor) -> pb.Tokens:
        """Log-probabilities of each prompt token, from the logits [len(prompt), V] of every prompt position."""
        targets = torch.tensor(state.input_ids[1:], dtype=torch.long, device=prompt_logits.device)
        logprobs = torch.log_softmax(prompt_logits[:-1].float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        return prefill_tokens_pb(state.input_ids, logprobs.tolist(), self.tokenizer)


def all_finished(generations: list[pb.Generation]) -> bool:
    """Every request ended at this step: nothing to cache, nothing for the router to filter."""
    return all(g.HasField("finished") for g in generations)


def timings(start: int, forward_done: int) -> pb.Timings:
    end = time.perf_counter_ns()
    return pb.Timings(forward_ns=forward_done - start, decode_ns=end - forward_done, total_ns=end - start)


def _eos_token_ids(model_dir, config, tokenizer, generation_config_cls) -> frozenset[int]:
    """EOS ids as `generate()` sees them: generation_config first (it may list several), then config, tokenizer."""
    try:
        found = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:
        found = None
    for source in (found, getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            return frozenset(source if isinstance(source, (list, tuple)) else [source])
    return frozenset()
