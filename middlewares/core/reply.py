"""Replies that have not been sent yet.

The proxy handler returns one of these; on the way out the stages replace the payload (a whole
message) or the encoder (an event stream), and billing wraps the events. Nothing reaches the
socket until aiohttp calls `prepare`, after the outermost stage has returned, as with aiohttp's
own FileResponse.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from middlewares.core.errors import GatewayError, error_event
from middlewares.core.usage import StreamUsage, Usage

log = logging.getLogger("ezat.reply")

PING = b": ping\n\n"  # an SSE comment: OpenAI's clients skip it
ANTHROPIC_PING = b'event: ping\ndata: {"type":"ping"}\n\n'  # Anthropic's own, which its clients know
INTERNAL_ERROR = error_event("The gateway failed mid-stream.")


class MessageReply(web.Response):
    """One JSON document: an Anthropic message until a stage replaces `payload`. Its usage is
    read once, here, for every stage that needs it (billing, the translator)."""

    def __init__(self, payload: dict[str, Any], *, headers: dict[str, str] | None = None) -> None:
        super().__init__(headers=headers, content_type="application/json")
        self.payload = payload
        self.usage = Usage.from_message(payload)
        # The upstream message's, for the app's traces (a stage may replace the payload).
        self.message_id, self.stop_reason = payload.get("id"), payload.get("stop_reason")
        self.response_model = payload.get("model")

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        self.body = orjson.dumps(self.payload)
        return await super().prepare(request)


class RelayedEvent(dict[str, Any]):
    """A stream event the gateway has read, sent on as the upstream's own bytes (`raw`: the
    whole SSE event), not written again."""

    __slots__ = ("raw",)
    raw: bytes


# A batch: the events that arrived together. Each is a dict, or, on a stream relayed as the
# upstream sent it, bytes: a run of content_block_delta events the gateway did not parse.
Batch = list[dict[str, Any] | bytes]


def ends_stream(batch: Batch) -> str | None:
    """The type of the event that ends the stream with this batch (only a batch's last event
    can: nothing after an end is read), or None."""
    last = batch[-1] if batch else None
    if not isinstance(last, dict):
        return None
    kind = last["type"]
    return kind if kind in ("message_stop", "error") else None


class EventEncoder(Protocol):
    finished: bool  # the last batch encoded ended the stream
    ping: bytes  # what keeps a quiet stream alive, in the encoder's framing

    def encode(self, batch: Batch) -> bytes:
        """The bytes to send for a batch of upstream events (b"" when none)."""


class EventStream(Protocol):
    """Batches of Anthropic stream events: the events that arrived together ([] when a read
    held no whole event). `usage` has counted a batch by the time it is returned."""

    usage: StreamUsage

    def __aiter__(self) -> AsyncIterator[Batch]: ...
    async def __anext__(self) -> Batch: ...
    async def aclose(self, failed: bool = False) -> None:
        """`failed`: the stream ended in an error the client was told of (not billed)."""


class EventSource(EventStream, Protocol):
    """Where a stream's events come from (the upstream), which the gateway can end."""

    def stop(self, event: dict[str, Any]) -> None:
        """End the stream now: what is being read is cut off, and `event` (an error) comes next."""


class AnthropicSSE:
    """Anthropic's own SSE framing: what a stream sends when no stage translates it. Events the
    gateway relays go out as the upstream's bytes; those it made (an error) are written here.
    With `model`, the message is said to be that model's (the name the client asked by, not
    the upstream's). With `usage` (the stream's meter), a message_delta whose output count the
    gateway did not bill as sent says the output it billed, so the client and the ledger agree."""

    finished = False
    ping = ANTHROPIC_PING

    def __init__(self, model: str | None = None, usage: StreamUsage | None = None) -> None:
        self._model = model
        self._usage = usage

    def encode(self, batch: Batch) -> bytes:
        self.finished = ends_stream(batch) is not None
        return b"".join(self._bytes(event) for event in batch)

    def _bytes(self, event: dict[str, Any] | bytes) -> bytes:
        if isinstance(event, bytes):
            return event
        kind = event["type"]
        if kind == "message_start" and self._model is not None and isinstance(event.get("message"), dict):
            return _with_model(event, self._model)
        if kind == "message_delta" and self._usage is not None:
            billed = self._usage.total()
            if billed.estimated is not None:
                return _sse({**event, "usage": {**(event.get("usage") or {}), "output_tokens": billed.output_tokens}})
        return event.raw if isinstance(event, RelayedEvent) else _sse(event)


def _sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]  # the event's name is its type, as on Anthropic's API
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


# The first "model" member of a message_start's data, its value a JSON string.
_MODEL_MEMBER = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.)*")')


def _with_model(event: dict[str, Any], model: str) -> bytes:
    """A message_start said to be `model`'s: in its own bytes where the gateway relays them
    (only the name's value changes), else written again."""
    if isinstance(event, RelayedEvent):
        raw = event.raw
        found = _MODEL_MEMBER.search(raw)
        # It is the message's own member when it holds the message's name.
        if found is not None and orjson.loads(found[1]) == event["message"].get("model"):
            return raw[: found.start(1)] + orjson.dumps(model) + raw[found.end(1) :]
    return _sse({**event, "message": {**event["message"], "model": model}})


