"""`ezat-gateway admin-tokens …` and `ezat-gateway audit` as an operator runs them (the installed
console script in a subprocess, on SQLite and PostgreSQL), and the audit entry every change the
command line makes writes."""

from __future__ import annotations

import getpass
import json
import re

import openai
import pytest

from tests.test_admin_cli import (  # noqa: F401 (backend: a fixture)
    CONFIG_KEY,
    ask,
    backend,
    create_ci_key,
    ezat,
    in_database_files,
    serve,
    stored_keys,
)


async def test_admin_tokens_create_list_revoke(backend, start_gateway):
    _, _, url = backend
    status, output = await ezat(backend, "admin-tokens", "create", "--name", "ops", "--role", "admin")
    assert status == 0, output
    *said, token = output.splitlines()
    assert re.fullmatch(r"ezat-admin-[A-Za-z0-9_-]{40,}", token)  # last, alone on its line
    assert said[-1] == "created admin token 1 (ops, admin); it is shown only this once:"  # after "… did not exist"
    status, output = await ezat(backend, "admin-tokens", "create", "--name", "ops", "--role", "viewer")
    assert (status, output) == (1, "an admin token named 'ops' exists already (revoked ones keep their names)\n")
    status, output = await ezat(backend, "admin-tokens", "create", "--name", "eve", "--role", "root")
    assert status == 2 and "invalid choice: 'root'" in output

    status, listed = await ezat(backend, "admin-tokens", "list")
    assert status == 0, listed
    header, line = listed.splitlines()
    assert header.split() == ["id", "name", "role", "created_at", "revoked_at"]
    assert line.split()[:3] == ["1", "ops", "admin"] and len(line.split()) == 4  # not revoked
    assert token not in listed

    status, output = await ezat(backend, "admin-tokens", "revoke", "ops")
    assert status == 0, output
    assert len(output.splitlines()[1].split()) == 5  # revoked_at
    assert await ezat(backend, "admin-tokens", "revoke", "nobody") == (1, "no admin token named or numbered 'nobody'\n")
    if url.startswith("sqlite:///"):
        assert not await in_database_files(url, token)


async def test_every_change_the_cli_makes_is_audited_without_secrets(backend, start_gateway):
    _, _, url = backend
    secret = await create_ci_key(backend, "--rpm", "10")
    changes = [
        ("keys", "update", "ci", "--rpm", "20"),
        ("keys", "revoke", "ci"),
        ("keys", "update", "ci", "--unrevoke"),
        ("orgs", "create", "acme", "--balance", "10"),
        ("orgs", "update", "acme", "--balance", "12"),
        ("orgs", "top-up", "acme", "--amount", "3.5"),
        ("orgs", "suspend", "acme"),
        ("orgs", "resume", "acme"),
        ("admin-tokens", "create", "--name", "ops", "--role", "viewer"),
        ("admin-tokens", "revoke", "ops"),
    ]
    shown = [secret]
    for change in changes:
        status, output = await ezat(backend, *change)
        assert status == 0, (change, output)
        shown += re.findall(r"(?:sk-ezat-|ezat-admin-)[A-Za-z0-9_-]+", output)
    status, output = await ezat(backend, "keys", "rotate", "ci")
    assert status == 0, output
    rotated = output.splitlines()[-1]
    assert rotated.startswith("sk-ezat-") and rotated != secret
    shown.append(rotated)

    status, output = await ezat(backend, "audit", "--format", "json", "--limit", "100")
    assert status == 0, output
    entries = json.loads(output)
    assert [entry["action"] for entry in reversed(entries)] == [
        "key.create",
        "key.update",
        "key.revoke",
        "key.update",
        "organization.create",
        "organization.update",
        "organization.top_up",
        "organization.suspend",
        "organization.resume",
        "admin_token.create",
        "admin_token.revoke",
        "key.rotate",
    ]
    assert {entry["actor"] for entry in entries} == {f"cli:{getpass.getuser()}"}
    top_up = next(entry for entry in entries if entry["action"] == "organization.top_up")
    assert (top_up["before"]["balance_usd"], top_up["after"]["balance_usd"]) == ("12", "15.5")
    update = entries[-2]
    assert (update["target"], update["before"]["rpm"], update["after"]["rpm"]) == (
        f"key:{(await stored_keys(url))['ci'].id}",
        10,
        20,
    )
    digests = [key.key_sha256 for key in (await stored_keys(url)).values()]
    for hidden in (*shown, *digests, "sha256"):
        assert hidden not in output

    # A refused change is not audited; the table's newest line is the rotation.
    status, _ = await ezat(backend, "orgs", "top-up", "acme", "--amount", "0")
    assert status == 2
    status, table = await ezat(backend, "audit", "--limit", "1")
    header, line = table.splitlines()
    assert header.split()[:5] == ["id", "at", "actor", "action", "target"]
    assert "key.rotate" in line.split()


async def test_a_rotated_key_keeps_its_id_and_the_old_secret_stops_working(backend, start_gateway):
    _, _, url = backend
    secret = await create_ci_key(backend)
    gateway = await serve(start_gateway, backend)  # reads keys afresh on every request
    await ask(gateway, secret)
    before = (await stored_keys(url))["ci"]
    status, output = await ezat(backend, "keys", "rotate", "ci")
    assert status == 0, output
    with pytest.raises(openai.AuthenticationError):
        await ask(gateway, secret)
    await ask(gateway, output.splitlines()[-1])
    after = (await stored_keys(url))["ci"]
    assert (after.id, after.spent_usd > 0) == (before.id, True)
    # The config file's key is its file's: not rotated here.
    status, output = await ezat(backend, "keys", "rotate", "cfg")
    assert (status, output) == (
        1,
        "key 'cfg' is declared in the config file: change it there (revoked = true to revoke it)\n",
    )
    await ask(gateway, CONFIG_KEY)


async def test_top_up_of_an_organization_without_a_balance_is_refused(backend):
    assert (await ezat(backend, "orgs", "create", "open"))[0] == 0
    assert await ezat(backend, "orgs", "top-up", "open", "--amount", "5") == (
        1,
        "organization 'open' has no balance limit to add to: give it a balance_usd first\n",
    )
    assert await ezat(backend, "orgs", "resume", "nowhere") == (1, "no organization named 'nowhere'\n")
