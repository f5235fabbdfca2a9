"""Extra training text for the default model: Python sources of installed, permissively
licensed packages.

The stdlib alone (7.8M training tokens) let the 8-expert target memorise; these files only
ever join the TRAINING split.  Validation and held-out stay the stdlib files that
stdlib_corpus.split_of picks, so figures stay comparable across corpora, and every file here
that equals or nearly copies one of those is dropped.

Packages are capped at MAX_PACKAGE_BYTES (a hash-ordered sample beyond it) so that no single
one dominates.  Each package must be installed and its metadata must name only permissive licences (no GPL,
LGPL, MPL, or anything unrecognised); vendored copies of other projects are skipped, since
their licences are not the package's.  Files are the package's own RECORD entries, filtered
the way code corpora usually are (The Stack / StarCoder): UTF-8, <= 1 MB, longest line <= 1000
characters, mean line <= 100, at least 25% alphanumeric characters.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stdlib_corpus import MAX_FILE_BYTES, Document

# The distributions searched, in this order (the first copy of a duplicated file wins).
PACKAGES = (
    "torch", "transformers", "numpy", "scipy", "sympy", "mpmath", "networkx", "matplotlib",
    "setuptools", "pip", "pydantic", "fastapi", "starlette", "uvicorn", "jinja2", "markupsafe",
    "huggingface_hub", "tokenizers", "safetensors", "accelerate", "pygments", "ipython",
    "prompt_toolkit", "traitlets", "jedi", "parso", "click", "typer", "flask", "werkzeug",
    "itsdangerous", "httpx", "httpcore", "h11", "anyio", "trio", "requests", "urllib3", "idna",
    "rich", "markdown-it-py", "pytest", "pluggy", "packaging", "pyparsing", "attrs", "fsspec",
    "filelock", "jsonschema", "python-dateutil", "six", "sortedcontainers", "pyflakes", "psutil",
    "wcwidth", "boto3", "botocore", "s3transfer", "fonttools", "pillow", "cryptography",
)

# SPDX ids and the spellings older metadata uses for them; all permissive.
PERMISSIVE = {
    "mit", "mit license", "mit-0", "mit-cmu", "0bsd", "bsd", "bsd license", "bsd-2-clause",
    "bsd-3-clause", "bsd 3-clause license", "modified bsd license", "apache", "apache-2.0",
    "apache 2.0", "apache 2.0 license", "apache license 2.0", "apache software license",
    "llvm-exception", "bsl-1.0", "zlib", "cc0-1.0", "psf-2.0", "python software foundation license",
}
SPDX_OPERATORS = re.compile(r"\s+(?:AND|OR|WITH)\s+|[()]")
VENDORED_DIRS = {"_vendor", "vendor", "_vendored", "vendored", "third_party", "_third_party",
                 "extern", "_extern", "externals"}
MAX_LINE_CHARS = 1000
MAX_MEAN_LINE_CHARS = 100
MIN_ALNUM_FRACTION = 0.25
MAX_PACKAGE_BYTES = 30_000_000  # torch and transformers hold 45-53 MB each; keeps the mix diverse
NEAR_COPY_LINE_CHARS = 40  # lines at least this long (stripped) identify a copied file
NEAR_COPY_FRACTION = 0.5  # share of a file's long lines found in held-out/validation: dropped


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    licence: str  # as the metadata states it: SPDX expression, License field or classifiers


def licence_terms(dist: md.Distribution) -> tuple[str, list[str]]:
    """The licence statement and its terms: the SPDX expression if there is one, else a short
    License field, else the License classifiers (long License fields are full texts)."""
    meta = dist.metadata
    expression = meta.get("License-Expression")
    if expression:
        return expression, [t for t in SPDX_OPERATORS.split(expression) if t.strip()]
    field = (meta.get("License") or "").strip()
    if field and "\n" not in field and len(field) < 40:
        return field, [t for t in re.split(r"\s+OR\s+|\s+AND\s+", field) if t.strip()]
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
                   if c.startswith("License ::")]
    return "; ".join(classifiers) + " (classifiers)", classifiers


def is_permissive(terms: list[str]) -> bool:
    return bool(terms) and all(t.strip().lower() in PERMISSIVE for t in terms)


def is_vendored(relpath: str) -> bool:
    return any(part in VENDORED_DIRS for part in relpath.split("/")[:-1])


def looks_like_code(text: str) -> bool:
    lines = text.splitlines() or [""]
    alnum = sum(c.isalnum() for c in text)
    return (max(map(len, lines)) <= MAX_LINE_CHARS
            and len(text) / len(lines) <= MAX_MEAN_LINE_CHARS
            and alnum >= MIN_ALNUM_FRACTION * len(text))


def long_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= NEAR_COPY_LINE_CHARS}


def is_near_copy(text: str, protected_lines: set[str]) -> bool:
    lines = long_lines(text)
    return bool(lines) and len(lines & protected_lines) >= NEAR_COPY_FRACTION * len(lines)


def package_files(dist: md.Distribution) -> Iterable[tuple[str, str]]:
    """(path relative to site-packages, text) of the package's own .py files, in a fixed
    pseudo-random order, so a package cut at MAX_PACKAGE_BYTES keeps a sample of all of it."""
    for entry in sorted(dist.files or [], key=lambda e: _digest(e.as_posix())):
        relpath = entry.as_posix()
        if not relpath.endswith(".py") or relpath.startswith("..") or is_vendored(relpath):
            continue
        path = entry.locate()
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and looks_like_code(text):
            yield relpath, text


def collect_packages(stdlib_docs: list[Document], protected: list[Document],
                     names: Iterable[str] = PACKAGES,
                     find: Callable[[str], md.Distribution] = md.distribution,
                     ) -> tuple[dict[str, list[Document]], dict[str, dict]]:
    """Training documents of each named package, and a manifest row per package considered.
    stdlib_docs: every stdlib file (exact copies are dropped); protected: the validation and
    held-out files (near copies are dropped too)."""
    seen = {_digest(d.text) for d in stdlib_docs}
    protected_lines = set().union(*(long_lines(d.text) for d in protected))
    docs: dict[str, list[Document]] = {}
    manifest: dict[str, dict] = {}
    for name in names:
        try:
            dist = find(name)
        except md.PackageNotFoundError:
            manifest[name] = {"skipped": "not installed"}
            continue
        licence, terms = licence_terms(dist)
        row = {"version": dist.version, "licence": licence}
        if not is_permissive(terms):
            manifest[name] = row | {"skipped": "licence not on the permissive list"}
            continue
        counts = {"files": 0, "bytes": 0, "duplicates": 0, "near_copies_of_heldout_or_validation": 0,
                  "over_size_cap": 0}
        for relpath, text in package_files(dist):
            if counts["bytes"] + len(text.encode()) > MAX_PACKAGE_BYTES:
                counts["over_size_cap"] += 1
                continue
            digest = _digest(text)
            if digest in seen:
                counts["duplicates"] += 1
                continue
            seen.add(digest)
            if is_near_copy(text, protected_lines):
                counts["near_copies_of_heldout_or_validation"] += 1
                continue
            docs.setdefault(name, []).append(Document(relpath, text))
            counts["files"] += 1
            counts["bytes"] += len(text.encode())
        manifest[name] = row | counts
    return docs, manifest


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
