"""The benchmark scripts run end to end against a live server (on the tiny model; nothing is timed here)."""

import subprocess
import sys
from pathlib import Path

from conftest import Server

ROOT = Path(__file__).resolve().parent.parent


def test_streams_benchmark_prints_its_table(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "streams.py"), "--url", server.url,
         "--requests", "4", "--concurrency", "1,2", "--max-new-tokens", "3"],  # fmt: skip
        capture_output=True, text=True, timeout=300, check=True,  # fmt: skip
    ).stdout
    lines = [line.split() for line in out.strip().splitlines()]
    assert lines[0][:2] == ["streams", "requests"]
    assert [row[:3] for row in lines[1:]] == [["1", "4", "12"], ["2", "4", "12"]]


def test_engines_benchmark_prints_its_grid(tiny_model) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engines.py"), "--model-id", str(tiny_model),
         "--engines", "padded,paged", "--shards", "1", "--requests", "2", "--concurrency", "1,2",
         "--max-new-tokens", "2"],  # fmt: skip
        capture_output=True, text=True, timeout=300, check=True,  # fmt: skip
    ).stdout
    lines = [line.split() for line in out.splitlines()]
    rows = {tuple(cells[:2]): cells[2:] for cells in lines if cells[:1] in (["padded"], ["paged"])}
    assert set(rows) == {("padded", "1"), ("paged", "1")}
    assert all(len(cells) == 2 and all(float(c) > 0 for c in cells) for cells in rows.values())
    assert "paged/padded" in out
