"""The waiting line: the lowest (priority, arrival) first, so a preempted sequence, which keeps its arrival, goes
back ahead of everyone of its priority who came after it."""

from __future__ import annotations

import heapq

from conveyor.router.sequence import Sequence


class Queue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], Sequence]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def append(self, sequence: Sequence) -> None:
        heapq.heappush(self._heap, (sequence.order, sequence))

    def appendleft(self, sequence: Sequence) -> None:
        """A preempted or replayed sequence: its place is its own (priority, arrival), ahead of anyone of its
        priority still waiting, since it was admitted before them."""
        self.append(sequence)

    def peek(self) -> Sequence | None:
        self._drop_cancelled()
        return self._heap[0][1] if self._heap else None

    def popleft(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        if any(s.cancelled for _, s in self._heap):
            self._heap = [entry for entry in self._heap if not entry[1].cancelled]
            heapq.heapify(self._heap)

    def ordered(self) -> list[Sequence]:
        """The waiting sequences in the order they would be admitted."""
        return [s for _, s in sorted(self._heap, key=lambda entry: entry[0])]

    def take_all(self) -> list[Sequence]:
        """Empties the line (the server is stopping): every waiting sequence, in order."""
        sequences, self._heap = self.ordered(), []
        return sequences
