"""The console (/console) through a real gateway on loopback and a real SQLite file: who may sign
in and for how long, the CSRF token on every POST, what a viewer may not do, the headers on every
answer, names shown as text; and a real browser (Debian's chromium, driven by Playwright) that
signs in, reads the overview's plot, creates a key and sees its secret once, revokes it, and finds
both in the audit log, taking a screenshot of the overview (into a temporary folder: docs/admin.md's
is made by `make docs-images`)."""

from __future__ import annotations

import base64
import hashlib
import html
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http.cookies import SimpleCookie

import aiohttp
import pytest

from gateway.admin import changes
from gateway.config import AdminConfig, AdminTokenConfig
from gateway.storage import LedgerRow, open_store
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, make_config
from tests.test_storage import row

ROOT_TOKEN = "ezat-admin-console-root-token"
VIEWER_TOKEN = "ezat-admin-console-viewer-token"
ADMIN = AdminConfig(
    tokens=(
        AdminTokenConfig(name="root", role="admin", token_sha256=hashlib.sha256(ROOT_TOKEN.encode()).hexdigest()),
        AdminTokenConfig(name="watcher", role="viewer", token_sha256=hashlib.sha256(VIEWER_TOKEN.encode()).hexdigest()),
    )
)
NOW = datetime(2026, 11, 20, 15, 30, tzinfo=UTC)  # the gateway's idea of now here
SESSION_COOKIE = "ezat_console_session"


@pytest.fixture
def storage_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ezat.db'}"


@pytest.fixture
async def gateway(start_gateway, upstream, storage_url):
    return await start_gateway(replace(make_config(upstream.url, storage_url), admin=ADMIN), now=lambda: NOW)


class Browserless:
    """One visitor of the console over plain HTTP, keeping its cookies by hand (to read their
    flags): each answer is (status, text, headers), redirects not followed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cookies: dict[str, str] = {}
        self.set_cookies: list[SimpleCookie] = []  # every Set-Cookie seen, for their flags

    async def call(self, method: str, path: str, data: dict | None = None):
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())} if self.cookies else {}
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            async with http.request(
                method, self.url + path, data=data, headers=headers, allow_redirects=False
            ) as response:
                body = await response.text()
                for line in response.headers.getall("Set-Cookie", []):
                    cookie = SimpleCookie(line)
                    self.set_cookies.append(cookie)
                    for name, morsel in cookie.items():
                        if morsel.value and morsel["max-age"] != "0":
                            self.cookies[name] = morsel.value
                        else:
                            self.cookies.pop(name, None)
                return response.status, body, response.headers

    async def sign_in(self, token: str):
        status, body, _ = await self.call("GET", "/console/sign-in")
        assert status == 200, body
        return await self.call("POST", "/console/sign-in", {"token": token, "csrf": csrf(body)})

    async def page(self, path: str) -> str:
        status, body, _ = await self.call("GET", path)
        assert status == 200, (path, status, body)
        return body


def csrf(body: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', body).group(1)


def secrets_in(body: str) -> list[str]:
    return re.findall(r"sk-ezat-[A-Za-z0-9_-]+", body)


async def signed_in(gateway, token: str = ROOT_TOKEN) -> tuple[Browserless, str]:
    """A visitor signed in with `token`, and its session's CSRF token."""
    visitor = Browserless(gateway.url)
    status, body, headers = await visitor.sign_in(token)
    assert (status, headers.get("Location")) == (303, "/console"), body
    return visitor, csrf(await visitor.page("/console/keys"))


def ledger_row(n: int, key_id: int, cost: str, finished: datetime, model: str = MODEL) -> LedgerRow:
    return row(f"req_console_{n}", key_id, cost, finished, model=model, answered_model=model)


async def in_store(storage_url: str, change):
    """`await change(store)` on another connection to the gateway's database (as the CLI would)."""
    store = open_store(storage_url)
    await store.open()
    try:
        return await change(store)
    finally:
        await store.close()


