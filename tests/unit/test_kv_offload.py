"""The prefix cache's disk tier (shard/kv_offload/prefix_offload.py, its files block_files.py): what it writes comes
back whole; what was damaged, cut short or written for another model or scope never comes back; the folder stays
under its cap; an unwritable folder is survived."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from conveyor.shard.kv_offload import block_files, prefix_offload
from conveyor.shard.kv_offload.block_files import DiskTier
from conveyor.shard.kv_offload.prefix_offload import PrefixOffload
from conveyor.shard.layers.attention import KVCache
from conveyor.shard.runtime.process_group import ProcessGroup

BLOCK, LAYERS, HEADS, DIM = 4, 2, 2, 8
FP = block_files.digest(b"a model")


def pool(blocks: int = 6, seed: int = 0) -> KVCache:
    cache = KVCache.allocate(LAYERS, blocks, BLOCK, HEADS, DIM, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for t in [*cache.keys, *cache.values]:
        t.copy_(torch.randn(t.shape, generator=generator))
    return cache


def tier(folder: Path, max_bytes: int = 1 << 30, fp: bytes = FP) -> DiskTier:
    block_bytes = KVCache.bytes_per_block(LAYERS, BLOCK, HEADS, DIM, torch.float32)
    return DiskTier(folder, fp, max_bytes, block_bytes)


def test_a_block_written_comes_back_whole(tmp_path: Path) -> None:
    source, target = pool(seed=1), pool(seed=2)
    store = tier(tmp_path)
    key = block_files.digest(b"block 0")
    store.save(key, prefix_offload.block_payload(source.keys, source.values, 3))
    store.flush()
    assert store.has(key) and store.stats.saved_blocks == 1
    prefix_offload.restore_block(target.keys, target.values, 5, store.read(key))
    for a, b in zip([*source.keys, *source.values], [*target.keys, *target.values]):
        assert torch.equal(a[3], b[5])
    assert tier(tmp_path).has(key)  # a new process finds it: the restart case


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "another-model", "another-key"])
def test_a_damaged_or_foreign_file_is_skipped_counted_and_removed(tmp_path: Path, damage: str) -> None:
    source = pool()
    store = tier(tmp_path)
    key, other = block_files.digest(b"k"), block_files.digest(b"other")
    store.save(key, prefix_offload.block_payload(source.keys, source.values, 0))
    store.flush()
    path = store.path(key)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-10]
    elif damage == "bit-flipped":
        data[-100] ^= 0x04
    elif damage == "another-model":  # written by another model's shard under this name
        other_model = tier(tmp_path / "elsewhere", fp=block_files.digest(b"another model"))
        other_model.save(key, prefix_offload.block_payload(source.keys, source.values, 0))
        other_model.flush()
        data = bytearray(other_model.path(key).read_bytes())
    else:  # another block's file under this block's name
        store.save(other, prefix_offload.block_payload(source.keys, source.values, 1))
        store.flush()
        data = bytearray(store.path(other).read_bytes())
    path.write_bytes(bytes(data))
    reopened = tier(tmp_path)
    assert reopened.has(key)
    assert reopened.read(key) is None
    assert reopened.stats.skipped_files == 1 and not path.exists() and not reopened.has(key)


def test_the_folder_stays_under_its_cap_least_recently_used_first(tmp_path: Path) -> None:
    source = pool()
    payload = prefix_offload.block_payload(source.keys, source.values, 0)
    size = block_files.HEADER.size + len(payload)
    store = tier(tmp_path, max_bytes=3 * size)
    keys = [block_files.digest(bytes([i])) for i in range(5)]
    for key in keys[:3]:
        store.save(key, payload)
        store.flush()
    assert store.read(keys[0]) is not None  # used again: the least recently used is now keys[1]
    for key in keys[3:]:
        store.save(key, payload)
        store.flush()
    assert [store.has(k) for k in keys] == [True, False, False, True, True]
    assert store.stats.bytes_on_disk == 3 * size == sum(p.stat().st_size for p in store.root.iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_a_read_only_folder_is_survived(tmp_path: Path) -> None:
    store = tier(tmp_path)
    store.root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        store.save(block_files.digest(b"k"), b"\0" * store.block_bytes)
        store.flush()
        assert store.stats.write_errors == 1 and store.stats.saved_blocks == 0
    finally:
        store.root.chmod(stat.S_IRWXU)


def test_a_folder_that_cannot_be_written_is_survived(tmp_path: Path) -> None:
    """A file where the folder should be: every write fails (as on a full or read-only disk), none raises."""
    (tmp_path / "blocked").write_text("not a folder")
    store = tier(tmp_path / "blocked")
    store.save(block_files.digest(b"k"), b"\0" * store.block_bytes)
    store.flush()
    assert store.stats.write_errors == 1 and not store.has(block_files.digest(b"k"))


class _Request:
    """The fields of a shard's RequestState that the tier reads."""

    def __init__(
        self, tokens: list[int], blocks: list[int], scope: str = "scope-a", adapter: str = "", images: int = 0
    ) -> None:
        self.input_ids, self.block_table, self.cache_scope, self.adapter = tokens, blocks, scope, adapter
        self.computes_every_prompt_token, self.offload_keys = False, []
        self.images = [object()] * images  # the tier reads only whether there are any
        self.num_computed_tokens, self.chunk_len, self.disk_cached_tokens = 0, len(tokens), 0


