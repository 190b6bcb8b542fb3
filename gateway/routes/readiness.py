"""GET /readyz: whether this replica should be sent requests. 200 while its store answers and it
is not shutting down; 503 otherwise, saying why. On SIGTERM it turns 503 at once, before the
drain, so a load balancer stops sending. The rate limiter's Redis is checked too, but without it
requests are still served (rate limits fail open), and every replica shares it: it failing would
take them all out at once. So it is named, as degraded, on a 200. GET /healthz stays liveness:
the process serves."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.accounting.ratelimit import RateLimiter
from gateway.storage import Store

# Seconds a check may take: a probe that hangs is a failing probe.
CHECK_TIMEOUT = 2.0


class Readiness:
    def __init__(self, store: Store, limiter: RateLimiter) -> None:
        self._store, self._limiter = store, limiter
        self._draining = False

    def drain(self) -> None:
        """The gateway is shutting down: not ready from now on."""
        self._draining = True

    async def on_shutdown(self, app: web.Application) -> None:
        """aiohttp on_shutdown: however the app is run and stopped, it is not ready once stopping."""
        self.drain()

    async def readyz(self, request: web.Request) -> web.Response:
        if self._draining:
            return web.json_response({"status": "shutting down"}, status=503)
        store, ratelimit = await asyncio.gather(self._answers(self._store.ping), self._answers(self._limiter.ping))
        if not store:
            return web.json_response({"status": "not ready", "failing": ["store"]}, status=503)
        if not ratelimit:
            return web.json_response({"status": "ready", "degraded": ["ratelimit"]})
        return web.json_response({"status": "ready"})

    @staticmethod
    async def _answers(check) -> bool:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                await check()
        except Exception:
            return False
        return True
