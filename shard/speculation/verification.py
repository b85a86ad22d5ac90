"""Speculative decoding on the shard: each decoding row's drafts for the step (from the draft model, or by prompt
lookup), and their verification once the step's forward has fed them: every position sampled as a plain step
would sample it, kept while it chose the draft fed after it (`verify`).

A verify step feeds a row its next token and k drafts. Run as one sequence of k+1 new tokens it would take the
prompt path (the prefill attention over a chunk, and the modules one by one), which on a CPU made a 5-row verify
step of SmolLM2 cost 1.6x a plain one in float32 and 2.8x in bf16. So the engine runs it as k+1 rows of one token
each over the same block table, with context lengths start+1 .. start+k+1 (`one_token_rows`): every new token's
K/V is written before any row attends, so row j sees exactly positions 0..start+j, which is causal attention, and
the step takes the decode kernel and the one-call decode stack, as k+1 streams' rows would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.shard.batch.request_state import RequestState
from conveyor.shard.sampling.sampler import Sampler
from conveyor.shard.speculation import draft_model, prompt_lookup
from conveyor.shard.speculation.draft_model import DraftModel
from conveyor.v1 import shard_pb2 as pb

Record = Callable[[list[RequestState], Sampler, torch.Tensor], list[pb.Generation]]


def propose(drafter: DraftModel | None, decoding: list[RequestState]) -> None:
    """This step's drafts: from the draft model when there is one, else by prompt lookup (a row's whole text
    is gathered only when it may draft: every decode step passes here)."""
    limits = [min(s.speculate, s.draft_room) for s in decoding]
    if drafter is not None and any(k > 0 for k in limits):
        for state, proposed in zip(decoding, drafter.propose(decoding, limits)):
            state.drafts = proposed
        return
    for state, limit in zip(decoding, limits):
        state.drafts = prompt_lookup.propose(state.token_ids, limit) if limit > 0 else []


def verify(
    decoding: list[RequestState], sampler: Sampler, logits: torch.Tensor, record: Record, block_size: int
) -> list[pb.Generation]:
    """Samples each decoding row at its first position and, while the token it chose is the draft fed at the
    next position, at that one too (speculative decoding's verification). Each position is sampled exactly as
    a step without drafts would sample it, with the row's next draw: a greedy row gets greedy's tokens, and a
    sampled one the target's own distribution (a draft is a point mass, so keeping the sample, and going on
    only when it equals the draft, is the rejection rule), with the same tokens for the same seed. KV written
    for rejected drafts is left behind: the row's length says where its next token goes. `record` samples rows of
    logits as the engine does (its grammar masks, its generations)."""
    counts = [1 + len(s.drafts) for s in decoding]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    generations = record(decoding, sampler, logits[starts] if len(logits) > len(decoding) else logits)
    alive = list(range(len(decoding)))  # rows whose every position so far chose the draft fed after it
    for j in range(1, max(counts)):
        alive = [
            i
            for i in alive
            if len(decoding[i].drafts) >= j
            and decoding[i].drafts[j - 1] == decoding[i].next_token
            and not generations[i].HasField("finished")
        ]
        if not alive:
            break
        more = record([decoding[i] for i in alive], sampler.filter(alive), logits[[starts[i] + j for i in alive]])
        for i, generation in zip(alive, more):
            _extend(generations[i], generation)
    for state, generation in zip(decoding, generations):
        _settle(state, generation, block_size)
    return generations


def _settle(state: RequestState, generation: pb.Generation, block_size: int) -> None:
    """After a step that let the row speculate: its KV length counts only the drafts accepted, and its block
    table keeps what its next token needs (the router cuts its own copy by the same rule)."""
    if not state.speculate:
        return
    accepted = len(generation.tokens.ids) - 1
    generation.drafted = len(state.drafts)
    state.num_computed_tokens -= len(state.drafts) - accepted
    draft_model.settle(state)
    del state.block_table[math.ceil((state.num_computed_tokens + 1) / block_size) :]
    state.drafts, state.speculate = [], 0


def _extend(generation: pb.Generation, more: pb.Generation) -> None:
    """One row's next accepted position joins its step's generation: another token, its alternatives, and the
    end of the request if that token ended it."""
    for field in ("ids", "logprobs", "texts", "is_special"):
        getattr(generation.tokens, field).extend(getattr(more.tokens, field))
    generation.top_tokens.extend(more.top_tokens)
    if more.HasField("finished"):
        generation.finished.CopyFrom(more.finished)


@dataclass
class ForwardRows:
    """The per-row arguments of `Engine.forward` (`reaches`, `adapters`, `state_spans`: None where not given)."""

    new_tokens: list[list[int]]
    starts: list[int]
    blocks: list[list[int]]
    lengths: list[int]
    logit_counts: list[int]
    reaches: list[int] | None = None
    adapters: list[str] | None = None
    state_spans: list[tuple[int, int]] | None = None
    images: list | None = None  # each row's image spans (shard/step/image_inputs.py): prompt chunks' only


OPTIONAL = ("reaches", "adapters", "state_spans", "images")


def one_token_rows(rows: ForwardRows, split: list[bool]) -> ForwardRows:
    """`rows` with each row marked in `split` (a verify step's: every position's logits kept) made into one row per
    token over the same blocks, the same flat tokens and the same logits in the same order."""
    out = ForwardRows([], [], [], [], [])
    for name in OPTIONAL:
        setattr(out, name, [] if getattr(rows, name) is not None else None)
    for i, tokens in enumerate(rows.new_tokens):
        parts = len(tokens) if split[i] else 1
        if split[i] and rows.logit_counts[i] != len(tokens):
            raise ValueError("a verify row keeps every position's logits")
        for j in range(parts):
            out.new_tokens.append([tokens[j]] if split[i] else tokens)
            out.starts.append(rows.starts[i] + j)
            out.blocks.append(rows.blocks[i])
            out.lengths.append(rows.starts[i] + j + 1 if split[i] else rows.lengths[i])
            out.logit_counts.append(1 if split[i] else rows.logit_counts[i])
            for name in OPTIONAL:
                column = getattr(rows, name)
                if column is not None:
                    getattr(out, name).append((0, 0) if name == "state_spans" and split[i] else column[i])
    return out
