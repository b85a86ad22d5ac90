"""The disk tier's block files (`--kv-offload-dir`): one file per KV block, named by its key, whole or absent,
checked before it is served, the folder held under a byte cap.

Each file is a header (format, the model's fingerprint, the block's key, the payload's length and digest) and the
block's bytes. A file is read whole and served only if all of them agree: a truncated, corrupt or foreign file is
skipped, counted and removed, never served. Writes go through a thread of their own (a step hands over a copy and
goes on) into a partial file renamed into place; the least recently used files go once the folder holds more than
its cap. A folder that cannot be written (full, read-only) is logged at most once a minute and counted; the shard
serves from memory alone meanwhile. What the keys cover, and when blocks are written and read: prefix_offload.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"CVKV\x00\x01"  # the format, version 1
DIGEST = 16  # bytes of a key, a fingerprint and a payload digest (blake2b)
HEADER = struct.Struct(f"<6s{DIGEST}s{DIGEST}sQ{DIGEST}s")  # magic, fingerprint, key, payload bytes, digest
SUFFIX = ".kv"


def digest(*parts: bytes) -> bytes:
    """blake2b over the parts, each prefixed by its length (so no two lists of parts run together the same way)."""
    h = hashlib.blake2b(digest_size=DIGEST)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass
class Stats:
    """Counted since the start. Each step's timings carry `bytes_on_disk` and `skipped_files` to the router's
    /metrics; the others are the log's and the tests'."""

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
            found = [(p.stat(), p) for p in self.root.glob(f"*{SUFFIX}")]
        except OSError as exc:
            self._error("cannot open the KV offload folder", exc)
            found = []
        for status, path in sorted(found, key=lambda f: f[0].st_mtime):  # least recently used first
            with contextlib.suppress(ValueError):  # a name that is no key: not ours
                self._files[bytes.fromhex(path.stem)] = status.st_size
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
            magic, fp, stored_key, length, stored_digest = HEADER.unpack_from(data)
            payload = data[HEADER.size :]
            ok = (magic, fp, stored_key, length) == (MAGIC, self.fp, key, self.block_bytes)
            if ok and digest(payload) == stored_digest:
                self._touch(key, path)
                return payload
        log.warning("kv offload: a block file failed its checks and was skipped", extra={"file": path.name})
        self.stats.skipped_files += 1
        self._forget(key)
        with contextlib.suppress(OSError):
            path.unlink()
        return None

    def _touch(self, key: bytes, path: Path) -> None:
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)

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
        data = HEADER.pack(MAGIC, self.fp, item.key, len(item.payload), digest(item.payload)) + item.payload
        path = self.path(item.key)
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(data)
            partial.replace(path)  # whole or absent: a reader never sees half a file under a key's name
        except OSError as exc:
            self.stats.write_errors += 1
            self._error("cannot write to the KV offload folder: serving from memory alone", exc)
            with contextlib.suppress(OSError):
                partial.unlink()
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
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _error(self, message: str, exc: OSError) -> None:
        """Logged at most once a minute: a full disk fails every write."""
        now = time.monotonic()
        if now - self._last_error > 60:
            self._last_error = now
            log.warning(message, extra={"folder": str(self.folder), "reason": str(exc)})
