"""Per-key rate limits (requests and tokens per minute) as token buckets, and the requests a key
may run at once: in memory for one process, or in Redis so every replica draws on the same.

A request takes one request token and reserves its token estimate (its input, estimated, and
its output limit), both checked and taken at once; afterwards the difference between what it
used and what it reserved is charged or given back (`charge_tokens`), so concurrent requests
cannot all pass on one balance. A request whose estimate exceeds the whole per-minute limit
waits for a full bucket, and so can run once a minute at most.

With several workers and no Redis, each worker's buckets would let through N times a key's
limits: `serve` refuses to start with rate-limited keys in its config then, and each worker
refuses any other key with limits (`MemoryRateLimiter(workers=N)`).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from middlewares.core import protocols
from middlewares.core.errors import GatewayError
from middlewares.core.protocols import Wait
from middlewares.core.records import KeyRecord

log = logging.getLogger("ezat.ratelimit")
# The wait a key at its most requests at once is told: the time a short request takes.
CONCURRENCY_RETRY = 1.0
# Seconds a running request's place outlives a process that died holding it.
RUNNING_TTL = 3600


class RateLimiter(protocols.RateLimiter, Protocol):
    async def ping(self) -> None:
        """Raise unless the limiter's shared state answers now (in memory, it always does)."""

    async def close(self) -> None: ...


def _buckets(key: KeyRecord, tokens: int | None) -> list[tuple[str, int, int, int]]:
    """(bucket name, per-minute limit, tokens taken now, balance needed) for each limit the key
    has (rpm alone when `tokens` is None). The balance needed is at most the limit, so a request
    larger than it can still run."""
    buckets = []
    if key.rpm:
        buckets.append((_bucket(key, "rpm"), key.rpm, 1, 1))
    if key.tpm and tokens is not None:
        buckets.append((_bucket(key, "tpm"), key.tpm, tokens, min(max(tokens, 1), key.tpm)))
    return buckets


def _bucket(key: KeyRecord, limit: str) -> str:
    return f"ezat:rl:{key.id}:{limit}"


def _limit_of(bucket: str) -> str:
    return bucket.rpartition(":")[2]


class MemoryRateLimiter:
    """This process's buckets. `workers`: how many processes serve the port, each with buckets
    of its own; past one, a rate-limited key is refused rather than given N times its limits."""

    def __init__(self, *, workers: int = 1) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # name → (balance, at)
        self._running: dict[int, set[str]] = {}  # key id → the request ids it runs
        self._workers = workers

    def _balance(self, name: str, per_minute: int, now: float) -> float:
        balance, at = self._buckets.get(name, (per_minute, now))
        return min(per_minute, balance + (now - at) * per_minute / 60)

    async def admit(self, key: KeyRecord, tokens: int | None = 0) -> float:
        buckets = _buckets(key, tokens)
        if self._workers > 1 and (buckets or key.max_concurrent):
            raise unshared_limits()
        now = time.monotonic()
        wait = 0.0
        balances = [self._balance(name, limit, now) for name, limit, _, _ in buckets]
        for (name, limit, _, need), balance in zip(buckets, balances):
            seconds = (need - balance) * 60 / limit
            if seconds > wait:  # (and so the bucket holds less than it needs)
                wait = Wait(seconds, _limit_of(name))
        if wait:
            return wait
        for (name, _, take, _), balance in zip(buckets, balances):
            self._buckets[name] = (balance - take, now)
        return 0.0

    async def charge_tokens(self, key: KeyRecord, tokens: int) -> None:
        if key.tpm:
            name, now = _bucket(key, "tpm"), time.monotonic()
            self._buckets[name] = (self._balance(name, key.tpm, now) - tokens, now)

    async def enter(self, key: KeyRecord, request_id: str) -> float:
        assert key.max_concurrent is not None  # limits enters only a key with one
        running = self._running.setdefault(key.id, set())
        if len(running) >= key.max_concurrent:
            return CONCURRENCY_RETRY
        running.add(request_id)
        return 0.0

    async def leave(self, key: KeyRecord, request_id: str) -> None:
        running = self._running.get(key.id)
        if running is not None:
            running.discard(request_id)
            if not running:
                del self._running[key.id]

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass


# KEYS: bucket names. ARGV: per bucket, its per-minute limit, the tokens to take and the balance
# needed. Checks every bucket and takes from them only if all hold what is needed, atomically.
# Returns the milliseconds to wait (0 when admitted) and which bucket asks for the longest wait
# (its place in KEYS). Redis's clock serves every replica.
_ADMIT = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) + tonumber(now_us) / 1e6
local balances, wait, which = {}, 0, 0
for i, name in ipairs(KEYS) do
  local limit, need = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i])
  local state = redis.call('HMGET', name, 'balance', 'at')
  local balance = tonumber(state[1]) or limit
  local at = tonumber(state[2]) or now
  balance = math.min(limit, balance + (now - at) * limit / 60)
  balances[i] = balance
  if balance < need and (need - balance) * 60 / limit > wait then
    wait, which = (need - balance) * 60 / limit, i
  end
end
if wait > 0 then return {math.ceil(wait * 1000), which} end
for i, name in ipairs(KEYS) do
  redis.call('HSET', name, 'balance', balances[i] - tonumber(ARGV[3 * i - 1]), 'at', now)
  redis.call('EXPIRE', name, 120)  -- idle that long, a bucket is full again anyway
end
return {0, 0}
"""


# Takes tokens from the key's token bucket (a negative count gives them back).
_CHARGE = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) + tonumber(now_us) / 1e6
local limit = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[1], 'balance', 'at')
local balance = tonumber(state[1]) or limit
local at = tonumber(state[2]) or now
balance = math.min(limit, balance + (now - at) * limit / 60)
balance = balance - tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'balance', balance, 'at', now)
-- kept until refilled: a debt must not vanish with the key
redis.call('EXPIRE', KEYS[1], 120 + math.ceil(math.max(0, -balance) * 60 / limit))
return 0
"""


# KEYS: the key's set of running requests. ARGV: the most at once, the request id, and how long
# a request's place is kept if its process dies without leaving. Returns 1 when it entered.
_ENTER = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) + tonumber(now_us) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])))
return 1
"""


class RedisRateLimiter:
    """Buckets shared through Redis. If Redis is unreachable, requests go through (fail open)
    and the failure is logged, at most every 30 s: a rate limit must not take the gateway down."""

    def __init__(self, url: str, *, timeout: float = 1.0) -> None:
        import redis.asyncio as redis

        self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._enter = self._redis.register_script(_ENTER)
        self._warned_at = -60.0

    async def admit(self, key: KeyRecord, tokens: int | None = 0) -> float:
        buckets = _buckets(key, tokens)
        if not buckets:
            return 0.0
        args = [value for _, limit, take, need in buckets for value in (limit, take, need)]
        try:
            milliseconds, which = await self._admit(keys=[name for name, _, _, _ in buckets], args=args)
        except Exception as exc:
            self._fail_open(exc)
            return 0.0
        return Wait(milliseconds / 1000, _limit_of(buckets[which - 1][0])) if milliseconds else 0.0

    async def charge_tokens(self, key: KeyRecord, tokens: int) -> None:
        if not key.tpm:
            return
        try:
            await self._charge(keys=[_bucket(key, "tpm")], args=[key.tpm, tokens])
        except Exception as exc:
            self._fail_open(exc)

    async def enter(self, key: KeyRecord, request_id: str) -> float:
        assert key.max_concurrent is not None  # limits enters only a key with one
        try:
            entered = await self._enter(
                keys=[_bucket(key, "running")], args=[key.max_concurrent, request_id, RUNNING_TTL]
            )
        except Exception as exc:
            self._fail_open(exc)
            return 0.0
        return 0.0 if entered else CONCURRENCY_RETRY

    async def leave(self, key: KeyRecord, request_id: str) -> None:
        try:
            await self._redis.zrem(_bucket(key, "running"), request_id)
        except Exception as exc:
            self._fail_open(exc)

    def _fail_open(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 30:
            self._warned_at = now
            log.warning("rate limits not enforced: Redis unavailable (%r)", exc)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def rate_limiter(url: str, *, workers: int = 1) -> RateLimiter:
    return RedisRateLimiter(url) if url else MemoryRateLimiter(workers=workers)


def unshared_limits() -> GatewayError:
    return GatewayError(
        500,
        "This key has rate limits, which several workers can only share through [ratelimit] url (Redis).",
        type="server_error",
    )
