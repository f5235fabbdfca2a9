"""Tool-call parsers, one per model family's output format, chosen with --tool-call-parser."""
from __future__ import annotations

from moe_serve.server.tool_parsers.base import ToolParser
from moe_serve.server.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from moe_serve.server.tool_parsers.glm45 import Glm45Parser
from moe_serve.server.tool_parsers.hermes import HermesParser
from moe_serve.server.tool_parsers.llama3_json import Llama3JsonParser
from moe_serve.server.tool_parsers.minimax_m2 import MiniMaxM2Parser
from moe_serve.server.tool_parsers.mistral import MistralParser
from moe_serve.server.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "deepseek_v3": DeepSeekV3Parser,
    "glm45": Glm45Parser,
    "qwen3_coder": Qwen3CoderParser,
    "minimax_m2": MiniMaxM2Parser,
}
# vLLM's name for gpt-oss's calls, which the harmony format reads from the answer's tokens (server/harmony.py)
HARMONY_TOOL_CALL_PARSER = "openai"
