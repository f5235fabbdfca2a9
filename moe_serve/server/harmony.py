"""gpt-oss's harmony format, through openai-harmony: a chat request rendered to harmony tokens, and
an answer's tokens read back into reasoning_content, content and tool calls.

As in vLLM: on for a gpt_oss checkpoint, or with --tool-call-parser openai / --reasoning-parser
openai_gptoss; the checkpoint's Jinja template is then not used. The prompt is harmony's system
message (reasoning effort), a developer message (the request's system and developer text as its
instructions, the tools as the `functions` namespace), then the conversation; the answer is read
by harmony's StreamableParser: the analysis channel is reasoning, a message to `functions.NAME`
is a call of NAME (its text the JSON arguments), anything else is content. One call per answer:
<|call|> ends the answer, as <|return|> does.

Constraints are written in harmony markup too, so the answer is always harmony and always read
this way: a forced call (tool_choice required or named) and a structured answer (response_format,
structured_outputs, guided_*) become Lark grammars that let the model reason first, then write the
call or the final answer; a Lark grammar a request gives constrains the raw output, markup and all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    StreamState,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from moe_serve.engine.config import ConfigError
from moe_serve.engine.messages import StructuredOutput
from moe_serve.server.errors import bad_request
from moe_serve.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeChatRequest
from moe_serve.server.reasoning import HARMONY_REASONING_PARSER
from moe_serve.server.tokenizer import Tokenizer
from moe_serve.server.tool_parsers import HARMONY_TOOL_CALL_PARSER
from moe_serve.server.tool_parsers.base import openai_call_id
from moe_serve.server.tool_parsers.forced import EMPTY_PARAMETERS
from moe_serve.server.tool_parsers.stream import ToolCallDelta

FAMILY = "gpt_oss"
FUNCTIONS = "functions."  # the namespace the request's tools are rendered in
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
# JSON in a constraint without optional whitespace, as the engine's own JSON schemas (engine/structured.py)
_JSON_OPTIONS = {"whitespace_flexible": False}
# the model's reasoning before a constrained part: any text, closed, then the next assistant message
_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"\n'
             "THOUGHT: /(.|\\n)*/\n")


def uses_harmony(tool_call_parser: str | None, reasoning_parser: str | None, chat_template: str | None,
                 family: str) -> bool:
    """Whether the server speaks harmony: asked for by either flag, or a gpt_oss checkpoint; a
    ConfigError for flags that would have something else render the prompt or read the answer."""
    asked = (("tool-call-parser", tool_call_parser, HARMONY_TOOL_CALL_PARSER),
             ("reasoning-parser", reasoning_parser, HARMONY_REASONING_PARSER))
    if not (family == FAMILY or any(value == ours for _, value, ours in asked)):
        return False
    others = [f"--{flag} {value}" for flag, value, ours in asked if value not in (None, ours)]
    if chat_template is not None:
        others.append("--chat-template")
    if others:
        raise ConfigError(f"the harmony format (gpt-oss) renders the prompt and reads tool calls and reasoning "
                          f"itself; drop {' and '.join(others)}")
    return True


def load_encoding() -> HarmonyEncoding:
    """harmony's o200k_harmony encoding; a ConfigError saying where the vocabulary comes from if it cannot load."""
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise ConfigError(f"openai-harmony cannot load its o200k_base vocabulary ({exc}): it downloads it once "
                          "into its cache; offline, set TIKTOKEN_ENCODINGS_BASE to a folder holding "
                          "o200k_base.tiktoken, or TIKTOKEN_RS_CACHE_DIR to a cache that has it") from None


