"""What the stores keep: API keys (hashed) and the usage ledger (the records are the stages')."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from middlewares.core.records import KeyRecord, LedgerRow

__all__ = ["KeyRecord", "LedgerRow", "cost_by_key"]


def cost_by_key(rows: Iterable[LedgerRow]) -> dict[int, Decimal]:
    """Each key's total cost in `rows`: what writing them adds to the keys' spend."""
    totals: dict[int, Decimal] = {}
    for row in rows:
        totals[row.key_id] = totals.get(row.key_id, Decimal(0)) + row.cost_usd
    return totals
