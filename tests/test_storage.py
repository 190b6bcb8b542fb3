"""The Store contract (gateway.storage), the same on SQLite and PostgreSQL, through the store's
own interface; and the group-commit ledger (gateway.accounting.ledger) on top of a real store."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import asyncpg
import pytest

from gateway.accounting.ledger import Ledger, LedgerError
from gateway.config import KeyConfig, parse_config
from gateway.storage import LedgerRow, SessionRecord, open_store, schema
from gateway.storage.group_commit import ALONE_AFTER
from gateway.storage.records import ADMIN_TOKEN_SESSION
from gateway.storage.sqlite import CHECKPOINT_EVERY
from gateway.storage.unavailable import QUIET_FOR, WATCH_EVERY, StoreOutage, StoreUnavailable

UTC = UTC
NO_KEY = 999_999  # a key id no store has: a row naming it breaks the foreign key


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path) -> str:
    """A storage URL for each backend: a SQLite file in tmp_path, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def opened():
    """Opens stores and closes them at the end of the test."""
    stores = []

    async def open_(url: str, store=None):
        store = store or open_store(url)
        await store.open()
        stores.append(store)
        return store

    yield open_
    for store in stores:
        await store.close()


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def migrations(url: str) -> list:
    return schema.SQLITE if url.startswith("sqlite") else schema.POSTGRES


async def query(url: str, sql: str) -> list[tuple]:
    """Reads the database behind `url` directly, not through the store."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
            return db.execute(sql).fetchall()
    db = await asyncpg.connect(url)
    try:
        return [tuple(row) for row in await db.fetch(sql)]
    finally:
        await db.close()


async def every_table_text(url: str) -> str:
    """Every value of every table in the store's database, as text."""
    if url.startswith("sqlite:///"):
        tables = [name for (name,) in await query(url, "SELECT name FROM sqlite_master WHERE type = 'table'")]
    else:
        tables = [
            name
            for (name,) in await query(
                url, "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
            )
        ]
    assert {"keys", "ledger", "schema_version"} <= set(tables)
    return "\n".join([repr(await query(url, f"SELECT * FROM {table}")) for table in tables])


async def in_database_files(url: str, needle: str) -> bool:
    """Whether `needle` is anywhere in the SQLite file or its WAL. Read by another process: closing
    a descriptor of the file here would drop the SQLite locks this process's store holds."""
    path = url.removeprefix("sqlite:///")
    script = "import glob, sys; sys.exit(any(sys.argv[2].encode() in open(p, 'rb').read() for p in glob.glob(sys.argv[1] + '*')))"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, path, needle)
    return await asyncio.wait_for(process.wait(), 10) == 1


def row(request_id: str, key_id: int, cost: str, finished: datetime | None = None, **fields) -> LedgerRow:
    finished = finished or datetime.now(UTC)
    values = dict(
        request_id=request_id,
        key_id=key_id,
        model="anthropic/claude-sonnet-5-5",
        answered_model="anthropic/claude-sonnet-5-5",
        deployment="primary",
        input_tokens=100,
        cache_write_tokens=20,
        cache_read_tokens=30,
        output_tokens=40,
        reasoning_tokens=5,
        cost_usd=Decimal(cost),
        outcome="complete",
        started_at=finished - timedelta(milliseconds=250),
        finished_at=finished,
    )
    return LedgerRow(**{**values, **fields})


# --- schema and migrations


async def test_open_creates_the_schema_and_records_its_version(store_url, opened):
    await opened(store_url)
    assert await query(store_url, "SELECT version FROM schema_version") == [
        (n,) for n in range(1, len(migrations(store_url)) + 1)
    ]
    await every_table_text(store_url)  # keys, ledger and schema_version exist and are readable
    assert await query(store_url, "SELECT count(*) FROM keys") == [(0,)]


async def test_reopening_applies_no_migration_twice_and_keeps_the_data(store_url, opened):
    first = await opened(store_url)
    key = await first.create_key(digest("sk-kept"), name="kept")
    await first.write_ledger([row("req-kept", key.id, "0.25")])
    await first.close()

    second = await opened(store_url)
    third = await opened(store_url)  # and again, beside the second: nothing is applied twice
    assert await query(store_url, "SELECT version FROM schema_version") == [
        (n,) for n in range(1, len(migrations(store_url)) + 1)
    ]
    assert await second.find_key(digest("sk-kept")) == replace(key, spent_usd=Decimal("0.25"))
    assert [r.request_id for r in await third.ledger()] == ["req-kept"]
    assert await third.spent(key.id) == Decimal("0.25")


async def test_replicas_opening_a_fresh_postgres_schema_at_once_migrate_it_once(postgres_url, opened):
    stores = [open_store(postgres_url) for _ in range(4)]
    await asyncio.gather(*(opened(postgres_url, store) for store in stores))
    assert await query(postgres_url, "SELECT version FROM schema_version") == [
        (n,) for n in range(1, len(schema.POSTGRES) + 1)
    ]
    key = await stores[0].create_key(digest("sk-race"), name="race")
    assert await stores[3].find_key(digest("sk-race")) == key


async def open_or_close(store) -> None:
    """Opens the store; one that fails to open is closed at once, as its process would exit."""
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise


async def test_processes_opening_a_fresh_sqlite_file_at_once_migrate_it_once(tmp_path):
    # e.g. two gateway workers, or the gateway and `ezat-gateway keys create`, started together
    for attempt in range(10):  # a race: several fresh files, so losing it is not left to luck
        url = f"sqlite:///{tmp_path / f'fresh-{attempt}.db'}"
        stores = [open_store(url) for _ in range(4)]
        results = await asyncio.gather(*(open_or_close(store) for store in stores), return_exceptions=True)
        for store in stores:  # every open has finished: each connection is closed
            await store.close()
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert await query(url, "SELECT version FROM schema_version") == [
            (n,) for n in range(1, len(schema.SQLITE) + 1)
        ]


