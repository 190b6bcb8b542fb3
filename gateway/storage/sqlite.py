"""The SQLite store: the embedded default, one file, nothing to run.

WAL mode, so the reading connection never waits for the writing one; `synchronous=NORMAL`, so
a committed row survives the gateway process being killed (it is in the OS before COMMIT
returns). Connections live on threads of their own and every operation, a whole transaction
included, is one call there: one hop from the event loop, never one per statement.

The ledger's batches (and groups of spend reservations) are the exception: committing one is a
WAL append of a few pages, tens of microseconds, less than the hop to a thread costs, so they
are written on the event loop by a connection that never waits (no busy timeout). When another
writer holds the file, the batch goes to the writer thread, which waits its turn. No request
waits for a checkpoint: no connection checkpoints on its own; every CHECKPOINT_EVERY writes, a
thread of its own copies the WAL into the file (a passive checkpoint, which writers never wait
for, its fsyncs included) and then starts the WAL again from its beginning, so it stays
bounded. Money is kept as exact decimal strings; what requests under way hold, in whole
billionths of a dollar, totalled on each key's and organization's row (sqlite_reservations.py).

Stored responses (the Responses API's) are written by a connection and thread of their own, one
short transaction each, so the writer thread's queue, where the ledger's batches wait when the
file is busy, never holds a response's write. Once a minute, at a hold's sweep or a response's
write, a task of its own deletes the expired ones; nothing waits for it.

The files are private: a database the store creates is made 0600 before SQLite opens it, and
SQLite gives its -wal and -shm files the database file's mode. An existing file keeps its mode
(its owner chose it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar, cast, overload

import orjson

from gateway.clock import Clock, system
from gateway.config import KeyConfig, OrganizationConfig
from gateway.storage import sqlite_reservations as reservations
from gateway.storage.records import (
    ADMIN_TOKEN_SESSION,
    DEVICE_APPROVED,
    DEVICE_DENIED,
    DEVICE_PENDING,
    EXPIRED_GRANTS_KEPT,
    AdminTokenRecord,
    Alert,
    AlertDelivery,
    AuditEntry,
    AuditNote,
    DeviceGrant,
    Hold,
    KeyRecord,
    LedgerRow,
    OrganizationRecord,
    PastTheCap,
    PersonRecord,
    RenewalRecord,
    SessionRecord,
    Shortfall,
    StoredResponse,
    admin_token_view,
    cost_by_key,
    groups_text,
    key_view,
    organization_view,
    person_view,
    polled,
)
from gateway.storage.schema import (
    ADMIN_TOKEN_COLUMNS,
    AUDIT_COLUMNS,
    DEVICE_GRANT_COLUMNS,
    KEY_COLUMNS,
    KEY_FIELDS,
    KEY_TABLES,
    LEDGER_COLUMNS,
    LEDGER_FIELDS,
    ORGANIZATION_COLUMNS,
    PERSON_COLUMNS,
    RENEWAL_COLUMNS,
    RESPONSE_COLUMNS,
    SESSION_COLUMNS,
    SQLITE,
    SWEEP_BATCH,
    ledger_page_query,
)
from gateway.storage.unavailable import raises_unavailable
from middlewares.core.periods import PERIODS, still_current
from middlewares.core.records import PersonSpend

log = logging.getLogger("ezat.storage")
# Writes on the event loop between two checkpoints of the WAL into the file: a few pages each
# (the row, its indexes, the key's spend; more for batches of many rows), so the WAL, which reads
# search and a checkpoint copies, stays short (its size under steady writes: bench/HISTORY.md).
CHECKPOINT_EVERY = 1000
# A checkpoint's passes while writes go on: each copies what arrived during the last, until one
# copies fewer than FEW_FRAMES pages; then one more with writes held off.
CATCH_UP_PASSES = 5
FEW_FRAMES = 256
# Seconds between sweeps of the reservations (sqlite_reservations.sweep): what expired (its
# process died, an hour ago at least) is dropped, and the totals are checked against the rows;
# expired stored responses are deleted then too.
SWEEP_EVERY = 60.0
# The WAL grows by a page per PAGE_BYTES of a stored response: its write counts as that many
# writes towards the next checkpoint.
PAGE_BYTES = 4096
T = TypeVar("T")


class Connection:
    """One sqlite3 connection and the one thread that uses it."""

    def __init__(self, path: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ezat-sqlite")
        self._path = path
        self._db: sqlite3.Connection | None = None

    async def call(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, self._db, *args)

    async def open(self) -> None:
        def connect(_) -> None:
            self._db = _connect(self._path, "busy_timeout=10000", "wal_autocheckpoint=0")  # the store checkpoints

        await self.call(connect)

    async def close(self) -> None:
        if self._db is not None:
            await self.call(sqlite3.Connection.close)
            self._db = None
        self._thread.shutdown(wait=False)


def _transaction(db: sqlite3.Connection, work: Callable[..., T], *args: Any, wait: bool = True) -> T:
    """`work` in one write transaction (BEGIN IMMEDIATE serialises writers, across processes too)."""
    if wait:
        _when_unlocked(db, "BEGIN IMMEDIATE")
    else:
        db.execute("BEGIN IMMEDIATE")
    try:
        result = work(db, *args)
        db.execute("COMMIT")
        return result
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _when_unlocked(db: sqlite3.Connection, statement: str, attempts: int = 100) -> None:
    """A statement SQLite refuses at once, without its busy wait, while another connection sets
    the file up (switching it to WAL, or migrating it): tried again shortly."""
    for attempt in range(attempts):
        try:
            db.execute(statement)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.02)


# SQLite's primary result codes that mean the file cannot be used now, not that a statement is wrong.
_UNREACHABLE_CODES = frozenset(
    {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN}
)


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` means the file cannot be used now: busy past the wait (another process holds
    it), or its disk failing, full or gone."""
    if isinstance(exc, OSError):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and code is not None and code & 0xFF in _UNREACHABLE_CODES


