"""The gateway's log: text or JSON lines (`[logging] format`), each with the request id of the
request it is about, and one access line per request when it ends (`access`, which
gateway/ops/observe.py calls).

JSON lines are encoded with orjson: `{"time", "level", "logger", "message", "pid", "request_id",
…}`, an access line's fields at the top level. No line ever holds a key: the gateway logs a key's
name, never the key.

Lines are cheap: no caller's frame, thread or process lookup per record (the logging module's
documented switches), lines written in one turn of the event loop leave in one write, and a JSON
access line, written for every request, is formatted straight into that batch rather than
through a LogRecord (measured: bench/observability.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import sys
import time
from typing import Any

import orjson

from gateway.config import LoggingConfig

# The request the running code serves: every request has a task of its own, so a log line
# written on its behalf, however deep, names it.
CURRENT_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("ezat_request_id", default=None)
ACCESS = logging.getLogger("ezat.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(pid)d %(name)s: %(message)s"


def configure_logging(config: LoggingConfig = LoggingConfig()) -> None:
    """The process's log, as the config says: replaces whatever was set up before."""
    logging._srcfile = None  # no sys._getframe() walk per record
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.logAsyncioTasks = False  # type: ignore[attr-defined]  # Python 3.12's; on 3.11 it reads nothing
    handler = BatchingHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter())
    handler.addFilter(_with_request_id)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    ACCESS.disabled = not config.access_log
    global _configured
    _configured = handler


# The handler configure_logging set up, which access lines go straight to.
_configured: BatchingHandler | None = None


def access(message: str, request_id: str, fields: dict[str, Any]) -> None:
    """One access line (the caller checked that ACCESS is enabled). In JSON, while the configured
    handler is the log's only one, straight into its batch; else as any line of `ezat.access`."""
    handler = _configured
    if (
        handler is None
        or not isinstance(handler.formatter, JsonFormatter)
        or ACCESS.handlers
        or not ACCESS.propagate
        or logging.root.handlers != [handler]
    ):
        ACCESS.info(message, extra={"request_id": request_id, "fields": fields})
        return
    handler.write_line(handler.formatter.line(time.time(), "INFO", ACCESS.name, message, request_id, fields))


def _with_request_id(record: logging.LogRecord) -> bool:
    if not hasattr(record, "request_id"):
        record.request_id = CURRENT_REQUEST.get()
    return True


class BatchingHandler(logging.StreamHandler):
    """Lines logged in one turn of the event loop leave in one write at its end (under load, a
    turn finishes many requests); a line logged with no loop running is written at once."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.write_line(line)

    def write_line(self, line: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write([line])
            return
        if not self._lines:
            loop.call_soon(self._flush_lines)
        self._lines.append(line)

    def _flush_lines(self) -> None:
        lines, self._lines = self._lines, []
        if lines:
            self._write(lines)

    def flush(self) -> None:
        """Lines still batched go out too (at exit, logging flushes every handler)."""
        self._flush_lines()
        super().flush()

    def _write(self, lines: list[str]) -> None:
        self.acquire()  # the handler's lock (self.lock, typed Optional: acquire() checks)
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        finally:
            self.release()


class _Timestamps:
    """ISO 8601 UTC times to the millisecond; the seconds part made once a second."""

    def __init__(self) -> None:
        self._second, self._prefix = -1, ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((created - second) * 1000):03d}+00:00"


class TextFormatter(logging.Formatter):
    """The usual line, then the request id and an access line's fields as key=value pairs."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)
        self._pid = os.getpid()  # made in the process that logs (each worker configures its own)

    def format(self, record: logging.LogRecord) -> str:
        record.pid = self._pid
        line = super().format(record)
        request_id, fields = getattr(record, "request_id", None), getattr(record, "fields", None)
        if request_id:
            line += f" request_id={request_id}"
        if fields:
            line += " " + " ".join(f"{name}={value}" for name, value in fields.items() if value is not None)
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._timestamp = _Timestamps()
        self._pid = os.getpid()  # made in the process that logs (each worker configures its own)

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if record.exc_info:
            fields = {**(fields or {}), "exception": self.formatException(record.exc_info)}
        return self.line(
            record.created,
            record.levelname,
            record.name,
            record.getMessage(),
            getattr(record, "request_id", None),
            fields,
        )

    def line(
        self,
        created: float,
        level: str,
        logger: str,
        message: str,
        request_id: str | None,
        fields: dict[str, Any] | None,
    ) -> str:
        line: dict[str, Any] = {
            "time": self._timestamp(created),
            "level": level,
            "logger": logger,
            "message": message,
            "pid": self._pid,
        }
        if request_id:
            line["request_id"] = request_id
        if fields:
            line.update(fields)
        return orjson.dumps(line, default=str).decode()