async def older_database(store_url: str, migrations_applied: int) -> int:
    """The database as a gateway that knew only the first `migrations_applied` migrations left it,
    with one key, "older" (sk-older): that key's id."""
    scripts = migrations(store_url)[:migrations_applied]
    if store_url.startswith("sqlite:///"):
        with sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None) as db:
            db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            for number, script in enumerate(scripts, start=1):
                for statement in filter(str.strip, script.split(";")):
                    db.execute(statement)
                db.execute("INSERT INTO schema_version VALUES (?)", (number,))
            db.execute("INSERT INTO keys (key_sha256, name, created_at) VALUES (?, 'older', '')", (digest("sk-older"),))
            (key_id,) = db.execute("SELECT id FROM keys WHERE name = 'older'").fetchone()
        db.close()
        return key_id
    db = await asyncpg.connect(store_url)
    try:
        async with db.transaction():
            await db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            for number, script in enumerate(scripts, start=1):
                await db.execute(script)
                await db.execute("INSERT INTO schema_version VALUES ($1)", number)
            return await db.fetchval(
                "INSERT INTO keys (key_sha256, name) VALUES ($1, 'older') RETURNING id", digest("sk-older")
            )
    finally:
        await db.close()


async def test_a_ledger_from_before_sessions_is_migrated_its_rows_kept_without_one(store_url, opened):
    """A database whose ledger has no session column (every migration before it applied, one row
    written): opening it adds the column; the old row reads back with no session, and new rows
    keep theirs."""
    scripts = migrations(store_url)
    before = next(i for i, script in enumerate(scripts) if "ADD COLUMN session" in script)
    old = (
        "old-row",
        "anthropic/claude-sonnet-5-5",
        "anthropic/claude-sonnet-5-5",
        "primary",
        1,
        2,
        3,
        4,
        0,
        "0.5",
        "complete",
    )
    key_id = await older_database(store_url, before)
    if store_url.startswith("sqlite:///"):
        with sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None) as db:
            db.execute(
                "INSERT INTO ledger (request_id, key_id, model, answered_model, deployment, input_tokens,"
                " cache_write_tokens, cache_read_tokens, output_tokens, reasoning_tokens, cost_usd, outcome,"
                " started_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                " '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:01.000000Z')",
                (old[0], key_id, *old[1:]),
            )
        db.close()
    else:
        db = await asyncpg.connect(store_url)
        try:
            await db.execute(
                "INSERT INTO ledger (request_id, key_id, model, answered_model, deployment, input_tokens,"
                " cache_write_tokens, cache_read_tokens, output_tokens, reasoning_tokens, cost_usd, outcome,"
                " started_at, finished_at) VALUES ($1, $12, $2, $3, $4, $5, $6, $7, $8, $9, $10::numeric, $11,"
                " '2026-01-01T00:00:00Z', '2026-01-01T00:00:01Z')",
                *old,
                key_id,
            )
        finally:
            await db.close()

    store = await opened(store_url)
    assert await query(store_url, "SELECT max(version) FROM schema_version") == [(len(scripts),)]
    key = await store.find_key(digest("sk-older"))
    new = row("new-row", key.id, "0.25", session="claude-code-session")
    await store.write_ledger([new])
    [kept, written] = await store.ledger()
    assert (kept.request_id, kept.cost_usd, kept.session) == ("old-row", Decimal("0.5"), None)
    assert written == new


