"""TGI's launcher flags and environment variables read as Conveyor's (launcher/tgi_flags.py)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from conveyor import config
from conveyor.launcher.tgi_flags import SAME, TgiFlagError, translate


def test_every_shared_name_is_a_conveyor_flag() -> None:
    names = {f.name for f in fields(config.Config)}
    assert set(SAME) <= names


def test_environment_alone_configures_the_launcher() -> None:
    env = {"MODEL_ID": "/m", "PORT": "80", "NUM_SHARD": "2", "MAX_INPUT_TOKENS": "100", "MAX_TOTAL_TOKENS": "200"}
    argv, extra = translate([], env)
    parsed = config.parse(argv)
    assert (parsed.model_id, parsed.port, parsed.num_shard) == ("/m", 80, 2)
    assert (parsed.max_input_tokens, parsed.max_total_tokens) == (100, 200)
    assert extra == {}


def test_a_flag_beats_its_environment_variable() -> None:
    argv, _ = translate(["--port", "8080", "--max-input-length=50"], {"PORT": "80", "MAX_INPUT_TOKENS": "9"})
    parsed = config.parse(argv)
    assert (parsed.port, parsed.max_input_tokens) == (8080, 50)


def test_old_names_and_the_hub_cache() -> None:
    argv, extra = translate(["--huggingface-hub-cache", "/data"], {"MAX_INPUT_LENGTH": "7"})
    assert config.parse(argv).max_input_tokens == 7
    assert extra == {"HF_HUB_CACHE": "/data"}
    assert translate([], {"HUGGINGFACE_HUB_CACHE": "/data"})[1] == {"HF_HUB_CACHE": "/data"}


def test_hostname_and_env_of_a_container_are_not_read() -> None:
    assert translate([], {"HOSTNAME": "c0ffee", "ENV": "/etc/shrc"}) == ([], {})


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--max-best-of", "2"], {}, "--max-best-of"),
        (["--trust-remote-code"], {}, "--trust-remote-code"),
        ([], {"CORS_ALLOW_ORIGIN": "*"}, "CORS_ALLOW_ORIGIN"),
        (["--quantize", "awq"], {}, "awq"),
        ([], {"QUANTIZE": "gptq"}, "gptq"),
        (["--kv-cache-dtype=fp8"], {}, "fp8"),
    ],
)
def test_what_conveyor_cannot_honour_is_refused_by_name(argv: list[str], env: dict[str, str], named: str) -> None:
    with pytest.raises(TgiFlagError) as refused:
        translate(argv, env)
    line = str(refused.value.code)
    assert named in line and "\n" not in line
