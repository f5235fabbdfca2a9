"""Stop strings over streamed text: detect them across token boundaries and never leak them."""
from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds text deltas through; emits only text that cannot be the start of a stop string.

    The stop that counts is the one that *ends* first (ties: the one that starts first), which
    is what a client reading token by token would see, so the result is the same however the
    text is chunked. include_stop (vLLM's include_stop_str_in_output) keeps the stop string
    itself as the end of the text.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include_stop = include_stop
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self._pending += text
        stop = self._first_stop()
        if stop is not None:
            end, start = stop
            emitted, self._pending = self._pending[:end if self._include_stop else start], ""
            return emitted, True
        hold = self._held_suffix_length()
        emitted = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(emitted):]
        return emitted, False

    def flush(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        rest, self._pending = self._pending, ""
        return rest

    def _first_stop(self) -> tuple[int, int] | None:
        """(end, start) of the stop string that ends first in the pending text."""
        hits = [(i + len(s), i) for s in self._stops if (i := self._pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _held_suffix_length(self) -> int:
        longest = max((len(s) for s in self._stops), default=0)
        for k in range(min(len(self._pending), longest - 1), 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