async def test_a_rows_session_is_kept_as_written(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-sessions"), name="sessions")
    rows = [
        row("named", key.id, "0.1", session="a" * 64),
        row("unnamed", key.id, "0.2"),
        row("digest", key.id, "0.3", session=LedgerRow.session_name("a" * 65)),
    ]
    await store.write_ledger(rows)
    assert await store.ledger() == rows
    assert [r.session for r in rows] == ["a" * 64, None, "sha256:" + hashlib.sha256(b"a" * 65).hexdigest()[:32]]


# --- keys


async def test_sync_config_keys_creates_then_updates_and_keeps_spend(store_url, opened):
    store = await opened(store_url)
    config = KeyConfig(
        name="ci",
        key_sha256=digest("sk-ci"),
        models=("anthropic/*",),
        spend_limit_usd=Decimal("5"),
        rpm=10,
        tpm=1000,
        expires_at=datetime(2030, 1, 1, tzinfo=UTC),
    )
    other = KeyConfig(name="other", key_sha256=digest("sk-other"), rpm=2**63 - 1, tpm=3_000_000_000)  # beyond 32 bits
    await store.sync_config_keys([config, other])

    created = await store.find_key(digest("sk-ci"))
    assert created is not None
    assert (created.name, created.key_sha256, created.models) == ("ci", digest("sk-ci"), ("anthropic/*",))
    assert (created.spend_limit_usd, created.rpm, created.tpm) == (Decimal("5"), 10, 1000)
    assert created.expires_at == datetime(2030, 1, 1, tzinfo=UTC)
    assert created.revoked is False
    assert created.spent_usd == Decimal(0)
    other_key = await store.find_key(digest("sk-other"))
    assert (other_key.models, other_key.spend_limit_usd, other_key.rpm, other_key.tpm, other_key.expires_at) == (
        ("*",),
        None,
        2**63 - 1,
        3_000_000_000,
        None,
    )

    await store.write_ledger([row("req-1", created.id, "1.234567")])
    changed = replace(
        config,
        name="ci-renamed",
        models=("anthropic/*", "test/*"),
        spend_limit_usd=Decimal("7.25"),
        rpm=None,
        tpm=2000,
        expires_at=None,
        revoked=True,
    )
    await store.sync_config_keys([changed, other])  # and again: the same file read by a restart

    updated = await store.find_key(digest("sk-ci"))
    assert updated == replace(
        created,
        name="ci-renamed",
        models=("anthropic/*", "test/*"),
        spend_limit_usd=Decimal("7.25"),
        rpm=None,
        tpm=2000,
        expires_at=None,
        revoked=True,
        spent_usd=Decimal("1.234567"),
    )
    assert [k.key_sha256 for k in await store.list_keys()] == [digest("sk-ci"), digest("sk-other")]
    assert await store.spent(created.id) == Decimal("1.234567")


async def test_a_key_the_config_file_no_longer_declares_is_revoked(store_url, opened):
    """The file is its keys' source of truth: one taken out of it stops working at the next
    start; put back, it works again. Keys made with the CLI are not the file's to revoke."""
    store = await opened(store_url)
    kept, dropped = (
        KeyConfig(name="kept", key_sha256=digest("sk-kept")),
        KeyConfig(name="dropped", key_sha256=digest("sk-dropped")),
    )
    await store.sync_config_keys([kept, dropped])
    made = await store.create_key(digest("sk-made"), name="made")
    assert (await store.find_key(digest("sk-kept"))).from_config and not made.from_config

    await store.sync_config_keys([kept])
    assert {k.name: k.revoked for k in await store.list_keys()} == {"kept": False, "dropped": True, "made": False}
    await store.sync_config_keys([])
    assert {k.name: k.revoked for k in await store.list_keys()} == {"kept": True, "dropped": True, "made": False}
    await store.sync_config_keys([kept, dropped])
    assert {k.name: k.revoked for k in await store.list_keys()} == {"kept": False, "dropped": False, "made": False}


async def test_the_plaintext_key_is_stored_nowhere(store_url, opened):
    secret = "sk-plaintext-Zq7vX2"
    config = parse_config(f'[[keys]]\nkey = "{secret}"\nname = "laptop"\n')
    store = await opened(store_url)
    await store.sync_config_keys(config.keys)
    created = await store.create_key(digest(secret + "-2"), name="cli")
    await store.write_ledger([row("req-secret", created.id, "0.5")])

    assert (await store.find_key(digest(secret))).name == "laptop"
    text = await every_table_text(store_url)
    assert digest(secret) in text  # what is kept is the digest
    assert secret not in text
    if store_url.startswith("sqlite:///"):  # nor anywhere in the files, the WAL included
        assert await in_database_files(store_url, digest(secret))
        assert not await in_database_files(store_url, secret)


async def test_find_key_by_digest(store_url, opened):
    store = await opened(store_url)
    created = await store.create_key(digest("sk-find"), name="find", rpm=3)
    assert await store.find_key(digest("sk-find")) == created
    assert await store.find_key(digest("sk-unknown")) is None
    assert await store.find_key("sk-find") is None  # the secret itself matches nothing


async def test_create_list_and_update_keys(store_url, opened):
    store = await opened(store_url)
    alpha = await store.create_key(
        digest("sk-alpha"),
        name="alpha",
        models=("anthropic/*",),
        spend_limit_usd=Decimal("2.50"),
        rpm=60,
        tpm=10000,
        expires_at=datetime(2031, 6, 1, 12, 30, tzinfo=UTC),
    )
    assert alpha.id > 0
    assert (alpha.name, alpha.models, alpha.spend_limit_usd, alpha.rpm, alpha.tpm) == (
        "alpha",
        ("anthropic/*",),
        Decimal("2.50"),
        60,
        10000,
    )
    assert alpha.expires_at == datetime(2031, 6, 1, 12, 30, tzinfo=UTC)
    assert (alpha.revoked, alpha.spent_usd) == (False, Decimal(0))
    beta = await store.create_key(digest("sk-beta"), name="beta")
    assert beta.id != alpha.id
    assert await store.list_keys() == [alpha, beta]

    changed = await store.update_key(alpha.id, rpm=None, spend_limit_usd=Decimal("9"))
    assert changed == replace(alpha, rpm=None, spend_limit_usd=Decimal("9"))
    renamed = await store.update_key(beta.id, revoked=True, models=("test/*",), name="beta2")
    assert renamed == replace(beta, revoked=True, models=("test/*",), name="beta2")
    assert await store.update_key(alpha.id) == changed  # no fields: unchanged
    assert await store.list_keys() == [changed, renamed]
    assert await store.find_key(digest("sk-alpha")) == changed
    assert await store.update_key(beta.id + 100, rpm=1) is None


# --- spend and ledger


async def test_write_ledger_adds_exact_spend_and_ledger_filters(store_url, opened):
    store = await opened(store_url)
    alpha = await store.create_key(digest("sk-alpha"), name="alpha")
    beta = await store.create_key(digest("sk-beta"), name="beta")

    def day(d):
        return datetime(2026, 1, d, tzinfo=UTC)

    rows = [
        row("r1", alpha.id, "0.000123", day(1)),
        row("r2", alpha.id, "0.1", day(2), outcome="client_closed", deployment="secondary"),
        row("r3", beta.id, "0.2", day(2) + timedelta(microseconds=1)),
        row("r4", alpha.id, "0.000000001", day(3), answered_model="test/small", input_tokens=7),
    ]
    await store.write_ledger(rows[:2])
    await store.write_ledger(rows[2:])

    # exact decimals: 0.1 + 0.000123 + 0.000000001 would not survive floats
    assert await store.spent(alpha.id) == Decimal("0.100123001")
    assert await store.spent(beta.id) == Decimal("0.2")
    assert {k.name: k.spent_usd for k in await store.list_keys()} == {
        "alpha": Decimal("0.100123001"),
        "beta": Decimal("0.2"),
    }
    assert (await store.find_key(digest("sk-alpha"))).spent_usd == Decimal("0.100123001")
    reader = await opened(store_url)  # not this process's cache: what is in the database
    assert await reader.spent(alpha.id) == Decimal("0.100123001")

    assert await store.ledger() == rows  # every field read back as written
    assert await store.ledger(key_id=alpha.id) == [rows[0], rows[1], rows[3]]
    assert await store.ledger(key_id=beta.id) == [rows[2]]
    assert await store.ledger(key_id=beta.id + 100) == []
    assert await store.ledger(since=day(2)) == rows[1:]  # since is inclusive
    assert await store.ledger(since=day(2) + timedelta(microseconds=1)) == rows[2:]
    plus_two = timezone(timedelta(hours=2))
    assert await store.ledger(since=datetime(2026, 1, 2, 2, 0, tzinfo=plus_two)) == rows[1:]  # any offset
    assert await store.ledger(key_id=alpha.id, since=day(2)) == [rows[1], rows[3]]
    assert await store.ledger(since=day(4)) == []


async def test_a_failed_batch_writes_nothing_and_adds_no_spend(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-atomic"), name="atomic")
    other = await store.create_key(digest("sk-other"), name="other")
    first = row("req-1", key.id, "1.5")
    await store.write_ledger([first])

    # the batch's other rows come first, so only atomicity can keep them out
    failing = [row("req-2", key.id, "2"), row("req-3", other.id, "3"), row("req-6", NO_KEY, "4")]
    with pytest.raises(Exception):  # noqa: B017 - the store's own error: sqlite3's or asyncpg's
        await store.write_ledger(failing)

    assert await store.ledger() == [first]
    assert await store.spent(key.id) == Decimal("1.5")
    assert await store.spent(other.id) == Decimal(0)
    fresh = await opened(store_url)
    assert await fresh.ledger() == [first]
    assert {k.name: k.spent_usd for k in await fresh.list_keys()} == {"atomic": Decimal("1.5"), "other": Decimal(0)}

    await store.write_ledger([row("req-5", key.id, "0.5")])  # the store still works afterwards
    assert await fresh.spent(key.id) == Decimal("2.0")


async def test_rows_written_again_are_skipped_and_not_charged_twice(store_url, opened):
    """The ledger writes a batch again when it failed, and with a server a commit can succeed
    while its answer is lost: what was written then is not written, nor charged, twice."""
    store = await opened(store_url)
    key = await store.create_key(digest("sk-again"), name="again")
    other = await store.create_key(digest("sk-other"), name="other")
    first = [row("req-1", key.id, "1.5"), row("req-2", other.id, "0.25")]
    await store.write_ledger(first)
    again = [row("req-0", key.id, "0.125"), *first, row("req-3", other.id, "2")]
    await store.write_ledger(again)
    await store.write_ledger(first)  # nothing new at all

    assert sorted(r.request_id for r in await store.ledger()) == ["req-0", "req-1", "req-2", "req-3"]
    assert await store.spent(key.id) == Decimal("1.625")
    assert await store.spent(other.id) == Decimal("2.25")
    fresh = await opened(store_url)
    assert {k.name: k.spent_usd for k in await fresh.list_keys()} == {
        "again": Decimal("1.625"),
        "other": Decimal("2.25"),
    }


async def test_two_sqlite_stores_on_one_file_see_each_others_spend(tmp_path, opened):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a, b = await opened(url), await opened(url)
    key = await a.create_key(digest("sk-shared"), name="shared")
    assert await b.spent(key.id) == Decimal(0)  # b now holds the spend it read

    await a.write_ledger([row("a-1", key.id, "1.25")])
    assert await a.spent(key.id) == Decimal("1.25")
    assert await b.spent(key.id) == Decimal("1.25")  # at once: read from the file each time

    # both write at once, each as its one ledger writer would: every row is added, none lost to a
    # read-modify-write race between the two
    async def writes(store, prefix, numbers, cost):
        for i in numbers:
            await store.write_ledger([row(f"{prefix}-{i}", key.id, cost)])

    await asyncio.gather(writes(a, "a", range(2, 22), "0.01"), writes(b, "b", range(20), "0.001"))
    expected = Decimal("1.25") + 20 * Decimal("0.01") + 20 * Decimal("0.001")
    assert await a.spent(key.id) == expected
    assert await b.spent(key.id) == expected
    assert len(await a.ledger()) == 41


async def test_two_postgres_stores_see_each_others_spend_at_once(postgres_url, opened):
    a, b = await opened(postgres_url), await opened(postgres_url)
    key = await a.create_key(digest("sk-shared"), name="shared")
    assert await b.spent(key.id) == Decimal(0)
    await a.write_ledger([row("a-1", key.id, "1.25")])
    assert await b.spent(key.id) == Decimal("1.25")  # immediately: replicas share one limit

    await asyncio.gather(
        *(a.write_ledger([row(f"a-{i}", key.id, "0.01")]) for i in range(2, 22)),
        *(b.write_ledger([row(f"b-{i}", key.id, "0.001")]) for i in range(20)),
    )
    expected = Decimal("1.25") + 20 * Decimal("0.01") + 20 * Decimal("0.001")
    assert await a.spent(key.id) == expected
    assert await b.spent(key.id) == expected
    assert len(await b.ledger()) == 41


# --- the group-commit ledger


def counting_store(url: str):
    """The real store for `url`, which also notes the size of each batch it is asked to write."""
    base = type(open_store(url))

    class CountingStore(base):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.batches: list[int] = []
            self.written_now = 0  # batches committed by write_ledger_now
            self.commit_seconds = 0.0  # how long write_ledger_now takes (a slow disk)
            self.gate: asyncio.Event | None = None  # when set up, writes wait for it (a slow disk)
            self.writing = asyncio.Event()

        async def write_ledger(self, rows) -> None:
            self.batches.append(len(rows))
            self.writing.set()
            if self.gate is not None:
                await self.gate.wait()
            await super().write_ledger(rows)

        def write_ledger_now(self, rows) -> bool:
            if self.gate is not None:  # a slow disk: nothing is written at once
                return False
            time.sleep(self.commit_seconds)
            written = super().write_ledger_now(rows)
            if written:
                self.batches.append(len(rows))
                self.written_now += 1
            return written

    return CountingStore(url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url)


async def test_ledger_groups_500_concurrent_records_into_few_transactions(store_url, opened):
    store = await opened(store_url, counting_store(store_url))
    keys = [await store.create_key(digest(f"sk-{i}"), name=f"k{i}") for i in range(3)]
    ledger = Ledger(store)
    rows = [row(f"req-{i:03d}", keys[i % 3].id, f"0.00{i % 10}1") for i in range(500)]

    await asyncio.wait_for(asyncio.gather(*(ledger.record(r) for r in rows)), 20)
    await ledger.close()

    assert sum(store.batches) == 500
    assert len(store.batches) <= 10, store.batches  # far fewer transactions than rows
    assert sorted(await store.ledger(), key=lambda r: r.request_id) == rows
    for i, key in enumerate(keys):
        assert await store.spent(key.id) == sum((r.cost_usd for r in rows[i::3]), Decimal(0))


async def test_a_row_recorded_alone_is_committed_by_its_own_request(tmp_path, opened):
    # On SQLite a lone row needs no writer task: it is in the file before record() returns,
    # and each such row is its own transaction; rows recorded together still share one.
    store = await opened(f"sqlite:///{tmp_path / 'alone.db'}", counting_store(f"sqlite:///{tmp_path / 'alone.db'}"))
    key = await store.create_key(digest("sk-alone"), name="alone")
    ledger = Ledger(store)
    tasks = asyncio.all_tasks()
    for i in range(3):
        await asyncio.sleep(2 * ALONE_AFTER)
        await ledger.record(row(f"req-alone-{i}", key.id, "0.25"))
        assert asyncio.all_tasks() == tasks
        assert len(await query(f"sqlite:///{tmp_path / 'alone.db'}", "SELECT 1 FROM ledger")) == i + 1
    store.commit_seconds = 2 * ALONE_AFTER  # a commit slower than the gap that makes a row alone
    await asyncio.sleep(2 * ALONE_AFTER)
    await asyncio.gather(*(ledger.record(row(f"req-burst-{i}", key.id, "0.01")) for i in range(50)))

    assert store.batches == [1, 1, 1, 1, 49]  # the burst's first row finds the ledger idle
    assert store.written_now == 4  # the lone rows and that first one, by their own requests
    assert await store.spent(key.id) == Decimal("1.25")


async def ledger_in_a_slow_write(store_url, opened, name: str, request_id: str, cost: str):
    """A ledger on a counting store whose writes wait for `store.gate`, and the task of a first
    record() whose batch is being written (held at the gate)."""
    store = await opened(store_url, counting_store(store_url))
    key = await store.create_key(digest(f"sk-{name}"), name=name)
    ledger = Ledger(store)
    store.gate = asyncio.Event()
    recorder = asyncio.create_task(ledger.record(row(request_id, key.id, cost)))
    await asyncio.wait_for(store.writing.wait(), 5)
    return store, key, ledger, recorder


async def test_ledger_records_arriving_during_a_write_go_in_the_next_batch(store_url, opened):
    # the first record's batch is being written...
    store, key, ledger, first = await ledger_in_a_slow_write(store_url, opened, "batch", "req-first", "1")
    later = [asyncio.create_task(ledger.record(row(f"req-{i:03d}", key.id, "0.001"))) for i in range(499)]
    await asyncio.sleep(0)
    assert not first.done() and not any(t.done() for t in later)  # ...and record() waits for the commit
    store.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *later), 20)

    assert store.batches == [1, 499]
    assert len(await store.ledger()) == 500
    assert await store.spent(key.id) == Decimal("1.499")


