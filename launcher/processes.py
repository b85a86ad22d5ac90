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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from conveyor.config import Config
from conveyor.lifeline import launcher_env
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # imported when needed: it imports torch, which a single-node launcher never needs
    from conveyor.group_store import GroupStore
from conveyor.shard_channels import RankAddress, Security, parse_tcp, rank_address

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
SHARD_STOP_SECONDS = 10.0  # a shard's gRPC server lets RPCs in flight finish for 5 s; then it is killed


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
        self.ask_to_stop()
        self.wait_or_kill(time.monotonic() + timeout)

    def ask_to_stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        """Waits until `deadline` (a time.monotonic() value) for it to exit, then SIGKILLs it."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def stop_together(children: list[Child], timeout: float) -> None:
    """Asks every child to stop at once and gives them the same `timeout`: ranks stopped one after another add up
    (each waits for its gRPC server's grace), and a rank whose peer is already gone may wait for it in a
    collective."""
    for child in children:
        child.ask_to_stop()
    deadline = time.monotonic() + timeout
    for child in children:
        child.wait_or_kill(deadline)


class StartupTimeout(ChildDied):
    pass


class EpochMoved(RuntimeError):
    """Another node restarted the group while this one was starting its ranks: they must join the new epoch."""


def spawn(name: str, module: str, args: list[str], env: dict[str, str]) -> Child:
    # Own session: a terminal's Ctrl-C reaches the launcher only, which stops children in order. A launcher
    # that is SIGKILLed cannot: each child dies with it instead (conveyor/lifeline.py).
    process = subprocess.Popen([sys.executable, "-m", module, *args], env=launcher_env(env), start_new_session=True)
    return Child(name, process)


@dataclass
class ShardGroup:
    """One tensor-parallel group of this node's ranks: started, watched and restarted as one (a group cannot lose
    a rank). `config` is the group's own: its socket prefix, rendezvous port and TCP ports (`group_config`).
    With --nnodes > 1 the group spans the nodes and `store` holds its epoch (node 0's launcher hosts it)."""

    config: Config
    security: Security  # the deployment's: every group speaks with the same token and certificates
    index: int = 0
    shards: list[Child] = field(default_factory=list)
    store: GroupStore | None = None
    epoch: int = 0  # the group's epoch this node's ranks belong to, with several nodes
    restarts: deque[float] = field(default_factory=deque)  # when it was restarted, within --restart-window

    @property
    def num_shard(self) -> int:
        return self.config.num_shard

    @property
    def first_rank(self) -> int:
        return self.config.node_rank * self.config.num_shard

    @property
    def name(self) -> str:
        return f"group {self.index}"

    @property
    def addresses(self) -> list[RankAddress]:
        """This node's ranks' addresses, in local rank order."""
        return [rank_address(self.config, self.first_rank + i, i) for i in range(self.num_shard)]

    def start(self, deadline: float, wait: Callable[..., None], should_stop: Callable[[], bool]) -> None:
        """Starts this node's ranks. With several nodes, a node that starts (or comes back) while another node
        restarts the group can start its ranks in an epoch that is already over: they die meeting peers that are
        gone, or the epoch moves under them. Then they start again in the current epoch, until the deadline."""
        while True:
            try:
                return self.start_shards(deadline, wait, should_stop)
            except (EpochMoved, ChildDied) as exc:
                if self.store is None or isinstance(exc, StartupTimeout) or time.monotonic() > deadline:
                    raise
                log.warning("group start overtaken; starting again", extra={"cause": str(exc)})
                self.failure()  # a rank of this node died: move the epoch on, so that the others follow
                self.kill()
                self.epoch = self.store.epoch

    def start_shards(self, deadline: float, wait: Callable[..., None], should_stop: Callable[[], bool]) -> None:
        argv, world_size = self.config.to_argv(), self.config.nnodes * self.num_shard
        for local_rank in range(self.num_shard):
            rank = self.first_rank + local_rank
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(self.num_shard),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR=self.config.master_addr,
                MASTER_PORT=str(self.config.master_port),
                CONVEYOR_DEVICE_OFFSET=str(self.index * self.num_shard),  # each group its own GPUs
            )
            if self.store is not None:
                env["CONVEYOR_GROUP_EPOCH"] = str(self.epoch)
            label = f"shard {rank}" if self.index == 0 else f"shard {rank} of group {self.index}"
            self.shards.append(spawn(label, "conveyor.shard.main", argv, env))
        for shard, address in zip(self.shards, self.addresses):
            wait(self, shard, lambda url=address.url: shard_healthy(url, self.security), deadline, should_stop)

    def failure(self) -> str | None:
        """Why the group must restart, if it must: a rank of this node died (then, with several nodes, this node
        moves the epoch on so that the others follow), or another node (or the router) moved it."""
        dead = next((s for s in self.shards if s.process.poll() is not None), None)
        if self.store is None:
            return None if dead is None else f"{dead.name} exited with code {dead.process.returncode}"
        try:
            if dead is not None:
                self.store.restart(self.epoch)
                return f"{dead.name} exited with code {dead.process.returncode}"
            if (epoch := self.store.epoch) != self.epoch:
                return f"the group moved to epoch {epoch} (a rank of another node failed, or the router found it hung)"
        except RuntimeError as exc:  # torch's store client: node 0's launcher is gone
            raise ChildDied(
                f"lost node 0's group store at {self.config.master_addr}:{self.config.master_port}"
            ) from exc
        return None

    def restart(self, wait: Callable[..., None], should_stop: Callable[[], bool]) -> None:
        """Kills what is left of the group (its survivors may wait in a collective for ever) and starts it anew.
        With several nodes, a start that another node's restart overtakes, or that loses a rank while the nodes
        meet, is one more failure for `watch` to count."""
        self.kill()
        if self.store is not None:
            self.epoch = self.store.epoch
        try:
            self.start_shards(time.monotonic() + self.config.startup_timeout, wait, should_stop)
        except (EpochMoved, ChildDied) as exc:
            if self.store is None or isinstance(exc, StartupTimeout):
                raise
            log.warning("group restart interrupted", extra={"cause": str(exc)})
            return
        log.warning("shards restarted", extra={"group": self.index, "epoch": self.epoch})

    def kill(self) -> None:
        for shard in self.shards:
            shard.kill()
        self.shards = []
        self.remove_sockets()

    def remove_sockets(self) -> None:
        for address in self.addresses:
            if address.bind.startswith("unix://"):
                Path(address.bind.removeprefix("unix://")).unlink(missing_ok=True)


