"""Signing in to the console through the company's identity provider, with a real OpenID provider
on loopback (oidc-provider-mock: tests/oidc_provider.py) in front of a real gateway and its store:
the role a person's group gives them, a member who sees only their own page, a wrong state or an
address outside the allowed domains refused, an admin who disables a person (their session ends,
and they cannot sign in again), a provider that is down (the console says so; admin tokens still
sign in); and Debian's chromium, driven by Playwright, through the whole flow with the provider on
another site, as the cookies' SameSite rules meet it in a browser."""

from __future__ import annotations

import re
import socket
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from gateway.admin.policies import NO_POLICY
from gateway.config import OidcConfig, OidcRole, PolicyConfig
from gateway.storage import open_store
from tests.oidc_provider import add_user, authorize, running_provider
from tests.support import MODEL, make_config, run_command
from tests.test_console import ADMIN, ROOT_TOKEN, Browserless, csrf, secrets_in

ANA = "ana"  # in the platform group: an admin
BEN = "ben"  # in the finance group: a viewer
CAT = "cat"  # in no group of [[oidc.roles]]: a member
ROLES = (OidcRole("platform", "admin"), OidcRole("finance", "viewer"))


def oidc_config(issuer: str, **fields) -> OidcConfig:
    return OidcConfig(
        issuer=issuer, client_id="ezat-gateway", client_secret="ezat-client-secret", roles=ROLES, **fields
    )


@pytest.fixture
def issuer():
    with running_provider() as url:
        yield url


@pytest.fixture
def storage_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ezat.db'}"


@pytest.fixture
async def start(start_gateway, upstream, storage_url):
    async def start(oidc: OidcConfig):
        return await start_gateway(replace(make_config(upstream.url, storage_url), admin=ADMIN, oidc=oidc))

    return start


@pytest.fixture
async def people(issuer):
    await add_user(issuer, ANA, email="ana@example.com", name="Ana", groups=["platform", "eng"])
    await add_user(issuer, BEN, email="ben@example.com", name="Ben", groups=["finance"])
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])


async def sign_in_through_the_provider(visitor: Browserless, sub: str):
    """The console's button, the provider's approval, the callback: the callback's answer."""
    status, body, headers = await visitor.call("GET", "/console/oidc/start")
    assert status == 303, body
    callback = urlsplit(await authorize(headers["Location"], sub))
    return await visitor.call("GET", f"{callback.path}?{callback.query}")


async def signed_in_as(gateway, sub: str) -> Browserless:
    visitor = Browserless(gateway.url)
    status, body, _ = await sign_in_through_the_provider(visitor, sub)
    assert status == 200 and 'http-equiv="refresh" content="0;url=/console"' in body, body
    return visitor


async def test_the_sign_in_page_offers_the_provider_and_its_flow_cookie(start, issuer, people):
    gateway = await start(oidc_config(issuer))
    visitor = Browserless(gateway.url)
    assert 'href="/console/oidc/start"' in await visitor.page("/console/sign-in")
    status, _, headers = await visitor.call("GET", "/console/oidc/start")
    sent = urlsplit(headers["Location"])
    query = parse_qs(sent.query)
    assert status == 303 and f"{sent.scheme}://{sent.netloc}" == issuer
    assert query["redirect_uri"] == [f"{gateway.url}/console/oidc/callback"]
    assert query["code_challenge_method"] == ["S256"] and query["client_id"] == ["ezat-gateway"]
    [flow] = [c["ezat_console_oidc"] for c in visitor.set_cookies if "ezat_console_oidc" in c]
    assert flow["httponly"] and flow["samesite"] == "Lax" and flow["path"] == "/console/oidc"
    assert query["state"][0] not in flow.value  # sealed, not readable as the state itself


