"""The proxy handler: sends the (already Anthropic-shaped) request to a deployment and returns
the reply unsent, for the stages to translate and bill on the way out.

Nothing reaches the client before the upstream has produced output, so a failed attempt is
invisible: deployments are tried in routing order (skipping cooled-down ones), then the
request's fallback models, until one answers or the attempts run out. A connection failure, a
timeout before the first token, 429 or a 5xx moves on; a request the upstream refuses as
invalid (other 4xx) is answered at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.config import Config, Deployment, Model
from gateway.health import Health
from gateway.routing import affinity, ranked
from gateway.streams import OpenStreams
from gateway.upstream import UpstreamClient, UpstreamEvents
from gateway.upstream_errors import retry_after_seconds
from gateway.upstream_shape import readable_message
from middlewares.core.chain import Stage
from middlewares.core.context import ANSWERED_MODEL, BODY, DEPLOYMENT, FALLBACK_MODELS, MODEL, SESSION
from middlewares.core.errors import GatewayError, retry_after
from middlewares.core.reply import EventStreamReply, MessageReply

# docs/api.md, "Errors": a non-streaming request that takes longer than this ends with 504.
NON_STREAMING_DEADLINE = 590.0
# Failures another deployment may not have (an upstream 401 is the gateway's credential: 500).
RETRYABLE = frozenset({429, 500, 502, 503, 504})


def proxy_handler(
    config: Config,
    upstream: UpstreamClient,
    *,
    health: Health | None = None,
    non_streaming_deadline: float = NON_STREAMING_DEADLINE,
    streams: OpenStreams | None = None,
):
    health = health or Health(
        failures_before_cooldown=config.routing.failures_before_cooldown, cooldown=config.routing.cooldown_seconds
    )

    async def stream(deployment: Deployment, body: dict[str, Any]) -> EventStreamReply:
        try:
            async with asyncio.timeout(deployment.first_token_timeout_seconds):
                events = UpstreamEvents(
                    await upstream.post(deployment, body),
                    idle_timeout=deployment.stream_idle_timeout_seconds,
                    max_duration=deployment.max_stream_duration_seconds,
                )
                await events.first_output()
        except TimeoutError:
            # A 500, not the 504 `timeout`: that one tells a non-streaming request to stream.
            raise GatewayError(
                500,
                f"The upstream produced nothing within {deployment.first_token_timeout_seconds:g} seconds.",
                type="server_error",
            ) from None
        return EventStreamReply(events, streams=streams)

    async def message(deployment: Deployment, body: dict[str, Any]) -> MessageReply:
        try:
            async with await upstream.post(deployment, body) as response:
                raw = await response.read()
        except (aiohttp.ClientError, OSError):
            raise GatewayError(500, "The upstream connection broke.", type="server_error") from None
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            message = None
        if not readable_message(message):
            raise GatewayError(500, "The upstream sent a reply the gateway cannot read.", type="server_error")
        return MessageReply(message)

    async def first_answer(request: web.Request) -> web.StreamResponse:
        body = request[BODY]
        asked = request[MODEL]
        models = [asked, *request.get(FALLBACK_MODELS, ())]
        attempt = stream if body.get("stream") else message
        attempts, error = config.routing.max_attempts, None
        # Worked out only when there is a deployment to choose (the digest costs a serialisation).
        choosing = any(len(model.deployments) > 1 for model in models)
        stick_by = affinity(request.get(SESSION), body) if choosing else None
        for model in models:
            upstream_body = _for_model(body, model, asked)
            deployments = ranked(model.deployments, stick_by)
            usable = health.available(deployments)
            if not usable:
                error = error or _all_cooling(health.cooling_ends(deployments))
            for name in usable:
                if attempts == 0:
                    raise error
                attempts -= 1
                try:
                    reply = await attempt(config.deployment(name), upstream_body)
                except GatewayError as failure:
                    if failure.status not in RETRYABLE:
                        raise
                    health.failed(name, retry_after_seconds(failure.headers.get("retry-after")))
                    error = failure
                    continue
                health.succeeded(name)
                request[DEPLOYMENT], request[ANSWERED_MODEL] = name, model
                reply.headers["x-ezat-model"] = model.id
                if model is not asked:
                    reply.headers["x-ezat-routed-from"] = asked.id
                return reply
        raise error

    async def proxy(request: web.Request) -> web.StreamResponse:
        """Requires `request[BODY]`, an Anthropic Messages request, and `request[MODEL]`."""
        if request[BODY].get("stream"):
            return await first_answer(request)
        try:
            async with asyncio.timeout(non_streaming_deadline):
                return await first_answer(request)
        except TimeoutError:
            raise GatewayError(
                504,
                f"The request took longer than {non_streaming_deadline:g} seconds; stream it instead.",
                type="server_error",
                code="timeout",
            ) from None

    proxy.stage = Stage("proxy", requires=frozenset({BODY, MODEL}), provides=frozenset({ANSWERED_MODEL, DEPLOYMENT}))
    return proxy


def _for_model(body: dict[str, Any], model: Model, asked: Model) -> dict[str, Any]:
    """The upstream request for `model`: a fallback gets what it supports of the asked one's."""
    upstream_body = {**body, "model": model.upstream_model}
    if model is asked:
        return upstream_body
    upstream_body["max_tokens"] = min(body["max_tokens"], model.max_output_tokens)
    effort = (body.get("output_config") or {}).get("effort")
    if effort is not None and effort not in model.efforts:
        rest = {k: v for k, v in body["output_config"].items() if k != "effort"}
        if rest:
            upstream_body["output_config"] = rest
        else:
            del upstream_body["output_config"]
    if not model.sampling:
        for field in ("temperature", "top_p"):
            upstream_body.pop(field, None)
    return upstream_body


def _all_cooling(seconds: float) -> GatewayError:
    return GatewayError(
        503,
        "No deployment of this model is available right now.",
        type="server_error",
        code="overloaded",
        headers=retry_after(seconds),
    )

