"""The OpenID Connect relying party (gateway/admin/oidc.py): sign-in and renewal through a real
provider on loopback (oidc-provider-mock, tests/oidc_provider.py), and, for what a well-behaved
provider never does (a forged or expired ID token, a key it does not publish, a PKCE verifier it
checks, an answer too large or too slow), through FakeProvider: a small aiohttp provider whose
every answer the test sets, and which counts the requests it gets."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections import Counter
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import aiohttp
import pytest
from aiohttp import web
from joserfc import jwt
from joserfc.jwk import ECKey, Key, OctKey, RSAKey

from gateway.admin.oidc import Identity, OidcClient, OidcError, ProviderUnavailable
from gateway.config import OidcConfig
from tests.oidc_provider import add_user, authorize, oidc_issuer, revoke_tokens, running_provider  # noqa: F401
from tests.support import free_port

CLIENT_ID = "ezat-gateway"
# Characters that RFC 6749's form-encoding of Basic credentials changes: sent as they are, a
# provider that decodes them (as the RFC says it must) would read another secret.
CLIENT_SECRET = "s3cret:%+/ é-0123456789abcdefghijklmnop"
REDIRECT = "http://127.0.0.1:8080/console/oidc/callback"


def make_config(issuer: str, **fields: Any) -> OidcConfig:
    return OidcConfig(issuer=issuer, client_id=CLIENT_ID, client_secret=CLIENT_SECRET, **fields)


@pytest.fixture
async def clients():
    """Makes OidcClients (closed after the test)."""
    made: list[OidcClient] = []

    def make(issuer: str, *, clock=time.time, timeout: float = 10.0, **fields: Any) -> OidcClient:
        client = OidcClient(make_config(issuer, **fields), clock=clock, timeout=timeout)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


def query(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query))


async def sign_in(client: OidcClient, sub: str, **finish: str) -> Identity:
    """`sub` signs in through the provider's authorization URL, as their browser would go."""
    start = await client.start(REDIRECT)
    callback = await authorize(start.url, sub)
    kept = {"state": start.state, "nonce": start.nonce, "code_verifier": start.code_verifier} | finish
    return await client.finish(REDIRECT, query(callback), **kept)


def assert_shows_no_secret(error: Exception, *secrets: str) -> None:
    for secret in (CLIENT_SECRET, *secrets):
        assert secret not in str(error), f"{secret!r} shown in {error}"


# --- through oidc-provider-mock


async def test_a_person_signs_in_through_the_provider(oidc_issuer, clients):
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice Liddell", groups=["ops", "eng"])
    client = clients(oidc_issuer)

    start = await client.start(REDIRECT)
    assert start.url.startswith(f"{oidc_issuer}/oauth2/authorize?")
    params = query(start.url)
    assert params == {
        "response_type": "code",
        "client_id": CLIENT_ID,
        "redirect_uri": REDIRECT,
        "scope": "openid email profile",
        "state": start.state,
        "nonce": start.nonce,
        "code_challenge": params["code_challenge"],
        "code_challenge_method": "S256",
    }
    # PKCE's S256: the challenge is the unpadded base64url SHA-256 of the verifier the caller keeps.
    digest = hashlib.sha256(start.code_verifier.encode()).digest()
    assert params["code_challenge"] == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert 43 <= len(start.code_verifier) <= 128 and len(start.state) >= 43 and len(start.nonce) >= 43
    assert start.code_verifier not in repr(start)

    callback = await authorize(start.url, "alice")
    assert callback.startswith(REDIRECT + "?")
    assert query(callback)["state"] == start.state and query(callback)["code"]

    identity = await client.finish(
        REDIRECT, query(callback), state=start.state, nonce=start.nonce, code_verifier=start.code_verifier
    )
    assert (identity.subject, identity.email, identity.name, identity.groups) == (
        "alice",
        "alice@example.com",
        "Alice Liddell",
        ("ops", "eng"),
    )
    assert identity.refresh_token and identity.refresh_token not in repr(identity)


async def test_each_sign_in_has_its_own_state_nonce_and_verifier(oidc_issuer, clients):
    client = clients(oidc_issuer)
    first, second = await client.start(REDIRECT), await client.start(REDIRECT)
    assert len({first.state, second.state, first.nonce, second.nonce}) == 4
    assert first.code_verifier != second.code_verifier


