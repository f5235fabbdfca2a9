"""One log format for the server, the engine process and uvicorn: a logging dictConfig built from
--log-level and --log-format, applied in each process (the engine is spawned: it inherits nothing)
and handed to uvicorn as its log_config, so every line leaves through the same stderr handler."""
from __future__ import annotations

import logging
import logging.config
import sys
from dataclasses import dataclass

from pythonjsonlogger.core import RESERVED_ATTRS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
# processName tells the server's lines (MainProcess) from the engine's (moe-engine)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(processName)s %(name)s %(message)s"
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


@dataclass(frozen=True)
class LogSettings:
    level: str = "info"
    format: str = "text"  # text | json (one object a line: time, level, process, logger, message)

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ValueError(f"log level {self.level!r} not in {LOG_LEVELS}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format {self.format!r} not in {LOG_FORMATS}")

    def dict_config(self) -> dict:
        """For logging.config.dictConfig and uvicorn.Config(log_config=...)."""
        if self.format == "json":
            formatter = {"()": "pythonjsonlogger.json.JsonFormatter", "fmt": JSON_FIELDS,
                         "rename_fields": {"asctime": "time", "levelname": "level", "processName": "process",
                                           "name": "logger"},
                         # uvicorn repeats some messages with terminal colours: not for a JSON reader
                         "reserved_attrs": [*RESERVED_ATTRS, "color_message"]}
        else:
            formatter = {"format": TEXT_FORMAT}
        level = self.level.upper()
        return {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"moe": formatter},
            "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "moe", "stream": "ext://sys.stderr"}},
            "root": {"level": level, "handlers": ["stderr"]},
            # uvicorn's own config gives these handlers and formats of their own; here they reach the root's
            "loggers": {name: {"level": level, "handlers": [], "propagate": True} for name in _UVICORN_LOGGERS},
        }

    def apply(self) -> None:
        logging.config.dictConfig(self.dict_config())
        adopt_transformers_logging()


def adopt_transformers_logging() -> None:
    """transformers gives its logger a stderr handler of its own format on import; once it is imported,
    send its records through the root handler instead (a no-op before)."""
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
