"""The Responses API stages: OpenAI's Responses API in, Anthropic Messages to the handler, and the
reply back: a message becomes a `response`, stream events the Responses event protocol.

`responses_refusals_middleware` refuses, before admission, the fields nothing upstream does;
`responses_middleware` stands where the chat route's translator does, and keeps each answer in
the store it is given, for `previous_response_id` and the stored responses' routes."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import ANSWERED_MODEL, API_KEY, BODY, CONVERSATION, MODEL, request_id
from middlewares.core.errors import invalid_request
from middlewares.core.protocols import ResponseStore
from middlewares.core.reply import Batch, EventStreamReply, MessageReply
from middlewares.core.usage import StreamUsage
from middlewares.responses.reply import THINKING_BLOCKS, to_response
from middlewares.responses.request import (
    input_items,
    keeps,
    previous_response_id,
    prompt_cache_key,
    referenced_responses,
    refused_field,
    to_anthropic,
)
from middlewares.responses.sealing import KEY_BYTES, open_sealed, seal
from middlewares.responses.stream import ResponsesEncoder
from middlewares.responses.turn import ResponseTurn

__all__ = ["responses_middleware", "responses_refusals_middleware"]


def responses_refusals_middleware() -> Stage:
    """A 400 naming the first field of a Responses request the gateway refuses (`background`,
    `conversation`, `prompt`, `truncation: "auto"`, an unknown `include`,
    `n`, `top_logprobs`): cheap, so it goes before admission and downloads, as the chat route's
    refusals do."""

    @stage("responses_refusals", requires=(BODY,))
    async def responses_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = refused_field(request[BODY])
        if refused is not None:
            raise refused
        return await handler(request)

    return responses_refusals


def responses_middleware(*, reasoning_key: bytes | None = None, store: ResponseStore | None = None) -> Stage:
    """Replaces `request[BODY]`, a Responses API request, by the Anthropic Messages request for
    `request[MODEL]` (invalid fields are a 400 naming the field), then turns the handler's reply,
    an unsent Anthropic message or event stream, into a `response` or its events. The request's
    `prompt_cache_key` goes to `request[CONVERSATION]`, for cache_breakpoints to name the
    conversation by once the body is Anthropic's.

    `reasoning_key` (32 bytes) seals the answer's thinking into reasoning items'
    encrypted_content, for `request[API_KEY]` alone, and opens the ones sent back sealed for it;
    without it none are made or opened, and a request that continues a tool call goes without
    thinking.

    `store` keeps each answered response (unless the request says `"store": false`) with the
    conversation in Anthropic's format, the answer's blocks last, thinking included; a request's
    `previous_response_id` continues from it, and one it does not find is a 400. A streamed
    response is kept as its last event is encoded, completed or incomplete, before the client
    can read it; a failed one, or one the client left, is not. An `item_reference` in the input
    is looked up in the key's stored response its id names. Without a store nothing is kept and
    every `previous_response_id` and `item_reference` is a 400."""
    if reasoning_key is not None and len(reasoning_key) != KEY_BYTES:
        raise ValueError(f"responses_middleware: reasoning_key must be {KEY_BYTES} bytes")

    # The key finds stored responses and owns the ones it makes, and its reasoning opens for it alone.
    @stage(
        "responses",
        requires=(BODY, MODEL) if store is None and reasoning_key is None else (BODY, MODEL, API_KEY),
        provides=(CONVERSATION,),
        reads=(ANSWERED_MODEL,),
    )
    async def responses(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request[BODY]
        asked = request[MODEL]
        conversation = prompt_cache_key(body)
        if conversation is not None:
            request[CONVERSATION] = conversation
        previous = None
        previous_id = previous_response_id(body)
        if previous_id is not None:
            previous = await store.find(previous_id, request[API_KEY].id) if store is not None else None
            if previous is None:
                raise invalid_request(f"Previous response with id '{previous_id}' not found.", "previous_response_id")
        referenced = {}
        if store is not None:  # without one, a reference is a 400 naming it
            for named in referenced_responses(body):
                found = await store.find(named, request[API_KEY].id)
                if found is None:
                    break  # the first reference to it is the 400, whatever follows
                referenced[named] = found
        response_id = "resp_" + request_id(request)
        unseal = sealer = None
        if reasoning_key is not None:
            key_id = request[API_KEY].id
            unseal = partial(open_sealed, key=reasoning_key, key_id=key_id)
            sealer = partial(seal, key=reasoning_key, key_id=key_id)
        request[BODY], turn = to_anthropic(
            body,
            asked,
            response_id=response_id,
            created_at=int(time.time()),
            unseal=unseal,
            seal=sealer,
            previous=previous,
            referenced=referenced,
        )
        kept = None
        if keeps(body) and store is not None:
            # The stages after this one mark cache breakpoints on these blocks: a continuation
            # reads them back without (request._earlier_entries).
            items = input_items(body, response_id)
            kept = _Kept(store, request[API_KEY].id, items, turn.conversation, turn.conversation_system)
        reply = await handler(request)
        answered = request.get(ANSWERED_MODEL, asked)
        if answered.id != asked.id:
            turn.model = answered.id  # a fallback answered: the response names it
        if isinstance(reply, MessageReply):
            answer = reply.payload.get("content") or []
            reply.payload = to_response(reply.payload, reply.usage, turn)
            if kept is not None:
                kept.keep(reply.payload, answer)
        elif isinstance(reply, EventStreamReply):
            reply.encoder = (
                ResponsesEncoder(turn, reply.usage) if kept is None else _KeepingEncoder(turn, reply.usage, kept)
            )
        return reply

    return responses


class _KeepingEncoder(ResponsesEncoder):
    """A Responses stream's encoder that keeps the response once its last event is encoded,
    before that event is written: a client that continues the response as soon as it has read
    response.completed finds it kept (or being written)."""

    def __init__(self, turn: ResponseTurn, usage: StreamUsage, kept: _Kept) -> None:
        super().__init__(turn, usage)
        self._kept: _Kept | None = kept

    def encode(self, batch: Batch) -> bytes:
        data = super().encode(batch)
        if self.finished and self._kept is not None:
            kept, self._kept = self._kept, None
            if self.response is not None and self.response["status"] != "failed":
                kept.keep(self.response, self.answer())
        return data


class _Kept:
    """What a response is kept with, gathered before the request goes upstream."""

    def __init__(
        self,
        store: ResponseStore,
        key_id: int,
        items: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        system: list[dict[str, Any]],
    ) -> None:
        self._store, self._key_id, self._items, self._messages, self._system = store, key_id, items, messages, system

    def keep(self, response: dict[str, Any], answer: list[dict[str, Any]]) -> None:
        """The response, and the conversation with its answer's assistant turn last."""
        blocks = [block for block in answer if _kept_block(block)]
        messages = self._messages + [{"role": "assistant", "content": blocks}] if blocks else self._messages
        self._store.keep(self._key_id, response, self._items, messages, self._system or None)


def _kept_block(block: dict[str, Any]) -> bool:
    """The answer's blocks a later request sends back: not a server tool's (the client's tools
    only), nor empty text, which the upstream refuses."""
    kind = block.get("type")
    if kind == "text":
        return bool(block.get("text"))
    return kind == "tool_use" or kind in THINKING_BLOCKS