async def test_one_bad_row_does_not_take_its_batch_down(store_url, opened):
    store = await opened(store_url, counting_store(store_url))
    key = await store.create_key(digest("sk-poison"), name="poison")
    await store.write_ledger([row("req-taken", key.id, "1")])
    ledger = Ledger(store, attempts=1)
    store.gate = asyncio.Event()
    blocker = asyncio.create_task(ledger.record(row("req-first", key.id, "0.1")))
    await asyncio.wait_for(store.writing.wait(), 5)
    # these three go in one batch; one of them names a key that does not exist
    good = [asyncio.create_task(ledger.record(row(f"req-good-{i}", key.id, "0.01"))) for i in range(2)]
    bad = asyncio.create_task(ledger.record(row("req-bad", NO_KEY, "5")))
    await asyncio.sleep(0)
    store.gate.set()
    await asyncio.wait_for(asyncio.gather(blocker, *good), 10)
    with pytest.raises(LedgerError):
        await bad

    # after the setup's row and the blocker: the batch of three failed whole, then went row by row
    assert store.batches[2:] == [3, 1, 1, 1]
    assert sorted(r.request_id for r in await store.ledger()) == ["req-first", "req-good-0", "req-good-1", "req-taken"]
    assert await store.spent(key.id) == Decimal("1.12")


