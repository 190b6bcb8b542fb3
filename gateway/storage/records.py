"""What the stores keep: API keys (hashed) and the usage ledger (the records are the stages')."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

import orjson

from middlewares.core.records import KeyRecord, LedgerRow, Shortfall

__all__ = [
    "ADMIN_TOKEN_SESSION",
    "AdminTokenRecord",
    "Alert",
    "AlertDelivery",
    "AuditEntry",
    "AuditNote",
    "DeviceGrant",
    "Hold",
    "KeyRecord",
    "LedgerRow",
    "OrganizationRecord",
    "PersonRecord",
    "RenewalRecord",
    "SessionRecord",
    "Shortfall",
    "StoredResponse",
    "admin_token_view",
    "cost_by_key",
    "groups_text",
    "key_view",
    "organization_view",
    "person_view",
    "polled",
]

DEFAULT_ORGANIZATION_ID = 1  # the "default" organization, made by the migration that made the table


class PastTheCap(Exception):
    """A top-up that would take an organization's balance past the most it may be: nothing was
    added. `balance` is the balance as the store found it, under its lock."""

    def __init__(self, balance: Decimal) -> None:
        super().__init__(f"the balance {balance} cannot take it")
        self.balance = balance


class Hold(NamedTuple):
    """A request's spend reservation: `amount` held for it, if the key's spend and holds leave
    that much of `limit`, its person's spend in the current `person_period` and holds (over all
    their keys) that much of `person_budget`, and its organization's spend and holds that much
    of `balance` (None: no such limit), for `ttl` seconds at most (its ledger row or its
    release ends it). A reservation names its person (`person`) only where their budget counts
    it."""

    request_id: str
    key_id: int
    amount: Decimal
    limit: Decimal | None
    ttl: float
    organization_id: int = DEFAULT_ORGANIZATION_ID
    balance: Decimal | None = None
    person_id: int | None = None
    person_budget: Decimal | None = None
    person_period: str = "month"

    @property
    def person(self) -> int | None:
        """The person whose budget counts this hold (None: none does)."""
        return self.person_id if self.person_budget is not None else None


class OrganizationRecord(NamedTuple):
    id: int
    name: str
    balance_usd: Decimal | None  # shared by its keys; None: no balance limit
    suspended: bool
    spent_usd: Decimal  # by all its keys, since the organization was made
    from_config: bool  # declared in the config file, which alone may change it
    keys: int  # how many keys belong to it


class AdminTokenRecord(NamedTuple):
    """An admin token made with the CLI (the config file's are its own): only its digest is kept."""

    id: int
    name: str
    role: str  # "admin" or "viewer"
    token_sha256: str
    created_at: datetime
    revoked_at: datetime | None


class PersonRecord(NamedTuple):
    """Someone who signed in to the console through the company's identity provider, known by
    the provider's `sub` (`subject`); email, name and groups are as of their last sign-in."""

    id: int
    subject: str
    email: str
    name: str
    groups: tuple[str, ...]
    first_seen: datetime
    last_seen: datetime
    disabled: bool


# What a session is for: an admin token's holder, its subject the token's digest (a person signed
# in through an identity provider will be another kind, with their own subject).
ADMIN_TOKEN_SESSION = "admin_token"


class SessionRecord(NamedTuple):
    """A console session: who it is for, the CSRF token of its forms, and when it ends. Its id is
    the cookie's value; only the id's SHA-256 digest is kept."""

    id_sha256: str
    kind: str  # ADMIN_TOKEN_SESSION
    subject: str  # who, as `kind` names them: for an admin token, its digest
    csrf: str
    created_at: datetime
    expires_at: datetime


# A device grant's states (RFC 8628's device authorization grant, `ezat-gateway login`): waiting
# for a person, approved or denied by one, and used (the poll that found it approved got its key).
DEVICE_PENDING = "pending"
DEVICE_APPROVED = "approved"
DEVICE_DENIED = "denied"
DEVICE_USED = "used"
# What a poll finds, beside those states: the grant expired, or it was polled sooner than its
# interval after the poll before (RFC 8628 §3.5's slow_down).
DEVICE_EXPIRED = "expired"
DEVICE_TOO_SOON = "too_soon"
SLOW_DOWN_SECONDS = 5  # what a poll too soon adds to its grant's interval (RFC 8628 §3.5)
# An expired grant is kept this long (a client still polling hears that it expired, not that it
# is unknown), then deleted as a new grant is made.
EXPIRED_GRANTS_KEPT = timedelta(hours=1)


class DeviceGrant(NamedTuple):
    """A device's request for a key (RFC 8628): the device code it polls with (only its SHA-256
    digest is kept), the user code a person types on the console (normalised: upper case, no
    hyphen), and what became of it."""

    device_sha256: str
    user_code: str
    client_id: str
    created_at: datetime
    expires_at: datetime
    interval: int  # seconds the client waits between polls; a poll too soon adds SLOW_DOWN_SECONDS
    status: str  # DEVICE_PENDING, DEVICE_APPROVED, DEVICE_DENIED or DEVICE_USED
    person_id: int | None = None  # who approved or denied it
    last_polled_at: datetime | None = None


def polled(grant: DeviceGrant, now: datetime) -> tuple[DeviceGrant, str]:
    """A client's poll of `grant` at `now`: the grant as the poll leaves it (its time recorded; an
    approved grant used, so that only one poll ever gets its key; a pending one polled too soon
    given a longer interval), and what the poll found: DEVICE_USED (before this poll), DEVICE_EXPIRED,
    DEVICE_DENIED, DEVICE_APPROVED (this poll uses it), DEVICE_TOO_SOON or DEVICE_PENDING. Both
    stores apply it in one transaction with the read."""
    after = grant._replace(last_polled_at=now)
    if grant.status == DEVICE_USED:
        return after, DEVICE_USED
    if now >= grant.expires_at:
        return after, DEVICE_EXPIRED
    if grant.status == DEVICE_DENIED:
        return after, DEVICE_DENIED
    if grant.status == DEVICE_APPROVED:
        return after._replace(status=DEVICE_USED), DEVICE_APPROVED
    if grant.last_polled_at is not None and now < grant.last_polled_at + timedelta(seconds=grant.interval):
        return after._replace(interval=grant.interval + SLOW_DOWN_SECONDS), DEVICE_TOO_SOON
    return after, DEVICE_PENDING


class RenewalRecord(NamedTuple):
    """A renewal token (OAuth's refresh token), which gets a person's command line a new key
    without a browser: only its SHA-256 digest is kept. Revoked when its person is disabled."""

    token_sha256: str
    person_id: int
    created_at: datetime
    expires_at: datetime
    revoked_at: datetime | None = None


class AuditNote(NamedTuple):
    """Who is making a change, and what it is called in the audit log ("key.create", …): a store
    writes the entry in the change's own transaction."""

    actor: str
    action: str


class Alert(NamedTuple):
    """A threshold crossed: for whom (`subject`, "key:12" or "organization:3"), in which period
    (its first day, or what a lifetime limit or a balance was), and the JSON body its webhook gets."""

    webhook_url: str
    subject: str
    period: str
    threshold: str
    payload: bytes


class AlertDelivery(NamedTuple):
    """An alert to POST now: its row, where, the body, and how many times it was tried before."""

    id: int
    webhook_url: str
    payload: bytes
    attempts: int


class AuditEntry(NamedTuple):
    """One change: who made it, what, to what (`target`, "key:12"), and the thing before and
    after (its view: key_view and the others, which hold no secret nor digest; None for a thing
    made or ended)."""

    id: int
    at: datetime
    actor: str
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    def view(self) -> dict[str, Any]:
        return {**self._asdict(), "at": self.at.isoformat()}


def _money(amount: Decimal | None) -> str | None:
    # Exact decimal text: JSON numbers would come back as binary floats.
    return None if amount is None else str(amount)


def key_view(key: KeyRecord, now: datetime) -> dict[str, Any]:
    """A key as the admin API and the audit log show it at `now`: its settings as [[keys]] names
    them, and its spend; never its digest."""
    return {
        "id": key.id,
        "name": key.name,
        "models": list(key.models),
        "spend_limit_usd": _money(key.spend_limit_usd),
        "budget_period": key.budget_period,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "max_concurrent": key.max_concurrent,
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "revoked": key.revoked,
        "organization": key.organization,
        "person_id": key.person_id,  # None: an admin's key
        "spent_usd": _money(key.spent_usd),
        # What counts against a period's budget now (None without a period).
        "period_spent_usd": _money(key.spent_in_period(now)) if key.budget_period else None,
        "from_config": key.from_config,
    }


def organization_view(organization: OrganizationRecord) -> dict[str, Any]:
    """An organization as the admin API and the audit log show it."""
    return {
        "id": organization.id,
        "name": organization.name,
        "balance_usd": _money(organization.balance_usd),
        "suspended": organization.suspended,
        "spent_usd": _money(organization.spent_usd),
        "keys": organization.keys,
        "from_config": organization.from_config,
    }


def person_view(person: PersonRecord) -> dict[str, Any]:
    """A person as the admin API and the audit log show them."""
    return {
        "id": person.id,
        "subject": person.subject,
        "email": person.email,
        "name": person.name,
        "groups": list(person.groups),
        "first_seen": person.first_seen.isoformat(),
        "last_seen": person.last_seen.isoformat(),
        "disabled": person.disabled,
    }


def groups_text(groups: Sequence[str]) -> str:
    """A person's groups as the stores keep them, a JSON array. (One string would pass for a
    sequence of its characters: refused.)"""
    if isinstance(groups, str):
        raise TypeError("groups: expected a sequence of group names, not one string")
    return orjson.dumps(list(groups)).decode()


def admin_token_view(token: AdminTokenRecord) -> dict[str, Any]:
    """An admin token without its digest."""
    return {
        "id": token.id,
        "name": token.name,
        "role": token.role,
        "created_at": token.created_at.isoformat(),
        "revoked_at": token.revoked_at.isoformat() if token.revoked_at else None,
    }


class StoredResponse(NamedTuple):
    """A Responses API response kept for GET /v1/responses/{id}, its input items, and requests
    that continue it (previous_response_id); only the key that made it finds it, until it expires."""

    response_id: str  # "resp_…"
    key_id: int
    created_at: datetime  # timezone-aware
    expires_at: datetime
    response: dict[str, Any]  # the response object as the client got it
    input_items: list[dict[str, Any]]  # the request's input, as Responses items, as the client sent them
    # The conversation so far in Anthropic's Messages format: its messages, the answer's
    # assistant turn last (thinking blocks included), and its system prompt (None: none).
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None

    def documents(self) -> tuple[str, str, str]:
        """The JSON texts the stores keep: the response, its input items, and the conversation."""
        conversation = {"system": self.system, "messages": self.messages}
        response, input_items, conversation_text = (
            orjson.dumps(value).decode() for value in (self.response, self.input_items, conversation)
        )
        return response, input_items, conversation_text

    @classmethod
    def from_documents(
        cls, response_id: str, key_id: int, created_at: datetime, expires_at: datetime, *documents: str
    ) -> StoredResponse:
        response, input_items, conversation = (orjson.loads(document) for document in documents)
        return cls(
            response_id,
            key_id,
            created_at,
            expires_at,
            response,
            input_items,
            conversation["messages"],
            conversation["system"],
        )


def take(holds, key_left, person_left, org_left) -> list[Shortfall | None]:
    """Each hold taken in turn where what is left allows it. `key_left(hold)` gives what is left
    of `hold.limit` for its key before these holds, `person_left(hold)` what is left of
    `hold.person_budget` for its person, and `org_left(hold)` what is left of `hold.balance` for
    its organization; each is called once per key (or person, or organization), with its first
    hold that has a limit (or a person budget, or a balance). A refused hold takes nothing from
    any; the narrowest that falls short is named: the key, then the person, then the
    organization."""
    keys: dict[int, Decimal] = {}
    people: dict[int, Decimal] = {}
    orgs: dict[int, Decimal] = {}
    results: list[Shortfall | None] = []
    for hold in holds:
        person = hold.person
        if hold.limit is not None and hold.key_id not in keys:
            keys[hold.key_id] = key_left(hold)
        if person is not None and person not in people:
            people[person] = person_left(hold)
        if hold.balance is not None and hold.organization_id not in orgs:
            orgs[hold.organization_id] = org_left(hold)
        if hold.limit is not None and hold.amount > keys[hold.key_id]:
            results.append(Shortfall("key", keys[hold.key_id]))
        elif person is not None and hold.amount > people[person]:
            results.append(Shortfall("person", people[person]))
        elif hold.balance is not None and hold.amount > orgs[hold.organization_id]:
            results.append(Shortfall("organization", orgs[hold.organization_id]))
        else:
            if hold.limit is not None:
                keys[hold.key_id] -= hold.amount
            if person is not None:
                people[person] -= hold.amount
            if hold.balance is not None:
                orgs[hold.organization_id] -= hold.amount
            results.append(None)
    return results


def cost_by_key(rows: Iterable[LedgerRow]) -> dict[int, Decimal]:
    """Each key's total cost in `rows`: what writing them adds to the keys' spend."""
    totals: dict[int, Decimal] = {}
    for row in rows:
        totals[row.key_id] = totals.get(row.key_id, Decimal(0)) + row.cost_usd
    return totals
