"""The auth stage: the caller's key from `Authorization: Bearer` or `x-api-key`, looked up by
its SHA-256 digest (keys are only ever stored hashed)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from aiohttp import web

from gateway.config import KeyConfig
from gateway.context import API_KEY
from gateway.errors import GatewayError

# Finds the key whose sha256 hex digest is given, or None.
KeyLookup = Callable[[str], Awaitable[KeyConfig | None]]


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key") or None


def auth_middleware(find_key: KeyLookup):
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        secret = presented_key(request)
        if secret is None:
            raise _unauthorized("Missing API key: send it as `Authorization: Bearer <key>`.")
        key = await find_key(hashlib.sha256(secret.encode()).hexdigest())
        if key is None:
            raise _unauthorized("Incorrect API key provided.")
        if key.revoked:
            raise _unauthorized("This API key has been revoked.")
        if key.expires_at is not None and key.expires_at <= datetime.now(timezone.utc):
            raise _unauthorized("This API key has expired.")
        request[API_KEY] = key
        return await handler(request)

    return auth


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def static_keys(keys: list[KeyConfig] | tuple[KeyConfig, ...]) -> KeyLookup:
    """A lookup over keys from the config file. Matching by digest compares digests, never
    the secret itself, so timing says nothing about the key."""
    by_digest = {key.key_sha256: key for key in keys}

    async def find(digest: str) -> KeyConfig | None:
        return by_digest.get(digest)

    return find
