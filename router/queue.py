"""The waiting line: validated requests in arrival order, and the rule that picks the next batch from it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from opentelemetry.trace import Span

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
    # Tokens generated so far, as streamed: a preempted request is recomputed from its prompt and these.
    generated_ids: list[int] = field(default_factory=list)
    # Paged engine, from admission until the request leaves the batch: its block table, how many of its leading
    # full blocks were matched in or offered to the prefix cache, how many of its tokens have KV on the shards,
    # and how many tokens it must read before it samples (its prompt, plus what it had generated when it was
    # preempted).
    blocks: list[int] = field(default_factory=list)
    cached_blocks: int = 0
    computed: int = 0
    target: int = 0
    preemptions: int = 0
    # Tracing: the span of the call that made this request, and the one timing its wait in the queue.
    span: Span | None = None
    queue_span: Span | None = None

    @property
    def input_length(self) -> int:
        return len(self.request.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.parameters.max_new_tokens

    @property
    def tokens(self) -> list[int]:
        """Every token whose KV the request may need: its prompt and what it has generated."""
        return [*self.request.input_ids, *self.generated_ids]

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


@dataclass
class NextBatch:
    entries: list[Entry]
    max_tokens: int  # the KV tokens the batch may grow to, padding included


class Queue:
    def __init__(self) -> None:
        self._entries: deque[Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: Entry) -> None:
        self._entries.append(entry)

    def appendleft(self, entry: Entry) -> None:
        """A preempted request goes back to the front: it was admitted before anyone still waiting."""
        self._entries.appendleft(entry)

    def peek(self) -> Entry | None:
        self._drop_cancelled()
        return self._entries[0] if self._entries else None

    def popleft(self) -> Entry:
        return self._entries.popleft()

    def next_batch(self, admission: Admission) -> NextBatch | None:
        """Takes from the front of the line the longest run of entries that fits `admission` (padded engine: a
        batch of n prompts costs n times the longest).

        An entry that does not fit stays first in line, so a large request is not overtaken for ever by smaller
        ones behind it.
        """
        self._drop_cancelled()
        if admission.prefill_budget <= 0 or admission.token_budget <= 0 or admission.max_size == 0:
            return None
        if not self._entries or (admission.min_size and len(self._entries) < admission.min_size):
            return None
        taken, max_tokens = self._take_padded(admission)
        if not taken or (admission.min_size and len(taken) < admission.min_size):
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

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        if any(e.cancelled for e in self._entries):
            self._entries = deque(e for e in self._entries if not e.cancelled)

    def drain(self) -> list[Entry]:
        entries, self._entries = list(self._entries), deque()
        return entries
