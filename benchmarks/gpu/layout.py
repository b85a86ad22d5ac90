"""`python3 benchmarks/gpu/layout.py DIR`: the `conveyor` package laid out under DIR as an install would lay it out,
each folder of `[tool.setuptools] package-dir` linked in place, so that `PYTHONPATH=DIR` imports this checkout.

The GPU machine runs the checkout as it arrives: no network, and no need of a build, since the C++ kernels serve
CPU shards alone (a CUDA shard never loads them). Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def lay_out(into: Path) -> Path:
    """Links each mapped folder under `into` (a subpackage inside its parent's folder comes with it); the top
    package's own modules are linked one by one, beside the linked subpackages."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = set(mapped.values())
    for package, folder in sorted(mapped.items()):
        target = into.joinpath(*package.split("."))
        if package == "conveyor":
            target.mkdir(parents=True, exist_ok=True)
            for module in (ROOT / folder).glob("*.py"):
                (target / module.name).unlink(missing_ok=True)
                (target / module.name).symlink_to(module)
        elif not any(folder.startswith(other + "/") for other in folders):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            target.symlink_to(ROOT / folder, target_is_directory=True)
    return into


if __name__ == "__main__":
    print(lay_out(Path(sys.argv[1])))
