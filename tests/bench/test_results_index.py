"""Every result the docs cite exists: `bench/results/...` paths in README.md, ARCHITECTURE.md and the
results index (brace patterns like `rest-{25,50}.md` expanded), the bare result file names of the
README's Performance section, and one index row per results folder."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "README.md"
CITING = [REPO / "README.md", REPO / "ARCHITECTURE.md", INDEX]


def expand_braces(pattern: str) -> list[str]:
    """`a-{1,2}.md` -> [`a-1.md`, `a-2.md`]; nested and repeated groups expand left to right."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    return [p for option in match.group(1).split(",") for p in expand_braces(head + option + tail)]


def cited_paths(text: str) -> list[str]:
    paths = re.findall(r"bench/results/[\w./{},-]*", text)
    return [p for raw in paths for p in expand_braces(raw.rstrip(".,"))]


def performance_section(readme: str) -> str:
    start = readme.index("\n## Performance")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end != -1 else None]


def bare_result_names(text: str) -> list[str]:
    names = re.findall(r"`([\w{},.-]+\.(?:json|md|png))`", text)
    return [n for name in names for n in expand_braces(name)]


def test_expand_braces() -> None:
    assert expand_braces("x/a-{25,50}.md") == ["x/a-25.md", "x/a-50.md"]
    assert expand_braces("g{8,12}-{a,b}") == ["g8-a", "g8-b", "g12-a", "g12-b"]
    assert expand_braces("plain.json") == ["plain.json"]


@pytest.mark.parametrize("doc", CITING, ids=lambda p: p.name if p != INDEX else "bench/results/README.md")
def test_every_cited_results_path_exists(doc: Path) -> None:
    paths = cited_paths(doc.read_text())
    assert paths, f"{doc} cites no bench/results path"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"{doc.name} cites missing results: {missing}"


def test_every_result_file_named_in_performance_exists() -> None:
    names = bare_result_names(performance_section((REPO / "README.md").read_text()))
    present = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    assert names
    missing = sorted(set(names) - present)
    assert not missing, f"README's Performance section names result files not under bench/results: {missing}"


def test_index_has_a_row_per_results_folder() -> None:
    index = INDEX.read_text()
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders
    unlisted = [f for f in folders if f"| `{f}/` |" not in index]
    assert not unlisted, f"bench/results/README.md has no row for {unlisted}"
