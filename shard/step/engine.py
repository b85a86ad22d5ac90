"""The engine: our Llama-family model over a KV pool whose blocks the router hands out, one step at a time.

A batch is plain bookkeeping (`batch/running_batch.py`), so filtering and joining batches copy no KV at all. Every step
is one flat forward over the new tokens of all its requests: one token for each decoding row, a prompt chunk for each
prefilling row the router gave one (chunked prefill mixes them into the same forward). Each request may name a LoRA
adapter (`adapters/served_adapters.py`): requests of different adapters and of the base model share that one
forward.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from conveyor.grammar import GrammarCache
from conveyor.shard.adapters.adapter_files import AdapterFiles, resolve_source
from conveyor.shard.adapters.served_adapters import ServedAdapters
from conveyor.shard.batch.request_state import BadRequest, RequestState
from conveyor.shard.batch.running_batch import RunningBatch
from conveyor.shard.layers import kv_quant
from conveyor.shard.layers.attention import KVCache, build_per_window
from conveyor.shard.layers.gemm import plain_copy_fits, weight_copies
from conveyor.shard.models import language_config, model_for, vision_encoder_for, weight_names
from conveyor.shard.runtime import host_memory
from conveyor.shard.runtime.device import to_device
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights
from conveyor.shard.sampling.masks import Masks
from conveyor.shard.sampling.sampler import Sampler
from conveyor.shard.speculation import verification
from conveyor.shard.speculation.verification import ForwardRows, one_token_rows
from conveyor.shard.step import image_inputs, loading, pooling
from conveyor.shard.step.generations import Generations
from conveyor.shard.step.loading import Draft
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

BLOCK_SIZE = 16

StepOutput = tuple[list[pb.Generation], RunningBatch | None, pb.Timings]


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
        self.dtype_name = loading.resolve_dtype(dtype, self.config, device)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.kv_dtype = kv_quant.cache_dtype(kv_cache_dtype, self.dtype)
        log.info("dtype", extra={"asked": dtype, "dtype": self.dtype_name})
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_ids = loading.eos_token_ids(model_dir, self.config, self.tokenizer, GenerationConfig)
        self.vocab_size = self.config.vocab_size
        self.generations = Generations(self.tokenizer)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.masks = Masks(self.eos_token_ids)
        self._mask_ns = 0  # this step's
        weights = Weights(model_dir, group, self.dtype, device, weight_names(checkpoint_config))
        copies = weight_copies(self.dtype)
        weights.plain_copies = device.type == "cpu" and plain_copy_fits(
            weights.nbytes(), host_memory.available(device), copies
        )
        weights.quantize = self.quantize = quantize
        self.model = model_for(self.config, weights).eval()
        self.vision = vision_encoder_for(str(model_dir), checkpoint_config, self.dtype, device)
        self.weight_bytes = host_memory.model_bytes(self.model)
        log.info(
            "weights",
            extra={"bytes": self.weight_bytes, "quantize": quantize or "none", "plain_copies": weights.plain_copies},
        )
        shape = self.model.shape
        self.cache_shape = (self.config.num_hidden_layers, shape.kv_heads_per_rank, shape.head_dim)
        kv_quant.check_head_dim(shape.head_dim, self.kv_dtype)
        self.offload = None if kv_offload is None else loading.disk_tier(self, Path(model_dir), *kv_offload, quantize)
        self.cache: KVCache | None = None
        self.drafter = None if draft is None else loading.load_draft(self, model_dir, draft)
        served = [model_name or "", str(model_dir), getattr(checkpoint_config, "_name_or_path", "") or ""]
        self.adapters = ServedAdapters(self.model, group, self.dtype, device, max_loras, served)
        for name, source in adapters:  # before warmup, which sizes the KV pool from the memory left
            self.load_adapter(name, source)

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

    def batch(self, batch: pb.Batch) -> RunningBatch:
        """A joining batch as the engine steps it: its requests' states in its order."""
        return RunningBatch.from_pb(batch, self.states(batch))

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
        layers, kv_heads, head_dim = self.cache_shape
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
        layers, kv_heads, head_dim = self.cache_shape
        per_block = KVCache.bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.kv_dtype)
        if self.drafter is not None:
            per_block += self.drafter.bytes_per_block()  # one block id holds the draft's KV too
        return max(1, int(host_memory.free_memory(self.device) // per_block))

    # --- a step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: RunningBatch) -> StepOutput:
        """One forward: each decoding row feeds its next token, each prefilling row its chunk. Decoding rows and
        rows whose chunk ends their prompt sample a token, but prompt-only rows (embeddings, rerank), which keep
        final states or a score instead and finish there; the batch is gone once every request has finished."""
        if self.cache is None:
            raise BadRequest("the KV pool is not allocated yet: call Warmup first")
        start = time.perf_counter_ns()
        self._mask_ns = 0
        decoding = batch.decoding
        verification.propose(self.drafter, decoding)
        prefilling = [r for r in batch.prefilling if r.chunk_len]
        prompt_only = [r for r in prefilling if r.pooling is not None]  # last: a score's logits follow the sampled ones
        prefilling = [r for r in prefilling if r.pooling is None] + prompt_only
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
        spans = pooling.state_spans(rows, new_tokens, ending) if prompt_only else None
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
        if prompt_only:
            done = [r for r in ending if r.pooling is not None]
            generations += pooling.answers(prompt_only, spans[len(rows) - len(prompt_only) :], states, done, logits)
        finished = all(g.HasField("finished") for g in generations) and len(generations) == batch.size
        timings = pb.Timings(total_ns=time.perf_counter_ns() - start, mask_ns=self._mask_ns)
        if self.offload is not None:
            stats = self.offload.tier.stats
            timings.disk_bytes, timings.disk_skipped_files = stats.bytes_on_disk, stats.skipped_files
            timings.disk_loaded_tokens, timings.disk_load_ns = self.offload.loaded_tokens, self.offload.load_ns
        return generations, None if finished else batch, timings

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

    def _sample(
        self, batch: RunningBatch, decoding: list[RequestState], ending: list[RequestState], logits: torch.Tensor
    ) -> list[pb.Generation]:
        """Samples the decoding rows with the batch's sampler and the rows that just finished their prompt with
        a new one, which then joins the batch's."""
        generations: list[pb.Generation] = []
        decoded = sum(1 + len(s.drafts) for s in decoding)
        if decoding:
            generations = verification.verify(decoding, batch.sampler, logits[:decoded], self._record, self.block_size)
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
        images = image_inputs.row_images(self.vision, rows, new_tokens, self.dtype)
        args = ForwardRows(new_tokens, starts, blocks, lengths, logit_counts, reaches, adapters, state_spans, images)
        verifying = [r.is_decoding and len(n) > 1 for r, n in zip(rows, new_tokens)]
        if any(verifying):
            args = one_token_rows(args, verifying)  # the decode path's rows (speculation/verification.py)
        return self.forward(
            args.new_tokens,
            args.starts,
            args.blocks,
            args.lengths,
            args.logit_counts,
            args.reaches,
            adapters=args.adapters,
            state_spans=args.state_spans,
            images=args.images,
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
        images: list[image_inputs.RowImages] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model over the KV pool: sequence i feeds `new_tokens[i]` at positions starts[i]..lengths[i]-1.
        `reaches[i]`: the longer of sequence i's prompt and its length (LongRoPE's choice; default: lengths).
        `model` and `cache`: another model and its pool (the draft model's); default: the target's.
        `adapters[i]`: sequence i's LoRA adapter ("": the base model); default: none for any (the draft model's
        forwards, whose layers carry no adapter). `state_spans[i]`: (first, count) of sequence i's new tokens whose
        final-norm hidden states to return too, after the logits (embeddings). `images[i]`: the image spans sequence
        i's new tokens hold, with their embeddings (None: no sequence's do)."""
        model = self.model if model is None else model
        cache = self.cache if cache is None else cache
        device = self.device
        ids = to_device(torch.tensor([t for n in new_tokens for t in n], dtype=torch.long), device)
        positions = to_device(torch.cat([torch.arange(s, s + len(n)) for s, n in zip(starts, new_tokens)]), device)
        query_lens = [len(n) for n in new_tokens]
        more, image_blocks = {}, None
        if images is not None:
            image_blocks, more["image_embeds"] = image_inputs.flat_inputs(images, starts, query_lens, device)
            if not self.vision.bidirectional:  # SmolVLM: the image's tokens attend causally, as text does
                image_blocks = None
        metas = build_per_window(model.windows, blocks, lengths, query_lens, self.block_size, device, image_blocks)
        ends = torch.cumsum(torch.tensor(query_lens), 0).tolist()
        keep = torch.cat([torch.arange(e - c, e) for e, c in zip(ends, logit_counts)])
        reach = None
        if model.needs_reach:
            per_token = torch.repeat_interleave(torch.tensor(reaches or lengths), torch.tensor(query_lens))
            reach = to_device(per_token, device)
        if state_spans is not None:
            firsts = [e - n + f for e, n, (f, _) in zip(ends, query_lens, state_spans)]
            kept = torch.cat([torch.arange(f, f + c) for f, (_, c) in zip(firsts, state_spans)])
            more["states_index"] = to_device(kept, device)
        self.adapters.begin(adapters, query_lens)
        try:
            return model(ids, positions, cache, metas, to_device(keep, device), reach, **more)
        finally:
            self.adapters.end()
