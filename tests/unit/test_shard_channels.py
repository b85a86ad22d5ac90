"""Shard addresses, the launcher's checks of the several-node flags, and the group's epoch store, without processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import free_port

from conveyor.config import Config
from conveyor.group_store import GroupStore
from conveyor.launcher.main import check_nodes
from conveyor.shard_channels import AddressError, parse_tcp, rank_address, target


def test_tcp_urls_parse_and_default_to_loopback() -> None:
    assert parse_tcp("tcp://10.0.0.5:5000") == ("10.0.0.5", 5000)
    assert parse_tcp("tcp://:5000") == ("127.0.0.1", 5000)
    assert target("tcp://[::1]:5000") == "[::1]:5000"
    assert target("unix:///tmp/s-0") == "unix:///tmp/s-0" and target("/tmp/s-0") == "unix:///tmp/s-0"
    for bad in ("10.0.0.5:5000", "tcp://host", "http://host:5000", "tcp://host:5000/path", "tcp://host:port"):
        with pytest.raises(AddressError):
            parse_tcp(bad)


def test_each_local_rank_listens_on_its_own_port_and_is_reached_at_the_advertised_host() -> None:
    config = Config(listen="tcp://0.0.0.0:5000", advertise_host="node-3.example", num_shard=2, node_rank=3)
    assert rank_address(config, 7, 1).bind == "0.0.0.0:5001"
    assert rank_address(config, 7, 1).url == "tcp://node-3.example:5001"
    assert rank_address(replace(config, advertise_host=None), 6, 0).url == "tcp://127.0.0.1:5000"  # wildcard
    assert rank_address(Config(shard_uds_path="/run/c/shard"), 1, 1).url == "unix:///run/c/shard-1"


def test_the_launcher_refuses_several_nodes_it_could_not_wire() -> None:
    with pytest.raises(SystemExit, match="--listen"):
        check_nodes(Config(nnodes=2))
    with pytest.raises(SystemExit, match="CONVEYOR_SHARD_TOKEN"):
        check_nodes(Config(nnodes=2, listen="tcp://10.0.0.5:5000"))
    with pytest.raises(SystemExit, match="--advertise-host"):
        check_nodes(Config(nnodes=2, listen="tcp://0.0.0.0:5000", shard_token="t"))
    with pytest.raises(SystemExit, match="--node-rank"):
        check_nodes(Config(nnodes=2, node_rank=2, listen="tcp://0.0.0.0:5000", shard_token="t"))
    with pytest.raises(SystemExit, match="tcp://HOST:PORT"):
        check_nodes(Config(listen="0.0.0.0:5000"))
    with pytest.raises(SystemExit, match="go together"):
        check_nodes(Config(listen="tcp://:5000", shard_tls_cert="cert.pem"))


def test_a_single_node_on_tcp_makes_up_its_token_and_several_keep_theirs() -> None:
    made_up = check_nodes(Config(listen="tcp://127.0.0.1:5000")).shard_token
    assert made_up and len(made_up) >= 32 and made_up != check_nodes(Config(listen="tcp://:5000")).shard_token
    given = Config(nnodes=2, listen="tcp://10.0.0.5:5000", shard_token="shared")
    assert check_nodes(given).shard_token == "shared"
    assert check_nodes(Config()).shard_token is None  # unix sockets in a private directory need none


def test_a_failure_seen_by_two_nodes_moves_the_epoch_once() -> None:
    port = free_port()
    host = GroupStore("127.0.0.1", port, host_it=True, timeout=30)
    node_1 = GroupStore("127.0.0.1", port, host_it=False, timeout=30)
    assert host.epoch == node_1.epoch == 0
    assert node_1.restart(0) == 1
    assert host.restart(0) == 1  # it saw the same failure of epoch 0: the group restarts once
    assert host.restart() == 2  # the router, finding epoch 1 hung
    assert node_1.epoch == 2
