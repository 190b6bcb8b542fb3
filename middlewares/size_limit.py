"""The size_limit stage: refuses bodies over the limit before reading them, then reads and
parses the JSON body once for every later stage."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from gateway.context import BODY, BODY_BYTES
from gateway.errors import GatewayError, invalid_request

MAX_BODY_BYTES = 32 * 1024 * 1024  # spec: "The whole request body can be up to 32 MB."


def size_limit_middleware(max_bytes: int = MAX_BODY_BYTES):
    too_large = f"The request body is over {max_bytes // (1024 * 1024)} MB."

    def refuse() -> GatewayError:
        return GatewayError(413, too_large, code="request_too_large")

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
