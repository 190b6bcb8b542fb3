"""The PostgreSQL store: one database shared by every replica. Spend is read and added in the
database itself, so a key's limit holds across replicas.

Stored responses (the Responses API's) use a small pool of their own: a burst of them never takes
the connections that the ledger and spend reservations wait for. Once a minute, at a hold (as
holds delete expired reservations) or a response's write, a replica starts a task deleting the
expired ones."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import asyncpg
import orjson

from gateway.clock import Clock, system
from gateway.config import KeyConfig, OrganizationConfig
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
    groups_text,
    key_view,
    organization_view,
    person_view,
    polled,
    take,
)
from gateway.storage.schema import (
    ADMIN_TOKEN_COLUMNS,
    AUDIT_COLUMNS,
    DEVICE_GRANT_COLUMNS,
    KEY_COLUMNS,
    KEY_FIELDS,
    KEY_TABLES,
    LEDGER_FIELDS,
    ORGANIZATION_COLUMNS,
    PERSON_COLUMNS,
    POSTGRES,
    RENEWAL_COLUMNS,
    RESPONSE_COLUMNS,
    SESSION_COLUMNS,
    SWEEP_BATCH,
    ledger_page_query,
)
from gateway.storage.unavailable import raises_unavailable
from middlewares.core.periods import PERIODS, current_starts, still_current
from middlewares.core.records import PersonSpend

log = logging.getLogger("ezat.storage")

# Any constant works: it only has to be the same for every replica migrating at once.
_MIGRATION_LOCK = 0x657A6174
# Seconds a connection may take to open, and a statement to answer, before it counts as failed:
# a server that stops answering fails requests instead of holding them (and shutdown) forever.
_TIMEOUT = 10.0
# A person's spend added in the current day, week and month ($3, $4, $5: their first days), each
# from 0 in a period of its kind begun since they last spent in one.
_ADD_PERSON_SPEND = (
    "UPDATE people SET "
    + ", ".join(
        f"{period}_spent_usd = CASE WHEN {period}_start >= ${n}::date"
        f" THEN {period}_spent_usd + $2 ELSE $2 END, {period}_start = GREATEST({period}_start, ${n}::date)"
        for n, period in enumerate(PERIODS, start=3)
    )
    + " WHERE id = $1"
)
# A person's command-line renewal tokens, all revoked (disabled, or the provider no longer vouches).
_REVOKE_RENEWALS = "UPDATE renewal_tokens SET revoked_at = now() WHERE person_id = $1 AND revoked_at IS NULL"
# Connections of the stored responses' own pool, opened as they are needed.
RESPONSES_POOL_SIZE = 4
# Seconds between a replica's sweeps of expired stored responses.
SWEEP_EVERY = 60.0
# The ledger's columns in LEDGER_FIELDS' order, as PostgreSQL types for unnest().
_LEDGER_TYPES = (
    "text",
    "bigint",
    "text",
    "text",
    "text",
    "bigint",
    "bigint",
    "bigint",
    "bigint",
    "bigint",
    "numeric",
    "text",
    "timestamptz",
    "timestamptz",
    "bigint",
    "text",
)
assert len(_LEDGER_TYPES) == len(LEDGER_FIELDS)
# Written again after a commit whose answer was lost (the ledger tries a failed batch again), a
# row that is already there is skipped, and only the rows inserted add to their key's spend.
_INSERT_LEDGER = (
    f"INSERT INTO ledger ({', '.join(LEDGER_FIELDS)}) "
    f"SELECT * FROM unnest({', '.join(f'${i}::{t}[]' for i, t in enumerate(_LEDGER_TYPES, start=1))}) "
    "ON CONFLICT (request_id) DO NOTHING RETURNING key_id, cost_usd"
)


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` means the server cannot be reached: no connection (refused, lost, closed), a
    wait or a statement timed out, or the server refusing work for now (SQLSTATE class 08, a
    connection's; 53, out of resources such as connections; 57P, starting up or shutting down).
    asyncpg's InternalClientError is what a connection that broke mid-operation raises on its
    next use ("cannot switch to state …")."""
    if isinstance(exc, OSError | asyncpg.InternalClientError) or type(exc) is asyncpg.InterfaceError:
        return True  # (not InterfaceError's subclasses: bad data, say)
    return isinstance(exc, asyncpg.PostgresError) and str(exc.sqlstate).startswith(("08", "53", "57P"))