@pytest.mark.parametrize(
    ("claimed", "groups"),
    [(["eng", "eng", 7, "ops"], ("eng", "ops")), ("eng", ("eng",)), (None, ()), ({"eng": True}, ())],
    ids=["list", "single string", "absent", "neither"],
)
async def test_the_groups_claim(oidc_issuer, clients, claimed, groups):
    await add_user(oidc_issuer, "bob", email="bob@example.com", name="Bob", groups=claimed)
    assert (await sign_in(clients(oidc_issuer), "bob")).groups == groups


async def test_groups_under_the_claim_the_config_names(oidc_issuer, clients):
    await add_user(oidc_issuer, "bob", email="bob@example.com", name="Bob", groups=["x"], roles=["console-admins"])
    assert (await sign_in(clients(oidc_issuer, groups_claim="roles"), "bob")).groups == ("console-admins",)


async def test_a_callback_with_another_state_is_refused_before_its_code_is_used(oidc_issuer, clients):
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=[])
    client = clients(oidc_issuer)
    start, other = await client.start(REDIRECT), await client.start(REDIRECT)
    params = query(await authorize(start.url, "alice"))
    for state in (other.state, "", start.state[:-1]):
        with pytest.raises(OidcError, match="state does not match") as refused:
            await client.finish(REDIRECT, params, state=state, nonce=start.nonce, code_verifier=start.code_verifier)
        assert_shows_no_secret(refused.value, params["code"])
    # Nothing was exchanged: the code still works with the right state.
    identity = await client.finish(
        REDIRECT, params, state=start.state, nonce=start.nonce, code_verifier=start.code_verifier
    )
    assert identity.subject == "alice"


async def test_a_nonce_mismatch_is_refused(oidc_issuer, clients):
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=[])
    client = clients(oidc_issuer)
    other = await client.start(REDIRECT)
    with pytest.raises(OidcError, match="ID token is for another sign-in"):
        await sign_in(client, "alice", nonce=other.nonce)


async def test_an_authorization_code_works_once(oidc_issuer, clients):
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=[])
    client = clients(oidc_issuer)
    start = await client.start(REDIRECT)
    params = query(await authorize(start.url, "alice"))
    kept = {"state": start.state, "nonce": start.nonce, "code_verifier": start.code_verifier}
    await client.finish(REDIRECT, params, **kept)
    with pytest.raises(OidcError, match="refused the sign-in: invalid_grant") as refused:
        await client.finish(REDIRECT, params, **kept)
    assert not isinstance(refused.value, ProviderUnavailable)
    assert_shows_no_secret(refused.value, params["code"])


async def test_a_person_who_refuses_at_the_provider(oidc_issuer, clients):
    client = clients(oidc_issuer)
    start = await client.start(REDIRECT)
    params = query(await authorize(start.url, "alice", deny=True))
    assert params["error"] == "access_denied"
    with pytest.raises(OidcError, match="the identity provider refused the sign-in: access_denied"):
        await client.finish(REDIRECT, params, state=start.state, nonce=start.nonce, code_verifier=start.code_verifier)


async def test_a_callback_from_another_issuer_or_without_a_code_is_refused(oidc_issuer, clients):
    client = clients(oidc_issuer)
    start = await client.start(REDIRECT)
    kept = {"state": start.state, "nonce": start.nonce, "code_verifier": start.code_verifier}
    with pytest.raises(OidcError, match="names another identity provider"):
        await client.finish(REDIRECT, {"code": "c", "state": start.state, "iss": "https://evil.example"}, **kept)
    with pytest.raises(OidcError, match="carries no authorization code"):
        await client.finish(REDIRECT, {"state": start.state}, **kept)


async def test_a_provider_error_is_shown_printable_and_short(oidc_issuer, clients):
    client = clients(oidc_issuer)
    start = await client.start(REDIRECT)
    params = {"error": "server_error\x1b[31m", "error_description": "<b>" + "x" * 5000 + "\n", "state": start.state}
    with pytest.raises(OidcError) as refused:
        await client.finish(REDIRECT, params, state=start.state, nonce=start.nonce, code_verifier=start.code_verifier)
    message = str(refused.value)
    assert message.startswith("the identity provider refused the sign-in: server_error [31m (<b>xxx")
    assert len(message) < 500 and message.isprintable()


