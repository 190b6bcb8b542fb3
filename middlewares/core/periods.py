"""Budget periods: the UTC calendar day, week (from Monday, as ISO 8601 counts weeks) or month
that a key's spend limit counts over when it has one. Spend counts in the period its request
was billed in."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import TypeVar

PERIODS = ("day", "week", "month")
EVERY = {"day": "daily", "week": "weekly", "month": "monthly"}  # the period's word in messages
# A period's first day, as a date or as a store keeps it, ISO text.
Day = TypeVar("Day", date, str)


def period_start(period: str, now: datetime) -> date:
    """The first day of the period `now` (UTC) falls in."""
    today = now.date()
    if period == "day":
        return today
    if period == "week":
        return today - timedelta(days=today.weekday())
    if period == "month":
        return today.replace(day=1)
    raise ValueError(f"unknown budget period {period!r}")


def current_starts(now: datetime) -> dict[str, date]:
    """Each period's current one at `now`, by its first day."""
    return {period: period_start(period, now) for period in PERIODS}


def still_current(started: Day | None, current: Day) -> bool:
    """Whether the spend a key recorded for the period begun on `started` (None: none yet)
    counts in the one begun on `current` (both dates, or both ISO text, as a store keeps them).
    It does unless it is an earlier period's: a period that a process whose clock is a moment
    ahead has begun already is this one, and never goes back."""
    return started is not None and started >= current


def next_start(period: str, now: datetime) -> date:
    """The first day of the next period: when what the current one has spent is forgotten."""
    start = period_start(period, now)
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    return date(start.year + start.month // 12, start.month % 12 + 1, 1)
