"""The documentation cannot drift from what it describes: the benchmark tables in docs/benchmarks.md are exactly what
`benchmarks.docs_tables` renders from benchmarks/results/, and every relative link in README.md and
docs/*.md reaches a file that exists (and, for `#anchor` links into a markdown file, a heading it has).

Typed figures and moved sections rot silently; a failing check here says which table to regenerate
(`.venv/bin/python -m benchmarks.docs_tables`) or which link to mend.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import docs_tables

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def prose(markdown: str) -> str:
    """The text a reader sees as text: fenced blocks and code spans left out."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2, ... for repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def links(document: Path) -> Iterator[str]:
    for target in LINK.findall(prose(document.read_text())):
        if not EXTERNAL.match(target):
            yield target


def broken(document: Path, target: str) -> str | None:
    """Why a relative link in `document` does not resolve, or None."""
    path, _, anchor = target.partition("#")
    file = (document.parent / path).resolve() if path else document
    if not file.exists():
        return f"{document.name}: {target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
        return f"{document.name}: {target}: no heading #{anchor} in {file.name}"
    return None


def test_the_benchmark_tables_are_generated_from_the_results() -> None:
    document = docs_tables.DOC.read_text()
    assert docs_tables.generated_part(document) == docs_tables.render(), (
        "docs/benchmarks.md's tables differ from benchmarks/results/: run `.venv/bin/python -m benchmarks.docs_tables`"
    )


def test_readme_leads_with_the_real_model_on_each_kind_of_cpu() -> None:
    document = docs_tables.README.read_text()
    assert docs_tables.generated_part(document) == docs_tables.render_readme(), (
        "README.md's benchmark table differs from benchmarks/results/: run `.venv/bin/python -m benchmarks.docs_tables`"
    )
    kinds = {summary["machine"]["cpu"] for _, summary in docs_tables.newest_real_sittings()}
    assert len(kinds) >= 2, kinds  # an AMD EPYC and an Intel Xeon sitting, at least


def test_every_results_folder_has_its_sitting_and_its_tables() -> None:
    documented = {docs_tables.folder_of(run) for run in docs_tables.sittings()}
    assert set(docs_tables.result_folders()) <= documented
    stale = [
        str(path.relative_to(ROOT))
        for path, text in docs_tables.folder_readmes().items()
        if not path.exists() or path.read_text() != text
    ]
    assert stale == [], (
        f"results READMEs differ from their JSON: run `.venv/bin/python -m benchmarks.docs_tables` ({stale})"
    )


def test_a_results_folder_without_its_sitting_stops_the_generator(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "new-cpu").mkdir()
    (tmp_path / "new-cpu" / "summary.json").write_text("{}")
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="new-cpu"):
        docs_tables.render()


def test_every_relative_link_resolves() -> None:
    problems = [why for document in DOCUMENTS for target in links(document) if (why := broken(document, target))]
    assert problems == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    assert [page.name for page in DOCUMENTS[1:] if page.resolve() not in linked] == []


def test_the_link_check_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section: `code`\n\n[ok](#a-section-code) [gone](other.md) [bad](#nowhere)\n")
    assert [broken(page, target) for target in links(page)] == [
        None,
        "page.md: other.md: no such file",
        "page.md: #nowhere: no heading #nowhere in page.md",
    ]