def test_a_prompt_written_by_one_request_is_read_by_the_next_of_its_scope_only(tmp_path: Path) -> None:
    """Blocks 0-2 of a 14-token prompt go to disk after its prefill; the same prompt later in the same scope reads
    them (all but the block of its last token) and computes the rest; another scope reads none."""
    group = ProcessGroup(0, 1)
    writer = PrefixOffload(tier(tmp_path), BLOCK, group)
    tokens = list(range(100, 114))
    first, cache = _Request(tokens, [0, 1, 2, 3]), pool(seed=3)
    writer.load([first], cache)
    assert first.num_computed_tokens == 0  # nothing there yet
    first.num_computed_tokens = 14  # the forward read it
    writer.save([first], [0], cache)
    writer.tier.flush()
    assert writer.tier.stats.saved_blocks == 3  # the fourth block is not full

    reader, fresh = PrefixOffload(tier(tmp_path), BLOCK, group), pool(seed=4)
    again = _Request(tokens, [5, 4, 3, 2])
    reader.load([again], fresh)
    assert (again.num_computed_tokens, again.chunk_len, reader.loaded_tokens) == (12, 2, 12)
    assert again.disk_cached_tokens == 12  # the request's own count, which its first token tells the router
    for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        assert all(torch.equal(a[src], b[dst]) for src, dst in ((0, 5), (1, 4), (2, 3)))
    stranger = _Request(tokens, [5, 4, 3, 2], scope="scope-b")
    reader.load([stranger], fresh)
    assert stranger.num_computed_tokens == 0 and reader.loaded_tokens == 0
    through_adapter = _Request(tokens, [5, 4, 3, 2], adapter="sql")
    reader.load([through_adapter], fresh)
    assert through_adapter.num_computed_tokens == 0
    with_an_image = _Request(tokens, [5, 4, 3, 2], images=1)  # its image's tokens are any image's: never read
    reader.load([with_an_image], fresh)
    assert with_an_image.num_computed_tokens == 0


def test_a_chunk_keeps_its_last_token_to_compute(tmp_path: Path) -> None:
    """A 12-token prompt whose three blocks are all on disk still computes its last token (its logits)."""
    group = ProcessGroup(0, 1)
    offload, cache = PrefixOffload(tier(tmp_path), BLOCK, group), pool()
    tokens = list(range(12))
    done = _Request(tokens, [0, 1, 2])
    done.num_computed_tokens = 12
    offload.save([done], [0], cache)
    offload.tier.flush()
    again = _Request(tokens, [3, 4, 5])
    offload.load([again], cache)
    assert (again.num_computed_tokens, again.chunk_len) == (8, 4)