async def test_roles_come_from_groups(start, issuer, people, storage_url):
    gateway = await start(oidc_config(issuer))
    ana = await signed_in_as(gateway, ANA)
    overview = await ana.page("/console")
    assert "ana@example.com (admin)" in overview and 'href="/console/people"' in overview
    assert 'action="/console/keys"' in await ana.page("/console/keys")  # an admin gets the form
    ben = await signed_in_as(gateway, BEN)
    keys = await ben.page("/console/keys")
    assert "ben@example.com (viewer)" in keys and 'action="/console/keys"' not in keys
    status, _, _ = await ben.call("POST", "/console/keys", {"name": "nope", "csrf": csrf(keys)})
    assert status == 403
    people = await ana.page("/console/people")
    assert "ana@example.com" in people and "ben@example.com" in people and "platform, eng" in people

    store = open_store(storage_url)
    await store.open()
    try:
        ana_record = await store.find_person_by_subject(ANA)
        assert ana_record is not None and ana_record.groups == ("platform", "eng")
    finally:
        await store.close()


async def test_a_member_sees_only_their_own_page(start, issuer, people):
    gateway = await start(oidc_config(issuer))
    cat = await signed_in_as(gateway, CAT)
    for path in ("/console", "/console/keys", "/console/audit", "/console/people", "/console/keys/1"):
        status, _, headers = await cat.call("GET", path)
        assert (status, headers["Location"]) == (303, "/console/me"), path
    mine = await cat.page("/console/me")
    assert "cat@example.com (member)" in mine and "Cat" in mine and "eng" in mine
    assert 'href="/console/keys"' not in mine and 'href="/console/people"' not in mine
    status, _, _ = await cat.call("POST", "/console/keys", {"name": "nope", "csrf": csrf(mine)})
    assert status == 403


async def test_a_wrong_state_or_no_flow_is_refused(start, issuer, people):
    gateway = await start(oidc_config(issuer))
    visitor = Browserless(gateway.url)
    _, _, headers = await visitor.call("GET", "/console/oidc/start")
    callback = urlsplit(await authorize(headers["Location"], ANA))
    code = parse_qs(callback.query)["code"][0]
    status, body, _ = await visitor.call("GET", f"/console/oidc/callback?code={code}&state=forged")
    assert status == 403 and "Sign-in failed" in body
    assert "ezat_console_session" not in visitor.cookies
    stranger = Browserless(gateway.url)  # the callback in a browser that did not start the sign-in
    status, body, _ = await stranger.call("GET", f"{callback.path}?{callback.query}")
    assert status == 400 and "did not start here" in body and "ezat_console_session" not in stranger.cookies


async def test_an_address_outside_the_allowed_domains_is_refused(start, issuer, people, storage_url):
    gateway = await start(oidc_config(issuer, allowed_email_domains=("company.com",)))
    status, body, _ = await sign_in_through_the_provider(Browserless(gateway.url), ANA)
    assert status == 403 and "ana@example.com" in body
    store = open_store(storage_url)
    await store.open()
    try:
        assert await store.list_people(limit=10) == []  # refused before anyone was recorded
    finally:
        await store.close()


async def test_a_disabled_person_loses_their_session_and_cannot_sign_in(start, issuer, people):
    gateway = await start(oidc_config(issuer))
    cat = await signed_in_as(gateway, CAT)
    admin = Browserless(gateway.url)
    await admin.sign_in(ROOT_TOKEN)
    people_page = await admin.page("/console/people")
    async with aiohttp.ClientSession() as http:
        async with http.get(
            gateway.url + "/admin/v1/people", headers={"Authorization": f"Bearer {ROOT_TOKEN}"}
        ) as response:
            [cat_id] = [p["id"] for p in (await response.json())["data"] if p["subject"] == CAT]
    status, _, headers = await admin.call("POST", f"/console/people/{cat_id}/disable", {"csrf": csrf(people_page)})
    assert (status, headers["Location"]) == (303, "/console/people")
    assert "disabled" in await admin.page("/console/people")
    status, _, headers = await cat.call("GET", "/console/me")
    assert (status, headers["Location"]) == (303, "/console/sign-in")  # the session ended
    status, body, _ = await sign_in_through_the_provider(Browserless(gateway.url), CAT)
    assert status == 403 and "disabled" in body
    async with aiohttp.ClientSession() as http:
        async with http.get(
            gateway.url + "/admin/v1/audit", headers={"Authorization": f"Bearer {ROOT_TOKEN}"}
        ) as response:
            entries = (await response.json())["data"]
    assert any(e["action"] == "person.disable" and e["actor"] == "root" for e in entries)


async def test_a_provider_that_is_down_is_said_so_and_admin_tokens_still_sign_in(start):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    gateway = await start(oidc_config(f"http://127.0.0.1:{port}"))  # nothing listens there
    visitor = Browserless(gateway.url)
    status, body, _ = await visitor.call("GET", "/console/oidc/start")
    assert status == 503 and "cannot be reached" in body and "admin token" in body
    status, _, headers = await visitor.sign_in(ROOT_TOKEN)
    assert (status, headers["Location"]) == (303, "/console")
    assert "<h1>Overview</h1>" in await visitor.page("/console")  # signed in, as an admin


async def test_signing_in_through_the_provider_in_a_browser(start_gateway, upstream, storage_url, chromium):
    """The provider on another site than the gateway (localhost, beside 127.0.0.1): its redirect
    back is a cross-site navigation, which the flow's Lax cookie comes with, and the console's
    Strict session cookie is used from the page that follows."""
    from playwright.async_api import async_playwright

    with running_provider() as provider:
        issuer = provider.replace("127.0.0.1", "localhost")
        await add_user(provider, ANA, email="ana@example.com", name="Ana", groups=["platform"])
        await add_user(provider, CAT, email="cat@example.com", name="Cat", groups=["eng"])
        config = replace(make_config(upstream.url, storage_url), admin=ADMIN, oidc=oidc_config(issuer))
        gateway = await start_gateway(config)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=chromium)
            try:
                for sub, landing, heading in ((ANA, "/console", "Overview"), (CAT, "/console/me", "My page")):
                    page = await (await browser.new_context()).new_page()
                    await page.goto(gateway.url + "/console")
                    assert page.url == gateway.url + "/console/sign-in"
                    await page.click('a:has-text("Sign in with your identity provider")')
                    await page.wait_for_url(issuer + "/**")
                    await page.get_by_placeholder("sub").first.fill(sub)
                    await page.get_by_role("button", name="Authorize").click()
                    await page.wait_for_url(gateway.url + landing)
                    assert await page.locator("h1").inner_text() == heading
                    nav = await page.locator("header").inner_text()
                    assert f"{sub}@example.com" in nav
                    assert ("People" in nav) == (sub == ANA)
            finally:
                await browser.close()


# --- A person's own keys, under their group's policy ------------------------------------------------

POLICIES = (
    PolicyConfig(group="eng", models=("anthropic/*",), rpm=100, key_ttl_hours=6, budget_usd=Decimal("25")),
    PolicyConfig(group="platform", key_ttl_hours=12),
)


@pytest.fixture
async def start_with_policies(start_gateway, upstream, storage_url):
    async def start(issuer: str, models=None):
        config = replace(
            make_config(upstream.url, storage_url), admin=ADMIN, oidc=oidc_config(issuer), policies=POLICIES
        )
        if models is not None:
            config = replace(config, models=models)
        return await start_gateway(config, key_cache_seconds=0)

    return start


async def make_my_key(visitor: Browserless, name: str = "laptop") -> str:
    mine = await visitor.page("/console/me")
    status, body, _ = await visitor.call("POST", "/console/me/keys", {"name": name, "csrf": csrf(mine)})
    assert status == 200, body
    [secret] = secrets_in(body)
    return secret


async def chat(gateway, secret: str, model: str = MODEL) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Hello"}]},
            headers={"Authorization": f"Bearer {secret}"},
        ) as response:
            return response.status


async def test_a_person_makes_a_key_under_their_policy_and_uses_it(start_with_policies, issuer, people):
    gateway = await start_with_policies(issuer)
    cat = await signed_in_as(gateway, CAT)  # in "eng": models anthropic/*, 6 hours
    mine = await cat.page("/console/me")
    assert "eng" in mine and "6 hours" in mine and "100 requests a minute" in mine
    assert "Your budget, over all your keys, this month:" in mine and "$25" in mine
    secret = await make_my_key(cat)
    assert secret not in await cat.page("/console/me")  # shown once
    assert await chat(gateway, secret) == 200
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ROOT_TOKEN}"}
        async with http.get(gateway.url + "/admin/v1/keys", headers=headers) as response:
            [key] = [k for k in (await response.json())["data"] if k["name"] == "laptop"]
        async with http.get(gateway.url + "/admin/v1/audit", headers=headers) as response:
            entries = (await response.json())["data"]
    lives = datetime.fromisoformat(key["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=6) - timedelta(minutes=1) < lives <= timedelta(hours=6)
    assert key["person_id"] is not None
    assert any(e["action"] == "key.create" and e["actor"] == "cat@example.com" for e in entries)


async def test_the_policy_chooses_the_models(start_with_policies, issuer, people, upstream, storage_url):
    config = make_config(upstream.url, storage_url)
    other = replace(config.models[0], id="other/model", aliases=())
    gateway = await start_with_policies(issuer, models=(config.models[0], other))
    cat = await signed_in_as(gateway, CAT)  # "eng": anthropic/* only
    secret = await make_my_key(cat)
    assert MODEL.startswith("anthropic/") and await chat(gateway, secret) == 200
    assert await chat(gateway, secret, "other/model") == 403


async def test_no_policy_no_key(start_with_policies, issuer, people):
    gateway = await start_with_policies(issuer)
    ben = await signed_in_as(gateway, BEN)  # "finance": no policy
    mine = await ben.page("/console/me")
    assert "cannot make a key" in mine and 'action="/console/me/keys"' not in mine
    status, body, _ = await ben.call("POST", "/console/me/keys", {"name": "x", "csrf": csrf(mine)})
    assert status == 403 and secrets_in(body) == []


async def test_a_disabled_person_or_one_who_left_the_group_has_no_working_key(start_with_policies, issuer, people):
    gateway = await start_with_policies(issuer)
    cat = await signed_in_as(gateway, CAT)
    secret = await make_my_key(cat)
    assert await chat(gateway, secret) == 200
    # Cat leaves "eng": at their next sign-in the provider says so, and their key stops.
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["finance"])
    await signed_in_as(gateway, CAT)
    assert await chat(gateway, secret) == 401
    await add_user(issuer, CAT, email="cat@example.com", name="Cat", groups=["eng"])
    await signed_in_as(gateway, CAT)
    assert await chat(gateway, secret) == 200
    # An admin disables Cat: the key is refused, saying why.
    admin = Browserless(gateway.url)
    await admin.sign_in(ROOT_TOKEN)
    people_page = await admin.page("/console/people")
    cat_id = re.search(r'action="/console/people/(\d+)/disable"', people_page.split("cat@example.com")[1]).group(1)
    await admin.call("POST", f"/console/people/{cat_id}/disable", {"csrf": csrf(people_page)})
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/openai/v1/models", headers={"Authorization": f"Bearer {secret}"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["message"] == "This API key's owner has been disabled by an administrator."


async def test_a_person_revokes_their_own_key_and_no_one_elses(start_with_policies, issuer, people):
    gateway = await start_with_policies(issuer)
    cat = await signed_in_as(gateway, CAT)
    ana = await signed_in_as(gateway, ANA)
    cats = await make_my_key(cat)
    anas = await make_my_key(ana, "ana-laptop")
    mine = await cat.page("/console/me")
    [cat_key] = re.findall(r'action="/console/me/keys/(\d+)/revoke"', mine)
    ana_key = re.findall(r'action="/console/me/keys/(\d+)/revoke"', await ana.page("/console/me"))[0]
    status, _, _ = await cat.call("POST", f"/console/me/keys/{ana_key}/revoke", {"csrf": csrf(mine)})
    assert status == 404 and await chat(gateway, anas) == 200
    status, _, headers = await cat.call("POST", f"/console/me/keys/{cat_key}/revoke", {"csrf": csrf(mine)})
    assert (status, headers["Location"]) == (303, "/console/me")
    assert await chat(gateway, cats) == 401 and "revoked" in await cat.page("/console/me")


async def test_disabling_through_the_api_stops_the_keys_at_once(start_gateway, upstream, storage_url, issuer, people):
    """With the auth stage's usual 5-second cache: the gateway that disables forgets the keys."""
    config = replace(make_config(upstream.url, storage_url), admin=ADMIN, oidc=oidc_config(issuer), policies=POLICIES)
    gateway = await start_gateway(config)
    cat = await signed_in_as(gateway, CAT)
    secret = await make_my_key(cat)
    assert await chat(gateway, secret) == 200  # its record now cached
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ROOT_TOKEN}"}
        async with http.get(gateway.url + "/admin/v1/people", headers=headers) as response:
            [cat_id] = [p["id"] for p in (await response.json())["data"] if p["subject"] == CAT]
        async with http.post(gateway.url + f"/admin/v1/people/{cat_id}/disable", headers=headers) as response:
            assert response.status == 200 and (await response.json())["disabled"] is True
    assert await chat(gateway, secret) == 401


async def test_spend_per_person_in_the_api_the_cli_and_the_overview(
    start_with_policies, issuer, people, storage_url, tmp_path
):
    gateway = await start_with_policies(issuer)
    ana, cat = await signed_in_as(gateway, ANA), await signed_in_as(gateway, CAT)
    anas, cats = await make_my_key(ana), await make_my_key(cat)
    for secret, times in ((anas, 1), (cats, 2)):
        for _ in range(times):
            assert await chat(gateway, secret) == 200
    async with gateway.client() as admins_key:  # the test config's own key: nobody's
        await admins_key.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])

    async with aiohttp.ClientSession() as http:
        async with http.get(
            gateway.url + "/admin/v1/usage?group_by=person", headers={"Authorization": f"Bearer {ROOT_TOKEN}"}
        ) as response:
            report = await response.json()
    assert {row["person"]: row["requests"] for row in report["data"]} == {
        "ana@example.com": 1,
        "cat@example.com": 2,
        None: 1,
    }
    status, output = await run_command("usage", "--by", "person", "--storage", storage_url, cwd=tmp_path)
    assert status == 0, output
    lines = [line.split() for line in output.splitlines()]
    assert [line[:2] for line in lines if line and line[0].endswith("@example.com")] == [
        ["ana@example.com", "1"],
        ["cat@example.com", "2"],
    ]
    assert any(line[:3] == ["(no", "person)", "1"] for line in lines)
    overview = await ana.page("/console")
    assert "Top people" in overview and "cat@example.com" in overview


async def test_without_oidc_a_persons_keys_are_refused(
    start_with_policies, start_gateway, upstream, issuer, people, storage_url
):
    """[oidc] taken out of the config (and so [[policies]], which needs it): a person's keys are
    no admin's keys, and no policy covers them any more."""
    gateway = await start_with_policies(issuer)
    secret = await make_my_key(await signed_in_as(gateway, CAT))
    assert await chat(gateway, secret) == 200
    config = replace(make_config(upstream.url, storage_url), admin=ADMIN)
    without = await start_gateway(config, key_cache_seconds=0)
    async with aiohttp.ClientSession() as http:
        async with http.get(without.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["message"] == NO_POLICY
    async with without.client() as admins_key:  # the config's own key is nobody's: it still works
        assert (await admins_key.models.list()).data


async def test_the_first_policy_in_file_order_governs_and_its_rates_hold(start_gateway, upstream, issuer, people):
    """Ana is in "platform" and "eng"; the file lists a 2-request-a-minute "platform" policy first,
    so hers is it (not "eng", listed second, nor the order of her groups): her key lives the
    default 12 hours and its third request in a minute gets 429."""
    policies = (PolicyConfig(group="platform", rpm=2), PolicyConfig(group="eng", key_ttl_hours=1))
    config = replace(make_config(upstream.url), admin=ADMIN, oidc=oidc_config(issuer), policies=policies)
    gateway = await start_gateway(config, key_cache_seconds=0)
    ana = await signed_in_as(gateway, ANA)
    assert "Your group <b>platform</b>" in await ana.page("/console/me")
    secret = await make_my_key(ana)
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ROOT_TOKEN}"}
        async with http.get(gateway.url + "/admin/v1/keys", headers=headers) as response:
            [key] = [k for k in (await response.json())["data"] if k["person_id"] is not None]
    lives = datetime.fromisoformat(key["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=12) - timedelta(minutes=1) < lives <= timedelta(hours=12)
    assert [await chat(gateway, secret) for _ in range(3)] == [200, 200, 429]
