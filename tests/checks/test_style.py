"""The tree is as `ruff format` leaves it and passes `ruff check` (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, str(ROOT)], capture_output=True, text=True, cwd=ROOT)


def test_ruff_check_passes() -> None:
    result = ruff("check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted() -> None:
    result = ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, "run `.venv/bin/ruff format .`\n" + result.stdout + result.stderr
