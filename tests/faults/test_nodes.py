"""One model across two nodes, as two hosts would run it: two launchers (`--nnodes 2`, one rank each) on
loopback TCP with different ports, node 0's router reaching rank 1 over TCP with the shared token. The greedy
oracle holds through it; losing node 1 whole (its launcher and its rank SIGKILLed, as when the host dies, then
started again) is a shard crash like any other: no request is lost, and every stream is exact. (A hung rank
across nodes, where the router restarts the group through the epoch store, was run here too and passed; it
costs a deployment's restart of CI time, and its parts are tested apart: the step deadline in test_crash_recovery,
the epoch moving once per failure in test_shard_channels.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import free_port, start_server, wait_for
from test_crash_recovery import MAX_BATCH, _serve_through

TOKEN = "two-node-test-token"


class Node1:
    """Node 1's launcher, which can be lost whole and started again with the same flags."""

    def __init__(self, model_dir: Path, flags: list[str]) -> None:
        self.command = [sys.executable, "-m", "conveyor.launcher.main", "--model-id", str(model_dir), *flags]
        self.env = dict(os.environ, CONVEYOR_SHARD_TOKEN=TOKEN, CONVEYOR_LOG_LEVEL="WARNING")
        self.process = self.start()

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command, env=self.env)

    def shard_pid(self) -> int:
        (shard,) = psutil.Process(self.process.pid).children()
        return shard.pid

    def lose(self) -> None:
        """SIGKILLs the launcher and its rank at once, as when the host goes away, and starts the node again."""
        launcher = psutil.Process(self.process.pid)
        for process in [launcher, *launcher.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.process.wait()
        self.process = self.start()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(90)


def test_two_nodes_serve_exactly_and_survive_losing_node_1(tiny_model: Path) -> None:
    master_port, port_0, port_1 = free_port(), free_port(), free_port()
    common = ["--nnodes", "2", "--master-port", str(master_port), "--max-batch-size", MAX_BATCH]
    node_1 = Node1(tiny_model, [*common, "--node-rank", "1", "--listen", f"tcp://127.0.0.1:{port_1}"])
    try:
        node_0 = start_server(
            tiny_model,
            *common,
            *("--node-rank", "0", "--listen", f"tcp://127.0.0.1:{port_0}"),
            env={"CONVEYOR_SHARD_TOKEN": TOKEN},
        )
        try:
            info = node_0.info()
            assert info["num_shard"] == 2
            wait_for(lambda: len(psutil.Process(node_1.process.pid).children()) == 1, 60, "node 1's rank")
            _serve_through(node_0, node_1.lose, restarts=1)
            assert node_1.stop() == 0
        finally:
            assert node_0.stop() == 0
    finally:
        if node_1.process.poll() is None:
            node_1.process.kill()
