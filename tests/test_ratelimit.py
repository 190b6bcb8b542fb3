"""Per-key rate limits: the in-memory and the Redis token buckets (gateway.accounting.ratelimit), driven
directly with KeyRecord values; Redis through the real server (the redis_url fixture)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from gateway.accounting.ratelimit import MemoryRateLimiter, RedisRateLimiter
from gateway.storage import KeyRecord
from tests.support import free_port


def key(key_id: int = 1, **limits) -> KeyRecord:
    return KeyRecord(id=key_id, name=f"k{key_id}", key_sha256=f"{key_id:064x}", **limits)


@pytest.fixture(params=["memory", "redis"])
def limiter_url(request) -> str:
    """ "" for the in-memory limiter, else a flushed Redis database."""
    return "" if request.param == "memory" else request.getfixturevalue("redis_url")


@pytest.fixture
async def limiter(limiter_url):
    made = RedisRateLimiter(limiter_url) if limiter_url else MemoryRateLimiter()
    yield made
    await made.close()


@pytest.fixture
async def replicas(redis_url):
    """Two Redis limiters, as two gateway replicas would each have."""
    pair = RedisRateLimiter(redis_url), RedisRateLimiter(redis_url)
    yield pair
    for made in pair:
        await made.close()


async def admitted_in_a_burst(limiter, record: KeyRecord, most: int = 10_000) -> tuple[int, float]:
    """How many requests go through before one is refused, and the wait that refusal gives."""
    for count in range(most):
        wait = await limiter.admit(record)
        if wait:
            return count, wait
    raise AssertionError(f"more than {most} requests admitted")


async def test_rpm_admits_exactly_rpm_in_a_burst_then_waits_60_over_rpm(limiter):
    count, wait = await admitted_in_a_burst(limiter, key(rpm=5))
    assert count == 5
    assert 11.8 < wait <= 12.001  # one request's worth of refill: 60/5 s (less the little refilled already)
    again = await limiter.admit(key(rpm=5))
    assert 11.8 < again <= 12.001  # a refused request takes nothing and is refused again


async def test_a_key_without_limits_is_always_admitted(limiter):
    for _ in range(50):
        assert await limiter.admit(key()) == 0
    await limiter.charge_tokens(key(), 10**9)
    assert await limiter.admit(key()) == 0


async def test_rpm_bucket_refills_with_time(limiter):
    rpm = 600  # 10 requests a second
    record = key(rpm=rpm)
    count, wait = await admitted_in_a_burst(limiter, record)
    assert count >= rpm
    assert 0 < wait <= 60 / rpm + 0.001
    emptied = time.monotonic()

    await asyncio.sleep(0.2)
    started = time.monotonic()
    refilled, _ = await admitted_in_a_burst(limiter, record)
    ended = time.monotonic()
    # below one token when emptied, plus 10 a second since: about 2 after 0.2 s
    assert math.floor((started - emptied) * rpm / 60) <= refilled <= math.ceil((ended - emptied) * rpm / 60) + 1
    assert 2 <= refilled <= 4


async def test_tpm_admits_while_positive_and_waits_in_proportion_to_the_debt(limiter):
    tpm = 1000
    record = key(tpm=tpm)
    for _ in range(20):  # admitting takes no tokens: only what requests used does
        assert await limiter.admit(record) == 0
    await limiter.charge_tokens(record, 600)
    assert await limiter.admit(record) == 0  # about 400 left
    await limiter.charge_tokens(record, 900)  # about 500 owed
    first = await limiter.admit(record)
    assert first == pytest.approx((1 + 500) * 60 / tpm, abs=0.5)  # ≈ 30 s to earn back 501 tokens
    await limiter.charge_tokens(record, 1000)  # about 1500 owed: three times the wait
    second = await limiter.admit(record)
    assert second == pytest.approx((1 + 1500) * 60 / tpm, abs=0.5)
    assert second > 2.9 * first


async def test_charge_without_tpm_changes_nothing(limiter):
    record = key(rpm=3)
    await limiter.charge_tokens(record, 10**6)
    count, _ = await admitted_in_a_burst(limiter, record)
    assert count == 3


async def test_keys_are_independent(limiter):
    a, b = key(1, rpm=2, tpm=1000), key(2, rpm=2, tpm=1000)
    assert (await admitted_in_a_burst(limiter, a))[0] == 2
    await limiter.charge_tokens(a, 5000)
    assert (await admitted_in_a_burst(limiter, b))[0] == 2
    c = key(3, tpm=1000)
    assert await limiter.admit(c) == 0  # a's token debt is a's alone
    assert await limiter.admit(a) > 200


async def test_a_request_refused_for_tokens_takes_no_request(limiter):
    limited = key(7, rpm=2, tpm=1000)
    await limiter.charge_tokens(limited, 3000)
    for _ in range(5):
        assert await limiter.admit(limited) > 100  # the token debt decides the wait
    # the same key once its tpm is removed (`keys update --tpm 0`): its 2 requests are all still there
    assert (await admitted_in_a_burst(limiter, key(7, rpm=2)))[0] == 2


async def test_two_redis_replicas_share_one_bucket(replicas):
    one, two = replicas
    record = key(rpm=4, tpm=1000)
    assert await one.admit(record) == 0
    assert await two.admit(record) == 0
    assert await one.admit(record) == 0
    assert await two.admit(record) == 0
    assert 14.5 < await one.admit(record) <= 15.001  # the 5th, whichever replica gets it
    assert 14.5 < await two.admit(record) <= 15.001

    shared = key(2, tpm=1000)
    assert await two.admit(shared) == 0
    await one.charge_tokens(shared, 2000)  # tokens used through one replica...
    assert await two.admit(shared) == pytest.approx((1 + 1000) * 60 / 1000, abs=0.5)  # ...hold back the other


async def test_concurrent_requests_through_two_replicas_get_exactly_the_limit(replicas):
    record = key(rpm=30)
    waits = await asyncio.gather(*(replicas[i % 2].admit(record) for i in range(100)))
    assert sum(1 for wait in waits if wait == 0) == 30  # the Lua bucket is atomic


async def test_redis_unreachable_fails_open_and_warns_once(caplog):
    limiter = RedisRateLimiter(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    record = key(rpm=1, tpm=10)
    caplog.set_level(logging.WARNING, logger="ezat.ratelimit")
    try:
        started = time.monotonic()
        for _ in range(5):
            assert await limiter.admit(record) == 0  # rpm=1 would refuse the 2nd: no limit is enforced
            await limiter.charge_tokens(record, 1000)  # and charging does not raise
        assert time.monotonic() - started < 5  # each try gives up fast
    finally:
        await limiter.close()
    warnings = [r for r in caplog.records if r.name == "ezat.ratelimit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Redis" in warnings[0].getMessage()
