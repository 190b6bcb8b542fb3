"""Per-key rate limits (requests and tokens per minute) as token buckets: in memory for one
process, or in Redis so every replica draws on the same buckets.

A request takes one request token and needs a positive token balance; the tokens it used are
taken afterwards, when they are known (a large answer can leave the balance below zero, and
the key waits until it refills).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from middlewares.core import protocols
from middlewares.core.records import KeyRecord

log = logging.getLogger("ezat.ratelimit")


class RateLimiter(protocols.RateLimiter, Protocol):
    async def close(self) -> None: ...


def _buckets(key: KeyRecord) -> list[tuple[str, int, int]]:
    """(bucket name, per-minute limit, tokens taken now) for each limit the key has."""
    buckets = []
    if key.rpm:
        buckets.append((_bucket(key, "rpm"), key.rpm, 1))
    if key.tpm:
        buckets.append((_bucket(key, "tpm"), key.tpm, 0))
    return buckets


def _bucket(key: KeyRecord, limit: str) -> str:
    return f"ezat:rl:{key.id}:{limit}"


class MemoryRateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # name → (balance, at)

    def _balance(self, name: str, per_minute: int, now: float) -> float:
        balance, at = self._buckets.get(name, (per_minute, now))
        return min(per_minute, balance + (now - at) * per_minute / 60)

    async def admit(self, key: KeyRecord) -> float:
        now = time.monotonic()
        wait = 0.0
        buckets = _buckets(key)
        balances = [self._balance(name, limit, now) for name, limit, _ in buckets]
        for (name, limit, _), balance in zip(buckets, balances):
            if balance < 1:
                wait = max(wait, (1 - balance) * 60 / limit)
        if wait:
            return wait
        for (name, _, take), balance in zip(buckets, balances):
            self._buckets[name] = (balance - take, now)
        return 0.0

    async def charge_tokens(self, key: KeyRecord, tokens: int) -> None:
        if key.tpm:
            name, now = _bucket(key, "tpm"), time.monotonic()
            self._buckets[name] = (self._balance(name, key.tpm, now) - tokens, now)

    async def close(self) -> None:
        pass


# KEYS: bucket names. ARGV: per bucket, its per-minute limit and the tokens to take.
# Checks every bucket and takes from them only if all have at least one token, atomically.
# Returns the milliseconds to wait (0 when admitted). Redis's clock serves every replica.
_ADMIT = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) + tonumber(now_us) / 1e6
local balances, wait = {}, 0
for i, name in ipairs(KEYS) do
  local limit = tonumber(ARGV[2 * i - 1])
  local state = redis.call('HMGET', name, 'balance', 'at')
  local balance = tonumber(state[1]) or limit
  local at = tonumber(state[2]) or now
  balance = math.min(limit, balance + (now - at) * limit / 60)
  balances[i] = balance
  if balance < 1 then wait = math.max(wait, (1 - balance) * 60 / limit) end
end
if wait > 0 then return math.ceil(wait * 1000) end
for i, name in ipairs(KEYS) do
  redis.call('HSET', name, 'balance', balances[i] - tonumber(ARGV[2 * i]), 'at', now)
  redis.call('EXPIRE', name, 120)  -- idle that long, a bucket is full again anyway
end
return 0
"""


# Takes the tokens a request used from the key's token bucket.
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


class RedisRateLimiter:
    """Buckets shared through Redis. If Redis is unreachable, requests go through (fail open)
    and the failure is logged, at most every 30 s: a rate limit must not take the gateway down."""

    def __init__(self, url: str, *, timeout: float = 1.0) -> None:
        import redis.asyncio as redis

        self._redis = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._warned_at = -60.0

    async def admit(self, key: KeyRecord) -> float:
        buckets = _buckets(key)
        if not buckets:
            return 0.0
        args = [value for _, limit, take in buckets for value in (limit, take)]
        try:
            return await self._admit(keys=[name for name, _, _ in buckets], args=args) / 1000
        except Exception as exc:
            self._fail_open(exc)
            return 0.0

    async def charge_tokens(self, key: KeyRecord, tokens: int) -> None:
        if not key.tpm:
            return
        try:
            await self._charge(keys=[_bucket(key, "tpm")], args=[key.tpm, tokens])
        except Exception as exc:
            self._fail_open(exc)

    def _fail_open(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 30:
            self._warned_at = now
            log.warning("rate limits not enforced: Redis unavailable (%r)", exc)

    async def close(self) -> None:
        await self._redis.aclose()


def rate_limiter(url: str) -> RateLimiter:
    return RedisRateLimiter(url) if url else MemoryRateLimiter()
