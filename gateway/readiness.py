"""GET /readyz: whether this replica should be sent requests. 200 while its store answers, its
rate limiter's Redis answers (when it has one) and it is not shutting down; 503 otherwise, saying
which. On SIGTERM it turns 503 at once, before the drain, so a load balancer stops sending.
GET /healthz stays liveness: the process serves."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.ratelimit import RateLimiter
from gateway.storage import Store

# Seconds a check may take: a probe that hangs is a failing probe.
CHECK_TIMEOUT = 2.0


class Readiness:
    def __init__(self, store: Store, limiter: RateLimiter) -> None:
        self._checks = {"store": store.ping, "ratelimit": limiter.ping}
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
        failing = [name for name, ok in zip(self._checks, await asyncio.gather(
            *(self._answers(check) for check in self._checks.values()))) if not ok]
        if failing:
            return web.json_response({"status": "not ready", "failing": failing}, status=503)
        return web.json_response({"status": "ready"})

    @staticmethod
    async def _answers(check) -> bool:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                await check()
        except Exception:
            return False
        return True
