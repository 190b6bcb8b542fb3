"""The proxy handler: sends the (already Anthropic-shaped) request to a deployment of its model
and returns the reply unsent, for the stages to translate and bill on the way out.

Deployments are tried in routing order until one produces output: an attempt that fails in a
way another deployment may not (connection refused, 429, 5xx) moves on, invisibly to the
client, who has been sent nothing yet.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from gateway.config import Config, Deployment
from gateway.context import AFFINITY, BODY, DEPLOYMENT
from gateway.errors import GatewayError, model_not_found
from gateway.reply import EventStreamReply, MessageReply
from gateway.routing import ranked
from gateway.upstream import UpstreamClient, UpstreamEvents

# Spec, "Errors": a non-streaming request that takes longer than this ends with 504.
NON_STREAMING_DEADLINE = 590.0
# Failures another deployment may not have (upstream 401 is the gateway's credential: 500).
RETRYABLE = frozenset({429, 500, 502, 503, 504})


def proxy_handler(
    config: Config,
    upstream: UpstreamClient,
    *,
    non_streaming_deadline: float = NON_STREAMING_DEADLINE,
    ping_interval: float = 15.0,
):
    async def stream(deployment: Deployment, body: dict) -> EventStreamReply:
        events = UpstreamEvents(await upstream.post(deployment, body), idle=ping_interval)
        await events.first_output()
        return EventStreamReply(events, ping_interval=ping_interval)

    async def message(deployment: Deployment, body: dict) -> MessageReply:
        try:
            async with await upstream.post(deployment, body) as response:
                raw = await response.read()
        except (aiohttp.ClientError, OSError):
            raise GatewayError(500, "The upstream connection broke.", type="server_error") from None
        try:
            return MessageReply(orjson.loads(raw))
        except orjson.JSONDecodeError:
            raise GatewayError(500, "The upstream sent a reply that is not JSON.", type="server_error") from None

    async def first_answer(request: web.Request) -> web.StreamResponse:
        body = request[BODY]
        model = config.model(body.get("model"))
        if model is None:
            raise model_not_found(body.get("model"))
        upstream_body = {**body, "model": model.upstream_model}
        attempt = stream if body.get("stream") else message
        error = None
        for name in ranked(model.deployments, request.get(AFFINITY)):
            try:
                reply = await attempt(config.deployment(name), upstream_body)
            except GatewayError as failure:
                if failure.status not in RETRYABLE:
                    raise
                error = failure
                continue
            request[DEPLOYMENT] = name
            return reply
        raise error

    async def proxy(request: web.Request) -> web.StreamResponse:
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

    return proxy