async def test_addresses_outside_the_allowed_domains_are_refused(oidc_issuer, clients):
    client = clients(oidc_issuer, allowed_email_domains=("example.com", "example.org"))
    await add_user(oidc_issuer, "bob", email="bob@elsewhere.net", name="Bob", groups=["eng"])
    with pytest.raises(OidcError, match=r"^bob@elsewhere\.net is not an address this gateway accepts$"):
        await sign_in(client, "bob")
    # A subdomain is another domain.
    await add_user(oidc_issuer, "bob", email="bob@mail.example.com", name="Bob", groups=["eng"])
    with pytest.raises(OidcError, match="is not an address this gateway accepts"):
        await sign_in(client, "bob")
    # The domain in any case.
    await add_user(oidc_issuer, "carol", email="Carol@Example.ORG", name="Carol", groups=[])
    assert (await sign_in(client, "carol")).email == "Carol@Example.ORG"


async def test_an_address_the_provider_has_not_verified_counts_as_none(oidc_issuer, clients):
    await add_user(oidc_issuer, "dan", email="dan@example.com", name="Dan", groups=[], email_verified=False)
    assert (await sign_in(clients(oidc_issuer), "dan")).email == ""
    with pytest.raises(OidcError, match="vouches for no email address: this gateway accepts only @example.com"):
        await sign_in(clients(oidc_issuer, allowed_email_domains=("example.com",)), "dan")
    await add_user(oidc_issuer, "erin", email="erin@example.com", name="Erin", groups=[], email_verified="false")
    assert (await sign_in(clients(oidc_issuer), "erin")).email == ""


async def test_a_sign_in_is_renewed_with_its_refresh_token_until_it_is_revoked(oidc_issuer, clients):
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=["viewers"])
    client = clients(oidc_issuer)
    signed_in = await sign_in(client, "alice")
    assert signed_in.refresh_token

    renewed = await client.refresh(signed_in.refresh_token)
    assert (renewed.subject, renewed.email, renewed.name, renewed.groups) == (
        "alice",
        "alice@example.com",
        "Alice",
        ("viewers",),
    )
    assert renewed.refresh_token  # a new one, or the same when the provider does not rotate them

    # The person changes at the provider: a renewal sees them as they are now.
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=["admins"])
    assert (await client.refresh(renewed.refresh_token)).groups == ("admins",)

    await revoke_tokens(oidc_issuer, "alice")
    with pytest.raises(OidcError, match="refused the sign-in: invalid_grant") as refused:
        await client.refresh(renewed.refresh_token)
    assert not isinstance(refused.value, ProviderUnavailable)
    assert_shows_no_secret(refused.value, renewed.refresh_token)


async def test_a_renewal_checks_the_allowed_domains_again(oidc_issuer, clients):
    client = clients(oidc_issuer, allowed_email_domains=("example.com",))
    await add_user(oidc_issuer, "alice", email="alice@example.com", name="Alice", groups=[])
    signed_in = await sign_in(client, "alice")
    await add_user(oidc_issuer, "alice", email="alice@elsewhere.net", name="Alice", groups=[])
    with pytest.raises(OidcError, match="alice@elsewhere.net is not an address this gateway accepts"):
        await client.refresh(signed_in.refresh_token or "")


async def test_a_provider_out_of_reach(clients):
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    client = clients(issuer)
    for attempt in (client.start(REDIRECT), client.refresh("a-refresh-token")):
        with pytest.raises(ProviderUnavailable) as down:
            await attempt
        assert str(down.value) == (
            "the identity provider could not be reached"
            f" (discovery document at {issuer}/.well-known/openid-configuration): could not connect"
        )
    # Not kept failed: once the provider is up, the same client signs in.
    with running_provider(port=port) as up:
        assert up == issuer
        await add_user(issuer, "alice", email="alice@example.com", name="Alice", groups=[])
        assert (await sign_in(client, "alice")).subject == "alice"


async def test_a_provider_that_goes_away_after_discovery(clients):
    with running_provider() as issuer:
        client = clients(issuer)
        await add_user(issuer, "alice", email="alice@example.com", name="Alice", groups=[])
        signed_in = await sign_in(client, "alice")
    with pytest.raises(ProviderUnavailable, match=r"could not be reached \(token endpoint at .*/oauth2/token\)"):
        await client.refresh(signed_in.refresh_token or "")


