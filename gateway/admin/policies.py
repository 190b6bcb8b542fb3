"""People's keys under their group's policy (`[[policies]]`): the first policy whose group the
person is in says which models their keys may use, at what rates, what they may spend over all
of them in a day, week or month, and how long a key they make lives. The policy is applied to a
key each time the auth stage reads it (so within its cache's seconds a changed policy, a
person's new groups or their being disabled reach every key of theirs), not copied into the key
when it is made. A person's key is made one way, on the console's page or by `ezat-gateway
login` alike (make_person_key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta

from gateway.admin import changes
from gateway.admin.changes import AdminError
from gateway.config import PolicyConfig
from gateway.storage import Store
from gateway.storage.records import PersonRecord
from middlewares.core.records import KeyRecord

FindKey = Callable[[str], Awaitable[KeyRecord | None]]
DISABLED = "This API key's owner has been disabled by an administrator."
NO_POLICY = "This API key's owner is in no group a policy of this gateway covers."


class NoPolicy(AdminError):
    """A person in no policy's group asked for a key: they get none."""

    status = 403
    type = "permission_error"


def person_actor(person: PersonRecord) -> str:
    """A person as the audit log names them when they make a change: their address (else their subject)."""
    return person.email or person.subject


async def make_person_key(
    store: Store, person: PersonRecord, policies: Sequence[PolicyConfig], now: datetime, *, name: str = ""
) -> tuple[KeyRecord, str]:
    """A key for `person` as their policy has it (its models; living its key_ttl_hours from `now`),
    made through changes.create_key, so audited with the person as actor; and its secret, shown
    once. `name` is optional. NoPolicy when none of their groups has a policy."""
    policy = policy_for(person.groups, policies)
    if policy is None:
        raise NoPolicy("None of your groups has a policy: no key.")
    expires = now + timedelta(hours=policy.key_ttl_hours)
    named = {"name": name} if name else {}
    return await changes.create_key(
        store, person_actor(person), person_id=person.id, models=policy.models, expires_at=expires, **named
    )


def policy_for(groups: Sequence[str], policies: Sequence[PolicyConfig]) -> PolicyConfig | None:
    """The first policy whose group is among `groups`; None: the person gets no key."""
    return next((policy for policy in policies if policy.group in groups), None)


def governed(key: KeyRecord, policies: Sequence[PolicyConfig]) -> KeyRecord:
    """`key` as its person's policy has it now: an admin's key as it is; a person's with the
    policy's models, rates and budget (over all the person's keys), or refused
    (KeyRecord.refusal) when the person is disabled or in no policy's group."""
    if key.person_id is None:
        return key
    if key.person_disabled:
        return dataclasses.replace(key, refusal=DISABLED)
    policy = policy_for(key.person_groups, policies)
    if policy is None:
        return dataclasses.replace(key, refusal=NO_POLICY)
    return dataclasses.replace(
        key,
        models=policy.models,
        rpm=policy.rpm,
        tpm=policy.tpm,
        person_budget_usd=policy.budget_usd,
        person_budget_period=policy.budget_period,
    )


def governing(find_key: FindKey, policies: Sequence[PolicyConfig]) -> FindKey:
    """`find_key`, each key it finds governed by its person's policy."""

    async def find(digest: str) -> KeyRecord | None:
        key = await find_key(digest)
        return None if key is None else governed(key, policies)

    return find
