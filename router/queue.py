"""The waiting line: sequences in arrival order, a preempted one back at the front."""

from __future__ import annotations

from collections import deque

from conveyor.router.sequence import Sequence


class Queue:
    def __init__(self) -> None:
        self._sequences: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._sequences)

    def append(self, sequence: Sequence) -> None:
        self._sequences.append(sequence)

    def appendleft(self, sequence: Sequence) -> None:
        """A preempted sequence goes back to the front: it was admitted before anyone still waiting."""
        self._sequences.appendleft(sequence)

    def peek(self) -> Sequence | None:
        self._drop_cancelled()
        return self._sequences[0] if self._sequences else None

    def popleft(self) -> Sequence:
        return self._sequences.popleft()

    def _drop_cancelled(self) -> None:
        """Requests whose client left while waiting never reach a shard."""
        if any(s.cancelled for s in self._sequences):
            self._sequences = deque(s for s in self._sequences if not s.cancelled)

    def take_all(self) -> list[Sequence]:
        """Empties the line (the server is stopping): every waiting sequence, in order."""
        sequences, self._sequences = list(self._sequences), deque()
        return sequences
