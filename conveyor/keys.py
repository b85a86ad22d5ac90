"""Who is calling: the API keys a shared server knows, each with a name, a weight and its limits.

`--api-keys-file` lists the keys (JSON, below); `--api-key` is one more key, named "default", with admin rights.
A server with neither is open: every caller is "anonymous" and may do everything. Metrics, logs and the dashboard
name a key by its `name`, never by the key itself.

    {"keys": [
      {"name": "chat", "key": "sk-chat-...", "weight": 3, "max_concurrent": 32},
      {"name": "nightly", "key": "sk-batch-...", "weight": 1, "max_concurrent": 8, "top_priority": 10},
      {"name": "ops", "key": "sk-ops-...", "admin": true}
    ]}
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor import log as conveyor_log

NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a Prometheus label value and a log field that needs no escaping


@dataclass(frozen=True)
class ApiKey:
    name: str
    secret: str | None = field(default=None, repr=False)  # None: the anonymous caller of an open server
    # Its share of admission when several keys have work waiting (router/core/queue.py).
    weight: float = 1.0
    max_concurrent: int | None = None  # requests queued or running at once; more are refused with 429
    # The most urgent priority (the lowest value) its requests get: one asking for more is served at this one,
    # so that a client cannot promote itself over others.
    top_priority: int | None = None
    admin: bool = False  # may cancel and see every key's requests

    def priority(self, asked: int) -> int:
        return asked if self.top_priority is None else max(asked, self.top_priority)

    def may_manage(self, owner: ApiKey) -> bool:
        """Whether this caller may see and cancel a request made with `owner`."""
        return self.admin or owner.name == self.name


ANONYMOUS = ApiKey("anonymous", admin=True)


class KeyFileError(ValueError):
    pass


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[ApiKey, ...] = ()

    @property
    def open(self) -> bool:
        return not self.keys

    def identify(self, authorization: str) -> ApiKey | None:
        """The key an `Authorization` value (HTTP header or gRPC metadata) carries as `Bearer <key>`; None if it is
        no known key. Every key is compared, in constant time, so the answer's timing does not tell which key a
        guess came close to."""
        if self.open:
            return ANONYMOUS
        scheme, _, given = authorization.partition(" ")
        try:
            # aiohttp hands a header's bytes that are not UTF-8 over as lone surrogates: back to those bytes, which
            # match no key (a key is text), rather than an encoding error and a 500 for a header anyone can send.
            given_bytes = given.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return None
        found = None
        for key in self.keys:
            assert key.secret is not None
            if hmac.compare_digest(given_bytes, key.secret.encode()):
                found = key
        return found if scheme.lower() == "bearer" else None

    @classmethod
    def load(cls, keys_file: str | None, api_key: str | None) -> KeyRing:
        keys = [_key(entry, where) for where, entry in _entries(keys_file)] if keys_file else []
        if api_key:
            keys.append(ApiKey("default", api_key, admin=True))
        for attribute in ("name", "secret"):
            values = [getattr(k, attribute) for k in keys]
            if len(set(values)) != len(values):
                raise KeyFileError(f"two API keys have the same {'key' if attribute == 'secret' else 'name'}")
        return cls(tuple(keys))


def load_keys(keys_file: str | None, api_key: str | None) -> KeyRing:
    """The API keys of --api-keys-file and --api-key; a bad file stops the start, saying what is wrong in it."""
    try:
        ring = KeyRing.load(keys_file, api_key)
    except KeyFileError as exc:
        raise SystemExit(f"conveyor: {exc}") from None
    conveyor_log.add_secrets(key.secret for key in ring.keys)
    return ring


def _entries(path: str) -> list[tuple[str, Any]]:
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the API keys file {path}: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise KeyFileError(f'{path}: expected {{"keys": [...]}}')
    return [(f"{path}: keys[{i}]", entry) for i, entry in enumerate(document["keys"])]


_FIELDS = {"name", "key", "weight", "max_concurrent", "top_priority", "admin"}


def _key(entry: Any, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: expected an object")
    if unknown := set(entry) - _FIELDS:
        raise KeyFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    name, secret = entry.get("name"), entry.get("key")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise KeyFileError(f"{where}: name must be 1-64 letters, digits or _.:- (given {name!r})")
    if not isinstance(secret, str) or len(secret) < 8:
        raise KeyFileError(f"{where}: key must be a string of at least 8 characters")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
        raise KeyFileError(f"{where}: weight must be a number in (0, 1e6] (given {weight!r})")
    return ApiKey(
        name,
        secret,
        float(weight),
        _optional_int(entry, "max_concurrent", where, low=1),
        _optional_int(entry, "top_priority", where, low=-(2**31)),
        _flag(entry, "admin", where),
    )


def _optional_int(entry: dict[str, Any], name: str, where: str, low: int) -> int | None:
    value = entry.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31):
        raise KeyFileError(f"{where}: {name} must be an integer of at least {low} (given {value!r})")
    return value


def _flag(entry: dict[str, Any], name: str, where: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise KeyFileError(f"{where}: {name} must be true or false (given {value!r})")
    return value
