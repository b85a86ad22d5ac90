"""The launcher's children, without a model: they die with a launcher that is SIGKILLed (conveyor/lifeline.py),
and they are stopped together (launcher/processes.py). Real processes, synchronised on files and pids, never on
sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from conveyor import lifeline
from conveyor.launcher.processes import Child, stop_together

# A child that dies with its launcher, then reports that it is ready and waits for ever.
CHILD = """
import sys, threading
from conveyor import lifeline
if {no_prctl}:
    lifeline._pdeathsig = lambda sig: False  # the thread that watches the parent, as off Linux
lifeline.die_with_launcher()
open(sys.argv[1], "w").close()
threading.Event().wait()
"""

# A launcher stand-in: starts the child with the launcher's environment, names its pid, waits for ever.
LAUNCHER = """
import os, subprocess, sys, threading
from conveyor.lifeline import launcher_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=launcher_env(dict(os.environ)),
                         start_new_session=True)
print(child.pid, flush=True)
threading.Event().wait()
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("no_prctl", [False, True], ids=["pdeathsig", "watch-thread"])
def test_a_child_dies_with_its_sigkilled_launcher(tmp_path: Path, no_prctl: bool) -> None:
    ready = tmp_path / "ready"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD.format(no_prctl=no_prctl), str(ready)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(launcher.stdout.readline())
        wait_for(ready.exists, 60, "the child to start")
        assert alive(child)
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(child), 30, "the child to die with its launcher")
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def test_a_child_whose_launcher_died_before_it_started_ends_at_once(tmp_path: Path) -> None:
    """The launcher may die before the child asks for the signal: the child finds another parent and ends."""
    env = dict(os.environ, **{lifeline.LAUNCHER_PID: str(os.getpid() + 1)})  # not the child's parent: this is
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(no_prctl=False), str(tmp_path / "ready")], env=env, timeout=60
    )
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "ready").exists()


def test_a_child_started_by_hand_is_left_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != lifeline.LAUNCHER_PID}
    script = "from conveyor import lifeline; lifeline.die_with_launcher(); print('alive')"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "alive")


# A rank that, asked to stop, exits only once its peer has been asked too (as a rank may wait for a peer in a
# collective): it marks its own SIGTERM, then waits for the peer's mark. Stopped one after the other, the first
# would wait until it is killed.
RANK = """
import os, signal, sys, threading
me, peer = sys.argv[1], sys.argv[2]
def on_term(*_):
    open(me, "w").close()
    while not os.path.exists(peer):
        threading.Event().wait(0.01)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(me + ".ready", "w").close()
threading.Event().wait()
"""


def test_ranks_are_asked_to_stop_together(tmp_path: Path) -> None:
    marks = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    children = [
        Child(f"rank {i}", subprocess.Popen([sys.executable, "-c", RANK, marks[i], marks[1 - i]])) for i in range(2)
    ]
    try:
        wait_for(lambda: all(os.path.exists(m + ".ready") for m in marks), 60, "both ranks to start")
        stop_together(children, timeout=60)
        assert [c.process.returncode for c in children] == [0, 0]  # neither needed the SIGKILL
    finally:
        for child in children:
            child.kill()


IGNORES_SIGTERM = """
import signal, sys, threading
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").close()
threading.Event().wait()
"""


def test_a_rank_that_ignores_sigterm_is_killed_at_the_deadline(tmp_path: Path) -> None:
    script = IGNORES_SIGTERM
    ready = tmp_path / "ready"
    child = Child("rank 0", subprocess.Popen([sys.executable, "-c", script, str(ready)]))
    wait_for(ready.exists, 60, "the rank to start")
    stop_together([child], timeout=0.5)
    assert child.process.returncode == -signal.SIGKILL