class StreamRegistry(Protocol):
    """Where an app keeps its open streams (to keep quiet ones alive, to end them on shutdown)."""

    def watch(self, stream: EventStreamReply) -> None: ...
    def done(self, stream: EventStreamReply) -> None: ...


class EventStreamReply(web.StreamResponse):
    """An SSE stream, written batch by batch as the upstream produces it.

    Each batch is encoded and written at once, so events that arrived together leave in one
    write; the headers go with the first batch, and the chunked body's terminator with the
    last. While it is open, `streams` keeps it alive through long pauses, and may end it. However
    the loop ends (done, client gone, cancelled), the upstream stream is closed with it. Its
    `usage` is the events' meter, read by every stage that needs it (billing, the translator).
    """

    # prepare() runs once the first output is at hand (the proxy primes the stream): the
    # headers can wait for it and share its write, as aiohttp's own Response does.
    _send_headers_immediately = False

    def __init__(
        self, events: EventSource, *, streams: StreamRegistry | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(headers=headers)
        self.content_type = "text/event-stream"
        self.headers["Cache-Control"] = "no-cache"
        self.events: EventStream = events  # the source, or a stage's wrapping of it
        self.usage = events.usage  # the stages wrap `events`; this stays the source's meter
        self._source = events
        self.encoder: EventEncoder = AnthropicSSE()
        self._streams = streams
        self.last_write = 0.0  # loop time of the last write, for the pings
        self.writing_since: float | None = None  # loop time a write began that has not ended yet
        self._transport: asyncio.Transport | None = None
        self._ending = False
        self._failed = False  # the stream failed (the upstream, or the gateway), and said so in the stream
        self._when_done: list[Callable[[EventStreamReply], None]] = []
        self.first_output_at: float | None = None  # loop time prepare began: the first output is at hand then
        self.outcome = "client_closed"  # until the stream's end is written: "ok", or "failed"
        self.failure: Exception | None = None  # the gateway's failure that ended the stream, if one did

    @property
    def message_id(self) -> str | None:
        return self.usage.message_id

    @property
    def stop_reason(self) -> str | None:
        return self.usage.stop_reason

    @property
    def response_model(self) -> str | None:
        return self.usage.response_model

    def when_done(self, callback: Callable[[EventStreamReply], None]) -> None:
        """Call `callback(self)` once the stream has ended, however it ended (its `outcome`)."""
        self._when_done.append(callback)

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        self.first_output_at = asyncio.get_running_loop().time()  # prepare waits for it (the proxy primes)
        try:
            self._transport = request.transport
            writer = await super().prepare(request)
            await self._send_events()
            return writer
        finally:
            if self._streams is not None:
                self._streams.done(self)
            try:
                await self.events.aclose(self._failed)
            except BaseException as exc:
                if self.outcome == "client_closed" and not self._failed:
                    self.outcome = "failed"  # billing could not record what the client got
                if isinstance(exc, GatewayError) and exc.quiet:
                    self.failure = exc  # told once elsewhere (when_done's callbacks), not to aiohttp's log
                else:
                    raise
            finally:
                for callback in self._when_done:
                    try:
                        callback(self)
                    except Exception:
                        log.exception("a stream's when_done callback failed")

    def stop(self, event: dict[str, Any]) -> None:
        self._source.stop(event)

    def abandon(self) -> None:
        """Drop the client's connection: a client that has stopped reading holds a write (and
        the upstream behind it) forever otherwise. The write fails, and the stream ends."""
        if self._transport is not None:
            self._transport.abort()

    async def ping(self) -> None:
        # Not after the body's terminator (nothing may follow it), nor beside a write that waits:
        # that client is not reading, and the app's sweep drops it.
        if self._ending or self.writing_since is not None:
            return
        try:
            await self._write(self.encoder.ping)  # whole writes: never inside another chunk
        except (ConnectionError, RuntimeError):
            pass  # the stream ended meanwhile

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        """Every write of the stream's goes here: while one waits (a client that stopped
        reading), `writing_since` says since when. One that returns at once, as nearly all do,
        is never seen half-way."""
        self.writing_since = self.last_write = asyncio.get_running_loop().time()
        if last:
            await self.write_eof(data)
        else:
            await self.write(data)
        self.writing_since = None

    async def _send_events(self) -> None:
        encoder = self.encoder
        encode = encoder.encode
        self.last_write = asyncio.get_running_loop().time()
        if self._streams is not None:
            self._streams.watch(self)
        try:
            async for batch in self.events:
                data = encode(batch)
                if encoder.finished:
                    # write_eof sets aiohttp's own flag only after draining: a ping must not
                    # slip in after the terminator meanwhile.
                    self._ending = True
                    self._failed = ends_stream(batch) == "error"
                    await self._write(data, last=True)
                    self.outcome = "failed" if self._failed else "ok"
                    return
                if data:
                    await self._write(data)
                del batch, data  # not held while the next is awaited, which may be seconds
        except ConnectionError:
            raise  # the client is gone; aiohttp notes it
        except Exception as exc:
            # The 200 is committed: the only way left to say it failed is in the stream itself.
            self._failed = True
            self.failure = exc
            if isinstance(exc, GatewayError):  # a failure the gateway foresaw, with its message
                if not exc.quiet:
                    log.warning("stream to the client failed: %s", exc)
                error = error_event(exc.message)
            else:
                log.exception("stream to the client failed")
                error = INTERNAL_ERROR
            await self._write(encode([error]))
            self.outcome = "failed"
