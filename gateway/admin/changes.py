"""The changes an administrator makes to keys, organizations and admin tokens, each written to the
audit log in the change's own transaction. The command line (gateway/admin/commands.py) and the admin API
(gateway/admin/api.py) both make their changes here, so the two cannot drift apart: the same
checks, the same secrets, the same audit entries.

Keys and organizations the config file declares are read-only here: the next start would undo a
change (the file is their source of truth)."""

from __future__ import annotations

import getpass
import hashlib
import secrets
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from gateway.config import MAX_USD, budget_problem, is_id, name_problem
from gateway.storage import AdminTokenRecord, AuditNote, KeyRecord, OrganizationRecord, PastTheCap, Store
from gateway.storage.records import PersonRecord

KEY_PREFIX = "sk-ezat-"
ADMIN_TOKEN_PREFIX = "ezat-admin-"
ROLES = ("admin", "viewer")


class AdminError(Exception):
    """Why a change was refused: an HTTP status, an error type and a message for people (the CLI
    prints the message; the API sends all three)."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(AdminError):
    status = 404
    type = "not_found_error"


class Conflict(AdminError):
    status = 409
    type = "conflict_error"


class Invalid(AdminError):
    pass


def _check_name(name: str) -> None:
    problem = name_problem(name)
    if problem is not None:
        raise Invalid(f"name: {problem}")


def cli_actor() -> str:
    """The audit log's name for the command line's changes: `cli:` and the user running it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's), nor LOGNAME and the like
        user = "unknown"
    return f"cli:{user}"


