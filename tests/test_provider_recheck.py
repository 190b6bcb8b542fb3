"""A renewal asks the identity provider again: the refresh token it gave at the person's sign-in is
kept sealed in the store, and each renewal of their command line's key refreshes it there. The
person's new groups count at once, without a sign-in; a person the provider no longer vouches for
(their tokens revoked there, as when they leave the company) gets no new key; a provider that is
down renews nothing but says to try again. With the real OpenID provider on loopback."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from gateway.admin.oidc import OidcClient
from gateway.admin.provider_tokens import ProviderTokens, Rechecks, open_sealed, seal, sealing_key
from gateway.app import STORE
from gateway.storage import open_store
from tests.oidc_provider import add_user, revoke_tokens, running_provider
from tests.support import make_config
from tests.test_console import ADMIN
from tests.test_console_oidc import ANA, CAT, chat, oidc_config
from tests.test_device_flow import POLICIES, issuer, logged_in, people, renew, start  # noqa: F401 (fixtures)


@pytest.fixture
def storage_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ezat.db'}"


async def sealed_token_of(storage_url: str, subject: str) -> str | None:
    store = open_store(storage_url)
    await store.open()
    try:
        person = await store.find_person_by_subject(subject)
        assert person is not None
        return await store.person_provider_token(person.id)
    finally:
        await store.close()


async def test_the_providers_refresh_token_is_kept_sealed(start, storage_url, issuer):
    gateway = await start(storage_url)
    await logged_in(gateway)
    sealed = await sealed_token_of(storage_url, CAT)
    assert sealed is not None and sealed.startswith("ezat-idp1.")
    # It opens, under the gateway's key, to a token the provider takes; the store holds it only sealed.
    token = open_sealed(sealed, sealing_key(ADMIN.session_signing_key), CAT)
    assert token and token not in sealed
    client = OidcClient(oidc_config(issuer))
    try:
        assert (await client.refresh(token)).subject == CAT
    finally:
        await client.close()
    # Bound to its person: the same seal does not open as someone else's, nor under another key.
    key = sealing_key(b"k" * 32)
    assert open_sealed(seal("a-refresh-token", key, CAT), key, CAT) == "a-refresh-token"
    assert open_sealed(seal("a-refresh-token", key, CAT), key, "ana") is None
    assert open_sealed(seal("a-refresh-token", key, CAT), sealing_key(b"j" * 32), CAT) is None


async def test_a_renewal_takes_the_groups_the_provider_says_now(start, storage_url, issuer):
    gateway = await start(storage_url)
    answer = await logged_in(gateway)
    # Cat leaves "eng" at the provider; she does not sign in to the console again.
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["finance"])
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant") and "policy" in body["error_description"]
    # Back in "eng" at the provider: the same renewal token (a refused renewal spends none) gets a key.
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])
    status, body = await renew(gateway, answer["refresh_token"])
    assert status == 200, body
    assert await chat(gateway, body["access_token"]) == 200


async def test_a_person_the_provider_no_longer_vouches_for_gets_no_key(start, storage_url, issuer):
    gateway = await start(storage_url)
    answer = await logged_in(gateway)
    await revoke_tokens(issuer, CAT)  # as when she leaves the company
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant")
    assert "no longer vouches" in body["error_description"]
    assert await sealed_token_of(storage_url, CAT) is None  # dropped: she signs in again
    # Asking again with the same renewal token gets no key either: it was revoked with the trust.
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant") and "revoked" in body["error_description"]


async def test_a_provider_that_is_down_renews_nothing_and_says_so(start_gateway, upstream, storage_url):
    with running_provider() as issuer:
        await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])
        config = replace(
            make_config(upstream.url, storage_url), admin=ADMIN, oidc=oidc_config(issuer), policies=POLICIES
        )
        gateway = await start_gateway(config, key_cache_seconds=0)
        answer = await logged_in(gateway)
    # The provider has stopped.
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (503, "temporarily_unavailable") and "try again" in body["error_description"]
    status, body = await renew(gateway, answer["refresh_token"])  # the token was not spent
    assert status == 503


async def test_a_recheck_round_revokes_the_keys_of_whom_the_provider_no_longer_vouches_for(start, storage_url, issuer):
    """[oidc] recheck_minutes' round, on the gateway's own store: Cat left (her tokens revoked at
    the provider), so her keys are revoked, audited as the identity provider's doing; Ana stays."""
    gateway = await start(storage_url)
    cats_login = await logged_in(gateway)
    cats = cats_login["access_token"]
    anas = (await logged_in(gateway, ANA))["access_token"]
    await revoke_tokens(issuer, CAT)
    provider = ProviderTokens(OidcClient(oidc_config(issuer)), ADMIN.session_signing_key)
    try:
        rechecks = Rechecks(gateway.app[STORE], provider, 60, lambda digest: None, lambda: datetime.now(UTC))
        assert await rechecks.round() == 1
        assert await rechecks.round() == 0  # her keys are gone: nobody left to end
    finally:
        await provider.client.close()
    assert await chat(gateway, cats) == 401 and await chat(gateway, anas) == 200
    status, body = await renew(gateway, cats_login["refresh_token"])  # nor does her command line renew
    assert (status, body["error"]) == (400, "invalid_grant")
    entries = await gateway.app[STORE].audit_log(limit=20)
    assert any(e.action == "key.revoke" and e.actor == "identity provider" for e in entries)