async def test_a_recorder_cancelled_while_its_batch_is_written_does_not_unwrite_its_row(store_url, opened):
    store, key, ledger, recorder = await ledger_in_a_slow_write(store_url, opened, "cancel", "req-left", "0.5")
    recorder.cancel()  # the client went away while its row was being committed
    with pytest.raises(asyncio.CancelledError):
        await recorder
    store.gate.set()
    await asyncio.wait_for(ledger.close(), 5)

    assert [r.request_id for r in await store.ledger()] == ["req-left"]
    assert await store.spent(key.id) == Decimal("0.5")


async def test_sqlite_checkpoints_off_the_writes_path_and_keeps_the_wal_bounded(tmp_path, opened):
    # No write waits for a checkpoint: every CHECKPOINT_EVERY writes a thread of the store's
    # copies the WAL into the file and starts it again from its beginning, while lone ledger
    # writes go on being committed at once on the event loop. Only a write that meets the
    # checkpoint's last pass (a few pages, with writes held off) waits its turn on the writer
    # thread. Without the checkpoints, all 6,000 writes stay in the WAL.
    url = f"sqlite:///{tmp_path / 'steady.db'}"
    store = await opened(url)
    key = await store.create_key(digest("sk-steady"), name="steady")
    writes = 6 * CHECKPOINT_EVERY
    during_checkpoints = waited = 0
    for i in range(writes):
        checkpointing = store._checkpoint is not None
        written = row(f"req-{i:05d}", key.id, "0.001")
        if store.write_ledger_now([written]):
            during_checkpoints += checkpointing
        else:
            waited += 1
            await store.write_ledger([written])
        # Between two requests' writes: the checkpoint's task gets its turn, and its thread
        # finds the file free for a moment (SQLite's busy wait would miss a file never free).
        await asyncio.sleep(0)
        time.sleep(0.00005)

    # Most writes that meet a checkpoint are committed at once; only those of its last pass wait.
    assert during_checkpoints > 10 * waited, (during_checkpoints, waited)

    page = (await query(url, "PRAGMA page_size"))[0][0]
    wal = (tmp_path / "steady.db-wal").stat().st_size
    # A write adds about 5 pages; without restarts the WAL would hold all 6,000 writes' of them.
    # A checkpoint that finds a reader at the WAL's end leaves it to the next (a warning says
    # so), so the WAL may reach three checkpoints' worth before one restarts it: half of all.
    assert wal < 3 * CHECKPOINT_EVERY * 6 * (page + 24), (wal, writes)
    assert len(await store.ledger()) == writes
    assert await store.spent(key.id) == Decimal("0.001") * writes


