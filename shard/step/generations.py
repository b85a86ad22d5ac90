"""Turning a step's sampled tokens into the `Generation` records the router streams: text, log-probabilities,
the most likely alternatives and, when asked, the prompt's own log-probabilities."""

from __future__ import annotations

import math

import torch

from conveyor.shard.batch.request_state import RequestState
from conveyor.shard.sampling.sampler import Sample
from conveyor.v1 import shard_pb2 as pb


class Generations:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def record(self, states: list[RequestState], sample: Sample) -> list[pb.Generation]:
        """Records one sampled token per request in its state (which may stop it) and returns what to stream."""
        generations = [
            state.step(token, lp, self.tokenizer, self.special_ids)
            for state, token, lp in zip(states, sample.ids.tolist(), sample.logprobs.tolist())
        ]
        if any(s.top_n_tokens for s in states):
            for generation, top in zip(generations, self._top_tokens(states, sample.distribution)):
                if top is not None:
                    generation.top_tokens.append(top)
        return generations

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
            texts = [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
            tops.append(
                pb.Tokens(
                    ids=ids, logprobs=row_values[:n], texts=texts, is_special=[i in self.special_ids for i in ids]
                )
            )
        return tops

    def prefill_tokens(self, state: RequestState, prompt_logits: torch.Tensor) -> pb.Tokens:
        """Log-probabilities of each prompt token, from the logits [len(prompt), V] of every prompt position."""
        targets = torch.tensor(state.input_ids[1:], dtype=torch.long, device=prompt_logits.device)
        logprobs = torch.log_softmax(prompt_logits[:-1].float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        ids = state.input_ids
        return pb.Tokens(
            ids=ids,
            logprobs=[math.nan, *logprobs.tolist()],  # the first prompt token has none
            texts=[self.tokenizer.decode([i], skip_special_tokens=False) for i in ids],
            is_special=[i in self.special_ids for i in ids],
        )
