"""One log format for every process: text or JSON lines through one stderr handler, uvicorn's and
transformers' loggers included."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from moe_serve.engine.logging_config import LogSettings


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")]
    saved = [(lg.level, list(lg.handlers)) for lg in loggers]
    yield
    for lg, (level, handlers) in zip(loggers, saved, strict=True):
        lg.setLevel(level)
        lg.handlers[:] = handlers


def test_json_lines_for_every_logger(restore_logging: None, capsys: pytest.CaptureFixture) -> None:
    LogSettings("info", "json").apply()
    logging.getLogger("moe_serve").info("hello %s", "world")
    logging.getLogger("uvicorn.access").info("GET /health", extra={"color_message": "\x1b[1mGET\x1b[0m /health"})
    logging.getLogger("moe_serve.engine.runtime").debug("not at info")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["logger"], r["message"], r["level"]) for r in lines] == [
        ("moe_serve", "hello world", "INFO"), ("uvicorn.access", "GET /health", "INFO")]
    assert {"time", "process"} <= set(lines[0]) and "color_message" not in lines[1]


def test_text_lines_name_the_process(restore_logging: None, capsys: pytest.CaptureFixture) -> None:
    LogSettings("warning", "text").apply()
    logging.getLogger("uvicorn.error").info("hidden")
    logging.getLogger("uvicorn.error").warning("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err and "WARNING MainProcess uvicorn.error: shown" in err


def test_transformers_logs_through_the_same_handler(restore_logging: None, capsys: pytest.CaptureFixture) -> None:
    import transformers  # noqa: F401 - its import installs its own handler, which apply() must take over

    assert "transformers" in sys.modules
    LogSettings("info", "json").apply()
    logging.getLogger("transformers.tokenization_utils_base").warning("from transformers")
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert record["message"] == "from transformers"


def test_unknown_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError):
        LogSettings("loud")
    with pytest.raises(ValueError):
        LogSettings("info", "xml")
