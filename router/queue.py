"""The waiting line: validated requests in arrival order, and the rule that picks the next batch from it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

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

    @property
    def input_length(self) -> int:
        return len(self.request.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.parameters.max_new_tokens


@dataclass
class NextBatch:
    entries: list[Entry]
    max_tokens: int  # the padded KV tokens the batch may grow to, counted against the token budget


class Queue:
    def __init__(self) -> None:
        self._entries: deque[Entry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: Entry) -> None:
        self._entries.append(entry)

    def next_batch(self, admission: Admission) -> NextBatch | None:
        """Takes from the front of the line the longest run of entries that fits `admission`.

        Padded accounting: a batch of n prompts costs n times the longest prompt in prefill tokens, and its
        KV may grow to that plus every request's `max_new_tokens`. An entry that does not fit stays first in
        line, so a large request is not overtaken for ever by smaller ones behind it.
        """
        self._drop_cancelled()
        if admission.prefill_budget <= 0 or admission.token_budget <= 0 or admission.max_size == 0:
            return None
        if not self._entries or (admission.min_size and len(self._entries) < admission.min_size):
            return None
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
        if not taken or (admission.min_size and len(taken) < admission.min_size):
            return None
        for _ in taken:
            self._entries.popleft()
        return NextBatch(taken, len(taken) * longest + decode_tokens)

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        if any(e.cancelled for e in self._entries):
            self._entries = deque(e for e in self._entries if not e.cancelled)

    def drain(self) -> list[Entry]:
        entries, self._entries = list(self._entries), deque()
        return entries
