"""The import contracts in pyproject.toml (`[tool.importlinter]`) hold: the processes stand on the common package
and never import one another, the API types import no route, the router's rooms and the shard's form layers, the
shard protocol's wire format stays in the router's transport, the benchmarks reach the product only as a user can,
and no import cycle exists anywhere (imports under TYPE_CHECKING and inside functions included).

import-linter reads a package from one folder, while `conveyor`'s subpackages live in several top-level folders
(`[tool.setuptools] package-dir`). So the test lays the package out as an install would, copying each mapped
folder's modules into one `conveyor` tree, with the benchmarks (not installed) beside it, and runs `lint-imports`
over that copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    shutil.copytree(ROOT / "benchmarks", into / "benchmarks", ignore=shutil.ignore_patterns("results", "data"))
    return into


def lint_imports(tmp_path: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the layout in `tmp_path`/src, with this checkout's contracts."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_every_import_contract_is_kept(tmp_path: Path) -> None:
    installed_layout(tmp_path / "src")
    result = lint_imports(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 8 kept, 0 broken." in result.stdout, result.stdout


# An import each contract forbids, inside a function as such imports hide: (module, import, the contract it breaks).
FORBIDDEN = [
    ("conveyor/shard/batch/stopping.py", "from conveyor.shard.step import engine", "The shard's rooms"),
    ("conveyor/shard/layers/norm.py", "from conveyor.shard import offline", "The shard's rooms"),
    ("benchmarks/report.py", "from conveyor.router.core import queue", "The benchmarks use the product"),
    ("benchmarks/plot.py", "from conveyor.shard.step.engine import Engine", "The benchmarks use the product"),
    ("conveyor/router/core/queue.py", "from conveyor.v1 import shard_pb2", "wire format stays in the router's"),
    ("conveyor/router/core/sequence.py", "from conveyor.router.frontends import app", "The router's rooms"),
    ("conveyor/shard/sampling/masks.py", "from conveyor.router import metrics", "never import one another"),
    ("conveyor/allowance.py", "from conveyor.shard.batch import stopping", "The common package is the floor"),
]


@pytest.mark.parametrize(("module", "line", "contract"), FORBIDDEN, ids=[f"{m}: {i}" for m, i, _ in FORBIDDEN])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    target = installed_layout(tmp_path / "src") / module
    target.write_text(target.read_text() + f"\n\ndef _forbidden() -> None:\n    {line}  # noqa\n")
    result = lint_imports(tmp_path)
    _, _, broken = result.stdout.partition("Broken contracts")  # each broken contract's name and its imports
    assert result.returncode != 0 and contract in broken, result.stdout + result.stderr


def test_the_router_and_the_launcher_start_without_torch() -> None:
    """Neither process computes with tensors, and importing torch costs each start over a second on a small CPU
    (every deployment a test or a restart brings up pays it): torch stays out of their imports, including
    conveyor.group_store's, which imports torch.distributed only when a multi-node store is made."""
    code = "import sys, conveyor.router.main, conveyor.launcher.main; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stdout
