"""The scheduling policies, one per `--scheduling` value (conveyor/config.py's SCHEDULING lists the same names).

Another policy is one module with a `SchedulingPolicy` subclass and one line in `POLICIES`.
"""

from __future__ import annotations

from conveyor.router.core.policies.base import SchedulingPolicy
from conveyor.router.core.policies.continuous import Continuous
from conveyor.router.core.policies.sequential import Sequential
from conveyor.router.core.policies.static import Static

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "continuous": Continuous,
    "static": Static,
    "sequential": Sequential,
}


def policy_for(name: str, max_batch_size: int | None = None, batch_timeout: float = 1.0) -> SchedulingPolicy:
    """The policy `--scheduling name` asks for, with the deployment's batch limits."""
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling {name!r}: one of {', '.join(POLICIES)}") from None
    return policy(max_batch_size, batch_timeout)
