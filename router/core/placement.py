"""Which shard group a request joins, when the router drives several (`--replicas`): the one that has the longest
part of its prompt cached, unless that group is busier than the least busy one by more than a bound.

The router owns every group's block pool and prefix cache, so it knows where each prefix lives rather than guessing
it from a hash of the prompt: a conversation's next turn, or a question behind a long shared system prompt, goes to
the group that already holds its KV and reads only the rest. Load still wins past the bound, so one hot prefix
cannot queue a group while another idles. A placement sees each group as a `GroupView`; it neither holds blocks nor
counts queries, so asking is free and changes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupView:
    """One group as a placement sees it, for one request."""

    index: int
    cached_blocks: int  # full blocks of the request's prompt this group has cached in the request's scope
    load: int  # tokens the group has to compute for what it runs and holds queued: its work ahead
    serving: bool = True  # False while the group is down, restarting or draining: nothing is placed there


@dataclass(frozen=True)
class Placed:
    """The choice and why, for the log and the counters (`conveyor_placements_total{group, reason}`)."""

    group: int
    reason: str  # prefix | load | round_robin | moved (Groups.move_waiting)


class Placement(ABC):
    name: str  # its --placement value

    @abstractmethod
    def choose(self, groups: list[GroupView]) -> Placed:
        """The group among the serving ones; raises NoGroup when none serves."""


class NoGroup(RuntimeError):
    """Every group is down or draining: the request waits in the queue until one serves again."""


def _serving(groups: list[GroupView]) -> list[GroupView]:
    serving = [g for g in groups if g.serving]
    if not serving:
        raise NoGroup("no shard group is serving")
    return serving


class CacheAware(Placement):
    """The longest cached prefix, unless its group's load exceeds the least loaded group's by more than
    `max_extra_load` tokens; then the least loaded (ties: the most cached, then the lowest index)."""

    name = "cache-aware"

    def __init__(self, max_extra_load: int) -> None:
        self.max_extra_load = max_extra_load

    def choose(self, groups: list[GroupView]) -> Placed:
        serving = _serving(groups)
        lightest = min(serving, key=lambda g: (g.load, -g.cached_blocks, g.index))
        best = max(serving, key=lambda g: (g.cached_blocks, -g.load, -g.index))
        if best.cached_blocks and best.load - lightest.load <= self.max_extra_load:
            return Placed(best.index, "prefix")
        return Placed(lightest.index, "load")


class RoundRobin(Placement):
    """Each request to the next serving group in turn: the blind spreading a Service in front of replicas does,
    kept as the baseline the benchmark compares against."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, groups: list[GroupView]) -> Placed:
        serving = _serving(groups)
        chosen = serving[self._next % len(serving)]
        self._next += 1
        return Placed(chosen.index, "round_robin")


PLACEMENTS = {p.name: p for p in (CacheAware, RoundRobin)}  # --placement


def placement_for(name: str, max_extra_load: int) -> Placement:
    return CacheAware(max_extra_load) if name == "cache-aware" else PLACEMENTS[name]()
