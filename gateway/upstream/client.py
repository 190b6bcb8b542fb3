"""The upstream side: one pooled HTTP client per process, and an upstream SSE body read as
batches of Anthropic events."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.config import Deployment
from gateway.upstream.anthropic import Anthropic
from gateway.upstream.bedrock import Bedrock
from gateway.upstream.provider import MESSAGES, Lines, Provider, UpstreamBody
from gateway.upstream.shape import passed_on_error, readable_event
from gateway.upstream.vertex import Vertex
from middlewares.core.errors import GatewayError, error_event, stream_error
from middlewares.core.reply import Batch, RelayedEvent, ends_stream
from middlewares.core.sizes import MAX_BODY_BYTES, MiB
from middlewares.core.usage import StreamUsage

log = logging.getLogger("ezat.upstream")

# Events that mean the model has produced something (or finished): before one of them the
# request can still fail cleanly, as an HTTP error.
_FIRST_OUTPUT = frozenset({"content_block_delta", "message_delta", "message_stop", "error"})
# Events that end a stream: nothing after one of them is read.
_ENDS = frozenset({"message_stop", "error"})
# Seconds a finished stream's connection waits for the body's last bytes before it is closed.
_LAST_BYTES_WITHIN = 5.0
# The most an event may take, whole. Anthropic's largest (a server tool's results) are far
# smaller; an upstream that sends more without an event's end is not sending SSE.
MAX_EVENT_BYTES = 4 * 1024 * 1024
_CUT_SHORT = error_event("The upstream stream ended early.")
_UNREADABLE = error_event("The upstream sent an event the gateway cannot read.")


class UpstreamUnreachable(GatewayError):
    """The upstream could not be reached, or its connection broke before its answer was whole."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, type="server_error")