def digest(secret: str) -> str:
    """What the store keeps of a secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def new_key_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_admin_token() -> str:
    return ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)


# --- keys


async def create_key(
    store: Store, actor: str, *, organization: str | None = None, **fields: Any
) -> tuple[KeyRecord, str]:
    """A new key with `fields` (KeyRecord's) in `organization` (a name; default: "default"), and
    its secret, which is shown once: only its digest is stored."""
    if "name" in fields:
        _check_name(fields["name"])
    _check_budget(fields.get("budget_period"), fields.get("spend_limit_usd"))
    if organization is not None:
        fields["organization_id"] = await _organization_id(store, organization)
    secret = new_key_secret()
    key = await store.create_key(digest(secret), audit=AuditNote(actor, "key.create"), **fields)
    return key, secret


async def update_key(
    store: Store,
    actor: str,
    key: KeyRecord,
    *,
    organization: str | None = None,
    action: str = "key.update",
    ref: str | None = None,
    **fields: Any,
) -> KeyRecord:
    """The key with `fields` changed (and moved to `organization`, a name). `ref` is how the
    caller named the key, for the messages."""
    _writable_key(key, ref)
    if "name" in fields:
        _check_name(fields["name"])
    if "budget_period" in fields or "spend_limit_usd" in fields:
        _check_budget(
            fields.get("budget_period", key.budget_period), fields.get("spend_limit_usd", key.spend_limit_usd)
        )
    if organization is not None:
        fields["organization_id"] = await _organization_id(store, organization)
    changed = await store.update_key(key.id, audit=AuditNote(actor, action), **fields)
    if changed is None:
        raise NotFound(f"no key numbered {key.id}")
    return changed


ForgetKey = Callable[[str], None]  # the auth stage's forget(digest): a key's cached record dropped


async def revoke_key(
    store: Store, actor: str, key: KeyRecord, *, ref: str | None = None, forget_key: ForgetKey | None = None
) -> KeyRecord:
    """Requests with it get 401: at once in the process whose `forget_key` is given, elsewhere
    within the auth stage's cache time. One revoked already stays so, and nothing is audited."""
    _writable_key(key, ref)
    revoked = key if key.revoked else await update_key(store, actor, key, action="key.revoke", ref=ref, revoked=True)
    if forget_key is not None:  # revoked already, perhaps by another process: this one's cache too
        forget_key(key.key_sha256)
    return revoked


async def rotate_key(
    store: Store, actor: str, key: KeyRecord, *, ref: str | None = None, forget_key: ForgetKey | None = None
) -> tuple[KeyRecord, str]:
    """A new secret for the key (shown once); the old one finds no key in the store from now on
    (at once in the process whose `forget_key` is given, elsewhere within the auth stage's
    key_cache_seconds). Its id, settings, spend and ledger rows stay."""
    _writable_key(key, ref)
    secret = new_key_secret()
    rotated = await store.rotate_key(key.id, digest(secret), audit=AuditNote(actor, "key.rotate"))
    if rotated is None:
        raise NotFound(f"no key numbered {key.id}")
    if forget_key is not None:
        forget_key(key.key_sha256)
    return rotated, secret


def _writable_key(key: KeyRecord, ref: str | None) -> None:
    if key.from_config:
        raise Conflict(
            f"key {ref or key.name or str(key.id)!r} is declared in the config file: "
            "change it there (revoked = true to revoke it)"
        )


def _check_budget(period: str | None, limit: Decimal | None) -> None:
    problem = budget_problem(period, limit)
    if problem is not None:
        raise Invalid(problem)


async def _organization_id(store: Store, name: str) -> int:
    found = await store.find_organization(name)
    if found is None:
        raise Invalid(f"no organization named {name!r}")
    return found.id


# --- organizations


async def create_organization(
    store: Store, actor: str, name: str, *, balance_usd: Decimal | None = None, suspended: bool = False
) -> OrganizationRecord:
    _check_name(name)
    made = await store.create_organization(
        name, balance_usd=balance_usd, suspended=suspended, audit=AuditNote(actor, "organization.create")
    )
    if made is None:
        raise Conflict(f"an organization named {name!r} exists already")
    return made


async def update_organization(
    store: Store, actor: str, organization: OrganizationRecord, *, action: str = "organization.update", **fields: Any
) -> OrganizationRecord:
    """`balance_usd` and `suspended` changed."""
    _writable_organization(organization)
    changed = await store.update_organization(organization.name, audit=AuditNote(actor, action), **fields)
    if changed is None:
        raise NotFound(f"no organization named {organization.name!r}")
    return changed


async def suspend_organization(store: Store, actor: str, organization: OrganizationRecord) -> OrganizationRecord:
    """Its keys' requests get 403 from now on."""
    return await update_organization(store, actor, organization, action="organization.suspend", suspended=True)


async def resume_organization(store: Store, actor: str, organization: OrganizationRecord) -> OrganizationRecord:
    return await update_organization(store, actor, organization, action="organization.resume", suspended=False)


async def top_up_organization(
    store: Store, actor: str, organization: OrganizationRecord, amount_usd: Decimal
) -> OrganizationRecord:
    """Adds `amount_usd` of credit to its balance, in one transaction (two top-ups at once both
    count); the audit log records it, the balance before and after."""
    _writable_organization(organization)
    if not amount_usd.is_finite() or amount_usd <= 0:
        raise Invalid(f"amount_usd: expected an amount of USD above 0, not {amount_usd}")
    if organization.balance_usd is None:
        raise Conflict(
            f"organization {organization.name!r} has no balance limit to add to: give it a balance_usd first"
        )
    # The cap is checked by the store, under its lock, on the balance it finds there: a check on
    # the balance as read here could pass two top-ups at once that each fit what the other had
    # not added yet. PastTheCap carries that balance, for the message.
    try:
        changed = await store.top_up_organization(
            organization.name, amount_usd, most=MAX_USD, audit=AuditNote(actor, "organization.top_up")
        )
    except PastTheCap as past:
        after, room = past.balance + amount_usd, MAX_USD - past.balance
        raise Invalid(
            f"amount_usd: the balance would be {after.normalize():,f}, past the most a balance may be "
            f"({MAX_USD:,}): add at most {room.normalize():,f}"
        ) from None
    if changed is None:
        raise NotFound(f"no organization named {organization.name!r}")
    if changed.balance_usd is None:  # its limit was removed meanwhile: nothing was added
        raise Conflict(f"organization {organization.name!r} has no balance limit to add to")
    return changed


def _writable_organization(organization: OrganizationRecord) -> None:
    if organization.from_config:
        raise Conflict(f"organization {organization.name!r} is declared in the config file: change it there")


# --- admin tokens


async def create_admin_token(store: Store, actor: str, name: str, role: str) -> tuple[AdminTokenRecord, str]:
    """A new admin token and its secret, shown once (only its digest is stored)."""
    _check_name(name)
    if role not in ROLES:
        raise Invalid(f'role: expected "admin" or "viewer", not {role!r}')
    token = new_admin_token()
    made = await store.create_admin_token(name, role, digest(token), audit=AuditNote(actor, "admin_token.create"))
    if made is None:
        raise Conflict(f"an admin token named {name!r} exists already (revoked ones keep their names)")
    return made, token


async def revoke_admin_token(store: Store, actor: str, ref: str) -> AdminTokenRecord:
    """The token numbered `ref` (digits), or else named so, revoked: the admin API refuses it
    from its next request on."""
    tokens = await store.list_admin_tokens()
    found = next((t for t in tokens if (t.id == row_id(ref) if is_id(ref) else t.name == ref)), None)
    if found is None:
        raise NotFound(f"no admin token named or numbered {ref!r}")
    revoked = await store.revoke_admin_token(found.id, audit=AuditNote(actor, "admin_token.revoke"))
    if revoked is None:
        raise NotFound(f"no admin token named or numbered {ref!r}")
    return revoked


def row_id(value: str) -> int | None:
    """A row's id as a path or a query gives it (ASCII digits, within the stores' 64 bits), else None."""
    if not (value.isascii() and value.isdigit()) or not 0 < int(value) < 2**63:
        return None
    return int(value)


async def find_key(store: Store, ref: str) -> KeyRecord | None:
    """The key whose id `ref` names (as a path gives it), or None."""
    key_id = row_id(ref)
    found = await store.keys_by_id([key_id]) if key_id is not None else []
    return found[0] if found else None


async def set_person_disabled(
    store: Store, actor: str, person_id: int, disabled: bool, forget_key: ForgetKey
) -> PersonRecord | None:
    """The person disabled (their keys refused, their console sessions ended) or enabled again,
    audited; None: no such person. This process's auth stage forgets their keys at once; other
    processes within their key cache's seconds."""
    action = "person.disable" if disabled else "person.enable"
    changed = await store.set_person_disabled(person_id, disabled, audit=AuditNote(actor, action))
    if changed is not None:
        for key in await store.list_person_keys(person_id):
            forget_key(key.key_sha256)
    return changed
