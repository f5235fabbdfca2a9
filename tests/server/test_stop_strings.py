"""Stop strings: same answer however the text is chunked, and never a leaked stop prefix."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve.server.stop import StopMatcher

ALPHABET = "ab c日"


def _reference(text: str, stops: list[str], include_stop: bool = False) -> tuple[str, bool]:
    """Cut at the stop occurrence that ends first (ties: starts first); before it, or after it when included."""
    hits = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(hits)[0 if include_stop else 1]], True) if hits else (text, False)


def _run(chunks: list[str], stops: list[str], include_stop: bool = False) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops, include_stop)
    out = []
    for chunk in chunks:
        emitted, hit = matcher.feed(chunk)
        out.append(emitted)
        if hit:
            return out, True
    return out + [matcher.flush()], False


@settings(max_examples=500, deadline=None)
@given(chunks=st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=12),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
def test_any_chunking_gives_the_reference_cut(chunks: list[str], stops: list[str]) -> None:
    out, hit = _run(chunks, stops)
    assert ("".join(out), hit) == _reference("".join(chunks), stops)
    out, hit = _run(chunks, stops, include_stop=True)  # vLLM's include_stop_str_in_output
    assert ("".join(out), hit) == _reference("".join(chunks), stops, include_stop=True)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=12),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_emitted_text_never_starts_a_stop_string(chunks: list[str], stops: list[str]) -> None:
    """Text already sent can never turn out to be the start of a stop string."""
    matcher = StopMatcher(stops)
    emitted = seen = ""
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        emitted, seen = emitted + text, seen + chunk
        if hit:
            break
        for start in range(len(emitted)):
            assert not any(s.startswith(seen[start:]) or seen[start:].startswith(s) for s in stops)


def test_stop_split_across_tokens_is_cut_and_not_leaked() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("hello </") == ("hello ", False)
    assert matcher.feed("en") == ("", False)
    assert matcher.feed("d> more") == ("", True)


def test_false_start_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("ay") == ("STay", False)
    assert matcher.flush() == ""
