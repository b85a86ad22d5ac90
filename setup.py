"""Builds the C++ kernels with the package: one library per CPU kind (shard/kernels/toolchain.py), so that no shard
compiles anything when it starts. Everything else about the package is in pyproject.toml."""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _module(name: str, path: Path):
    """A module of the source tree, loaded before the package is installed (both import only the standard library
    at their top)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class build_kernels(Command):  # noqa: N801 - setuptools names commands by their class
    """Compiles the kernels into the package's kernels/built/ (in place for an editable install)."""

    description = "compile the C++ kernels for every x86 CPU kind"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _dest(self, toolchain) -> Path:
        if self.editable_mode:
            return toolchain.BUILT
        return Path(self.build_lib) / "conveyor" / "shard" / "kernels" / "built"

    def run(self) -> None:
        cpu = _module("_conveyor_setup_cpu", ROOT / "conveyor" / "cpu.py")
        toolchain = _module("_conveyor_setup_toolchain", ROOT / "shard" / "kernels" / "toolchain.py")
        paths = _module("_conveyor_setup_paths", ROOT / "conveyor" / "paths.py")
        if platform.machine().lower() not in ("x86_64", "amd64"):
            print(f"conveyor: no C++ kernels for {platform.machine()}: shards use the torch path", file=sys.stderr)
            return
        kinds = {name: cpu.compile_flags(name) for name in cpu.KINDS}
        dest = self._dest(toolchain)
        print(f"conveyor: compiling the C++ kernels for {', '.join(kinds)} into {dest}", file=sys.stderr, flush=True)
        try:
            manifest = toolchain.build_all(dest, kinds, cache=paths.cache_root() / "kernels")
        except toolchain.CompilerMissing as exc:
            print(f"conveyor: {exc}: shards will use the torch path (install g++ to build them)", file=sys.stderr)
            return
        note = toolchain.reuse_note(manifest)
        print(f"conveyor: kernels built in {manifest['seconds']} s with {manifest['compiler']}{note}", file=sys.stderr)

    def get_outputs(self) -> list[str]:
        return []

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


class build_with_kernels(build):  # noqa: N801
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class BinaryDistribution(Distribution):
    """The wheel carries compiled libraries: it is tagged for a platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(distclass=BinaryDistribution, cmdclass={"build": build_with_kernels, "build_kernels": build_kernels})
