"""Spend reservations in the SQLite store: what each request under way holds of its key's limit,
its person's budget and its organization's balance, and those holds totalled on the key's, the
person's and the organization's row, so that a hold reads one row however many requests are
under way. Totals are in whole billionths of a dollar (SQLite adds integers exactly, decimals
not), each reservation's rounded up, so they never hold back less than the reservations do.
Each function runs inside its caller's write transaction, which serialises every process's
reservations."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import ROUND_CEILING, Decimal

from gateway.storage.records import Hold, Shortfall, take
from middlewares.core.periods import PERIODS, current_starts, still_current

log = logging.getLogger("ezat.storage")

_INSERT = (
    "INSERT INTO reservations (request_id, key_id, amount_usd, amount_nano_usd, expires_at, organization_id,"
    " person_id) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING"
)
# A person's columns for the last period of each kind they spent in: its first day, its spend.
PERSON_PERIODS = {period: f"{period}_start, {period}_spent_usd" for period in PERIODS}


def hold(
    db: sqlite3.Connection,
    holds: Sequence[Hold],
    releases: Sequence[str],
    expires_at: dict[float, str],
    sweep_at: str | None,
    now: datetime,
) -> list[Shortfall | None]:
    """`releases` given back, then each hold taken where what is left allows it (records.take).
    `expires_at`: each hold's ttl → its expiry, as the file keeps times; `sweep_at`: the time
    now, to sweep first (see sweep), or None; `now`, the gateway's, for budget periods."""
    drop(db, releases)
    if sweep_at is not None:
        sweep(db, sweep_at)
    starts = period_starts(now)

    def key_left(hold: Hold) -> Decimal:
        assert hold.limit is not None  # take() asks only of a hold with a limit
        row = db.execute(
            "SELECT spent_usd, reserved_nano_usd, budget_period, period_start, period_spent_usd FROM keys WHERE id = ?",
            (hold.key_id,),
        ).fetchone()
        if row is None:
            return hold.limit
        spent, reserved, period, started, period_spent = row
        if period is not None:  # the current period's spend counts, not the key's whole
            spent = period_spent if still_current(started, starts[period]) else 0
        return hold.limit - Decimal(spent) - _usd(reserved)

    def person_left(hold: Hold) -> Decimal:
        assert hold.person_budget is not None  # take() asks only of a hold with a person budget
        period = hold.person_period
        row = db.execute(
            f"SELECT {PERSON_PERIODS[period]}, reserved_nano_usd FROM people WHERE id = ?", (hold.person_id,)
        ).fetchone()
        if row is None:
            return hold.person_budget
        started, spent, reserved = row
        spent = spent if still_current(started, starts[period]) else 0  # the current period's spend counts
        return hold.person_budget - Decimal(spent) - _usd(reserved)

    def organization_left(hold: Hold) -> Decimal:
        assert hold.balance is not None  # take() asks only of a hold with a balance
        row = db.execute(
            "SELECT spent_usd, reserved_nano_usd FROM organizations WHERE id = ?", (hold.organization_id,)
        ).fetchone()
        return hold.balance - Decimal(row[0]) - _usd(row[1]) if row else hold.balance

    results = take(holds, key_left, person_left, organization_left)
    by_key: dict[int, int] = {}
    by_person: dict[int, int] = {}
    by_organization: dict[int, int] = {}
    for taken, refused in zip(holds, results):
        if refused is not None:
            continue
        nano_usd = _nano_usd(taken.amount)
        person = taken.person  # a reservation names its person only where their budget counts it
        values = (
            taken.request_id,
            taken.key_id,
            str(taken.amount),
            nano_usd,
            expires_at[taken.ttl],
            taken.organization_id,
            person,
        )
        if db.execute(_INSERT, values).rowcount:  # a request already holding keeps its reservation, counted once
            by_key[taken.key_id] = by_key.get(taken.key_id, 0) + nano_usd
            if person is not None:
                by_person[person] = by_person.get(person, 0) + nano_usd
            by_organization[taken.organization_id] = by_organization.get(taken.organization_id, 0) + nano_usd
    _add(db, by_key, by_person, by_organization)
    return results


def period_starts(now: datetime) -> dict[str, str]:
    """Each budget period's one at `now`, by its first day as the file keeps it."""
    return {period: start.isoformat() for period, start in current_starts(now).items()}


