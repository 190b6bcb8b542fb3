"""The gateway's idea of now, for budget periods: the system's clock or, where `EZAT_NOW` (an ISO
8601 instant) is set as the gateway starts, that instant, fixed, for tests and drills (a month's
turn, without waiting for one). Read once, at start, and handed down as a `Clock`."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def system() -> datetime:
    return datetime.now(UTC)


def from_environment() -> Clock:
    """`EZAT_NOW`'s instant as a clock, when it is set; else the system's."""
    fixed = os.environ.get("EZAT_NOW")
    if not fixed:
        return system
    moment = datetime.fromisoformat(fixed)
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return lambda: moment