async def test_hold_now_holds_as_hold_does_where_it_need_not_wait(store_url, opened):
    from gateway.storage import Hold, Shortfall

    store = await opened(store_url)
    key = await store.create_key(digest("sk-now"), name="now", spend_limit_usd=Decimal("0.5"))

    def hold(rid: str, amount: str) -> Hold:
        return Hold(rid, key.id, Decimal(amount), key.spend_limit_usd, 60.0)

    await store.hold([hold("first", "0.1")], [])
    if store_url.startswith("sqlite"):  # its own file, unlocked: held on the event loop, "first" released with it
        assert store.hold_now([hold("a", "0.3"), hold("b", "0.25")], ["first"]) == [
            None,
            Shortfall("key", Decimal("0.2")),
        ]
        assert await store.reserved() == {key.id: Decimal("0.3")}
    else:  # every write is a round trip to the server: nothing held or released here
        assert store.hold_now([hold("a", "0.3")], ["first"]) is None
        assert await store.reserved() == {key.id: Decimal("0.1")}


async def test_a_hold_takes_from_its_key_and_its_organization_or_from_neither(store_url, opened):
    from gateway.storage import Hold, Shortfall

    store = await opened(store_url)
    acme = await store.create_organization("acme", balance_usd=Decimal("1"))
    limited = await store.create_key(
        digest("sk-limited"), name="limited", spend_limit_usd=Decimal("0.5"), organization_id=acme.id
    )
    free = await store.create_key(digest("sk-free"), name="free", organization_id=acme.id)
    assert (limited.organization, limited.organization_balance_usd, free.organization_id) == (
        "acme",
        Decimal("1"),
        acme.id,
    )

    def hold(rid: str, key, amount: str) -> Hold:
        return Hold(rid, key.id, Decimal(amount), key.spend_limit_usd, 60.0, acme.id, acme.balance_usd)

    results = await store.hold(
        [
            hold("a", limited, "0.4"),
            hold("b", limited, "0.2"),
            hold("c", free, "0.5"),
            hold("d", free, "0.2"),
            hold("e", free, "0.1"),
        ],
        [],
    )
    # b: its key's limit has 0.1 left; d: the organization's balance has 0.1 left (b took none of it).
    assert results == [None, Shortfall("key", Decimal("0.1")), None, Shortfall("organization", Decimal("0.1")), None]
    assert (await store.reserved())[limited.id] == Decimal("0.4")
    assert (await store.organizations_reserved())[acme.id] == Decimal("1.0")
    await store.hold([], ["a"])  # released: the organization's part comes back with the key's
    assert (await store.organizations_reserved())[acme.id] == Decimal("0.6")
    assert await store.hold([hold("f", free, "0.4")], []) == [None]


