"""The waiting line: validated requests in arrival order, and the rule that picks the next batch from it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from conveyor.router.block_allocator import Allocation, BlockAllocator
from conveyor.router.events import Event
from conveyor.router.policy import Admission
from conveyor.router.validation import ValidRequest


@dataclass(eq=False)
class Entry:
    """A request from the moment it is queued until its last token (or error) is sent to its stream."""

    id: int
    request: ValidRequest
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    queued_at: float = field(default_factory=time.monotonic)
    batched_at: float | None = None
    # Set by the HTTP side when the client goes away; the scheduler drops the entry at its next step.
    cancelled: bool = False
    done: bool = False
    # Paged engine: the KV blocks this request holds from admission until it leaves the batch.
    allocation: Allocation | None = None
    # Tracing: the span of the call that made this request, and the one timing its wait in the queue.
    span: Span | None = None
    queue_span: Span | None = None

    @property
    def input_length(self) -> int:
        return len(self.request.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.parameters.max_new_tokens


@dataclass
class NextBatch:
    entries: list[Entry]
    max_tokens: int  # the KV tokens the batch may grow to (padded, or in whole blocks)


def kv_tokens(entry: Entry) -> int:
    """KV slots a request can fill: its prompt and every generated token but the last, which is never fed back."""
    return entry.input_length + entry.max_new_tokens - 1


class Queue:
    def __init__(self) -> None:
        self._entries: deque[Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: Entry) -> None:
        self._entries.append(entry)

    def next_batch(self, admission: Admission, allocator: BlockAllocator | None = None) -> NextBatch | None:
        """Takes from the front of the line the longest run of entries that fits `admission`.

        An entry that does not fit stays first in line, so a large request is not overtaken for ever by smaller
        ones behind it. With an `allocator` (paged engine) the entries taken hold their KV blocks on return.
        """
        self._drop_cancelled()
        if admission.prefill_budget <= 0 or admission.token_budget <= 0 or admission.max_size == 0:
            return None
        if not self._entries or (admission.min_size and len(self._entries) < admission.min_size):
            return None
        if allocator is None:
            taken, max_tokens = self._take_padded(admission)
        else:
            taken, max_tokens = self._take_paged(admission, allocator)
        if not taken or (admission.min_size and len(taken) < admission.min_size):
            for entry in taken:
                release(entry, allocator)
            return None
        for _ in taken:
            self._entries.popleft()
        return NextBatch(taken, max_tokens)

    def _take_padded(self, admission: Admission) -> tuple[list[Entry], int]:
        """A batch of n prompts costs n times the longest in prefill tokens, and its KV may grow to that plus
        every request's `max_new_tokens`."""
        taken: list[Entry] = []
        longest = decode_tokens = 0
        for entry in self._entries:
            new_longest = max(longest, entry.input_length)
            prefill_tokens = (len(taken) + 1) * new_longest
            max_tokens = prefill_tokens + decode_tokens + entry.max_new_tokens
            if prefill_tokens > admission.prefill_budget or max_tokens > admission.token_budget:
                break
            taken.append(entry)
            longest, decode_tokens = new_longest, decode_tokens + entry.max_new_tokens
            if admission.max_size is not None and len(taken) >= admission.max_size:
                break
        return taken, len(taken) * longest + decode_tokens

    def _take_paged(self, admission: Admission, allocator: BlockAllocator) -> tuple[list[Entry], int]:
        """Prompts cost their real length in prefill tokens; KV memory is whatever blocks are free."""
        taken: list[Entry] = []
        prefill_tokens = blocks = 0
        for entry in self._entries:
            if prefill_tokens + entry.input_length > admission.prefill_budget:
                break
            allocation = allocator.allocate(kv_tokens(entry))
            if allocation is None:
                break
            entry.allocation = allocation
            taken.append(entry)
            prefill_tokens += entry.input_length
            blocks += len(allocation.blocks)
            if admission.max_size is not None and len(taken) >= admission.max_size:
                break
        return taken, blocks * allocator.block_size

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        if any(e.cancelled for e in self._entries):
            self._entries = deque(e for e in self._entries if not e.cancelled)

    def drain(self) -> list[Entry]:
        entries, self._entries = list(self._entries), deque()
        return entries


def release(entry: Entry, allocator: BlockAllocator | None) -> None:
    """Gives an entry's KV blocks back; safe to call on an entry that holds none."""
    if entry.allocation is not None and allocator is not None:
        allocator.free(entry.allocation)
    entry.allocation = None
