"""The proxy handler: sends the (already Anthropic-shaped) request to a deployment of its model
and returns the reply unsent, for the stages to translate and bill on the way out."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from gateway.config import Config
from gateway.context import BODY, DEPLOYMENT
from gateway.errors import GatewayError, model_not_found
from gateway.reply import EventStreamReply, MessageReply
from gateway.upstream import UpstreamClient, UpstreamEvents

# Spec, "Errors": a non-streaming request that takes longer than this ends with 504.
NON_STREAMING_DEADLINE = 590.0


def proxy_handler(
    config: Config,
    upstream: UpstreamClient,
    *,
    non_streaming_deadline: float = NON_STREAMING_DEADLINE,
    ping_interval: float = 15.0,
):
    async def proxy(request: web.Request) -> web.StreamResponse:
        body = request[BODY]
        model = config.model(body.get("model"))
        if model is None:
            raise model_not_found(body.get("model"))
        deployment = config.deployment(model.deployments[0])
        request[DEPLOYMENT] = deployment.name
        upstream_body = {**body, "model": model.upstream_model}

        if body.get("stream"):
            events = UpstreamEvents(await upstream.post(deployment, upstream_body), idle=ping_interval)
            await events.first_output()
            return EventStreamReply(events, ping_interval=ping_interval)

        try:
            async with asyncio.timeout(non_streaming_deadline):
                async with await upstream.post(deployment, upstream_body) as response:
                    raw = await response.read()
        except TimeoutError:
            raise GatewayError(
                504,
                f"The request took longer than {non_streaming_deadline:g} seconds; stream it instead.",
                type="server_error",
                code="timeout",
            ) from None
        except (aiohttp.ClientError, OSError):
            raise GatewayError(500, "The upstream connection broke.", type="server_error") from None
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise GatewayError(500, "The upstream sent a reply that is not JSON.", type="server_error") from None
        return MessageReply(message)

    return proxy
