"""The extra training text: only permissive packages' own files, never a copy of held-out text."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import package_corpus as pc  # noqa: E402
from stdlib_corpus import Document  # noqa: E402

CODE = "def f(x):\n    return x + 1\n"
HELDOUT = "".join(f"    result_{i} = compute_something_long(argument_{i}, other_argument)\n" for i in range(10))


def fake_dist(root: Path, name: str, licence_header: str, files: dict[str, str]) -> md.Distribution:
    """An installed-looking distribution: METADATA, RECORD and the files under root."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\n{licence_header}\n")
    for relpath, text in files.items():
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        (root / relpath).write_text(text)
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in files))
    return md.PathDistribution(info)


@pytest.mark.parametrize("terms, ok", [
    (["MIT"], True), (["Apache-2.0", "BSD-3-Clause"], True), (["BSD License"], True),
    (["GPL-3.0-or-later"], False), (["MIT", "MPL-2.0"], False), (["Dual License"], False), ([], False),
])
def test_only_permissive_licences_pass(terms, ok):
    assert pc.is_permissive(terms) is ok


def test_spdx_expression_is_split_into_terms(tmp_path):
    dist = fake_dist(tmp_path, "p", "License-Expression: Apache-2.0 AND (MIT OR LGPL-2.1-only)", {})
    statement, terms = pc.licence_terms(dist)
    assert statement == "Apache-2.0 AND (MIT OR LGPL-2.1-only)"
    assert sorted(terms) == ["Apache-2.0", "LGPL-2.1-only", "MIT"]
    assert not pc.is_permissive(terms)


def test_vendored_and_data_like_files_are_recognised():
    assert pc.is_vendored("pip/_vendor/rich/console.py")
    assert not pc.is_vendored("pip/_internal/vendor.py")
    assert pc.looks_like_code(CODE)
    assert not pc.looks_like_code("TABLE = [" + "1, " * 500 + "]\n")  # one 1500-character line
    assert not pc.looks_like_code("#" * 80 + "\n" + "=" * 80 + "\n")  # no letters or digits


def test_collect_keeps_own_files_and_drops_copies_vendored_code_and_copyleft(tmp_path):
    stdlib = [Document("heldout_mod.py", HELDOUT), Document("train_mod.py", "x = 1\n" * 3)]
    good = fake_dist(tmp_path / "a", "good", "License-Expression: MIT", {
        "good/core.py": CODE,
        "good/copy.py": "x = 1\n" * 3,  # identical to a stdlib file
        "good/fork.py": HELDOUT + "extra = 1\n",  # a near copy of a held-out file
        "good/_vendor/lib.py": CODE + "# vendored\n",
        "good/data.txt": "not python",
    })
    bad = fake_dist(tmp_path / "b", "bad", "License-Expression: GPL-3.0-only", {"bad/x.py": CODE + "#\n"})
    dists = {"good": good, "bad": bad}

    def find(name: str) -> md.Distribution:
        if name not in dists:
            raise md.PackageNotFoundError(name)
        return dists[name]

    docs, manifest = pc.collect_packages(stdlib, stdlib[:1], names=["good", "bad", "absent"], find=find)
    assert [d.relpath for d in docs["good"]] == ["good/core.py"]
    assert "bad" not in docs
    assert manifest["good"]["duplicates"] == 1
    assert manifest["good"]["near_copies_of_heldout_or_validation"] == 1
    assert manifest["bad"]["skipped"].startswith("licence")
    assert manifest["absent"] == {"skipped": "not installed"}
