"""Where a request carries its credential: the auth stage reads an API key from either header
its clients send; the admin API reads its token from `Authorization: Bearer` alone."""

from __future__ import annotations

from aiohttp import web


def bearer_token(request: web.Request) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    authorization = request.headers.get("Authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def presented_key(request: web.Request) -> str | None:
    """An API key: the bearer token, else `x-api-key` (Anthropic's clients send that)."""
    return bearer_token(request) or request.headers.get("x-api-key") or None
