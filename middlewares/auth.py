"""The auth stage: the caller's key from `Authorization: Bearer` or `x-api-key`, looked up by
its SHA-256 digest (keys are only ever stored hashed), with lookups cached for a few seconds."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Keys, Stage
from middlewares.core.context import API_KEY
from middlewares.core.credentials import presented_key
from middlewares.core.errors import GatewayError
from middlewares.core.protocols import FindKey
from middlewares.core.records import KeyRecord

__all__ = ["AuthStage", "auth_middleware"]


@dataclass(frozen=True)
class AuthStage(Stage):
    """The auth stage, and `forget(digest)`, which drops one key's cached record at once."""

    forget: Callable[[str], None]


def auth_middleware(*, find_key: FindKey, cache_seconds: float = 5.0, cache_size: int = 10_000) -> AuthStage:
    """A request without a key, with an unknown, revoked or expired one, or one whose record
    carries a `refusal`, gets 401 `invalid_api_key`; otherwise its `KeyRecord` is `request[API_KEY]`. `find_key(digest)` finds
    a key by the SHA-256 hex digest of its secret (so the secret is never stored), or None.

    `cache_seconds` bounds how long a revoked or changed key keeps its old record here (0: no
    cache); the stage's `forget(digest)` drops one key's at once. Requests that miss the cache together share one `find_key` call for their key: a
    replica that starts under load asks its store once, not once per request waiting. Matching
    by digest compares digests, never the secret, so timing says nothing of a key."""
    if not callable(find_key):
        raise TypeError("auth_middleware: find_key must be an async callable")
    if not cache_seconds >= 0 or not isinstance(cache_size, int) or cache_size < 1:
        raise ValueError("auth_middleware: cache_seconds must be 0 or more, cache_size a positive integer")
    cache: OrderedDict[str, tuple[KeyRecord | None, float]] = OrderedDict()
    finding: dict[str, asyncio.Task[KeyRecord | None]] = {}  # the lookups under way, by digest
    forgotten: dict[str, float] = {}  # digest → when forget() dropped it (a few, for cache_seconds)

    async def lookup(digest: str) -> KeyRecord | None:
        hit = cache.get(digest)
        if hit is not None and time.monotonic() - hit[1] < cache_seconds:
            return hit[0]
        task = finding.get(digest)
        if task is None:
            # In a context of its own: the lookup is every waiter's, not the first request's (its id, its span).
            task = finding[digest] = asyncio.get_running_loop().create_task(find(digest), context=contextvars.Context())
        # Shielded: a waiter that goes (its client hung up) does not end the lookup for the others.
        return await asyncio.shield(task)

    async def find(digest: str) -> KeyRecord | None:
        now = time.monotonic()
        try:
            key = await find_key(digest)
        finally:
            del finding[digest]
        if forgotten.get(digest, -math.inf) >= now:
            return key  # began before forget(): this record may be the old one, not to be kept
        cache[digest] = (key, now)
        cache.move_to_end(digest)
        if len(cache) > cache_size:  # unknown keys are cached too: bound what a flood of them costs
            cache.popitem(last=False)
        return key

    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        secret = presented_key(request)
        if secret is None:
            raise _unauthorized("Missing API key: send it as `Authorization: Bearer <key>`.")
        # aiohttp hands a header's bytes that are not UTF-8 over as surrogates: hashed as they came.
        key = await lookup(hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest())
        if key is None:
            raise _unauthorized("Incorrect API key provided.")
        if key.revoked:
            raise _unauthorized("This API key has been revoked.")
        if key.expired():
            raise _unauthorized("This API key has expired.")
        if key.refusal:
            raise _unauthorized(key.refusal)
        request[API_KEY] = key
        return await handler(request)

    def forget(digest: str) -> None:
        """Drops what this process keeps of the key with that digest: its next request looks it
        up again (the admin API calls it on revoking or rotating a key)."""
        now = time.monotonic()
        for old in [d for d, at in forgotten.items() if now - at > cache_seconds]:
            del forgotten[old]
        forgotten[digest] = now
        cache.pop(digest, None)

    return AuthStage(Keys("auth", provides=frozenset({API_KEY})), auth, forget)


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key", refusal="auth")
