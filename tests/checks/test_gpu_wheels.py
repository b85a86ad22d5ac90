"""The GPU check's packages travel with it: every distribution it imports is in the GPU image or in the wheel list.

The GPU machine has no network: it runs `make gpu-check` on its image's Python packages
(benchmarks/gpu/image_packages.txt) plus the wheels that `make gpu-wheels` downloaded here into .whl/ from
benchmarks/gpu/wheels.txt. A new import in the product, or in the tests and benchmarks that the GPU check runs, must
travel too, with everything it requires on that machine (Python 3.12, Linux x86_64), or the check fails there, where
nothing can be installed. This test reads those imports (with `ast`, at module top and inside functions), maps each
to the distributions installed here, takes the closure of their requirements, and fails on a distribution that
neither file names. A second test holds every pin in wheels.txt to the version installed here, so that the GPU
machine runs what CI tested.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from test_dependencies import product_folders  # the product's folders, as deptry reads them

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
IMAGE_PACKAGES = GPU / "image_packages.txt"
WHEELS = GPU / "wheels.txt"

TESTS = GPU / "tests.txt"  # the node ids of the CUDA test subset that benchmarks/gpu/run.sh runs


def gpu_test_ids() -> list[str]:
    return [line for line in TESTS.read_text().splitlines() if line and not line.startswith("#")]


# The test files the GPU check runs, with the local helpers they import.
GPU_TESTS = ["tests/conftest.py", "tests/loopback.py", "tests/chat_templates.py"] + sorted(
    {node.split("::")[0] for node in gpu_test_ids()}
)
# The benchmark entry points it runs; the benchmarks modules they import (`from benchmarks...`) are followed.
GPU_BENCHMARKS = ["benchmarks/gpu_check.py", "benchmarks/serve.py", "benchmarks/bare.py"]

# Loaded by pytest from the configuration ([tool.pytest.ini_options]'s asyncio_mode, timeout), imported by no file.
PYTEST_PLUGINS = ["pytest-asyncio", "pytest-timeout"]

# Ours, not distributions: the product's namespace, the benchmarks beside it, the tests' local helpers.
LOCAL_MODULES = {"conveyor", "benchmarks", "tests", "conftest", "loopback", "chat_templates"}

# The GPU machine's interpreter and platform, for the requirements' environment markers.
GPU_ENVIRONMENT = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}

# Named allowances: distributions that the closure reaches here and the GPU machine does not need, each with why
# (e.g. a requirement of the CPU torch wheel here that the image's CUDA torch lacks). None today: torch 2.13.0+cpu
# requires filelock, typing-extensions, setuptools, sympy, networkx, jinja2 and fsspec, all in the image.
ALLOWED_ABSENT: dict[str, str] = {}

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def imports(path: Path) -> set[str]:
    """The absolute modules that a file imports, anywhere in it, dotted: `import a.b` gives a.b, `from a.b import c`
    gives a.b.c (c may be a name, not a module: distributions_of looks for the longest dotted prefix a file holds)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update(f"{node.module}.{alias.name}" if alias.name != "*" else node.module for alias in node.names)
    return found


def benchmark_modules(path: Path) -> set[Path]:
    """The benchmarks modules that a benchmarks file imports: `from benchmarks.x import ...`, `import benchmarks.x`,
    `from benchmarks import x, y` (where x is a module) and the relative forms inside benchmarks/."""
    bench = ROOT / "benchmarks"
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative, from a file in benchmarks/
                module = "benchmarks" + ("." + module if module else "")
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "benchmarks" or len(parts) < 2:
                continue
            candidate = bench.joinpath(*parts[1:])
            for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if file.is_file():
                    found.add(file)
    return found


def gpu_files() -> list[Path]:
    """Every file whose imports the GPU machine must satisfy."""
    files: set[Path] = set()
    for folder in product_folders():
        files.update((ROOT / folder).rglob("*.py"))
    files.update(ROOT / name for name in GPU_TESTS)
    pending = [ROOT / name for name in GPU_BENCHMARKS]
    while pending:
        file = pending.pop()
        if file not in files:
            files.add(file)
            pending.extend(benchmark_modules(file))
    return sorted(files)


def third_party(modules: Iterable[str]) -> set[str]:
    local = LOCAL_MODULES | set(sys.stdlib_module_names)
    return {m for m in modules if (top := m.split(".")[0]) not in local and not top.startswith("test_")}


def provides(distribution: str, module: str) -> bool:
    """Whether an installed distribution's files hold the dotted module (or a package inside it)."""
    stem = module.replace(".", "/")
    files = importlib.metadata.distribution(distribution).files or []
    return any(path.startswith((stem + "/", stem + ".")) for path in (f.as_posix() for f in files))


def distributions_of(modules: set[str]) -> tuple[dict[str, set[str]], list[str]]:
    """Each module's distributions (normalized names), and the top-level names that no installed distribution
    provides. Where several distributions share a top-level name (the namespace packages google, opentelemetry),
    the module maps to those that hold its longest dotted prefix (opentelemetry.trace: opentelemetry-api)."""
    by_top = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    missing: list[str] = []
    for module in sorted(modules):
        candidates = sorted(set(by_top.get(module.split(".")[0], [])))
        if not candidates:
            missing.append(module.split(".")[0])
            continue
        narrowed = candidates
        parts = module.split(".")
        while len(candidates) > 1 and len(parts) > 1:
            holders = [d for d in candidates if provides(d, ".".join(parts))]
            if holders:
                narrowed = holders
                break
            parts.pop()
        found[module] = {canonicalize_name(d) for d in narrowed}
    return found, sorted(set(missing))


