"""The translator stage: OpenAI Chat Completions in, Anthropic Messages to the handler, and
the reply back: a message becomes a chat completion, stream events become chunks."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from gateway.config import Model
from gateway.context import ANSWERED_MODEL, BODY, FALLBACK_MODELS, request_id
from gateway.errors import invalid_request, model_not_found
from gateway.reply import EventStreamReply, MessageReply
from middlewares.translator.request import to_anthropic
from middlewares.translator.response import to_completion
from middlewares.translator.stream import ChunkEncoder


def translator_middleware(find_model: Callable[[str], Model | None]):
    """`find_model` maps the model id a client sends to its configuration (None: unknown)."""

    async def translator(request: web.Request, handler) -> web.StreamResponse:
        body = request[BODY]
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise invalid_request("model: required", "model")
        model = find_model(name)
        if model is None:
            raise model_not_found(name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid_request("stream: expected a boolean", "stream")
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        request[FALLBACK_MODELS] = _fallbacks(body.get("models"), name, find_model)
        request[BODY], renamed = to_anthropic(body, model)

        reply = await handler(request)
        name = request.get(ANSWERED_MODEL, name)  # `model` is the model that answered
        completion_id = "chatcmpl-" + request_id(request)
        created = int(time.time())
        if isinstance(reply, MessageReply):
            reply.payload = to_completion(
                reply.payload, reply.usage, completion_id=completion_id, model=name, created=created, renamed=renamed
            )
        elif isinstance(reply, EventStreamReply):
            reply.encoder = ChunkEncoder(
                completion_id=completion_id,
                model=name,
                created=created,
                include_usage=include_usage,
                renamed=renamed,
                usage=reply.usage,
            )
        return reply

    return translator


def _fallbacks(models, asked: str, find_model: Callable[[str], Model | None]) -> tuple[str, ...]:
    """The request's `models`: alternatives tried in order when the asked model cannot answer."""
    if models is None:
        return ()
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise invalid_request("models: expected a list of model ids", "models")
    for name in models:
        if find_model(name) is None:
            raise model_not_found(name)
    return tuple(dict.fromkeys(m for m in models if m != asked))
