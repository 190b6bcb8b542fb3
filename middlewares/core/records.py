"""The records stages read and write: an API key (auth finds it, limits reads its limits) and a
ledger row (billing makes it). The gateway's stores keep them; another app may keep its own."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Literal, NamedTuple

from middlewares.core.periods import period_start, still_current

Outcome = Literal["complete", "client_closed"]

# The longest conversation name the ledger keeps as sent; a longer one is kept as its digest.
MAX_SESSION_CHARS = 64
# What a name kept as sent may not hold: control characters (PostgreSQL's text refuses NUL; a
# report's line would break on a newline) and surrogates (a header's bytes that are not UTF-8).
_UNKEPT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


class PersonSpend(NamedTuple):
    """What a person's keys together spent in the last day, week and month they spent in, each
    by its first day (None: nothing spent in one yet). All three are kept, whatever the person's
    policy says, so that a policy given a budget, or another period, counts at once what its
    current period has spent."""

    day_start: date | None = None
    day_usd: Decimal = Decimal(0)
    week_start: date | None = None
    week_usd: Decimal = Decimal(0)
    month_start: date | None = None
    month_usd: Decimal = Decimal(0)

    def in_period(self, period: str, now: datetime) -> Decimal:
        """What the current `period` ("day", "week" or "month") at `now` has spent."""
        started, spent = {
            "day": (self.day_start, self.day_usd),
            "week": (self.week_start, self.week_usd),
            "month": (self.month_start, self.month_usd),
        }[period]
        return spent if still_current(started, period_start(period, now)) else Decimal(0)


@dataclass(frozen=True)
class KeyRecord:
    id: int
    name: str
    key_sha256: str  # the key itself is never stored
    models: tuple[str, ...] = ("*",)  # globs of model ids this key may use
    spend_limit_usd: Decimal | None = None
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (input + output) per minute
    max_concurrent: int | None = None  # requests running at once
    expires_at: datetime | None = None
    revoked: bool = False
    spent_usd: Decimal = Decimal(0)  # as of when the record was read
    from_config: bool = False  # declared in the config file, which alone may change it
    # The organization the key belongs to (every key has one: "default" unless it says otherwise),
    # as of when the record was read: its balance is shared by all its keys.
    organization: str = "default"
    organization_id: int = 1
    organization_balance_usd: Decimal | None = None  # None: no balance limit
    organization_suspended: bool = False  # its keys' requests are refused (403)
    # The period the spend limit counts over ("day", "week" or "month", UTC calendar;
    # middlewares.core.periods), None for the key's whole life; and, as of when the record was
    # read, the period its period_spent_usd counts (None: nothing spent in one yet).
    budget_period: str | None = None
    period_start: date | None = None
    period_spent_usd: Decimal = Decimal(0)
    # The person the key belongs to (None: an admin's key), and, as of when the record was read,
    # their email, groups and whether they are disabled (a person's key follows their group's policy).
    person_id: int | None = None
    person_email: str = ""
    person_groups: tuple[str, ...] = ()
    person_disabled: bool = False
    # The person's budget over all their keys together, as their group's policy has it now (set by
    # the gateway, never by the stores: None, no such budget), and the period it counts over; and,
    # as of when the record was read, what the person's keys spent in each kind of period.
    person_budget_usd: Decimal | None = None
    person_budget_period: str | None = None
    person_spend: PersonSpend = PersonSpend()
    # Why every request with this key is refused (None: it is not). Set by the gateway, never by
    # the stores: a person's key whose person is disabled or in no policy's group gets 401 with
    # this message.
    refusal: str | None = None

    def spent_in_period(self, now: datetime) -> Decimal:
        """What counts against the spend limit at `now`: the current period's spend, or the
        key's whole spend when it has no period."""
        if self.budget_period is None:
            return self.spent_usd
        current = period_start(self.budget_period, now)
        return self.period_spent_usd if still_current(self.period_start, current) else Decimal(0)

    def person_spent_in_period(self, now: datetime) -> Decimal:
        """What counts against the person's budget at `now`: what all their keys spent in its
        current period (0 for a key without a person budget)."""
        if self.person_budget_period is None:
            return Decimal(0)
        return self.person_spend.in_period(self.person_budget_period, now)

    def allows(self, model_id: str) -> bool:
        return "*" in self.models or any(fnmatchcase(model_id, pattern) for pattern in self.models)

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or datetime.now(UTC))


class Shortfall(NamedTuple):
    """Why a spend reservation was refused: what ran out (the key's spend limit, its person's
    budget over all their keys, or its organization's balance) and how much of it was left."""

    of: Literal["key", "person", "organization"]
    left: Decimal


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
    cache_write_1h_tokens: int = 0  # of cache_write_tokens, those written for an hour
    session: str | None = None  # the conversation, as `session_name` keeps it

    @staticmethod
    def session_name(session: str | None) -> str | None:
        """How the ledger names a request's conversation (the name routing sticks by): as sent
        when it is at most MAX_SESSION_CHARS characters of text; else "sha256:" and the first 32
        hex digits of its SHA-256, the same for every request of the conversation. None for a
        request that names none."""
        if not session:
            return None
        if len(session) <= MAX_SESSION_CHARS and not _UNKEPT.search(session):
            return session
        return "sha256:" + hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()[:32]
