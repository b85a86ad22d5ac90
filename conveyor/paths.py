"""Where Conveyor keeps what it builds on a machine: the demo models, the C++ kernels, the benchmark's models.

One root for every process (the launcher builds the demo model there, each shard its kernels), set by
CONVEYOR_CACHE so that tests and CI can point all of them at one place.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """CONVEYOR_CACHE, or ~/.cache/conveyor."""
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