def group_config(config: Config, index: int) -> Config:
    """Group `index` of --replicas on this machine: the first keeps the deployment's sockets and ports; the others
    get their own socket prefix, rendezvous port (+index) and, on TCP, the ports after the first group's ranks."""
    if index == 0:
        return config
    listen = None
    if config.listen is not None:
        host, port = parse_tcp(config.listen)
        listen = f"tcp://{host}:{port + index * config.num_shard}"
    return replace(
        config,
        shard_uds_path=f"{config.shard_uds_path}-g{index}",
        master_port=config.master_port + index,
        listen=listen,
    )


@dataclass
class Deployment:
    """Every process gets the same `config` (model directory and socket prefix already decided), each shard group
    its own variant of it (`group_config`). With --nnodes > 1 this launcher runs one node's ranks (node 0's also
    runs the router and hosts the group's epoch store)."""

    config: Config
    groups: list[ShardGroup] = field(init=False)
    router: Child | None = None

    def __post_init__(self) -> None:
        security = Security.from_config(self.config)  # read once: a restart reads no certificate file again
        self.groups = [ShardGroup(group_config(self.config, i), security, i) for i in range(self.config.replicas)]

    @property
    def shards(self) -> list[Child]:
        return [shard for group in self.groups for shard in group.shards]

    @property
    def addresses(self) -> list[RankAddress]:
        """This node's ranks' addresses, group after group."""
        return [address for group in self.groups for address in group.addresses]

    @property
    def router_url(self) -> str:
        return f"http://{self.config.hostname}:{self.config.port}"

    def router_config(self) -> Config:
        """The router's flags: the first group as --shard-address, the others (then any given) as --shard-groups."""
        others = [group.addresses[0].url for group in self.groups[1:]]
        groups = ";".join(others + self.config.other_groups) or None
        return replace(self.config, shard_address=self.groups[0].addresses[0].url, shard_groups=groups)

    def start(self, timeout: float, should_stop: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        if self.config.nnodes > 1:
            from conveyor.group_store import GroupStore

            group = self.groups[0]  # several nodes: one group (check_nodes refuses --replicas with --nnodes)
            group.store = GroupStore(
                self.config.master_addr, self.config.master_port, self.config.node_rank == 0, timeout
            )
            group.epoch = group.store.epoch
        # On one node the router starts beside the shards: its imports and tokenizer load overlap theirs, and it
        # connects (retrying until --startup-timeout) once they answer. Across nodes it waits for node 0's ranks,
        # whose start may be overtaken by a new epoch (ShardGroup.start).
        early = self.config.nnodes == 1
        if early:
            self._spawn_router()
        for group in self.groups:
            group.start(deadline, self._wait, should_stop)
        if self.config.node_rank == 0:
            if not early:
                self._spawn_router()
            self._wait(None, self.router, lambda: _http_ok(f"{self.router_url}/health"), deadline, should_stop)

    def _spawn_router(self) -> None:
        self.router = spawn("router", "conveyor.router.main", self.router_config().to_argv(), dict(os.environ))

    def _wait(
        self,
        group: ShardGroup | None,
        child: Child,
        ready: Callable[[], bool],
        deadline: float,
        should_stop: Callable[[], bool],
    ) -> None:
        """Polls until `ready`, failing fast if the child, another of its group or the router dies, if another node
        restarts the group, and clearly if the deadline passes."""
        watched = self.children if group is None else [*group.shards, *([self.router] if self.router else [])]
        while not should_stop():
            for other in watched:
                other.check()
            if group is not None and group.store is not None and group.store.epoch != group.epoch:
                raise EpochMoved(f"the group moved to epoch {group.store.epoch} while {child.name} started")
            if ready():
                return
            if time.monotonic() > deadline:
                raise StartupTimeout(f"{child.name} was not ready within the startup timeout")
            time.sleep(POLL_SECONDS)

    @property
    def children(self) -> list[Child]:
        return [*self.shards, *([self.router] if self.router else [])]

    def watch(self, should_stop: Callable[[], bool]) -> None:
        """Returns when asked to stop. A shard that exits on its own takes its group down with it (a
        tensor-parallel group cannot lose one rank), and the group is started again: the router notices the
        failed step, replays its requests (on another group, if there are others) and reconnects. With several
        nodes the group restarts on every node together (conveyor/group_store.py). Raises ChildDied when the
        router exits, when a restart fails, or when a group died more than --max-restarts times within
        --restart-window seconds."""
        while not should_stop():
            if self.router is not None:
                self.router.check()
            for group in self.groups:
                failure = group.failure()
                if failure is not None:
                    self._count_restart(group, failure)
                    log.warning("restarting the shards", extra={"group": group.index, "cause": failure})
                    group.restart(self._wait, should_stop)
            time.sleep(POLL_SECONDS)

    def _count_restart(self, group: ShardGroup, failure: str) -> None:
        now, restarts = time.monotonic(), group.restarts
        while restarts and now - restarts[0] > self.config.restart_window:
            restarts.popleft()
        if len(restarts) >= self.config.max_restarts:
            raise ChildDied(
                f"{failure}, after {len(restarts)} restarts within {self.config.restart_window:g}s "
                f"(--max-restarts {self.config.max_restarts})"
            )
        restarts.append(now)

    def stop(self, timeout: float) -> None:
        if self.router is not None:
            self.router.terminate(timeout)
        stop_together(self.shards, SHARD_STOP_SECONDS)
        for group in self.groups:
            group.remove_sockets()


def shard_healthy(url: str, security: Security) -> bool:
    """True once the shard at this address answers Health (which it serves only once loaded and grouped)."""
    if url.startswith("unix://") and not os.path.exists(url.removeprefix("unix://")):
        return False
    try:
        with security.channel(url) as channel:
            pb_grpc.ShardStub(channel).Health(pb.HealthRequest(), timeout=2.0, metadata=security.metadata())
        return True
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