def drop(db: sqlite3.Connection, request_ids: Iterable[str]) -> None:
    """These requests' reservations, where they have one, gone and taken off their key's,
    person's and organization's totals. (A select, then a delete: DELETE … RETURNING needs
    SQLite 3.35.)"""
    by_key: dict[int, int] = {}
    by_person: dict[int, int] = {}
    by_organization: dict[int, int] = {}
    for request_id in request_ids:
        row = db.execute(
            "SELECT key_id, organization_id, person_id, amount_nano_usd FROM reservations WHERE request_id = ?",
            (request_id,),
        ).fetchone()
        if row is not None:
            db.execute("DELETE FROM reservations WHERE request_id = ?", (request_id,))
            key_id, organization_id, person_id, nano_usd = row
            by_key[key_id] = by_key.get(key_id, 0) - nano_usd
            if person_id is not None:
                by_person[person_id] = by_person.get(person_id, 0) - nano_usd
            by_organization[organization_id] = by_organization.get(organization_id, 0) - nano_usd
    _add(db, by_key, by_person, by_organization)


def sweep(db: sqlite3.Connection, now: str) -> None:
    """Drops the reservations that expired before `now` (a process that died held them), then
    reconciles the totals, with a warning if one was wrong (a process of an older version on
    the file, say, kept none): scans of every reservation and key, for now and then."""
    drop(
        db,
        [rid for (rid,) in db.execute("SELECT request_id FROM reservations WHERE expires_at <= ?", (now,)).fetchall()],
    )
    wrong = reconcile(db)
    if wrong:
        log.warning(
            "what requests under way hold did not add up to their reservations for %d keys, people or organizations;"
            " corrected",
            wrong,
        )


def reconcile(db: sqlite3.Connection) -> int:
    """Sets each total that holds read (a key's with a spend limit, a person's, an
    organization's with a balance) to its reservations' sum where it differs; returns how many
    did. For the sweep, and for keys and organizations that may have just been given a limit or
    a balance. (A person's budget is their policy's, which the store does not know: every
    person's total is kept, of the reservations that name them.)"""
    wrong = 0
    for table, column, limit in (
        ("keys", "key_id", "spend_limit_usd IS NOT NULL"),
        ("people", "person_id", "1"),
        ("organizations", "organization_id", "balance_usd IS NOT NULL"),
    ):
        summed = dict(
            db.execute(
                f"SELECT {column}, sum(amount_nano_usd) FROM reservations WHERE {column} IS NOT NULL GROUP BY {column}"
            )
        )
        kept = db.execute(f"SELECT id, reserved_nano_usd FROM {table} WHERE {limit}").fetchall()
        updates = [(summed.get(owner, 0), owner) for owner, total in kept if total != summed.get(owner, 0)]
        db.executemany(f"UPDATE {table} SET reserved_nano_usd = ? WHERE id = ?", updates)
        wrong += len(updates)
    return wrong


def _add(
    db: sqlite3.Connection, by_key: dict[int, int], by_person: dict[int, int], by_organization: dict[int, int]
) -> None:
    # Kept only where holds read them, for a key with a spend limit, a person whose holds name
    # them (those with a budget) and an organization with a balance: no other row is written (a
    # page less to commit). reconcile() sets the total of one given a limit or a balance.
    db.executemany(
        "UPDATE keys SET reserved_nano_usd = reserved_nano_usd + ? WHERE id = ? AND spend_limit_usd IS NOT NULL",
        [(nano_usd, key_id) for key_id, nano_usd in by_key.items()],
    )
    db.executemany(
        "UPDATE people SET reserved_nano_usd = reserved_nano_usd + ? WHERE id = ?",
        [(nano_usd, person_id) for person_id, nano_usd in by_person.items()],
    )
    db.executemany(
        "UPDATE organizations SET reserved_nano_usd = reserved_nano_usd + ? WHERE id = ? AND balance_usd IS NOT NULL",
        [(nano_usd, organization_id) for organization_id, nano_usd in by_organization.items()],
    )


def _nano_usd(amount: Decimal) -> int:
    """Billionths of a dollar, rounded up."""
    return int(amount.scaleb(9).to_integral_value(rounding=ROUND_CEILING))


def _usd(nano_usd: int) -> Decimal:
    return Decimal(nano_usd).scaleb(-9)
