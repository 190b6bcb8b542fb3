"""`ezat-gateway login`'s server side (RFC 8628's device authorization grant, and RFC 6749's refresh
grant), over HTTP through a real gateway on loopback with a real OpenID provider
(tests/oidc_provider.py): a command line asks for a sign-in, a person signed in through the
provider approves it on /console/device, and the command line's poll gets a key that works and
expires as their policy says; polled too fast, denied, expired, a device code used twice, a code
typed in lower case with spaces; renewal (a new key, the renewal token rotated) and its refusal
once the person is disabled or has left every policy's group; an admin token's session, which
cannot approve; and `next`, which takes only a console path. Then the store's part, on SQLite and
PostgreSQL: grants polled, approved once, cleaned up; renewal tokens rotated and revoked."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode, urlsplit

import aiohttp
import pytest

from gateway.admin import device
from gateway.admin.console.identity import local_next
from gateway.config import PolicyConfig
from gateway.storage import AuditNote, DeviceGrant, RenewalRecord, open_store
from gateway.storage.records import (
    DEVICE_APPROVED,
    DEVICE_DENIED,
    DEVICE_EXPIRED,
    DEVICE_PENDING,
    DEVICE_TOO_SOON,
    DEVICE_USED,
    SLOW_DOWN_SECONDS,
)
from tests.oidc_provider import add_user, authorize, running_provider
from tests.support import make_config
from tests.test_console import ADMIN, ROOT_TOKEN, Browserless, csrf, secrets_in
from tests.test_console_oidc import ANA, BEN, CAT, chat, oidc_config, signed_in_as
from tests.test_storage import digest, query

POLICIES = (
    PolicyConfig(group="eng", models=("anthropic/*",), rpm=100, key_ttl_hours=6),
    PolicyConfig(group="platform", key_ttl_hours=12),
)
USER_CODE = re.compile(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}")
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


@pytest.fixture
def issuer():
    with running_provider() as url:
        yield url


@pytest.fixture
async def people(issuer):
    await add_user(issuer, ANA, email="ana@example.com", name="Ana", groups=["platform"])
    await add_user(issuer, BEN, email="ben@example.com", name="Ben", groups=["finance"])  # no policy
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ezat.db'}"


@pytest.fixture
async def start(start_gateway, upstream, issuer, people):
    async def start(storage_url: str, **fields):
        config = replace(
            make_config(upstream.url, storage_url),
            admin=ADMIN,
            oidc=oidc_config(issuer),
            policies=POLICIES,
            **fields,
        )
        return await start_gateway(config, key_cache_seconds=0)

    return start


async def oauth(gateway, path: str, form: dict[str, str]) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(gateway.url + path, data=form) as response:
        assert response.headers["Cache-Control"] == "no-store"
        return response.status, await response.json()


async def begin(gateway) -> dict:
    status, body = await oauth(gateway, "/oauth/device/authorize", {"client_id": "ezat-gateway-cli"})
    assert status == 200, body
    return body


async def poll(gateway, device_code: str) -> tuple[int, dict]:
    return await oauth(
        gateway,
        "/oauth/token",
        {"grant_type": DEVICE_GRANT, "device_code": device_code, "client_id": "ezat-gateway-cli"},
    )


async def renew(gateway, refresh_token: str) -> tuple[int, dict]:
    return await oauth(
        gateway,
        "/oauth/token",
        {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": "ezat-gateway-cli"},
    )


async def decide(visitor: Browserless, user_code: str, action: str = "approve"):
    form_page = await visitor.page(f"/console/device?user_code={user_code}")
    return await visitor.call(
        "POST", "/console/device", {"user_code": user_code, "action": action, "csrf": csrf(form_page)}
    )


async def logged_in(gateway, sub: str = CAT) -> dict:
    """The whole flow: authorized, approved by `sub`, polled: the token answer."""
    started = await begin(gateway)
    person = await signed_in_as(gateway, sub)
    status, body, _ = await decide(person, started["user_code"])
    assert status == 200, body
    status, answer = await poll(gateway, started["device_code"])
    assert status == 200, answer
    return answer


async def admin_api(gateway, method: str, path: str) -> dict:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, gateway.url + "/admin/v1" + path, headers={"Authorization": f"Bearer {ROOT_TOKEN}"}) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def person_id(gateway, sub: str) -> int:
    [found] = [p["id"] for p in (await admin_api(gateway, "GET", "/people"))["data"] if p["subject"] == sub]
    return found


# --- The flow over HTTP ----------------------------------------------------------------------------


async def test_a_command_line_signs_in_through_a_person_who_approves_on_the_console(start, storage_url):
    gateway = await start(storage_url)
    started = await begin(gateway)
    assert set(started) == {
        "device_code",
        "user_code",
        "verification_uri",
        "verification_uri_complete",
        "expires_in",
        "interval",
    }
    assert re.fullmatch(r"[A-Za-z0-9_-]{43,}", started["device_code"])
    assert USER_CODE.fullmatch(started["user_code"])
    assert started["verification_uri"] == gateway.url + "/console/device"
    assert started["verification_uri_complete"] == f"{gateway.url}/console/device?user_code={started['user_code']}"
    assert (started["expires_in"], started["interval"]) == (600, 5)
    status, body = await poll(gateway, started["device_code"])
    assert (status, body["error"]) == (400, "authorization_pending"), body

    # Cat opens the complete URL: not signed in, she is sent to sign in and, through the
    # provider, back to the device page with her code.
    cat = Browserless(gateway.url)
    complete = urlsplit(started["verification_uri_complete"])
    status, _, headers = await cat.call("GET", f"{complete.path}?{complete.query}")
    assert status == 303 and headers["Location"].startswith("/console/sign-in?next=")
    sign_in = await cat.page(headers["Location"])
    [start_link] = re.findall(r'href="(/console/oidc/start[^"]*)"', sign_in)
    status, _, headers = await cat.call("GET", start_link.replace("&amp;", "&"))
    callback = urlsplit(await authorize(headers["Location"], CAT))
    status, body, _ = await cat.call("GET", f"{callback.path}?{callback.query}")
    back = f"/console/device?user_code={started['user_code']}"
    assert status == 200 and f'content="0;url={back}"' in body, body
    form_page = await cat.page(back)
    assert f'value="{started["user_code"]}"' in form_page and "6 hours" in form_page
    status, body, _ = await cat.call(
        "POST", "/console/device", {"user_code": started["user_code"], "action": "approve", "csrf": csrf(form_page)}
    )
    assert status == 200 and "signed in" in body

    # Polled again sooner than the interval: an approved grant is not slowed down (only pending ones are).
    status, answer = await poll(gateway, started["device_code"])
    assert status == 200, answer
    assert set(answer) == {"access_token", "token_type", "expires_in", "refresh_token"}
    assert answer["access_token"].startswith("sk-ezat-") and answer["token_type"] == "Bearer"
    assert 6 * 3600 - 60 < answer["expires_in"] <= 6 * 3600
    assert await chat(gateway, answer["access_token"]) == 200

    [key] = [k for k in (await admin_api(gateway, "GET", "/keys"))["data"] if k["name"] == "ezat-gateway login"]
    lives = datetime.fromisoformat(key["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=6) - timedelta(minutes=1) < lives <= timedelta(hours=6)
    assert key["person_id"] == await person_id(gateway, CAT) and key["models"] == ["anthropic/*"]
    entries = (await admin_api(gateway, "GET", "/audit"))["data"]
    assert any(e["action"] == "key.create" and e["actor"] == "cat@example.com" for e in entries)

    # The device code was used: never again.
    status, body = await poll(gateway, started["device_code"])
    assert (status, body["error"]) == (400, "invalid_grant") and "used already" in body["error_description"]
    # Only digests are kept: neither the device code nor the renewal token is in the database.
    grants = await query(storage_url, "SELECT device_sha256 FROM device_grants")
    renewals = await query(storage_url, "SELECT token_sha256 FROM renewal_tokens")
    assert (digest(started["device_code"]),) in grants and renewals == [(digest(answer["refresh_token"]),)]
    for table in ("device_grants", "renewal_tokens"):
        every = repr(await query(storage_url, f"SELECT * FROM {table}"))
        assert started["device_code"] not in every and answer["refresh_token"] not in every


async def test_polled_faster_than_the_interval_is_slow_down_and_the_interval_grows(start, sqlite_url):
    gateway = await start(sqlite_url)
    started = await begin(gateway)
    status, body = await poll(gateway, started["device_code"])
    assert body["error"] == "authorization_pending"
    status, body = await poll(gateway, started["device_code"])
    assert (status, body["error"]) == (400, "slow_down")
    assert "wait 10 seconds" in body["error_description"]  # 5, and 5 more (RFC 8628 §3.5)
    [(interval,)] = await query(sqlite_url, "SELECT interval_seconds FROM device_grants")
    assert interval == 5 + SLOW_DOWN_SECONDS


async def test_a_denied_sign_in_is_access_denied(start, sqlite_url):
    gateway = await start(sqlite_url)
    started = await begin(gateway)
    cat = await signed_in_as(gateway, CAT)
    status, body, _ = await decide(cat, started["user_code"], "deny")
    assert status == 200 and "gets no key" in body
    status, body = await poll(gateway, started["device_code"])
    assert (status, body["error"]) == (400, "access_denied")
    status, body, _ = await decide(cat, started["user_code"], "approve")  # too late to change her mind
    assert status == 400 and "denied already" in body


async def test_an_expired_sign_in_is_expired_token_and_cannot_be_approved(start, sqlite_url, monkeypatch):
    gateway = await start(sqlite_url)
    monkeypatch.setattr(device, "EXPIRES_IN", 1)
    started = await begin(gateway)
    assert started["expires_in"] == 1
    await asyncio.sleep(1.2)
    status, body = await poll(gateway, started["device_code"])
    assert (status, body["error"]) == (400, "expired_token")
    status, body, _ = await decide(await signed_in_as(gateway, CAT), started["user_code"])
    assert status == 400 and "has expired" in body


async def test_unknown_codes_are_refused(start, sqlite_url):
    gateway = await start(sqlite_url)
    status, body = await poll(gateway, "not-a-device-code-this-gateway-gave")
    assert (status, body["error"]) == (400, "invalid_grant")
    cat = await signed_in_as(gateway, CAT)
    status, body, _ = await decide(cat, "BCDF-GHJK")  # no such grant
    assert status == 400 and "No command line is waiting" in body
    status, body, _ = await decide(cat, "AEIO-U123")  # not a code at all
    assert status == 400 and "not a code" in body


async def test_a_user_code_typed_in_lower_case_with_spaces_is_the_same_code(start, sqlite_url):
    gateway = await start(sqlite_url)
    started = await begin(gateway)
    typed = " " + started["user_code"].lower().replace("-", " ") + " "  # "bcdf ghjk", as one reads it out
    cat = await signed_in_as(gateway, CAT)
    status, body, _ = await decide(cat, typed)
    assert status == 200 and started["user_code"] in body
    status, answer = await poll(gateway, started["device_code"])
    assert status == 200 and await chat(gateway, answer["access_token"]) == 200


async def test_renewal_gives_a_new_working_key_and_a_new_renewal_token(start, storage_url):
    gateway = await start(storage_url)
    first = await logged_in(gateway)
    status, renewed = await renew(gateway, first["refresh_token"])
    assert status == 200, renewed
    assert renewed["access_token"] != first["access_token"] and renewed["refresh_token"] != first["refresh_token"]
    assert renewed["refresh_token"].startswith("ezat-renew-") and 6 * 3600 - 60 < renewed["expires_in"]
    assert await chat(gateway, renewed["access_token"]) == 200
    status, body = await renew(gateway, first["refresh_token"])  # rotated: the old one is spent
    assert (status, body["error"]) == (400, "invalid_grant")
    status, again = await renew(gateway, renewed["refresh_token"])
    assert status == 200 and await chat(gateway, again["access_token"]) == 200
    keys = [k for k in (await admin_api(gateway, "GET", "/keys"))["data"] if k["name"] == "ezat-gateway login"]
    assert len(keys) == 3 and {k["person_id"] for k in keys} == {await person_id(gateway, CAT)}


async def test_renewal_is_refused_once_the_person_is_disabled(start, storage_url):
    gateway = await start(storage_url)
    answer = await logged_in(gateway)
    cat = await person_id(gateway, CAT)
    await admin_api(gateway, "POST", f"/people/{cat}/disable")
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant") and "disabled" in body["error_description"]
    await admin_api(gateway, "POST", f"/people/{cat}/enable")  # the token stays revoked: log in again
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant") and "revoked" in body["error_description"]
    assert answer["refresh_token"] not in body["error_description"]


async def test_renewal_is_refused_once_the_person_left_every_policys_group(start, sqlite_url, issuer):
    gateway = await start(sqlite_url)
    answer = await logged_in(gateway)
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["finance"])
    await signed_in_as(gateway, CAT)  # her groups as of this sign-in
    status, body = await renew(gateway, answer["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant") and "policy" in body["error_description"]


async def test_only_a_person_in_a_policys_group_approves(start, sqlite_url):
    gateway = await start(sqlite_url)
    started = await begin(gateway)
    admin = Browserless(gateway.url)
    await admin.sign_in(ROOT_TOKEN)
    status, body, _ = await admin.call("GET", f"/console/device?user_code={started['user_code']}")
    assert status == 403 and "Only a person" in body and "/console/oidc/start?next=" in body
    page = await admin.page("/console/keys")
    status, body, _ = await admin.call(
        "POST", "/console/device", {"user_code": started["user_code"], "action": "approve", "csrf": csrf(page)}
    )
    assert status == 403 and "Only a person" in body
    ben = await signed_in_as(gateway, BEN)  # in "finance": no policy
    status, body, _ = await ben.call("GET", f"/console/device?user_code={started['user_code']}")
    assert status == 403 and "has a policy" in body
    status, body = await poll(gateway, started["device_code"])
    assert body["error"] == "authorization_pending"  # nobody approved it
    stranger = Browserless(gateway.url)  # no session: the POST is refused as every console POST is
    status, _, _ = await stranger.call("POST", "/console/device", {"user_code": started["user_code"]})
    assert status == 403


async def test_next_takes_only_a_console_path(start, sqlite_url):
    gateway = await start(sqlite_url)
    for elsewhere in ("https://evil.example/console", "//evil.example/console", "/\\evil.example", "/admin/v1/keys"):
        visitor = Browserless(gateway.url)
        async with aiohttp.ClientSession() as http:
            url = gateway.url + "/console/sign-in"
            async with http.get(url, params={"next": elsewhere}) as response:
                sign_in = await response.text()
        assert 'href="/console/oidc/start"' in sign_in and "evil" not in sign_in
        # Past the sign-in page: the provider's way, and an admin token's.
        status, _, headers = await visitor.call("GET", "/console/oidc/start?" + urlencode({"next": elsewhere}))
        callback = urlsplit(await authorize(headers["Location"], CAT))
        status, body, _ = await visitor.call("GET", f"{callback.path}?{callback.query}")
        assert status == 200 and 'content="0;url=/console"' in body
        token_visitor = Browserless(gateway.url)
        form = await token_visitor.page("/console/sign-in")
        status, _, headers = await token_visitor.call(
            "POST", "/console/sign-in", {"token": ROOT_TOKEN, "csrf": csrf(form), "next": elsewhere}
        )
        assert (status, headers["Location"]) == (303, "/console")
    for refused in ("/console/../admin", "/console#x", "/console/ x", "/consoles", "/console/\u00e9", ""):
        assert local_next(refused) is None, refused
    for taken in ("/console", "/console/device?user_code=BCDF-GHJK", "/console/me"):
        assert local_next(taken) == taken


async def test_a_key_made_on_the_console_needs_no_name(start, sqlite_url):
    """The console's Make a key and login make keys one way (policies.make_person_key): a name
    is optional on the console, as login's keys have theirs."""
    gateway = await start(sqlite_url)
    cat = await signed_in_as(gateway, CAT)
    mine = await cat.page("/console/me")
    status, body, _ = await cat.call("POST", "/console/me/keys", {"name": "", "csrf": csrf(mine)})
    assert status == 200 and "(no name) was made" in body
    [secret] = secrets_in(body)
    assert await chat(gateway, secret) == 200


async def test_without_oidc_the_routes_say_so_in_oauths_envelope(start_gateway, upstream):
    gateway = await start_gateway(make_config(upstream.url))
    for path in ("/oauth/device/authorize", "/oauth/token"):
        status, body = await oauth(gateway, path, {"client_id": "ezat-gateway-cli"})
        assert (status, body["error"]) == (404, "unsupported")


async def test_requests_the_contract_refuses(start, sqlite_url):
    gateway = await start(sqlite_url)
    status, body = await oauth(gateway, "/oauth/device/authorize", {"client_id": "someone-else"})
    assert (status, body["error"]) == (401, "invalid_client") and "someone-else" not in body["error_description"]
    status, body = await oauth(gateway, "/oauth/device/authorize", {})
    assert (status, body["error"]) == (401, "invalid_client")
    status, body = await oauth(gateway, "/oauth/token", {"grant_type": "password", "client_id": "ezat-gateway-cli"})
    assert (status, body["error"]) == (400, "unsupported_grant_type")
    status, body = await oauth(gateway, "/oauth/token", {"grant_type": DEVICE_GRANT, "client_id": "ezat-gateway-cli"})
    assert (status, body["error"]) == (400, "invalid_request") and "device_code" in body["error_description"]
    status, body = await renew(gateway, "ezat-renew-not-one-this-gateway-gave")
    assert (status, body["error"]) == (400, "invalid_grant") and "unknown" in body["error_description"]
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/oauth/token", json={"grant_type": DEVICE_GRANT, "client_id": "ezat-gateway-cli"}
        ) as response:
            assert response.status == 400 and (await response.json())["error"] == "invalid_request"
        async with http.post(
            gateway.url + "/oauth/token",
            data="grant_type=refresh_token&grant_type=refresh_token&client_id=ezat-gateway-cli&refresh_token=x",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        ) as response:
            body = await response.json()
            assert response.status == 400 and body["error"] == "invalid_request" and "more than once" in str(body)


# --- The store's part, on SQLite and PostgreSQL ----------------------------------------------------


@pytest.fixture
async def store(storage_url):
    opened = open_store(storage_url)
    await opened.open()
    yield opened
    await opened.close()


def grant(code: str, user_code: str, *, lives: float = 600, interval: int = 5, made: datetime | None = None):
    made = made or datetime.now(UTC)
    return DeviceGrant(
        digest(code), user_code, "ezat-gateway-cli", made, made + timedelta(seconds=lives), interval, DEVICE_PENDING
    )


async def test_the_store_polls_a_grant_as_records_polled_says(store):
    alice = await store.person_signed_in("idp|alice", "alice@example.com", "Alice", ["eng"])
    made = grant("device-1", "BCDFGHJK", interval=1)
    assert await store.create_device_grant(made)
    assert not await store.create_device_grant(grant("device-2", "BCDFGHJK"))  # its user code is taken
    assert await store.find_device_grant("BCDFGHJK") == made
    assert await store.poll_device_grant(digest("no-such-device")) is None

    after, found = await store.poll_device_grant(digest("device-1"))
    assert found == DEVICE_PENDING and after.last_polled_at is not None
    after, found = await store.poll_device_grant(digest("device-1"))
    assert found == DEVICE_TOO_SOON and after.interval == 1 + SLOW_DOWN_SECONDS
    assert (await store.find_device_grant("BCDFGHJK")).interval == 1 + SLOW_DOWN_SECONDS

    decided = await store.decide_device_grant("BCDFGHJK", alice.id, True)
    assert (decided.status, decided.person_id) == (DEVICE_APPROVED, alice.id)
    assert await store.decide_device_grant("BCDFGHJK", alice.id, False) is None  # decided already
    # Two polls at once: exactly one finds it approved (and uses it).
    results = await asyncio.gather(*(store.poll_device_grant(digest("device-1")) for _ in range(4)))
    assert sorted(found for _, found in results) == [DEVICE_APPROVED] + [DEVICE_USED] * 3
    assert (await store.find_device_grant("BCDFGHJK")).status == DEVICE_USED


async def test_the_store_denies_expires_and_cleans_up_grants(store, storage_url):
    bob = await store.person_signed_in("idp|bob", "bob@example.com", "Bob", ["eng"])
    assert await store.create_device_grant(grant("denied", "CDFGHJKL"))
    assert (await store.decide_device_grant("CDFGHJKL", bob.id, False)).status == DEVICE_DENIED
    assert (await store.poll_device_grant(digest("denied")))[1] == DEVICE_DENIED

    long_ago = datetime.now(UTC) - timedelta(hours=2)
    assert await store.create_device_grant(grant("old", "DFGHJKLM", made=long_ago))
    assert await store.create_device_grant(grant("late", "FGHJKLMN", lives=-1))  # just expired
    assert (await store.poll_device_grant(digest("late")))[1] == DEVICE_EXPIRED
    assert await store.decide_device_grant("FGHJKLMN", bob.id, True) is None
    # A new grant deletes those expired over an hour ago, and takes an expired grant's user code.
    assert await store.create_device_grant(grant("new", "FGHJKLMN"))
    left = {row[0] for row in await query(storage_url, "SELECT device_sha256 FROM device_grants")}
    assert left == {digest("denied"), digest("new")}


async def test_the_store_rotates_renewal_tokens_and_revokes_them_when_the_person_is_disabled(store, storage_url):
    carol = await store.person_signed_in("idp|carol", "carol@example.com", "Carol", ["eng"])
    now = datetime.now(UTC)
    first = RenewalRecord(digest("ezat-renew-1"), carol.id, now, now + timedelta(days=30))
    await store.create_renewal(first)
    assert await store.find_renewal(first.token_sha256) == first
    second = first._replace(token_sha256=digest("ezat-renew-2"))
    assert await store.rotate_renewal(first.token_sha256, second)
    assert await store.find_renewal(first.token_sha256) is None
    assert not await store.rotate_renewal(first.token_sha256, first)  # spent: once only
    # Two renewals at once with one token: one wins.
    thirds = [second._replace(token_sha256=digest(f"ezat-renew-3{n}")) for n in range(3)]
    won = await asyncio.gather(*(store.rotate_renewal(second.token_sha256, third) for third in thirds))
    assert sorted(won) == [False, False, True]

    # An expired token is deleted as another is made.
    stale = RenewalRecord(digest("ezat-renew-stale"), carol.id, now - timedelta(days=31), now - timedelta(days=1))
    await store.create_renewal(stale)
    await store.create_renewal(first._replace(token_sha256=digest("ezat-renew-4")))
    assert await store.find_renewal(stale.token_sha256) is None

    await store.set_person_disabled(carol.id, True, audit=AuditNote("root", "person.disable"))
    live = [r for r in await query(storage_url, "SELECT token_sha256, revoked_at FROM renewal_tokens")]
    assert live and all(revoked is not None for _, revoked in live)
    [winner] = [third for third, ok in zip(thirds, won) if ok]
    assert (await store.find_renewal(winner.token_sha256)).revoked_at is not None
    assert not await store.rotate_renewal(winner.token_sha256, first)  # revoked: no renewal


async def test_one_address_asking_for_many_sign_ins_is_slowed_down(start, sqlite_url):
    """/oauth/device/authorize needs no credential and writes a row each time: an address gets
    AUTHORIZATIONS_PER_MINUTE a minute, then 429 slow_down with retry-after."""
    gateway = await start(sqlite_url)
    for _ in range(device.AUTHORIZATIONS_PER_MINUTE):
        await begin(gateway)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/oauth/device/authorize", data={"client_id": "ezat-gateway-cli"}
        ) as response:
            body = await response.json()
            assert (response.status, body["error"]) == (429, "slow_down")
            assert 0 < int(response.headers["Retry-After"]) <= 60