@raises_unavailable(_unreachable)
class PostgresStore:
    def __init__(self, url: str, *, pool_size: int = 10, now: Clock = system) -> None:
        self.url = url
        self._now = now  # the gateway's clock, for budget periods
        self._pool_size = pool_size
        # Made by open(), None before it and after close(). (asyncpg is untyped: a Pool is Any.)
        self._pool: asyncpg.Pool = None
        self._responses: asyncpg.Pool = None  # stored responses' own
        self._next_sweep = 0.0  # time.monotonic() when the expired stored responses are next deleted
        self._response_sweep: asyncio.Task[None] | None = None

    async def open(self) -> None:
        # No floor of idle connections (min_size=0): asyncpg keeps one by a loop of its own that
        # logs a traceback at each try while the database is down, which the outage is not (it is
        # logged once: unavailable.py). Connections open as requests need them, and one left idle
        # for asyncpg's max_inactive_connection_lifetime (300 s) is closed: a quiet gateway holds
        # none, and its next request opens one again.
        self._pool = await asyncpg.create_pool(
            self.url, min_size=0, max_size=self._pool_size, timeout=_TIMEOUT, command_timeout=_TIMEOUT
        )
        self._responses = await asyncpg.create_pool(
            self.url, min_size=0, max_size=RESPONSES_POOL_SIZE, timeout=_TIMEOUT, command_timeout=_TIMEOUT
        )
        await self._migrate()

    async def close(self) -> None:
        if self._response_sweep is not None:
            self._response_sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._response_sweep
        for pool in (self._pool, self._responses):
            if pool is not None:
                await pool.close()
        self._pool = self._responses = None

    async def _migrate(self) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)  # one replica at a time
            await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            version = await db.fetchval("SELECT coalesce(max(version), 0) FROM schema_version")
            for number, script in enumerate(POSTGRES[version:], start=version + 1):
                await db.execute(script)
                await db.execute("INSERT INTO schema_version VALUES ($1)", number)

    async def ping(self) -> None:
        await self._pool.fetchval("SELECT 1")

    # --- keys

    async def find_key(self, key_sha256: str) -> KeyRecord | None:
        row = await self._pool.fetchrow(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.key_sha256 = $1", key_sha256)
        return _key(row) if row else None

    async def sync_config_keys(self, keys: Sequence[KeyConfig]) -> None:
        """The file's keys as it declares them; a key it no longer declares is revoked."""
        async with self._pool.acquire() as db, db.transaction():
            periods = {
                digest: (key_id, period)
                for key_id, digest, period in await db.fetch(
                    "SELECT id, key_sha256, budget_period FROM keys WHERE from_config"
                )
            }
            await db.execute(
                "UPDATE keys SET revoked = TRUE WHERE from_config AND NOT (key_sha256 = ANY($1::text[]))",
                [k.key_sha256 for k in keys],
            )
            await db.executemany(
                """INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked,
                                     max_concurrent, budget_period, organization_id, from_config)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                           (SELECT id FROM organizations WHERE name = $11), TRUE)
                   ON CONFLICT (key_sha256) DO UPDATE SET
                     name = excluded.name, models = excluded.models, spend_limit_usd = excluded.spend_limit_usd,
                     rpm = excluded.rpm, tpm = excluded.tpm, expires_at = excluded.expires_at,
                     revoked = excluded.revoked, max_concurrent = excluded.max_concurrent,
                     budget_period = excluded.budget_period, organization_id = excluded.organization_id,
                     from_config = TRUE""",
                [(k.key_sha256, *_key_values(*(getattr(k, f) for f in KEY_FIELDS)), k.organization) for k in keys],
            )
            for key in keys:  # a key the file gave another budget period
                key_id, period = periods.get(key.key_sha256, (None, key.budget_period))
                if period != key.budget_period:
                    await _restart_period(db, key_id, key.budget_period, self._now())

    async def create_key(self, key_sha256: str, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord:
        record = KeyRecord(id=0, key_sha256=key_sha256, **{"name": "", **fields})
        async with self._pool.acquire() as db, db.transaction():
            key_id = await db.fetchval(
                "INSERT INTO keys (key_sha256, name, models, spend_limit_usd, rpm, tpm, expires_at, revoked,"
                " max_concurrent, budget_period, organization_id, person_id)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING id",
                key_sha256,
                *_key_values(*(getattr(record, f) for f in KEY_FIELDS)),
                record.organization_id,
                record.person_id,
            )
            made = await _key_in(db, key_id)
            assert made is not None  # this transaction wrote it
            await _audit(db, audit, f"key:{key_id}", None, key_view(made, self._now()))
            return made

    async def list_keys(self) -> list[KeyRecord]:
        return [_key(row) for row in await self._pool.fetch(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} ORDER BY k.id")]

    async def list_person_keys(self, person_id: int) -> list[KeyRecord]:
        rows = await self._pool.fetch(
            f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.person_id = $1 ORDER BY k.id DESC", person_id
        )
        return [_key(row) for row in rows]

    async def update_key(self, key_id: int, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord | None:
        now = self._now()
        async with self._pool.acquire() as db, db.transaction():
            found = await _key_in(db, key_id, lock=True)
            if found is None or not fields:
                return found
            merged = {f: fields.get(f, getattr(found, f)) for f in KEY_FIELDS}
            assignments = ", ".join(f"{f} = ${i}" for i, f in enumerate(KEY_FIELDS, start=2))
            await db.execute(
                f"UPDATE keys SET {assignments}, organization_id = ${len(KEY_FIELDS) + 2} WHERE id = $1",
                found.id,
                *_key_values(*(merged[f] for f in KEY_FIELDS)),
                fields.get("organization_id", found.organization_id),
            )
            if merged["budget_period"] != found.budget_period:
                await _restart_period(db, key_id, merged["budget_period"], now)
            changed = await _key_in(db, key_id)
            assert changed is not None  # this transaction wrote it
            await _audit(db, audit, f"key:{key_id}", key_view(found, now), key_view(changed, now))
            return changed

    async def rotate_key(self, key_id: int, key_sha256: str, *, audit: AuditNote | None = None) -> KeyRecord | None:
        now = self._now()
        async with self._pool.acquire() as db, db.transaction():
            found = await _key_in(db, key_id, lock=True)
            if found is None:
                return None
            await db.execute("UPDATE keys SET key_sha256 = $2 WHERE id = $1", key_id, key_sha256)
            changed = await _key_in(db, key_id)
            assert changed is not None  # this transaction wrote it
            await _audit(db, audit, f"key:{key_id}", key_view(found, now), key_view(changed, now))
            return changed

    # --- organizations

    async def sync_config_organizations(self, organizations: Sequence[OrganizationConfig]) -> None:
        """The file's organizations as it declares them; one it no longer declares stays, with its
        keys and settings, but is no longer from the file (the CLI may change it)."""
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "UPDATE organizations SET from_config = FALSE WHERE from_config AND NOT (name = ANY($1::text[]))",
                [o.name for o in organizations],
            )
            await db.executemany(
                """INSERT INTO organizations (name, balance_usd, suspended, from_config) VALUES ($1, $2, $3, TRUE)
                   ON CONFLICT (name) DO UPDATE SET
                     balance_usd = excluded.balance_usd, suspended = excluded.suspended, from_config = TRUE""",
                [(o.name, o.balance_usd, o.suspended) for o in organizations],
            )

    async def create_organization(
        self,
        name: str,
        *,
        balance_usd: Decimal | None = None,
        suspended: bool = False,
        audit: AuditNote | None = None,
    ) -> OrganizationRecord | None:
        async with self._pool.acquire() as db, db.transaction():
            inserted = await db.fetchval(
                "INSERT INTO organizations (name, balance_usd, suspended) VALUES ($1, $2, $3)"
                " ON CONFLICT (name) DO NOTHING RETURNING id",
                name,
                balance_usd,
                suspended,
            )
            if inserted is None:
                return None
            made = await _organization_in(db, name)
            assert made is not None  # this transaction wrote it
            await _audit(db, audit, f"organization:{made.id}", None, organization_view(made))
            return made

    async def find_organization(self, name: str) -> OrganizationRecord | None:
        row = await self._pool.fetchrow(f"SELECT {ORGANIZATION_COLUMNS} FROM organizations o WHERE o.name = $1", name)
        return None if row is None else OrganizationRecord(*row)

    async def list_organizations(self) -> list[OrganizationRecord]:
        rows = await self._pool.fetch(f"SELECT {ORGANIZATION_COLUMNS} FROM organizations o ORDER BY o.id")
        return [OrganizationRecord(*row) for row in rows]

    async def update_organization(
        self, name: str, *, audit: AuditNote | None = None, **fields: Any
    ) -> OrganizationRecord | None:
        async with self._pool.acquire() as db, db.transaction():
            found = await _organization_in(db, name, lock=True)
            if found is None or not fields:
                return found
            await db.execute(
                "UPDATE organizations SET balance_usd = $2, suspended = $3 WHERE id = $1",
                found.id,
                fields.get("balance_usd", found.balance_usd),
                fields.get("suspended", found.suspended),
            )
            changed = await _organization_in(db, name)
            assert changed is not None  # this transaction wrote it
            await _audit(db, audit, f"organization:{found.id}", organization_view(found), organization_view(changed))
            return changed

    async def top_up_organization(
        self, name: str, amount_usd: Decimal, *, most: Decimal, audit: AuditNote | None = None
    ) -> OrganizationRecord | None:
        """The balance raised by `amount_usd`; one with no balance limit is left as it is (unaudited)."""
        async with self._pool.acquire() as db, db.transaction():
            found = await _organization_in(db, name, lock=True)
            if found is None or found.balance_usd is None:
                return found
            if found.balance_usd + amount_usd > most:
                raise PastTheCap(found.balance_usd)
            await db.execute(
                "UPDATE organizations SET balance_usd = balance_usd + $2 WHERE id = $1", found.id, amount_usd
            )
            changed = await _organization_in(db, name)
            assert changed is not None  # this transaction wrote it
            await _audit(db, audit, f"organization:{found.id}", organization_view(found), organization_view(changed))
            return changed

    # --- admin tokens and the audit log

    async def create_admin_token(
        self, name: str, role: str, token_sha256: str, *, audit: AuditNote | None = None
    ) -> AdminTokenRecord | None:
        async with self._pool.acquire() as db, db.transaction():
            row = await db.fetchrow(
                "INSERT INTO admin_tokens (name, role, token_sha256) VALUES ($1, $2, $3)"
                f" ON CONFLICT (name) DO NOTHING RETURNING {ADMIN_TOKEN_COLUMNS}",
                name,
                role,
                token_sha256,
            )
            if row is None:
                return None
            made = _admin_token(row)
            await _audit(db, audit, f"admin_token:{made.id}", None, admin_token_view(made))
            return made

    async def find_admin_token(self, token_sha256: str) -> AdminTokenRecord | None:
        row = await self._pool.fetchrow(
            f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE token_sha256 = $1", token_sha256
        )
        return None if row is None else _admin_token(row)

    async def list_admin_tokens(self) -> list[AdminTokenRecord]:
        rows = await self._pool.fetch(f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens ORDER BY id")
        return [_admin_token(row) for row in rows]

    async def revoke_admin_token(self, token_id: int, *, audit: AuditNote | None = None) -> AdminTokenRecord | None:
        """One revoked already stays as it was (unaudited)."""
        async with self._pool.acquire() as db, db.transaction():
            row = await db.fetchrow(
                f"SELECT {ADMIN_TOKEN_COLUMNS} FROM admin_tokens WHERE id = $1 FOR UPDATE", token_id
            )
            if row is None or row["revoked_at"] is not None:
                return None if row is None else _admin_token(row)
            revoked = _admin_token(
                await db.fetchrow(
                    f"UPDATE admin_tokens SET revoked_at = now() WHERE id = $1 RETURNING {ADMIN_TOKEN_COLUMNS}",
                    token_id,
                )
            )
            await db.execute(
                "DELETE FROM sessions WHERE kind = $1 AND subject = $2", ADMIN_TOKEN_SESSION, row["token_sha256"]
            )
            before = admin_token_view(_admin_token(row))
            await _audit(db, audit, f"admin_token:{token_id}", before, admin_token_view(revoked))
            return revoked

    # --- people

    async def person_signed_in(self, subject: str, email: str, name: str, groups: Sequence[str]) -> PersonRecord:
        # One statement: replicas signing the same person in at once meet at the row's unique
        # subject, and the second updates what the first inserted. Last seen never goes back (a
        # replica whose clock is behind signing them in after another).
        row = await self._pool.fetchrow(
            "INSERT INTO people (subject, email, name, groups, first_seen, last_seen) VALUES ($1, $2, $3, $4, $5, $5)"
            " ON CONFLICT (subject) DO UPDATE SET email = excluded.email, name = excluded.name,"
            " groups = excluded.groups, last_seen = GREATEST(people.last_seen, excluded.last_seen)"
            f" RETURNING {PERSON_COLUMNS}",
            subject,
            email,
            name,
            groups_text(groups),
            self._now(),
        )
        return _person(row)

    async def find_person(self, person_id: int) -> PersonRecord | None:
        row = await self._pool.fetchrow(f"SELECT {PERSON_COLUMNS} FROM people WHERE id = $1", person_id)
        return None if row is None else _person(row)

    async def find_person_by_subject(self, subject: str) -> PersonRecord | None:
        row = await self._pool.fetchrow(f"SELECT {PERSON_COLUMNS} FROM people WHERE subject = $1", subject)
        return None if row is None else _person(row)

    async def person_provider_token(self, person_id: int) -> str | None:
        token: str | None = await self._pool.fetchval("SELECT provider_token FROM people WHERE id = $1", person_id)
        return token

    async def set_person_provider_token(self, person_id: int, sealed: str | None) -> None:
        await self._pool.execute("UPDATE people SET provider_token = $2 WHERE id = $1", person_id, sealed)

    async def end_provider_trust(self, person_id: int) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("UPDATE people SET provider_token = NULL WHERE id = $1", person_id)
            await db.execute(_REVOKE_RENEWALS, person_id)

    async def list_people(self, *, limit: int, after: int | None = None) -> list[PersonRecord]:
        rows = await self._pool.fetch(
            f"SELECT {PERSON_COLUMNS} FROM people WHERE id > $1 ORDER BY id LIMIT $2",
            after if after is not None else 0,
            limit,
        )
        return [_person(row) for row in rows]

    async def set_person_disabled(
        self, person_id: int, disabled: bool, *, audit: AuditNote | None = None
    ) -> PersonRecord | None:
        """One disabled (or enabled) already stays as it was (unaudited)."""
        async with self._pool.acquire() as db, db.transaction():
            row = await db.fetchrow(f"SELECT {PERSON_COLUMNS} FROM people WHERE id = $1 FOR UPDATE", person_id)
            if row is None or row["disabled"] == disabled:
                return None if row is None else _person(row)
            changed = _person(
                await db.fetchrow(
                    f"UPDATE people SET disabled = $2 WHERE id = $1 RETURNING {PERSON_COLUMNS}", person_id, disabled
                )
            )
            if disabled:  # their command line's renewals end with their access
                await db.execute(_REVOKE_RENEWALS, person_id)
            await _audit(db, audit, f"person:{person_id}", person_view(_person(row)), person_view(changed))
            return changed

    # --- the console's sessions

    async def create_session(self, session: SessionRecord) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("DELETE FROM sessions WHERE expires_at <= now()")
            await db.execute(f"INSERT INTO sessions ({SESSION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)", *session)

    async def find_session(self, id_sha256: str) -> SessionRecord | None:
        row = await self._pool.fetchrow(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id_sha256 = $1 AND expires_at > now()", id_sha256
        )
        return None if row is None else SessionRecord(*row[:4], *(moment.astimezone(UTC) for moment in row[4:]))

    async def delete_session(self, id_sha256: str) -> None:
        await self._pool.execute("DELETE FROM sessions WHERE id_sha256 = $1", id_sha256)

    # --- `ezat-gateway login`: device grants and renewal tokens

    async def create_device_grant(self, grant: DeviceGrant) -> bool:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "DELETE FROM device_grants WHERE expires_at <= now() - $1::interval"
                " OR (user_code = $2 AND expires_at <= now())",
                EXPIRED_GRANTS_KEPT,
                grant.user_code,
            )
            inserted = await db.fetchval(
                f"INSERT INTO device_grants ({DEVICE_GRANT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
                " ON CONFLICT DO NOTHING RETURNING 1",
                *grant,
            )
            return inserted is not None

    async def find_device_grant(self, user_code: str) -> DeviceGrant | None:
        row = await self._pool.fetchrow(
            f"SELECT {DEVICE_GRANT_COLUMNS} FROM device_grants WHERE user_code = $1", user_code
        )
        return None if row is None else _device_grant(row)

    async def decide_device_grant(self, user_code: str, person_id: int, approved: bool) -> DeviceGrant | None:
        row = await self._pool.fetchrow(
            "UPDATE device_grants SET status = $3, person_id = $2 WHERE user_code = $1 AND status = $4"
            f" AND expires_at > now() RETURNING {DEVICE_GRANT_COLUMNS}",
            user_code,
            person_id,
            DEVICE_APPROVED if approved else DEVICE_DENIED,
            DEVICE_PENDING,
        )
        return None if row is None else _device_grant(row)

    async def poll_device_grant(self, device_sha256: str) -> tuple[DeviceGrant, str] | None:
        async with self._pool.acquire() as db, db.transaction():
            # The row locked: of two polls at once, the second reads what the first wrote.
            row = await db.fetchrow(
                f"SELECT {DEVICE_GRANT_COLUMNS}, now() AS now FROM device_grants WHERE device_sha256 = $1 FOR UPDATE",
                device_sha256,
            )
            if row is None:
                return None
            after, found = polled(_device_grant(row), row["now"].astimezone(UTC))
            await db.execute(
                "UPDATE device_grants SET status = $2, interval_seconds = $3, last_polled_at = $4"
                " WHERE device_sha256 = $1",
                device_sha256,
                after.status,
                after.interval,
                after.last_polled_at,
            )
            return after, found

    async def create_renewal(self, renewal: RenewalRecord) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("DELETE FROM renewal_tokens WHERE expires_at <= now()")
            await db.execute(f"INSERT INTO renewal_tokens ({RENEWAL_COLUMNS}) VALUES ($1, $2, $3, $4, $5)", *renewal)

    async def find_renewal(self, token_sha256: str) -> RenewalRecord | None:
        row = await self._pool.fetchrow(
            f"SELECT {RENEWAL_COLUMNS} FROM renewal_tokens WHERE token_sha256 = $1", token_sha256
        )
        if row is None:
            return None
        revoked = row["revoked_at"]
        return RenewalRecord(
            row["token_sha256"],
            row["person_id"],
            row["created_at"].astimezone(UTC),
            row["expires_at"].astimezone(UTC),
            None if revoked is None else revoked.astimezone(UTC),
        )

    async def rotate_renewal(self, token_sha256: str, replacement: RenewalRecord) -> bool:
        async with self._pool.acquire() as db, db.transaction():
            used = await db.execute(
                "DELETE FROM renewal_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL AND expires_at > now()",
                token_sha256,
            )
            if used == "DELETE 0":  # a renewal at the same time used it first, or it was revoked
                return False
            await db.execute("DELETE FROM renewal_tokens WHERE expires_at <= now()")
            await db.execute(
                f"INSERT INTO renewal_tokens ({RENEWAL_COLUMNS}) VALUES ($1, $2, $3, $4, $5)", *replacement
            )
            return True

    async def audit_log(self, *, limit: int = 100, before: int | None = None) -> list[AuditEntry]:
        rows = await self._pool.fetch(
            f"SELECT {AUDIT_COLUMNS} FROM audit_log WHERE id < $1 ORDER BY id DESC LIMIT $2",
            before if before is not None else 2**63 - 1,
            limit,
        )
        return [
            AuditEntry(
                row["id"],
                row["at"].astimezone(UTC),
                row["actor"],
                row["action"],
                row["target"],
                *(None if row[c] is None else orjson.loads(row[c]) for c in ("before", "after")),
            )
            for row in rows
        ]

    async def organizations_reserved(self) -> dict[int, Decimal]:
        rows = await self._pool.fetch(
            "SELECT organization_id, sum(amount_usd) FROM reservations WHERE expires_at > now() GROUP BY organization_id"
        )
        return {organization_id: amount for organization_id, amount in rows}

    # --- spend and ledger

    async def spent(self, key_id: int) -> Decimal:
        value = await self._pool.fetchval("SELECT spent_usd FROM keys WHERE id = $1", key_id)
        return Decimal(0) if value is None else value

    async def hold(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None]:
        self._sweep_responses_when_due()
        async with self._pool.acquire(timeout=_TIMEOUT) as db, db.transaction():
            if not holds:
                await db.execute("DELETE FROM reservations WHERE request_id = ANY($1::text[])", list(releases))
                return []
            keys = sorted({hold.key_id for hold in holds if hold.limit is not None})
            people = sorted({hold.person for hold in holds if hold.person is not None})
            organizations = sorted({hold.organization_id for hold in holds if hold.balance is not None})
            # The row locks of the keys with limits, then of the people with budgets, then of the
            # organizations with balances, then reservations: each in the order the ledger's
            # writes take them (and each table's rows in id order), so no two replicas wait on
            # each other in a cycle. They serialise reservations and ledger writes across
            # replicas; the statements after them see what committed before they were granted.
            # NO KEY UPDATE: foreign keys (the ledger's to keys, keys' to people) take KEY SHARE
            # locks, which FOR UPDATE would conflict with.
            now = self._now()
            starts = current_starts(now)
            spent = {
                key_id: _counted(spent, period, started, period_spent, starts)
                for key_id, spent, period, started, period_spent in await db.fetch(
                    "SELECT id, spent_usd, budget_period, period_start, period_spent_usd FROM keys"
                    " WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
                    keys,
                )
            }
            # Only a person's key with a budget names them: the others' holds pay no round trip for it.
            person_spent = {
                row["id"]: _person_spend(row)
                for row in (
                    await db.fetch(
                        f"SELECT id, {_PERSON_SPEND} FROM people WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
                        people,
                    )
                    if people
                    else ()
                )
            }
            org_spent = dict(
                await db.fetch(
                    "SELECT id, spent_usd FROM organizations WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
                    organizations,
                )
            )
            if releases:
                await db.execute("DELETE FROM reservations WHERE request_id = ANY($1::text[])", list(releases))
            await db.execute(
                "DELETE FROM reservations WHERE (key_id = ANY($1) OR organization_id = ANY($2) OR person_id = ANY($3))"
                " AND expires_at <= now()",
                keys,
                organizations,
                people,
            )
            held = dict(
                await db.fetch(
                    "SELECT key_id, sum(amount_usd) FROM reservations WHERE key_id = ANY($1) GROUP BY key_id", keys
                )
            )
            person_held = dict(
                await db.fetch(
                    "SELECT person_id, sum(amount_usd) FROM reservations WHERE person_id = ANY($1) GROUP BY person_id",
                    people,
                )
                if people
                else ()
            )
            org_held = dict(
                await db.fetch(
                    "SELECT organization_id, sum(amount_usd) FROM reservations WHERE organization_id = ANY($1)"
                    " GROUP BY organization_id",
                    organizations,
                )
            )
            zero = Decimal(0)
            results = take(
                holds,
                lambda h: h.limit - spent.get(h.key_id, zero) - held.get(h.key_id, zero),
                lambda h: (
                    h.person_budget
                    - person_spent.get(h.person_id, PersonSpend()).in_period(h.person_period, now)
                    - person_held.get(h.person_id, zero)
                ),
                lambda h: h.balance - org_spent.get(h.organization_id, zero) - org_held.get(h.organization_id, zero),
            )
            taken = [hold for hold, refused in zip(holds, results) if refused is None]
            if taken:
                # A reservation names its person only where their budget counts it.
                await db.execute(
                    "INSERT INTO reservations (request_id, key_id, amount_usd, expires_at, organization_id, person_id)"
                    " SELECT r, k, a, now() + make_interval(secs => t), o, p FROM unnest($1::text[], $2::bigint[],"
                    " $3::numeric[], $4::float8[], $5::bigint[], $6::bigint[]) AS h(r, k, a, t, o, p) "
                    "ON CONFLICT (request_id) DO UPDATE SET amount_usd = excluded.amount_usd, expires_at = excluded.expires_at,"
                    " organization_id = excluded.organization_id, person_id = excluded.person_id",
                    *(
                        list(column)
                        for column in zip(
                            *((h.request_id, h.key_id, h.amount, h.ttl, h.organization_id, h.person) for h in taken)
                        )
                    ),
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
            inserted = await db.fetch(_INSERT_LEDGER, *(list(column) for column in zip(*rows)))
            spend: dict[int, Decimal] = {}
            for key_id, cost in inserted:
                spend[key_id] = spend.get(key_id, Decimal(0)) + cost
            # In key order, then organization order, as hold() locks them, so two replicas'
            # transactions never wait on each other's locks in a cycle. A key with a budget
            # period: its period's spend too, from 0 in a new period.
            starts = current_starts(self._now())
            await db.executemany(
                "UPDATE keys SET spent_usd = spent_usd + $2,"
                " period_spent_usd = CASE WHEN budget_period IS NULL THEN period_spent_usd"
                f" WHEN period_start >= {_CURRENT_START} THEN period_spent_usd + $2 ELSE $2 END,"
                # A period a replica whose clock is ahead began already is this one: never back.
                f" period_start = CASE WHEN budget_period IS NULL THEN NULL"
                f" ELSE GREATEST(period_start, {_CURRENT_START}) END"
                " WHERE id = $1",
                [
                    (key_id, cost, starts["day"], starts["week"], starts["month"])
                    for key_id, cost in sorted(spend.items())
                ],
            )
            if spend:
                by_person: dict[int, Decimal] = {}
                by_organization: dict[int, Decimal] = {}
                for key_id, organization_id, person_id in await db.fetch(
                    "SELECT id, organization_id, person_id FROM keys WHERE id = ANY($1)", list(spend)
                ):
                    if person_id is not None:
                        by_person[person_id] = by_person.get(person_id, Decimal(0)) + spend[key_id]
                    by_organization[organization_id] = by_organization.get(organization_id, Decimal(0)) + spend[key_id]
                # Each person's spend in the current day, week and month (whatever their policy's
                # period, which may change), from 0 in a period of a kind begun since they last
                # spent in one; after keys, before organizations, as hold() locks them.
                if by_person:
                    await db.executemany(
                        _ADD_PERSON_SPEND,
                        [
                            (person_id, cost, starts["day"], starts["week"], starts["month"])
                            for person_id, cost in sorted(by_person.items())
                        ],
                    )
                await db.executemany(
                    "UPDATE organizations SET spent_usd = spent_usd + $2 WHERE id = $1", sorted(by_organization.items())
                )
            # A row's request gives up its reservation as its cost becomes spend, in one commit;
            # last, as hold() takes reservations after keys and organizations.
            await db.execute("DELETE FROM reservations WHERE request_id = ANY($1::text[])", [row[0] for row in rows])

    # --- alerts

    async def keys_by_id(self, key_ids: Sequence[int]) -> list[KeyRecord]:
        rows = await self._pool.fetch(f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.id = ANY($1)", list(key_ids))
        return [_key(row) for row in rows]

    async def claim_alert(self, alert: Alert) -> bool:
        status = await self._pool.execute(
            "INSERT INTO alerts (webhook_url, subject, period, threshold, payload) VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT DO NOTHING",
            *alert,
        )
        return status == "INSERT 0 1"

    async def due_alerts(self, lease_seconds: float, give_up_after: float) -> tuple[list[AlertDelivery], int]:
        async with self._pool.acquire(timeout=_TIMEOUT) as db, db.transaction():
            status = await db.execute(
                "UPDATE alerts SET given_up_at = now() WHERE delivered_at IS NULL AND given_up_at IS NULL"
                " AND created_at < now() - make_interval(secs => $1)",
                give_up_after,
            )
            # SKIP LOCKED: replicas polling at once each lease different alerts, never the same.
            rows = await db.fetch(
                "UPDATE alerts SET next_attempt_at = now() + make_interval(secs => $1) WHERE id IN ("
                " SELECT id FROM alerts WHERE delivered_at IS NULL AND given_up_at IS NULL AND next_attempt_at <= now()"
                " ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING id, webhook_url, payload, attempts",
                lease_seconds,
            )
        deliveries = sorted(AlertDelivery(*row) for row in rows)
        return deliveries, int(status.split()[-1])

    async def alert_sent(self, alert_id: int) -> None:
        await self._pool.execute(
            "UPDATE alerts SET delivered_at = now(), attempts = attempts + 1, last_error = NULL WHERE id = $1", alert_id
        )

    async def alert_failed(self, alert_id: int, retry_in: float, error: str) -> None:
        await self._pool.execute(
            "UPDATE alerts SET attempts = attempts + 1, next_attempt_at = now() + make_interval(secs => $2),"
            " last_error = $3 WHERE id = $1",
            alert_id,
            retry_in,
            error,
        )

    # --- stored responses

    def put_responses_now(self, stored: Sequence[StoredResponse]) -> bool:
        return False  # every write waits for the server

    async def put_responses(self, stored: Sequence[StoredResponse]) -> None:
        # A response written again (a retried write) replaces itself; never another key's.
        # (executemany runs in one transaction.)
        await self._responses.executemany(
            f"INSERT INTO responses ({RESPONSE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            " ON CONFLICT (response_id) DO UPDATE SET created_at = excluded.created_at,"
            " expires_at = excluded.expires_at, response = excluded.response, input_items = excluded.input_items,"
            " conversation = excluded.conversation WHERE responses.key_id = excluded.key_id",
            [(one.response_id, one.key_id, one.created_at, one.expires_at, *one.documents()) for one in stored],
        )
        self._sweep_responses_when_due()  # keys with no spend limit never hold: their responses expire too

    async def get_response(self, response_id: str, key_id: int) -> StoredResponse | None:
        row = await self._responses.fetchrow(
            f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE response_id = $1 AND key_id = $2 AND expires_at > now()",
            response_id,
            key_id,
        )
        if row is None:
            return None
        response_id, key_id, created_at, expires_at, *documents = row
        return StoredResponse.from_documents(
            response_id, key_id, created_at.astimezone(UTC), expires_at.astimezone(UTC), *documents
        )

    async def delete_response(self, response_id: str, key_id: int) -> bool:
        # False for one that get_response would not find either (an expired one is the sweep's).
        status = await self._responses.execute(
            "DELETE FROM responses WHERE response_id = $1 AND key_id = $2 AND expires_at > now()", response_id, key_id
        )
        return status != "DELETE 0"

    def _sweep_responses_when_due(self) -> None:
        """At most once every SWEEP_EVERY seconds (at a hold or a response's write), a task deletes
        the expired responses; nothing waits for it."""
        if time.monotonic() < self._next_sweep:
            return
        if self._response_sweep is None or self._response_sweep.done():
            self._next_sweep = time.monotonic() + SWEEP_EVERY
            self._response_sweep = asyncio.create_task(self._sweep_responses(), context=contextvars.Context())

    async def _sweep_responses(self) -> None:
        """Deletes the expired responses, SWEEP_BATCH to a transaction; rows another replica's
        sweep is deleting are skipped, not waited for. The next sweep tries again after a failure."""
        try:
            while True:
                status = await self._responses.execute(
                    "DELETE FROM responses WHERE response_id IN (SELECT response_id FROM responses"
                    " WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)",
                    SWEEP_BATCH,
                )
                if int(status.split()[-1]) < SWEEP_BATCH:
                    return
        except Exception as exc:
            log.warning("deleting expired stored responses failed: %r", exc)

    def write_ledger_now(self, rows: Sequence[LedgerRow]) -> bool:
        return False  # every write is a round trip to the server

    def hold_now(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None] | None:
        return None  # every write is a round trip to the server

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
        query, params = ledger_page_query(lambda n: f"${n}", (key_id, since, until, after), limit)
        rows = await self._pool.fetch(query, *params)
        return [(row[0], LedgerRow(*tuple(row)[1:])) for row in rows]


async def _key_in(db, key_id: int, *, lock: bool = False) -> KeyRecord | None:
    """The key, read in `db`'s transaction; `lock`: its row locked until the transaction ends
    (NO KEY UPDATE, as hold() locks it)."""
    query = f"SELECT {KEY_COLUMNS} FROM {KEY_TABLES} WHERE k.id = $1"
    row = await db.fetchrow(query + (" FOR NO KEY UPDATE OF k" if lock else ""), key_id)
    return None if row is None else _key(row)


async def _organization_in(db, name: str, *, lock: bool = False) -> OrganizationRecord | None:
    query = f"SELECT {ORGANIZATION_COLUMNS} FROM organizations o WHERE o.name = $1"
    row = await db.fetchrow(query + (" FOR NO KEY UPDATE OF o" if lock else ""), name)
    return None if row is None else OrganizationRecord(*row)


async def _audit(db, note: AuditNote | None, target: str, before: dict | None, after: dict | None) -> None:
    """The audit log's entry for a change, in the change's own transaction."""
    if note is None:
        return
    await db.execute(
        "INSERT INTO audit_log (actor, action, target, before, after) VALUES ($1, $2, $3, $4, $5)",
        note.actor,
        note.action,
        target,
        *(None if value is None else orjson.dumps(value).decode() for value in (before, after)),
    )


def _admin_token(row) -> AdminTokenRecord:
    return AdminTokenRecord(
        row["id"],
        row["name"],
        row["role"],
        row["token_sha256"],
        row["created_at"].astimezone(UTC),
        row["revoked_at"].astimezone(UTC) if row["revoked_at"] else None,
    )


def _person(row) -> PersonRecord:
    return PersonRecord(
        row["id"],
        row["subject"],
        row["email"],
        row["name"],
        tuple(orjson.loads(row["groups"])),
        row["first_seen"].astimezone(UTC),
        row["last_seen"].astimezone(UTC),
        row["disabled"],
    )


def _device_grant(row) -> DeviceGrant:
    polled_at = row["last_polled_at"]
    return DeviceGrant(
        row["device_sha256"],
        row["user_code"],
        row["client_id"],
        row["created_at"].astimezone(UTC),
        row["expires_at"].astimezone(UTC),
        row["interval_seconds"],
        row["status"],
        row["person_id"],
        None if polled_at is None else polled_at.astimezone(UTC),
    )


# A key's current budget period's first day, of $3, $4 and $5 (the day's, week's and month's).
_CURRENT_START = "(CASE budget_period WHEN 'day' THEN $3::date WHEN 'week' THEN $4::date ELSE $5::date END)"


async def _restart_period(db, key_id: int, period: str | None, now: datetime) -> None:
    """A key given another budget period (or none): what the current one has spent, from the
    ledger, so that changing the period neither carries one period's spend into another nor
    forgets it."""
    if period is None:
        await db.execute("UPDATE keys SET period_start = NULL, period_spent_usd = 0 WHERE id = $1", key_id)
        return
    start = current_starts(now)[period]
    await db.execute(
        "UPDATE keys SET period_start = $2::date, period_spent_usd = (SELECT coalesce(sum(cost_usd), 0) FROM ledger"
        " WHERE key_id = $1 AND finished_at >= $2::date::timestamp AT TIME ZONE 'UTC') WHERE id = $1",
        key_id,
        start,
    )


# A person's spend per kind of period, in PERIODS' order: each one's first day, then its spend.
_PERSON_SPEND = ", ".join(f"{period}_start, {period}_spent_usd" for period in PERIODS)


def _person_spend(row, prefix: str = "") -> PersonSpend:
    """A person's spend per kind of period, from a row with their _PERSON_SPEND columns, each
    named with `prefix` (KEY_COLUMNS' are "person_"; NULLs for an admin's key)."""

    def spent(period: str) -> Decimal:
        return row[f"{prefix}{period}_spent_usd"] or Decimal(0)

    return PersonSpend(
        day_start=row[f"{prefix}day_start"],
        day_usd=spent("day"),
        week_start=row[f"{prefix}week_start"],
        week_usd=spent("week"),
        month_start=row[f"{prefix}month_start"],
        month_usd=spent("month"),
    )


def _counted(spent: Decimal, period: str | None, started: date | None, period_spent: Decimal, starts) -> Decimal:
    """What counts against a key's spend limit: its whole spend, or its current period's."""
    if period is None:
        return spent
    return period_spent if still_current(started, starts[period]) else Decimal(0)


def _key_values(name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent, budget_period) -> tuple:
    models = orjson.dumps(list(models)).decode()
    return (name, models, spend_limit_usd, rpm, tpm, expires_at, revoked, max_concurrent, budget_period)


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
        expires_at=row["expires_at"].astimezone(UTC) if row["expires_at"] else None,
        revoked=row["revoked"],
        spent_usd=row["spent_usd"],
        from_config=row["from_config"],
        organization=row["organization"],
        organization_id=row["organization_id"],
        organization_balance_usd=row["organization_balance_usd"],
        organization_suspended=row["organization_suspended"],
        budget_period=row["budget_period"],
        period_start=row["period_start"],
        period_spent_usd=row["period_spent_usd"],
        # An admin's key joins no person: NULLs.
        person_id=row["person_id"],
        person_email=row["person_email"] or "",
        person_groups=() if row["person_groups"] is None else tuple(orjson.loads(row["person_groups"])),
        person_disabled=bool(row["person_disabled"]),
        person_spend=_person_spend(row, "person_"),
    )
