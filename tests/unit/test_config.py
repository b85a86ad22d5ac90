"""One configuration, one parser: what the launcher hands its shards and router parses back to the same config."""

from __future__ import annotations

from dataclasses import fields, replace

from conveyor import config
from conveyor.config import Config
from conveyor.launcher.processes import Deployment
from conveyor.router.core.placement import PLACEMENTS
from conveyor.router.transport.connect import group_addresses


def test_every_flag_survives_the_hand_over() -> None:
    argv = [
        "--model-id",
        "/models/m",
        "--num-shard",
        "2",
        "--dtype",
        "bfloat16",
        "--port",
        "3100",
        "--grpc-port",
        "3101",
        "--max-batch-size",
        "8",
        "--scheduling",
        "static",
        "--static-batch-timeout",
        "0.5",
        "--no-prefix-caching",
        "--prefill-chunk-tokens",
        "32",
        "--shard-uds-path",
        "/tmp/x",
        "--max-total-tokens",
        "512",
        "--log-level",
        "INFO",
    ]
    parsed = config.parse(argv)
    assert parsed.num_shard == 2 and parsed.prefix_caching is False and parsed.static_batch_timeout == 0.5
    assert config.parse(parsed.to_argv()) == parsed


def test_the_api_key_never_reaches_a_command_line(monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    parsed = config.parse(["--api-key", "secret"])
    assert "secret" not in parsed.to_argv() and "--api-key" not in parsed.to_argv()
    monkeypatch.setenv("CONVEYOR_API_KEY", "secret")  # how the launcher hands it to the router
    assert config.parse(parsed.to_argv()).api_key == "secret"


def test_defaults_are_left_off_and_every_field_is_a_flag() -> None:
    assert Config().to_argv() == []
    help_text = config.parser("x").format_help()
    for f in fields(Config):
        assert "--" + f.name.replace("_", "-") in help_text
    assert replace(Config(), prefix_caching=False).to_argv() == ["--no-prefix-caching"]


def test_each_replica_gets_its_own_sockets_and_ports_and_the_router_reaches_every_group() -> None:
    deployment = Deployment(Config(shard_uds_path="/run/c/shard", replicas=3))
    assert [(g.config.shard_uds_path, g.config.master_port) for g in deployment.groups] == [
        ("/run/c/shard", 29500),
        ("/run/c/shard-g1", 29501),
        ("/run/c/shard-g2", 29502),
    ]
    router = deployment.router_config()
    assert group_addresses(router) == ["unix:///run/c/shard-0", "unix:///run/c/shard-g1-0", "unix:///run/c/shard-g2-0"]
    # On TCP, a group's ranks take the ports after the group before it; groups on other machines come last.
    tcp = Config(listen="tcp://127.0.0.1:7000", num_shard=2, replicas=2, shard_groups="tcp://far:9000", shard_token="t")
    deployment = Deployment(tcp)
    assert [a.url for a in deployment.addresses] == [f"tcp://127.0.0.1:{p}" for p in (7000, 7001, 7002, 7003)]
    assert group_addresses(deployment.router_config()) == [
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.1:7002",
        "tcp://far:9000",
    ]


def test_the_placement_flag_offers_every_placement() -> None:
    assert tuple(PLACEMENTS) == config.PLACEMENTS
