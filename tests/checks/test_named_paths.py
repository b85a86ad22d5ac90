"""Every path of this repository that a docstring, comment or document names exists: a file renamed or deleted
leaves its mentions behind, and a reader who follows one finds nothing.

A mention is a path with a folder whose first part is one of the repository's folders (`router/core/queue.py`,
`shard/kv_offload/`), read from the root, from the mentioning file's folder, or from a process's package
(`layers/gemm.py` in shard/), tracked or built (`shard/kernels/built/`), or a bare `name.py` (`compile.py`), which
must be some tracked file's name. Other projects' files (llama.cpp's converter) are named in OTHERS; URLs are left
alone.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS = "py|md|cpp|h|proto|json|toml|yml|yaml|sh|html|txt|cfg"
MENTION = re.compile(rf"(?<![\w./:~$*-])((?:[\w.-]+/)+|(?:[\w.-]+/)*[\w-]+\.(?:{EXTENSIONS}))(?![\w/])")
PACKAGES = ("router", "shard")  # a mention inside one of these may start below it: `core/queue.py`
OTHERS = {"convert_hf_to_gguf.py"}  # llama.cpp's, which the benchmarks run
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples of stale mentions are on purpose


@dataclass(frozen=True)
class Repository:
    """What a mention may name: tracked files and their folders, the files' bare names, and the folders a mention
    may start with."""

    paths: set[str]
    names: set[str]
    tops: set[str]

    @classmethod
    def tracked(cls) -> Repository:
        git = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        files = git.stdout.split()
        folders = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
        tops = {f.split("/")[0] for f in folders}
        below = {f.split("/")[1] for f in folders if f.split("/")[0] in PACKAGES and f.count("/") >= 1}
        return cls(set(files) | folders, {Path(f).name for f in files}, tops | below)

    def has(self, mention: str, mentioned_in: str) -> bool:
        if "/" not in mention:
            return not mention.endswith(".py") or mention in self.names or mention in OTHERS
        if mention.split("/")[0] not in self.tops:
            return True  # not this repository's: a model's folder, a user's path, another project's
        here = str(Path(mentioned_in).parent)
        candidates = [mention, f"{here}/{mention}", mention.removeprefix("conveyor/")]
        candidates += [f"{package}/{mention}" for package in PACKAGES]
        return any(c in self.paths or (ROOT / c).exists() for c in candidates)  # or built: kernels/built


def readable(name: str) -> bool:
    """Python and Markdown, but not the generated stubs nor the recorded benchmark results."""
    return name.endswith((".py", ".md")) and not name.startswith("benchmarks/results/") and "_pb2" not in name


def mentions(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every mention outside a line that holds a URL."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if "://" not in line:
            found += [(number, m.group(1).rstrip("/")) for m in MENTION.finditer(line)]
    return found


def test_every_named_repository_path_exists() -> None:
    repository = Repository.tracked()
    stale = [
        f"{name}:{number}: {mention}"
        for name in sorted(filter(readable, repository.paths - {THIS}))
        for number, mention in mentions((ROOT / name).read_text(errors="replace"))
        if not repository.has(mention, name)
    ]
    assert not stale, "paths named that the repository does not have:\n" + "\n".join(stale)


def test_a_moved_file_s_mention_is_caught_and_a_real_one_is_not() -> None:
    """A check that cannot fail proves nothing."""
    repository = Repository.tracked()
    text = "See router/core/queue.py, `layers/gemm.py`, kernels/toolchain.py and weights/x/config.json;\n"
    text += "once benchmarks/validation.py, core/kv_offload.py, build.py and kernels/compile.py;\n"
    text += "not https://x.org/router/b.py\n"
    found = {mention: repository.has(mention, "shard/step/engine.py") for _, mention in mentions(text)}
    assert found == {
        "router/core/queue.py": True,
        "layers/gemm.py": True,
        "kernels/toolchain.py": True,
        "weights/x/config.json": True,
        "benchmarks/validation.py": False,
        "core/kv_offload.py": False,
        "build.py": False,
        "kernels/compile.py": False,
    }