async def test_close_closes_only_a_session_the_client_made(oidc_issuer):
    own = OidcClient(make_config(oidc_issuer))
    await own.start(REDIRECT)
    session = own._session
    await own.close()
    assert session is not None and session.closed

    async with aiohttp.ClientSession() as given:
        client = OidcClient(make_config(oidc_issuer), given)
        await client.start(REDIRECT)
        await client.close()
        assert not given.closed


def test_reprs_show_no_secret():
    config = make_config("https://login.example.com")
    identity = Identity("s", "e@example.com", "n", ("g",), refresh_token="refresh-secret")
    for shown in (repr(config), repr(OidcClient(config)), repr(identity)):
        assert CLIENT_SECRET not in shown and "refresh-secret" not in shown


# --- through FakeProvider


class FakeProvider:
    """An OpenID provider on loopback whose answers the test sets. Its authorization step is
    `authorize(url)`: it keeps the request's code challenge and nonce, and its token endpoint checks
    the verifier against that challenge (as a provider enforcing PKCE does), then answers with an ID
    token made by `id_token()`: signed with `key` (kid "k1", published in its JWKS) unless the test
    replaces `sign`, with the claims a valid token has, changed by `claims` (a value of None takes a
    claim out)."""

    CODE = "fake-authorization-code"
    ACCESS_TOKEN = "fake-access-token"
    REFRESH_TOKEN = "fake-refresh-token"

    def __init__(self) -> None:
        self.key: Key = RSAKey.generate_key(2048, {"kid": "k1"})
        self.published: list[Key] = [self.key]
        self.sign = lambda claims: jwt.encode({"alg": "RS256", "kid": "k1"}, claims, self.key)
        self.claims: dict[str, Any] = {}
        self.discovery: dict[str, Any] = {}  # changes to the discovery document (None takes a field out)
        self.userinfo: dict[str, Any] | None = None  # None: userinfo answers the ID token's claims
        self.token_answer: web.StreamResponse | None = None  # a fixed answer from the token endpoint
        self.token_delay = 0.0  # seconds the token endpoint waits before answering
        self.refresh_id_token = True  # whether a refresh answers with an ID token
        self.requests: Counter[str] = Counter()
        self.token_requests: list[tuple[dict[str, str], dict[str, str]]] = []  # (headers, form)
        self.challenge = self.nonce = ""
        self.runner: web.AppRunner | None = None
        self.issuer = ""

    async def start(self) -> FakeProvider:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._discovery)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_post("/token", self._token)
        app.router.add_get("/userinfo", self._userinfo)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.issuer = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def authorize(self, url: str) -> dict[str, str]:
        """The callback's query once the person approves the request at `url`."""
        params = query(url)
        self.challenge, self.nonce = params["code_challenge"], params["nonce"]
        return {"code": self.CODE, "state": params["state"]}

    def id_token(self, **changes: Any) -> str:
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": "u-1",
            "aud": CLIENT_ID,
            "exp": now + 300,
            "iat": now,
            "nonce": self.nonce,
            "email": "pat@example.com",
            "name": "Pat",
            "groups": ["eng"],
        }
        claims.update(self.claims | changes)
        return self.sign({k: v for k, v in claims.items() if v is not None})

    async def _discovery(self, request: web.Request) -> web.StreamResponse:
        self.requests["discovery"] += 1
        document = {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "userinfo_endpoint": f"{self.issuer}/userinfo",
            "response_types_supported": ["code"],
            "id_token_signing_alg_values_supported": ["RS256"],
        }
        document.update(self.discovery)
        if "status" in document:
            return web.Response(status=document["status"], headers={"Location": f"{self.issuer}/elsewhere"})
        return web.json_response({k: v for k, v in document.items() if v is not None})

    async def _jwks(self, request: web.Request) -> web.StreamResponse:
        self.requests["jwks"] += 1
        return web.json_response({"keys": [key.as_dict(private=False) for key in self.published]})

    async def _token(self, request: web.Request) -> web.StreamResponse:
        self.requests["token"] += 1
        form = {k: str(v) for k, v in (await request.post()).items()}
        self.token_requests.append((dict(request.headers), form))
        await asyncio.sleep(self.token_delay)
        if self.token_answer is not None:
            return self.token_answer
        tokens = {"access_token": self.ACCESS_TOKEN, "token_type": "Bearer", "expires_in": 3600}
        if form.get("grant_type") == "authorization_code":
            verifier = form.get("code_verifier", "")
            digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
            if form.get("code") != self.CODE or digest.rstrip(b"=").decode() != self.challenge:
                return web.json_response({"error": "invalid_grant", "error_description": "PKCE failed"}, status=400)
            return web.json_response(tokens | {"id_token": self.id_token(), "refresh_token": self.REFRESH_TOKEN})
        if form.get("grant_type") == "refresh_token" and form.get("refresh_token") == self.REFRESH_TOKEN:
            if self.refresh_id_token:
                tokens["id_token"] = self.id_token(nonce=None)
            return web.json_response(tokens)
        return web.json_response({"error": "invalid_grant"}, status=400)

    async def _userinfo(self, request: web.Request) -> web.StreamResponse:
        self.requests["userinfo"] += 1
        if request.headers.get("Authorization") != f"Bearer {self.ACCESS_TOKEN}":
            return web.json_response({"error": "invalid_token"}, status=401)
        if self.userinfo is not None:
            return web.json_response(self.userinfo)
        return web.json_response({"sub": "u-1", "email": "pat@example.com", "name": "Pat", "groups": ["eng"]})


