"""A plain (not editable) install of the package carries its C++ kernels, built when it is, and a deployment from
it serves the demo model on them with no compiler anywhere on its PATH and nothing built at start.

The install is of a copy of the source tree (another location than this checkout's), into a new venv. Its
dependencies are this venv's packages, on its path through a .pth line (they are what `pip install .` would fetch
from the index; tests/checks/test_dependencies.py holds the product to declaring them), so that the test costs one
package build rather than a download of every dependency. That build takes each kind's library from the machine's
cache of builds, where this checkout's own build filed it under the same key (shard/kernels/toolchain.py), so the
test costs a copy rather than four compiles; compiling and keying are tests/unit/test_kernel_build.py's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
from conftest import start_server

from conveyor import cpu

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "built", "build", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", ".hypothesis"
)


def install(tmp_path: Path) -> Path:
    """A new venv with the package installed from a copy of the sources; returns its Python."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index"]
    run = subprocess.run([*pip, "--no-build-isolation", str(source)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return python


def test_a_plain_install_serves_the_demo_model_on_its_shipped_kernels_without_a_compiler(tmp_path: Path) -> None:
    python = install(tmp_path)
    installed = subprocess.run(
        [str(python), "-c", "from conveyor.shard.kernels import toolchain; print(toolchain.BUILT)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert installed.startswith(str(tmp_path / "venv")), installed  # the install's own libraries, not the checkout's
    package = Path(installed).parents[2]
    assert not (package / "benchmarks").exists() and not (package.parent / "benchmarks").exists()  # what serves, only
    assert {p.name for p in Path(installed).iterdir()} == {"manifest.json", *(f"{k}.so" for k in cpu.KINDS)}
    cache, log = tmp_path / "cache", tmp_path / "deployment.log"
    env = {
        "PATH": str(python.parent),  # no c++, g++ or cc here
        "CXX": "/nonexistent/c++",
        "CONVEYOR_CACHE": str(cache),
        "CONVEYOR_LOG_LEVEL": "INFO",
    }
    server = start_server("demo", "--demo-size", "tiny", env=env, log=log, python=str(python), cwd=tmp_path)
    try:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
        answer = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["generated_text"], answer.text
    finally:
        assert server.stop() == 0
    lines = log.read_text().splitlines()
    loaded = [line for line in lines if "kernels loaded" in line]
    assert loaded and all(f"library={installed}/{cpu.probe().kind}.so" in line for line in loaded), loaded
    assert not [line for line in lines if "building the C++ kernels" in line or "kernels unavailable" in line]
    # no kernels/: the demo model, and the class of its tokenizer (router/pipeline/tokenizer_loading.py)
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["demo-tiny", "tokenizer-classes"]