def closure(roots: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Every distribution that the roots require on the GPU machine, transitively (requirements whose marker holds
    there, with the extras asked for), each with the one that brought it in; and a line per one not installed here,
    whose requirements could not be read."""
    via: dict[str, str] = {canonicalize_name(r): "imported" for r in roots}
    extras_done: dict[str, set[str]] = {}
    pending: list[tuple[str, set[str]]] = [(name, set()) for name in via]
    missing: list[str] = []
    while pending:
        name, extras = pending.pop()
        done = extras_done.get(name)
        if done is not None and extras <= done:
            continue
        extras_done[name] = (done or set()) | extras
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{name} (required by {via[name]}): not installed here")
            continue
        for line in requires:
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                missing.append(f"{name}: unreadable requirement {line!r}")
                continue
            marker = requirement.marker
            wanted = marker is None or any(
                marker.evaluate({**GPU_ENVIRONMENT, "extra": extra}) for extra in ({""} | extras_done[name])
            )
            if wanted:
                child = canonicalize_name(requirement.name)
                via.setdefault(child, name)
                pending.append((child, set(requirement.extras)))
    return via, sorted(set(missing))


def chain(via: dict[str, str], name: str) -> str:
    """Who brought a distribution into the closure, back to one imported: `b <- a` (a imported, requires b)."""
    links = []
    while (name := via[name]) != "imported":
        links.append(name)
    return " <- ".join(links)


def listed(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(Requirement(line).name))
    return names


def pins() -> dict[str, str]:
    """wheels.txt's pins, name (normalized) to version; each line must be a plain `name==version`."""
    found: dict[str, str] = {}
    for number, raw in enumerate(WHEELS.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        assert match, f"{WHEELS.relative_to(ROOT)}:{number}: {raw!r} is not a plain `name==version` pin"
        name = canonicalize_name(match.group(1))
        assert name not in found, f"{WHEELS.relative_to(ROOT)}:{number}: {name} pinned twice: keep one version"
        found[name] = match.group(2)
    return found


def test_gpu_packages_cover_the_imports() -> None:
    files = gpu_files()
    assert ROOT / "benchmarks" / "serve.py" in files and ROOT / "benchmarks" / "workload.py" in files, files
    modules: dict[str, set[str]] = {}
    for file in files:
        for module in third_party(imports(file)):
            modules.setdefault(module, set()).add(str(file.relative_to(ROOT)))
    assert "torch" in modules and "grpc" in modules, sorted(modules)  # it read the product's imports

    by_module, unknown = distributions_of(set(modules))
    assert not unknown, (
        "these modules are imported by code the GPU check runs, but no distribution installed here provides them:"
        " declare and install the package (pyproject.toml), then pin it in benchmarks/gpu/wheels.txt\n"
        + "\n".join(
            f"  {top} (in {', '.join(sorted({f for m, fs in modules.items() if m.split('.')[0] == top for f in fs}))})"
            for top in unknown
        )
    )
    roots = {d for distributions in by_module.values() for d in distributions} | set(PYTEST_PLUGINS)
    via, not_installed = closure(roots)
    assert not not_installed, (
        "the GPU machine would need these distributions (their markers hold for Python 3.12 on Linux x86_64), and"
        " they are not installed here, so their requirements cannot be followed: install them in the venv, then pin"
        " them in benchmarks/gpu/wheels.txt (or, if the image has them, check benchmarks/gpu/image_packages.txt)\n"
        + "\n".join(f"  {line}" for line in not_installed)
    )

    available = listed(IMAGE_PACKAGES) | set(pins())
    absent = sorted(set(via) - available - set(ALLOWED_ABSENT))
    importers = {d: sorted({m.split(".")[0] for m, ds in by_module.items() if d in ds}) for d in roots}
    assert not absent, (
        "the GPU machine has no network, and neither its image (benchmarks/gpu/image_packages.txt) nor the wheels"
        " (benchmarks/gpu/wheels.txt) hold these distributions: add `name==version` (the version installed here) to"
        " benchmarks/gpu/wheels.txt, then run `make gpu-wheels`\n"
        + "\n".join(
            f"  {d}=={importlib.metadata.version(d)}  "
            + (f"(imported as {', '.join(importers[d])})" if importers.get(d) else f"(required by {chain(via, d)})")
            for d in absent
        )
    )


def test_gpu_wheels_pin_the_installed_versions() -> None:
    pinned = pins()
    assert pinned, WHEELS
    wrong: list[str] = []
    for name, version in sorted(pinned.items()):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"  {name}=={version}: not installed here; install it, or remove the line")
            continue
        if installed != version:
            wrong.append(f"  {name}=={version}: installed here is {installed}; write {name}=={installed}")
    assert not wrong, (
        "benchmarks/gpu/wheels.txt must pin the versions installed in this venv, so that the GPU machine runs what CI"
        " tested; change these lines, then run `make gpu-wheels`\n" + "\n".join(wrong)
    )


def test_every_test_the_gpu_check_runs_is_still_collected() -> None:
    """A renamed test or deployment would silently drop out of the GPU check: pytest collects each node id."""
    ids = gpu_test_ids()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"benchmarks/gpu/tests.txt names a test that is gone:\n{done.stdout[-3000:]}"