@pytest.fixture
async def fake():
    provider = await FakeProvider().start()
    yield provider
    await provider.close()


async def fake_sign_in(client: OidcClient, fake: FakeProvider, **finish: str) -> Identity:
    start = await client.start(REDIRECT)
    kept = {"state": start.state, "nonce": start.nonce, "code_verifier": start.code_verifier} | finish
    return await client.finish(REDIRECT, fake.authorize(start.url), **kept)


def unsigned(claims: dict[str, Any]) -> str:
    """A token with alg "none": a header and claims, and no signature."""

    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'kid': 'k1'})}.{part(claims)}."


def tampered(token: str) -> str:
    """`token` with its claims changed (another person's address), its signature kept."""
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["email"] = "mallory@example.com"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{forged}.{signature}"


async def test_pkce_the_token_endpoint_gets_the_verifier_of_the_challenge(fake, clients):
    client = clients(fake.issuer)
    identity = await fake_sign_in(client, fake)
    assert (identity.subject, identity.email, identity.name, identity.groups) == (
        "u-1",
        "pat@example.com",
        "Pat",
        ("eng",),
    )
    assert identity.refresh_token == FakeProvider.REFRESH_TOKEN
    headers, form = fake.token_requests[-1]
    assert form == {
        "grant_type": "authorization_code",
        "code": FakeProvider.CODE,
        "redirect_uri": REDIRECT,
        "code_verifier": form["code_verifier"],
    }
    # A wrong verifier (another sign-in's) is refused by a provider that checks PKCE.
    other = await client.start(REDIRECT)
    with pytest.raises(OidcError, match=r"refused the sign-in: invalid_grant \(PKCE failed\)"):
        await fake_sign_in(client, fake, code_verifier=other.code_verifier)


async def test_the_client_authenticates_with_basic_credentials_form_encoded(fake, clients):
    await fake_sign_in(clients(fake.issuer), fake)
    headers, form = fake.token_requests[-1]
    scheme, _, encoded = headers["Authorization"].partition(" ")
    client_id, _, secret = base64.b64decode(encoded).decode().partition(":")
    assert scheme == "Basic" and (unquote(client_id), unquote(secret)) == (CLIENT_ID, CLIENT_SECRET)
    assert "client_secret" not in form


async def test_the_client_posts_its_credentials_where_the_provider_takes_only_that(fake, clients):
    fake.discovery["token_endpoint_auth_methods_supported"] = ["client_secret_post", "private_key_jwt"]
    await fake_sign_in(clients(fake.issuer), fake)
    headers, form = fake.token_requests[-1]
    assert "Authorization" not in headers
    assert (form["client_id"], form["client_secret"]) == (CLIENT_ID, CLIENT_SECRET)


def signed_by(key: Key, alg: str, kid: str | None) -> Any:
    header = {"alg": alg} | ({"kid": kid} if kid else {})
    return lambda claims: jwt.encode(header, claims, key, algorithms=[alg])


