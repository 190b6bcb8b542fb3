"""What each API request leaves behind when it ends, however it ends: one access line, its
metrics and, with [tracing], its span. A stream ends after its reply has left this middleware,
so it is finished from the stream's own `when_done`; every other reply here and now.

Only the API routes are observed (the app names their handlers in `API_ROUTES`): health probes
and scrapes would drown them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial
from types import MappingProxyType
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.ops.logs import ACCESS, CURRENT_REQUEST, access
from gateway.ops.metrics import NO_METRICS, TOKEN_COLUMNS, Metrics, NoMetrics
from gateway.ops.tracing import Tracing
from middlewares.core.context import ANSWERED_MODEL, API_KEY, DEPLOYMENT, LEDGER_ROW, MODEL, request_id
from middlewares.core.reply import EventStreamReply

# Routes whose answers come from a model: their time to first output is measured.
GENERATING = frozenset({"chat_completions", "responses", "messages"})
CLIENT_CLOSED = 499  # the status a request has whose client left before its answer began
log = logging.getLogger("ezat.observe")
# The API routes' handlers, each with the name its metrics and access line give its route.
API_ROUTES = web.AppKey("ezat.api_routes", dict[Handler, str])


def observe_middleware(
    *,
    metrics: Metrics | NoMetrics = NO_METRICS,
    tracing: Tracing | None = None,
    providers: Mapping[str, str] = MappingProxyType({}),
):
    """The app's outermost middleware: each API request's access line, and its metrics and span
    when the app has them. `providers`: each deployment's provider, by the deployment's name."""

    @web.middleware
    async def observe(request: web.Request, handler) -> web.StreamResponse:
        route = request.config_dict[API_ROUTES].get(request.match_info.handler)
        if route is None:
            return await handler(request)
        CURRENT_REQUEST.set(request_id(request))
        clock = asyncio.get_running_loop().time
        started = clock()
        resource = request.match_info.route.resource
        assert resource is not None  # an API route's
        pattern = resource.canonical  # never the path: it holds what a client typed
        span = tracing.server_span(request, route, pattern) if tracing is not None else None
        end = partial(finish, request, route, pattern, started, span)
        try:
            with (
                tracing.current(span) if tracing is not None and span is not None else nullcontext()
            ):  # the attempts' spans are its children
                reply = await handler(request)
        except web.HTTPException as exc:
            refusal = getattr(exc, "refusal", None)
            end(exc.status, None, f"refused:{refusal}" if refusal else "failed", refusal)
            raise
        except asyncio.CancelledError:
            end(CLIENT_CLOSED, None, "client_closed")
            raise
        if isinstance(reply, EventStreamReply):
            reply.when_done(lambda stream: end(stream.status, stream.first_output_at, stream.outcome, reply=stream))
        else:
            end(reply.status, clock() if route in GENERATING else None, "ok", reply=reply)
        return reply

    def finish(
        request: web.Request,
        route: str,
        pattern: str,
        started: float,
        span: Any,
        status: int,
        first_output: float | None,
        outcome: str,
        refusal: str | None = None,
        reply: web.StreamResponse | None = None,
    ) -> None:
        try:
            seconds = asyncio.get_running_loop().time() - started
            to_first_output = first_output - started if first_output is not None else None
            model, deployment = request.get(MODEL), request.get(DEPLOYMENT)
            provider = providers.get(deployment) if deployment is not None else None
            metrics.answered(route, model.id if model is not None else "", status, seconds, to_first_output)
            if refusal:
                metrics.refused(refusal)
            if tracing is not None and span is not None:
                tracing.end_server_span(span, request, status, outcome, reply, provider)
            if ACCESS.isEnabledFor(logging.INFO):
                access(
                    f"{request.method} {pattern} {status}",
                    request_id(request),
                    access_fields(
                        request,
                        route,
                        status,
                        seconds,
                        to_first_output,
                        outcome,
                        isinstance(reply, EventStreamReply),
                        provider,
                    ),
                )
        except Exception:  # what observes a request must not fail it
            log.exception("observing a request failed")

    return observe


def access_fields(
    request: web.Request,
    route: str,
    status: int,
    seconds: float,
    first_output: float | None,
    outcome: str,
    streamed: bool,
    provider: str | None,
) -> dict[str, Any]:
    """An access line's fields: what was asked, who asked, what answered (and its provider),
    and what it cost."""
    model, answered, key, row = (
        request.get(MODEL),
        request.get(ANSWERED_MODEL),
        request.get(API_KEY),
        request.get(LEDGER_ROW),
    )
    fields = {
        "route": route,
        "model": model.id if model is not None else None,  # a configured id: never what a client typed
        "answered_model": answered.id if answered is not None else None,
        "deployment": request.get(DEPLOYMENT),
        "provider": provider,
        "status": status,
        "duration_ms": round(seconds * 1000, 1),
        "ttft_ms": round(first_output * 1000, 1) if first_output is not None else None,
        "key": key.name if key is not None else None,  # its name: never the key
        "client": request.remote,
        "stream": streamed,
        "outcome": outcome,
    }
    if row is not None:
        fields.update({column: getattr(row, column) for _, column in TOKEN_COLUMNS}, cost_usd=row.cost_usd)
    return fields
