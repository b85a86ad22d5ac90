"""The child processes of one deployment: start in order, wait until ready, watch, stop in order."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

from conveyor.config import Config

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1


class ChildDied(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen

    def check(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise ChildDied(f"{self.name} exited with code {code}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def terminate(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Deployment:
    """Every process gets the same `config` (model directory and socket prefix already decided)."""

    config: Config
    shards: list[Child] = field(default_factory=list)
    router: Child | None = None

    @property
    def uds_path(self) -> str:
        return self.config.shard_uds_path

    @property
    def router_url(self) -> str:
        return f"http://{self.config.hostname}:{self.config.port}"

    def _spawn(self, name: str, module: str, args: list[str], env: dict[str, str]) -> Child:
        # Own session: a terminal's Ctrl-C reaches the launcher only, which stops children in order.
        process = subprocess.Popen([sys.executable, "-m", module, *args], env=env, start_new_session=True)
        return Child(name, process)

    def start(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        self._start_shards(deadline, should_stop)
        self.router = self._spawn("router", "conveyor.router.main", self.config.to_argv(), dict(os.environ))
        self._wait(self.router, lambda: _http_ok(f"{self.router_url}/health"), deadline, should_stop)

    def _start_shards(self, deadline: float, should_stop: Callable[[], bool]) -> None:
        argv, num_shard = self.config.to_argv(), self.config.num_shard
        for rank in range(num_shard):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(num_shard),
                MASTER_ADDR=self.config.master_addr,
                MASTER_PORT=str(self.config.master_port),
            )
            self.shards.append(self._spawn(f"shard {rank}", "conveyor.shard.main", argv, env))
        for rank, shard in enumerate(self.shards):
            self._wait(shard, lambda r=rank: shard_healthy(f"{self.uds_path}-{r}"), deadline, should_stop)

    def _wait(self, child: Child, ready: Callable[[], bool], deadline: float, should_stop) -> None:
        """Polls until `ready`, failing fast if the child dies and clearly if the deadline passes."""
        while not should_stop():
            self._check_all()
            if ready():
                return
            if time.monotonic() > deadline:
                raise ChildDied(f"{child.name} was not ready within the startup timeout")
            time.sleep(POLL_SECONDS)

    def _check_all(self) -> None:
        for child in self.children:
            child.check()

    @property
    def children(self) -> list[Child]:
        return [*self.shards, *([self.router] if self.router else [])]

    def watch(self, should_stop: Callable[[], bool]) -> None:
        """Returns when asked to stop. A shard that exits on its own takes its group down with it (a
        tensor-parallel group cannot lose one rank), and the group is started again: the router notices the
        failed step, replays its requests and reconnects. Raises ChildDied when the router exits, when a restart
        fails, or when the group died more than --max-restarts times within --restart-window seconds."""
        restarts: deque[float] = deque()
        while not should_stop():
            self.router.check()
            dead = next((s for s in self.shards if s.process.poll() is not None), None)
            if dead is not None:
                now = time.monotonic()
                while restarts and now - restarts[0] > self.config.restart_window:
                    restarts.popleft()
                if len(restarts) >= self.config.max_restarts:
                    raise ChildDied(
                        f"{dead.name} exited with code {dead.process.returncode}, after {len(restarts)} restarts "
                        f"within {self.config.restart_window:g}s (--max-restarts {self.config.max_restarts})"
                    )
                restarts.append(now)
                log.warning("restarting the shards", extra={"exited": dead.name, "code": dead.process.returncode})
                self._restart_shards(should_stop)
                continue
            time.sleep(POLL_SECONDS)

    def _restart_shards(self, should_stop: Callable[[], bool]) -> None:
        """Kills what is left of the group (its survivors may wait in a collective for ever) and starts it anew."""
        for shard in self.shards:
            shard.kill()
        self.shards = []
        self._remove_sockets()
        self._start_shards(time.monotonic() + self.config.startup_timeout, should_stop)
        log.warning("shards restarted")

    def stop(self, timeout: float) -> None:
        if self.router is not None:
            self.router.terminate(timeout)
        for shard in self.shards:
            shard.terminate(10.0)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        for rank in range(self.config.num_shard):
            Path(f"{self.uds_path}-{rank}").unlink(missing_ok=True)


def shard_healthy(socket_path: str) -> bool:
    """True once the shard at this socket answers Health."""
    if not os.path.exists(socket_path):
        return False
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            pb_grpc.ShardStub(channel).Health(pb.HealthRequest(), timeout=2.0)
        return True
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
