"""The waiting line, shared fairly between API keys.

Admission takes the lowest priority value first (vLLM's convention). Within one priority, a sequence that ran
before (preempted, or replayed after a failed step) goes first, by arrival: it was admitted and charged already.
Then the keys with new work waiting take turns in proportion to their weights, by virtual time (start-time fair
queueing): each key has a clock that moves on by the tokens it is admitted with (prompt + max_new_tokens)
divided by its weight, and the key whose clock is earliest goes next, its oldest request first. A key that had
nothing waiting starts at the clock of the last admission, so idling banks no credit: a key that floods the
line delays the others by at most its share. Virtual time rather than deficit round robin: it needs no quantum
tuned to request sizes, and a key with one huge request and a key with many small ones still split by tokens.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from conveyor.router.core.sequence import Sequence

_Entry = tuple[tuple[int, bool, int], Sequence]


@dataclass
class _Tenant:
    """One key's waiting sequences, by (priority, new rather than resumed, arrival)."""

    weight: float
    clock: float = 0.0
    waiting: list[_Entry] = field(default_factory=list)


def _place(sequence: Sequence) -> tuple[int, bool, int]:
    return (sequence.priority, sequence.batched_at is None, sequence.id)


def _first(tenant: _Tenant, group: int | None) -> Sequence | None:
    """The tenant's next sequence, or its next one placed on `group` (a scan: a key's line is short)."""
    if not tenant.waiting:
        return None
    if group is None:
        return tenant.waiting[0][1]
    return min((entry for entry in tenant.waiting if entry[1].group == group), default=(None, None))[1]


def _remove(tenant: _Tenant, sequence: Sequence) -> None:
    if tenant.waiting[0][1] is sequence:
        heapq.heappop(tenant.waiting)
    else:
        tenant.waiting = [entry for entry in tenant.waiting if entry[1] is not sequence]
        heapq.heapify(tenant.waiting)


class Queue:
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._clock = 0.0  # the clock of the last admission: where a key that starts waiting joins

    def __len__(self) -> int:
        return len(self.sequences())

    def sequences(self, group: int | None = None) -> list[Sequence]:
        """The waiting sequences (those cancelled meanwhile left out), of `group` if one is named, in no particular
        order."""
        waiting = (s for t in self._tenants.values() for _, s in t.waiting if not s.cancelled)
        return [s for s in waiting if group is None or s.group == group]

    def append(self, sequence: Sequence) -> None:
        tenant = self._tenants.setdefault(sequence.key.name, _Tenant(sequence.key.weight))
        if not tenant.waiting:
            tenant.clock = max(tenant.clock, self._clock)
        heapq.heappush(tenant.waiting, (_place(sequence), sequence))

    def appendleft(self, sequence: Sequence) -> None:
        """A preempted or replayed sequence: its place is its own (priority, arrival), ahead of every new request of
        its priority, since it was admitted before them."""
        self.append(sequence)

    def peek(self, group: int | None = None) -> Sequence | None:
        """The sequence admission takes next (without taking it); of those placed on `group`, if one is named."""
        head = self._head(group)
        return None if head is None else head[1]

    def _head(self, group: int | None = None) -> tuple[_Tenant, Sequence] | None:
        self._drop_cancelled()
        heads = ((t, first) for t in self._tenants.values() if (first := _first(t, group)) is not None)
        return min(heads, key=self._rank, default=None)

    @staticmethod
    def _rank(head: tuple[_Tenant, Sequence]) -> tuple[int, bool, float, int]:
        tenant, sequence = head
        priority, new, arrival = _place(sequence)
        return (priority, new, tenant.clock if new else 0.0, arrival)

    def popleft(self, group: int | None = None) -> Sequence:
        if (head := self._head(group)) is None:
            raise IndexError("pop from an empty queue")
        tenant, sequence = head
        _remove(tenant, sequence)
        if sequence.batched_at is None:  # charged once, when first admitted
            self._clock = tenant.clock
            tenant.clock += (sequence.num_prompt_tokens + sequence.max_new_tokens) / tenant.weight
        return sequence

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        for tenant in self._tenants.values():
            if any(s.cancelled for _, s in tenant.waiting):
                tenant.waiting = [entry for entry in tenant.waiting if not entry[1].cancelled]
                heapq.heapify(tenant.waiting)

    def ordered(self) -> list[Sequence]:
        """The waiting sequences by (priority, resumed first, arrival): the order admission would take them in
        with one key."""
        entries = [entry for t in self._tenants.values() for entry in t.waiting]
        return [s for _, s in sorted(entries, key=lambda entry: entry[0])]

    def by_priority(self, group: int | None = None) -> dict[int, int]:
        """How many sequences wait at each priority (those cancelled meanwhile are not counted)."""
        return dict(sorted(Counter(s.priority for s in self.sequences(group)).items()))

    def take_all(self) -> list[Sequence]:
        """Empties the line (the server is stopping): every waiting sequence, in order."""
        sequences = self.ordered()
        for tenant in self._tenants.values():
            tenant.waiting = []
        return sequences


class GroupQueue:
    """One shard group's view of the shared line: the sequences placed on it, in the line's own order, so that
    priorities and the keys' fair shares hold across every group (one clock per key, charged wherever it runs)."""

    def __init__(self, queue: Queue, group: int) -> None:
        self.queue, self.group = queue, group

    def __len__(self) -> int:
        return len(self.sequences())

    def append(self, sequence: Sequence) -> None:
        sequence.group = self.group
        self.queue.append(sequence)

    def appendleft(self, sequence: Sequence) -> None:
        sequence.group = self.group
        self.queue.appendleft(sequence)

    def peek(self) -> Sequence | None:
        return self.queue.peek(self.group)

    def popleft(self) -> Sequence:
        return self.queue.popleft(self.group)

    def sequences(self) -> list[Sequence]:
        return self.queue.sequences(self.group)

    def by_priority(self) -> dict[int, int]:
        return self.queue.by_priority(self.group)

    def take_all(self) -> list[Sequence]:
        """Takes every sequence placed on the group out of the line (the server is stopping), in order."""
        taken = []
        while self.peek() is not None:
            taken.append(self.popleft())
        return taken
