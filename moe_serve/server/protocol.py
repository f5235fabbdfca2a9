"""The OpenAI request bodies this server accepts, as strict pydantic models.

extra="forbid" turns every field not declared here (suffix, best_of, audio, ...)
into a 400 that names it; strict=True refuses "5" for an int instead of coercing it.
A null value means "use the default", as the OpenAI API treats it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from jsonschema import (
    Draft3Validator,
    Draft4Validator,
    Draft6Validator,
    Draft7Validator,
    Draft201909Validator,
    Draft202012Validator,
)
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from moe_serve.server.errors import bad_request

MAX_N = 16
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_LOGIT_BIAS = 1024  # entries; each is a scatter into the row's logits at every step
MAX_STOP_TOKEN_IDS = 64
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, values up to 512 characters


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call an earlier assistant turn made, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only on an assistant turn that made tool calls
    name: str | None = None  # the participant's name, passed to the chat template
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    # assistant turns: their reasoning, as this server answered it (an agent loop sends it back so the
    # model keeps its chain of thought across tool calls); to the chat template as reasoning_content
    reasoning_content: str | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def check(self, at: str) -> None:
        """Rules across this message's fields; at: its path in the body ("messages.3")."""
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning_content)):
            raise bad_request("content may be null only on an assistant message with tool_calls or "
                              "reasoning_content", f"{at}.content")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{at}.tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry reasoning_content", f"{at}.reasoning_content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise bad_request("a tool message needs tool_call_id, and only a tool message has one",
                              f"{at}.tool_call_id")


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # accepted: a forced call always follows the schema, an "auto" one is parsed as written

    def check(self, at: str) -> None:
        if self.parameters is None:
            return
        draft = _schema_draft(self.parameters.get("$schema", Draft202012Validator.META_SCHEMA["$id"]))
        if draft is None:
            raise bad_request("the parameters' $schema is not a JSON Schema draft this server knows "
                              "(3, 4, 6, 7, 2019-09, 2020-12)", f"{at}.parameters")
        try:
            draft.check_schema(self.parameters)
        except SchemaError as exc:
            raise bad_request(f"the parameters are not a valid JSON Schema: {exc.message}",
                              f"{at}.parameters") from None


def _schema_draft(uri: object) -> type[Validator] | None:
    """The validator of the draft a $schema URI names (http or https, with or without '#')."""
    if not isinstance(uri, str):
        return None
    return _SCHEMA_DRAFTS.get(uri.split("://", 1)[-1].rstrip("#"))


_SCHEMA_DRAFTS = {draft.META_SCHEMA.get("$id", draft.META_SCHEMA.get("id", "")).split("://", 1)[-1].rstrip("#"): draft
                  for draft in (Draft3Validator, Draft4Validator, Draft6Validator, Draft7Validator,
                                Draft201909Validator, Draft202012Validator)}


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice | None


StopField = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None


class JsonSchemaSpec(_Strict):
    """response_format.json_schema. The schema is always enforced, whatever strict says."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # "schema": BaseModel's own attribute
    strict: bool | None = None
    description: str | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: Any) -> str:
    """The union tag of a response_format: "type=..." so that error paths skip it (moe_serve/server/errors.py)."""
    return f"type={value.get('type') if isinstance(value, dict) else getattr(value, 'type', None)}"


ResponseFormatField = Annotated[Annotated[TextFormat, Tag("type=text")]
                                | Annotated[JsonObjectFormat, Tag("type=json_object")]
                                | Annotated[JsonSchemaFormat, Tag("type=json_schema")], Discriminator(_format_type)]


class StructuredOutputsParams(_Strict):
    """vLLM's structured_outputs extra: exactly one of its fields (moe_serve/server/structured.py checks)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # "json": BaseModel's own attribute
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect)
    json_object: bool | None = None


class GenerationFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extension (vLLM's spelling); 0 = off
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1 - MAX_N)] | None = None  # n choices use seed + i
    stop: StopField = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None  # logged with the request id, for tracing abuse back to an end user
    # OpenAI's logit_bias (token id as a string -> bias) and vLLM's sampling extras
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # accepted and documented as not changing the output: nothing is stored, there is one tier
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # vLLM's extra: each prompt token's logprob (the first has none) with this many alternatives
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # structured outputs (constrained decoding, moe_serve/server/structured.py): OpenAI's field, vLLM's extras
    response_format: ResponseFormatField | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def check(self) -> None:
        """Rules across fields (a 400 naming the field), checked after the per-field ones."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they belong to no chunk
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def echoes_prompt(self) -> bool:
        """The answer repeats the prompt, so max_tokens 0 (score the prompt, generate nothing) makes sense."""
        return False

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class ChatTemplateFields(_Strict):
    """vLLM's chat-template controls: chat completions and POST /tokenize."""

    add_generation_prompt: bool | None = None  # default true: the prompt ends with an open assistant turn
    continue_final_message: bool | None = None  # the prompt ends inside the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking, ...)
    # OpenAI's field; the harmony format's system message says it (moe_serve/server/harmony.py), other
    # templates take their own switches through chat_template_kwargs
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def check_template(self, messages: list[ChatMessage]) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message continues the last message; it cannot be combined with "
                              "add_generation_prompt: true", "continue_final_message")
        if self.continue_final_message and messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of Tokenizer.chat_prompt_ids."""
        return {"add_generation_prompt": not self.continue_final_message and self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message),
                "template_kwargs": self.chat_template_kwargs or {}}


class ChatCompletionRequest(GenerationFields, ChatTemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceField = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true: one answer may make several calls

    def check(self) -> None:
        super().check()
        self.check_template(self.messages)
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_completion_tokens or max_tokens, not both", "max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")
        self._check_tools()

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or ()]
        for i, tool in enumerate(self.tools or ()):
            tool.function.check(f"tools.{i}.function")
        if len(set(names)) < len(names):
            raise bad_request("function names in tools must be unique", "tools")
        if self.tool_choice not in (None, "none") and not names:
            raise bad_request("tool_choice other than 'none' needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names the function '{self.tool_choice.function.name}', "
                              "which is not in tools", "tool_choice")

    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptField = (
    str
    | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(GenerationFields):
    prompt: PromptField
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None  # the choice's text (and logprobs) start with the prompt's

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def echoes_prompt(self) -> bool:
        return bool(self.echo)

    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs repeats the prompt's logprobs too, so the engine scores the prompt."""
        asked = (self.prompt_logprobs, self.logprobs if self.echo else None)
        return max((n for n in asked if n is not None), default=None)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize of text (vLLM's body)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS and friends, as /v1/completions adds them
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize of messages (vLLM's body), rendered as /v1/chat/completions renders them."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        self.check_template(self.messages)
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class ResponsesContentPart(_Strict):
    """Text of an input message; an earlier answer sent back keeps its output_text parts."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponsesInputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContentPart]
    id: str | None = None  # an output item sent back as input keeps its id and status
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponsesFunctionCall(_Strict):
    """A call an earlier answer made, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponsesReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ResponsesSummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ResponsesReasoningItem(_Strict):
    """An earlier answer's reasoning sent back as input (clients that keep their own history): its
    reasoning_text content, else its summary, becomes the reasoning_content of the assistant turn it opens."""

    type: Literal["reasoning"]
    summary: list[ResponsesSummaryText] | None = None
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: str | None = None  # never issued here: unreadable, so ignored beside readable text
    id: str | None = None
    status: str | None = None

    def reasoning(self, at: str) -> str:
        """The reasoning's text; at: this item's path in the body ("input.2")."""
        if self.content:
            return "".join(part.text for part in self.content)
        if self.summary:
            return "\n\n".join(part.text for part in self.summary)
        if self.encrypted_content is not None:
            raise bad_request("a reasoning item with only encrypted_content cannot be read by this server (it "
                              "issues none); send its content or summary", f"{at}.encrypted_content")
        raise bad_request("a reasoning item needs its reasoning_text content or its summary", f"{at}.content")


_INPUT_KINDS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
                "reasoning": "Reasoning"}


def _input_kind(item: object) -> str | None:
    """The union tag of an input item (CamelCase, so error locations leave it out of `param`)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return _INPUT_KINDS.get(kind or "message")


ResponsesInputItem = Annotated[
    Annotated[ResponsesInputMessage, Tag("Message")] | Annotated[ResponsesFunctionCall, Tag("FunctionCall")]
    | Annotated[ResponsesFunctionCallOutput, Tag("FunctionCallOutput")]
    | Annotated[ResponsesReasoningItem, Tag("Reasoning")], Discriminator(_input_kind)]


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # BaseModel has a .schema
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat completions response_format this format is (None: plain text)."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class ResponsesText(_Strict):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Strict):
    """reasoning.effort; no summary: this server does not summarise the reasoning it returns whole."""

    effort: Literal["low", "medium", "high"] | None = None


class ResponsesNamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """POST /v1/responses, stateless but for store / previous_response_id; served on the chat path."""

    model: str
    input: str | Annotated[list[ResponsesInputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool | None = None
    store: bool | None = None  # default true, as OpenAI's: kept in memory for GET and previous_response_id
    previous_response_id: str | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    # function tools, flat ({"type": "function", "name", "parameters", ...}); checked as chat's are
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: object) -> object:
        """Other item kinds (item_reference, ...) named, before the union's vaguer error."""
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if _input_kind(item) is None:
                raise bad_request(f"input items of type '{item.get('type')}' are not supported; send messages, "
                                  "reasoning, function_call and function_call_output items", f"input.{i}.type",
                                  "unsupported_parameter")
        return value

    def check(self) -> None:
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise bad_request(f"the built-in tool '{tool.get('type')}' is not supported by this server",
                                  f"tools.{i}.type")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
            raise bad_request("a json_schema format needs a name and a schema", "text.format")

    def chat_tools(self) -> dict[str, Any]:
        """tools, tool_choice and parallel_tool_calls as a chat completion body spells them."""
        tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                 for tool in self.tools or ()]
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        return {"tools": tools or None, "tool_choice": choice if tools else None,
                "parallel_tool_calls": self.parallel_tool_calls}

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: consecutive function calls are one assistant turn, each output a
        tool turn; a reasoning item opens an assistant turn (its reasoning_content), which the assistant
        message and the function calls right after it join, as an answer gives them (reasoning, text, calls)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else {}
            if isinstance(item, ResponsesReasoningItem):
                messages.append({"role": "assistant", "content": None,
                                 "reasoning_content": item.reasoning(f"input.{i}")})
            elif isinstance(item, ResponsesInputMessage):
                if item.role == "assistant" and "reasoning_content" in turn and turn["content"] is None \
                        and "tool_calls" not in turn:
                    turn["content"] = item.text()
                else:
                    messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ResponsesFunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not ("tool_calls" in turn or "reasoning_content" in turn):
                    messages.append(turn := {"role": "assistant", "content": None})
                turn.setdefault("tool_calls", []).append(call)
        return messages
