"""Replies that have not been sent yet.

The proxy handler returns one of these; on the way out the stages replace the payload (a whole
message) or the encoder (an event stream), and billing wraps the events. Nothing reaches the
socket until aiohttp calls `prepare`, after the outermost stage has returned, as with aiohttp's
own FileResponse.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from aiohttp import web

log = logging.getLogger("ezat.reply")

PING = b": ping\n\n"
INTERNAL_ERROR = {"type": "error", "error": {"type": "api_error", "message": "The gateway failed mid-stream."}}


class MessageReply(web.Response):
    """One JSON document: an Anthropic message until a stage replaces `payload`."""

    def __init__(self, payload: dict[str, Any], *, headers: dict[str, str] | None = None) -> None:
        super().__init__(headers=headers, content_type="application/json")
        self.payload = payload

    async def prepare(self, request: web.BaseRequest):
        self.body = orjson.dumps(self.payload)
        return await super().prepare(request)


class EventEncoder(Protocol):
    def encode(self, batch: list[dict[str, Any]]) -> bytes:
        """The bytes to send for a batch of upstream events (b"" when none)."""


class EventStream(Protocol):
    """Batches of Anthropic stream events: the events that arrived together, or [] when the
    upstream has been silent for a while."""

    def __aiter__(self) -> AsyncIterator[list[dict[str, Any]]]: ...
    async def __anext__(self) -> list[dict[str, Any]]: ...
    async def aclose(self) -> None: ...


class AnthropicSSE:
    """Anthropic's own SSE framing: the handler's default, kept by the native endpoint."""

    def encode(self, batch: list[dict[str, Any]]) -> bytes:
        return b"".join(
            b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n" for event in batch
        )


class EventStreamReply(web.StreamResponse):
    """An SSE stream, written batch by batch as the upstream produces it.

    Each batch is encoded and written at once, so events that arrived together leave in one
    write. After `ping_interval` seconds without output a `: ping` comment keeps proxies from
    closing the connection. However the loop ends (done, client gone, cancelled), the
    upstream stream is closed with it.
    """

    def __init__(self, events: EventStream, *, ping_interval: float = 15.0, headers: dict[str, str] | None = None):
        super().__init__(headers=headers)
        self.content_type = "text/event-stream"
        self.headers["Cache-Control"] = "no-cache"
        self.events = events
        self.encoder: EventEncoder = AnthropicSSE()
        self.ping_interval = ping_interval

    async def prepare(self, request: web.BaseRequest):
        try:
            writer = await super().prepare(request)
            await self._send_events()
            return writer
        finally:
            await self.events.aclose()

    async def _send_events(self) -> None:
        loop = asyncio.get_running_loop()
        encode = self.encoder.encode
        quiet_since = loop.time()
        try:
            async for batch in self.events:
                data = encode(batch)
                if not data:
                    if loop.time() - quiet_since < self.ping_interval:
                        continue
                    data = PING
                await self.write(data)
                quiet_since = loop.time()
        except ConnectionError:
            raise  # the client is gone; aiohttp notes it
        except Exception:
            # Headers are out: the only way left to say it failed is in the stream itself.
            log.exception("stream to the client failed")
            await self.write(encode([INTERNAL_ERROR]))
