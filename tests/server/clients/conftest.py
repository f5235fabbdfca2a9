"""One real server for the client-library tests: the embedded default model with the hermes tool-call
parser (so `tool_choice: "auto"` is served), on the CPU (tests/server/conftest.py's hermes_server, which the
tool-calling tests share).

The default model is a small code model: it writes code, not answers. These tests check the protocol
each client speaks (shapes, tool-call names and JSON arguments, structured output that parses and
validates), not the quality of what it says. Greedy decoding (temperature 0) makes every answer the
same on every run; a call the test needs is forced with `tool_choice`, and schemas close their
objects (`additionalProperties: false`), since without that the model is free to add keys until
`max_tokens`."""
from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.conftest import RunningServer

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
def client_server(hermes_server: RunningServer) -> RunningServer:
    return hermes_server


@pytest.fixture(scope="package")
def base_url(client_server: RunningServer) -> str:
    return client_server.base_url + "/v1"
