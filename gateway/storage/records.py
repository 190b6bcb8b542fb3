"""What the stores keep: API keys (hashed) and the usage ledger (the records are the stages')."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from typing import NamedTuple

from middlewares.core.records import KeyRecord, LedgerRow

__all__ = ["Hold", "KeyRecord", "LedgerRow", "cost_by_key"]


class Hold(NamedTuple):
    """A request's spend reservation: `amount` held for it, if the key's spend and holds leave
    that much of `limit`, for `ttl` seconds at most (its ledger row or its release ends it)."""

    request_id: str
    key_id: int
    amount: Decimal
    limit: Decimal
    ttl: float


def cost_by_key(rows: Iterable[LedgerRow]) -> dict[int, Decimal]:
    """Each key's total cost in `rows`: what writing them adds to the keys' spend."""
    totals: dict[int, Decimal] = {}
    for row in rows:
        totals[row.key_id] = totals.get(row.key_id, Decimal(0)) + row.cost_usd
    return totals
