"""The Responses API stages: OpenAI's Responses API in, Anthropic Messages to the handler, and the
reply back: a message becomes a `response`, stream events the Responses event protocol.

`responses_refusals_middleware` refuses, before admission, the fields nothing upstream does;
`responses_middleware` stands where the chat route's translator does."""

from __future__ import annotations

import time
from functools import partial

from aiohttp import web

from middlewares.core.chain import stage
from middlewares.core.context import ANSWERED_MODEL, BODY, CONVERSATION, MODEL, request_id
from middlewares.core.reply import EventStreamReply, MessageReply
from middlewares.responses.reply import to_response
from middlewares.responses.request import prompt_cache_key, refused_field, to_anthropic
from middlewares.responses.sealing import KEY_BYTES, open_sealed, seal
from middlewares.responses.stream import ResponsesEncoder

__all__ = ["responses_middleware", "responses_refusals_middleware"]


def responses_refusals_middleware():
    """A 400 naming the first field of a Responses request the gateway refuses (`background`,
    `conversation`, `previous_response_id`, `prompt`, `truncation: "auto"`, an unknown `include`,
    `n`, `top_logprobs`): cheap, so it goes before admission and downloads, as the chat route's
    refusals do."""

    @stage("responses_refusals", requires=(BODY,))
    async def responses_refusals(request: web.Request, handler) -> web.StreamResponse:
        refused = refused_field(request[BODY])
        if refused is not None:
            raise refused
        return await handler(request)

    return responses_refusals


def responses_middleware(*, reasoning_key: bytes | None = None):
    """Replaces `request[BODY]`, a Responses API request, by the Anthropic Messages request for
    `request[MODEL]` (invalid fields are a 400 naming the field), then turns the handler's reply,
    an unsent Anthropic message or event stream, into a `response` or its events. The request's
    `prompt_cache_key` goes to `request[CONVERSATION]`, for cache_breakpoints to name the
    conversation by once the body is Anthropic's.

    `reasoning_key` (32 bytes) seals the answer's thinking into reasoning items'
    encrypted_content and opens the ones sent back; without it none are made or opened, and a
    request that continues a tool call goes without thinking."""
    if reasoning_key is not None and len(reasoning_key) != KEY_BYTES:
        raise ValueError(f"responses_middleware: reasoning_key must be {KEY_BYTES} bytes")
    unseal = partial(open_sealed, key=reasoning_key) if reasoning_key is not None else None
    sealer = partial(seal, key=reasoning_key) if reasoning_key is not None else None

    @stage("responses", requires=(BODY, MODEL))
    async def responses(request: web.Request, handler) -> web.StreamResponse:
        body = request[BODY]
        asked = request[MODEL]
        conversation = prompt_cache_key(body)
        if conversation is not None:
            request[CONVERSATION] = conversation
        request[BODY], turn = to_anthropic(
            body,
            asked,
            response_id="resp_" + request_id(request),
            created_at=int(time.time()),
            unseal=unseal,
            seal=sealer,
        )
        reply = await handler(request)
        answered = request.get(ANSWERED_MODEL, asked)
        if answered.id != asked.id:
            turn.model = answered.id  # a fallback answered: the response names it
        if isinstance(reply, MessageReply):
            reply.payload = to_response(reply.payload, reply.usage, turn)
        elif isinstance(reply, EventStreamReply):
            reply.encoder = ResponsesEncoder(turn, reply.usage)
        return reply

    return responses
