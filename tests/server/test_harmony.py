"""The harmony format (gpt-oss) without a model: a conversation rendered through openai-harmony, answers
read back from their tokens the same however the engine's outputs chunk them, the constraints written
in its markup, and the flags that turn it on."""
from __future__ import annotations

import itertools
from datetime import date
from pathlib import Path

import llguidance
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_serve.engine.config import ConfigError
from moe_serve.engine.messages import RequestOutput, SamplingParams, StructuredOutput
from moe_serve.engine.structured import Grammars, grammar_text
from moe_serve.server.choice import ChoiceDecoder, TextOptions
from moe_serve.server.errors import APIError
from moe_serve.server.harmony import Harmony, final_answer, forced_call, load_encoding, uses_harmony
from moe_serve.server.prompts import chat_prompts
from moe_serve.server.protocol import ChatCompletionRequest
from moe_serve.server.tokenizer import Tokenizer
from moe_serve.server.tool_parsers.tool_choice import tool_calling
from tests.server.tiny_tokenizer import build_tiny_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "Where"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
]
RENDERED = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: TODAY\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// The weather in a city\ntype get_weather = (_: {\n// Where\ncity: string,\n}) => any;\n\n"
    "type now = () => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}<|end|>'
    "<|start|>assistant"
)

ANSWER = ("<|channel|>analysis<|message|>The user wants 日本 🙂 & <b>.<|end|><|start|>assistant<|channel|>final"
          "<|message|>Hi <b>there</b>!<|return|>")
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
PREAMBLE_CALL = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
                 "to=functions.now<|message|>{}<|call|>")
# (answer, tokens cut off its end, calls allowed) -> (reasoning, content, calls, finish_reason)
CASES = [
    ((ANSWER, 0, True), ("The user wants 日本 🙂 & <b>.", "Hi <b>there</b>!", [], "stop")),
    ((CALL, 0, True), ("Need the weather.", "", [("get_weather", '{"city":"Paris"}')], "tool_calls")),
    ((PREAMBLE_CALL, 0, True), ("", "Checking.", [("now", "{}")], "tool_calls")),
    ((CALL, 0, False), ("Need the weather.", '{"city":"Paris"}', [], "stop")),  # tool_choice none: only text
    ((CALL, 3, True), ("Need the weather.", "", [("get_weather", '{"city":"')], "length")),  # cut in the arguments
    ((ANSWER, 11, True), ("The user wants 日本 🙂 & <b>.", "", [], "length")),  # cut in the final header
    (("<|channel|>final<|message|>x<|end|>text outside any message", 0, True), ("", "x", [], "length")),
    # a special token inside a message is its text, never a new message (the parser is not strict)
    (("<|channel|>commentary to=functions.now<|message|>{<|message|>}<|call|>", 0, True),
     ("", "", [("now", "{<|message|>}")], "tool_calls")),
]


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(str(gpt_oss_tokenizer_dir))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(lambda: tokenizer.hf)


def body(**fields) -> ChatCompletionRequest:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": CONVERSATION, **fields})
    request.check()
    return request


def test_the_gpt_oss_tokenizer_encodes_as_harmony(harmony: Harmony, tokenizer: Tokenizer) -> None:
    text = RENDERED + ANSWER + " naïve 日本語 🙂 x=12345;\n\n  "
    assert tokenizer.encode(text, add_special_tokens=False) == harmony.encoding.encode(text, allowed_special="all")


def test_a_conversation_with_tools_a_call_and_its_result_renders_as_harmony(harmony: Harmony) -> None:
    request = body(tools=TOOLS, reasoning_effort="high")
    ids = harmony.prompt_ids(request, TOOLS)
    assert harmony.encoding.decode(ids) == RENDERED.replace("TODAY", date.today().isoformat())
    assert chat_prompts(request, None, TOOLS, harmony) == [ids]  # the chat path's prompt, templates unused


@pytest.mark.parametrize(("fields", "effort"), [({}, "medium"), ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "low"),
                                                ({"reasoning_effort": "high", "chat_template_kwargs": {}}, "high")])
