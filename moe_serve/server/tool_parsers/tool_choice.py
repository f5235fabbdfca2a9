"""A request's tools and tool_choice -> what they ask of the prompt, the sampler and the output.

- "none" (the default without tools): the tools are not rendered and nothing is parsed, so
  the model is not invited to write calls that would come back as text;
- "auto" (the default with tools): the chat template renders the tools and the server's
  --tool-call-parser reads calls out of the model's text; without a parser it is a 400, as in vLLM;
- "required" and a named function: the tools are rendered too, and the output is constrained to
  JSON (moe_serve/server/tool_parsers/forced.py), so they work on any model.

parallel_tool_calls false keeps at most one call: constrained for "required", and in "auto"
the calls after the first are dropped.

With gpt-oss's harmony format (moe_serve/server/harmony.py) the answer's calls are read from its
tokens whatever the flags, and a forced call is constrained in harmony's own markup.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.structured import GrammarError, Grammars
from moe_serve.server.errors import bad_request
from moe_serve.server.harmony import forced_call
from moe_serve.server.protocol import ChatCompletionRequest, NamedToolChoice
from moe_serve.server.tool_parsers import TOOL_PARSERS
from moe_serve.server.tool_parsers.base import ToolParser
from moe_serve.server.tool_parsers.forced import NamedParser, RequiredParser, named_schema, required_schema
from moe_serve.server.tool_parsers.stream import ToolCallStream


@dataclass(frozen=True)
class ToolCalling:
    template_tools: list[dict]  # as the chat template receives them (OpenAI's tool objects)
    parser: ToolParser | None  # None: the harmony format reads the calls
    structured: StructuredOutput | None  # the constraint of a forced call
    max_calls: int | None

    def stream(self) -> ToolCallStream:
        """A fresh reader for one choice."""
        return ToolCallStream(self.parser, self.max_calls)

    def constrain(self, structured: StructuredOutput | None) -> StructuredOutput | None:
        """The one constraint of the request, given the one its other fields ask for."""
        if self.structured is None:
            return structured
        if structured is not None:
            raise bad_request("a forced tool call is already constrained to JSON; drop response_format "
                              "(or the structured output extra) or use tool_choice 'auto'", "tool_choice")
        return self.structured


def tool_calling(body: ChatCompletionRequest, parser_name: str | None, grammars: Grammars,
                 harmony: bool = False) -> ToolCalling | None:
    """None when no tool can be called; 400 for what this server cannot do with the request.
    harmony: the server speaks gpt-oss's harmony format."""
    choice = body.effective_tool_choice()
    if choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    parallel = body.parallel_tool_calls is not False
    max_calls = None if parallel else 1
    parameters = {tool.function.name: tool.function.parameters for tool in body.tools or ()}
    if choice == "auto" and harmony:
        return ToolCalling(tools, None, None, max_calls)
    if choice == "auto":
        if parser_name is None:
            raise bad_request("tool_choice 'auto' (the default with tools) needs a server started with "
                              "--tool-call-parser; 'required', a named function and 'none' work without one",
                              "tool_choice")
        return ToolCalling(tools, TOOL_PARSERS[parser_name](parameters), None, max_calls)
    parser, structured = _forced(choice, parameters, parallel, harmony)
    try:
        grammars.check(structured)
    except GrammarError as exc:
        raise bad_request(f"the tools' parameter schemas cannot be used for constrained decoding: {exc}",
                          "tools") from None
    return ToolCalling(tools, parser, structured, max_calls)


def _forced(choice: str | NamedToolChoice, parameters: dict[str, dict | None], parallel: bool,
            harmony: bool) -> tuple[ToolParser | None, StructuredOutput]:
    """A forced call's reader and constraint: JSON read as calls, or in the harmony format a call in its
    markup (one an answer, parallel or not), read as any harmony answer is."""
    if harmony:
        return None, forced_call(parameters if choice == "required"
                                 else {choice.function.name: parameters[choice.function.name]})
    if choice == "required":
        parser, schema = RequiredParser(), required_schema(parameters, parallel)
    else:
        parser, schema = NamedParser(choice.function.name), named_schema(parameters[choice.function.name])
    return parser, StructuredOutput("json_schema", json.dumps(schema))
