"""API keys: the file's format and its errors, who a header identifies, priorities and who may manage what."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.keys import ANONYMOUS, KeyFileError, KeyRing


def keys_file(tmp_path: Path, document: object) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(document))
    return str(path)


GOOD = {
    "keys": [
        {"name": "chat", "key": "chat-secret-1", "weight": 3, "max_concurrent": 8},
        {"name": "nightly", "key": "nightly-secret", "top_priority": 10},
        {"name": "ops", "key": "ops-secret-01", "admin": True},
    ]
}


def test_a_file_and_the_single_key_together(tmp_path: Path) -> None:
    ring = KeyRing.load(keys_file(tmp_path, GOOD), "single-secret")
    names = [k.name for k in ring.keys]
    assert names == ["chat", "nightly", "ops", "default"]
    chat = ring.identify("Bearer chat-secret-1")
    assert chat is not None and chat.weight == 3.0 and chat.max_concurrent == 8 and not chat.admin
    default = ring.identify("bearer single-secret")
    assert default is not None and default.admin
    assert ring.identify("Bearer nope") is None
    assert ring.identify("Basic chat-secret-1") is None
    assert ring.identify("") is None
    assert "chat-secret-1" not in repr(chat)  # logs and reprs never show the key itself
    # Header bytes that are not UTF-8 (aiohttp's surrogates for them) or a lone surrogate: no key, no error.
    invalid = b"Bearer chat-secret-1\xe9".decode("utf-8", "surrogateescape")
    assert ring.identify(invalid) is None and ring.identify("Bearer \ud800") is None


def test_an_open_server_lets_everyone_in_as_anonymous() -> None:
    assert KeyRing.load(None, None).identify("") is ANONYMOUS
    assert ANONYMOUS.admin


def test_top_priority_stops_a_key_promoting_itself(tmp_path: Path) -> None:
    ring = KeyRing.load(keys_file(tmp_path, GOOD), None)
    nightly, chat = ring.identify("Bearer nightly-secret"), ring.identify("Bearer chat-secret-1")
    assert nightly is not None and chat is not None
    assert nightly.priority(-5) == 10 and nightly.priority(20) == 20
    assert chat.priority(-5) == -5


def test_who_may_manage_whose_requests(tmp_path: Path) -> None:
    ring = KeyRing.load(keys_file(tmp_path, GOOD), None)
    chat, nightly, ops = (ring.identify(f"Bearer {k['key']}") for k in GOOD["keys"])
    assert chat is not None and nightly is not None and ops is not None
    assert chat.may_manage(chat) and not chat.may_manage(nightly)
    assert ops.may_manage(chat) and ops.may_manage(nightly)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "expected"),
        ({"keys": [{"name": "a", "key": "short"}]}, "at least 8"),
        ({"keys": [{"name": "bad name", "key": "long-enough"}]}, "name must be"),
        ({"keys": [{"name": "a", "key": "long-enough", "wieght": 2}]}, "unknown field"),
        ({"keys": [{"name": "a", "key": "long-enough", "weight": 0}]}, "weight"),
        ({"keys": [{"name": "a", "key": "long-enough", "max_concurrent": 0}]}, "max_concurrent"),
        ({"keys": [{"name": "a", "key": "long-enough", "admin": "yes"}]}, "admin"),
        ({"keys": [{"name": "a", "key": "long-enough"}, {"name": "a", "key": "other-secret"}]}, "same name"),
        ({"keys": [{"name": "a", "key": "long-enough"}, {"name": "b", "key": "long-enough"}]}, "same key"),
    ],
)
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, document: object, message: str) -> None:
    with pytest.raises(KeyFileError, match=message):
        KeyRing.load(keys_file(tmp_path, document), None)


def test_the_launcher_refuses_a_bad_file_before_starting_anything(tmp_path: Path) -> None:
    bad = keys_file(tmp_path, {"keys": [{"name": "a", "key": "short"}]})
    result = subprocess.run(
        [sys.executable, "-m", "conveyor.launcher.main", "--model-id", "/nonexistent", "--api-keys-file", bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "at least 8 characters" in result.stderr
