"""The translator stage: OpenAI Chat Completions in, Anthropic Messages to the handler, and
the reply back: a message becomes a chat completion, stream events become chunks."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import ANSWERED_MODEL, BODY, MODEL, request_id
from middlewares.core.errors import invalid_request
from middlewares.core.reply import EventStreamReply, MessageReply
from middlewares.translator.request import to_anthropic
from middlewares.translator.response import to_completion
from middlewares.translator.stream import ChunkEncoder

__all__ = ["translator_middleware"]


def translator_middleware() -> Stage:
    """Replaces `request[BODY]`, an OpenAI chat completion request, by the Anthropic Messages
    request for `request[MODEL]` (fields the upstream has no use for are left out; invalid ones
    are a 400 naming the field), then turns the handler's reply, an unsent Anthropic message or
    event stream, into a chat completion or its chunks. `model` in the answer is the name the
    client sent (an alias stays an alias), unless another model answered (a fallback,
    `request[ANSWERED_MODEL]`, set by the handler): then that model's id."""

    @stage("translator", requires=(BODY, MODEL), reads=(ANSWERED_MODEL,))
    async def translator(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request[BODY]
        stream = body.get("stream")
        if stream is None:  # absent, or null: OpenAI's "not set"
            stream = False
        elif not isinstance(stream, bool):
            raise invalid_request("stream: expected a boolean", "stream")
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        asked = request[MODEL]
        sent = body.get("model")
        request[BODY], renamed = to_anthropic(body, asked)

        reply = await handler(request)
        answered = request.get(ANSWERED_MODEL, asked)
        name = sent if answered.id == asked.id and isinstance(sent, str) else answered.id
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