@pytest.mark.parametrize(
    ("forge", "refusal"),
    [
        (lambda fake: setattr(fake, "sign", signed_by(RSAKey.generate_key(2048), "RS256", "k1")), "does not verify"),
        (lambda fake: setattr(fake, "sign", unsigned), "signed with an algorithm it does not declare"),
        (lambda fake: setattr(fake, "sign", lambda c, s=fake.sign: tampered(s(c))), "does not verify"),
        (
            lambda fake: setattr(fake, "sign", signed_by(OctKey.import_key(CLIENT_SECRET.encode()), "HS256", "k1")),
            "signed with an algorithm it does not declare",
        ),
        (lambda fake: fake.claims.update(exp=int(time.time()) - 120), "has expired"),
        (lambda fake: fake.claims.update(exp=None), "lacks the exp claim"),
        (lambda fake: fake.claims.update(exp="tomorrow"), "malformed exp claim"),
        (lambda fake: fake.claims.update(iat=None), "lacks the iat claim"),
        (lambda fake: fake.claims.update(iat=int(time.time()) + 600), "wrong iat claim"),
        (lambda fake: fake.claims.update(aud="another-app"), "is for another application"),
        (lambda fake: fake.claims.update(aud=None), "lacks the aud claim"),
        (lambda fake: fake.claims.update(aud=["another-app", CLIENT_ID]), "is for another application"),
        (lambda fake: fake.claims.update(aud=[CLIENT_ID], azp="another-app"), "is for another application"),
        (lambda fake: fake.claims.update(iss="https://another-provider.example"), "is for another identity provider"),
        (lambda fake: fake.claims.update(iss=["https://another-provider.example", fake.issuer]), "malformed iss claim"),
        (lambda fake: fake.claims.update(nonce=None), "lacks the nonce claim"),
        (lambda fake: fake.claims.update(nonce="another"), "is for another sign-in"),
        (lambda fake: fake.claims.update(sub=None), "lacks the sub claim"),
        (lambda fake: fake.claims.update(sub=""), "sub claim"),
    ],
    ids=[
        "another key, same kid",
        "alg none",
        "tampered claims",
        "HS256 with the client secret",
        "expired",
        "no exp",
        "exp not a number",
        "no iat",
        "issued in the future",
        "another audience",
        "no audience",
        "several audiences without azp",
        "azp another client",
        "another issuer",
        "issuer a list",
        "no nonce",
        "another nonce",
        "no subject",
        "empty subject",
    ],
)
async def test_an_id_token_that_is_not_right_is_refused(fake, clients, forge, refusal):
    forge(fake)
    with pytest.raises(OidcError, match=refusal) as refused:
        await fake_sign_in(clients(fake.issuer), fake)
    assert not isinstance(refused.value, ProviderUnavailable)
    assert_shows_no_secret(refused.value, FakeProvider.ACCESS_TOKEN, FakeProvider.REFRESH_TOKEN, FakeProvider.CODE)


@pytest.mark.parametrize(
    "change",
    [
        lambda: {"exp": int(time.time()) - 30},  # within the minute of clock skew allowed (now, not at collection)
        lambda: {"aud": [CLIENT_ID, "another-app"], "azp": CLIENT_ID},
        lambda: {"aud": [CLIENT_ID]},
    ],
    ids=["expired within the leeway", "several audiences, azp this client", "one audience in a list"],
)
async def test_an_id_token_within_the_rules_is_accepted(fake, clients, change):
    fake.claims.update(change())
    assert (await fake_sign_in(clients(fake.issuer), fake)).subject == "u-1"


async def test_another_declared_algorithm(fake, clients):
    key = ECKey.generate_key("P-256", {"kid": "ec-1"})
    fake.published = [fake.key, key]
    fake.sign = signed_by(key, "ES256", "ec-1")
    fake.discovery["id_token_signing_alg_values_supported"] = ["ES256"]
    assert (await fake_sign_in(clients(fake.issuer), fake)).subject == "u-1"
    # RS256, which the provider does not declare, is refused though its key is published.
    fake.sign = signed_by(fake.key, "RS256", "k1")
    with pytest.raises(OidcError, match="signed with an algorithm it does not declare"):
        await fake_sign_in(clients(fake.issuer), fake)


async def test_an_unknown_kid_fetches_the_keys_again_at_most_once_a_minute(fake, clients):
    now = [time.time()]
    client = clients(fake.issuer, clock=lambda: now[0])
    await fake_sign_in(client, fake)
    assert fake.requests["jwks"] == 1  # fetched once, then kept
    await fake_sign_in(client, fake)
    assert fake.requests["jwks"] == 1

    fake.sign = signed_by(RSAKey.generate_key(2048), "RS256", "forged-1")
    with pytest.raises(OidcError, match="signed with a key it does not publish"):
        await fake_sign_in(client, fake)
    assert fake.requests["jwks"] == 2  # one refetch, in case the provider had rotated its keys
    fake.sign = signed_by(RSAKey.generate_key(2048), "RS256", "forged-2")
    with pytest.raises(OidcError, match="signed with a key it does not publish"):
        await fake_sign_in(client, fake)
    assert fake.requests["jwks"] == 2  # within the minute: none

    now[0] += 61
    with pytest.raises(OidcError, match="signed with a key it does not publish"):
        await fake_sign_in(client, fake)
    assert fake.requests["jwks"] == 3


