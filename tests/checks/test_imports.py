"""The import contracts in pyproject.toml (`[tool.importlinter]`) hold: the processes stand on the common package
and never import one another, the API types import no route, the router's rooms form layers, and no import cycle
exists anywhere (imports under TYPE_CHECKING and inside functions included).

import-linter reads a package from one folder, while `conveyor`'s subpackages live in several top-level folders
(`[tool.setuptools] package-dir`). So the test lays the package out as an install would, copying each mapped
folder's modules into one `conveyor` tree, and runs `lint-imports` over that copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# The `lint-imports` command, run by this interpreter (the venv's bin/ need not be on PATH).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def installed_layout(into: Path) -> Path:
    """`into`/conveyor/..., each subpackage's .py files from its folder in package-dir."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools["package-dir"].items():
        target = into.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in (ROOT / folder).glob("*.py"):
            shutil.copy(module, target / module.name)
    return into


def test_every_import_contract_is_kept(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    installed_layout(tmp_path / "src")
    result = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout, result.stdout
