"""The usage report: the ledger's rows added up by day, model, deployment, key, organization,
person or session. One computation for the CLI (`ezat-gateway usage`), the admin API (`GET
/admin/v1/usage`) and the console's figures, so that none can disagree with another on a number."""

from __future__ import annotations

import csv
import io
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

import orjson

from gateway.accounting.money import usd_exact, usd_text
from gateway.storage import LedgerRow, Store

# The requests, then the ledger's columns of the same names, added up.
USAGE_COLUMNS = [
    "requests",
    "input_tokens",
    "cache_write_tokens",
    "cache_write_1h_tokens",
    "cache_read_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cost_usd",
]
USAGE_GROUPS = ("day", "model", "deployment", "key", "org", "organization", "person", "session")
NO_SESSION = "(no session)"  # the group of requests that named no conversation, in a table
NO_PERSON = "(no person)"  # the group of requests made with an admin's keys, which belong to nobody


def usage_groups(rows: list[LedgerRow], key_names: dict[int, str], *, by: str) -> list[dict[str, Any]]:
    """The rows added up by `by` (its name the group's column: "org" and "organization" group
    alike), in the group's order, each a dict of the group and USAGE_COLUMNS (cost_usd a
    Decimal). By session, requests that named no conversation are one group, None, last; by
    person, those with keys of no person (not in `key_names`) likewise."""
    groups: dict[str | None, list[Any]] = defaultdict(lambda: [0] * len(USAGE_COLUMNS))
    for row in rows:
        group = {
            "day": row.finished_at.date().isoformat(),
            "model": row.answered_model,
            "deployment": row.deployment,  # the one that answered, whose price it was billed at
            "key": key_names.get(row.key_id, str(row.key_id)),
            "org": key_names.get(row.key_id, "default"),
            "organization": key_names.get(row.key_id, "default"),
            "person": key_names.get(row.key_id),
            "session": row.session,
        }[by]
        totals = groups[group]
        for i, value in enumerate((1, *(getattr(row, column) for column in USAGE_COLUMNS[1:]))):
            totals[i] += value
    header = [by, *USAGE_COLUMNS]
    ordered = sorted(groups.items(), key=lambda item: (item[0] is None, item[0] or ""))
    return [dict(zip(header, [group, *totals])) for group, totals in ordered]


async def usage_for(
    store: Store,
    *,
    by: str,
    key_id: int | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[dict[str, Any]]:
    """The store's ledger (of one key, within [since, until)) grouped `by`; a key's group is its
    name (with its id where two keys share one), an organization's its name, a person's their
    address as the store has it now."""
    keys = await store.list_keys()
    rows = await store.ledger(key_id=key_id, since=since, until=until)
    if by in ("org", "organization"):
        names = {key.id: key.organization for key in keys}
    elif by == "person":
        names = {key.id: key.person_email or f"person {key.person_id}" for key in keys if key.person_id is not None}
    else:
        shared = {name for name, count in Counter(key.name for key in keys).items() if count > 1}
        names = {key.id: f"{key.name} ({key.id})" if key.name in shared else key.name or str(key.id) for key in keys}
    return usage_groups(rows, names, by=by)


def usage_table(groups: list[dict[str, Any]], by: str) -> list[list[Any]]:
    """The groups as a table's lines, for people: the requests that named no session (or had no
    person's key) labelled as such, and the cost at the precision people read
    (gateway/accounting/money.py)."""
    unnamed = NO_PERSON if by == "person" else NO_SESSION
    return [
        [
            unnamed if group[by] is None else group[by],
            *(group[column] for column in USAGE_COLUMNS[:-1]),
            usd_text(group["cost_usd"], symbol=False),
        ]
        for group in groups
    ]


def usage_json(groups: list[dict[str, Any]]) -> str:
    return orjson.dumps(_exact(groups), option=orjson.OPT_INDENT_2).decode() + "\n"


def usage_csv(groups: list[dict[str, Any]], by: str) -> str:
    """The groups as CSV. The group's column is text (a day, or a name a client or an admin
    chose), written as text; the others are the gateway's numbers, written as they are."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([by, *USAGE_COLUMNS])
    writer.writerows([_as_text(group[by]), *(group[column] for column in USAGE_COLUMNS)] for group in _exact(groups))
    return out.getvalue()


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _as_text(cell: str | None) -> str | None:
    """A text cell that a spreadsheet would run as a formula (`=HYPERLINK(…)` as a session's
    name) with a leading `'`, which makes it text there (OWASP's rule for CSV injection)."""
    return f"'{cell}" if cell is not None and cell.startswith(FORMULA_STARTS) else cell


def _exact(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups for machines: the cost as an exact decimal string (gateway/accounting/money.py)."""
    return [{**group, "cost_usd": usd_exact(group["cost_usd"])} for group in groups]
