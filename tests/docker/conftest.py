"""The Dockerfile read as instructions, the .dockerignore as Docker applies it, and the shared
test server (for the healthcheck's route)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import cache

from tests.server.conftest import REPO, server, tiny_model  # noqa: F401  (fixtures, re-exported)


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, ARG, COPY, RUN, ...
    args: str


@cache
def dockerfile() -> tuple[Instruction, ...]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines = [line for line in (REPO / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return tuple(Instruction(keyword.upper(), args.strip())
                 for keyword, _, args in (line.strip().partition(" ") for line in joined.splitlines() if line.strip()))


def instructions(keyword: str) -> list[str]:
    return [i.args for i in dockerfile() if i.keyword == keyword]


def arg_default(name: str) -> str:
    [value] = [args.split("=", 1)[1] for args in instructions("ARG") if args.startswith(name + "=")]
    return value


def copy_sources() -> list[str]:
    """Every source path of every COPY (the last word is the destination)."""
    return [source for args in instructions("COPY") for source in shlex.split(args)[:-1]]


def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker reads it: `**` spans directories, `*` and `?` do not."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


@cache
def _dockerignore() -> tuple[tuple[bool, re.Pattern], ...]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, _pattern_regex(line.lstrip("!").strip("/"))))
    return tuple(rules)


def ignored(path: str) -> bool:
    """Whether the build context leaves out `path` (relative to the repository): the last rule
    that matches the path or one of its parent directories decides."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    verdict = False
    for negated, regex in _dockerignore():
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = not negated
    return verdict
