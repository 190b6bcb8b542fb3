"""The size_limit stage: refuses bodies over the limit before reading them, then reads the body
within a deadline, decodes it (gzip, deflate) and parses the JSON once for every later stage,
refusing a key repeated at its top level.

aiohttp's server decodes gzip and deflate bodies itself unless it runs with
`auto_decompress=False` (as the gateway does: aiohttp would answer br or zstd with a plain-text
400 of its own, and log it as an error, before any stage runs). This stage works either way:
it decodes what the server left encoded, and caps the decoded size in both cases.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import BODY, BODY_BYTES, CLIENT_BYTES, ClientBytes
from middlewares.core.errors import GatewayError, invalid_request
from middlewares.core.sizes import MAX_BODY_BYTES, MiB

__all__ = ["ENCODINGS", "size_limit_middleware"]

# The Content-Encodings a body may have; any other (br, zstd, compress, several at once) is a 415.
ENCODINGS = ("identity", "gzip", "deflate")
DEFAULT_BODY_TIMEOUT = 60.0


def size_limit_middleware(
    *, max_bytes: int = MAX_BODY_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT, keep_client_bytes: bool = False
) -> Stage:
    """A body declared (Content-Length) or found (chunked, or once decoded) to be over
    `max_bytes` gets 413 `request_too_large`, unread past that point; one whose Content-Encoding
    is not identity, gzip or deflate gets 415, unread; one that does not decode gets 400, and one
    that has not all arrived `body_timeout` seconds after the stage began to read it gets 408 and
    its connection closed. One that is not a JSON object, or repeats a key at its top level, gets
    400. Otherwise the parsed object is `request[BODY]` and its
    decoded size in bytes `request[BODY_BYTES]`; with `keep_client_bytes`, for a handler that
    can send them on (the Messages route's), its decoded bytes too, tied to it,
    `request[CLIENT_BYTES]` (`client_bytes(request)` gives them while nothing has changed the
    body), when they are exactly what the gateway would write for it (`_as_written`). Otherwise
    they are let go once parsed: a body may be large, and a request may run long."""
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError("size_limit_middleware: max_bytes must be a positive integer")
    if (
        not isinstance(body_timeout, (int, float))
        or isinstance(body_timeout, bool)
        or not math.isfinite(body_timeout)
        or body_timeout <= 0
    ):
        raise ValueError("size_limit_middleware: body_timeout must be a positive number of seconds")
    size = f"{max_bytes // MiB} MB" if max_bytes % MiB == 0 else f"{max_bytes:,} bytes"
    too_large = f"The request body is over {size}."
    seconds = f"{body_timeout:g} second{'' if body_timeout == 1 else 's'}"
    too_slow = f"The request body did not arrive within {seconds}."

    def refuse() -> GatewayError:
        return GatewayError(413, too_large, code="request_too_large", refusal="field")

    async def read(request: web.Request, encoding: str) -> bytes:
        length = request.content_length  # as sent: before decoding
        if length is not None and length > max_bytes:
            raise refuse()
        if encoding == "identity" and length is not None:
            try:
                return await request.content.readexactly(length) if length else b""
            except asyncio.IncompleteReadError:
                raise invalid_request("The request body ended before its Content-Length.") from None
        # Chunked, or encoded (its Content-Length, if any, is not the decoded size): count as it
        # arrives, decoded, and stop at the limit.
        decoder = None if encoding == "identity" or _decoded_by_server(request) else Decoder(encoding)
        parts, size = [], 0
        async for part in request.content.iter_any():
            if decoder is not None:
                part = decoder.decode(part, max_bytes - size)
            size += len(part)
            if size > max_bytes:
                raise refuse()
            parts.append(part)
        if decoder is not None:
            decoder.end()
        return b"".join(parts)

    @stage("size_limit", provides=(BODY, BODY_BYTES, CLIENT_BYTES) if keep_client_bytes else (BODY, BODY_BYTES))
    async def size_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        encoding = "identity"
        try:
            encoding = _encoding(request)
            # The whole body, not each read; none for a body that has all arrived (most: a
            # small one comes with its headers), since reading it cannot wait.
            async with asyncio.timeout(None if request.content.is_eof() else body_timeout):
                raw = await read(request, encoding)
        except TimeoutError:
            raise _leave_unread(request, GatewayError(408, too_slow, code="timeout", refusal="field")) from None
        except (zlib.error, web.RequestPayloadError):  # aiohttp raises the latter when it decodes
            what = "could not be read" if encoding == "identity" else f"is not valid {encoding}"
            raise _leave_unread(request, invalid_request(f"The request body {what}.")) from None
        except GatewayError as error:
            if _decoded_by_server(request):  # what is left would be decoded for nothing
                _leave_unread(request, error)
            raise
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid_request(f"The request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise invalid_request("The request body must be a JSON object.")
        as_written = _as_written(body, raw)
        request[BODY] = body
        request[BODY_BYTES] = len(raw)
        if keep_client_bytes and as_written:
            # Held as long as the body is, no longer: the stage that changes the body lets them
            # go, and the proxy with the body once an answer has begun.
            request[CLIENT_BYTES] = ClientBytes(body, raw)
        del raw
        return await handler(request)

    return size_limit


def _as_written(body: dict[str, Any], raw: bytes) -> bool:
    """Whether `raw` is exactly orjson's writing of `body`, parsed from it. Then no object in it
    repeats a key (the writing would hold the key once, and be shorter), and the upstream reads
    in them what the gateway read: this is most bodies, since most clients write JSON compactly.
    Otherwise `raw` is read again, slowly, for a key repeated at its top level, a 400 naming it
    (where `model` or `max_tokens` would be checked and billed as one value and served as
    another); and the bytes do not stand for the body, whose own writing is sent instead. A body
    nested past the 255 levels orjson writes (it reads 1,024) is not read again, which Python's
    parser could not do all the way down: its bytes do not stand for it either, and the gateway
    cannot write it, so it reaches no upstream as it is (a 400 where it would be sent)."""
    try:
        if orjson.dumps(body) == raw:
            return True
    except orjson.JSONEncodeError:
        return False
    seen: set[str] = set()
    for key, _ in json.loads(raw, object_pairs_hook=list):  # a C builtin: each object a list of pairs
        if key in seen:
            named = key if len(key) <= 64 else key[:64] + "…"  # the client's text, echoed only so far
            raise invalid_request(f"{named}: appears more than once in the request body; send it once", named)
        seen.add(key)
    return False


def _encoding(request: web.Request) -> str:
    """The body's one Content-Encoding, lowercased ("identity" when none), or a 415."""
    sent = ", ".join(request.headers.getall("Content-Encoding", ()))
    codings = [coding.strip().lower() for coding in sent.split(",") if coding.strip()]
    if not codings:
        return "identity"
    if len(codings) == 1 and codings[0] in ENCODINGS:
        return codings[0]
    raise GatewayError(
        415,
        f"Content-Encoding: {sent.strip()} is not supported; send the body as gzip, deflate or uncompressed",
        code="unsupported_media_type",
        refusal="field",
    )


def _decoded_by_server(request: web.Request) -> bool:
    """Whether aiohttp decodes this body as it arrives (its server's auto_decompress, the
    default): it then counts the bytes as sent apart from the decoded ones."""
    # A request without a body has aiohttp's EmptyStreamReader, which counts nothing.
    return request.body_exists and request.content.total_compressed_bytes is not None


def _leave_unread(request: web.Request, error: GatewayError) -> GatewayError:
    """The rest of the body will not be read, and the connection closes once `error` is sent.
    Without this, aiohttp goes on reading the body for up to 10 s after the answer (its
    "lingering"): a slow client's hold on the connection, extended; a body aiohttp decodes,
    inflated for nothing, and if it does not decode, logged as an unhandled exception. A
    TimeoutError is what that loop takes as its end."""
    if not request.content.is_eof():
        request.content.set_exception(TimeoutError())
        error.force_close()
    return error


class Decoder:
    """A gzip or deflate body decoded as it arrives, each call making at most one byte more
    than the room left: a small body that would inflate to gigabytes is refused as it passes
    the limit, never decoded whole."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._zlib: zlib._Decompress | None = None

    def decode(self, data: bytes, room: int) -> bytes:
        out = b""
        while data and len(out) <= room:
            if self._zlib is None or self._zlib.eof:
                if self._zlib is not None and self.encoding == "deflate":
                    raise zlib.error("data after the end of the deflate stream")
                self._zlib = zlib.decompressobj(self._window(data))  # gzip: one member after another
            out += self._zlib.decompress(data, room + 1 - len(out))
            data = self._zlib.unused_data if self._zlib.eof else self._zlib.unconsumed_tail
        return out

    def end(self) -> None:
        if self._zlib is not None and not self._zlib.eof:
            raise zlib.error("the body ended inside the compressed stream")

    def _window(self, data: bytes) -> int:
        if self.encoding == "gzip":
            return 16 + zlib.MAX_WBITS
        # HTTP's deflate is zlib's format (RFC 1950), but some clients send raw deflate: told
        # apart by the first byte, as aiohttp does.
        return zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS
