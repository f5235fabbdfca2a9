"""Every tool-call parser on its family's format: whole text and any chunking give the same calls
and content, and the markup never reaches the content."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_serve.server.tool_parsers import TOOL_PARSERS
from moe_serve.server.tool_parsers.base import ToolParser
from moe_serve.server.tool_parsers.forced import NamedParser, RequiredParser
from moe_serve.server.tool_parsers.stream import ToolCallDelta, ToolCallStream, merge_tool_call_deltas

WEATHER = {"city": "Pa\"ris }", "days": [1, {"x": "]"}], "unit": None}
WEATHER_TEXT = json.dumps(WEATHER)
EXPECTED = [("get_weather", WEATHER_TEXT), ("get_time", '{"zone": "UTC"}')]

# (parser, model output with a text preamble where the format has one, content, marker that must not leak)
CASES = {
    "hermes": (TOOL_PARSERS["hermes"](),
               (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}\n</tool_call>\n'
                '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'),
               "Let me check.\n", "<tool_call>"),
    "mistral": (TOOL_PARSERS["mistral"](),
                (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}, '
                 '{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
                "", "[TOOL_CALLS]"),
    "mistral_v11": (TOOL_PARSERS["mistral"](),
                    f'[TOOL_CALLS]get_weather[ARGS]{WEATHER_TEXT}[TOOL_CALLS]get_time[ARGS]{{"zone": "UTC"}}',
                    "", "[ARGS]"),
    "llama3_json": (TOOL_PARSERS["llama3_json"](),
                    (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER_TEXT}}}; '
                     '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
                    "", "python_tag"),
    "deepseek_v3": (TOOL_PARSERS["deepseek_v3"](),
                    ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                     f"```json\n{WEATHER_TEXT}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                     'get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
                    "Checking.", "tool▁"),
    "glm45": (TOOL_PARSERS["glm45"](),
              ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa\"ris }</arg_value>\n"
               '<arg_key>days</arg_key>\n<arg_value>[1, {"x": "]"}]</arg_value>\n<arg_key>unit</arg_key>\n'
               "<arg_value>null</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n"
               "<arg_value>UTC</arg_value>\n</tool_call>"),
              "Checking.\n", "arg_"),
    # as its template prints them: None in Python's spelling, read by the schema
    "qwen3_coder": (TOOL_PARSERS["qwen3_coder"]({"get_weather": {"properties": {"city": {"type": "string"},
                                                                             "unit": {"type": "null"}}}}),
                    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\"ris }\n</parameter>\n"
                     '<parameter=days>\n[1, {"x": "]"}]\n</parameter>\n<parameter=unit>\nNone\n</parameter>\n'
                     "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
                     "</parameter>\n</function>\n</tool_call>"),
                    "Checking.\n", "parameter"),
    "minimax_m2": (TOOL_PARSERS["minimax_m2"](),
                   ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Pa"ris }'
                    '</parameter>\n<parameter name="days">[1, {"x": "]"}]</parameter>\n<parameter name="unit">null'
                    '</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n'
                    '</invoke>\n</minimax:tool_call>'),
                   "Checking.\n", "invoke"),
    "required": (RequiredParser(),
                 f'[{{"name":"get_weather","parameters":{WEATHER_TEXT}}},{{"name":"get_time","parameters":{{"zone": "UTC"}}}}]',
                 "", "parameters"),
}


def read(parser: ToolParser, pieces: list[str], max_calls: int | None = None) -> tuple[str, list[ToolCallDelta], list]:
    """(content, whole calls, every delta) of a choice whose text arrives in these pieces."""
    stream = ToolCallStream(parser, max_calls)
    content, calls, deltas = "", [], []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas.extend(new)
        merge_tool_call_deltas(calls, new)
    return content, calls, deltas


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)] + [""]  # the last feed carries no text


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_output_gives_the_calls_and_the_content(case: str) -> None:
    parser, text, content, _ = CASES[case]
    got_content, calls, _ = read(parser, [text])
    assert got_content == content
    assert [(c.name, c.arguments) for c in calls] == EXPECTED
    assert all(json.loads(c.arguments) for c in calls)
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("case", sorted(CASES))
@given(cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_streamed_pieces_add_up_to_the_same_calls_and_never_leak_markup(case: str, cuts: list[int]) -> None:
    parser, text, content, marker = CASES[case]
    got_content, calls, deltas = read(parser, chunked(text, cuts))
    assert got_content == content
    assert [(c.name, c.arguments) for c in calls] == EXPECTED
    first_deltas = [d for d in deltas if d.id is not None]
    assert [d.index for d in first_deltas] == [0, 1] and all(d.name for d in first_deltas)
    assert marker not in got_content


def test_one_token_at_a_time_streams_the_arguments_in_pieces() -> None:
    parser, text, _, _ = CASES["hermes"]
    _, _, deltas = read(parser, list(text) + [""])
    pieces = [d for d in deltas if d.index == 0 and d.id is None]
    assert len(pieces) > 10 and "".join(d.arguments for d in pieces).endswith("}")


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_stays_content(name: str) -> None:
    text = "def f(x):\n    return [x, {'a': 1}]  # no tool here <tool or [TOOL"
    content, calls, _ = read(TOOL_PARSERS[name](), chunked(text, [3, 17, 40]))
    assert content == text and calls == []


def test_markup_that_holds_no_call_comes_back_as_content() -> None:
    text = "Sure <tool_call> not json at all"
    content, calls, _ = read(TOOL_PARSERS["hermes"](), chunked(text, [6, 9, 20]))
    assert content == text and calls == []


def test_llama3_json_only_at_the_start() -> None:
    text = 'The answer is {"name": "f", "parameters": {}}'
    assert read(TOOL_PARSERS["llama3_json"](), [text])[:2] == (text, [])


def test_calls_cut_by_max_tokens_keep_their_partial_arguments() -> None:
    content, calls, _ = read(TOOL_PARSERS["hermes"](), ['<tool_call>{"name": "f", "arguments": {"a": [1, 2'])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, 2')]


def test_a_call_without_arguments_gets_an_empty_object() -> None:
    _, calls, _ = read(TOOL_PARSERS["hermes"](), ['<tool_call>{"name": "now"}</tool_call>'])
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parser, text, _, _ = CASES["hermes"]
    _, calls, _ = read(parser, list(text) + [""], max_calls=1)
    assert [(c.name, c.arguments) for c in calls] == EXPECTED[:1]


@given(cuts=st.lists(st.integers(min_value=0), max_size=6))
def test_a_named_function_is_the_whole_output(cuts: list[int]) -> None:
    content, calls, deltas = read(NamedParser("get_weather"), chunked(WEATHER_TEXT, cuts))
    assert content == "" and [(c.name, c.arguments) for c in calls] == [EXPECTED[0]]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    parser, text, _, _ = CASES["mistral"]
    _, calls, _ = read(parser, [text])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_glm45_values_take_their_types_from_the_tools_schemas() -> None:
    """GLM-4.5 writes a string argument bare and any other as JSON: the schema tells "123" the string
    from 123 the number; without it, what reads as JSON is JSON."""
    text = ("<tool_call>lookup\n<arg_key>code</arg_key>\n<arg_value>123</arg_value>\n<arg_key>n</arg_key>\n"
            "<arg_value>7</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\"]</arg_value>\n</tool_call>")
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array"}}}
    _, [call], _ = read(TOOL_PARSERS["glm45"]({"lookup": schema}), chunked(text, [30, 77]))
    assert json.loads(call.arguments) == {"code": "123", "n": 7, "tags": ["a"]}
    _, [call], _ = read(TOOL_PARSERS["glm45"](), [text])
    assert json.loads(call.arguments) == {"code": 123, "n": 7, "tags": ["a"]}
    _, [call], _ = read(TOOL_PARSERS["glm45"](), ["<tool_call>now\n</tool_call>"])
    assert (call.name, call.arguments) == ("now", "{}")


def test_qwen3_coder_booleans_and_numbers_follow_the_schema() -> None:
    text = ("<tool_call>\n<function=run>\n<parameter=dry>\nTrue\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
            "<parameter=note>\n  two lines\nkept  \n</parameter>\n</function>\n</tool_call>")
    schema = {"properties": {"dry": {"type": "boolean"}, "n": {"type": "integer"}, "note": {"type": "string"}}}
    _, [call], _ = read(TOOL_PARSERS["qwen3_coder"]({"run": schema}), chunked(text, [25, 60, 101]))
    assert json.loads(call.arguments) == {"dry": True, "n": 3, "note": "  two lines\nkept  "}
