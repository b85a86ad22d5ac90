"""The engine: our Llama-family model over a KV pool whose blocks the router hands out, one step at a time.

A batch is plain bookkeeping (`batch/cached_batch.py`), so filtering and joining batches copy no KV at all. Every step
is one flat forward over the new tokens of all its requests: one token for each decoding row, a prompt chunk for each
prefilling row the router gave one (chunked prefill mixes them into the same forward). Each request may name a LoRA
adapter (`adapters/served_adapters.py`): requests of different adapters and of the base model share that one
forward.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.grammar import GrammarCache
from conveyor.shard.adapters.adapter_files import AdapterFiles, resolve_source
from conveyor.shard.adapters.served_adapters import ServedAdapters
from conveyor.shard.batch.cached_batch import CachedBatch
from conveyor.shard.batch.request_state import BadRequest, RequestState
from conveyor.shard.kv_offload import block_files, prefix_offload
from conveyor.shard.kv_offload.prefix_offload import PrefixOffload
from conveyor.shard.layers import kv_quant
from conveyor.shard.layers.attention import KVCache, build_per_window
from conveyor.shard.layers.gemm import plain_copy_fits, weight_copies
from conveyor.shard.models import language_config, model_for, weight_names
from conveyor.shard.runtime.device import checkpoint_dtype, choose_dtype, device_bf16, to_device
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights
from conveyor.shard.sampling.masks import Masks
from conveyor.shard.sampling.sampler import Sampler
from conveyor.shard.speculation import draft_model, prompt_lookup
from conveyor.shard.speculation.draft_model import DraftModel
from conveyor.shard.step.generations import Generations
from conveyor.shard.step.pooling import pooled, yes_no_score
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
CPU_MEMORY_FRACTION = 0.3  # of the memory available after loading, for the KV pool on CPU
GPU_MEMORY_FRACTION = 0.9

StepOutput = tuple[list[pb.Generation], CachedBatch | None, pb.Timings]


@dataclass(frozen=True)
class Draft:
    """The draft model's choice (--speculate-model, --speculate-quantize)."""

    model: str  # a model directory, or "self": the target's own checkpoint
    quantize: str | None = None


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str,
        device: torch.device,
        group: ProcessGroup,
        quantize: str | None = None,
        draft: Draft | None = None,
        *,
        adapters: Sequence[tuple[str, str]] = (),
        max_loras: int = 4,
        model_name: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_offload: tuple[Path, int] | None = None,
    ) -> None:
        """`adapters`: LoRA adapters to load now, (name, source) each; `max_loras`: how many may be resident;
        `model_name`: the served model's id as given (a Hub id's folder is a snapshot hash), which an adapter's
        base model must name; `kv_cache_dtype`: auto (the model's dtype) or int8 (layers/kv_quant.py);
        `kv_offload`: the folder and byte cap of the prefix cache's disk tier (kv_offload/prefix_offload.py), or
        none."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = device
        self.group = group
        self.block_size = BLOCK_SIZE
        checkpoint_config = AutoConfig.from_pretrained(model_dir)
        self.config = language_config(checkpoint_config)
        self.dtype_name = _resolve_dtype(dtype, self.config, device)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.kv_dtype = kv_quant.cache_dtype(kv_cache_dtype, self.dtype)
        log.info("dtype", extra={"asked": dtype, "dtype": self.dtype_name})
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, self.config, self.tokenizer, GenerationConfig)
        self.vocab_size = self.config.vocab_size
        self.generations = Generations(self.tokenizer)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.masks = Masks(self.eos_token_ids)
        self._mask_ns = 0  # this step's
        weights = Weights(model_dir, group, self.dtype, device, weight_names(checkpoint_config))
        copies = weight_copies(self.dtype)
        weights.plain_copies = device.type == "cpu" and plain_copy_fits(weights.nbytes(), _available(device), copies)
        weights.quantize = self.quantize = quantize
        self.model = model_for(self.config, weights).eval()
        self.weight_bytes = model_bytes(self.model)
        log.info(
            "weights",
            extra={"bytes": self.weight_bytes, "quantize": quantize or "none", "plain_copies": weights.plain_copies},
        )
        shape = self.model.shape
        self._cache_shape = (self.config.num_hidden_layers, shape.kv_heads_per_rank, shape.head_dim)
        kv_quant.check_head_dim(shape.head_dim, self.kv_dtype)
        self.offload = None if kv_offload is None else self._offload(Path(model_dir), *kv_offload, quantize)
        self.cache: KVCache | None = None
        self.drafter = None if draft is None else self._load_draft(model_dir, draft)
        served = [model_name or "", str(model_dir), getattr(checkpoint_config, "_name_or_path", "") or ""]
        self.adapters = ServedAdapters(self.model, group, self.dtype, device, max_loras, served)
        for name, source in adapters:  # before warmup, which sizes the KV pool from the memory left
            self.load_adapter(name, source)

    def _load_draft(self, model_dir: str | Path, draft: Draft) -> DraftModel:
        """The draft model: the target's own checkpoint (`self`) or another with the same vocabulary, read for
        this rank as the target is, quantized if asked."""
        from transformers import AutoConfig

        source = model_dir if draft.model == "self" else draft.model
        checkpoint_config = AutoConfig.from_pretrained(source)
        config = language_config(checkpoint_config)
        if config.vocab_size != self.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({config.vocab_size}) is not the target's ({self.vocab_size})"
            )
        weights = Weights(source, self.group, self.dtype, self.device, weight_names(checkpoint_config))
        weights.quantize = draft.quantize
        model = model_for(config, weights).eval()
        shape = model.shape
        cache_shape = (config.num_hidden_layers, shape.kv_heads_per_rank, shape.head_dim)
        log.info(
            "draft model",
            extra={"model": str(source), "quantize": draft.quantize or "none", "bytes": model_bytes(model)},
        )
        return DraftModel(model, self.forward, cache_shape, self.block_size, self.dtype, self.device)

    def _offload(self, model_dir: Path, folder: Path, max_bytes: int, quantize: str | None) -> PrefixOffload:
        """The disk tier for this rank: its files' fingerprint says everything their KV depends on but tokens."""
        layers, kv_heads, head_dim = self._cache_shape
        facts = {
            "dtype": self.dtype_name,
            "kv_dtype": str(self.kv_dtype),
            "block_size": self.block_size,
            "rank": self.group.rank,
            "world_size": self.group.world_size,
            "quantize": quantize or "",
            "format": block_files.MAGIC.hex(),
        }
        block_bytes = KVCache.bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.kv_dtype)
        tier = block_files.DiskTier(folder, prefix_offload.fingerprint(model_dir, facts), max_bytes, block_bytes)
        log.info("kv offload", extra={"folder": str(folder), "files_bytes": tier.stats.bytes_on_disk})
        return PrefixOffload(tier, self.block_size, self.group)

    def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(
            dtype=self.dtype_name,
            device_type=self.device.type,
            engine="paged",
            model_type=self.config.model_type,
            max_position_embeddings=getattr(self.config, "max_position_embeddings", 0) or 0,
            world_size=self.group.world_size,
            rank=self.group.rank,
            block_size=self.block_size,
            weight_bytes=self.weight_bytes,
            quantize=self.quantize or "",
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_offload_max_bytes=0 if self.offload is None else self.offload.tier.max_bytes,
            adapters=self.adapters.describe(),
            max_loras=self.adapters.max_loras,
        )

    def states(self, batch: pb.Batch) -> list[RequestState]:
        """The new requests' states; BadRequest for one naming an adapter not loaded."""
        states = [
            RequestState.from_pb(r, self.tokenizer, self.eos_token_ids, self.vocab_size, self.grammars)
            for r in batch.requests
        ]
        for state in states:
            self.adapters.track(state)
        return states

    def batch(self, batch: pb.Batch) -> CachedBatch:
        """A joining batch as the engine steps it: its requests' states in its order."""
        return CachedBatch.from_pb(batch, self.states(batch))

    # --- LoRA adapters, between steps ----------------------------------------------------------------------

    def read_adapter(self, name: str, folder: Path) -> AdapterFiles:
        """A LoRA adapter's files, read and checked off the torch thread by a live load (see ServedAdapters.read)."""
        return self.adapters.read(name, folder)

    def load_adapter(self, name: str, source: str, files: AdapterFiles | None = None) -> pb.Adapter:
        """Loads a LoRA adapter (AdapterError, a BadRequest, when it does not fit). A live load resolves the source
        and reads its files off the torch thread and hands over `files`; at start they are read here."""
        if files is None:
            files = self.adapters.read(name, resolve_source(name, source))
        adapter = self.adapters.install(source, files)
        log.info(
            "adapter loaded",
            extra={"adapter": name, "source": source, "rank": adapter.rank, "bytes": adapter.weight_bytes},
        )
        return adapter

    def unload_adapter(self, name: str) -> None:
        """Unloads a LoRA adapter (AdapterError if it is not loaded, or a live request still names it)."""
        self.adapters.unload(name)
        log.info("adapter unloaded", extra={"adapter": name})

    # --- KV pool ------------------------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> KVCache:
        """A KV pool of `num_blocks` blocks in the model's shape and the cache's dtype: the warmup's scratch pool and
        the real one, and the pools of the benchmarks' in-process loops."""
        layers, kv_heads, head_dim = self._cache_shape
        return KVCache.allocate(layers, num_blocks, self.block_size, kv_heads, head_dim, self.kv_dtype, self.device)

    def warmup(self, request: pb.WarmupRequest) -> int:
        """Runs the largest prefill on a scratch pool, then sizes the real pool from the memory left (or from
        the token budget the router was given) and returns its capacity in tokens, agreed by all ranks."""
        next_block = 0
        for r in request.batch.requests:
            count = math.ceil((len(r.input_ids) + r.stopping_parameters.max_new_tokens) / self.block_size)
            del r.blocks[:]
            r.blocks.extend(range(next_block, next_block + count))
            next_block += count
        self.cache = self.allocate(next_block)
        _, batch, _ = self.step(self.batch(request.batch))
        if batch is not None:
            self.step(batch)
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the scratch pool's memory goes back before the free memory is read
        num_blocks = self.group.min(self._pool_blocks(request.max_batch_total_tokens))
        self.cache = self.allocate(num_blocks)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
        log.info("kv pool", extra={"blocks": num_blocks, "tokens": num_blocks * self.block_size})
        return num_blocks * self.block_size

    def _pool_blocks(self, requested_tokens: int) -> int:
        if requested_tokens:
            return math.ceil(requested_tokens / self.block_size)
        layers, kv_heads, head_dim = self._cache_shape
        per_block = KVCache.bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.kv_dtype)
        if self.drafter is not None:
            per_block += self.drafter.bytes_per_block()  # one block id holds the draft's KV too
        return max(1, int(_free_memory(self.device) // per_block))

    # --- a step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: CachedBatch) -> StepOutput:
        """One forward: each decoding row feeds its next token, each prefilling row its chunk. Decoding rows and
        rows whose chunk ends their prompt sample a token, but prompt-only rows (embeddings, rerank), which keep
        final states or a score instead and finish there; the batch is gone once every request has finished."""
        if self.cache is None:
            raise BadRequest("the KV pool is not allocated yet: call Warmup first")
        start = time.perf_counter_ns()
        self._mask_ns = 0
        decoding = batch.decoding
        self._propose(decoding)
        prefilling = [r for r in batch.prefilling if r.chunk_len]
        pooling = [r for r in prefilling if r.pooling is not None]  # last: a score's logits follow the sampled ones
        prefilling = [r for r in prefilling if r.pooling is None] + pooling
        rows = decoding + prefilling
        if not rows:
            raise BadRequest(f"batch {batch.id} has nothing to compute at this step")
        if self.offload is not None:
            self.offload.load(prefilling, self.cache)
        before = [r.num_computed_tokens for r in prefilling]
        new_tokens = [r.step_tokens() for r in rows]
        ending = [
            r
            for r, n in zip(rows, new_tokens)
            if not r.is_decoding and r.num_computed_tokens + len(n) == len(r.input_ids)
        ]
        for state, tokens in zip(rows, new_tokens):
            self._check_blocks(state, state.num_computed_tokens + len(tokens))
        spans = self._state_spans(rows, new_tokens, ending) if pooling else None
        logits = self._forward(rows, new_tokens, self._logit_counts(rows, new_tokens, ending), spans)
        for state, tokens in zip(rows, new_tokens):
            state.num_computed_tokens += len(tokens)
        if self.offload is not None:
            self.offload.save(prefilling, before, self.cache)
        states = None
        if spans is not None:
            logits, states = logits
        sampled = [r for r in ending if r.pooling is None]
        generations = self._sample(batch, decoding, sampled, logits)
        if pooling:
            done = [r for r in ending if r.pooling is not None]
            generations += self._pool(pooling, spans[len(rows) - len(pooling) :], states, done, logits)
        finished = all(g.HasField("finished") for g in generations) and len(generations) == batch.size
        timings = pb.Timings(total_ns=time.perf_counter_ns() - start, mask_ns=self._mask_ns)
        if self.offload is not None:
            stats = self.offload.tier.stats
            timings.disk_bytes, timings.disk_skipped_files = stats.bytes_on_disk, stats.skipped_files
            timings.disk_loaded_tokens, timings.disk_load_ns = self.offload.loaded_tokens, self.offload.load_ns
        return generations, None if finished else batch, timings

    def _propose(self, decoding: list[RequestState]) -> None:
        """This step's drafts: from the draft model when there is one, else by prompt lookup (a row's whole text
        is gathered only when it may draft: every decode step passes here)."""
        limits = [min(s.speculate, s.draft_room) for s in decoding]
        if self.drafter is not None and any(k > 0 for k in limits):
            for state, proposed in zip(decoding, self.drafter.propose(decoding, limits)):
                state.drafts = proposed
            return
        for state, limit in zip(decoding, limits):
            state.drafts = prompt_lookup.propose(state.token_ids, limit) if limit > 0 else []

    @staticmethod
    def _logit_counts(rows: list[RequestState], new_tokens: list[list[int]], ending: list[RequestState]) -> list[int]:
        """How many logits each row of the forward keeps: its last for a row that samples, every position for a
        prompt whose log-probabilities were asked for, none for a chunk that leaves its prompt unfinished."""
        ends = {id(r) for r in ending}
        counts = []
        for state, tokens in zip(rows, new_tokens):
            if state.is_decoding:
                counts.append(len(tokens))  # its next token, and each draft token to verify
            elif id(state) not in ends:
                counts.append(0)
            elif state.pooling is not None:
                counts.append(int(state.pooling.scores))  # a score reads the last position's logits
            else:
                counts.append(len(tokens) if state.prefill_logprobs else 1)
        return counts

    @staticmethod
    def _state_spans(
        rows: list[RequestState], new_tokens: list[list[int]], ending: list[RequestState]
    ) -> list[tuple[int, int]]:
        """Per row, (first, count): the positions of its tokens whose final hidden states the forward keeps (a
        prompt-only row's, as its pooling needs them; none of any other row)."""
        ends = {id(r) for r in ending}
        return [
            (0, 0)
            if state.pooling is None
            else state.pooling.span(state.num_computed_tokens, len(tokens), id(state) in ends)
            for state, tokens in zip(rows, new_tokens)
        ]

    def _pool(
        self,
        pooling: list[RequestState],
        spans: list[tuple[int, int]],
        states: torch.Tensor,
        done: list[RequestState],
        logits: torch.Tensor,
    ) -> list[pb.Generation]:
        """Prompt-only rows take the final states their chunk kept; those whose prompt ended (`done`) answer their
        vector or score (the scores' logits are the step's last rows) and finish, with no token."""
        for state, kept in zip(pooling, torch.split(states, [count for _, count in spans])):
            state.pooling.take(kept)
        scores = iter(logits[len(logits) - sum(s.pooling.scores for s in done) :])
        generations = []
        for state in done:
            generation = pb.Generation(
                request_id=state.id, disk_cached_tokens=state.disk_cached_tokens, finished=pb.GeneratedText()
            )
            p = state.pooling
            if p.scores:
                generation.score = yes_no_score(next(scores), p.yes_token_id, p.no_token_id, raw=True)
            else:
                generation.embedding.extend(pooled(p, len(state.input_ids)).tolist())
            generations.append(generation)
        return generations

    def _sample(
        self, batch: CachedBatch, decoding: list[RequestState], ending: list[RequestState], logits: torch.Tensor
    ) -> list[pb.Generation]:
        """Samples the decoding rows with the batch's sampler and the rows that just finished their prompt with
        a new one, which then joins the batch's."""
        generations: list[pb.Generation] = []
        decoded = sum(1 + len(s.drafts) for s in decoding)
        if decoding:
            generations = self._decode(decoding, batch.sampler, logits[:decoded])
        if not ending:
            return generations
        counts = [len(s.input_ids) if s.prefill_logprobs else 1 for s in ending]
        ends = (decoded + torch.cumsum(torch.tensor(counts), 0)).tolist()
        sampler = Sampler.build(
            [s.params for s in ending],
            [s.input_ids for s in ending],
            self.vocab_size,
            self.device,
            [s.generated_ids for s in ending],
        )
        new = self._record(ending, sampler, logits[[e - 1 for e in ends]])
        for state, generation, end, count in zip(ending, new, ends, counts):
            generation.disk_cached_tokens = state.disk_cached_tokens  # the router reports them in usage
            if state.prefill_logprobs:
                generation.prefill_tokens.CopyFrom(self.generations.prefill_tokens(state, logits[end - count : end]))
        batch.start_decoding(ending, sampler)
        return generations + new

    def _decode(self, decoding: list[RequestState], sampler: Sampler, logits: torch.Tensor) -> list[pb.Generation]:
        """Samples each decoding row at its first position and, while the token it chose is the draft fed at the
        next position, at that one too (speculative decoding's verification). Each position is sampled exactly as
        a step without drafts would sample it, with the row's next draw: a greedy row gets greedy's tokens, and a
        sampled one the target's own distribution (a draft is a point mass, so keeping the sample, and going on
        only when it equals the draft, is the rejection rule), with the same tokens for the same seed. KV written
        for rejected drafts is left behind: the row's length says where its next token goes."""
        counts = [1 + len(s.drafts) for s in decoding]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        generations = self._record(decoding, sampler, logits[starts] if len(logits) > len(decoding) else logits)
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
            more = self._record(
                [decoding[i] for i in alive], sampler.filter(alive), logits[[starts[i] + j for i in alive]]
            )
            for i, generation in zip(alive, more):
                _extend(generations[i], generation)
        for state, generation in zip(decoding, generations):
            self._settle_drafts(state, generation)
        return generations

    def _settle_drafts(self, state: RequestState, generation: pb.Generation) -> None:
        """After a step that let the row speculate: its KV length counts only the drafts accepted, and its block
        table keeps what its next token needs (the router cuts its own copy by the same rule)."""
        if not state.speculate:
            return
        accepted = len(generation.tokens.ids) - 1
        generation.drafted = len(state.drafts)
        state.num_computed_tokens -= len(state.drafts) - accepted
        draft_model.settle(state)
        del state.block_table[math.ceil((state.num_computed_tokens + 1) / self.block_size) :]
        state.drafts, state.speculate = [], 0

    def _record(self, states: list[RequestState], sampler: Sampler, logits: torch.Tensor) -> list[pb.Generation]:
        """Samples one token per row of `logits` [B, V], within each constrained row's grammar; each request
        feeds it at its next step."""
        self._mask_ns += self.masks.apply(logits, [s.matcher for s in states])
        sample = sampler(logits)
        for state, token in zip(states, sample.ids.tolist()):
            state.next_token = token
        return self.generations.record(states, sample)

    def _check_blocks(self, state: RequestState, tokens: int) -> None:
        table = state.block_table
        if len(table) * self.block_size < tokens:
            raise BadRequest(f"request {state.id} needs {tokens} KV slots but has {len(table)} blocks")
        if table and max(table) >= self.cache.num_blocks:
            raise BadRequest(f"request {state.id} names blocks beyond the pool of {self.cache.num_blocks}")

    def _forward(
        self,
        rows: list[RequestState],
        new_tokens: list[list[int]],
        logit_counts: list[int],
        state_spans: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One flat forward: row i feeds `new_tokens[i]` after its `num_computed_tokens`. Returns the logits of
        the last `logit_counts[i]` positions of each row, in order (and the final states `state_spans` asks for)."""
        starts = [r.num_computed_tokens for r in rows]
        lengths = [s + len(n) for s, n in zip(starts, new_tokens)]
        reaches = [max(n, len(r.input_ids)) for n, r in zip(lengths, rows)] if self.model.needs_reach else None
        blocks, adapters = [r.block_table for r in rows], [r.adapter for r in rows]
        return self.forward(
            new_tokens, starts, blocks, lengths, logit_counts, reaches, adapters=adapters, state_spans=state_spans
        )

    def forward(
        self,
        new_tokens: list[list[int]],
        starts: list[int],
        blocks: list[list[int]],
        lengths: list[int],
        logit_counts: list[int],
        reaches: list[int] | None = None,
        *,
        model: torch.nn.Module | None = None,
        cache: KVCache | None = None,
        adapters: list[str] | None = None,
        state_spans: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model over the KV pool: sequence i feeds `new_tokens[i]` at positions starts[i]..lengths[i]-1.
        `reaches[i]`: the longer of sequence i's prompt and its length (LongRoPE's choice; default: lengths).
        `model` and `cache`: another model and its pool (the draft model's); default: the target's.
        `adapters[i]`: sequence i's LoRA adapter ("": the base model); default: none for any (the draft model's
        forwards, whose layers carry no adapter). `state_spans[i]`: (first, count) of sequence i's new tokens whose
        final-norm hidden states to return too, after the logits (embeddings)."""
        model = self.model if model is None else model
        cache = self.cache if cache is None else cache
        device = self.device
        ids = to_device(torch.tensor([t for n in new_tokens for t in n], dtype=torch.long), device)
        positions = to_device(torch.cat([torch.arange(s, s + len(n)) for s, n in zip(starts, new_tokens)]), device)
        query_lens = [len(n) for n in new_tokens]
        metas = build_per_window(model.windows, blocks, lengths, query_lens, self.block_size, device)
        ends = torch.cumsum(torch.tensor(query_lens), 0).tolist()
        keep = torch.cat([torch.arange(e - c, e) for e, c in zip(ends, logit_counts)])
        reach = None
        if model.needs_reach:
            per_token = torch.repeat_interleave(torch.tensor(reaches or lengths), torch.tensor(query_lens))
            reach = to_device(per_token, device)
        more = {}
        if state_spans is not None:
            firsts = [e - n + f for e, n, (f, _) in zip(ends, query_lens, state_spans)]
            kept = torch.cat([torch.arange(f, f + c) for f, (_, c) in zip(firsts, state_spans)])
            more["states_index"] = to_device(kept, device)
        self.adapters.begin(adapters, query_lens)
        try:
            return model(ids, positions, cache, metas, to_device(keep, device), reach, **more)
        finally:
            self.adapters.end()


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's weights take in memory: every tensor its modules hold and every holder that says its own
    size (a layer's GEMM, both copies where it keeps two; a quantized table), each once; the KV pool not
    included."""
    held = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor) or _sized(v)}
    return sum(v.nbytes for v in held.values())


def _sized(value: object) -> bool:
    return hasattr(type(value), "nbytes")


def _resolve_dtype(asked: str, config, device: torch.device) -> str:
    """`--dtype`, with auto worked out from the checkpoint and the device (every rank reaches the same answer)."""
    if asked != "auto":
        return asked
    return choose_dtype("auto", checkpoint_dtype(config), device, device_bf16(device))


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


def _free_memory(device: torch.device) -> float:
    """Bytes the KV pool may take: a share of what is free now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * GPU_MEMORY_FRACTION
    return _available(device) * CPU_MEMORY_FRACTION


def _available(device: torch.device) -> float:
    """This rank's part of the memory free now: the GPU's, or the machine's split between the ranks on it."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    ranks_here = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    return available_ram() / max(1, int(ranks_here))


def available_ram(cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> float:
    """What this process may still take: the host's available memory, or less when a container's cgroup limit
    leaves less (/proc/meminfo shows the host's memory inside a container, not the limit)."""
    available = 4 << 30
    with open(meminfo) as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap = (cgroup / limit).read_text().strip()
            used = int((cgroup / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit():
            return max(0, min(available, int(cap) - used))
    return available


def _extend(generation: pb.Generation, more: pb.Generation) -> None:
    """One row's next accepted position joins its step's generation: another token, its alternatives, and the
    end of the request if that token ended it."""
    for field in ("ids", "logprobs", "texts", "is_special"):
        getattr(generation.tokens, field).extend(getattr(more.tokens, field))
    generation.top_tokens.extend(more.top_tokens)
    if more.HasField("finished"):
        generation.finished.CopyFrom(more.finished)
