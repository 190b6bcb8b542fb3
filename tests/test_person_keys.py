"""Keys that belong to a person, through the real stores on SQLite and PostgreSQL: a person's key
reads back with the person as they are when it is read (their email, groups and whether they are
disabled), a person's keys are listed newest first, an admin's key belongs to nobody, a key for a
person who does not exist is refused, and a database with keys from before is migrated."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway.storage import AuditNote, KeyRecord, open_store
from tests.support import SetClock
from tests.test_storage import digest, migrations, older_database, query


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def clock() -> SetClock:
    return SetClock("2026-12-01T09:00:00+00:00")


@pytest.fixture
async def stores(storage_url, clock):
    """Opens stores on one database (replicas, or the console's and the gateway's), each with
    `clock`, and closes them at the end of the test."""
    opened = []

    async def open_():
        store = open_store(storage_url, now=clock)
        await store.open()
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()


def person_fields(key: KeyRecord) -> tuple:
    return key.person_id, key.person_email, key.person_groups, key.person_disabled


async def test_a_persons_key_reads_back_with_the_person_as_of_the_read(stores, clock):
    store, other = await stores(), await stores()  # `other` reads as another replica would
    alice = await store.person_signed_in("idp|alice", "alice@example.com", "Alice", ["eng", "ml"])

    made = await store.create_key(digest("sk-alice"), name="laptop", person_id=alice.id)
    assert person_fields(made) == (alice.id, "alice@example.com", ("eng", "ml"), False)
    assert made.refusal is None  # the gateway's to set, never the store's
    assert await other.find_key(digest("sk-alice")) == made
    assert await other.list_keys() == [made]
    assert await other.keys_by_id([made.id]) == [made]

    # Disabled: every read of her key from now on says so, the key itself unchanged.
    await store.set_person_disabled(alice.id, True, audit=AuditNote("root", "person.disable"))
    found = await other.find_key(digest("sk-alice"))
    assert person_fields(found) == (alice.id, "alice@example.com", ("eng", "ml"), True)
    assert (found.revoked, found.name) == (False, "laptop")
    await store.set_person_disabled(alice.id, False)

    # A sign-in with another address and other groups: her key reads back with them.
    clock.set("2026-12-02T10:00:00+00:00")
    await store.person_signed_in("idp|alice", "alice@corp.example", "Alice", ["research"])
    for read in (
        await other.find_key(digest("sk-alice")),
        *(await other.list_keys()),
        *(await other.keys_by_id([made.id])),
        *(await other.list_person_keys(alice.id)),
    ):
        assert person_fields(read) == (alice.id, "alice@corp.example", ("research",), False)

    # Changing or rotating the key leaves it hers.
    renamed = await store.update_key(made.id, name="desktop")
    assert person_fields(renamed) == (alice.id, "alice@corp.example", ("research",), False)
    rotated = await store.rotate_key(made.id, digest("sk-alice-2"))
    assert person_fields(rotated) == (alice.id, "alice@corp.example", ("research",), False)
    assert await other.find_key(digest("sk-alice")) is None


async def test_an_admins_key_belongs_to_nobody(stores):
    store = await stores()
    await store.person_signed_in("idp|bob", "bob@example.com", "Bob", ["eng"])
    made = await store.create_key(digest("sk-ci"), name="ci")
    assert person_fields(made) == (None, "", (), False)
    assert await store.find_key(digest("sk-ci")) == made
    assert made.refusal is None


async def test_a_persons_keys_are_listed_newest_first_revoked_and_expired_ones_too(stores):
    store = await stores()
    alice = await store.person_signed_in("idp|alice", "alice@example.com", "Alice", ["eng"])
    bob = await store.person_signed_in("idp|bob", "bob@example.com", "Bob", ["eng"])
    past = datetime.now(UTC) - timedelta(days=1)

    old = await store.create_key(digest("sk-alice-old"), name="old", person_id=alice.id, expires_at=past)
    await store.create_key(digest("sk-bob"), name="bob's", person_id=bob.id)
    revoked = await store.create_key(digest("sk-alice-revoked"), name="revoked", person_id=alice.id)
    await store.create_key(digest("sk-admin"), name="admin's")
    new = await store.create_key(digest("sk-alice-new"), name="new", person_id=alice.id)
    await store.update_key(revoked.id, revoked=True)

    listed = await store.list_person_keys(alice.id)
    assert [key.name for key in listed] == ["new", "revoked", "old"]
    assert [key.id for key in listed] == [new.id, revoked.id, old.id]
    assert (listed[1].revoked, listed[2].expired()) == (True, True)
    assert {key.person_id for key in listed} == {alice.id}
    assert [key.name for key in await store.list_person_keys(bob.id)] == ["bob's"]
    assert await store.list_person_keys(alice.id + bob.id + 1000) == []  # no such person: no keys


async def test_a_key_for_a_person_who_does_not_exist_is_refused(stores):
    store = await stores()
    with pytest.raises((sqlite3.IntegrityError, asyncpg.ForeignKeyViolationError)):
        await store.create_key(digest("sk-nobody"), name="nobody's", person_id=999_999)
    assert await store.find_key(digest("sk-nobody")) is None
    assert await store.list_keys() == []


async def test_a_database_with_keys_from_before_is_migrated_its_keys_belonging_to_nobody(storage_url, stores):
    scripts = migrations(storage_url)
    before = next(i for i, script in enumerate(scripts) if "ADD COLUMN person_id" in script)
    await older_database(storage_url, before)  # one key, "older"

    store = await stores()
    assert await query(storage_url, "SELECT max(version) FROM schema_version") == [(len(scripts),)]
    older = await store.find_key(digest("sk-older"))
    assert (older.name, *person_fields(older)) == ("older", None, "", (), False)

    carol = await store.person_signed_in("idp|carol", "carol@example.com", "Carol", ["eng"])
    mine = await store.create_key(digest("sk-carol"), name="carol's", person_id=carol.id)
    assert await store.list_person_keys(carol.id) == [mine]
    assert [key.name for key in await store.list_keys()] == ["older", "carol's"]
    if storage_url.startswith("sqlite:///"):
        indexes = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'keys'"
    else:
        indexes = "SELECT indexname FROM pg_indexes WHERE tablename = 'keys' AND schemaname = current_schema()"
    assert ("keys_by_person",) in await query(storage_url, indexes)
