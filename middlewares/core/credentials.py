"""Where a request carries its credential: shared by the auth stage and the admin API."""

from __future__ import annotations

from aiohttp import web


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key") or None
