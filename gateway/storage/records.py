"""What the stores keep: API keys (hashed) and the usage ledger."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Literal, NamedTuple

Outcome = Literal["complete", "client_closed"]


@dataclass(frozen=True)
class KeyRecord:
    id: int
    name: str
    key_sha256: str  # the key itself is never stored
    models: tuple[str, ...] = ("*",)  # globs of model ids this key may use
    spend_limit_usd: Decimal | None = None
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (input + output) per minute
    expires_at: datetime | None = None
    revoked: bool = False
    spent_usd: Decimal = Decimal(0)  # as of when the record was read
    from_config: bool = False  # declared in the config file, which alone may change it

    def allows(self, model_id: str) -> bool:
        return "*" in self.models or any(fnmatchcase(model_id, pattern) for pattern in self.models)

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or datetime.now(timezone.utc))


class LedgerRow(NamedTuple):
    """One billed request, its fields in the ledger's column order (a tuple: what the stores
    write as it is, and cheap to make on every request)."""

    request_id: str
    key_id: int
    model: str  # what the client asked for
    answered_model: str  # the model that answered (differs after a fallback)
    deployment: str
    input_tokens: int  # uncached input
    cache_write_tokens: int
    cache_read_tokens: int
    output_tokens: int  # reasoning included
    reasoning_tokens: int
    cost_usd: Decimal
    outcome: Outcome
    started_at: datetime
    finished_at: datetime


def cost_by_key(rows: Iterable[LedgerRow]) -> dict[int, Decimal]:
    """Each key's total cost in `rows`: what writing them adds to the keys' spend."""
    totals: dict[int, Decimal] = {}
    for row in rows:
        totals[row.key_id] = totals.get(row.key_id, Decimal(0)) + row.cost_usd
    return totals