async def test_a_rotated_key_is_found_by_fetching_the_keys_again(fake, clients):
    client = clients(fake.issuer)
    await fake_sign_in(client, fake)
    rotated = RSAKey.generate_key(2048, {"kid": "k2"})
    fake.published = [rotated]
    fake.sign = signed_by(rotated, "RS256", "k2")
    assert (await fake_sign_in(client, fake)).subject == "u-1"
    assert fake.requests["jwks"] == 2


async def test_a_token_without_kid_is_checked_with_the_one_key(fake, clients):
    fake.sign = signed_by(fake.key, "RS256", None)
    assert (await fake_sign_in(clients(fake.issuer), fake)).subject == "u-1"
    # Among several keys, a token must name its own.
    fake.published = [fake.key, RSAKey.generate_key(2048, {"kid": "k2"})]
    with pytest.raises(OidcError, match=r"names no key \(kid\), and it publishes several"):
        await fake_sign_in(clients(fake.issuer), fake)


async def test_a_published_symmetric_key_is_never_used(fake, clients):
    secret = OctKey.import_key(b"a-key-anyone-reading-the-jwks-would-know", {"kid": "k1"})
    fake.published = [secret]
    fake.discovery["id_token_signing_alg_values_supported"] = ["RS256", "HS256"]
    fake.sign = signed_by(secret, "HS256", "k1")
    with pytest.raises(ProviderUnavailable, match=r"signing keys \(JWKS\) hold no key this gateway can read"):
        await fake_sign_in(clients(fake.issuer), fake)


async def test_what_the_id_token_leaves_out_comes_from_userinfo(fake, clients):
    fake.claims.update(email=None, name=None, groups=None)
    fake.userinfo = {"sub": "u-1", "email": "pat@example.com", "email_verified": True, "name": "Pat", "groups": ["ops"]}
    identity = await fake_sign_in(clients(fake.issuer), fake)
    assert (identity.email, identity.name, identity.groups) == ("pat@example.com", "Pat", ("ops",))
    assert fake.requests["userinfo"] == 1

    fake.userinfo = {"sub": "someone-else", "email": "eve@example.com", "groups": ["admins"]}
    with pytest.raises(OidcError, match="userinfo answer is for another person"):
        await fake_sign_in(clients(fake.issuer), fake)

    # An ID token that says it all needs no userinfo.
    fake.claims.clear()
    await fake_sign_in(clients(fake.issuer), fake)
    assert fake.requests["userinfo"] == 2


async def test_an_unverified_address_from_userinfo_counts_as_none(fake, clients):
    fake.claims.update(email=None, email_verified=True)
    fake.userinfo = {"sub": "u-1", "email": "pat@example.com", "email_verified": False}
    assert (await fake_sign_in(clients(fake.issuer), fake)).email == ""


async def test_a_refresh_with_an_id_token_verifies_it_without_a_nonce(fake, clients):
    client = clients(fake.issuer)
    signed_in = await fake_sign_in(client, fake)
    fake.claims.update(groups=["admins"])
    renewed = await client.refresh(signed_in.refresh_token or "")
    assert (renewed.subject, renewed.groups, renewed.refresh_token) == ("u-1", ("admins",), FakeProvider.REFRESH_TOKEN)

    fake.sign = lambda c, s=fake.sign: tampered(s(c))
    with pytest.raises(OidcError, match="does not verify"):
        await client.refresh(FakeProvider.REFRESH_TOKEN)
    fake.sign = signed_by(fake.key, "RS256", "k1")
    fake.claims.update(aud="another-app")
    with pytest.raises(OidcError, match="for another application"):
        await client.refresh(FakeProvider.REFRESH_TOKEN)
    with pytest.raises(OidcError, match="refused the sign-in: invalid_grant"):
        await client.refresh("a-refresh-token-it-never-gave")


