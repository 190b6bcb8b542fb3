"""Errors in OpenAI's envelope, with the statuses and codes the gateway's API promises, or in
Anthropic's on the routes that speak Anthropic's API.

`GatewayError` is an aiohttp HTTP exception, so any stage can raise it and any aiohttp app that
mounts the stage renders it, with no error middleware of ours (in OpenAI's envelope; an app whose
route speaks Anthropic's API mounts `anthropic_error_envelope` in front).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.context import request_id

log = logging.getLogger("ezat.errors")
# Seconds to wait after a 429 or 503 when nothing better is known (the upstream said nothing).
DEFAULT_RETRY_AFTER = 1
# The most characters of an upstream's error message passed on: longer than any real one, which
# passes unchanged, but an upstream's body or stream event could hold megabytes.
MAX_ERROR_MESSAGE = 4096


_BODY_HEADERS = frozenset({"content-type", "content-length"})  # the envelope's own, made anew


class GatewayError(web.HTTPException):
    # True where what the error says is told to the log once elsewhere (an outage the app logs
    # as it begins and ends), so that a stream it ends logs nothing of its own.
    quiet = False

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        anthropic: tuple[int, str] | None = None,
        refusal: str | None = None,
    ) -> None:
        self.status_code = status  # per instance: one class serves every status
        super().__init__(headers=headers, content_type="application/json")
        self.message, self.type, self.code, self.param = message, type, code, param
        # The status and error type on Anthropic's API, where they are not the ones for `status`
        # (an upstream's own, passed on unchanged).
        self.anthropic = anthropic
        # Why the gateway refused the request before any upstream saw it, for its metrics and
        # logs: auth, model, spend, rpm, tpm, concurrency or field (what the request holds).
        self.refusal = refusal
        self.body = orjson.dumps({"error": self.payload()})

    def payload(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def anthropic_status_and_type(self) -> tuple[int, str]:
        """How Anthropic's API says this error: (its status there, its type)."""
        if self.anthropic is not None:
            return self.anthropic
        kind = anthropic_type(self.status)
        return anthropic_status(kind, self.status), kind

    def as_anthropic(self, request_id: str) -> GatewayError:
        """This error in Anthropic's envelope, `request_id` in it as Anthropic's API puts it."""
        status, kind = self.anthropic_status_and_type()
        headers = {name: value for name, value in self.headers.items() if name.lower() not in _BODY_HEADERS}
        error = GatewayError(
            status,
            self.message,
            type=self.type,
            code=self.code,
            param=self.param,
            headers=headers,
            anthropic=(status, kind),
            refusal=self.refusal,
        )
        error.body = orjson.dumps(
            {"type": "error", "error": {"type": kind, "message": self.message}, "request_id": request_id}
        )
        return error

    def __str__(self) -> str:
        return f"{self.status} {self.message}"


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    """A 400 for something the client sent; `message` starts with the field's path."""
    return GatewayError(400, message, param=param, refusal="field")


def retry_after(seconds: float) -> dict[str, str]:
    """The `retry-after` header for a wait: whole seconds, at least one."""
    return {"retry-after": str(max(1, math.ceil(seconds)))}


def too_deeply_nested() -> GatewayError:
    """orjson parses JSON up to 1024 levels deep but writes only 255: deeper cannot be sent on."""
    return GatewayError(400, "The request nests JSON more than 255 levels deep.", refusal="field")


def cut(message: str) -> str:
    """An upstream's error message, at most MAX_ERROR_MESSAGE characters; one cut ends with "…"."""
    return message if len(message) <= MAX_ERROR_MESSAGE else message[: MAX_ERROR_MESSAGE - 1] + "…"


def error_event(message: str, type: str = "api_error") -> dict[str, Any]:
    """An Anthropic stream's `error` event: how a stream that has begun says it failed."""
    return {"type": "error", "error": {"type": type, "message": message}}


def model_not_found(name: object) -> GatewayError:
    return GatewayError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
        refusal="model",
    )


# Status → Anthropic's error type for it; a status not here is `api_error` from 500 up, else
# `invalid_request_error` (Anthropic's own choice for the 4xx it has no type for).
ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPE_BY_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_status(kind: str, status: int) -> int:
    """The status an error of Anthropic's type `kind` has there: an overload is 529 (which
    Anthropic's clients know and retry), the rest keep `status`."""
    return 529 if kind == "overloaded_error" else status


# Anthropic error type → (status the client gets, OpenAI type, OpenAI code). The status is the
# Anthropic API's own, except 529 → 503 (OpenAI's clients know no 529).
BY_ANTHROPIC_TYPE: dict[str, tuple[int, str, str | None]] = {
    "invalid_request_error": (400, "invalid_request_error", None),
    "billing_error": (402, "insufficient_quota", "insufficient_quota"),
    "permission_error": (403, "permission_error", None),
    "not_found_error": (404, "invalid_request_error", "model_not_found"),
    "request_too_large": (413, "invalid_request_error", "request_too_large"),
    "rate_limit_error": (429, "rate_limit_error", "rate_limit_exceeded"),
    "api_error": (500, "server_error", None),
    "timeout_error": (504, "server_error", "timeout"),
    "overloaded_error": (503, "server_error", "overloaded"),
}


def stream_error(event: Mapping[str, Any]) -> GatewayError:
    """A stream's `error` event, as the error the client gets (on Anthropic's API, with the
    event's own type). Its source made the event what it passes on (the gateway's upstream
    cuts an upstream's message where it reads it)."""
    error = event.get("error") or {}
    kind = error.get("type") or "api_error"
    status, type_, code = BY_ANTHROPIC_TYPE.get(kind, BY_ANTHROPIC_TYPE["api_error"])
    return GatewayError(
        status,
        str(error.get("message") or "upstream error"),
        type=type_,
        code=code,
        anthropic=(anthropic_status(kind, status), kind),
    )


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost guard: aiohttp's own errors (404, 405) and anything unexpected leave in the
    OpenAI envelope, never as an HTML page or a traceback."""
    return await _guarded(request, handler)


@web.middleware
async def anthropic_error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The guard for a route that speaks Anthropic's API: every error, aiohttp's own and anything
    unexpected too, leaves in Anthropic's envelope, `{"type": "error", "error": {"type",
    "message"}, "request_id"}`, with Anthropic's status for it."""
    try:
        return await _guarded(request, handler)
    except GatewayError as exc:
        raise exc.as_anthropic(request_id(request)) from None


async def _guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's answer; whatever it raises, a GatewayError (a redirect aside)."""
    try:
        return await handler(request)
    except GatewayError as exc:
        if exc.status in (429, 503) and "retry-after" not in exc.headers:
            # docs/api.md, "Errors": each says to wait for retry-after seconds, so there always is one.
            # (Added here, not when the error is made: routing cools a deployment down for
            # what the upstream itself said.)
            exc.headers.update(retry_after(DEFAULT_RETRY_AFTER))
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        raise GatewayError(exc.status, exc.reason, type=_type_for(exc.status), headers=_allow(exc)) from None
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        raise GatewayError(500, "The gateway failed to handle the request.", type="server_error") from None


def _type_for(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def _allow(exc: web.HTTPException) -> dict[str, str]:
    return {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