class UpstreamClient:
    """Sends Anthropic Messages requests to deployments, each through its provider, over one
    shared connection pool."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._providers: dict[Deployment, Provider] = {}  # made at a deployment's first request

    async def lifespan(self, app: web.Application):
        """aiohttp cleanup context: the pool lives as long as the app."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),  # per deployment, below; overall, in the handler
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),  # an upstream's cookies are no client's
        )
        yield
        await self._session.close()

    def provider(self, deployment: Deployment) -> Provider:
        provider = self._providers.get(deployment)
        if provider is None:
            provider = self._providers[deployment] = PROVIDERS[deployment.provider](deployment)
        return provider

    async def post(
        self,
        deployment: Deployment,
        body: UpstreamBody,
        *,
        path: str = MESSAGES,
        headers: Lines = (),
        query: Mapping[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """POST `body` (a request to encode, or the client's own bytes) to `path` (MESSAGES or
        COUNT_TOKENS, as Anthropic's API names them) at `deployment`, as its provider sends it;
        `headers` ((lower-cased name, value) lines: a client's own anthropic-version or
        anthropic-beta, each line as it sent it) and `query` are what a client of Anthropic's
        API sent with it. A non-2xx answer is raised as the client's error."""
        assert self._session is not None, "UpstreamClient.lifespan is not running"
        provider = self.provider(deployment)
        outgoing = await provider.outgoing(body, path, headers, query or {})
        # Inlined images (base64) can take an encoded body over; the client's bytes were read
        # within the limit, but are measured the same.
        if len(outgoing.data) > MAX_BODY_BYTES:
            raise GatewayError(
                413,
                f"The request is over {MAX_BODY_BYTES // MiB} MB once its image URLs are downloaded and inlined ({len(outgoing.data):,} bytes); "
                "send fewer or smaller images.",
                code="request_too_large",
            )
        try:
            # A redirect is an error: followed, it would take the deployment's key and the prompt to another host.
            response = await self._session.post(
                outgoing.url,
                data=outgoing.data,
                headers=outgoing.headers,
                timeout=provider.timeout,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("deployment %s unreachable: %r", deployment.name, exc)
            raise UpstreamUnreachable("Could not reach the upstream.") from None
        if response.status >= 300:
            try:
                error_body = await response.content.read(65536)
            except (aiohttp.ClientError, OSError):
                error_body = b""
            finally:
                response.close()
            raise provider.error(response.status, error_body, response.headers, path)
        return response


PROVIDERS: dict[str, Callable[[Deployment], Provider]] = {"anthropic": Anthropic, "bedrock": Bedrock, "vertex": Vertex}


class UpstreamEvents:
    """An upstream SSE body as batches of events: the events that arrived in one read. Parsed,
    a text block's deltas among them joined into one; or, with `relay`, as the upstream's
    bytes, only the events the gateway reads parsed (see _relayed_events). `usage` meters
    them as they are read.

    The stream ends after `message_stop` or `error`; a body that ends before either yields an
    `error` event, so nothing downstream mistakes a cut stream for a finished one.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        *,
        idle_timeout: float | None = None,
        max_duration: float | None = None,
        relay: bool = False,
        decode: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.usage = StreamUsage()
        self._decode = decode  # the provider's: its stream's bytes as Anthropic's SSE
        self._events_of: Callable[[bytes], Batch] = _relayed_events if relay else _parse_events
        self._response = response
        self._content = response.content
        self._partial = bytearray()  # the start of an event whose end has not arrived
        self._held_cr = False  # the last read ended in "\r": the next may start with its "\n"
        self._pending: list[Batch] = []  # a list: an empty deque is several times larger, and every stream has one
        self._finished = False
        self._closed = False
        self._stopped: dict[str, Any] | None = None  # the error the gateway ends the stream with
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._last_read = self._clock()
        self._idle_timeout = idle_timeout
        self._begun = False  # the model has produced output: from then on, silence counts
        self._max_duration = max_duration
        self._ends_at = None if max_duration is None else self._last_read + max_duration
        # One timer a stream for both limits, not one each: every open stream holds its timers.
        # It is moved on when it fires and once when the stream begins, never by a read (a read
        # just notes its time), so a stream of many reads makes no timers.
        self._watch = None if self._ends_at is None else loop.call_at(self._ends_at, self._check_limits)

    async def first_output(self) -> None:
        """Read until the model has produced output, keeping what was read for the client.
        An error before that is raised as an HTTP error: the client has seen nothing yet.
        From then on, an upstream silent for `idle_timeout` is given up on."""
        primed: list[Batch] = []
        try:
            while True:
                batch = await self.__anext__()  # nothing is pending yet: this reads
                if batch:
                    primed.append(batch)
                for event in batch:
                    if isinstance(event, bytes):  # relayed: a run of content_block_deltas
                        event = _RELAYED_DELTA
                    if event["type"] == "error":
                        raise stream_error(event)
                    if event["type"] in _FIRST_OUTPUT:
                        self._pending.extend(primed)
                        if self._idle_timeout is not None and not self._closed:
                            self._begun = True
                            self._check_limits()
                        return
        except BaseException:  # an error, or the client went away: the upstream goes too
            await self.aclose()
            raise

    def _check_limits(self) -> None:
        """End the stream if it has reached its maximum duration, or (once it has begun) has
        been silent for its idle timeout; else look again when the first of them could be."""
        now = self._clock()
        if self._ends_at is not None and now >= self._ends_at:
            self.stop(error_event(f"The stream reached its maximum duration of {self._max_duration:g} seconds."))
            return
        next_check = self._ends_at
        if self._begun and self._idle_timeout is not None:  # (it begins only with an idle timeout)
            if now - self._last_read >= self._idle_timeout:
                self.stop(error_event(f"The upstream sent nothing for {self._idle_timeout:g} seconds."))
                return
            idle_at = self._last_read + self._idle_timeout
            next_check = idle_at if next_check is None else min(next_check, idle_at)
        if self._watch is not None:
            self._watch.cancel()
        self._watch = None if next_check is None else asyncio.get_running_loop().call_at(next_check, self._check_limits)

    def __aiter__(self) -> UpstreamEvents:
        return self

    async def __anext__(self) -> Batch:
        """The next batch: what first_output kept, else what the next read brought."""
        if self._pending:
            return self._pending.pop(0)
        if self._finished:
            raise StopAsyncIteration
        try:
            chunk = await self._content.readany()  # all that is buffered: a burst is one read
        except (aiohttp.ClientError, OSError) as exc:
            if self._stopped is None:
                log.warning("upstream stream broke: %r", exc)
            chunk = b""
        if not chunk or self._stopped is not None:
            await self.aclose()
            return [self._stopped or _CUT_SHORT]
        self._last_read = self._clock()
        if self._decode is not None and not (chunk := self._decode(chunk)):
            return []
        complete = self._complete_events(chunk)
        if complete is None:
            if len(self._partial) > MAX_EVENT_BYTES:
                log.warning(
                    "upstream sent %d bytes without an event's end, starting %r",
                    len(self._partial),
                    bytes(self._partial[:200]),
                )
                await self.aclose()
                return [_UNREADABLE]
            return []
        batch = self._events_of(complete)
        self.usage.count(batch)
        if ends_stream(batch):
            # The upstream ended the stream, unless the gateway gave up on what it sent: then
            # it is still answering, and its connection is closed at once.
            self._finished = batch[-1] is not _UNREADABLE
            await self.aclose()
        return batch

    def _complete_events(self, chunk: bytes) -> bytes | None:
        """The whole events that `chunk` completes ("\r\n" made "\n"), or None when it completes
        none. An event's start is kept in a bytearray that each read extends, and only what a read
        added is searched: the work stays linear in the bytes, however an event is split."""
        if self._held_cr:
            chunk = b"\r" + chunk
        self._held_cr = chunk.endswith(b"\r")
        if self._held_cr:
            chunk = chunk[:-1]
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        partial = self._partial
        if not partial:  # as reads mostly go: the last one ended where an event did
            end = chunk.rfind(b"\n\n") + 2
            if end == 1:
                partial += chunk
                return None
            if end == len(chunk):
                return chunk
            partial += memoryview(chunk)[end:]
            return chunk[:end]
        searched = len(partial) - 1  # an event's end may straddle the two
        partial += chunk
        end = partial.rfind(b"\n\n", searched) + 2
        if end == 1:
            return None
        complete = bytes(partial[:end])
        del partial[:end]
        return complete

    def stop(self, event: dict[str, Any]) -> None:
        """End the stream now with `event`, an error: the read under way (if any) is cut off by
        closing the connection, and the batch it returns is `event`. A finished stream stays as it is."""
        if not self._finished:
            self._stopped = event
            self._response.close()

    async def aclose(self, failed: bool = False) -> None:
        """Give the connection back: to the pool once the body has ended, closed if the stream
        was cut short (an unread body makes a connection unusable)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        ended = self._finished  # message_stop or error read (a cut stream closes before it is set)
        self._finished = True
        if self._content.at_eof():
            self._response.release()
        elif ended:
            # message_stop arrived before the chunked body's last bytes. aiohttp gives the
            # connection back to the pool when they come (a TLS handshake kept, against a real
            # upstream); if they do not come soon, the connection is closed.
            timer = asyncio.get_running_loop().call_later(_LAST_BYTES_WITHIN, self._response.close)
            self._content.on_eof(timer.cancel)
        else:
            self._response.close()


# A data line's value. A line starts after "\n" (JSON holds none raw), so the pattern starts
# with a literal, which re finds by a fast scan for it; "^data: ?(.*)$" in MULTILINE would be
# tried at every position.
_DATA_LINE = re.compile(rb"\ndata: ?(.*)")


# An event that names anything but a content_block_delta: the events a relayed stream parses.
_READ_EVENT = re.compile(rb"\n\nevent:(?! ?content_block_delta\n)")
# An event that does not start with its event line (a relayed stream parses its batch whole).
_UNNAMED_EVENT = re.compile(rb"\n\n(?!event:|\Z)")
# What a relayed run of deltas is, to first_output: output.
_RELAYED_DELTA = {"type": "content_block_delta"}
_NO_EVENT = {"type": ""}

# A text delta's data line up to its text, as Anthropic writes it (compact, keys in this order).
# An upstream that writes it otherwise is read the same, its deltas just not joined.
_TEXT_DELTA = re.compile(rb'data: \{"type":"content_block_delta","index":\d+,"delta":\{"type":"text_delta","text":"')


def _parse_events(complete: bytes) -> Batch:
    """The events in `complete` (whole SSE events, "\n"-separated), parsed, through the first
    one that ends the stream; an event the gateway cannot read ends it as an error. Every event
    the upstream sends has one data line, so all of them parse as one JSON array: one call for
    the whole batch, not one per event. Anything else takes the event-by-event way."""
    complete = _join_text_deltas(complete)
    # (An event of several data lines yields pieces that are not JSON objects, and so the slow way.)
    try:
        events = orjson.loads(b"[" + b",".join(_DATA_LINE.findall(b"\n" + complete)) + b"]")
    except orjson.JSONDecodeError:
        events = None
    if events is not None and (through_end := _through_end(events)) is not None:
        return through_end
    parsed = _through_end([event for raw in complete.split(b"\n\n") if (event := _parse_event(raw)) is not None])
    assert parsed is not None  # each of them is a JSON event
    return parsed


def _relayed_events(complete: bytes) -> Batch:
    """The events in `complete` as a relayed stream has them, through the first that ends the
    stream: each run of content_block_delta events (nearly all of a stream) as its bytes,
    unparsed; every other event (message_start and _delta, message_stop, error, a block's
    start and stop, ping: a few a stream) parsed, its bytes kept beside it. Events are told
    apart by their `event:` line; a batch in which an event has none is parsed whole."""
    if not complete.startswith(b"event:") or _UNNAMED_EVENT.search(complete) is not None:
        events = _through_end([_relayed(raw + b"\n\n") for raw in complete.split(b"\n\n")[:-1]])
        assert events is not None  # each of them is a JSON event or a RelayedEvent of one
        return events
    batch: Batch = []
    done = 0  # what of `complete` is in the batch
    for found in _READ_EVENT.finditer(b"\n\n" + complete):  # the first event too follows a blank line
        start = found.start()  # where the event starts in `complete`: its event line
        end = complete.find(b"\n\n", start) + 2
        if start > done:
            batch.append(complete[done:start])
        batch.append(_relayed(complete[start:end]))
        done = end
    if done < len(complete):
        batch.append(complete[done:])
    relayed = _through_end(batch)
    assert relayed is not None  # each of them is bytes or a RelayedEvent of a JSON event
    return relayed


def _relayed(raw: bytes) -> RelayedEvent:
    """One SSE event, read, with its bytes. One that holds no JSON event (a comment, an event
    without data) is of no type the gateway knows, and passes as it came."""
    event = None
    data = raw.find(b"\ndata:") + 6
    if data > 5 and raw.find(b"\n", data) == len(raw) - 2:  # one data line, the last: as upstreams write
        try:
            event = orjson.loads(raw[data:])  # the space after "data:" and the blank line are JSON's whitespace
        except orjson.JSONDecodeError:
            pass
    if not (isinstance(event, dict) and type(event.get("type")) is str):
        event = _parse_event(raw)
    event = RelayedEvent(event or _NO_EVENT)
    event.raw = raw
    return event


def _through_end(events: list) -> Batch | None:
    """`events` through the first that ends the stream, or that the gateway cannot read (an
    error then ends it); None if one of them is not a JSON event (one of several data lines).
    Relayed bytes pass as they are."""
    for index, event in enumerate(events):
        if event.__class__ is bytes:
            continue
        if not isinstance(event, dict) or type(event.get("type")) is not str:
            return None
        if not readable_event(event):  # the stream ends there, as if the upstream had failed
            log.warning("upstream sent an event the gateway cannot read, starting %r", repr(event)[:200])
            return [*events[:index], _UNREADABLE]
        if event["type"] == "error":
            return [*events[:index], passed_on_error(event)]
        if event["type"] in _ENDS:
            return events[: index + 1]
    return events


def _join_text_deltas(complete: bytes) -> bytes:
    """`complete` with the text deltas of its first text block made one delta, whose text is
    theirs joined: what lies between one delta's text and the next one's (the closing quote,
    the event's end, the next event's start up to its opening quote) is cut out. Parsing,
    metering and translating then handle a few events, not one dict per delta, on a burst (as a
    fast upstream sends most of a stream). Kept on an A/B of the OpenAI route with it and without
    it, against the floor in one run: under load it saves more than the rounds' spread on a
    burst, and costs nothing on deltas that come one by one, which leave it at once
    (bench/HISTORY.md, 2026-12-03 07:48).

    A JSON string holds no raw newline, so what is cut is never text, and escapes stay whole.
    The upstream sends one content block at a time, so after a block's first text delta, what
    is cut (a string's end, then that block's next text delta) only ever lies between two of
    its text deltas."""
    if complete.find(b"\n\n") == len(complete) - 2:  # one event (as paced tokens come): nothing to join
        return complete
    first = _TEXT_DELTA.search(complete)
    if first is None:
        return complete
    end = first.end()
    texts = complete[end:].split(b'"}}\n\nevent: content_block_delta\n' + first[0])
    return complete if len(texts) == 1 else complete[:end] + b"".join(texts)


def _parse_event(raw: bytes) -> dict[str, Any] | None:
    """One SSE event's JSON data, or None for comments and events without data."""
    data = b"\n".join(line[5:] for line in raw.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return None
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        log.warning("upstream sent an event that is not JSON: %r", raw[:200])
        return None
    return event if isinstance(event, dict) and isinstance(event.get("type"), str) else None
