"""The PostgreSQL store: one database shared by every replica. Spend is read and added in the
database itself, so a key's limit holds across replicas."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import asyncpg
import orjson

from gateway.config import KeyConfig
from gateway.storage.records import Hold, KeyRecord, LedgerRow
from gateway.storage.schema import KEY_COLUMNS, KEY_FIELDS, LEDGER_FIELDS, LEDGER_SELECT, POSTGRES

_MAX_ID = 2**63 - 1  # BIGSERIAL's largest
# Any constant works: it only has to be the same for every replica migrating at once.
_MIGRATION_LOCK = 0x657A6174
# Seconds a connection may take to open, and a statement to answer, before it counts as failed:
# a server that stops answering fails requests instead of holding them (and shutdown) forever.
_TIMEOUT = 10.0
# The ledger's columns in LEDGER_FIELDS' order, as PostgreSQL types for unnest().
_LEDGER_TYPES = ("text", "bigint", "text", "text", "text", "bigint", "bigint", "bigint", "bigint", "bigint",
                 "numeric", "text", "timestamptz", "timestamptz")
assert len(_LEDGER_TYPES) == len(LEDGER_FIELDS)
# Written again after a commit whose answer was lost (the ledger tries a failed batch again), a
# row that is already there is skipped, and only the rows inserted add to their key's spend.
_INSERT_LEDGER = (
    f"INSERT INTO ledger ({', '.join(LEDGER_FIELDS)}) "
    f"SELECT * FROM unnest({', '.join(f'${i}::{t}[]' for i, t in enumerate(_LEDGER_TYPES, start=1))}) "
    "ON CONFLICT (request_id) DO NOTHING RETURNING key_id, cost_usd"
)


class PostgresStore:
    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        self.url = url
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self.url, min_size=1, max_size=self._pool_size, timeout=_TIMEOUT, command_timeout=_TIMEOUT
        )
        await self._migrate()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _migrate(self) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)  # one replica at a time
            await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            version = await db.fetchval("SELECT coalesce(max(version), 0) FROM schema_version")
            for number, script in enumerate(POSTGRES[version:], start=version + 1):
                await db.execute(script)
                await db.execute("INSERT INTO schema_version VALUES ($1)", number)

    # --- keys

    async def find_key(self, key_sha256: str) -> KeyRecord | None:
        row = await self._pool.fetchrow(f"SELECT {KEY_COLUMNS} FROM keys WHERE key_sha256 = $1", key_sha256)
        return _key(row) if row else None

    async def sync_config_keys(self, keys: Sequence[KeyConfig]) -> None:
        """The file's keys as it declares them; a key it no longer declares is revoked."""
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "UPDATE keys SET revoked = TRUE WHERE from_config AND NOT (key_sha256 = ANY($1::text[]))",
                [k.key_sha256 for k in keys],
            )
            await db.executemany(
                """INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked,
                                     max_concurrent, from_config)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, TRUE)
                   ON CONFLICT (key_sha256) DO UPDATE SET
                     name = excluded.name, models = excluded.models, spend_limit_usd = excluded.spend_limit_usd,
                     rpm = excluded.rpm, tpm = excluded.tpm, expires_at = excluded.expires_at,
                     revoked = excluded.revoked, max_concurrent = excluded.max_concurrent, from_config = TRUE""",
                [(k.key_sha256, *_key_values(*(getattr(k, f) for f in KEY_FIELDS))) for k in keys],
            )

    async def create_key(self, key_sha256: str, **fields: Any) -> KeyRecord:
        record = KeyRecord(id=0, key_sha256=key_sha256, **{"name": "", **fields})
        row = await self._pool.fetchrow(
            "INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent)"
            f" VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {KEY_COLUMNS}",
            key_sha256,
            *_key_values(*(getattr(record, f) for f in KEY_FIELDS)),
        )
        return _key(row)

    async def list_keys(self) -> list[KeyRecord]:
        return [_key(row) for row in await self._pool.fetch(f"SELECT {KEY_COLUMNS} FROM keys ORDER BY id")]

    async def update_key(self, name_or_id: str, **fields: Any) -> KeyRecord | None:
        # ASCII digits ("²".isdigit() too) that fit an id; else a name.
        by_id = name_or_id.isascii() and name_or_id.isdigit() and int(name_or_id) <= _MAX_ID
        column, value = ("id", int(name_or_id)) if by_id else ("name", name_or_id)
        rows = await self._pool.fetch(f"SELECT {KEY_COLUMNS} FROM keys WHERE {column} = $1", value)
        if len(rows) != 1:
            return None
        found = _key(rows[0])
        merged = {f: fields.get(f, getattr(found, f)) for f in KEY_FIELDS}
        assignments = ", ".join(f"{f} = ${i}" for i, f in enumerate(KEY_FIELDS, start=2))
        row = await self._pool.fetchrow(
            f"UPDATE keys SET {assignments} WHERE id = $1 RETURNING {KEY_COLUMNS}",
            found.id,
            *_key_values(*(merged[f] for f in KEY_FIELDS)),
        )
        return _key(row)

    # --- spend and ledger

    async def spent(self, key_id: int) -> Decimal:
        value = await self._pool.fetchval("SELECT spent_usd FROM keys WHERE id = $1", key_id)
        return Decimal(0) if value is None else value

    async def hold(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Decimal | None]:
        async with self._pool.acquire(timeout=_TIMEOUT) as db, db.transaction():
            if releases:
                await db.execute("DELETE FROM reservations WHERE request_id = ANY($1::text[])", list(releases))
            if not holds:
                return []
            keys = sorted({hold.key_id for hold in holds})
            # The keys' row locks (in key order: no two replicas wait on each other in a cycle)
            # serialise their reservations and ledger writes across replicas; the statements
            # after them see what committed before they were granted.
            spent = dict(await db.fetch("SELECT id, spent_usd FROM keys WHERE id = ANY($1) ORDER BY id FOR UPDATE", keys))
            await db.execute("DELETE FROM reservations WHERE key_id = ANY($1) AND expires_at <= now()", keys)
            held = dict(await db.fetch(
                "SELECT key_id, sum(amount_usd) FROM reservations WHERE key_id = ANY($1) GROUP BY key_id", keys
            ))
            left: dict[int, Decimal] = {}
            results: list[Decimal | None] = []
            taken: list[Hold] = []
            for hold in holds:
                if hold.key_id not in left:
                    left[hold.key_id] = hold.limit - spent.get(hold.key_id, Decimal(0)) - held.get(hold.key_id, Decimal(0))
                if hold.amount > left[hold.key_id]:
                    results.append(left[hold.key_id])
                    continue
                left[hold.key_id] -= hold.amount
                taken.append(hold)
                results.append(None)
            if taken:
                await db.execute(
                    "INSERT INTO reservations SELECT r, k, a, now() + make_interval(secs => t) "
                    "FROM unnest($1::text[], $2::bigint[], $3::numeric[], $4::float8[]) AS h(r, k, a, t) "
                    "ON CONFLICT (request_id) DO UPDATE SET amount_usd = excluded.amount_usd, expires_at = excluded.expires_at",
                    *(list(column) for column in zip(*((h.request_id, h.key_id, h.amount, h.ttl) for h in taken))),
                )
            return results

    async def reserved(self) -> dict[int, Decimal]:
        rows = await self._pool.fetch(
            "SELECT key_id, sum(amount_usd) FROM reservations WHERE expires_at > now() GROUP BY key_id"
        )
        return {key_id: amount for key_id, amount in rows}

    async def write_ledger(self, rows: Sequence[LedgerRow]) -> None:
        if not rows:
            return
        async with self._pool.acquire(timeout=_TIMEOUT) as db, db.transaction():
            # A row's request gives up its reservation as its cost becomes spend, in one commit.
            await db.execute("DELETE FROM reservations WHERE request_id = ANY($1::text[])", [row[0] for row in rows])
            inserted = await db.fetch(_INSERT_LEDGER, *(list(column) for column in zip(*rows)))
            spend: dict[int, Decimal] = {}
            for key_id, cost in inserted:
                spend[key_id] = spend.get(key_id, Decimal(0)) + cost
            # In key order, so two replicas' batches never wait on each other's locks in a cycle.
            await db.executemany("UPDATE keys SET spent_usd = spent_usd + $2 WHERE id = $1", sorted(spend.items()))

    def write_ledger_now(self, rows: Sequence[LedgerRow]) -> bool:
        return False  # every write is a round trip to the server

    async def ledger(self, *, key: str | None = None, since: datetime | None = None) -> list[LedgerRow]:
        query = f"SELECT {LEDGER_SELECT} FROM ledger JOIN keys ON keys.id = ledger.key_id WHERE TRUE"
        params: list[Any] = []
        if key is not None:
            params.append(key)
            query += f" AND (keys.name = ${len(params)} OR keys.id::text = ${len(params)})"
        if since is not None:
            params.append(since)
            query += f" AND ledger.finished_at >= ${len(params)}"
        rows = await self._pool.fetch(query + " ORDER BY ledger.id", *params)
        return [LedgerRow(*row) for row in rows]


def _key_values(name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent) -> tuple:
    return (name, orjson.dumps(list(models)).decode(), spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent)


def _key(row) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        key_sha256=row["key_sha256"],
        models=tuple(orjson.loads(row["models"])),
        spend_limit_usd=row["spend_limit_usd"],
        rpm=row["rpm"],
        tpm=row["tpm"],
        max_concurrent=row["max_concurrent"],
        expires_at=row["expires_at"].astimezone(timezone.utc) if row["expires_at"] else None,
        revoked=row["revoked"],
        spent_usd=row["spent_usd"],
        from_config=row["from_config"],
    )
