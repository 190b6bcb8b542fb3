"""Keys, the usage ledger, stored responses, admin tokens, the people who sign in, the console's
sessions, `ezat-gateway login`'s device grants and renewal tokens, the audit log and alerts, in
SQLite (one process or machine) or PostgreSQL (replicas)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from gateway.clock import Clock, system
from gateway.config import KeyConfig, OrganizationConfig
from gateway.storage.records import (
    DEFAULT_ORGANIZATION_ID,
    AdminTokenRecord,
    Alert,
    AlertDelivery,
    AuditEntry,
    AuditNote,
    DeviceGrant,
    Hold,
    KeyRecord,
    LedgerRow,
    OrganizationRecord,
    PastTheCap,
    PersonRecord,
    RenewalRecord,
    SessionRecord,
    Shortfall,
    StoredResponse,
)

__all__ = [
    "DEFAULT_ORGANIZATION_ID",
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
    "PastTheCap",
    "PersonRecord",
    "RenewalRecord",
    "SessionRecord",
    "Shortfall",
    "Store",
    "StoredResponse",
    "open_store",
]


class Store(Protocol):
    async def open(self) -> None:
        """Connect and bring the schema up to date."""

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise unless the database answers a query now."""

    async def find_key(self, key_sha256: str) -> KeyRecord | None: ...

    async def sync_config_keys(self, keys: Sequence[KeyConfig]) -> None:
        """Create or update the keys the config file declares, and revoke those it declared
        before and no longer does: the file is their source of truth."""

    # Each change below takes `audit`: who makes it and what it is called; given, the change's
    # entry in the audit log (the thing before and after, as records.key_view and the others
    # show it) is written in the change's own transaction. (gateway/admin/changes.py makes them.)

    async def create_key(self, key_sha256: str, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord:
        """`fields` are KeyRecord's; `organization_id` places it (default: the default organization),
        `person_id` gives it to a person (default: none, an admin's key), who must exist."""

    async def list_keys(self) -> list[KeyRecord]: ...

    async def list_person_keys(self, person_id: int) -> list[KeyRecord]:
        """The person's keys, newest first, revoked and expired ones included."""

    async def update_key(self, key_id: int, *, audit: AuditNote | None = None, **fields: Any) -> KeyRecord | None:
        """The key with `fields` (KeyRecord's, and `organization_id`) changed; None if there is
        no such key. (The command line finds a key by its name or id: gateway/admin/commands.py.)"""

    async def rotate_key(self, key_id: int, key_sha256: str, *, audit: AuditNote | None = None) -> KeyRecord | None:
        """The key given a new secret (its digest), its id, settings and spend kept: the old
        secret finds no key from the commit on. None if there is no such key."""

    async def sync_config_organizations(self, organizations: Sequence[OrganizationConfig]) -> None:
        """Create or update the organizations the config file declares (before its keys, which
        name them). One it declared before and no longer does stays, its keys and settings as
        they were, but is no longer from the file: the CLI may change it from then on."""

    async def create_organization(
        self,
        name: str,
        *,
        balance_usd: Decimal | None = None,
        suspended: bool = False,
        audit: AuditNote | None = None,
    ) -> OrganizationRecord | None:
        """None when an organization has that name already."""

    async def find_organization(self, name: str) -> OrganizationRecord | None: ...

    async def list_organizations(self) -> list[OrganizationRecord]: ...

    async def update_organization(
        self, name: str, *, audit: AuditNote | None = None, **fields: Any
    ) -> OrganizationRecord | None:
        """`balance_usd` and `suspended`; None when no organization has that name."""

    async def top_up_organization(
        self, name: str, amount_usd: Decimal, *, most: Decimal, audit: AuditNote | None = None
    ) -> OrganizationRecord | None:
        """Its balance raised by `amount_usd`, in one transaction; one with no balance limit is
        returned unchanged (and nothing audited). None when no organization has that name.
        PastTheCap, with nothing added, when the balance would be above `most`."""

    async def create_admin_token(
        self, name: str, role: str, token_sha256: str, *, audit: AuditNote | None = None
    ) -> AdminTokenRecord | None:
        """None when a token has that name already (a revoked one too)."""

    async def find_admin_token(self, token_sha256: str) -> AdminTokenRecord | None:
        """The token with that digest, revoked or not."""

    async def list_admin_tokens(self) -> list[AdminTokenRecord]: ...

    async def revoke_admin_token(self, token_id: int, *, audit: AuditNote | None = None) -> AdminTokenRecord | None:
        """None when there is no such token; one revoked already is returned as it is. Its
        sessions are deleted in the same transaction."""

    async def person_signed_in(self, subject: str, email: str, name: str, groups: Sequence[str]) -> PersonRecord:
        """The person with that subject (the identity provider's `sub`) as of this sign-in: made,
        or given these email, name and groups and last seen now, by the store's clock (first seen
        and disabled kept), in one statement, so that replicas signing the same person in at once
        both succeed, with one row."""

    async def find_person(self, person_id: int) -> PersonRecord | None: ...

    async def find_person_by_subject(self, subject: str) -> PersonRecord | None: ...

    async def person_provider_token(self, person_id: int) -> str | None:
        """The person's sealed refresh token from the identity provider, if one is kept."""

    async def set_person_provider_token(self, person_id: int, sealed: str | None) -> None:
        """Keeps `sealed` as the person's (None: drops theirs)."""

    async def end_provider_trust(self, person_id: int) -> None:
        """The identity provider no longer vouches for the person: their sealed token dropped and
        their command line's renewal tokens revoked, in one transaction (they log in again)."""

    async def list_people(self, *, limit: int, after: int | None = None) -> list[PersonRecord]:
        """By id, `limit` at most; `after`: only people with a larger id."""

    async def set_person_disabled(
        self, person_id: int, disabled: bool, *, audit: AuditNote | None = None
    ) -> PersonRecord | None:
        """None when there is no such person; one disabled (or enabled) already is returned as it
        is, and nothing audited. Disabling revokes their renewal tokens in the same transaction."""

    async def create_session(self, session: SessionRecord) -> None:
        """Keep a console session; the expired ones are deleted in the same transaction."""

    async def find_session(self, id_sha256: str) -> SessionRecord | None:
        """The session whose id has that digest, unless it has expired."""

    async def delete_session(self, id_sha256: str) -> None: ...

    # `ezat-gateway login`: RFC 8628's device grants, and the renewal tokens a person's command line
    # gets a new key with (gateway/admin/device.py). Times are the store's clock's, as sessions'.

    async def create_device_grant(self, grant: DeviceGrant) -> bool:
        """Keep a new grant; False, with nothing kept, when an unexpired grant has its user code
        (the caller draws another). Grants that expired EXPIRED_GRANTS_KEPT ago are deleted in
        the same transaction."""

    async def find_device_grant(self, user_code: str) -> DeviceGrant | None:
        """The grant with that user code (normalised), whatever became of it."""

    async def decide_device_grant(self, user_code: str, person_id: int, approved: bool) -> DeviceGrant | None:
        """The pending, unexpired grant with that user code, approved (or denied) by the person;
        None, with nothing changed, when there is no such grant."""

    async def poll_device_grant(self, device_sha256: str) -> tuple[DeviceGrant, str] | None:
        """A client's poll of the grant whose device code has that digest, applied as
        records.polled says, in one transaction with its read (so two polls at once cannot both
        find it approved): the grant as the poll left it, and what the poll found. None: no such
        grant (or one deleted since it expired)."""

    async def create_renewal(self, renewal: RenewalRecord) -> None:
        """Keep a renewal token; the expired ones are deleted in the same transaction."""

    async def find_renewal(self, token_sha256: str) -> RenewalRecord | None:
        """The renewal token with that digest, expired or revoked too, until it is deleted."""

    async def rotate_renewal(self, token_sha256: str, replacement: RenewalRecord) -> bool:
        """The renewal token, if it is unexpired and not revoked, replaced by `replacement` in one
        transaction: True. False, with nothing changed, when it is not (a renewal at the same
        time used it first, or it was revoked)."""

    async def audit_log(self, *, limit: int = 100, before: int | None = None) -> list[AuditEntry]:
        """The newest `limit` entries, newest first; `before`: only entries with a smaller id."""

    async def organizations_reserved(self) -> dict[int, Decimal]:
        """What each organization's admitted requests hold now, by organization id."""

    async def spent(self, key_id: int) -> Decimal:
        """What the key has spent so far, across every process sharing the store."""

    async def hold(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None]:
        """In one transaction, atomic across every process sharing the store: end the
        reservations of `releases` (requests not billed), then take each hold in turn if its
        key's spend and what its admitted requests still hold leave `amount` of its limit, and
        its organization's spend and holds leave `amount` of its balance (either None: not
        checked). Per hold, None when held, else what ran out first (the key's limit is checked
        first) and what was left of it; a refused hold takes nothing. A reservation also ends when its request's
        ledger row is written, or after its `ttl` (a process that died holds none; SQLite finds
        those once a minute)."""

    def hold_now(self, holds: Sequence[Hold], releases: Sequence[str]) -> list[Shortfall | None] | None:
        """hold without leaving the event loop, where that cannot wait (SQLite's own file,
        unlocked, and no sweep of its reservations due); None, with nothing held or released,
        where it would."""

    async def reserved(self) -> dict[int, Decimal]:
        """What each key's admitted requests hold now, by key id (keys holding nothing left out)."""

    async def write_ledger(self, rows: Sequence[LedgerRow]) -> None:
        """Record rows and add their cost to their keys' spend and their keys' organizations'
        spend, in one durable transaction. A
        row already written (its request id) is skipped, its cost not added again: the ledger
        writes a failed batch again, and a server's commit can succeed with its answer lost."""

    def write_ledger_now(self, rows: Sequence[LedgerRow]) -> bool:
        """write_ledger without leaving the event loop, where that cannot wait (SQLite's own
        file, unlocked); False, with nothing written, where it would."""

    async def ledger(
        self, *, key_id: int | None = None, since: datetime | None = None, until: datetime | None = None
    ) -> list[LedgerRow]:
        """The ledger's rows, oldest first: one key's (by id), finished from `since` on and before `until`."""

    async def ledger_page(
        self,
        *,
        key_id: int | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> list[tuple[int, LedgerRow]]:
        """ledger()'s rows with their ids, past the row `after` (an id), `limit` at most."""

    async def put_responses(self, stored: Sequence[StoredResponse]) -> None:
        """Keep Responses API responses, in one transaction, each until its `expires_at`, once its
        answer is complete; a response written again replaces itself. Off the ledger's way: on
        SQLite a connection of its own, on PostgreSQL a pool of its own. Expired ones are deleted
        by a sweep that a hold or a write starts once a minute, which nothing waits for."""

    def put_responses_now(self, stored: Sequence[StoredResponse]) -> bool:
        """put_responses without leaving the event loop, where that cannot wait (SQLite's own
        file, unlocked); False, with nothing written, where it would."""

    async def keys_by_id(self, key_ids: Sequence[int]) -> list[KeyRecord]:
        """The keys with these ids (those that exist)."""

    async def claim_alert(self, alert: Alert) -> bool:
        """Record the alert to be sent, once: False, with nothing written, when one for the same
        webhook, subject, period and threshold is recorded already (by any process)."""

    async def due_alerts(self, lease_seconds: float, give_up_after: float) -> tuple[list[AlertDelivery], int]:
        """The recorded alerts not yet delivered whose next attempt is due, each leased to the
        caller for `lease_seconds` (no other process takes it meanwhile); and how many were given
        up now, not delivered `give_up_after` seconds after they were recorded."""

    async def alert_sent(self, alert_id: int) -> None: ...

    async def alert_failed(self, alert_id: int, retry_in: float, error: str) -> None:
        """An attempt failed: the next is due in `retry_in` seconds."""

    async def get_response(self, response_id: str, key_id: int) -> StoredResponse | None:
        """The response, if `key_id` made it and it has not expired or been deleted; else None
        (another key's is not told apart from one that does not exist)."""

    async def delete_response(self, response_id: str, key_id: int) -> bool:
        """Deletes the response if get_response would find it; whether it did."""


def open_store(url: str, *, now: Clock = system) -> Store:
    """The store for a `[storage] url`: sqlite:///path or postgresql://…; `now` dates budget periods."""
    if url.startswith("sqlite:///"):
        from gateway.storage.sqlite import SQLiteStore

        return SQLiteStore(url.removeprefix("sqlite:///"), now=now)
    if url.startswith(("postgresql://", "postgres://")):
        from gateway.storage.postgres import PostgresStore

        return PostgresStore(url, now=now)
    raise ValueError("unsupported storage URL: expected sqlite:///… or postgresql://…")  # it may hold a password
