"""An upstream's error answers, as the errors the client gets: the upstream's status (529
becomes 503), OpenAI's type and code for it, the upstream's message (cut at MAX_ERROR_MESSAGE
characters); and its retry-after."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import orjson

from gateway.upstream.shape import error_type
from middlewares.core.errors import BY_ANTHROPIC_TYPE, GatewayError, anthropic_type, cut, retry_after

log = logging.getLogger("ezat.errors")
# The longest wait an upstream's retry-after is believed for: a deployment it cools is tried
# again after this at the latest, whatever it said.
MAX_RETRY_AFTER = 600.0


def retry_after_seconds(value: str | None) -> float | None:
    """The wait an upstream's `retry-after` asks for (seconds, or an HTTP date), at most
    MAX_RETRY_AFTER; None when it says nothing usable ("inf", "nan", negative, garbage)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # asctime's form, or "-0000": HTTP dates are in UTC
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not 0 <= seconds < math.inf:  # NaN fails both comparisons
        return None
    return min(seconds, MAX_RETRY_AFTER)


def upstream_error(status: int, body: bytes, headers: Mapping[str, str]) -> GatewayError:
    """Map an upstream's non-2xx answer to the error the client gets: the upstream's status
    (529 becomes 503), OpenAI's type and code for it, the upstream's message, cut if long. On
    Anthropic's API the status and type stay the upstream's own."""
    kind, message = _read_anthropic_error(body)
    message = cut(message)
    if status < 400:
        return GatewayError(500, f"The upstream answered with HTTP {status}.", type="server_error")
    if status == 401:
        # The client's key passed auth: it is the gateway's upstream credential that failed.
        # "invalid_api_key" would send the client after the wrong key.
        log.error("upstream rejected the gateway's credentials: %s", message)
        return GatewayError(500, "The upstream rejected the gateway's credentials.", type="server_error")
    status_type = anthropic_type(status)
    _, type_, code = BY_ANTHROPIC_TYPE[status_type]
    if code is None and message.startswith("prompt is too long"):
        code = "context_length_exceeded"
    wait = retry_after_seconds(headers.get("retry-after"))  # passed on as whole seconds, if usable
    return GatewayError(
        503 if status == 529 else status,
        message,
        type=type_,
        code=code,
        param="model" if code == "model_not_found" else None,
        headers=retry_after(wait) if wait is not None else None,
        anthropic=(status, kind or status_type),
    )


def _read_anthropic_error(body: bytes) -> tuple[str | None, str]:
    """The type (None when it has none) and message of an upstream's error body."""
    try:
        error = orjson.loads(body)["error"]
        return error_type(error.get("type")), str(error["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None, body[:200].decode("utf-8", "replace").strip() or "upstream error"