async def test_signing_in_and_out(gateway):
    visitor = Browserless(gateway.url)
    status, _, headers = await visitor.call("GET", "/console")
    assert (status, headers["Location"]) == (303, "/console/sign-in")
    status, body, _ = await visitor.call("GET", "/console/sign-in")
    assert status == 200 and 'name="token"' in body
    form_csrf = csrf(body)

    # No CSRF token, a wrong token, a gateway key: no session.
    status, _, _ = await visitor.call("POST", "/console/sign-in", {"token": ROOT_TOKEN})
    assert status == 403
    for wrong in ("ezat-admin-not-a-token", KEY, ""):
        status, body, _ = await visitor.call("POST", "/console/sign-in", {"token": wrong, "csrf": form_csrf})
        assert status == 401 and "not a valid admin token" in body
    assert SESSION_COOKIE not in visitor.cookies

    status, _, headers = await visitor.call("POST", "/console/sign-in", {"token": ROOT_TOKEN, "csrf": form_csrf})
    assert (status, headers["Location"]) == (303, "/console")
    (session,) = [c[SESSION_COOKIE] for c in visitor.set_cookies if SESSION_COOKIE in c]
    assert session["httponly"] and session["samesite"] == "Strict" and session["path"] == "/console"
    assert session["max-age"] == str(8 * 3600)
    assert not session["secure"]  # plain HTTP here; over TLS it is Secure
    # The cookie is an opaque id: neither the token nor its digest.
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", session.value)
    assert ROOT_TOKEN not in session.value and session.value != changes.digest(ROOT_TOKEN)
    assert "root (admin)" in await visitor.page("/console")

    # A cookie changed by one character is no session, nor is one never given.
    tampered = Browserless(gateway.url)
    value = visitor.cookies[SESSION_COOKIE]
    tampered.cookies[SESSION_COOKIE] = value[:-1] + ("A" if value[-1] != "A" else "B")
    assert (await tampered.call("GET", "/console"))[0] == 303
    tampered.cookies[SESSION_COOKIE] = "A" * 43
    assert (await tampered.call("GET", "/console"))[0] == 303

    # Signing out needs the session's CSRF token, then ends it.
    assert (await visitor.call("POST", "/console/sign-out", {}))[0] == 403
    session_csrf = csrf(await visitor.page("/console"))
    status, _, headers = await visitor.call("POST", "/console/sign-out", {"csrf": session_csrf})
    assert (status, headers["Location"]) == (303, "/console/sign-in")
    assert SESSION_COOKIE not in visitor.cookies
    assert (await visitor.call("GET", "/console"))[0] == 303


async def test_failed_sign_ins_are_limited_per_address_never_the_right_token(start_gateway, upstream, storage_url):
    admin = replace(ADMIN, failed_attempts_per_minute=3)
    gateway = await start_gateway(replace(make_config(upstream.url, storage_url), admin=admin))
    visitor = Browserless(gateway.url)
    for _ in range(3):
        assert (await visitor.sign_in("ezat-admin-wrong"))[0] == 401
    status, body, headers = await visitor.sign_in("ezat-admin-wrong")
    assert status == 429 and "Too many failed sign-ins" in body and 1 <= int(headers["Retry-After"]) <= 60
    assert SESSION_COOKIE not in visitor.cookies
    # Whoever made the failures (any page a browser behind the same proxy opens), the right
    # token still signs in.
    status, _, headers = await visitor.sign_in(ROOT_TOKEN)
    assert (status, headers["Location"]) == (303, "/console") and SESSION_COOKIE in visitor.cookies
    # The admin API counts with the console: its wrong tokens get 429 too, its right one passes.
    async with aiohttp.ClientSession() as http:
        for token, expected in (("ezat-admin-wrong", 429), (ROOT_TOKEN, 200)):
            async with http.get(gateway.url + "/admin/v1/keys", headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == expected, token


async def test_csrf_and_what_a_viewer_may_do(gateway, storage_url):
    root, root_csrf = await signed_in(gateway)
    viewer, viewer_csrf = await signed_in(gateway, VIEWER_TOKEN)
    assert root_csrf != viewer_csrf

    # Without the session's own CSRF token a POST changes nothing: 403.
    for form in ({"name": "no-csrf"}, {"name": "wrong", "csrf": "x" * 43}, {"name": "other", "csrf": viewer_csrf}):
        status, body, _ = await root.call("POST", "/console/keys", form)
        assert status == 403, body
    assert (await root.call("POST", "/console/keys/1/revoke", {}))[0] == 403
    # With no session at all, neither.
    assert (await Browserless(gateway.url).call("POST", "/console/keys", {"name": "x", "csrf": root_csrf}))[0] == 403

    # A viewer sees the keys but no form that changes them, and its POSTs are refused.
    page = await viewer.page("/console/keys")
    assert "watcher (viewer)" in page and ">test<" in page
    assert 'action="/console/keys"' not in page and "Revoke" not in page and "Rotate" not in page
    status, body, _ = await viewer.call("POST", "/console/keys", {"name": "by-viewer", "csrf": viewer_csrf})
    assert status == 403 and "viewer" in body

    # An admin makes one (its secret shown on that answer alone), rotates it, revokes it.
    status, body, _ = await root.call("POST", "/console/keys", {"name": "made-here", "csrf": root_csrf})
    assert status == 200, body
    (secret,) = secrets_in(body)
    assert secrets_in(await root.page("/console/keys")) == []
    made = (await in_store(storage_url, lambda store: store.list_keys()))[-1]
    assert made.name == "made-here" and made.key_sha256 == changes.digest(secret)
    status, body, _ = await viewer.call("POST", f"/console/keys/{made.id}/rotate", {"csrf": viewer_csrf})
    assert status == 403
    question = await root.page(f"/console/keys/{made.id}/rotate")
    assert f"Give key {made.id} (made-here) a new secret?" in question and secrets_in(question) == []
    status, body, _ = await root.call("POST", f"/console/keys/{made.id}/rotate", {"csrf": root_csrf})
    (rotated,) = secrets_in(body)
    assert status == 200 and rotated != secret
    # Revoking asks first: a viewer may not be asked, an admin gets a page whose one form does it.
    assert (await viewer.call("GET", f"/console/keys/{made.id}/revoke"))[0] == 403
    question = await root.page(f"/console/keys/{made.id}/revoke")
    assert f"Revoke key {made.id} (made-here)?" in question and f'href="/console/keys/{made.id}"' in question
    assert f'action="/console/keys/{made.id}/revoke"' in question and csrf(question) == root_csrf
    assert (await in_store(storage_url, lambda store: store.list_keys()))[-1].revoked is False  # asking changes nothing
    status, body, _ = await root.call("POST", f"/console/keys/{made.id}/revoke", {"csrf": root_csrf})
    assert status == 200 and f"Key {made.id} (made-here) was revoked: its requests get 401" in body
    status, body, _ = await root.call("POST", f"/console/keys/{made.id}/revoke", {"csrf": root_csrf})
    assert status == 200 and "was revoked already: nothing changed" in body
    assert (await root.call("GET", f"/console/keys/{made.id}/revoke"))[0] == 409  # nothing left to ask
    # The config file's key is its own: no buttons, and a POST is refused with the reason.
    status, body, _ = await root.call("POST", "/console/keys/1/revoke", {"csrf": root_csrf})
    assert status == 409 and "declared in the config file" in body

    entries = await in_store(storage_url, lambda store: store.audit_log())
    assert [(e.actor, e.action, e.target) for e in entries] == [
        ("root", "key.revoke", f"key:{made.id}"),
        ("root", "key.rotate", f"key:{made.id}"),
        ("root", "key.create", f"key:{made.id}"),
    ]
    assert not any(secret in str(e) or rotated in str(e) for e in entries)


async def test_a_key_made_in_the_console_may_have_a_budget_period(gateway, storage_url):
    visitor, session_csrf = await signed_in(gateway)
    form = {"name": "monthly", "spend_limit_usd": "50", "budget_period": "month", "csrf": session_csrf}
    status, body, _ = await visitor.call("POST", "/console/keys", form)
    assert status == 200, body
    made = (await in_store(storage_url, lambda store: store.list_keys()))[-1]
    assert (made.name, made.spend_limit_usd, made.budget_period) == ("monthly", Decimal("50"), "month")
    status, body, _ = await visitor.call("POST", "/console/keys", {**form, "name": "yearly", "budget_period": "year"})
    assert status == 400 and "Budget period: expected day, week or month." in body
    status, body, _ = await visitor.call("POST", "/console/keys", {**form, "name": "unlimited", "spend_limit_usd": ""})
    assert status == 400 and "a budget period (month) needs a spend limit to count over" in body
    assert [key.name for key in await in_store(storage_url, lambda store: store.list_keys())][-1] == "monthly"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def shared_storage_url(request, tmp_path) -> str:
    """A store two gateways share: a SQLite file, or a PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return request.getfixturevalue("postgres_url")


async def test_signing_out_ends_the_session_on_every_gateway(start_gateway, upstream, shared_storage_url):
    """Two gateways on one store: a session opened on one holds on the other, and once it is
    signed out on either, a copy of its cookie taken before gets the sign-in page on both."""
    config = replace(make_config(upstream.url, shared_storage_url), admin=ADMIN)
    first, second = await start_gateway(config), await start_gateway(config)
    visitor, session_csrf = await signed_in(first)
    copy = Browserless(second.url)
    copy.cookies = dict(visitor.cookies)
    assert "root (admin)" in await copy.page("/console")

    status, _, headers = await visitor.call("POST", "/console/sign-out", {"csrf": session_csrf})
    assert (status, headers["Location"]) == (303, "/console/sign-in")
    for gateway in (second, first):
        copy.url = gateway.url
        status, _, headers = await copy.call("GET", "/console")
        assert (status, headers["Location"]) == (303, "/console/sign-in")
        assert (await copy.call("POST", "/console/keys", {"name": "after", "csrf": session_csrf}))[0] == 403
    session = changes.digest(copy.cookies[SESSION_COOKIE])
    assert await in_store(shared_storage_url, lambda store: store.find_session(session)) is None


async def test_a_key_made_in_the_console_has_a_name_and_an_amount_as_the_cli_and_api_take_them(gateway, storage_url):
    """The console's form is held to the rules the CLI and the admin API hold: one function each."""
    visitor, session_csrf = await signed_in(gateway)
    for form, said in (
        ({"name": "x" * 201}, "name: expected 1 to 200 characters, not 201"),
        (
            {"name": "invoice\u202eexe.pdf"},
            "name: expected no control or bidirectional formatting character, not U+202E",
        ),
        ({"name": "42"}, "name: expected a name that is not digits alone (digits are an id)"),
        ({"name": " padded "}, "name: expected no space at either end"),  # refused, not trimmed
        ({"name": "plain", "spend_limit_usd": "5_000"}, "Spend limit: expected an amount of USD as a plain decimal"),
        ({"name": "plain", "spend_limit_usd": "١٢"}, "Spend limit: expected an amount of USD as a plain decimal"),
    ):
        status, body, _ = await visitor.call("POST", "/console/keys", {**form, "csrf": session_csrf})
        assert status == 400 and said in html.unescape(body), (form, status, body)
    assert [key.name for key in await in_store(storage_url, lambda store: store.list_keys())] == ["test"]


async def test_a_revoked_token_ends_its_sessions(gateway, storage_url):
    _, token = await in_store(storage_url, lambda store: changes.create_admin_token(store, "cli:test", "ops", "admin"))
    visitor, _ = await signed_in(gateway, token)
    assert "ops (admin)" in await visitor.page("/console")
    await in_store(storage_url, lambda store: changes.revoke_admin_token(store, "cli:test", "ops"))
    session = changes.digest(visitor.cookies[SESSION_COOKIE])
    assert await in_store(storage_url, lambda store: store.find_session(session)) is None  # deleted with it
    status, _, headers = await visitor.call("GET", "/console")
    assert (status, headers["Location"]) == (303, "/console/sign-in")
    status, body, _ = await Browserless(gateway.url).sign_in(token)
    assert status == 401


ADMIN_TOML = """
[admin]
{session_key}

[[admin.tokens]]
name = "root"
role = "admin"
token_sha256 = "{digest}"
"""


async def test_a_session_holds_across_workers_and_replicas(upstream, tmp_path):
    """Sessions are in the store: two workers of one process and a replica on the same store
    agree on one, whatever their `[admin] session_key` (it signs only the sign-in form's
    cookie), and a sign-out on one ends it on the others."""

    def serve(name: str, session_key: str) -> ServeProcess:
        admin = ADMIN_TOML.format(session_key=session_key, digest=ADMIN.tokens[0].token_sha256)
        return ServeProcess(
            tmp_path, name, SERVE_CONFIG + admin, upstream_url=upstream.url, storage_url=f"sqlite:///{tmp_path}/ezat.db"
        )

    shared = 'session_key = "' + base64.b64encode(bytes(range(32))).decode() + '"'
    first, second = serve("first", shared), serve("second", "")
    try:
        await first.start("--workers", "2")
        await second.start()
        visitor, session_csrf = await signed_in(first)
        for _ in range(8):  # a new connection each time, which the kernel spreads over the workers
            assert "root (admin)" in await visitor.page("/console")
        visitor.url = second.url
        assert "root (admin)" in await visitor.page("/console/keys")
        cookies = dict(visitor.cookies)
        assert (await visitor.call("POST", "/console/sign-out", {"csrf": session_csrf}))[0] == 303
        visitor.url, visitor.cookies = first.url, cookies
        for _ in range(4):
            assert (await visitor.call("GET", "/console"))[0] == 303
    finally:
        for process in (first, second):
            await process.stop()


async def test_every_answer_has_the_headers(gateway):
    visitor, session_csrf = await signed_in(gateway)
    answers = [
        await Browserless(gateway.url).call("GET", "/console/sign-in"),
        await Browserless(gateway.url).call("GET", "/console"),  # the redirect to sign in
        await visitor.call("GET", "/console"),
        await visitor.call("GET", "/console/keys/1"),
        await visitor.call("GET", "/console/organizations"),
        await visitor.call("GET", "/console/audit"),
        await visitor.call("POST", "/console/keys", {"name": "no-csrf"}),  # 403
        await visitor.call("GET", "/console/no-such-page"),  # 404
        await visitor.call("GET", "/console/keys/999"),  # 404
        await visitor.call("DELETE", "/console/keys"),
    ]
    statuses = [status for status, _, _ in answers]
    assert statuses == [200, 303, 200, 200, 200, 200, 403, 404, 404, 404]
    for _, body, headers in answers:
        policy = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["base-uri"] == "'none'"
        assert policy["frame-ancestors"] == "'none'" and policy["form-action"] == "'self'"
        assert policy["img-src"] == "'self' data:" and re.fullmatch(r"'sha256-[A-Za-z0-9+/]+=*'", policy["style-src"])
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Referrer-Policy"] == "no-referrer"
        assert headers["Cache-Control"] == "no-store"
        assert "<script" not in body and "http://" not in body.replace("http://www.w3.org/2000/svg", "")
    # The API's routes are not the console's: no CSP there.
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/healthz") as response:
            assert "Content-Security-Policy" not in response.headers


async def test_ids_that_are_no_ids_are_not_found(gateway):
    visitor, session_csrf = await signed_in(gateway)
    for path in ("/console/keys/%C2%B2", "/console/keys/99999999999999999999999", "/console/keys/-1"):
        status, body, _ = await visitor.call("GET", path)
        assert status == 404 and "<html" in body, (path, status)
        status, _, _ = await visitor.call("POST", path + "/revoke", {"csrf": session_csrf})
        assert status == 404, path
    for before in ("%C2%B2", "99999999999999999999999"):  # not an id: the newest entries
        status, body, _ = await visitor.call("GET", f"/console/audit?before={before}")
        assert status == 200, before


async def test_names_are_shown_as_text(gateway, storage_url):
    visitor, session_csrf = await signed_in(gateway)
    name = "<script>alert(1)</script>"
    status, body, _ = await visitor.call("POST", "/console/keys", {"name": name, "csrf": session_csrf})
    assert status == 200, body
    made = (await in_store(storage_url, lambda store: store.list_keys()))[-1]

    async def seed(store):
        await changes.create_organization(store, "cli:test", '<img src=x onerror="alert(2)">')
        await store.write_ledger([ledger_row(1, made.id, "0.50", NOW - timedelta(hours=1), model="<b>model</b>")])

    await in_store(storage_url, seed)
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    for path in ("/console", "/console/keys", f"/console/keys/{made.id}", "/console/audit"):
        page = await visitor.page(path)
        assert escaped in page, path
        assert "<script" not in page and "<b>model" not in page, path
    assert "&lt;b&gt;model&lt;/b&gt;" in await visitor.page("/console")
    page = await visitor.page("/console/organizations")
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in page and "<img" not in page


def tables(body: str) -> list[list[list[str]]]:
    """A page's tables, each its rows (the header's first), each row its cells' text."""
    return [
        [
            [
                html.unescape(re.sub(r"<[^>]+>", " ", cell)).split()
                for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", tr)
            ]
            for tr in re.findall(r"<tr>(.*?)</tr>", table)
        ]
        for table in re.findall(r"<table>(.*?)</table>", body)
    ]


async def test_a_keys_page_counts_tokens_and_money_as_its_requests_do(gateway, storage_url):
    visitor, _ = await signed_in(gateway)
    costs = ["0.00371", "0.04", "0.00004"]
    await in_store(
        storage_url,
        lambda store: store.write_ledger(
            [ledger_row(i, 1, cost, NOW - timedelta(hours=len(costs) - i)) for i, cost in enumerate(costs)]
        ),
    )
    body = await visitor.page("/console/keys/1")
    *_, models, recent = [[[" ".join(cell) for cell in row] for row in table] for table in tables(body)]
    tokens = ["input", "cache write", "cache read", "output"]
    assert models[0] == ["model", "requests", *tokens, "cost"]
    assert recent[0][4:9] == [*tokens, "cost"]
    # The models table's tokens add up the requests' own, column by column (cache apart from input).
    (model,) = models[1:]
    for column, name in enumerate(tokens):
        assert int(model[2 + column]) == sum(int(request[4 + column]) for request in recent[1:]), name
    # Every amount has one precision: four decimals, and a sliver above 0 says so.
    assert [request[8] for request in recent[1:]] == ["<$0.0001", "$0.0400", "$0.0037"]  # the newest first
    assert model[6] == "$0.0438"
    amounts = re.findall(r"<?\$[\d,.]+", re.sub(r"<[^>]+>", " ", body))
    assert amounts and all(re.fullmatch(r"<?\$[\d,]+\.\d{4}", amount) for amount in amounts), amounts


async def test_the_audit_log_reads_as_fields(gateway, storage_url):
    visitor, session_csrf = await signed_in(gateway)
    form = {"name": "ci-runner", "spend_limit_usd": "12.5", "csrf": session_csrf}
    assert (await visitor.call("POST", "/console/keys", form))[0] == 200
    made = (await in_store(storage_url, lambda store: store.list_keys()))[-1]
    await visitor.call("POST", f"/console/keys/{made.id}/revoke", {"csrf": session_csrf})
    body = await visitor.page("/console/audit")
    assert "<pre" not in body and "{" not in re.sub(r"<style>.*?</style>", "", body, flags=re.S)
    revoke, create = tables(body)[0][1:3]
    # A change shows the fields that changed, then every field under "all fields".
    assert revoke[5][:2] == ["revoked", "no"] and revoke[6][:2] == ["revoked", "yes"]
    # A thing made shows each field as a name and its value, an amount in dollars.
    after = " ".join(create[6])
    assert "name ci-runner" in after and "spend_limit_usd $12.5000" in after and "revoked no" in after


async def test_the_console_in_a_browser(gateway, storage_url, chromium, tmp_path):
    from playwright.async_api import async_playwright

    # Spend on four days of the last thirty (two requests on one of them), one day whose
    # requests cost nothing, and one day before the plot's window.
    days = [0, 0, 1, 4, 4, 9, 12, 45]
    costs = ["0.40", "0.35", "1.20", "0.25", "0.50", "0", "2.10", "9.99"]
    rows = [ledger_row(i, 1, cost, NOW - timedelta(days=d, hours=1)) for i, (d, cost) in enumerate(zip(days, costs))]
    await in_store(storage_url, lambda store: store.write_ledger(rows))
    spent_days = sorted({(NOW - timedelta(days=d, hours=1)).date().isoformat() for d in (0, 1, 4, 12)})

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium)
        try:
            page = await browser.new_page(viewport={"width": 1180, "height": 900})
            refused = []  # anything the page's own Content-Security-Policy blocked
            page.on(
                "console", lambda message: refused.append(message.text) if "Content Security" in message.text else 0
            )

            await page.goto(gateway.url + "/console")
            assert page.url == gateway.url + "/console/sign-in"
            await page.fill('input[name="token"]', ROOT_TOKEN)
            await page.click('button:has-text("Sign in")')
            await page.wait_for_url(gateway.url + "/console")

            bars = page.locator("svg.spend-per-day rect.bar")
            assert sorted([await bar.get_attribute("data-day") for bar in await bars.all()]) == spent_days
            costs_drawn = {
                await bar.get_attribute("data-day"): await bar.get_attribute("data-cost-usd")
                for bar in await bars.all()
            }
            assert Decimal(costs_drawn[(NOW - timedelta(days=4, hours=1)).date().isoformat()]) == Decimal("0.75")
            # The plot's numbers are the API's: each day drawn costs what /admin/v1/usage says it did.
            async with aiohttp.ClientSession() as http:
                async with http.get(
                    gateway.url + "/admin/v1/usage?group_by=day", headers={"Authorization": f"Bearer {ROOT_TOKEN}"}
                ) as response:
                    by_day = {r["day"]: Decimal(r["cost_usd"]) for r in (await response.json())["data"]}
            assert {day: Decimal(cost) for day, cost in costs_drawn.items()} == {d: by_day[d] for d in spent_days}
            # Its axis is marked at round amounts from $0 up past the dearest day, ruled across.
            steps = await page.locator("svg.spend-per-day text.step").evaluate_all("all => all.map(t => t.textContent)")
            amounts = [Decimal(step.removeprefix("$")) for step in steps]
            assert amounts[0] == 0 and amounts[-1] >= Decimal("2.10") > amounts[-2]
            assert len({b - a for a, b in zip(amounts, amounts[1:])}) == 1 and len(amounts) >= 3
            assert all(re.fullmatch(r"\$\d+\.\d{4}", step) for step in steps), steps
            # Beside it, requests per day: the same days, two requests on the one that had two.
            counts = {
                await bar.get_attribute("data-day"): await bar.get_attribute("data-requests")
                for bar in await page.locator("svg.requests-per-day rect.bar").all()
            }
            zero_cost_day = (NOW - timedelta(days=9, hours=1)).date().isoformat()  # a request is one, free or not
            assert sorted(counts) == sorted([*spent_days, zero_cost_day])
            assert counts[(NOW - timedelta(days=4, hours=1)).date().isoformat()] == "2"
            # The stylesheet applies (its hash is in the policy): the bars are its blue.
            assert await bars.first.evaluate("bar => getComputedStyle(bar).fill") == "rgb(62, 111, 216)"
            assert "$4.8000" in await page.locator(".figures").inner_text()  # this month: November's four days
            await page.screenshot(path=str(tmp_path / "console-overview.png"), full_page=True)

            await page.click('header a:has-text("Keys")')
            await page.fill('input[name="name"]', "from-the-browser")
            await page.click('button:has-text("Create key")')
            secret = await page.locator("#secret").inner_text()
            assert secret.startswith("sk-ezat-")
            await page.goto(page.url)  # the same page again, by GET: the secret is not there
            assert secret not in await page.content() and await page.locator("#secret").count() == 0
            async with aiohttp.ClientSession() as http:  # and it is a working key
                async with http.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}) as r:
                    assert r.status == 200

            row = page.locator("tr", has_text="from-the-browser")
            made_id = (await row.locator("td").first.inner_text()).strip()
            await row.locator('a:has-text("Revoke")').click()  # asks first; Cancel goes back, changing nothing
            assert await page.locator("h1").inner_text() == f"Revoke key {made_id} (from-the-browser)?"
            await page.click('a:has-text("Cancel")')
            await page.wait_for_url(gateway.url + f"/console/keys/{made_id}")
            assert "active" in await page.locator("table").first.inner_text()
            await page.click('a:has-text("Revoke")')
            await page.click('button:has-text("Revoke")')
            await page.wait_for_url(gateway.url + f"/console/keys/{made_id}/revoke")
            said = await page.locator(".notice").inner_text()
            assert said == f"Key {made_id} (from-the-browser) was revoked: its requests get 401 from now on."
            row = page.locator("tr", has_text="from-the-browser")
            assert "revoked" in await row.inner_text() and await row.locator("a.button").count() == 0

            await page.click('header a:has-text("Audit log")')
            entries = [await row.locator("td").all_inner_texts() for row in await page.locator("tbody tr").all()]
            made = f"key:{made_id}"
            assert [cells[2:5] for cells in entries[:2]] == [["root", "key.revoke", made], ["root", "key.create", made]]
            assert secret not in await page.content()
            assert refused == []
        finally:
            await browser.close()
