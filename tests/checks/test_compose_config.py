"""The Compose reader that stands in for `docker compose config` where no binary is installed
(tests/checks/compose_config.py) refuses what Compose refuses and normalizes as Compose does."""

from __future__ import annotations

from pathlib import Path

import compose_config
import pytest

GOOD = """
name: demo
x-base: &base
  image: app:latest
  stop_grace_period: 90s
services:
  web:
    <<: *base
    command: conveyor-launcher --port "3000"
    environment: [A=1, B]
    ports: ["127.0.0.1:3000:3000", "3001:3001/udp", 9000-9001]
    volumes: [data:/data, ./conf:/etc/conf:ro]
  extra:
    image: other
    profiles: [more]
    environment:
      TOKEN: ${TOKEN:-none}
      FLAG: true
volumes:
  data:
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "docker-compose.yml"
    path.write_text(text)
    return path


def test_the_reader_normalizes_as_compose_does(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    read = compose_config.read(path, [], {})
    assert set(read["services"]) == {"web"}
    web = read["services"]["web"]
    assert web["image"] == "app:latest" and web["stop_grace_period"] == "90s"
    assert web["command"] == ["conveyor-launcher", "--port", "3000"]
    assert web["environment"] == {"A": "1", "B": None}
    assert [(p.get("host_ip"), p["published"], p["target"], p["protocol"]) for p in web["ports"]] == [
        ("127.0.0.1", "3000", 3000, "tcp"),
        (None, "3001", 3001, "udp"),
        (None, None, 9000, "tcp"),
        (None, None, 9001, "tcp"),
    ]
    assert [(v["type"], v["source"], v["target"]) for v in web["volumes"]] == [
        ("volume", "data", "/data"),
        ("bind", str(tmp_path / "conf"), "/etc/conf"),
    ]
    extra = compose_config.read(path, ["more"], {"TOKEN": "t"})["services"]["extra"]
    assert extra["environment"] == {"TOKEN": "t", "FLAG": "true"}
    assert compose_config.read(path, ["more"], {"TOKEN": ""})["services"]["extra"]["environment"]["TOKEN"] == "none"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (("stop_grace_period: 90s", "stop_grace_perod: 90s"), "stop_grace_perod"),  # a key Compose does not know
        (("image: other", "image: other\n    restart: sometimes"), "restart"),  # a value it does not take
        (("${TOKEN:-none}", "${TOKEN:?set a token}"), "TOKEN"),  # a required variable unset
    ],
)
def test_the_reader_refuses_what_compose_refuses(tmp_path: Path, change: tuple[str, str], words: str) -> None:
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(compose_config.ComposeError, match=words):
        compose_config.read(path, ["more"], {})
