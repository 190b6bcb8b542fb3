"""The gateway's idea of now for budget periods: `EZAT_NOW` (an ISO 8601 instant) when it is set,
for tests and drills (a month's turn, without waiting for one), else the system's clock."""

from __future__ import annotations

import os
from datetime import UTC, datetime


def now() -> datetime:
    fixed = os.environ.get("EZAT_NOW")
    if not fixed:
        return datetime.now(UTC)
    moment = datetime.fromisoformat(fixed)
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
