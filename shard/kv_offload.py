"""The prefix cache's second tier (`--kv-offload-dir`): full prompt blocks' KV on disk, so that a restarted shard, or
a new replica on the same volume, reads a known prefix instead of prefilling it.

The router's prefix cache lives in memory and dies with the processes. Here every full block of a prompt that a
prefill computes is written through to a file (on a writer thread, from a copy taken before the step returns, so
that a SIGKILL loses at most the blocks still queued), named by a chain of hashes: a block's key covers the
model's fingerprint, the request's cache scope (the router's `CacheScope`, as a digest: whose blocks may be
shared) and every token up to the block's end, so one key can never name another scope's or another model's KV.
When a prefill chunk starts on a block boundary, its blocks found on disk are read into the request's own blocks
and only the rest of the chunk is computed (at least its last token: the prompt's last logits are always
computed, as with the memory cache). A file is checked before it is served: its header (format, fingerprint, key,
length) and a digest of its bytes; a truncated, corrupt or foreign file is skipped, counted and removed, never
served. The folder is held under `--kv-offload-max-gb` by removing the least recently used files. A folder that
cannot be written (full, read-only) is logged and counted, and serving goes on from memory alone.

Requests through a LoRA adapter, asking for prompt log-probabilities, or without a scope stay in memory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"CVKV\x00\x01"  # the format, version 1
DIGEST = 16  # bytes of a key, a fingerprint and a payload digest (blake2b)
HEADER = struct.Struct(f"<6s{DIGEST}s{DIGEST}sQ{DIGEST}s")  # magic, fingerprint, key, payload bytes, digest
SUFFIX = ".kv"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def fingerprint(model_dir: Path, facts: dict[str, object]) -> bytes:
    """What a block's KV depends on besides its tokens: the model's config, its weight files (names, sizes and
    samples of their bytes: a fine-tune has the same config and sizes), and `facts` (dtype, KV dtype, block size,
    rank and world size, quantization, format)."""
    parts = [json.dumps(facts, sort_keys=True).encode(), (model_dir / "config.json").read_bytes()]
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        parts.append(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(16):  # 16 samples of 4 KiB spread over the file
                f.seek(size * i // 16)
                parts.append(f.read(4096))
    return _digest(*parts)


def chain(root: bytes, tokens: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """The keys of the first `count` full blocks of `tokens`: each the digest of the one before and its tokens."""
    keys, key = [], root
    for b in range(count):
        block = tokens[b * block_size : (b + 1) * block_size]
        key = _digest(key, struct.pack(f"<{len(block)}I", *block))
        keys.append(key)
    return keys


@dataclass
class Stats:
    """Counted since the start; the router reads them from each step's timings (and /metrics shows them)."""

    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_files: int = 0  # truncated, corrupt or foreign: removed, never served
    write_errors: int = 0  # a full or read-only folder, and the like
    bytes_on_disk: int = 0


@dataclass
class _Pending:
    key: bytes
    payload: bytes


@dataclass
class DiskTier:
    """One rank's files under `folder`/<fingerprint hex>/, at most `max_bytes` of them."""

    folder: Path
    fp: bytes
    max_bytes: int
    block_bytes: int  # a block's payload: every layer's K and V rows
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.root = self.folder / self.fp.hex()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, least recently used first
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=4096)
        self._last_error = 0.0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            found = [(p.stat().st_mtime, p) for p in self.root.glob(f"*{SUFFIX}")]
        except OSError as exc:
            self._error("cannot open the KV offload folder", exc)
            found = []
        for _, path in sorted(found):
            try:
                self._files[bytes.fromhex(path.stem)] = path.stat().st_size
            except (ValueError, OSError):
                continue
        self.stats.bytes_on_disk = sum(self._files.values())
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._writer.start()

    def path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}{SUFFIX}"

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._files

    # --- reading ------------------------------------------------------------------------------------------

    def read(self, key: bytes) -> bytes | None:
        """The block's payload, checked; None (the file skipped, counted and removed) if anything is off."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(key)
            return None
        if len(data) == HEADER.size + self.block_bytes:
            magic, fp, stored_key, length, digest = HEADER.unpack_from(data)
            payload = data[HEADER.size :]
            ok = (magic, fp, stored_key, length) == (MAGIC, self.fp, key, self.block_bytes)
            if ok and _digest(payload) == digest:
                self._touch(key, path)
                return payload
        log.warning("kv offload: a block file failed its checks and was skipped", extra={"file": path.name})
        self.stats.skipped_files += 1
        self._forget(key)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def _touch(self, key: bytes, path: Path) -> None:
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        try:
            os.utime(path)
        except OSError:
            pass

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._files.pop(key, 0)
            self.stats.bytes_on_disk -= size

    # --- writing ------------------------------------------------------------------------------------------

    def save(self, key: bytes, payload: bytes) -> None:
        """Queues the block for the writer thread (dropped, and counted, when the queue is full: the disk is slower
        than the prefills, and memory must not grow without bound)."""
        if self.has(key):
            return
        try:
            self._queue.put_nowait(_Pending(key, payload))
        except queue.Full:
            self.stats.write_errors += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until every queued block is written, or `timeout` (a clean stop, and the tests)."""
        waiter = threading.Thread(target=self._queue.join, name="kv-offload-flush", daemon=True)
        waiter.start()
        waiter.join(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, item: _Pending) -> None:
        if self.has(item.key):
            return
        data = HEADER.pack(MAGIC, self.fp, item.key, len(item.payload), _digest(item.payload)) + item.payload
        path = self.path(item.key)
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(data)
            partial.replace(path)  # whole or absent: a reader never sees half a file under a key's name
        except OSError as exc:
            self.stats.write_errors += 1
            self._error("cannot write to the KV offload folder: serving from memory alone", exc)
            try:
                partial.unlink()
            except OSError:
                pass
            return
        with self._lock:
            self._files[item.key] = len(data)
            self.stats.bytes_on_disk += len(data)
            self.stats.saved_blocks += 1
        self._trim()

    def _trim(self) -> None:
        """Removes the least recently used files while the folder holds more than `max_bytes`."""
        while True:
            with self._lock:
                if self.stats.bytes_on_disk <= self.max_bytes or not self._files:
                    return
                key, size = self._files.popitem(last=False)
                self.stats.bytes_on_disk -= size
            try:
                self.path(key).unlink()
            except OSError:
                pass

    def _error(self, message: str, exc: OSError) -> None:
        """Logged at most once a minute: a full disk fails every write."""
        now = time.monotonic()
        if now - self._last_error > 60:
            self._last_error = now
            log.warning(message, extra={"folder": str(self.folder), "reason": str(exc)})


