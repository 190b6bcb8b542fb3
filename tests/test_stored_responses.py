"""Stored Responses API responses (Store.put_responses, get_response, delete_response), the same on
SQLite and PostgreSQL, through the store's own interface on a real database."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import asyncpg
import pytest
from yarl import URL

from gateway.accounting.ledger import Ledger
from gateway.routes.stored_responses import KeptResponses
from gateway.storage import StoredResponse, open_store
from gateway.storage.unavailable import StoreUnavailable
from tests.conftest import POSTGRES_URL
from tests.support import Link
from tests.test_storage import migrations, older_database, opened, query, row, store_url  # noqa: F401 (fixtures)


@pytest.fixture
def sweep_every_time(monkeypatch):
    """The sweep that a hold or a response's write starts once a minute, every time, deleting two
    rows per transaction."""
    for module in ("gateway.storage.sqlite", "gateway.storage.postgres"):
        monkeypatch.setattr(f"{module}.SWEEP_EVERY", 0.0)
        monkeypatch.setattr(f"{module}.SWEEP_BATCH", 2)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def stored(response_id: str, key_id: int, *, expires_in: timedelta = timedelta(days=30), **fields) -> StoredResponse:
    created = datetime.now(UTC)
    values = dict(
        response_id=response_id,
        key_id=key_id,
        created_at=created,
        expires_at=created + expires_in,
        response={
            "id": response_id,
            "object": "response",
            "status": "completed",
            "model": "anthropic/claude-sonnet-5-5",
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "ezat1.abc"},
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Bonjour, ça va ? ✓", "annotations": []}],
                },
            ],
            "usage": {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19},
        },
        input_items=[
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "French, then.", "signature": "EqQBCkYIBxgC"},
                    {"type": "text", "text": "Bonjour, ça va ? ✓"},
                ],
            },
        ],
        system="Answer in French.",
    )
    return StoredResponse(**{**values, **fields})


async def count(url: str) -> int:
    [(rows,)] = await query(url, "SELECT count(*) FROM responses")
    return rows


async def test_a_stored_response_reads_back_as_it_was_put(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-responses"), name="responses")
    first = stored("resp_first", key.id)
    blocks = stored("resp_blocks", key.id, system=[{"type": "text", "text": "Be brief."}], input_items=[])
    unprompted = stored("resp_unprompted", key.id, system=None)
    await store.put_responses([first, blocks, unprompted])  # in one transaction
    assert await store.get_response("resp_first", key.id) == first
    assert await store.get_response("resp_blocks", key.id) == blocks
    assert await store.get_response("resp_unprompted", key.id) == unprompted
    assert await store.get_response("resp_never_issued", key.id) is None
    # Another store on the same database (a replica, or the gateway restarted) finds it too.
    assert await (await opened(store_url)).get_response("resp_first", key.id) == first


async def test_only_the_key_that_made_a_response_finds_or_deletes_it(store_url, opened):
    store = await opened(store_url)
    owner = await store.create_key(digest("sk-owner"), name="owner")
    other = await store.create_key(digest("sk-other"), name="other")
    mine = stored("resp_mine", owner.id)
    await store.put_responses([mine])
    assert await store.get_response("resp_mine", other.id) is None
    assert await store.delete_response("resp_mine", other.id) is False
    # Nor does another key's write of the same id replace it.
    await store.put_responses([stored("resp_mine", other.id, response={"id": "resp_mine", "forged": True})])
    assert await store.get_response("resp_mine", owner.id) == mine
    assert await store.get_response("resp_mine", other.id) is None


async def test_a_deleted_response_is_gone(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-delete"), name="delete")
    await store.put_responses([stored("resp_kept", key.id)])
    await store.put_responses([stored("resp_deleted", key.id)])
    assert await store.delete_response("resp_deleted", key.id) is True
    assert await store.get_response("resp_deleted", key.id) is None
    assert await store.delete_response("resp_deleted", key.id) is False  # deleted already
    assert await store.delete_response("resp_never_issued", key.id) is False
    assert (await store.get_response("resp_kept", key.id)).response_id == "resp_kept"


async def test_a_response_written_again_replaces_itself(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-again"), name="again")
    await store.put_responses([stored("resp_again", key.id)])
    again = stored("resp_again", key.id, response={"id": "resp_again", "status": "incomplete"}, system=None)
    await store.put_responses([again])
    assert await store.get_response("resp_again", key.id) == again
    assert await count(store_url) == 1


async def test_an_expired_response_is_not_found_nor_deleted(store_url, opened):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-expired"), name="expired")
    await store.put_responses([stored("resp_expired", key.id, expires_in=timedelta(seconds=-1))])
    await store.put_responses([stored("resp_soon", key.id, expires_in=timedelta(seconds=0.5))])
    assert await store.get_response("resp_expired", key.id) is None
    assert await store.delete_response("resp_expired", key.id) is False
    assert (await store.get_response("resp_soon", key.id)).response_id == "resp_soon"
    await asyncio.sleep(0.6)
    assert await store.get_response("resp_soon", key.id) is None
    # Still in the table (the next sweep is a minute away), but past its expiry: as good as gone.
    assert ("resp_soon",) in await query(store_url, "SELECT response_id FROM responses")
    assert await store.delete_response("resp_soon", key.id) is False


async def left_behind(url: str, key_id: int, count: int) -> None:
    """Expired responses written by a process that is gone (its own sweep never ran), as the
    database holds them."""
    rows = [(f"resp_old_{i}", key_id) for i in range(count)]
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None) as db:
            db.executemany(
                "INSERT INTO responses VALUES (?, ?, '2026-01-01T00:00:00.000000Z', '2026-01-31T00:00:00.000000Z',"
                " '{}', '[]', '{\"system\": null, \"messages\": []}')",
                rows,
            )
        db.close()
        return
    db = await asyncpg.connect(url)
    try:
        await db.executemany(
            "INSERT INTO responses VALUES ($1, $2, '2026-01-01T00:00:00Z', '2026-01-31T00:00:00Z',"
            " '{}', '[]', '{\"system\": null, \"messages\": []}')",
            rows,
        )
    finally:
        await db.close()


async def responses_left(url: str, expected: int) -> list[tuple]:
    """The response ids left once the sweep (a task no request waits for) has had time to run."""
    for _ in range(100):
        if await count(url) == expected:
            break
        await asyncio.sleep(0.05)
    return await query(url, "SELECT response_id FROM responses")


async def test_a_holds_sweep_deletes_expired_responses_and_keeps_the_others(store_url, opened, sweep_every_time):
    store = await opened(store_url)
    key = await store.create_key(digest("sk-sweep"), name="sweep")
    await left_behind(store_url, key.id, 5)  # more than a sweep's transaction takes: it takes several
    assert await count(store_url) == 5
    await store.hold([], [])  # a hold starts the sweep (once a minute; here, every time) and does not wait for it
    assert await responses_left(store_url, 0) == []


async def test_a_writes_sweep_deletes_expired_responses_where_no_request_holds(store_url, opened, sweep_every_time):
    """A key without a spend limit makes no holds: the writes of responses sweep too."""
    store = await opened(store_url)
    key = await store.create_key(digest("sk-no-limit"), name="no-limit")
    await left_behind(store_url, key.id, 5)
    live = stored("resp_live", key.id)
    await store.put_responses([live])
    assert await responses_left(store_url, 1) == [("resp_live",)]
    assert await store.get_response("resp_live", key.id) == live


async def test_responses_and_ledger_rows_written_at_once_are_all_kept(store_url, opened):
    """A response is written beside its request's ledger row; many at once, both are all kept
    (on SQLite each on a connection of its own, which wait for each other's locks)."""
    store = await opened(store_url)
    key = await store.create_key(digest("sk-busy"), name="busy")
    ledger = Ledger(store)
    big = [{"role": "user", "content": "x" * 100_000}]  # a long conversation: many pages
    await asyncio.gather(
        *(store.put_responses([stored(f"resp_{i}", key.id, messages=big)]) for i in range(40)),
        *(ledger.record(row(f"req_{i}", key.id, "0.01")) for i in range(200)),
    )
    await ledger.close()
    assert await count(store_url) == 40
    assert len(await store.ledger()) == 200
    assert await store.spent(key.id) == Decimal("2.00")
    assert (await store.get_response("resp_39", key.id)).messages == big


async def test_a_database_from_before_stored_responses_is_migrated_its_data_kept(store_url, opened):
    scripts = migrations(store_url)
    before = next(i for i, script in enumerate(scripts) if "CREATE TABLE responses" in script)  # the schema before it
    await older_database(store_url, before)
    store = await opened(store_url)
    assert await query(store_url, "SELECT max(version) FROM schema_version") == [(len(scripts),)]
    key = await store.find_key(digest("sk-older"))
    assert key.name == "older"
    response = stored("resp_after_migration", key.id)
    await store.put_responses([response])
    assert await store.get_response("resp_after_migration", key.id) == response


async def test_replicas_sweeping_at_once_delete_each_expired_response_once(
    postgres_url, opened, sweep_every_time, caplog
):
    replicas = [await opened(postgres_url) for _ in range(3)]
    key = await replicas[0].create_key(digest("sk-replicas"), name="replicas")
    for i in range(9):
        await replicas[i % 3].put_responses([stored(f"resp_old_{i}", key.id, expires_in=timedelta(seconds=-60))])
    await replicas[0].put_responses([stored("resp_live", key.id)])
    with caplog.at_level("WARNING", logger="ezat.storage"):
        await asyncio.gather(*(replica.hold([], []) for replica in replicas))
        for _ in range(100):
            if await count(postgres_url) == 1:
                break
            await asyncio.sleep(0.05)
    assert await query(postgres_url, "SELECT response_id FROM responses") == [("resp_live",)]
    assert "stored responses failed" not in caplog.text
    assert (await replicas[2].get_response("resp_live", key.id)).response_id == "resp_live"


async def test_responses_kept_while_the_database_is_out_are_given_up_quietly(postgres_url, caplog):
    """The database out of reach as responses are kept: none is, and the log does not say so
    once a response (the outage is told once, as it begins and ends, by the requests it refuses)."""
    link = await Link(URL(POSTGRES_URL).port).start()
    store = open_store(link.url(postgres_url))
    await store.open()
    try:
        kept = KeptResponses(store, retention_days=1)
        link.cut()
        for i in range(3):
            kept.keep(1, {"id": f"resp_{i}", "created_at": int(datetime.now(UTC).timestamp())}, [], [], None)
        with pytest.raises(StoreUnavailable):
            await kept.find("resp_2", 1)  # waits for its group's write, then reads
        assert [r.getMessage() for r in caplog.records if r.name == "ezat.responses"] == []
    finally:
        link.restore()
        await store.close()
        await link.close()