async def test_a_hold_counts_every_reservation_under_way_of_its_key_and_none_that_expired(
    store_url, opened, monkeypatch
):
    from gateway.storage import Hold, Shortfall

    # SQLite drops what expired in a sweep, once a minute: here, at every hold.
    monkeypatch.setattr("gateway.storage.sqlite.SWEEP_EVERY", 0.0)
    store = await opened(store_url)
    key = await store.create_key(digest("sk-busy"), name="busy", spend_limit_usd=Decimal("1"))
    other = await store.create_key(digest("sk-other"), name="other", spend_limit_usd=Decimal("1"))

    def hold(rid: str, amount: str, ttl: float = 60.0, of=key) -> Hold:
        return Hold(rid, of.id, Decimal(amount), of.spend_limit_usd, ttl)

    # 400 requests under way, held in groups as concurrent admissions are: 0.4 in all; another
    # key's take nothing from this one's.
    for group in range(8):
        assert await store.hold([hold(f"r{group}-{i}", "0.001") for i in range(50)], []) == [None] * 50
    assert await store.hold([hold("others", "0.9", of=other)], []) == [None]
    assert await store.hold([hold("gone", "0.3", ttl=0.3)], []) == [None]  # as a process that died leaves it
    # 0.3 left: a billionth of a dollar more does not fit, 0.3 does.
    assert await store.hold([hold("over", "0.300000001"), hold("exact", "0.3")], []) == [
        Shortfall("key", Decimal("0.3")),
        None,
    ]
    await asyncio.sleep(0.5)
    # What expired is no longer held: its 0.3 fits again, and no more.
    assert await store.hold([hold("again", "0.3"), hold("more", "0.000000001")], []) == [
        None,
        Shortfall("key", Decimal("0")),
    ]
    assert await store.reserved() == {key.id: Decimal("1.0"), other.id: Decimal("0.9")}


async def test_reservations_under_way_while_a_sqlite_file_is_migrated_still_hold(tmp_path, opened):
    """A file from before keys kept what their requests under way hold (in billionths of a
    dollar): what its requests under way hold counts once the file is migrated."""
    from gateway.storage import Hold, Shortfall

    url = f"sqlite:///{tmp_path / 'older.db'}"
    before = next(i for i, script in enumerate(schema.SQLITE) if "reserved_nano_usd" in script)
    with sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for number, script in enumerate(schema.SQLITE[:before], start=1):
            for statement in filter(str.strip, script.split(";")):
                db.execute(statement)
            db.execute("INSERT INTO schema_version VALUES (?)", (number,))
        db.execute(
            "INSERT INTO keys (key_sha256, name, spend_limit_usd, created_at) VALUES (?, 'older', '1', '')",
            (digest("sk-older"),),
        )
        db.execute(
            "INSERT INTO reservations (request_id, key_id, amount_usd, expires_at) VALUES"
            " ('under-way', 1, '0.123456789', '2999-01-01T00:00:00.000000Z')"
        )
    db.close()
    store = await opened(url)
    key = await store.find_key(digest("sk-older"))

    def hold(rid: str, amount: str) -> Hold:
        return Hold(rid, key.id, Decimal(amount), key.spend_limit_usd, 60.0)

    # 0.123456789 held, converted a billionth up (never down): 0.87654321 left.
    assert await store.hold([hold("more", "0.876543211"), hold("rest", "0.87654321")], []) == [
        Shortfall("key", Decimal("0.87654321")),
        None,
    ]


async def test_more_rows_keys_and_organizations_than_older_sqlite_takes_variables_are_written(tmp_path, opened):
    """SQLite before 3.32 takes at most 999 variables a statement. A ledger batch may hold 2,000
    rows of as many keys (the ledger's largest), and a config file may declare more than 999
    keys or organizations: no statement may need a variable for each."""
    from gateway.config import OrganizationConfig

    store = await opened(f"sqlite:///{tmp_path / 'older-sqlite.db'}")
    for connection in (store._inline, store._writer._db, store._reader._db):
        connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    await store.sync_config_organizations([OrganizationConfig(name=f"o{i}") for i in range(1001)])
    await store.sync_config_organizations([OrganizationConfig(name=f"o{i}") for i in range(1000)])
    assert [o.from_config for o in await store.list_organizations() if o.name in ("o999", "o1000")] == [True, False]
    declared = [KeyConfig(name=f"k{i}", key_sha256=digest(f"sk-{i}"), organization="o7") for i in range(1001)]
    await store.sync_config_keys(declared)
    await store.sync_config_keys(declared[:-1])
    keys = await store.list_keys()
    assert [key.revoked for key in keys[-2:]] == [False, True]
    await store.write_ledger([row(f"req-{i}", keys[i % 1000].id, "0.001") for i in range(2000)])
    assert len(await store.ledger()) == 2000
    assert {await store.spent(key.id) for key in keys[:1000]} == {Decimal("0.002")}
    assert (await store.find_organization("o7")).spent_usd == Decimal("2.000")


async def test_a_burst_of_spend_reservations_is_held_in_groups_of_at_most_max_group(store_url, opened):
    from gateway.accounting.spending import SpendReservations
    from gateway.storage import Shortfall
    from gateway.storage.group_commit import MAX_GROUP

    base = type(open_store(store_url))

    class HoldCountingStore(base):
        groups: list[int] = []

        async def hold(self, holds, releases):
            self.groups.append(len(holds))
            return await super().hold(holds, releases)

        def hold_now(self, holds, releases):
            result = super().hold_now(holds, releases)
            if result is not None:
                self.groups.append(len(holds))
            return result

    store = await opened(
        store_url,
        HoldCountingStore(store_url.removeprefix("sqlite:///") if store_url.startswith("sqlite:///") else store_url),
    )
    key = await store.create_key(digest("sk-burst"), name="burst", spend_limit_usd=Decimal("4.4"))
    spending = SpendReservations(store)
    burst = 2 * MAX_GROUP + 500
    results = await asyncio.wait_for(
        asyncio.gather(
            *(spending.reserve(f"r{i}", key.id, Decimal("0.001"), key.spend_limit_usd, 60.0) for i in range(burst))
        ),
        60,
    )
    await spending.close()

    assert sum(store.groups) == burst and max(store.groups) <= MAX_GROUP, store.groups
    assert len(store.groups) < 10  # still few transactions
    # Across the groups, exactly what fits the limit is held.
    assert results.count(None) == 4400
    assert all(r == Shortfall("key", Decimal("0")) for r in results if r is not None)
    assert await store.reserved() == {key.id: Decimal("4.4")}