def block_payload(keys: list[torch.Tensor], values: list[torch.Tensor], block: int) -> bytes:
    """A block's KV from every layer's pool, K then V a layer, as bytes."""
    parts = []
    for k, v in zip(keys, values):
        for pool in (k, v):
            parts.append(pool[block].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def restore_block(keys: list[torch.Tensor], values: list[torch.Tensor], block: int, payload: bytes) -> None:
    """Writes a payload of `block_payload`'s layout into `block` of every layer's pool."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for k, v in zip(keys, values):
        for pool in (k, v):
            dest = pool[block]
            size = dest.numel() * dest.element_size()
            dest.view(torch.uint8).view(-1).copy_(data[offset : offset + size].to(dest.device))
            offset += size


class PrefixOffload:
    """The engine's side of the tier: which blocks a step may read from disk, and which it writes."""

    def __init__(self, tier: DiskTier, block_size: int, group) -> None:
        self.tier, self.block_size, self.group = tier, block_size, group
        self.loaded_tokens = 0  # this step's, for its timings
        self.load_ns = 0

    @staticmethod
    def takes(state) -> bool:
        """Whether a request's blocks may go to disk and come back: a scope to key them by, the base model's KV,
        and no prompt log-probabilities (those need every prompt token computed)."""
        return bool(state.cache_scope) and not state.adapter and not state.prefill_logprobs

    def keys(self, state, count: int) -> list[bytes]:
        """The chain keys of the request's first `count` full blocks (kept on the request, extended as needed)."""
        if len(state.offload_keys) < count:
            root = state.offload_keys[-1] if state.offload_keys else _digest(self.tier.fp, state.cache_scope.encode())
            done = len(state.offload_keys)
            more = chain(root, state.input_ids[done * self.block_size :], self.block_size, count - done)
            state.offload_keys.extend(more)
        return state.offload_keys[:count]

    def load(self, prefilling: list, cache) -> None:
        """Before the forward: each chunk that starts on a block boundary takes the blocks of it found on disk (all
        but its last token's), in order, and reads only the rest. Ranks agree on how many each request took."""
        self.loaded_tokens, start_ns = 0, time.perf_counter_ns()
        for state in prefilling:
            if not self.takes(state) or state.num_computed_tokens % self.block_size:
                continue
            first = state.num_computed_tokens // self.block_size
            last = (state.num_computed_tokens + state.chunk_len - 1) // self.block_size  # blocks before the last token
            last = min(last, len(state.block_table))  # the router's table covers the chunk; never read past it
            if last <= first:
                continue
            keys = self.keys(state, last)
            count = 0
            for b in range(first, last):
                payload = self.tier.read(keys[b]) if self.tier.has(keys[b]) else None
                if payload is None:
                    break
                restore_block(cache.keys, cache.values, state.block_table[b], payload)
                count += 1
            count = self.group.min(count) if self.group.world_size > 1 else count
            if count:
                tokens = count * self.block_size
                state.num_computed_tokens += tokens
                state.chunk_len -= tokens
                self.loaded_tokens += tokens
                self.tier.stats.loaded_blocks += count
        self.load_ns = time.perf_counter_ns() - start_ns

    def save(self, prefilling: list, before: list[int], cache) -> None:
        """After the forward: the prompt blocks each chunk completed, copied now and written by the writer thread."""
        for state, start in zip(prefilling, before):
            if not self.takes(state):
                continue
            first, end = start // self.block_size, min(state.num_computed_tokens, len(state.input_ids))
            count = end // self.block_size
            if count <= first:
                continue
            keys = self.keys(state, count)
            for b in range(first, count):
                if not self.tier.has(keys[b]):
                    self.tier.save(keys[b], block_payload(cache.keys, cache.values, state.block_table[b]))
