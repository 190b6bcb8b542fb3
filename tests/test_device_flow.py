"""`ezat-gateway login`'s server side (RFC 8628's device authorization grant, and RFC 6749's refresh
grant): the store's part, on SQLite and PostgreSQL: grants polled, approved once, cleaned up;
renewal tokens rotated and revoked."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from gateway.storage import AuditNote, DeviceGrant, RenewalRecord, open_store
from gateway.storage.records import (
    DEVICE_APPROVED,
    DEVICE_DENIED,
    DEVICE_EXPIRED,
    DEVICE_PENDING,
    DEVICE_TOO_SOON,
    DEVICE_USED,
    SLOW_DOWN_SECONDS,
)
from tests.test_storage import digest, query


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


# --- The store's part, on SQLite and PostgreSQL ----------------------------------------------------


@pytest.fixture
async def store(storage_url):
    opened = open_store(storage_url)
    await opened.open()
    yield opened
    await opened.close()


def grant(code: str, user_code: str, *, lives: float = 600, interval: int = 5, made: datetime | None = None):
    made = made or datetime.now(UTC)
    return DeviceGrant(
        digest(code), user_code, "ezat-gateway-cli", made, made + timedelta(seconds=lives), interval, DEVICE_PENDING
    )


async def test_the_store_polls_a_grant_as_records_polled_says(store):
    alice = await store.person_signed_in("idp|alice", "alice@example.com", "Alice", ["eng"])
    made = grant("device-1", "BCDFGHJK", interval=1)
    assert await store.create_device_grant(made)
    assert not await store.create_device_grant(grant("device-2", "BCDFGHJK"))  # its user code is taken
    assert await store.find_device_grant("BCDFGHJK") == made
    assert await store.poll_device_grant(digest("no-such-device")) is None

    after, found = await store.poll_device_grant(digest("device-1"))
    assert found == DEVICE_PENDING and after.last_polled_at is not None
    after, found = await store.poll_device_grant(digest("device-1"))
    assert found == DEVICE_TOO_SOON and after.interval == 1 + SLOW_DOWN_SECONDS
    assert (await store.find_device_grant("BCDFGHJK")).interval == 1 + SLOW_DOWN_SECONDS

    decided = await store.decide_device_grant("BCDFGHJK", alice.id, True)
    assert (decided.status, decided.person_id) == (DEVICE_APPROVED, alice.id)
    assert await store.decide_device_grant("BCDFGHJK", alice.id, False) is None  # decided already
    # Two polls at once: exactly one finds it approved (and uses it).
    results = await asyncio.gather(*(store.poll_device_grant(digest("device-1")) for _ in range(4)))
    assert sorted(found for _, found in results) == [DEVICE_APPROVED] + [DEVICE_USED] * 3
    assert (await store.find_device_grant("BCDFGHJK")).status == DEVICE_USED


async def test_the_store_denies_expires_and_cleans_up_grants(store, storage_url):
    bob = await store.person_signed_in("idp|bob", "bob@example.com", "Bob", ["eng"])
    assert await store.create_device_grant(grant("denied", "CDFGHJKL"))
    assert (await store.decide_device_grant("CDFGHJKL", bob.id, False)).status == DEVICE_DENIED
    assert (await store.poll_device_grant(digest("denied")))[1] == DEVICE_DENIED

    long_ago = datetime.now(UTC) - timedelta(hours=2)
    assert await store.create_device_grant(grant("old", "DFGHJKLM", made=long_ago))
    assert await store.create_device_grant(grant("late", "FGHJKLMN", lives=-1))  # just expired
    assert (await store.poll_device_grant(digest("late")))[1] == DEVICE_EXPIRED
    assert await store.decide_device_grant("FGHJKLMN", bob.id, True) is None
    # A new grant deletes those expired over an hour ago, and takes an expired grant's user code.
    assert await store.create_device_grant(grant("new", "FGHJKLMN"))
    left = {row[0] for row in await query(storage_url, "SELECT device_sha256 FROM device_grants")}
    assert left == {digest("denied"), digest("new")}


async def test_the_store_rotates_renewal_tokens_and_revokes_them_when_the_person_is_disabled(store, storage_url):
    carol = await store.person_signed_in("idp|carol", "carol@example.com", "Carol", ["eng"])
    now = datetime.now(UTC)
    first = RenewalRecord(digest("ezat-renew-1"), carol.id, now, now + timedelta(days=30))
    await store.create_renewal(first)
    assert await store.find_renewal(first.token_sha256) == first
    second = first._replace(token_sha256=digest("ezat-renew-2"))
    assert await store.rotate_renewal(first.token_sha256, second)
    assert await store.find_renewal(first.token_sha256) is None
    assert not await store.rotate_renewal(first.token_sha256, first)  # spent: once only
    # Two renewals at once with one token: one wins.
    thirds = [second._replace(token_sha256=digest(f"ezat-renew-3{n}")) for n in range(3)]
    won = await asyncio.gather(*(store.rotate_renewal(second.token_sha256, third) for third in thirds))
    assert sorted(won) == [False, False, True]

    # An expired token is deleted as another is made.
    stale = RenewalRecord(digest("ezat-renew-stale"), carol.id, now - timedelta(days=31), now - timedelta(days=1))
    await store.create_renewal(stale)
    await store.create_renewal(first._replace(token_sha256=digest("ezat-renew-4")))
    assert await store.find_renewal(stale.token_sha256) is None

    await store.set_person_disabled(carol.id, True, audit=AuditNote("root", "person.disable"))
    live = [r for r in await query(storage_url, "SELECT token_sha256, revoked_at FROM renewal_tokens")]
    assert live and all(revoked is not None for _, revoked in live)
    [winner] = [third for third, ok in zip(thirds, won) if ok]
    assert (await store.find_renewal(winner.token_sha256)).revoked_at is not None
    assert not await store.rotate_renewal(winner.token_sha256, first)  # revoked: no renewal