async def test_a_refresh_without_an_id_token_asks_userinfo(fake, clients):
    fake.refresh_id_token = False
    client = clients(fake.issuer)
    fake.userinfo = {"sub": "u-1", "email": "pat@example.com", "name": "Pat", "groups": ["ops"]}
    renewed = await client.refresh(FakeProvider.REFRESH_TOKEN)
    assert (renewed.subject, renewed.groups) == ("u-1", ("ops",))

    fake.discovery["userinfo_endpoint"] = None
    with pytest.raises(ProviderUnavailable, match="without an ID token, and offers no userinfo endpoint"):
        await clients(fake.issuer).refresh(FakeProvider.REFRESH_TOKEN)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"issuer": "http://127.0.0.1:1"}, "its issuer is not http://127.0.0.1:"),
        ({"token_endpoint": "http://provider.example/token"}, "its token_endpoint is missing or not an https URL"),
        ({"jwks_uri": None}, "its jwks_uri is missing"),
        ({"response_types_supported": ["id_token"]}, "does not offer the authorization-code flow"),
        ({"id_token_signing_alg_values_supported": ["none", "HS256"]}, "with no algorithm this gateway accepts"),
        ({"token_endpoint_auth_methods_supported": ["private_key_jwt"]}, "neither client_secret_basic nor"),
        ({"status": 302}, "discovery document answered 302"),
        ({"status": 503}, "discovery document answered 503"),
    ],
    ids=[
        "another issuer",
        "plain http off loopback",
        "no jwks_uri",
        "no code flow",
        "no asymmetric algorithm",
        "no secret-based auth",
        "a redirect",
        "down",
    ],
)
async def test_an_unusable_discovery_document_is_refused_and_not_kept(fake, clients, change, refusal):
    fake.discovery.update(change)
    client = clients(fake.issuer)
    with pytest.raises(ProviderUnavailable, match=refusal):
        await client.start(REDIRECT)
    assert fake.requests["discovery"] == 1
    fake.discovery.clear()
    assert (await client.start(REDIRECT)).url.startswith(f"{fake.issuer}/authorize?")
    assert fake.requests["discovery"] == 2
    await client.start(REDIRECT)
    assert fake.requests["discovery"] == 2  # kept once it is right


async def test_an_answer_over_a_megabyte_is_refused(fake, clients):
    fake.discovery["padding"] = "x" * (1024 * 1024)
    with pytest.raises(ProviderUnavailable, match="discovery document is larger than 1024 KB"):
        await clients(fake.issuer).start(REDIRECT)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (web.Response(status=500, text="oops"), "token endpoint answered 500"),
        (web.Response(status=200, text="<html>"), "token endpoint answered something other than a JSON object"),
        (web.json_response({"token_type": "Bearer"}), "answered without an access token"),
        (web.json_response({"access_token": "a", "token_type": "Bearer"}), "answered without an ID token"),
        (web.Response(status=302, headers={"Location": "/elsewhere"}), "token endpoint answered 302"),
    ],
    ids=["500", "not JSON", "no access token", "no ID token", "a redirect"],
)
async def test_a_token_endpoint_answering_garbage(fake, clients, answer, error):
    fake.token_answer = answer
    with pytest.raises(ProviderUnavailable, match=error):
        await fake_sign_in(clients(fake.issuer), fake)


async def test_a_provider_that_does_not_answer_in_time(fake, clients):
    fake.token_delay = 2.0
    started = time.monotonic()
    with pytest.raises(
        ProviderUnavailable, match=r"\(token endpoint at http://127.0.0.1:\d+/token\): no answer within 0.5 s"
    ):
        await fake_sign_in(clients(fake.issuer, timeout=0.5), fake)
    assert time.monotonic() - started < 1.5


async def test_a_refused_grant_shows_the_providers_reason_short(fake, clients):
    fake.token_answer = web.json_response(
        {"error": "invalid_client", "error_description": "bad secret " + "y" * 1000 + "\r\n"}, status=401
    )
    with pytest.raises(OidcError) as refused:
        await fake_sign_in(clients(fake.issuer), fake)
    assert not isinstance(refused.value, ProviderUnavailable)
    assert str(refused.value).startswith("the identity provider refused the sign-in: invalid_client (bad secret yyy")
    assert len(str(refused.value)) < 300 and str(refused.value).isprintable()
    assert_shows_no_secret(refused.value, FakeProvider.CODE)
