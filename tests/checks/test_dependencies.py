"""Product code imports only what a plain `pip install .` installs, as the Docker image does.

deptry reads every import in the product packages (at module top and inside functions) and maps it to the
distribution that provides it; configured in pyproject.toml ([tool.deptry]), it fails on a module that no
[project] dependency provides (DEP001), one that comes only through another dependency (DEP003), or one declared
only in the test or bench extras (DEP004), which CI installs and the image does not.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def product_folders() -> list[str]:
    """The folders of the `conveyor` packages ([tool.setuptools] package-dir), each once: subpackages' folders
    lie inside their parents', which deptry scans whole."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = sorted(set(package_dir.values()))
    return [f for f in folders if not any(f.startswith(other + "/") for other in folders)]


def test_product_code_imports_only_declared_dependencies() -> None:
    folders = product_folders()
    assert "launcher" in folders and "router" in folders, folders
    result = subprocess.run(
        [sys.executable, "-m", "deptry", *folders, "--config", "pyproject.toml", "--no-ansi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        "declare each module below in pyproject.toml's [project] dependencies (or, if only a benchmark run by"
        " `make bench` or a try/except ImportError imports it, in an extra, with a justified [tool.deptry]"
        " per-rule ignore)\n" + output
    )
    scanned = re.search(r"Scanning (\d+) files", output)
    assert scanned and int(scanned.group(1)) >= len(folders), output  # it found the packages' files
