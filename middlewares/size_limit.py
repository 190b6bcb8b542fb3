"""The size_limit stage: refuses bodies over the limit before reading them, then reads and
parses the JSON body once for every later stage."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from middlewares.core.chain import stage
from middlewares.core.context import BODY, BODY_BYTES
from middlewares.core.errors import GatewayError, invalid_request
from middlewares.core.sizes import MAX_BODY_BYTES, MiB

__all__ = ["size_limit_middleware"]


def size_limit_middleware(*, max_bytes: int = MAX_BODY_BYTES):
    """A body declared (Content-Length) or found (chunked) to be over `max_bytes` gets 413
    `request_too_large`, unread; one that is not a JSON object gets 400. Otherwise the parsed
    object is `request[BODY]` and its size in bytes `request[BODY_BYTES]`."""
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError("size_limit_middleware: max_bytes must be a positive integer")
    size = f"{max_bytes // MiB} MB" if max_bytes % MiB == 0 else f"{max_bytes:,} bytes"
    too_large = f"The request body is over {size}."

    def refuse() -> GatewayError:
        return GatewayError(413, too_large, code="request_too_large")

    @stage("size_limit", provides=(BODY, BODY_BYTES))
    async def size_limit(request: web.Request, handler) -> web.StreamResponse:
        length = request.content_length
        if length is not None:
            if length > max_bytes:
                raise refuse()
            try:
                raw = await request.content.readexactly(length) if length else b""
            except asyncio.IncompleteReadError:
                raise invalid_request("The request body ended before its Content-Length.") from None
        else:  # chunked: count as it arrives, stop at the limit
            parts, size = [], 0
            async for part in request.content.iter_any():
                size += len(part)
                if size > max_bytes:
                    raise refuse()
                parts.append(part)
            raw = b"".join(parts)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid_request(f"The request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise invalid_request("The request body must be a JSON object.")
        request[BODY] = body
        request[BODY_BYTES] = len(raw)
        return await handler(request)

    return size_limit