class Harmony:
    """The encoding (loaded once per API server process) and what the server asks of it."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self.encoding = encoding
        # <|return|> and <|call|>: the answer is done, or waits for a tool's result
        self.stop_token_ids = tuple(encoding.stop_tokens_for_assistant_actions())
        self._message_token = encoding.encode("<|message|>", allowed_special="all")[0]

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """A ConfigError unless the served tokenizer is gpt-oss's (o200k_harmony): prompts are harmony's
        token ids and answers are read as harmony's, so both must mean the same tokens."""
        markup = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
        if tokenizer.hf.convert_tokens_to_ids(markup) != self.encoding.encode("".join(markup), allowed_special="all"):
            raise ConfigError("the harmony format needs gpt-oss's tokenizer (o200k_harmony), whose special tokens "
                              f"{', '.join(markup)} this checkpoint's tokenizer does not have at harmony's ids")

    def prompt_ids(self, body: ChatCompletionRequest | TokenizeChatRequest, tools: list[dict] | None) -> list[int]:
        """The conversation as harmony tokens, ending where the assistant's answer starts. body: a chat
        completion or /tokenize body (the fields they share); tools: OpenAI tool objects to offer."""
        if body.continue_final_message or body.add_generation_prompt is False:
            param = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
            raise bad_request("with the harmony format the prompt always ends with the assistant's turn opened",
                              param)
        leading = next((i for i, m in enumerate(body.messages) if m.role not in ("system", "developer")),
                       len(body.messages))
        instructions = "\n\n".join(m.text() or "" for m in body.messages[:leading])
        system = SystemContent.new().with_reasoning_effort(EFFORTS[_reasoning_effort(body)]) \
            .with_conversation_start_date(date.today().isoformat())
        messages = [Message.from_role_and_content(Role.SYSTEM, system)]
        if instructions or tools:
            messages.append(Message.from_role_and_content(Role.DEVELOPER, _developer(instructions, tools or [])))
        for i in range(leading, len(body.messages)):
            messages += _messages(body.messages, i)
        return self.encoding.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)

    def stream(self, calls: bool, max_calls: int | None) -> HarmonyStream:
        """A reader for one choice. calls: the request lets tools be called (else a call's text is content)."""
        return HarmonyStream(StreamableParser(self.encoding, Role.ASSISTANT, strict=False), self._message_token,
                             calls, max_calls)


def _reasoning_effort(body: ChatCompletionRequest | TokenizeChatRequest) -> str:
    """The request's reasoning_effort, else chat_template_kwargs' (the only one harmony has), else medium."""
    kwargs = dict(body.chat_template_kwargs or {})
    from_kwargs = kwargs.pop("reasoning_effort", None)
    if kwargs:
        raise bad_request(f"with the harmony format chat_template_kwargs may only set reasoning_effort, not "
                          f"'{min(kwargs)}'", "chat_template_kwargs")
    effort = body.reasoning_effort or from_kwargs or "medium"
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise bad_request(f"reasoning_effort is one of {', '.join(EFFORTS)}, got {effort!r}", "chat_template_kwargs")
    return effort


def _developer(instructions: str, tools: list[dict]) -> DeveloperContent:
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        developer = developer.with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                t["function"].get("parameters")) for t in tools])
    return developer


def _messages(conversation: list[ChatMessage], i: int) -> list[Message]:
    """conversation[i] (after the leading instructions) as harmony messages."""
    message, text = conversation[i], conversation[i].text() or ""
    if message.role in ("system", "developer"):  # later instructions stay where they were given
        return [Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(text))]
    if message.role == "user":
        return [Message.from_author_and_content(Author(role=Role.USER, name=message.name), text)]
    if message.role == "tool":
        author = Author.new(Role.TOOL, FUNCTIONS + _called_name(conversation, i))
        return [Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")]
    rendered = []
    if message.reasoning_content:
        rendered.append(Message.from_role_and_content(Role.ASSISTANT, message.reasoning_content)
                        .with_channel("analysis"))
    # beside calls, text is a preamble on the commentary channel; a turn that only reasoned (null
    # content: cut while thinking) has no final message, which would have harmony drop its reasoning
    if text or not (message.tool_calls or message.content is None):
        rendered.append(Message.from_role_and_content(Role.ASSISTANT, text)
                        .with_channel("commentary" if message.tool_calls else "final"))
    for call in message.tool_calls or ():
        rendered.append(Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
                        .with_channel("commentary").with_recipient(FUNCTIONS + call.function.name)
                        .with_content_type("<|constrain|>json"))
    return rendered


def _called_name(conversation: list[ChatMessage], i: int) -> str:
    """The function a tool message answers: its name, else that of the call its tool_call_id names."""
    if conversation[i].name is not None:
        return conversation[i].name
    for earlier in conversation[:i]:
        for call in earlier.tool_calls or ():
            if call.id == conversation[i].tool_call_id:
                return call.function.name
    raise bad_request(f"no earlier assistant message made the call '{conversation[i].tool_call_id}' (harmony "
                      "names the function a result comes from)", f"messages.{i}.tool_call_id")


def forced_call(parameters_by_name: dict[str, dict | None]) -> StructuredOutput:
    """tool_choice required (any of the functions) or a named function (one): the model may reason,
    then calls one of them with arguments valid for its schema."""
    calls = [f'call_{n}: <|channel|> "commentary to={FUNCTIONS}{name} " <|constrain|> "json" <|message|> '
             f"{_json_lark(parameters or EMPTY_PARAMETERS)} <|call|>"
             for n, (name, parameters) in enumerate(parameters_by_name.items())]
    choices = " | ".join(f"call_{n}" for n in range(len(calls)))
    return StructuredOutput("grammar", f"start: analysis? ({choices})\n{_ANALYSIS}" + "\n".join(calls))


def final_answer(structured: StructuredOutput) -> StructuredOutput:
    """A structured output as a constraint on the final answer, after optional reasoning; a Lark grammar
    stays as it is, constraining the raw output (it can name harmony's special tokens itself)."""
    if structured.kind == "grammar":
        return structured
    return StructuredOutput("grammar", 'start: analysis? <|channel|> "final" <|message|> answer <|return|>\n'
                                       f"{_ANALYSIS}answer: {_answer_lark(structured)}")


def _answer_lark(structured: StructuredOutput) -> str:
    if structured.kind == "json_schema":
        return _json_lark(json.loads(structured.spec))
    if structured.kind == "json_object":
        return _json_lark({"type": "object"})
    if structured.kind == "choice":
        return " | ".join(json.dumps(choice) for choice in json.loads(structured.spec))  # Lark's strings are JSON's
    return f"/{_lark_regex_body(structured.spec)}/"


def _json_lark(schema: dict) -> str:
    return f"%json {json.dumps({'x-guidance': _JSON_OPTIONS, **schema})}"


def _lark_regex_body(pattern: str) -> str:
    """pattern inside Lark's /.../: its unescaped slashes escaped, its line breaks written as escapes."""
    out, i = [], 0
    while i < len(pattern):
        piece = pattern[i:i + 2] if pattern[i] == "\\" else pattern[i]
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(piece, piece))
        i += len(piece)
    return "".join(out)


@dataclass
class HarmonyPart:
    """What one token (or the end of the answer) adds to each part of a choice."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class HarmonyStream:
    """One choice's tokens -> reasoning, content and tool-call deltas.

    Fed token ids, not text: harmony's markup is special tokens, which the text cannot tell from
    the same characters written by the model (re-encoding the text would turn them into markup),
    and re-encoding a growing text is neither cheap nor prefix-stable. Streamed and whole answers
    agree because the choice feeds tokens one at a time either way (moe_serve/server/choice.py)."""

    def __init__(self, parser: StreamableParser, message_token: int, calls: bool, max_calls: int | None) -> None:
        self._parser, self._message_token = parser, message_token
        self._calls, self._max_calls = calls, max_calls
        self._call_count = 0
        self._kind = "content"  # of the message being written: content, reasoning, call or dropped
        self.reasoning_tokens = 0  # tokens of analysis messages' text (their headers and <|end|> not)

    @property
    def called(self) -> bool:
        return self._call_count > 0

    def add(self, token: int) -> HarmonyPart:
        """What token adds. Nothing is held back for later: at the end of the answer an unfinished
        header and the bytes of a cut character are simply dropped."""
        try:
            self._parser.process(token)
        except HarmonyError:  # outside any message (text after <|end|> without <|start|>): no part's
            return HarmonyPart()
        text = self._parser.last_content_delta
        if token == self._message_token and text is None:  # a header is complete: its message's kind is known
            return self._open(self._parser.current_channel, self._parser.current_recipient)
        if self._kind == "reasoning" and self._parser.state == StreamState.CONTENT:
            self.reasoning_tokens += 1  # one holding part of a character too
        return self._part(text or "")

    def _open(self, channel: str | None, recipient: str | None) -> HarmonyPart:
        if recipient is not None and recipient.startswith(FUNCTIONS) and self._calls:
            if self._max_calls is not None and self._call_count >= self._max_calls:
                self._kind = "dropped"  # parallel_tool_calls false: the calls after the first
                return HarmonyPart()
            self._kind = "call"
            self._call_count += 1
            call = ToolCallDelta(self._call_count - 1, openai_call_id(), recipient[len(FUNCTIONS):])
            return HarmonyPart(tool_calls=[call])
        self._kind = "reasoning" if channel == "analysis" else "content"
        return HarmonyPart()

    def _part(self, text: str) -> HarmonyPart:
        if not text or self._kind == "dropped":
            return HarmonyPart()
        if self._kind == "call":
            return HarmonyPart(tool_calls=[ToolCallDelta(self._call_count - 1, arguments=text)])
        return HarmonyPart(reasoning=text) if self._kind == "reasoning" else HarmonyPart(content=text)
