"""What the console's pages show, read from the store: the usage report's groups
(gateway/accounting/usage.py, which `ezat-gateway usage` prints and GET /admin/v1/usage answers), so the
console and the API cannot disagree on a figure."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from gateway.accounting.usage import usage_groups
from gateway.storage import LedgerRow

DAYS = 30  # the plots' span, today included


def window(now: datetime) -> tuple[date, date]:
    """The plots' first and last day: the last DAYS days, today (UTC) the last."""
    today = now.astimezone(UTC).date()
    return today - timedelta(days=DAYS - 1), today


def midnight(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=UTC)


def groups(rows: list[LedgerRow], *, by: str, key_ids: bool = False) -> list[dict[str, Any]]:
    """The usage report's groups `by` day, model or key (by key: the key's id, as text, to link
    to its page and name it as it is now)."""
    names = {row.key_id: str(row.key_id) for row in rows} if key_ids else {}
    return usage_groups(rows, names, by=by)


def spend_by_day(rows: list[LedgerRow]) -> dict[date, Decimal]:
    return {date.fromisoformat(group["day"]): group["cost_usd"] for group in groups(rows, by="day")}


def requests_by_day(rows: list[LedgerRow]) -> dict[date, int]:
    return {date.fromisoformat(group["day"]): group["requests"] for group in groups(rows, by="day")}


def top(report: list[dict[str, Any]], n: int = 10) -> list[dict[str, Any]]:
    """The `n` groups that cost most, most first."""
    return sorted(report, key=lambda group: group["cost_usd"], reverse=True)[:n]
