"""The gateway's log: text or JSON lines (`[logging] format`), each with the request id of the
request it is about, and one access line per request when it ends (gateway/observe.py writes it).

JSON lines are encoded with orjson: `{"time", "level", "logger", "message", "pid", "request_id",
…}`, an access line's fields at the top level. No line ever holds a key: the gateway logs a key's
name, never the key.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from datetime import datetime, timezone
from typing import Any

import orjson

from gateway.config import LoggingConfig

# The request the running code serves: every request has a task of its own, so a log line
# written on its behalf, however deep, names it.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("ezat_request_id", default=None)
ACCESS = logging.getLogger("ezat.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"


def configure_logging(config: LoggingConfig = LoggingConfig()) -> None:
    """The process's log, as the config says: replaces whatever was set up before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter(TEXT_FORMAT))
    handler.addFilter(_with_request_id)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    ACCESS.disabled = not config.access_log


def _with_request_id(record: logging.LogRecord) -> bool:
    if not hasattr(record, "request_id"):
        record.request_id = REQUEST_ID.get()
    return True


class TextFormatter(logging.Formatter):
    """The usual line, then the request id and an access line's fields as key=value pairs."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if getattr(record, "request_id", None):
            line += f" request_id={record.request_id}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{name}={value}" for name, value in fields.items() if value is not None)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if getattr(record, "request_id", None):
            line["request_id"] = record.request_id
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()
