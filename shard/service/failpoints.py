"""Failpoints for the fault tests, read from the shard's environment at import; unset, each costs one comparison
per step. With CONVEYOR_FAILPOINT_EXIT_ON_TOKEN=<token id>, a shard dies at once (as on a segfault) at any step
that reads a prompt containing that token: "the request that crashes the shard every time"
(tests/faults/test_crash_recovery.py). With CONVEYOR_FAILPOINT_HANG_ON_TOKEN=<token id>, the forward of any such
step never returns while the event loop goes on answering: "the stuck forward" (shard/service/watchdog.py,
tests/e2e/test_shard_service.py).
"""

from __future__ import annotations

import logging
import os
import threading

from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

EXIT_TOKEN = (
    int(os.environ["CONVEYOR_FAILPOINT_EXIT_ON_TOKEN"]) if "CONVEYOR_FAILPOINT_EXIT_ON_TOKEN" in os.environ else None
)
EXIT_CODE = 70
HANG_TOKEN = (
    int(os.environ["CONVEYOR_FAILPOINT_HANG_ON_TOKEN"]) if "CONVEYOR_FAILPOINT_HANG_ON_TOKEN" in os.environ else None
)


def _reads(token: int | None, new: pb.Batch | None) -> bool:
    return new is not None and token is not None and any(token in r.input_ids for r in new.requests)


def exit_if_asked(new: pb.Batch | None) -> None:
    """Exits the process at once if a new request's prompt holds the exit failpoint's token."""
    if _reads(EXIT_TOKEN, new):
        log.error("failpoint: exiting", extra={"token": EXIT_TOKEN})
        os._exit(EXIT_CODE)


def hangs(new: pb.Batch | None) -> bool:
    """Whether this step's forward must hang (call `hang` on the torch thread): the hang failpoint's token is in
    a new request's prompt."""
    return _reads(HANG_TOKEN, new)


def hang() -> None:
    """Blocks the calling thread for ever: the forward that never returns."""
    log.error("failpoint: the forward hangs", extra={"token": HANG_TOKEN})
    threading.Event().wait()
