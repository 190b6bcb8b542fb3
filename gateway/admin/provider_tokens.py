"""The identity provider's refresh token of each person, sealed at rest: what lets the gateway ask
the provider again, when a person's command line renews its key, whether the person is still who
they were (not disabled there, the same groups).

A token is encrypted and authenticated with AES-GCM under a key derived (HKDF-SHA256) from
`[admin] session_key`, and bound to the person's subject: the store holds nothing the provider
would take, and a sealed token copied to another person's row does not open. Without a
session_key in the config, the key is the process's own: tokens sealed before a restart (or by
another replica) do not open, and the person's renewal simply does not ask the provider until
they sign in again. The envelope is the reasoning seals' (middlewares/responses/sealing.py),
under its own VERSION."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.admin import changes
from gateway.admin.oidc import OidcClient, OidcError, ProviderUnavailable
from gateway.clock import Clock
from gateway.storage import Store
from gateway.storage.records import PersonRecord
from middlewares.responses.sealing import open_bytes, seal_bytes

log = logging.getLogger("ezat.admin")

VERSION = "ezat-idp1."
PROVIDER_ACTOR = "identity provider"  # the audit log's actor of a revocation a re-check makes
PURPOSE = b"ezat-gateway identity provider refresh token v1"


def sealing_key(session_key: bytes) -> bytes:
    """The AES-256 key the tokens are sealed with, derived from the console's session key (so
    that the key signing the console's cookies never encrypts anything itself)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=PURPOSE).derive(session_key)


def seal(token: str, key: bytes, subject: str) -> str:
    return seal_bytes(token.encode(), key, PURPOSE + subject.encode(), VERSION)


def open_sealed(text: str | None, key: bytes, subject: str) -> str | None:
    """The token `seal` sealed for `subject` under `key`, or None for anything else (another
    key's, another person's, altered, not a seal at all)."""
    plain = open_bytes(text, key, PURPOSE + subject.encode(), VERSION)
    try:
        return None if plain is None else plain.decode()
    except UnicodeDecodeError:
        return None


class ProviderTokens:
    """The app's one OpenID client, and people's refresh tokens kept sealed in the store with it:
    kept at each sign-in, used when a person's command line renews its key."""

    def __init__(self, client: OidcClient, session_key: bytes) -> None:
        self.client = client
        self._key = sealing_key(session_key)

    async def keep(self, store: Store, person: PersonRecord, refresh_token: str | None) -> None:
        """The token the provider gave at this sign-in, sealed (none: the old one dropped, so the
        gateway never asks with a token the provider has replaced)."""
        sealed = seal(refresh_token, self._key, person.subject) if refresh_token else None
        await store.set_person_provider_token(person.id, sealed)

    async def recheck(self, store: Store, person: PersonRecord, *, again: bool = True) -> PersonRecord:
        """The person as the provider says they are now (their groups, address and name, kept as a
        sign-in keeps them), where it gave the gateway a refresh token; as the store has them where
        it did not. Raises OidcError when the provider no longer vouches for them (their token is
        dropped: they sign in again), ProviderUnavailable when it cannot be asked."""
        sealed = await store.person_provider_token(person.id)
        token = open_sealed(sealed, self._key, person.subject)
        if token is None:
            return person
        try:
            identity = await self.client.refresh(token)
        except ProviderUnavailable:
            raise
        except OidcError:
            # A provider that rotates its refresh tokens refuses the old one once another renewal
            # (or replica) has used it: with a newer one kept meanwhile, ask with that.
            if again and await store.person_provider_token(person.id) != sealed:
                return await self.recheck(store, person, again=False)
            await store.end_provider_trust(person.id)  # no renewal gets past it by asking again
            raise
        if identity.subject != person.subject:
            await store.end_provider_trust(person.id)
            raise OidcError("the identity provider answered for someone else")
        now = await store.person_signed_in(
            person.subject, identity.email or person.email, identity.name or person.name, identity.groups
        )
        if identity.refresh_token:  # a provider that rotates its refresh tokens gave a new one
            await self.keep(store, now, identity.refresh_token)
        return now


class Rechecks:
    """`[oidc] recheck_minutes`: every so often, each person who has keys in use is asked about
    again, as a renewal asks: their groups brought up to date (their policy follows at once), and
    the keys of one the provider no longer vouches for revoked, so that leaving the company ends
    their access within minutes, not at their key's end. A provider that cannot be reached is
    skipped until the next round."""

    def __init__(
        self, store: Store, provider: ProviderTokens, minutes: int, forget_key: Callable[[str], None], now: Clock
    ) -> None:
        self._store = store
        self._provider = provider
        self._seconds = minutes * 60
        self._forget_key = forget_key
        self._now = now

    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """aiohttp cleanup context: the loop, for as long as the app runs."""
        running = asyncio.create_task(self._loop(), context=contextvars.Context())
        yield
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._seconds)
            try:
                await self.round()
            except Exception:  # the store away, say: the next round tries again
                log.exception("re-checking people with the identity provider failed")

    async def round(self) -> int:
        """One pass over the people with keys in use; how many lost their keys."""
        ended = 0
        now = self._now()
        after = None
        while people := await self._store.list_people(limit=500, after=after):
            after = people[-1].id
            for person in people:
                if person.disabled:
                    continue
                live = [
                    k for k in await self._store.list_person_keys(person.id) if not k.revoked and not k.expired(now)
                ]
                if not live:
                    continue
                try:
                    await self._provider.recheck(self._store, person)
                except ProviderUnavailable as down:
                    log.warning("the identity provider cannot be reached to re-check people: %s", down)
                    return ended
                except OidcError:
                    for key in live:
                        await changes.revoke_key(self._store, PROVIDER_ACTOR, key, forget_key=self._forget_key)
                    ended += 1
        return ended
