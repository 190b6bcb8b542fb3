"""The admin API (/admin/v1/…) through a real gateway on loopback, on SQLite and PostgreSQL: its
auth rules, every key and organization operation and its audit entry, usage equal to the CLI's,
the ledger's pages, bad input, and its OpenAPI document against the routes."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import re
from dataclasses import replace
from decimal import Decimal

import aiohttp
import openai
import pytest

from gateway.admin.api import PREFIX
from gateway.admin.openapi import OPENAPI
from gateway.config import AdminConfig, AdminTokenConfig, OrganizationConfig, usd
from gateway.storage import open_store
from tests.support import KEY, MODEL, make_config, run_command
from tests.test_admin_cli import in_database_files

ROOT_TOKEN = "ezat-admin-root-token-for-tests"
VIEWER_TOKEN = "ezat-admin-viewer-token-for-tests"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


ADMIN = AdminConfig(
    tokens=(
        AdminTokenConfig(name="root", role="admin", token_sha256=_sha(ROOT_TOKEN)),
        AdminTokenConfig(name="watcher", role="viewer", token_sha256=_sha(VIEWER_TOKEN)),
    )
)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


class Admin:
    """The admin API of a gateway, called with a token (ROOT_TOKEN unless told otherwise)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway
        self.url = gateway.url + PREFIX

    async def call(self, method: str, path: str, *, token: str | None = ROOT_TOKEN, **options):
        """(status, JSON body or text, headers)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        headers.update(options.pop("headers", {}))
        async with aiohttp.ClientSession() as http:
            async with http.request(method, self.url + path, headers=headers, **options) as response:
                text = await response.text()
                is_json = response.content_type == "application/json"
                return response.status, json.loads(text) if is_json else text, response.headers

    async def ok(self, method: str, path: str, expected: int = 200, **options):
        status, body, _ = await self.call(method, path, **options)
        assert status == expected, body
        return body


@pytest.fixture
async def admin(start_gateway, upstream, storage_url) -> Admin:
    config = make_config(upstream.url, storage_url)
    config = replace(config, admin=ADMIN, organizations=(OrganizationConfig(name="filed", balance_usd=None),))
    return Admin(await start_gateway(config))  # key_cache_seconds: the default, 5 s


async def ask(gateway, secret: str):
    async with gateway.client(api_key=secret) as client:
        return await client.chat.completions.create(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )


def assert_error(status_body, status: int, kind: str, words: str = "") -> None:
    got_status, body, _ = status_body
    assert got_status == status, body
    assert body["error"]["type"] == kind, body
    assert words in body["error"]["message"], body


async def test_the_auth_rules(admin, storage_url, tmp_path):
    assert_error(await admin.call("GET", "/keys", token=None), 401, "authentication_error", "Missing admin token")
    # A gateway key is no admin token, and an admin token no gateway key.
    assert_error(await admin.call("GET", "/keys", token=KEY), 401, "authentication_error", "Invalid admin token")
    with pytest.raises(openai.AuthenticationError):
        await ask(admin.gateway, ROOT_TOKEN)
    # A viewer reads, and may not write.
    assert (await admin.ok("GET", "/keys", token=VIEWER_TOKEN))["data"][0]["name"] == "test"
    for method, path in (("POST", "/keys"), ("POST", "/organizations"), ("POST", "/organizations/1/suspend")):
        status = await admin.call(method, path, token=VIEWER_TOKEN, json={"name": "x"})
        assert_error(status, 403, "permission_error", "'watcher' is a viewer's")
    assert len((await admin.ok("GET", "/keys"))["data"]) == 1  # nothing was made

    # A token made with the CLI works until it is revoked, then gets 401 at once.
    status, output = await run_command(
        "admin-tokens", "create", "--name", "ops", "--role", "admin", "--storage", storage_url, cwd=tmp_path
    )
    assert status == 0, output
    token = output.splitlines()[-1]
    assert token.startswith("ezat-admin-")
    made = await admin.ok("POST", "/keys", 201, token=token, json={"name": "by-ops"})
    status, output = await run_command("admin-tokens", "revoke", "ops", "--storage", storage_url, cwd=tmp_path)
    assert status == 0, output
    assert_error(await admin.call("GET", "/keys", token=token), 401, "authentication_error")
    # The change it made is in the audit log under its name.
    entries = (await admin.ok("GET", "/audit"))["data"]
    (creation,) = [e for e in entries if e["action"] == "key.create"]
    assert (creation["actor"], creation["target"], creation["after"]["name"]) == ("ops", f"key:{made['id']}", "by-ops")


async def test_failed_attempts_from_an_address_are_limited_never_the_right_token(admin):
    for _ in range(10):
        assert_error(await admin.call("GET", "/keys", token="wrong"), 401, "authentication_error")
    status, body, headers = await admin.call("GET", "/keys", token="wrong")
    assert_error((status, body, headers), 429, "rate_limit_error", "Too many failed admin sign-ins")
    assert 1 <= int(headers["retry-after"]) <= 60
    # Anyone behind the same address (a proxy, a web page in a browser) may make failures; the
    # right token is accepted all the same.
    assert (await admin.ok("GET", "/keys"))["data"][0]["name"] == "test"
    # A request without a token guesses nothing: 401, and not counted.
    assert_error(await admin.call("GET", "/keys", token=None), 401, "authentication_error", "Missing admin token")


async def test_the_admin_api_is_off_without_an_admin_table(start_gateway, upstream):
    gateway = await start_gateway()
    status, body, _ = await Admin(gateway).call("GET", "/keys")
    assert status == 404
    assert "error" in body


async def test_every_key_operation_and_its_audit_entry(admin, storage_url):
    gateway = admin.gateway
    org = await admin.ok("POST", "/organizations", 201, json={"name": "acme", "balance_usd": "100"})
    created = await admin.ok(
        "POST",
        "/keys",
        201,
        json={"name": "ci", "models": ["anthropic/*"], "spend_limit_usd": 5, "rpm": 100, "organization": "acme"},
    )
    secret = created["secret"]
    assert re.fullmatch(r"sk-ezat-[A-Za-z0-9_-]{40,}", secret)
    assert (created["spend_limit_usd"], created["rpm"], created["organization"]) == ("5.000000000", 100, "acme")
    assert (await ask(gateway, secret)).choices[0].message.content

    got = await admin.ok("GET", f"/keys/{created['id']}")
    assert "secret" not in got and "key_sha256" not in got
    # The request above, exact to the billionth, as every amount the API answers with.
    assert re.fullmatch(r"0\.\d{9}", got["spent_usd"]) and Decimal(got["spent_usd"]) > 0

    # Filters, and pages followed by their cursor.
    for i in range(3):
        await admin.ok("POST", "/keys", 201, json={"name": f"bulk{i}"})
    assert [k["name"] for k in (await admin.ok("GET", "/keys?organization=acme"))["data"]] == ["ci"]
    assert [k["name"] for k in (await admin.ok("GET", "/keys?name=bulk1"))["data"]] == ["bulk1"]
    names, cursor = [], ""
    while cursor is not None:
        page = await admin.ok("GET", f"/keys?limit=2{cursor and '&after=' + cursor}")
        assert len(page["data"]) <= 2
        names += [k["name"] for k in page["data"]]
        cursor = page["next"]
    assert names == ["test", "ci", "bulk0", "bulk1", "bulk2"]

    patched = await admin.ok(
        "PATCH",
        f"/keys/{created['id']}",
        json={
            "models": ["test/*"],
            "spend_limit_usd": None,
            "rpm": 0,
            "expires_at": "2031-01-01",
            "organization": "default",
        },
    )
    assert (patched["models"], patched["spend_limit_usd"], patched["rpm"]) == (["test/*"], None, None)
    assert (patched["expires_at"], patched["organization"]) == ("2031-01-01T00:00:00+00:00", "default")
    with pytest.raises(openai.PermissionDeniedError):
        await ask(gateway, secret)  # MODEL is no longer one of its models
    await admin.ok("PATCH", f"/keys/{created['id']}", json={"models": ["*"]})

    # Rotation: a new secret at once, the old one refused at once (the auth stage's cache of
    # 5 s is dropped for it), the same id and spend.
    await ask(gateway, secret)
    rotated = await admin.ok("POST", f"/keys/{created['id']}/rotate")
    assert rotated["id"] == created["id"] and rotated["secret"] != secret
    assert rotated["spent_usd"] == (await admin.ok("GET", f"/keys/{created['id']}"))["spent_usd"]
    with pytest.raises(openai.AuthenticationError):
        await ask(gateway, secret)
    await ask(gateway, rotated["secret"])

    revoked = await admin.ok("POST", f"/keys/{created['id']}/revoke")
    assert revoked["revoked"] is True
    with pytest.raises(openai.AuthenticationError):
        await ask(gateway, rotated["secret"])  # at once, though it was used a moment ago
    assert [k["name"] for k in (await admin.ok("GET", "/keys?revoked=true"))["data"]] == ["ci"]
    unrevoked = await admin.ok("PATCH", f"/keys/{created['id']}", json={"revoked": False})
    assert unrevoked["revoked"] is False

    entries = (await admin.ok("GET", "/audit?limit=1000"))["data"]
    about_ci = [e for e in entries if e["target"] == f"key:{created['id']}"]
    assert [e["action"] for e in reversed(about_ci)] == [
        "key.create",
        "key.update",
        "key.update",
        "key.rotate",
        "key.revoke",
        "key.update",
    ]
    assert all(e["actor"] == "root" and e["at"] for e in about_ci)
    create, patch, *_ = reversed(about_ci)
    assert create["before"] is None and create["after"]["models"] == ["anthropic/*"]
    assert (patch["before"]["rpm"], patch["after"]["rpm"]) == (100, None)
    assert (patch["before"]["organization"], patch["after"]["organization"]) == ("acme", "default")
    assert [e["action"] for e in entries if e["target"] == f"organization:{org['id']}"] == ["organization.create"]

    # No secret nor digest in the audit log: not through the API, nor in the database's files.
    text = json.dumps(entries)
    for hidden in (secret, rotated["secret"], _sha(secret), _sha(rotated["secret"]), "key_sha256"):
        assert hidden not in text
    if storage_url.startswith("sqlite:///"):
        assert await in_database_files(storage_url, _sha(rotated["secret"]))  # the search works
        assert not await in_database_files(storage_url, rotated["secret"])


async def test_keys_and_organizations_from_the_config_file_are_read_only(admin):
    (filed,) = (await admin.ok("GET", "/keys?name=test"))["data"]
    for method, path, body in (
        ("PATCH", f"/keys/{filed['id']}", {"rpm": 5}),
        ("POST", f"/keys/{filed['id']}/revoke", None),
        ("POST", f"/keys/{filed['id']}/rotate", None),
        ("PATCH", "/organizations/filed", {"suspended": True}),
        ("POST", "/organizations/filed/suspend", None),
    ):
        assert_error(await admin.call(method, path, json=body), 409, "conflict_error", "declared in the config file")
    await ask(admin.gateway, KEY)  # unchanged
    assert (await admin.ok("GET", "/audit"))["data"] == []


async def test_top_ups_at_once_never_take_a_balance_past_its_cap(admin):
    """Each of ten top-ups would fit the balance as it was read; together only two fit the most
    a balance may be: the store checks under its lock, so the others are refused, nothing added."""
    await admin.ok("POST", "/organizations", 201, json={"name": "acme", "balance_usd": "999999999980"})
    answers = await asyncio.gather(
        *(admin.call("POST", "/organizations/acme/top-up", json={"amount_usd": 10}) for _ in range(10))
    )
    assert sorted(status for status, _, _ in answers) == [200] * 2 + [400] * 8
    refusals = [body["error"]["message"] for status, body, _ in answers if status == 400]
    assert all("past the most a balance may be" in message for message in refusals), refusals
    assert (await admin.ok("GET", "/organizations/acme"))["balance_usd"] == "1000000000000.000000000"


async def test_every_organization_operation_and_its_audit_entry(admin):
    made = await admin.ok("POST", "/organizations", 201, json={"name": "acme", "balance_usd": 10})
    assert (made["balance_usd"], made["suspended"], made["spent_usd"]) == ("10.000000000", False, "0.000000000")
    assert_error(await admin.call("POST", "/organizations", json={"name": "acme"}), 409, "conflict_error", "exists")
    assert (await admin.ok("GET", f"/organizations/{made['id']}"))["name"] == "acme"
    assert (await admin.ok("GET", "/organizations/acme"))["id"] == made["id"]
    assert [o["name"] for o in (await admin.ok("GET", "/organizations"))["data"]] == ["default", "filed", "acme"]

    key = await admin.ok("POST", "/keys", 201, json={"name": "acme-ci", "organization": "acme"})
    assert (await admin.ok("PATCH", "/organizations/acme", json={"balance_usd": "20.5"}))[
        "balance_usd"
    ] == "20.500000000"
    topped = await admin.ok("POST", "/organizations/acme/top-up", json={"amount_usd": 4.5})
    assert topped["balance_usd"] == "25.000000000"
    none = await admin.ok("POST", "/organizations", 201, json={"name": "open"})
    assert_error(
        await admin.call("POST", f"/organizations/{none['id']}/top-up", json={"amount_usd": 1}),
        409,
        "conflict_error",
        "no balance limit",
    )
    assert (await admin.ok("POST", "/organizations/acme/suspend"))["suspended"] is True
    with pytest.raises(openai.PermissionDeniedError):
        await ask(admin.gateway, key["secret"])
    assert (await admin.ok("POST", "/organizations/acme/resume"))["suspended"] is False
    await ask(admin.gateway, key["secret"])

    entries = [e for e in (await admin.ok("GET", "/audit"))["data"] if e["target"] == f"organization:{made['id']}"]
    assert [e["action"] for e in reversed(entries)] == [
        "organization.create",
        "organization.update",
        "organization.top_up",
        "organization.suspend",
        "organization.resume",
    ]
    top_up = entries[2]  # its before and after as they were written
    assert (top_up["before"]["balance_usd"], top_up["after"]["balance_usd"], top_up["actor"]) == (
        "20.5",
        "25.0",
        "root",
    )


@pytest.mark.parametrize(
    "method, path, body, status, words",
    [
        ("POST", "/keys", {}, 400, "name: required"),
        ("POST", "/keys", {"name": "x", "rpm": -1}, 400, "rpm: expected a whole number"),
        ("POST", "/keys", {"name": "x", "rpm": True}, 400, "rpm: expected a whole number"),
        ("POST", "/keys", {"name": "x", "spend_limit_usd": "lots"}, 400, "spend_limit_usd: expected an amount"),
        ("POST", "/keys", {"name": "x", "spend_limit_usd": "NaN"}, 400, "spend_limit_usd: expected an amount"),
        ("POST", "/keys", {"name": "x", "models": []}, 400, "models: expected a non-empty list"),
        ("POST", "/keys", {"name": "x", "expires_at": "soon"}, 400, "expires_at: expected an ISO datetime"),
        ("POST", "/keys", {"name": "x", "expires_at": "0001-01-01T00:00:00+05:00"}, 400, "expires_at: expected"),
        ("POST", "/keys", {"name": "x", "organization": "nowhere"}, 400, "no organization named 'nowhere'"),
        ("POST", "/keys", {"name": "x", "secret": "mine"}, 400, "secret: unknown field"),
        ("POST", "/keys", [1, 2], 400, "a JSON object"),
        ("POST", "/keys", "{not json", 400, "not valid JSON"),
        ("GET", "/keys/999999", None, 404, "no key numbered '999999'"),
        ("GET", "/keys/abc", None, 404, "no key numbered 'abc'"),
        ("PATCH", "/keys/999999", {"rpm": 1}, 404, "no key numbered"),
        ("GET", "/keys?limit=0", None, 400, "limit: expected a whole number from 1 to 1000"),
        ("GET", "/keys?after=-1", None, 400, "after: expected a whole number"),
        ("GET", "/keys?revoked=maybe", None, 400, "revoked: expected true or false"),
        ("GET", "/organizations/nowhere", None, 404, "no organization named 'nowhere'"),
        ("GET", "/organizations/999", None, 404, "no organization numbered 999"),
        ("POST", "/organizations", {"name": ""}, 400, "name: expected 1 to 200 characters, not 0"),
        ("POST", "/organizations", {"name": "2"}, 400, "name: expected a name that is not digits alone"),
        ("POST", "/organizations", {"name": "x" * 201}, 400, "name: expected 1 to 200 characters, not 201"),
        ("POST", "/keys", {"name": "x" * 1_000_000}, 400, "name: expected 1 to 200 characters, not 1000000"),
        ("POST", "/keys", {"name": "invoice\u202eexe.pdf"}, 400, "name: expected no control or bidirectional"),
        ("POST", "/keys", {"name": "two\nlines"}, 400, "formatting character, not U+000A"),
        ("POST", "/keys", {"name": "007"}, 400, "name: expected a name that is not digits alone"),
        ("POST", "/keys", {"name": " padded"}, 400, "name: expected no space at either end"),
        ("POST", "/organizations", {"name": "acme\u00a0"}, 400, "name: expected no space at either end"),
        ("POST", "/keys", {"name": "x", "spend_limit_usd": "5_000"}, 400, "spend_limit_usd: expected an amount"),
        ("POST", "/keys", {"name": "x", "spend_limit_usd": "١٢"}, 400, "as a plain decimal number such as 12.50"),
        ("POST", "/keys", {"name": "x", "spend_limit_usd": "1e3"}, 400, "as a plain decimal number such as 12.50"),
        ("POST", "/organizations", {"name": "x", "balance_usd": -3}, 400, "balance_usd: expected an amount"),
        ("POST", "/organizations/default/top-up", {}, 400, "amount_usd: required"),
        ("POST", "/organizations/default/top-up", {"amount_usd": 0}, 400, "above 0"),
        ("PATCH", "/organizations/default", {"suspended": "yes"}, 400, "suspended: expected true or false"),
        ("GET", "/usage?group_by=week", None, 400, "group_by: expected"),
        ("GET", "/usage?format=xml", None, 400, "format: expected json or csv"),
        ("GET", "/usage?since=yesterday", None, 400, "since: expected an ISO datetime"),
        ("GET", "/ledger?key_id=x", None, 400, "key_id: expected a whole number"),
        ("GET", "/audit?limit=5000", None, 400, "limit: expected a whole number from 1 to 1000"),
    ],
)
async def test_bad_input_is_a_clear_json_error(admin, method, path, body, status, words):
    options = {"data": body} if isinstance(body, str) else {"json": body} if body is not None else {}
    got, answer, _ = await admin.call(method, path, **options)
    assert got == status, answer
    assert words in answer["error"]["message"], answer
    assert answer["error"]["type"] in ("invalid_request_error", "not_found_error")


async def make_ledger(admin) -> dict[str, str]:
    """Requests by three keys in two organizations (one key twice the name of another); their secrets."""
    await admin.ok("POST", "/organizations", 201, json={"name": "acme"})
    secrets = {}
    for name, organization in (("alice", "acme"), ("bob", "default"), ("carol", "acme")):
        secrets[name] = (await admin.ok("POST", "/keys", 201, json={"name": name, "organization": organization}))[
            "secret"
        ]
    for name, times in (("alice", 3), ("bob", 1), ("carol", 2)):
        for _ in range(times):
            await ask(admin.gateway, secrets[name])
    await ask(admin.gateway, KEY)
    return secrets


async def test_usage_by_the_api_is_the_clis(admin, storage_url, tmp_path):
    await make_ledger(admin)
    for group_by in ("key", "organization", "person", "model", "deployment", "day", "session"):
        api = await admin.ok("GET", f"/usage?group_by={group_by}")
        status, cli = await run_command(
            "usage", "--by", group_by, "--format", "json", "--storage", storage_url, cwd=tmp_path
        )
        assert status == 0, cli
        assert api["data"] == json.loads(cli), group_by
        assert api["group_by"] == group_by
    by_key = {line["key"]: line for line in (await admin.ok("GET", "/usage?group_by=key"))["data"]}
    assert {name: line["requests"] for name, line in by_key.items()} == {"alice": 3, "bob": 1, "carol": 2, "test": 1}
    by_org = {
        line["organization"]: line["requests"]
        for line in (await admin.ok("GET", "/usage?group_by=organization"))["data"]
    }
    assert by_org == {"acme": 5, "default": 2}

    _, text, headers = await admin.call("GET", "/usage?group_by=model&format=csv")
    assert headers["content-type"].startswith("text/csv")
    _, cli = await run_command("usage", "--by", "model", "--format", "csv", "--storage", storage_url, cwd=tmp_path)
    assert text == cli
    assert next(csv.reader(io.StringIO(text)))[:2] == ["model", "requests"]

    # A time range: since the future, nothing; until the future, everything.
    assert (await admin.ok("GET", "/usage?group_by=key&since=2999-01-01"))["data"] == []
    until = await admin.ok("GET", "/usage?group_by=key&until=2999-01-01T00:00:00Z")
    assert sum(line["requests"] for line in until["data"]) == 7


async def test_the_ledger_in_pages(admin):
    await make_ledger(admin)
    rows, cursor, pages = [], "", 0
    while cursor is not None:
        page = await admin.ok("GET", f"/ledger?limit=2{cursor and '&after=' + cursor}")
        rows += page["data"]
        cursor, pages = page["next"], pages + 1
    assert (len(rows), pages) == (7, 4)
    assert len({row["request_id"] for row in rows}) == 7
    assert [row["key"] for row in rows] == ["alice"] * 3 + ["bob"] + ["carol"] * 2 + ["test"]
    first = rows[0]
    assert (first["model"], first["status"]) == (MODEL, "complete")
    assert first["input_tokens"] > 0 and first["output_tokens"] > 0 and float(first["cost_usd"]) > 0
    assert first["finished_at"] >= first["started_at"]
    carol = (await admin.ok("GET", "/keys?name=carol"))["data"][0]
    only = await admin.ok("GET", f"/ledger?key_id={carol['id']}")
    assert ([row["key"] for row in only["data"]], only["next"]) == (["carol", "carol"], None)
    # The admin API's own requests are not billed: the ledger holds the seven above alone.
    assert len((await admin.ok("GET", "/ledger?limit=1000"))["data"]) == 7


async def test_the_openapi_document_describes_every_route_and_no_other(admin):
    status, document, _ = await admin.call("GET", "/openapi.json", token=None)  # public: only the API's shape
    assert status == 200
    assert document == json.loads(json.dumps(OPENAPI))
    assert document["openapi"].startswith("3.1")
    registered = {
        (route.method.lower(), route.resource.canonical)
        for route in admin.gateway.app.router.routes()
        if route.resource is not None and route.resource.canonical.startswith(PREFIX) and route.method != "HEAD"
    }
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert registered == documented
    # Every reference resolves.
    text = json.dumps(document)
    for ref in set(re.findall(r'"\$ref": "#/components/(\w+)/(\w+)"', text)):
        assert ref[1] in document["components"][ref[0]], ref


@pytest.mark.parametrize(
    "text", ["12.50", "5", "0", "0.000000001", "5_000", "1e3", "+5", ".5", "5.", "-1", "\u0661\u0662", "", "1 2"]
)
def test_the_documented_amount_pattern_is_the_one_the_parser_takes(text):
    """An amount string matches the OpenAPI document's pattern exactly when usd() takes it (within
    the range, which the pattern does not describe)."""
    pattern = OPENAPI["components"]["schemas"]["TopUp"]["properties"]["amount_usd"]["oneOf"][1]["pattern"]
    try:
        taken = usd(text) is not None
    except ValueError:
        taken = False
    assert (re.search(pattern, text) is not None) == taken


def test_the_document_gives_names_their_bounds_and_every_route_its_503():
    schemas = OPENAPI["components"]["schemas"]
    for name in (schemas["KeyCreate"]["properties"]["name"], schemas["OrganizationCreate"]["properties"]["name"]):
        assert (name["minLength"], name["maxLength"]) == (1, 200)
    assert "store_unavailable" in OPENAPI["components"]["responses"]["E503"]["description"]
    assert "retry-after" in OPENAPI["components"]["responses"]["E503"]["headers"]
    routes = [
        operation
        for path, operations in OPENAPI["paths"].items()
        if path != "/admin/v1/openapi.json"
        for operation in operations.values()
    ]
    assert all("503" in operation["responses"] for operation in routes)


async def test_amounts_out_of_range_are_400s(admin):
    for value, problem in (
        ("1e999999999", "expected an amount of USD as a plain decimal number such as 12.50"),
        (1e13, "expected an amount of USD from 0 to 1,000,000,000,000"),
        (-1, "expected an amount of USD from 0 to 1,000,000,000,000"),
        ("0.0000000001", "expected at most 9 decimal places (billionths of a dollar)"),
    ):
        assert_error(
            await admin.call("POST", "/keys", json={"name": "big", "spend_limit_usd": value}),
            400,
            "invalid_request_error",
            f"spend_limit_usd: {problem}",
        )
    assert [key["name"] for key in (await admin.ok("GET", "/keys"))["data"]] == ["test"]  # nothing made
    # A JSON number is a number in any notation; a string is a plain decimal.
    for value, stored in ((1e-7, "0.000000100"), (2.5e3, "2500.000000000"), ("12.50", "12.500000000")):
        made = await admin.ok("POST", "/keys", 201, json={"name": "fine", "spend_limit_usd": value})
        assert made["spend_limit_usd"] == stored, value


async def test_a_top_up_may_not_take_a_balance_past_the_most_a_balance_may_be(admin):
    most = 10**12
    made = await admin.ok("POST", "/organizations", 201, json={"name": "rich", "balance_usd": most - 1})
    assert_error(
        await admin.call("POST", f"/organizations/{made['id']}/top-up", json={"amount_usd": "1.5"}),
        400,
        "invalid_request_error",
        "amount_usd: the balance would be 1,000,000,000,000.5, past the most a balance may be "
        "(1,000,000,000,000): add at most 1",
    )
    assert (await admin.ok("GET", f"/organizations/{made['id']}"))["balance_usd"] == f"{most - 1}.000000000"
    topped = await admin.ok("POST", f"/organizations/{made['id']}/top-up", json={"amount_usd": 1})
    assert topped["balance_usd"] == f"{most}.000000000"
    assert [e["action"] for e in (await admin.ok("GET", "/audit"))["data"]] == [
        "organization.top_up",
        "organization.create",
    ]


async def test_a_path_of_digits_is_an_id_and_a_name_is_never_digits(admin, storage_url):
    """An organization's path takes its id or its name; a name of digits alone is refused, so the
    two never meet. One an older version stored is reached by its id, and its name is not read."""
    default = (await admin.ok("GET", "/organizations/default"))["id"]
    assert_error(
        await admin.call("POST", "/organizations", json={"name": str(default)}),
        400,
        "invalid_request_error",
        "name: expected a name that is not digits alone (digits are an id)",
    )
    store = open_store(storage_url)  # as an older version wrote it: straight into the store
    await store.open()
    try:
        digits = await store.create_organization(str(default))
    finally:
        await store.close()
    suspended = await admin.ok("POST", f"/organizations/{default}/suspend")
    assert (suspended["id"], suspended["name"]) == (default, "default")
    assert (await admin.ok("GET", f"/organizations/{digits.id}"))["suspended"] is False
    assert (await admin.ok("POST", f"/organizations/{digits.id}/suspend"))["name"] == str(default)


async def test_an_admin_token_is_read_from_authorization_alone(admin):
    """x-api-key carries gateway keys, never admin tokens: one sent there is no token at all."""
    assert_error(
        await admin.call("GET", "/keys", token=None, headers={"x-api-key": ROOT_TOKEN}),
        401,
        "authentication_error",
        "Missing admin token: send it as `Authorization: Bearer <token>`.",
    )
    assert (await admin.ok("GET", "/keys", headers={"x-api-key": "anything"}))["data"]  # the bearer decides


async def test_client_text_in_the_usage_csv_is_text_to_a_spreadsheet(admin, storage_url, tmp_path):
    """A session's name is the client's text: one a spreadsheet would run as a formula is written
    with a leading ', by the admin API and the CLI alike; the numbers stay numbers, and JSON
    keeps the name as it was sent."""
    sessions = ['=HYPERLINK("http://x")', "-1.5", "@SUM(A1)", "+1", "plain"]
    for session in sessions:
        async with admin.gateway.client(api_key=KEY) as client:
            await client.chat.completions.create(
                model=MODEL,
                max_tokens=20,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-ezat-session": session},
            )
    _, api, _ = await admin.call("GET", "/usage?group_by=session&format=csv")
    status, cli = await run_command(
        "usage", "--by", "session", "--format", "csv", "--storage", storage_url, cwd=tmp_path
    )
    assert status == 0, cli
    for text in (api, cli):
        rows = list(csv.DictReader(io.StringIO(text)))
        assert sorted(row["session"] for row in rows) == sorted(
            ['\'=HYPERLINK("http://x")', "'-1.5", "'@SUM(A1)", "'+1", "plain"]
        )
        for row in rows:
            assert int(row["requests"]) == 1 and Decimal(row["cost_usd"]) > 0
    assert sorted(line["session"] for line in (await admin.ok("GET", "/usage?group_by=session"))["data"]) == sorted(
        sessions
    )


async def test_a_budget_period_without_a_spend_limit_is_refused(admin):
    """A period is what a limit counts over: alone it would limit nothing, so it is refused,
    whether the key is made so or an update would leave it so."""
    needs_a_limit = "a budget period (month) needs a spend limit to count over"
    assert_error(
        await admin.call("POST", "/keys", json={"name": "monthly", "budget_period": "month"}),
        400,
        "invalid_request_error",
        needs_a_limit,
    )
    assert [key["name"] for key in (await admin.ok("GET", "/keys"))["data"]] == ["test"]  # nothing made
    made = await admin.ok("POST", "/keys", 201, json={"name": "unlimited"})
    assert_error(
        await admin.call("PATCH", f"/keys/{made['id']}", json={"budget_period": "month"}),
        400,
        "invalid_request_error",
        needs_a_limit,
    )
    limited = await admin.ok("PATCH", f"/keys/{made['id']}", json={"budget_period": "month", "spend_limit_usd": 5})
    assert (limited["budget_period"], limited["spend_limit_usd"]) == ("month", "5.000000000")
    assert_error(
        await admin.call("PATCH", f"/keys/{made['id']}", json={"spend_limit_usd": None}),
        400,
        "invalid_request_error",
        needs_a_limit,
    )
    cleared = await admin.ok("PATCH", f"/keys/{made['id']}", json={"spend_limit_usd": None, "budget_period": None})
    assert (cleared["budget_period"], cleared["spend_limit_usd"]) == (None, None)


async def test_the_documented_shapes_are_what_the_api_answers(admin, upstream):
    """The OpenAPI document's keys, ledger rows and usage rows name exactly the fields the API sends."""
    schemas = OPENAPI["components"]["schemas"]
    await ask(admin.gateway, KEY)  # one billed request: a ledger row and a usage group
    [key, *_] = (await admin.ok("GET", "/keys"))["data"]
    assert set(key) == set(schemas["Key"]["properties"])
    [ledger_row] = (await admin.ok("GET", "/ledger"))["data"]
    assert set(ledger_row) == set(schemas["LedgerRow"]["properties"])
    usage = await admin.ok("GET", "/usage?group_by=model")
    [group] = usage["data"]
    assert set(group) - {"model"} == set(schemas["Usage"]["properties"]["data"]["items"]["properties"])
