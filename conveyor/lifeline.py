"""The launcher's children die with it, even when it is SIGKILLed and cannot stop them.

Each child runs in a session of its own (a terminal's Ctrl-C reaches only the launcher, which stops them in
order), so nothing else would end them: an orphaned shard keeps its memory and its socket, an orphaned router its
port. The launcher names itself in CONVEYOR_LAUNCHER_PID; a child that finds it asks the kernel for a signal when
its parent dies (Linux's PR_SET_PDEATHSIG), and elsewhere watches its parent from a thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

log = logging.getLogger(__name__)

LAUNCHER_PID = "CONVEYOR_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
WATCH_SECONDS = 1.0  # how often a child without prctl looks at its parent


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child of this process, which must die with it."""
    return {**env, LAUNCHER_PID: str(os.getpid())}


def die_with_launcher(sig: signal.Signals = signal.SIGKILL) -> None:
    """Called first thing by a child: `sig` reaches it when the launcher that started it dies. The variable is
    taken out of the environment, so that the child's own children do not compare themselves to the launcher."""
    parent = os.environ.pop(LAUNCHER_PID, None)
    if parent is None:
        return  # started by hand or by another supervisor: its lifetime is theirs to decide
    if not _pdeathsig(sig):
        threading.Thread(target=_watch, args=(int(parent), sig), name="lifeline", daemon=True).start()
    if os.getppid() != int(parent):  # the launcher died before the request above was made
        os.kill(os.getpid(), sig)


def _pdeathsig(sig: signal.Signals) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed", extra={"errno": ctypes.get_errno()})
        return False
    return True


def _watch(parent: int, sig: signal.Signals) -> None:
    while os.getppid() == parent:
        threading.Event().wait(WATCH_SECONDS)
    os.kill(os.getpid(), sig)


def end_cleanly() -> NoReturn:
    """Ends a child that has stopped cleanly without the interpreter's teardown, whose last garbage collection over
    torch's and transformers' objects took 0.5-0.8 s of CPU in every router and shard: a stop (a restart, a scale
    down, each test's deployment) waited for it twice, the shards only being asked once the router is gone. Nothing
    is left to run then but the logs, which are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
