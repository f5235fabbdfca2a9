"""One real server for the client-library tests: the embedded default model with the hermes tool-call
parser (so `tool_choice: "auto"` is served), on the CPU.

The default model is a small code model: it writes code, not answers. These tests check the protocol
each client speaks (shapes, tool-call names and JSON arguments, structured output that parses and
validates), not the quality of what it says. Greedy decoding (temperature 0) makes every answer the
same on every run; a call the test needs is forced with `tool_choice`, and schemas close their
objects (`additionalProperties: false`), since without that the model is free to add keys until
`max_tokens`."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.conftest import DEFAULT_MODEL, RunningServer, start_server

# No client reaches the internet: litellm would fetch its model cost map at import, the hub
# libraries would look up tokenizers.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Point(BaseModel):
    """A point in the plane."""
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false in its JSON schema
    x: int
    y: int


WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                      "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                  "parameters": WEATHER_PARAMETERS}}


@pytest.fixture(scope="package")
def client_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(DEFAULT_MODEL, tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                           "--tool-call-parser", "hermes")
    yield running
    running.stop()


@pytest.fixture(scope="package")
def base_url(client_server: RunningServer) -> str:
    return client_server.base_url + "/v1"
