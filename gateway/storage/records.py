"""What the stores keep: API keys (hashed) and the usage ledger."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Literal

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

    def allows(self, model_id: str) -> bool:
        return any(fnmatchcase(model_id, pattern) for pattern in self.models)

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or datetime.now(timezone.utc))


@dataclass(frozen=True)
class LedgerRow:
    """One billed request."""

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

    def values(self) -> tuple:
        """The fields in column order (dataclasses.astuple would deep-copy each one)."""
        return (
            self.request_id, self.key_id, self.model, self.answered_model, self.deployment, self.input_tokens,
            self.cache_write_tokens, self.cache_read_tokens, self.output_tokens, self.reasoning_tokens,
            self.cost_usd, self.outcome, self.started_at, self.finished_at,
        )


def cost_by_key(rows: Iterable[LedgerRow]) -> dict[int, Decimal]:
    """Each key's total cost in `rows`: what writing them adds to the keys' spend."""
    totals: dict[int, Decimal] = {}
    for row in rows:
        totals[row.key_id] = totals.get(row.key_id, Decimal(0)) + row.cost_usd
    return totals
