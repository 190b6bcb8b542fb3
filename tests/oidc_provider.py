"""A real OpenID provider on loopback for the tests: oidc-provider-mock (a Flask app, Authlib
inside) served from a thread of this process, and helpers that act as the provider's admin and as
a person's browser on it. Any client id and secret are accepted; a person is whoever the test says
(`authorize` POSTs their subject to the authorization URL, as the provider's form would).

Its server is synchronous: tests on the event loop talk to it with aiohttp, never with a blocking
client, or the loop would stall the requests the gateway's own client makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from urllib.parse import quote

import aiohttp
import oidc_provider_mock
import pytest


@contextlib.contextmanager
def running_provider(**options: object) -> Iterator[str]:
    """oidc-provider-mock on a free loopback port (`options` go to its `run_server_in_thread`:
    require_nonce, issue_refresh_token, access_token_max_age, ...); yields its issuer URL, which is
    its address as this URL names it."""
    with oidc_provider_mock.run_server_in_thread(**options) as server:
        yield f"http://127.0.0.1:{server.server_port}"


@pytest.fixture
def oidc_issuer() -> Iterator[str]:
    """The issuer URL of a fresh provider, with no person known yet; stopped after the test."""
    with running_provider() as issuer:
        yield issuer


async def add_user(
    issuer: str, sub: str, *, email: str, name: str, groups: list[str] | str | None, **claims: object
) -> None:
    """Makes `sub` a person of the provider with these claims (it puts them in the ID token and
    in userinfo): `groups` under "groups" (None: no such claim), and any others as given, e.g.
    email_verified=False. Setting a person again replaces their claims."""
    body: dict[str, object] = {"email": email, "name": name, **claims}
    if groups is not None:
        body["groups"] = groups
    async with aiohttp.ClientSession() as session, session.put(f"{issuer}/users/{quote(sub, safe='')}", json=body) as r:
        assert r.status == 204, f"the provider refused the person {sub!r}: {r.status} {await r.text()}"


async def authorize(url: str, sub: str, *, deny: bool = False) -> str:
    """The callback URL (with its code and state) that the provider sends the browser to once `sub`
    approves the authorization request at `url` (start()'s URL); with deny=True, once they refuse."""
    form = {"sub": sub, "action": "deny"} if deny else {"sub": sub}
    async with aiohttp.ClientSession() as session, session.post(url, data=form, allow_redirects=False) as r:
        assert r.status == 302, f"the provider did not redirect: {r.status} {await r.text()}"
        return r.headers["Location"]


async def revoke_tokens(issuer: str, sub: str) -> None:
    """Revokes every access and refresh token the provider gave for `sub` (as an admin would
    when the person leaves): renewing their sign-in is refused from then on."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{issuer}/users/{quote(sub, safe='')}/revoke-tokens") as r,
    ):
        assert r.status == 204, f"the provider did not revoke {sub!r}'s tokens: {r.status}"