async def test_sqlite_totals_of_what_is_held_are_checked_against_the_reservations_once_a_minute(
    tmp_path, opened, caplog
):
    """A reservation that a process keeping no totals wrote (one of an older version, still
    running on the file) counts from the next sweep on; until then the totals stand."""
    from gateway.storage import Hold, Shortfall

    path = tmp_path / "totals.db"
    store = await opened(f"sqlite:///{path}")
    key = await store.create_key(digest("sk-totals"), name="totals", spend_limit_usd=Decimal("1"))

    def hold(rid: str, amount: str) -> Hold:
        return Hold(rid, key.id, Decimal(amount), key.spend_limit_usd, 60.0)

    assert await store.hold([hold("first", "0.25")], []) == [None]  # the first hold sweeps
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute(
            "INSERT INTO reservations (request_id, key_id, amount_usd, amount_nano_usd, expires_at)"
            " VALUES ('unkept', ?, '0.5', 500000000, '2999-01-01T00:00:00.000000Z')",
            (key.id,),
        )
    db.close()
    assert await store.hold([hold("fits-without-it", "0.5")], []) == [None]
    await store.hold([], ["fits-without-it"])
    restarted = await opened(f"sqlite:///{path}")  # a process's first hold sweeps, as one a minute later does
    with caplog.at_level("WARNING", logger="ezat.storage"):
        assert await restarted.hold([hold("no-longer", "0.5")], []) == [Shortfall("key", Decimal("0.25"))]
    assert "did not add up" in caplog.text
    await store.hold([], ["unkept"])
    assert await store.hold([hold("fits-again", "0.75")], []) == [None]


async def test_a_key_or_organization_given_a_limit_counts_what_its_requests_under_way_hold(store_url, opened):
    from gateway.storage import Hold, Shortfall

    store = await opened(store_url)
    acme = await store.create_organization("acme", balance_usd=Decimal("10"))
    key = await store.create_key(digest("sk-unlimited"), name="unlimited", organization_id=acme.id)
    other = await store.create_key(digest("sk-other-org"), name="other-org", spend_limit_usd=Decimal("10"))

    def hold(rid: str, of, amount: str) -> Hold:
        return Hold(
            rid, of.id, Decimal(amount), of.spend_limit_usd, 60.0, of.organization_id, of.organization_balance_usd
        )

    # Held while the key has no limit (against its organization's balance), and while the other
    # key's organization has no balance (against its key's limit).
    assert await store.hold([hold("a", key, "0.4"), hold("b", other, "0.3")], []) == [None, None]
    key = await store.update_key(key.id, spend_limit_usd=Decimal("1"))
    assert await store.hold([hold("over", key, "0.600000001"), hold("fits", key, "0.6")], []) == [
        Shortfall("key", Decimal("0.6")),
        None,
    ]
    await store.update_organization("default", balance_usd=Decimal("1"))
    other = await store.find_key(digest("sk-other-org"))
    assert await store.hold([hold("over-too", other, "0.700000001"), hold("fits-too", other, "0.7")], []) == [
        Shortfall("organization", Decimal("0.7")),
        None,
    ]


async def test_sessions_are_found_until_they_expire_or_are_deleted_or_their_token_revoked(store_url, opened):
    store = await opened(store_url)
    now = datetime.now(UTC)
    token = await store.create_admin_token("ops", "admin", digest("ezat-admin-ops"))

    def session(name: str, subject: str, ends: datetime) -> SessionRecord:
        return SessionRecord(digest(name), ADMIN_TOKEN_SESSION, subject, "csrf-" + name, now, ends)

    expired = session("expired", digest("ezat-admin-ops"), now - timedelta(seconds=1))
    kept = session("kept", digest("ezat-admin-ops"), now + timedelta(hours=8))
    other = session("other", digest("ezat-admin-other"), now + timedelta(hours=8))
    signed_out = session("signed-out", digest("ezat-admin-other"), now + timedelta(hours=8))
    await store.create_session(expired)
    assert await store.find_session(expired.id_sha256) is None
    for made in (kept, other, signed_out):
        await store.create_session(made)  # the expired one is deleted then
    assert await store.find_session(kept.id_sha256) == kept
    await store.delete_session(signed_out.id_sha256)
    assert await store.find_session(signed_out.id_sha256) is None
    await store.revoke_admin_token(token.id)
    assert await store.find_session(kept.id_sha256) is None  # revoking its token ended it
    assert await store.find_session(other.id_sha256) == other  # another token's stays
    assert await query(store_url, "SELECT id_sha256 FROM sessions") == [(other.id_sha256,)]


async def test_an_outage_ends_only_once_requests_stop_being_refused(caplog):
    """A database that answers the ping while its writes still fail (a disk full, a lock held)
    is still out: the outage is told once as it begins and once as it ends, not at every ping."""
    counted = []
    outage = StoreOutage(answering, counted=lambda: counted.append(1))
    refusing_until = time.monotonic() + QUIET_FOR + 1
    while time.monotonic() < refusing_until:  # writes fail, though the ping answers
        outage.refused(StoreUnavailable())
        await asyncio.sleep(WATCH_EVERY / 2)
    began = [r for r in caplog.records if "database is unavailable" in r.getMessage()]
    assert len(began) == 1 and not [r for r in caplog.records if "answers again after" in r.getMessage()]
    async with asyncio.timeout(QUIET_FOR + 3 * WATCH_EVERY):
        while not [r for r in caplog.records if "answers again after" in r.getMessage()]:
            await asyncio.sleep(WATCH_EVERY / 2)
    (ended,) = [r.getMessage() for r in caplog.records if "answers again after" in r.getMessage()]
    assert f"{len(counted)} requests were refused meanwhile" in ended


async def answering() -> None:
    """A ping the database answers."""