def test_reasoning_effort_from_the_field_or_chat_template_kwargs(harmony: Harmony, fields: dict, effort: str) -> None:
    rendered = harmony.encoding.decode(harmony.prompt_ids(body(**fields), None))
    assert f"\nReasoning: {effort}\n" in rendered
    assert "# Tools" not in rendered and "# Instructions\n\nBe brief." in rendered


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"reasoning_effort": "extreme"}}, "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": [*CONVERSATION[:3], {"role": "tool", "tool_call_id": "c9", "content": "?"}]}, "messages.3.tool_call_id"),
])
def test_what_harmony_cannot_render_is_a_400_naming_the_field(harmony: Harmony, fields: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        harmony.prompt_ids(body(**fields), None)
    assert err.value.status == 400 and err.value.param == param


def test_reasoning_effort_without_harmony_is_a_400(tokenizer: Tokenizer) -> None:
    with pytest.raises(APIError) as err:
        chat_prompts(body(reasoning_effort="low"), tokenizer)
    assert err.value.param == "reasoning_effort"


def decode(harmony: Harmony, tokenizer: Tokenizer, ids: list[int], bounds: list[int], calls: bool = True,
           finish_reason: str = "stop", stops: tuple[str, ...] = ()) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls, finish_reason) of an answer whose tokens the engine sent in the pieces
    that bounds cut, the last with finish_reason."""
    params = SamplingParams(max_tokens=len(ids), stop_token_ids=harmony.stop_token_ids)
    choice = ChoiceDecoder(0, tokenizer, TextOptions(stops), params, harmony=harmony.stream(calls, None))
    reasoning = content = ""
    made: list[list[str]] = []
    pieces = list(itertools.pairwise(bounds))
    for n, (a, b) in enumerate(pieces):
        delta = choice.consume(RequestOutput("r", tuple(ids[a:b]), finish_reason=finish_reason if n == len(pieces) - 1 else None))
        reasoning, content = reasoning + delta.reasoning, content + delta.text
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(made) and call.id.startswith("call_")
                made.append([call.name, ""])
            made[call.index][1] += call.arguments
        if delta.finish_reason is not None:
            return reasoning, content, [tuple(c) for c in made], delta.finish_reason
    raise AssertionError("the choice never finished")


@pytest.mark.parametrize(("answer", "expected"), CASES)
@given(cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_chunking_of_the_tokens_gives_the_same_parts(harmony: Harmony, tokenizer: Tokenizer, answer: tuple,
                                                          expected: tuple, cuts: list[int]) -> None:
    text, cut, calls = answer
    ids = harmony.encoding.encode(text, allowed_special="all")
    ids = ids[:len(ids) - cut]
    finish = "stop" if ids[-1] in harmony.stop_token_ids else "length"
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    assert decode(harmony, tokenizer, ids, bounds, calls, finish) == expected


@pytest.mark.parametrize(("answer", "reasoning"), [
    (ANSWER, "The user wants 日本 🙂 & <b>."), (CALL, "Need the weather."), (PREAMBLE_CALL, ""),
    (ANSWER[:ANSWER.index("<b>.")], "The user wants 日本 🙂 & "),  # cut while reasoning
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_tokens_are_the_analysis_texts_tokens(harmony: Harmony, tokenizer: Tokenizer, answer: str,
                                                        reasoning: str, step: int) -> None:
    """Counted token by token (its markup not), the same however the engine chunks the answer."""
    ids = harmony.encoding.encode(answer, allowed_special="all")
    params = SamplingParams(max_tokens=len(ids), stop_token_ids=harmony.stop_token_ids)
    choice = ChoiceDecoder(0, tokenizer, TextOptions(), params, harmony=harmony.stream(True, None))
    for a in range(0, len(ids), step):
        last = a + step >= len(ids)
        choice.consume(RequestOutput("r", tuple(ids[a:a + step]), finish_reason="stop" if last else None))
    assert choice.reasoning_tokens == len(harmony.encoding.encode(reasoning))


def test_a_turn_that_only_reasoned_keeps_its_reasoning(harmony: Harmony) -> None:
    """Null content (a turn cut while thinking, a Responses reasoning item alone): no final message,
    which would have harmony drop the analysis before it; empty content is an empty final message."""
    def rendered(content: str | None) -> str:
        messages = [CONVERSATION[1], {"role": "assistant", "content": content, "reasoning_content": "Hmm."},
                    {"role": "user", "content": "Go on."}]
        return harmony.encoding.decode(harmony.prompt_ids(body(messages=messages), None))
    assert rendered(None).endswith("<|start|>assistant<|channel|>analysis<|message|>Hmm.<|end|>"
                                   "<|start|>user<|message|>Go on.<|end|><|start|>assistant")
    assert "Hmm." not in rendered("") and "<|channel|>final<|message|><|end|>" in rendered("")


def test_a_stop_string_ends_the_content_not_the_reasoning(harmony: Harmony, tokenizer: Tokenizer) -> None:
    ids = harmony.encoding.encode(ANSWER, allowed_special="all")
    reasoning, content, _, finish = decode(harmony, tokenizer, ids, list(range(len(ids) + 1)), stops=("wants", "there"))
    assert (reasoning, content, finish) == ("The user wants 日本 🙂 & <b>.", "Hi <b>", "stop")


def accepts(grammars: Grammars, tokenizer: Tokenizer, structured: StructuredOutput, text: str) -> bool:
    """Whether the constraint lets the model write text, to its end."""
    grammars.check(structured)
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar_text(structured))
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.consume_token(token)
    return not matcher.is_error() and matcher.is_accepting()


def test_a_forced_call_lets_the_model_reason_then_call_one_function(grammars: Grammars, tokenizer: Tokenizer) -> None:
    required = forced_call({"get_weather": WEATHER, "now": None})
    assert accepts(grammars, tokenizer, required, CALL)
    assert accepts(grammars, tokenizer, required, "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|call|>")
    assert not accepts(grammars, tokenizer, required, CALL.replace('"city"', '"town"'))  # the schema holds
    assert not accepts(grammars, tokenizer, required, PREAMBLE_CALL)  # nothing but the call after the reasoning
    assert not accepts(grammars, tokenizer, forced_call({"now": None}), CALL)  # a named function: that one


def test_tool_choice_in_harmony_needs_no_parser_flag(grammars: Grammars) -> None:
    auto = tool_calling(body(tools=TOOLS), None, grammars, harmony=True)
    assert auto.parser is None and auto.structured is None and auto.template_tools == TOOLS
    named = tool_calling(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), None,
                         grammars, harmony=True)
    assert named.parser is None and named.structured == forced_call({"now": None})
    assert tool_calling(body(tools=TOOLS, tool_choice="none"), None, grammars, harmony=True) is None


@pytest.mark.parametrize(("structured", "answer"), [
    (StructuredOutput("json_schema", '{"type": "object", "required": ["a"]}'), '{"a":[1,2]}'),
    (StructuredOutput("json_object", ""), "{}"),
    (StructuredOutput("regex", "a/b\\d+"), "a/b12"),
    (StructuredOutput("choice", '["yes", "no"]'), "no"),
])
def test_a_structured_answer_is_the_final_message(grammars: Grammars, tokenizer: Tokenizer,
                                                   structured: StructuredOutput, answer: str) -> None:
    constrained = final_answer(structured)
    final = f"<|channel|>final<|message|>{answer}<|return|>"
    assert accepts(grammars, tokenizer, constrained, final)
    assert accepts(grammars, tokenizer, constrained, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + final)
    assert not accepts(grammars, tokenizer, constrained, f"<|channel|>final<|message|>{answer}!<|return|>")


def test_a_lark_grammar_constrains_the_raw_output() -> None:
    grammar = StructuredOutput("grammar", 'start: <|channel|> "final" <|message|> "hi" <|return|>')
    assert final_answer(grammar) == grammar


@pytest.mark.parametrize(("flags", "family", "expected"), [
    ((None, None, None), "mixtral", False),
    (("openai", None, None), "qwen3_moe", True),
    ((None, "openai_gptoss", None), "qwen3_moe", True),
    ((None, None, None), "gpt_oss", True),
    (("openai", "openai_gptoss", None), "gpt_oss", True),
    (("hermes", None, None), "gpt_oss", "--tool-call-parser hermes"),
    (("openai", "deepseek_r1", None), "qwen3_moe", "--reasoning-parser deepseek_r1"),
    ((None, None, "{{ messages }}"), "gpt_oss", "--chat-template"),
])
def test_harmony_is_on_for_gpt_oss_or_either_flag(flags: tuple, family: str, expected: bool | str) -> None:
    if isinstance(expected, bool):
        assert uses_harmony(*flags, family) is expected
        return
    with pytest.raises(ConfigError, match=expected):
        uses_harmony(*flags, family)


def test_harmony_needs_gpt_oss_s_tokenizer(harmony: Harmony, tokenizer: Tokenizer, tmp_path: Path) -> None:
    harmony.check_tokenizer(tokenizer)
    build_tiny_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="o200k_harmony"):
        harmony.check_tokenizer(Tokenizer(str(tmp_path)))


def test_a_vocabulary_that_cannot_load_says_where_it_comes_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # no o200k_base.tiktoken there: nothing downloaded
    with pytest.raises(ConfigError, match="TIKTOKEN_ENCODINGS_BASE"):
        load_encoding()