@raises_unavailable(_unreachable)
class SQLiteStore:
    def __init__(self, path: str, *, now: Clock = system) -> None:
        self.path = path
        self._now = now  # the gateway's clock, for budget periods
        self._writer = Connection(path)
        # ":memory:" is one database per connection: there, reads share the writer's.
        self._reader = self._writer if path == ":memory:" else Connection(path)
        self._inline: sqlite3.Connection | None = None  # the ledger's, on the event loop
        self._checkpointer = None if path == ":memory:" else Connection(path)
        self._responses = self._writer if path == ":memory:" else Connection(path)  # stored responses' writes
        self._response_sweep: asyncio.Task[None] | None = None
        self._next_response_sweep = 0.0  # time.monotonic() when the expired responses are next deleted
        self._holder: sqlite3.Connection | None = None  # the checkpointer's, to hold writes off
        self._holding = threading.Event()  # set while it does: writes go to the writer thread
        self._checkpoint: asyncio.Task[None] | None = None
        self._since_checkpoint = 0
        self._next_sweep = 0.0  # time.monotonic() when a hold next sweeps the reservations

    async def open(self) -> None:
        if self.path != ":memory:":
            _create_private(self.path)
        try:
            await self._writer.open()
            await self._writer.call(_when_unlocked, "PRAGMA journal_mode=WAL")
            await self._writer.call(_transaction, _migrate)
            if self._checkpointer is not None:
                await self._reader.open()
                await self._checkpointer.open()
                await self._responses.open()
                self._holder = _connect(self.path, "busy_timeout=10000")
                self._inline = _connect(self.path, "busy_timeout=0", "wal_autocheckpoint=0")
        except BaseException:
            await self.close()  # a connection's thread would keep the process alive
            raise

    async def close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None  # no checkpoint starts from here on
        if self._checkpoint is not None:
            await self._checkpoint
        if self._response_sweep is not None:
            self._response_sweep.cancel()  # a batch under way ends on its thread, before its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await self._response_sweep
        for connection in (self._inline, self._holder):
            if connection is not None:
                connection.close()
        self._inline = self._holder = None
        await self._writer.close()
        if checkpointer is not None:
            await self._reader.close()
            await checkpointer.close()
            await self._responses.close()

    async def ping(self) -> None:
        await self._reader.call(_fetch_all, "SELECT 1")

    # --- keys

    async def find_key(self, key_sha256: str) -> KeyRecord | None:
        return await self._reader.call(_select_key, "k.key_sha256 = ?", key_sha256)

    async def sync_config_keys(self, keys: Sequence[KeyConfig]) -> None:
        now = _text(datetime.now(UTC))
        values = [(k.key_sha256, *_key_values(*(getattr(k, f) for f in KEY_FIELDS)), k.organization, now) for k in keys]
        await self._writer.call(_transaction, _upsert_config_keys, values, self._now())

    async def create_key(self, key_sha256: str, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord:
        record = KeyRecord(id=0, key_sha256=key_sha256, **{"name": "", **fields})
        values = (
            key_sha256,
            *_key_values(*(getattr(record, f) for f in KEY_FIELDS)),
            record.organization_id,
            record.person_id,
            _text(datetime.now(UTC)),
        )
        return await self._writer.call(_transaction, _create_key, values, audit, self._now())

    async def list_keys(self) -> list[KeyRecord]:
        return await self._reader.call(_select_keys)

    async def list_person_keys(self, person_id: int) -> list[KeyRecord]:
        rows = await self._reader.call(
            _fetch_all, f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.person_id = ? ORDER BY k.id DESC", (person_id,)
        )
        return [_key(row) for row in rows]

    async def update_key(self, key_id: int, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord | None:
        return await self._writer.call(_transaction, _update_key, key_id, fields, audit, self._now())

    async def rotate_key(self, key_id: int, key_sha256: str, *, audit: AuditNote | None = None) -> KeyRecord | None:
        return await self._writer.call(_transaction, _rotate_key, key_id, key_sha256, audit, self._now())

    # --- organizations

    async def sync_config_organizations(self, organizations: Sequence[OrganizationConfig]) -> None:
        values = [(o.name, _money(o.balance_usd), int(o.suspended), _text(datetime.now(UTC))) for o in organizations]
        await self._writer.call(_transaction, _upsert_config_organizations, values)

    async def create_organization(
        self,
        name: str,
        *,
        balance_usd: Decimal | None = None,
        suspended: bool = False,
        audit: AuditNote | None = None,
    ) -> OrganizationRecord | None:
        return await self._writer.call(
            _transaction, _insert_organization, name, _money(balance_usd), int(suspended), audit
        )

    async def find_organization(self, name: str) -> OrganizationRecord | None:
        return await self._reader.call(_select_organization, name)

    async def list_organizations(self) -> list[OrganizationRecord]:
        rows = await self._reader.call(_fetch_all, f"SELECT {ORGANIZATION_COLUMNS} FROM organizations o ORDER BY o.id")
        return [_organization(row) for row in rows]

    async def update_organization(
        self, name: str, *, audit: AuditNote | None = None, **fields: Any
    ) -> OrganizationRecord | None:
        return await self._writer.call(_transaction, _update_organization, name, fields, audit)

    async def top_up_organization(
        self, name: str, amount_usd: Decimal, *, most: Decimal, audit: AuditNote | None = None
    ) -> OrganizationRecord | None:
        return await self._writer.call(_transaction, _top_up_organization, name, str(amount_usd), str(most), audit)

    # --- admin tokens and the audit log

    async def create_admin_token(
        self, name: str, role: str, token_sha256: str, *, audit: AuditNote | None = None
    ) -> AdminTokenRecord | None:
        now = _text(datetime.now(UTC))
        return await self._writer.call(_transaction, _insert_admin_token, name, role, token_sha256, now, audit)

    async def find_admin_token(self, token_sha256: str) -> AdminTokenRecord | None:
        rows = await self._reader.call(
            _fetch_all, f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE token_sha256 = ?", (token_sha256,)
        )
        return _admin_token(rows[0]) if rows else None

    async def list_admin_tokens(self) -> list[AdminTokenRecord]:
        rows = await self._reader.call(_fetch_all, f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens ORDER BY id")
        return [_admin_token(row) for row in rows]

    async def revoke_admin_token(self, token_id: int, *, audit: AuditNote | None = None) -> AdminTokenRecord | None:
        return await self._writer.call(_transaction, _revoke_admin_token, token_id, _text(datetime.now(UTC)), audit)

    # --- people

    async def person_signed_in(self, subject: str, email: str, name: str, groups: Sequence[str]) -> PersonRecord:
        values = (subject, email, name, groups_text(groups), _text(self._now()))
        return await self._writer.call(_transaction, _upsert_person, values)

    async def find_person(self, person_id: int) -> PersonRecord | None:
        return await self._reader.call(_select_person, "id = ?", person_id)

    async def find_person_by_subject(self, subject: str) -> PersonRecord | None:
        return await self._reader.call(_select_person, "subject = ?", subject)

    async def person_provider_token(self, person_id: int) -> str | None:
        return await self._reader.call(_select_provider_token, person_id)

    async def set_person_provider_token(self, person_id: int, sealed: str | None) -> None:
        await self._writer.call(_transaction, _update_provider_token, person_id, sealed)

    async def end_provider_trust(self, person_id: int) -> None:
        await self._writer.call(_transaction, _end_provider_trust, person_id)

    async def list_people(self, *, limit: int, after: int | None = None) -> list[PersonRecord]:
        rows = await self._reader.call(
            _fetch_all,
            f"SELECT {PERSON_COLUMNS} FROM people WHERE id > ? ORDER BY id LIMIT ?",
            (after if after is not None else 0, limit),
        )
        return [_person(row) for row in rows]

    async def set_person_disabled(
        self, person_id: int, disabled: bool, *, audit: AuditNote | None = None
    ) -> PersonRecord | None:
        return await self._writer.call(_transaction, _set_person_disabled, person_id, disabled, audit)

    # --- the console's sessions

    async def create_session(self, session: SessionRecord) -> None:
        values = (*session[:4], _text(session.created_at), _text(session.expires_at))
        await self._writer.call(_transaction, _insert_session, values, _text(datetime.now(UTC)))

    async def find_session(self, id_sha256: str) -> SessionRecord | None:
        rows = await self._reader.call(
            _fetch_all,
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id_sha256 = ? AND expires_at > ?",
            (id_sha256, _text(datetime.now(UTC))),
        )
        return SessionRecord(*rows[0][:4], *map(_time, rows[0][4:])) if rows else None

    async def delete_session(self, id_sha256: str) -> None:
        await self._writer.call(_transaction, _execute, "DELETE FROM sessions WHERE id_sha256 = ?", (id_sha256,))

    # --- `ezat-gateway login`: device grants and renewal tokens

    async def create_device_grant(self, grant: DeviceGrant) -> bool:
        return await self._writer.call(
            _transaction, _insert_device_grant, _device_grant_values(grant), datetime.now(UTC)
        )

    async def find_device_grant(self, user_code: str) -> DeviceGrant | None:
        rows = await self._reader.call(
            _fetch_all, f"SELECT {DEVICE_GRANT_COLUMNS} FROM device_grants WHERE user_code = ?", (user_code,)
        )
        return _device_grant(rows[0]) if rows else None

    async def decide_device_grant(self, user_code: str, person_id: int, approved: bool) -> DeviceGrant | None:
        status = DEVICE_APPROVED if approved else DEVICE_DENIED
        return await self._writer.call(
            _transaction, _decide_device_grant, user_code, person_id, status, _text(datetime.now(UTC))
        )

    async def poll_device_grant(self, device_sha256: str) -> tuple[DeviceGrant, str] | None:
        return await self._writer.call(_transaction, _poll_device_grant, device_sha256, datetime.now(UTC))

    async def create_renewal(self, renewal: RenewalRecord) -> None:
        await self._writer.call(_transaction, _insert_renewal, _renewal_values(renewal), _text(datetime.now(UTC)))

    async def find_renewal(self, token_sha256: str) -> RenewalRecord | None:
        rows = await self._reader.call(
            _fetch_all, f"SELECT {RENEWAL_COLUMNS} FROM renewal_tokens WHERE token_sha256 = ?", (token_sha256,)
        )
        return _renewal(rows[0]) if rows else None

    async def rotate_renewal(self, token_sha256: str, replacement: RenewalRecord) -> bool:
        return await self._writer.call(
            _transaction, _rotate_renewal, token_sha256, _renewal_values(replacement), _text(datetime.now(UTC))
        )

    async def audit_log(self, *, limit: int = 100, before: int | None = None) -> list[AuditEntry]:
        rows = await self._reader.call(
            _fetch_all,
            f"SELECT {AUDIT_COLUMNS} FROM audit_log WHERE id < ? ORDER BY id DESC LIMIT ?",
            (before if before is not None else 2**63 - 1, limit),
        )
        return [_audit_entry(row) for row in rows]

    async def organizations_reserved(self) -> dict[int, Decimal]:
        rows = await self._reader.call(
            _fetch_all,
            "SELECT organization_id, amount_usd FROM reservations WHERE expires_at > ?",
            (_text(datetime.now(UTC)),),
        )
        held: dict[int, Decimal] = {}
        for organization_id, amount in rows:
            held[organization_id] = held.get(organization_id, Decimal(0)) + Decimal(amount)
        return held

    # --- spend and ledger

    async def spent(self, key_id: int) -> Decimal:
        return await self._reader.call(_select_spent, key_id)

    async def hold(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None]:
        now = datetime.now(UTC)
        if time.monotonic() < self._next_sweep:
            return await self._write_now_or_wait(
                reservations.hold, holds, releases, _expiries(holds, now), None, self._now()
            )
        # Once a minute a hold sweeps the reservations first: scans, on the writer thread. The
        # expired responses are deleted beside it, in a task this hold does not wait for.
        self._next_sweep = time.monotonic() + SWEEP_EVERY
        self._sweep_responses_when_due()
        return await self._write_waiting(
            reservations.hold, holds, releases, _expiries(holds, now), _text(now), self._now()
        )

    def hold_now(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None] | None:
        if time.monotonic() >= self._next_sweep:
            return None  # hold() sweeps, off the event loop
        written, result = self._write_inline(
            reservations.hold, holds, releases, _expiries(holds, datetime.now(UTC)), None, self._now()
        )
        return result if written else None

    async def reserved(self) -> dict[int, Decimal]:
        rows = await self._reader.call(
            _fetch_all, "SELECT key_id, amount_usd FROM reservations WHERE expires_at > ?", (_text(datetime.now(UTC)),)
        )
        held: dict[int, Decimal] = {}
        for key_id, amount in rows:
            held[key_id] = held.get(key_id, Decimal(0)) + Decimal(amount)
        return held

    async def _write_now_or_wait(self, work: Callable[..., T], *args: Any) -> T:
        """`work` in a write transaction: on the event loop when it can be (see _write_inline),
        else on the writer thread, which waits its turn (another writer has the file, or, in
        ":memory:", there is no inline connection)."""
        written, result = self._write_inline(work, *args)
        # Written inline, result is what `work` returned (None only when it was not written).
        return cast(T, result) if written else await self._write_waiting(work, *args)

    async def _write_waiting(self, work: Callable[..., T], *args: Any) -> T:
        """`work` in a write transaction on the writer thread, which waits its turn."""
        result = await self._writer.call(_transaction, work, *args)
        self._wrote()
        return result

    def write_ledger_now(self, rows: Sequence[LedgerRow]) -> bool:
        return self._write_inline(_insert_ledger, _ledger_values(rows), cost_by_key(rows), self._now())[0]

    async def write_ledger(self, rows: Sequence[LedgerRow]) -> None:
        await self._write_now_or_wait(_insert_ledger, _ledger_values(rows), cost_by_key(rows), self._now())

    def _write_inline(self, work: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """(True, its result) for `work` committed on the event loop, (False, None) when another
        writer has the file. A small write (a ledger batch, a group of reservations) costs less
        than the hop to a thread. (write_ledger calls this, not write_ledger_now, so a subclass
        may tell the two apart.)"""
        if self._inline is None or self._holding.is_set():
            return False, None
        try:
            result = _transaction(self._inline, work, *args, wait=False)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            return False, None  # another writer has the file
        self._wrote()
        return True, result

    def _wrote(self, writes: int = 1) -> None:
        """The WAL grew: every CHECKPOINT_EVERY writes it is copied into the file, while writes
        go on (nothing awaits the checkpoint)."""
        self._since_checkpoint += writes
        if self._since_checkpoint >= CHECKPOINT_EVERY and self._checkpoint is None and self._checkpointer is not None:
            self._since_checkpoint = 0
            self._checkpoint = asyncio.create_task(
                self._checkpoint_wal(self._checkpointer), context=contextvars.Context()
            )

    async def _checkpoint_wal(self, checkpointer: Connection) -> None:
        try:
            if not await checkpointer.call(_checkpoint, self._holder, self._holding):
                log.warning(
                    "WAL checkpoint could not copy the whole WAL (a reader or another checkpoint used it); "
                    "trying again later"
                )
        except Exception as exc:  # the next CHECKPOINT_EVERY writes try again
            log.warning("WAL checkpoint failed: %r", exc)
        finally:
            self._checkpoint = None

    # --- alerts

    async def keys_by_id(self, key_ids: Sequence[int]) -> list[KeyRecord]:
        return await self._reader.call(_select_keys_by_id, list(key_ids))

    async def claim_alert(self, alert: Alert) -> bool:
        now = _text(datetime.now(UTC))
        return await self._writer.call(_transaction, _insert_alert, (*alert, now, now))

    async def due_alerts(self, lease_seconds: float, give_up_after: float) -> tuple[list[AlertDelivery], int]:
        now = datetime.now(UTC)
        times = (
            _text(now),
            _text(now + timedelta(seconds=lease_seconds)),
            _text(now - timedelta(seconds=give_up_after)),
        )
        return await self._writer.call(_transaction, _lease_due_alerts, *times)

    async def alert_sent(self, alert_id: int) -> None:
        statement = "UPDATE alerts SET delivered_at = ?, attempts = attempts + 1, last_error = NULL WHERE id = ?"
        await self._writer.call(_transaction, _execute, statement, (_text(datetime.now(UTC)), alert_id))

    async def alert_failed(self, alert_id: int, retry_in: float, error: str) -> None:
        statement = "UPDATE alerts SET attempts = attempts + 1, next_attempt_at = ?, last_error = ? WHERE id = ?"
        retry_at = _text(datetime.now(UTC) + timedelta(seconds=retry_in))
        await self._writer.call(_transaction, _execute, statement, (retry_at, error, alert_id))

    # --- stored responses

    def put_responses_now(self, stored: Sequence[StoredResponse]) -> bool:
        rows = _response_rows(stored)
        if not self._write_inline(_upsert_responses, rows)[0]:
            return False
        self._wrote_responses(rows, inline=True)
        return True

    async def put_responses(self, stored: Sequence[StoredResponse]) -> None:
        rows = _response_rows(stored)  # on the event loop: the thread gets text, no live objects
        await self._responses.call(_transaction, _upsert_responses, rows)
        self._wrote_responses(rows)

    def _wrote_responses(self, rows: list[tuple], *, inline: bool = False) -> None:
        """The WAL grew by these rows (a write inline counted one already)."""
        self._wrote(len(rows) - inline + sum(len(document) for row in rows for document in row[4:]) // PAGE_BYTES)
        self._sweep_responses_when_due()  # keys with no spend limit never hold: their responses expire too

    async def get_response(self, response_id: str, key_id: int) -> StoredResponse | None:
        return await self._reader.call(_select_response, response_id, key_id, _text(datetime.now(UTC)))

    async def delete_response(self, response_id: str, key_id: int) -> bool:
        deleted = await self._responses.call(
            _transaction, _delete_response, response_id, key_id, _text(datetime.now(UTC))
        )
        if deleted:
            self._wrote()
        return deleted

    def _sweep_responses_when_due(self) -> None:
        """At most once every SWEEP_EVERY seconds (at a hold's sweep or a response's write), a task
        deletes the expired responses; nothing waits for it."""
        if time.monotonic() < self._next_response_sweep:
            return
        if self._response_sweep is None or self._response_sweep.done():
            self._next_response_sweep = time.monotonic() + SWEEP_EVERY
            self._response_sweep = asyncio.create_task(self._sweep_responses(), context=contextvars.Context())

    async def _sweep_responses(self) -> None:
        """Deletes the expired responses, SWEEP_BATCH to a transaction; the next sweep tries again
        after a failure."""
        try:
            while True:
                deleted = await self._responses.call(_delete_expired_responses, _text(datetime.now(UTC)))
                if deleted:
                    self._wrote(deleted)
                if deleted < SWEEP_BATCH:
                    return
        except Exception as exc:
            log.warning("deleting expired stored responses failed: %r", exc)

    async def ledger(
        self, *, key_id: int | None = None, since: datetime | None = None, until: datetime | None = None
    ) -> list[LedgerRow]:
        return [row for _, row in await self.ledger_page(key_id=key_id, since=since, until=until)]

    async def ledger_page(
        self,
        *,
        key_id: int | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> list[tuple[int, LedgerRow]]:
        values = (key_id, _text(since), _text(until), after)
        query, params = ledger_page_query(lambda n: "?", values, limit)
        rows = await self._reader.call(_fetch_all, query, params)
        return [(row[0], _ledger_row(row[1:])) for row in rows]


def _expiries(holds: Sequence[Hold], now: datetime) -> dict[float, str]:
    """Each of the holds' ttls → when a reservation made now for it expires (mostly one ttl)."""
    return {ttl: _text(now + timedelta(seconds=ttl)) for ttl in {hold.ttl for hold in holds}}


def _create_private(path: str) -> None:
    """An empty file (SQLite's new database) at `path`, readable by its owner only, unless one is
    there. (Not the umask around the connect: it is the whole process's, its other threads' files
    included.) A file that cannot be made is left to SQLite, which says why it cannot open it."""
    with contextlib.suppress(OSError):  # FileExistsError: an existing database keeps its mode
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _connect(path: str, *pragmas: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        for pragma in ("synchronous=NORMAL", "foreign_keys=ON", *pragmas):
            db.execute(f"PRAGMA {pragma}")
    except BaseException:
        db.close()
        raise
    return db


# --- What runs on a connection's thread.


def _migrate(db: sqlite3.Connection) -> None:
    """Inside one write transaction, so processes opening the file at once migrate it once."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    (version,) = db.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()
    for number, script in enumerate(SQLITE[version:], start=version + 1):
        for statement in filter(str.strip, script.split(";")):  # executescript would COMMIT
            db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (number,))


def _fetch_all(db: sqlite3.Connection, query: str, params: Sequence[Any] = ()) -> list[tuple]:
    return db.execute(query, params).fetchall()


def _select_key(db: sqlite3.Connection, condition: str, value: Any) -> KeyRecord | None:
    rows = db.execute(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE {condition}", (value,)).fetchall()
    return _key(rows[0]) if len(rows) == 1 else None


def _select_keys(db: sqlite3.Connection) -> list[KeyRecord]:
    return [_key(row) for row in db.execute(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} ORDER BY k.id")]


def _select_keys_by_id(db: sqlite3.Connection, key_ids: list[int]) -> list[KeyRecord]:
    """One query for them all (in batches: SQLite before 3.32 takes 999 variables at most)."""
    keys = []
    for at in range(0, len(key_ids), 900):
        batch = key_ids[at : at + 900]
        marks = ", ".join("?" * len(batch))
        keys += [
            _key(row) for row in db.execute(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.id IN ({marks})", batch)
        ]
    return keys


def _select_organization(db: sqlite3.Connection, name: str) -> OrganizationRecord | None:
    row = db.execute(f"SELECT {ORGANIZATION_COLUMNS} FROM organizations o WHERE o.name = ?", (name,)).fetchone()
    return None if row is None else _organization(row)


def _upsert_config_organizations(db: sqlite3.Connection, values: list[tuple]) -> None:
    """The file's organizations as it declares them; one it no longer declares stays, with its
    keys and settings, but is no longer from the file (the CLI may change it)."""
    declared = {row[0] for row in values}
    # A statement per name, not one with a variable each: SQLite before 3.32 takes 999 at most.
    db.executemany(
        "UPDATE organizations SET from_config = 0 WHERE name = ?",
        [
            (name,)
            for (name,) in db.execute("SELECT name FROM organizations WHERE from_config = 1").fetchall()
            if name not in declared
        ],
    )
    db.executemany(
        """INSERT INTO organizations (name, balance_usd, suspended, from_config, created_at) VALUES (?, ?, ?, 1, ?)
           ON CONFLICT (name) DO UPDATE SET
             balance_usd = excluded.balance_usd, suspended = excluded.suspended, from_config = 1""",
        values,
    )
    reservations.reconcile(db)  # an organization given a balance: what is held counts against it


def _insert_organization(
    db: sqlite3.Connection, name: str, balance: str | None, suspended: int, audit: AuditNote | None
) -> OrganizationRecord | None:
    """None when the name is taken."""
    inserted = db.execute(
        "INSERT INTO organizations (name, balance_usd, suspended, created_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (name) DO NOTHING",
        (name, balance, suspended, _text(datetime.now(UTC))),
    ).rowcount
    if not inserted:
        return None
    made = _select_organization(db, name)
    assert made is not None  # this transaction wrote it
    _audit(db, audit, f"organization:{made.id}", None, organization_view(made))
    return made


def _update_organization(
    db: sqlite3.Connection, name: str, fields: dict[str, Any], audit: AuditNote | None
) -> OrganizationRecord | None:
    found = _select_organization(db, name)
    if found is None or not fields:
        return found
    balance = fields.get("balance_usd", found.balance_usd)
    suspended = fields.get("suspended", found.suspended)
    db.execute(
        "UPDATE organizations SET balance_usd = ?, suspended = ? WHERE id = ?",
        (_money(balance), int(suspended), found.id),
    )
    reservations.reconcile(db)
    changed = _select_organization(db, name)
    assert changed is not None  # this transaction wrote it
    _audit(db, audit, f"organization:{found.id}", organization_view(found), organization_view(changed))
    return changed


def _top_up_organization(
    db: sqlite3.Connection, name: str, amount: str, most: str, audit: AuditNote | None
) -> OrganizationRecord | None:
    """The balance raised by `amount`; one with no balance limit is left as it is (unaudited)."""
    found = _select_organization(db, name)
    if found is None or found.balance_usd is None:
        return found
    if found.balance_usd + Decimal(amount) > Decimal(most):
        raise PastTheCap(found.balance_usd)
    db.execute(
        "UPDATE organizations SET balance_usd = ? WHERE id = ?", (str(found.balance_usd + Decimal(amount)), found.id)
    )
    changed = _select_organization(db, name)
    assert changed is not None  # this transaction wrote it
    _audit(db, audit, f"organization:{found.id}", organization_view(found), organization_view(changed))
    return changed


def _insert_admin_token(
    db: sqlite3.Connection, name: str, role: str, digest: str, now: str, audit: AuditNote | None
) -> AdminTokenRecord | None:
    """None when the name is taken."""
    inserted = db.execute(
        "INSERT INTO admin_tokens (name, role, token_sha256, created_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (name) DO NOTHING",
        (name, role, digest, now),
    ).rowcount
    if not inserted:
        return None
    made = _admin_token(
        db.execute(f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE name = ?", (name,)).fetchone()
    )
    _audit(db, audit, f"admin_token:{made.id}", None, admin_token_view(made))
    return made


def _revoke_admin_token(
    db: sqlite3.Connection, token_id: int, now: str, audit: AuditNote | None
) -> AdminTokenRecord | None:
    """One revoked already stays as it was (unaudited)."""
    query = f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE id = ?"
    row = db.execute(query, (token_id,)).fetchone()
    if row is None or row[-1] is not None:
        return None if row is None else _admin_token(row)
    db.execute("UPDATE admin_tokens SET revoked_at = ? WHERE id = ?", (now, token_id))
    db.execute("DELETE FROM sessions WHERE kind = ? AND subject = ?", (ADMIN_TOKEN_SESSION, row[3]))
    revoked = _admin_token(db.execute(query, (token_id,)).fetchone())
    _audit(db, audit, f"admin_token:{token_id}", admin_token_view(_admin_token(row)), admin_token_view(revoked))
    return revoked


def _select_provider_token(db: sqlite3.Connection, person_id: int) -> str | None:
    row = db.execute("SELECT provider_token FROM people WHERE id = ?", (person_id,)).fetchone()
    return None if row is None else row[0]


def _update_provider_token(db: sqlite3.Connection, person_id: int, sealed: str | None) -> None:
    db.execute("UPDATE people SET provider_token = ? WHERE id = ?", (sealed, person_id))


def _end_provider_trust(db: sqlite3.Connection, person_id: int) -> None:
    _update_provider_token(db, person_id, None)
    _revoke_renewals(db, person_id)


def _revoke_renewals(db: sqlite3.Connection, person_id: int) -> None:
    db.execute(
        "UPDATE renewal_tokens SET revoked_at = ? WHERE person_id = ? AND revoked_at IS NULL",
        (_text(datetime.now(UTC)), person_id),
    )


def _select_person(db: sqlite3.Connection, condition: str, value: Any) -> PersonRecord | None:
    row = db.execute(f"SELECT {PERSON_COLUMNS} FROM people WHERE {condition}", (value,)).fetchone()
    return None if row is None else _person(row)


def _upsert_person(db: sqlite3.Connection, values: tuple) -> PersonRecord:
    """The person made, or given this sign-in's email, name and groups. Last seen never goes back
    (a process whose clock is behind signing them in after another)."""
    subject, email, name, groups, now = values
    db.execute(
        "INSERT INTO people (subject, email, name, groups, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (subject) DO UPDATE SET email = excluded.email, name = excluded.name,"
        " groups = excluded.groups, last_seen = max(people.last_seen, excluded.last_seen)",
        (subject, email, name, groups, now, now),
    )
    person = _select_person(db, "subject = ?", subject)
    assert person is not None  # this transaction wrote it
    return person


def _set_person_disabled(
    db: sqlite3.Connection, person_id: int, disabled: bool, audit: AuditNote | None
) -> PersonRecord | None:
    """One disabled (or enabled) already stays as it was (unaudited)."""
    found = _select_person(db, "id = ?", person_id)
    if found is None or found.disabled == disabled:
        return found
    db.execute("UPDATE people SET disabled = ? WHERE id = ?", (int(disabled), person_id))
    if disabled:  # their command line's renewals end with their access
        _revoke_renewals(db, person_id)
    changed = _select_person(db, "id = ?", person_id)
    assert changed is not None  # this transaction wrote it
    _audit(db, audit, f"person:{person_id}", person_view(found), person_view(changed))
    return changed


def _insert_device_grant(db: sqlite3.Connection, values: tuple, now: datetime) -> bool:
    """False when an unexpired grant has the user code. An expired one with it is deleted, as are
    those expired EXPIRED_GRANTS_KEPT ago."""
    db.execute(
        "DELETE FROM device_grants WHERE expires_at <= ? OR (user_code = ? AND expires_at <= ?)",
        (_text(now - EXPIRED_GRANTS_KEPT), values[1], _text(now)),
    )
    marks = ", ".join("?" * len(values))
    inserted = db.execute(
        f"INSERT INTO device_grants ({DEVICE_GRANT_COLUMNS}) VALUES ({marks}) ON CONFLICT DO NOTHING", values
    ).rowcount
    return inserted > 0


def _decide_device_grant(
    db: sqlite3.Connection, user_code: str, person_id: int, status: str, now: str
) -> DeviceGrant | None:
    changed = db.execute(
        "UPDATE device_grants SET status = ?, person_id = ? WHERE user_code = ? AND status = ? AND expires_at > ?",
        (status, person_id, user_code, DEVICE_PENDING, now),
    ).rowcount
    if not changed:
        return None
    row = db.execute(f"SELECT {DEVICE_GRANT_COLUMNS} FROM device_grants WHERE user_code = ?", (user_code,)).fetchone()
    return _device_grant(row)


def _poll_device_grant(db: sqlite3.Connection, device_sha256: str, now: datetime) -> tuple[DeviceGrant, str] | None:
    row = db.execute(
        f"SELECT {DEVICE_GRANT_COLUMNS} FROM device_grants WHERE device_sha256 = ?", (device_sha256,)
    ).fetchone()
    if row is None:
        return None
    after, found = polled(_device_grant(row), now)
    db.execute(
        "UPDATE device_grants SET status = ?, interval_seconds = ?, last_polled_at = ? WHERE device_sha256 = ?",
        (after.status, after.interval, _text(after.last_polled_at), device_sha256),
    )
    return after, found


def _insert_renewal(db: sqlite3.Connection, values: tuple, now: str) -> None:
    db.execute("DELETE FROM renewal_tokens WHERE expires_at <= ?", (now,))
    db.execute(f"INSERT INTO renewal_tokens ({RENEWAL_COLUMNS}) VALUES (?, ?, ?, ?, ?)", values)


def _rotate_renewal(db: sqlite3.Connection, token_sha256: str, replacement: tuple, now: str) -> bool:
    used = db.execute(
        "DELETE FROM renewal_tokens WHERE token_sha256 = ? AND revoked_at IS NULL AND expires_at > ?",
        (token_sha256, now),
    ).rowcount
    if not used:
        return False
    _insert_renewal(db, replacement, now)
    return True


def _insert_session(db: sqlite3.Connection, values: tuple, now: str) -> None:
    db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
    db.execute(f"INSERT INTO sessions ({SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", values)


def _audit(
    db: sqlite3.Connection, note: AuditNote | None, target: str, before: dict | None, after: dict | None
) -> None:
    """The audit log's entry for a change, in the change's own transaction."""
    if note is None:
        return
    db.execute(
        "INSERT INTO audit_log (at, actor, action, target, before, after) VALUES (?, ?, ?, ?, ?, ?)",
        (_text(datetime.now(UTC)), note.actor, note.action, target, _document(before), _document(after)),
    )


def _select_spent(db: sqlite3.Connection, key_id: int) -> Decimal:
    row = db.execute("SELECT spent_usd FROM keys WHERE id = ?", (key_id,)).fetchone()
    return Decimal(row[0]) if row else Decimal(0)


def _upsert_config_keys(db: sqlite3.Connection, values: list[tuple], now: datetime) -> None:
    """The file's keys as it declares them; a key it no longer declares is revoked."""
    declared = {row[0] for row in values}
    periods = dict(db.execute("SELECT key_sha256, budget_period FROM keys WHERE from_config = 1").fetchall())
    db.executemany(
        "UPDATE keys SET revoked = 1 WHERE key_sha256 = ?",
        [  # as organizations' (above)
            (digest,)
            for (digest,) in db.execute("SELECT key_sha256 FROM keys WHERE from_config = 1").fetchall()
            if digest not in declared
        ],
    )
    db.executemany(
        """INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked,
                             max_concurrent, budget_period, organization_id, from_config, created_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT id FROM organizations WHERE name = ?), 1, ?)
           ON CONFLICT (key_sha256) DO UPDATE SET
             name = excluded.name, models = excluded.models, spend_limit_usd = excluded.spend_limit_usd,
             rpm = excluded.rpm, tpm = excluded.tpm, expires_at = excluded.expires_at,
             revoked = excluded.revoked, max_concurrent = excluded.max_concurrent,
             budget_period = excluded.budget_period, organization_id = excluded.organization_id,
             from_config = 1""",
        values,
    )
    for digest, *_, period, _organization, _created in values:  # a key the file gave another budget period
        if digest in periods and periods[digest] != period:
            (key_id,) = db.execute("SELECT id FROM keys WHERE key_sha256 = ?", (digest,)).fetchone()
            _restart_period(db, key_id, period, now)
    reservations.reconcile(db)  # a key given a spend limit: what is held counts against it


def _create_key(db: sqlite3.Connection, values: tuple, audit: AuditNote | None, now: datetime) -> KeyRecord:
    db.execute(
        "INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent,"
        " budget_period, organization_id, person_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        values,
    )
    made = _select_key(db, "k.key_sha256 = ?", values[0])
    assert made is not None  # this transaction wrote it
    _audit(db, audit, f"key:{made.id}", None, key_view(made, now))
    return made


def _update_key(
    db: sqlite3.Connection, key_id: int, fields: dict[str, Any], audit: AuditNote | None, now: datetime
) -> KeyRecord | None:
    found = _select_key(db, "k.id = ?", key_id)
    if found is None or not fields:
        return found
    merged = {f: fields.get(f, getattr(found, f)) for f in KEY_FIELDS}
    assignments = ", ".join(f"{f} = ?" for f in KEY_FIELDS)
    db.execute(
        f"UPDATE keys SET {assignments}, organization_id = ? WHERE id = ?",
        (*_key_values(*merged.values()), fields.get("organization_id", found.organization_id), found.id),
    )
    if merged["budget_period"] != found.budget_period:
        _restart_period(db, found.id, merged["budget_period"], now)
    reservations.reconcile(db)
    changed = _select_key(db, "k.id = ?", found.id)
    assert changed is not None  # this transaction wrote it
    _audit(db, audit, f"key:{found.id}", key_view(found, now), key_view(changed, now))
    return changed


def _restart_period(db: sqlite3.Connection, key_id: int, period: str | None, now: datetime) -> None:
    """A key given another budget period (or none): what the current one has spent, from the
    ledger, so that changing the period neither carries one period's spend into another nor
    forgets it."""
    if period is None:
        db.execute("UPDATE keys SET period_start = NULL, period_spent_usd = '0' WHERE id = ?", (key_id,))
        return
    start = reservations.period_starts(now)[period]
    costs = db.execute("SELECT cost_usd FROM ledger WHERE key_id = ? AND finished_at >= ?", (key_id, start))
    spent = sum((Decimal(cost) for (cost,) in costs), Decimal(0))
    db.execute("UPDATE keys SET period_start = ?, period_spent_usd = ? WHERE id = ?", (start, str(spent), key_id))


def _rotate_key(
    db: sqlite3.Connection, key_id: int, digest: str, audit: AuditNote | None, now: datetime
) -> KeyRecord | None:
    """The key's secret replaced (its digest): the old one finds no key from this commit on."""
    found = _select_key(db, "k.id = ?", key_id)
    if found is None:
        return None
    db.execute("UPDATE keys SET key_sha256 = ? WHERE id = ?", (digest, key_id))
    changed = _select_key(db, "k.id = ?", key_id)
    assert changed is not None  # this transaction wrote it
    _audit(db, audit, f"key:{key_id}", key_view(found, now), key_view(changed, now))
    return changed


def _insert_alert(db: sqlite3.Connection, values: tuple) -> bool:
    return bool(
        db.execute(
            "INSERT INTO alerts (webhook_url, subject, period, threshold, payload, created_at, next_attempt_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            values,
        ).rowcount
    )


def _lease_due_alerts(db: sqlite3.Connection, now: str, lease_until: str, too_old: str) -> tuple[list, int]:
    given_up = db.execute(
        "UPDATE alerts SET given_up_at = ? WHERE delivered_at IS NULL AND given_up_at IS NULL AND created_at < ?",
        (now, too_old),
    ).rowcount
    due = db.execute(
        "SELECT id, webhook_url, payload, attempts FROM alerts"
        " WHERE delivered_at IS NULL AND given_up_at IS NULL AND next_attempt_at <= ? ORDER BY id LIMIT 100",
        (now,),
    ).fetchall()
    db.executemany("UPDATE alerts SET next_attempt_at = ? WHERE id = ?", [(lease_until, row[0]) for row in due])
    return [AlertDelivery(row[0], row[1], bytes(row[2]), row[3]) for row in due], given_up


def _execute(db: sqlite3.Connection, statement: str, values: tuple) -> None:
    db.execute(statement, values)


def _response_rows(stored: Sequence[StoredResponse]) -> list[tuple]:
    return [
        (one.response_id, one.key_id, _text(one.created_at), _text(one.expires_at), *one.documents()) for one in stored
    ]


def _upsert_responses(db: sqlite3.Connection, rows: list[tuple]) -> None:
    """A response written again (a retried write) replaces itself; never another key's."""
    db.executemany(
        f"INSERT INTO responses ({RESPONSE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (response_id) DO UPDATE SET created_at = excluded.created_at,"
        " expires_at = excluded.expires_at, response = excluded.response, input_items = excluded.input_items,"
        " conversation = excluded.conversation WHERE responses.key_id = excluded.key_id",
        rows,
    )


def _select_response(db: sqlite3.Connection, response_id: str, key_id: int, now: str) -> StoredResponse | None:
    row = db.execute(
        f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE response_id = ? AND key_id = ? AND expires_at > ?",
        (response_id, key_id, now),
    ).fetchone()
    if row is None:
        return None
    response_id, key_id, created_at, expires_at, *documents = row
    return StoredResponse.from_documents(response_id, key_id, _time(created_at), _time(expires_at), *documents)


def _delete_response(db: sqlite3.Connection, response_id: str, key_id: int, now: str) -> bool:
    """False for one that get_response would not find either (an expired one is the sweep's)."""
    return (
        db.execute(
            "DELETE FROM responses WHERE response_id = ? AND key_id = ? AND expires_at > ?", (response_id, key_id, now)
        ).rowcount
        > 0
    )


def _delete_expired_responses(db: sqlite3.Connection, now: str) -> int:
    """Up to SWEEP_BATCH expired responses deleted in one transaction; how many. Where none has
    expired, the usual case, a read finds so and no write lock is taken from the ledger."""
    if db.execute("SELECT 1 FROM responses WHERE expires_at <= ? LIMIT 1", (now,)).fetchone() is None:
        return 0
    return _transaction(db, _delete_expired_batch, now)


def _delete_expired_batch(db: sqlite3.Connection, now: str) -> int:
    # DELETE … LIMIT needs a compile option SQLite may lack: the batch is picked by a subquery.
    return db.execute(
        "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses WHERE expires_at <= ? LIMIT ?)",
        (now, SWEEP_BATCH),
    ).rowcount


def _checkpoint(db: sqlite3.Connection, holder: sqlite3.Connection, holding: threading.Event) -> bool:
    """Copies the WAL into the file and starts it again from its beginning, in passive
    checkpoints that writers never wait for (their fsyncs included), each copying what arrived
    during the last, until one copies only a few pages. The last is made with writes held off
    (`holder` takes the write lock, and `holding` sends writes to the writer thread, which
    waits for that pass: a few pages and its fsyncs), so that it copies the whole WAL; then a
    write of nothing starts the WAL again and syncs its header, here, never on the event loop.
    False when a reader still used the WAL's end, or another checkpoint ran: the next one tries
    again."""
    frames = 0
    for _ in range(CATCH_UP_PASSES):
        _, now, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if now - frames < FEW_FRAMES:
            break
        frames = now
    holding.set()
    try:
        holder.execute("BEGIN IMMEDIATE")  # its busy timeout waits for a write under way
        try:
            busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            holder.execute("ROLLBACK")
        if busy or frames != copied:
            return False
        _transaction(db, _restart_wal)
        return True
    finally:
        holding.clear()


def _restart_wal(db: sqlite3.Connection) -> None:
    # Setting the version to itself writes the file's first page: the transaction's one frame.
    (version,) = db.execute("PRAGMA user_version").fetchone()
    db.execute(f"PRAGMA user_version = {int(version)}")


_INSERT_LEDGER = (
    f"INSERT INTO ledger ({LEDGER_COLUMNS}) VALUES ({', '.join('?' * len(LEDGER_FIELDS))})"
    " ON CONFLICT (request_id) DO NOTHING"
)


def _insert_ledger(db: sqlite3.Connection, values: list[tuple], totals: dict[int, Decimal], now: datetime) -> None:
    """The rows, and each key's spend raised by their cost. A row already
    written (the same request id) is skipped, and its cost not added again. A row's request
    gives up its reservation in the same transaction: its cost now counts as spend instead."""
    reservations.drop(db, [row[0] for row in values])
    inserted = db.executemany(_INSERT_LEDGER, values).rowcount
    if inserted == 0:
        return
    if inserted != len(values):
        # Only the rows inserted count. The one writer, this transaction gave them the rowids up
        # to the last one it inserted, one after another.
        last = db.execute("SELECT last_insert_rowid()").fetchone()[0]
        totals = {}
        for key_id, cost in db.execute(
            "SELECT key_id, cost_usd FROM ledger WHERE id > ? AND id <= ?", (last - inserted, last)
        ):
            totals[key_id] = totals.get(key_id, Decimal(0)) + Decimal(cost)
    # Each key's spend (and its current period's, if it has one), its person's (each kind of
    # period's) and its organization's, raised in the same transaction.
    by_person: dict[int, Decimal] = {}
    by_organization: dict[int, Decimal] = {}
    starts: dict[str, str] | None = None
    for key_id, cost in totals.items():
        row = db.execute(
            "SELECT spent_usd, organization_id, budget_period, period_start, period_spent_usd, person_id"
            " FROM keys WHERE id = ?",
            (key_id,),
        ).fetchone()
        if row is None:
            continue
        spent, organization_id, period, started, period_spent, person_id = row
        if person_id is not None:
            by_person[person_id] = by_person.get(person_id, Decimal(0)) + cost
        if period is None:
            db.execute("UPDATE keys SET spent_usd = ? WHERE id = ?", (str(Decimal(spent) + cost), key_id))
        else:
            start = (starts or (starts := reservations.period_starts(now)))[period]
            if still_current(started, start):  # else a new period, which starts at 0
                period_spent, start = Decimal(period_spent) + cost, started
            else:
                period_spent = cost
            db.execute(
                "UPDATE keys SET spent_usd = ?, period_start = ?, period_spent_usd = ? WHERE id = ?",
                (str(Decimal(spent) + cost), start, str(period_spent), key_id),
            )
        by_organization[organization_id] = by_organization.get(organization_id, Decimal(0)) + cost
    if by_person:
        _add_person_spend(db, by_person, starts or reservations.period_starts(now))
    for organization_id, cost in by_organization.items():
        row = db.execute("SELECT spent_usd FROM organizations WHERE id = ?", (organization_id,)).fetchone()
        if row is not None:
            db.execute(
                "UPDATE organizations SET spent_usd = ? WHERE id = ?", (str(Decimal(row[0]) + cost), organization_id)
            )


# A person's spend per kind of period, in PERIODS' order: each one's first day, then its spend.
_PERSON_SPEND = ", ".join(reservations.PERSON_PERIODS[period] for period in PERIODS)


def _add_person_spend(db: sqlite3.Connection, by_person: dict[int, Decimal], starts: dict[str, str]) -> None:
    """Each person's spend in the current day, week and month raised by `by_person`'s cost; a
    period of a kind that has begun since they last spent in one starts from that cost."""
    for person_id, cost in by_person.items():
        row = db.execute(f"SELECT {_PERSON_SPEND} FROM people WHERE id = ?", (person_id,)).fetchone()
        if row is None:
            continue
        values: list[str] = []
        for period, started, spent in zip(PERIODS, row[::2], row[1::2]):
            if still_current(started, starts[period]):
                values += (started, str(Decimal(spent) + cost))
            else:
                values += (starts[period], str(cost))
        db.execute(
            "UPDATE people SET day_start = ?, day_spent_usd = ?, week_start = ?, week_spent_usd = ?,"
            " month_start = ?, month_spent_usd = ? WHERE id = ?",
            (*values, person_id),
        )


# --- Values as the file keeps them.


@overload
def _text(moment: datetime) -> str: ...
@overload
def _text(moment: None) -> None: ...
def _text(moment: datetime | None) -> str | None:
    # Fixed-width UTC ISO text ("2026-11-30T05:52:01.123456Z") sorts, and so compares, as time does.
    if moment is None:
        return None
    if moment.tzinfo is not UTC:
        moment = moment.astimezone(UTC)
    return moment.isoformat(timespec="microseconds")[:-6] + "Z"  # less "+00:00"


@overload
def _time(text: str) -> datetime: ...
@overload
def _time(text: None) -> None: ...
def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def _key_values(name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent, budget_period) -> tuple:
    limit = None if spend_limit_usd is None else str(spend_limit_usd)
    models = orjson.dumps(list(models)).decode()
    return (name, models, limit, rpm, tpm, _text(expires_at), int(revoked), max_concurrent, budget_period)


def _money(amount: Decimal | None) -> str | None:
    return None if amount is None else str(amount)


def _document(value: dict | None) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _admin_token(row: tuple) -> AdminTokenRecord:
    token_id, name, role, digest, created_at, revoked_at = row
    return AdminTokenRecord(token_id, name, role, digest, _time(created_at), _time(revoked_at))


def _person(row: tuple) -> PersonRecord:
    person_id, subject, email, name, groups, first_seen, last_seen, disabled = row
    return PersonRecord(
        person_id,
        subject,
        email,
        name,
        tuple(orjson.loads(groups)),
        _time(first_seen),
        _time(last_seen),
        bool(disabled),
    )


def _device_grant_values(grant: DeviceGrant) -> tuple:
    times = (_text(grant.created_at), _text(grant.expires_at))
    return (*grant[:3], *times, grant.interval, grant.status, grant.person_id, _text(grant.last_polled_at))


def _device_grant(row: tuple) -> DeviceGrant:
    digest, user_code, client_id, created_at, expires_at, interval, status, person_id, last_polled_at = row
    return DeviceGrant(
        digest,
        user_code,
        client_id,
        _time(created_at),
        _time(expires_at),
        interval,
        status,
        person_id,
        _time(last_polled_at),
    )


def _renewal_values(renewal: RenewalRecord) -> tuple:
    created, expires, revoked = (_text(renewal.created_at), _text(renewal.expires_at), _text(renewal.revoked_at))
    return (renewal.token_sha256, renewal.person_id, created, expires, revoked)


def _renewal(row: tuple) -> RenewalRecord:
    digest, person_id, created_at, expires_at, revoked_at = row
    return RenewalRecord(digest, person_id, _time(created_at), _time(expires_at), _time(revoked_at))


def _audit_entry(row: tuple) -> AuditEntry:
    entry_id, at, actor, action, target, before, after = row
    return AuditEntry(
        entry_id, _time(at), actor, action, target, *(None if v is None else orjson.loads(v) for v in (before, after))
    )


def _organization(row: tuple) -> OrganizationRecord:
    org_id, name, balance, suspended, spent, from_config, keys = row
    return OrganizationRecord(
        org_id,
        name,
        None if balance is None else Decimal(balance),
        bool(suspended),
        Decimal(spent),
        bool(from_config),
        keys,
    )


def _key(row: tuple) -> KeyRecord:
    (
        key_id,
        name,
        digest,
        models,
        limit,
        rpm,
        tpm,
        expires_at,
        revoked,
        spent,
        from_config,
        max_concurrent,
        organization,
        organization_id,
        balance,
        suspended,
        budget_period,
        started,
        period_spent,
        person_id,
        person_email,
        person_groups,
        person_disabled,
        *person_spend,
    ) = row
    return KeyRecord(
        id=key_id,
        name=name,
        key_sha256=digest,
        models=tuple(orjson.loads(models)),
        spend_limit_usd=None if limit is None else Decimal(limit),
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        expires_at=_time(expires_at),
        revoked=bool(revoked),
        spent_usd=Decimal(spent),
        from_config=bool(from_config),
        organization=organization,
        organization_id=organization_id,
        organization_balance_usd=None if balance is None else Decimal(balance),
        organization_suspended=bool(suspended),
        budget_period=budget_period,
        period_start=None if started is None else date.fromisoformat(started),
        period_spent_usd=Decimal(period_spent),
        # An admin's key joins no person: NULLs.
        person_id=person_id,
        person_email=person_email or "",
        person_groups=() if person_groups is None else tuple(orjson.loads(person_groups)),
        person_disabled=bool(person_disabled),
        person_spend=_person_spend(*person_spend),
    )


def _person_spend(
    day_start: str | None,
    day_usd: str | None,
    week_start: str | None,
    week_usd: str | None,
    month_start: str | None,
    month_usd: str | None,
) -> PersonSpend:
    """A person's spend per kind of period as the file keeps it (NULLs for an admin's key)."""
    return PersonSpend(
        _date(day_start),
        Decimal(day_usd or 0),
        _date(week_start),
        Decimal(week_usd or 0),
        _date(month_start),
        Decimal(month_usd or 0),
    )


def _date(text: str | None) -> date | None:
    return None if text is None else date.fromisoformat(text)


def _ledger_values(rows: Sequence[LedgerRow]) -> list[tuple]:
    return [
        (*counts, str(cost), outcome, _text(started), _text(finished), cache_write_1h, session)
        for *counts, cost, outcome, started, finished, cache_write_1h, session in rows
    ]


def _ledger_row(values: tuple) -> LedgerRow:
    return LedgerRow._make(
        (*values[:10], Decimal(values[10]), values[11], _time(values[12]), _time(values[13]), values[14], values[15])
    )
