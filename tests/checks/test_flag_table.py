"""The "Launcher flags" table of docs/deployment.md against conveyor/config.py, so that neither drifts from the other
unnoticed.

Every flag the parser accepts is in the table, the table names no other, and each row's default is the declared
one. A flag declared with None has a default computed elsewhere (at warmup, from the model, from the
environment), which the table describes in words: any text passes there. A concrete default (number, string,
choice, boolean as on/off) must be shown as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from conveyor import config

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
SECTION = "## Launcher flags"
FLAG = re.compile(r"`(--[a-z0-9-]+)`")
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")  # `tiny\|small` is one cell
SWITCH = {True: "on", False: "off"}


@dataclass(frozen=True)
class Row:
    flags: list[str]
    default: str  # the cell, backticks left out
    line: str


def table_rows(doc: str) -> list[Row]:
    """The rows of the first table under SECTION, header and separator left out."""
    assert SECTION + "\n" in doc, f"docs/deployment.md has no {SECTION!r} section"
    lines = doc.split(SECTION + "\n", 1)[1].splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("|"))
    end = next((n for n, line in enumerate(lines[start:], start) if not line.startswith("|")), len(lines))
    rows = []
    for line in lines[start + 2 : end]:
        cells = [c.strip() for c in CELL_SEPARATOR.split(line.strip().strip("|"))]
        rows.append(Row(FLAG.findall(cells[0]), cells[1].replace("`", ""), line))
    return rows


def declared() -> tuple[dict[str, str], dict[str, object]]:
    """Every option string the parser accepts, with the field it sets (`--no-prefix-caching` sets prefix_caching),
    and each field's declared default."""
    options = {
        option: action.dest
        for action in config.parser("test")._actions
        if action.dest != "help"
        for option in action.option_strings
    }
    return options, {f.name: f.default for f in fields(config.Config)}


def shows(text: str, default: object) -> bool:
    """Whether a table cell shows this concrete default."""
    if isinstance(default, bool):
        return text == SWITCH[default]
    if isinstance(default, (int, float)):
        try:
            return float(text) == default
        except ValueError:
            return False
    return text == str(default)


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def problems(doc: str) -> list[str]:
    """Every disagreement between the table and config.py, in the order of the table, then of config.py."""
    options, defaults = declared()
    found: list[str] = []
    listed: dict[str, str] = {}  # field -> the row that lists it
    for row in table_rows(doc):
        unknown = [flag for flag in row.flags if flag not in options]
        found += [f"{flag}: in the table, but config.py has no such flag" for flag in unknown]
        dests = list(dict.fromkeys(options[flag] for flag in row.flags if flag in options))
        if not row.flags:
            found.append(f"a row names no flag: {row.line}")
        # `--hostname`, `--port` | `127.0.0.1`, `3000`: one default each; otherwise one for them all.
        parts = row.default.split(", ") if len(dests) > 1 else [row.default]
        if len(parts) != len(dests):
            parts = [row.default] * len(dests)
        for dest, text in zip(dests, parts):
            if dest in listed:
                found.append(f"{flag_of(dest)}: listed twice, in {listed[dest]!r} and {row.line!r}")
            listed[dest] = row.line
            default = defaults[dest]
            if not text:
                found.append(f"{flag_of(dest)}: no default in the table")
            elif default is not None and not shows(text, default):
                found.append(f"{flag_of(dest)}: the table says {text!r}, config.py declares {default!r}")
    found += [
        f"{flag_of(dest)}: declared in config.py, missing from the table" for dest in defaults if dest not in listed
    ]
    return found


def test_the_flag_table_lists_every_launcher_flag_with_its_default() -> None:
    assert problems(DEPLOYMENT.read_text()) == []


def test_the_check_catches_drift() -> None:
    """A planted wrong default, a missing row and a flag that does not exist are each reported."""
    doc = DEPLOYMENT.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `--max-request-retries` |"))
    assert problems(doc.replace(row, row.replace("| 2 |", "| 3 |"))) == [
        "--max-request-retries: the table says '3', config.py declares 2"
    ]
    assert problems(doc.replace(row + "\n", "")) == [
        "--max-request-retries: declared in config.py, missing from the table"
    ]
    assert problems(doc.replace(row, row.replace("--max-request-retries", "--max-request-retry"))) == [
        "--max-request-retry: in the table, but config.py has no such flag",
        "--max-request-retries: declared in config.py, missing from the table",
    ]
    pair = next(line for line in doc.splitlines() if line.startswith("| `--hostname`, `--port` |"))
    assert problems(doc.replace(pair, pair.replace("`3000`", "`3001`"))) == [
        "--port: the table says '3001', config.py declares 3000"
    ]
