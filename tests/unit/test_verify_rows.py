"""issue 66's k-row benchmark (benchmarks/verify_rows.py): every mode's steps timed at each row count, the first
count the ratios' base, on the tiny model; and the best-of-rounds timing it shares with nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import verify_rows


def test_every_mode_is_timed_at_every_row_count(tiny_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    verify_rows.main(
        ["--model-id", str(tiny_model), "--modes", "float32,int8", "--rows", "1,3", "--rounds", "1", "--calls", "1"]
        + ["--json", str(out)]
    )
    record = json.loads(out.read_text())
    assert record["rows"] == [1, 3]
    for mode in ("float32", "int8"):
        seconds, ratios = record["modes"][mode]["seconds"], record["modes"][mode]["ratio"]
        assert set(seconds) == set(ratios) == {"1", "3"}
        assert all(s > 0 for s in seconds.values())
        assert ratios["1"] == 1.0 and ratios["3"] == seconds["3"] / seconds["1"]
    printed = capsys.readouterr().out
    assert "float32" in printed and "int8" in printed and "3: " in printed


def test_each_count_keeps_its_best_round() -> None:
    calls = {1: 0, 2: 0}
    steps = {count: (lambda count=count: calls.__setitem__(count, calls[count] + 1)) for count in calls}
    best = verify_rows.best_seconds(steps, rounds=3, calls=2)
    assert calls == {1: 9, 2: 9}  # each round: one untimed call, then two timed
    assert set(best) == {1, 2} and all(0 <= s < 1 for s in best.values())


@pytest.mark.parametrize("flags", [["--modes", "float16"], ["--rows", "0,2"], ["--rows", "1,100"]])
def test_bad_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        verify_rows.main(["--model-id", "demo", *flags])
