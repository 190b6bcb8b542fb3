"""The SQLite store: the embedded default, one file, nothing to run.

WAL mode, so readers never wait for the ledger writer; `synchronous=NORMAL`, so a committed row
survives the gateway process being killed (it is in the OS before COMMIT returns). Money is
kept as exact decimal strings.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import astuple
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import aiosqlite
import orjson

from gateway.config import KeyConfig
from gateway.storage.records import KeyRecord, LedgerRow
from gateway.storage.schema import KEY_COLUMNS, KEY_FIELDS, LEDGER_COLUMNS, SQLITE

# How long a key's spend read from the file is trusted. Writes of this process update it at
# once; this bounds how late another process's writes to the same file are seen.
SPEND_TTL = 1.0


class SQLiteStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None  # writes
        self._reader: aiosqlite.Connection | None = None  # reads, never queued behind a write
        self._spent: dict[int, tuple[Decimal, float]] = {}

    async def open(self) -> None:
        try:
            self._db = await self._connect()
            await _when_unlocked(lambda: self._db.execute("PRAGMA journal_mode=WAL"))
            await self._migrate()
            # WAL lets a second connection read while the first writes; ":memory:" is one database per connection.
            self._reader = self._db if self.path == ":memory:" else await self._connect()
        except BaseException:
            await self.close()  # an open connection's thread would keep the process alive
            raise

    async def _connect(self) -> aiosqlite.Connection:
        db = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.execute("PRAGMA busy_timeout=10000")
            await db.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            await db.close()
            raise
        return db

    async def close(self) -> None:
        for db in {self._reader, self._db} - {None}:
            await db.close()
        self._db = self._reader = None

    async def _migrate(self) -> None:
        """All in one write transaction, so processes opening the file at once migrate it once."""
        db = self._db
        await _when_unlocked(lambda: db.execute("BEGIN IMMEDIATE"))
        try:
            await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            async with db.execute("SELECT coalesce(max(version), 0) FROM schema_version") as cursor:
                (version,) = await cursor.fetchone()
            for number, script in enumerate(SQLITE[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):  # executescript would COMMIT
                    await db.execute(statement)
                await db.execute("INSERT INTO schema_version VALUES (?)", (number,))
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise

    # --- keys

    async def find_key(self, key_sha256: str) -> KeyRecord | None:
        async with self._reader.execute(f"SELECT {KEY_COLUMNS} FROM keys WHERE key_sha256 = ?", (key_sha256,)) as cur:
            row = await cur.fetchone()
        return _key(row) if row else None

    async def sync_config_keys(self, keys: Sequence[KeyConfig]) -> None:
        now = _text(datetime.now(timezone.utc))
        await self._db.execute("BEGIN IMMEDIATE")
        try:
            await self._db.executemany(
                """INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked,
                                     from_config, created_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?)
                   ON CONFLICT (key_sha256) DO UPDATE SET
                     name = excluded.name, models = excluded.models, spend_limit_usd = excluded.spend_limit_usd,
                     rpm = excluded.rpm, tpm = excluded.tpm, expires_at = excluded.expires_at,
                     revoked = excluded.revoked, from_config = 1""",
                [
                    (k.key_sha256, *_key_values(k.name, k.models, k.spend_limit_usd, k.rpm, k.tpm, k.expires_at, k.revoked), now)
                    for k in keys
                ],
            )
            await self._db.execute("COMMIT")
        except BaseException:
            await self._db.execute("ROLLBACK")
            raise

    async def create_key(self, key_sha256: str, **fields: Any) -> KeyRecord:
        record = KeyRecord(id=0, key_sha256=key_sha256, **{"name": "", **fields})
        await self._db.execute(
            "INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key_sha256, *_key_values(*(getattr(record, f) for f in KEY_FIELDS)), _text(datetime.now(timezone.utc))),
        )
        return await self.find_key(key_sha256)

    async def list_keys(self) -> list[KeyRecord]:
        async with self._reader.execute(f"SELECT {KEY_COLUMNS} FROM keys ORDER BY id") as cursor:
            return [_key(row) for row in await cursor.fetchall()]

    async def update_key(self, name_or_id: str, **fields: Any) -> KeyRecord | None:
        found = await self._lookup(name_or_id)
        if found is None:
            return None
        if fields:
            merged = {f: fields.get(f, getattr(found, f)) for f in KEY_FIELDS}
            assignments = ", ".join(f"{f} = ?" for f in KEY_FIELDS)
            await self._db.execute(
                f"UPDATE keys SET {assignments} WHERE id = ?",
                (*_key_values(*(merged[f] for f in KEY_FIELDS)), found.id),
            )
        return await self.find_key(found.key_sha256)

    async def _lookup(self, name_or_id: str) -> KeyRecord | None:
        query = "id = ?" if name_or_id.isdigit() else "name = ?"
        async with self._reader.execute(f"SELECT {KEY_COLUMNS} FROM keys WHERE {query}", (name_or_id,)) as cursor:
            rows = await cursor.fetchall()
        return _key(rows[0]) if len(rows) == 1 else None

    # --- spend and ledger

    async def spent(self, key_id: int) -> Decimal:
        cached = self._spent.get(key_id)
        if cached is not None and time.monotonic() - cached[1] < SPEND_TTL:
            return cached[0]
        async with self._reader.execute("SELECT spent_usd FROM keys WHERE id = ?", (key_id,)) as cursor:
            row = await cursor.fetchone()
        spent = Decimal(row[0]) if row else Decimal(0)
        self._spent[key_id] = (spent, time.monotonic())
        return spent

    async def write_ledger(self, rows: Sequence[LedgerRow]) -> None:
        totals: dict[int, Decimal] = defaultdict(Decimal)
        for row in rows:
            totals[row.key_id] += row.cost_usd
        db = self._db
        await db.execute("BEGIN IMMEDIATE")  # serialises writers, across processes too
        try:
            await db.executemany(
                f"INSERT INTO ledger ({LEDGER_COLUMNS}) VALUES ({', '.join('?' * 14)})",
                [_ledger_values(row) for row in rows],
            )
            marks = ", ".join("?" * len(totals))
            async with db.execute(f"SELECT id, spent_usd FROM keys WHERE id IN ({marks})", tuple(totals)) as cursor:
                spent = {key_id: Decimal(value) + totals[key_id] for key_id, value in await cursor.fetchall()}
            await db.executemany("UPDATE keys SET spent_usd = ? WHERE id = ?", [(str(v), k) for k, v in spent.items()])
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise
        now = time.monotonic()
        self._spent.update((key_id, (value, now)) for key_id, value in spent.items())

    async def ledger(self, *, key: str | None = None, since: datetime | None = None) -> list[LedgerRow]:
        query = f"SELECT {', '.join('ledger.' + c.strip() for c in LEDGER_COLUMNS.split(','))} FROM ledger"
        where, params = [], []
        if key is not None:
            query += " JOIN keys ON keys.id = ledger.key_id"
            where.append("(keys.name = ? OR CAST(keys.id AS TEXT) = ?)")
            params += [key, key]
        if since is not None:
            where.append("ledger.finished_at >= ?")
            params.append(_text(since))
        if where:
            query += " WHERE " + " AND ".join(where)
        async with self._reader.execute(query + " ORDER BY ledger.id", params) as cursor:
            return [_ledger_row(row) for row in await cursor.fetchall()]


async def _when_unlocked(statement, attempts: int = 100) -> None:
    """Run a statement that SQLite refuses at once, without waiting, while another connection
    sets the file up (switching it to WAL, or starting a write)."""
    for attempt in range(attempts):
        try:
            await statement()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.02)


def _text(moment: datetime | None) -> str | None:
    # Fixed-width UTC ISO text sorts (and so compares) as time does.
    return None if moment is None else moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


def _key_values(name, models, spend_limit_usd, rpm, tpm, expires_at, revoked) -> tuple:
    limit = None if spend_limit_usd is None else str(spend_limit_usd)
    return (name, orjson.dumps(list(models)).decode(), limit, rpm, tpm, _text(expires_at), int(revoked))


def _key(row: tuple) -> KeyRecord:
    key_id, name, digest, models, limit, rpm, tpm, expires_at, revoked, spent = row
    return KeyRecord(
        id=key_id,
        name=name,
        key_sha256=digest,
        models=tuple(orjson.loads(models)),
        spend_limit_usd=None if limit is None else Decimal(limit),
        rpm=rpm,
        tpm=tpm,
        expires_at=_time(expires_at),
        revoked=bool(revoked),
        spent_usd=Decimal(spent),
    )


def _ledger_values(row: LedgerRow) -> tuple:
    values = astuple(row)
    return (*values[:10], str(row.cost_usd), row.outcome, _text(row.started_at), _text(row.finished_at))


def _ledger_row(values: tuple) -> LedgerRow:
    return LedgerRow(*values[:10], Decimal(values[10]), values[11], _time(values[12]), _time(values[13]))
