"""Organizations: every key belongs to one, whose balance all its keys share. Concurrent requests
of several keys cannot spend past it (on one SQLite file, and across two gateways on one
PostgreSQL database); a suspended organization's keys are refused; the config file declares
organizations, check-config reports what is wrong with them, and the CLI manages the others."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import replace
from decimal import Decimal

import anthropic
import openai
import pytest

from gateway.config import KeyConfig, OrganizationConfig
from gateway.mock.upstream import Scenario
from gateway.storage import open_store
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, make_config, read_store, run_command
from tests.test_limits import COSTLY, HI, SPEND_LIMIT

OTHER_KEY = "sk-test-other-key"
BALANCE = SPEND_LIMIT  # $0.05: room for three requests of ~$0.015 worst case, not four

# Two keys of the organization "acme", in a SERVE_CONFIG (its `key_fields` end the test key's table).
ACME = f"""organization = "acme"

[[keys]]
key = "{OTHER_KEY}"
name = "other"
organization = "acme"

[[organizations]]
name = "acme"
balance_usd = {BALANCE}
"""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def acme_config(upstream, storage_url: str = "sqlite:///:memory:", *, balance=BALANCE, suspended=False, **key_fields):
    config = make_config(upstream.url, storage_url)
    keys = (
        KeyConfig(name="test", key_sha256=digest(KEY), organization="acme", **key_fields),
        KeyConfig(name="other", key_sha256=digest(OTHER_KEY), organization="acme"),
    )
    acme = OrganizationConfig(name="acme", balance_usd=balance, suspended=suspended)
    return replace(config, organizations=(acme,), keys=keys)


async def spend(url: str, key: str, count: int) -> list[str]:
    """`count` requests at once with `key`: each one's outcome ("ok", or "402" naming acme's balance)."""
    async with openai.AsyncOpenAI(base_url=url + "/openai/v1", api_key=key, max_retries=0) as client:

        async def one() -> str:
            try:
                await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
            except openai.APIStatusError as error:
                assert error.status_code == 402, error
                assert error.body["code"] == error.body["type"] == "insufficient_quota"
                message = error.body["message"]
                assert re.fullmatch(
                    r"This key's organization `acme` has \$0\.0\d+ left of its balance of \$0\.05, less than this "
                    r"request may cost \(\$0\.015\d*\); a lower max_tokens would fit\.",
                    message,
                ), message
                return "402"
            return "ok"

        return await asyncio.gather(*(one() for _ in range(count)))


async def assert_within_the_balance(outcomes: list[str], storage_url: str) -> None:
    assert outcomes.count("ok") == 3 and outcomes.count("402") == len(outcomes) - 3
    rows, keys = await read_store(storage_url)
    assert len(rows) == 3
    assert {key.organization for key in keys} == {"acme"}
    total = sum(row.cost_usd for row in rows)
    assert total <= BALANCE
    store = open_store(storage_url)
    await store.open()
    try:
        acme = await store.find_organization("acme")
        reserved = await store.organizations_reserved()
    finally:
        await store.close()
    assert acme.spent_usd == total  # the ledger's writes added each row's cost to its organization
    assert acme.keys == 2
    assert reserved.get(acme.id, Decimal(0)) == 0  # every reservation ended


async def test_20_parallel_requests_of_two_keys_never_spend_past_their_organizations_balance(
    start_gateway, upstream, tmp_path
):
    storage = f"sqlite:///{tmp_path / 'orgs.db'}"
    gateway = await start_gateway(acme_config(upstream, storage))
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(20)])
    halves = await asyncio.gather(spend(gateway.url, KEY, 10), spend(gateway.url, OTHER_KEY, 10))
    await gateway.runner.cleanup()  # every row written
    await assert_within_the_balance([*halves[0], *halves[1]], storage)


async def test_two_gateways_on_one_postgresql_database_hold_one_organizations_balance(tmp_path, upstream, postgres_url):
    gateways = [
        ServeProcess(tmp_path, name, SERVE_CONFIG, storage_url=postgres_url, upstream_url=upstream.url, key_fields=ACME)
        for name in ("one", "two")
    ]
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(20)])
    try:
        for gateway in gateways:
            await gateway.start()
        # Each gateway gets both keys' requests.
        outcomes = await asyncio.gather(*(spend(g.url, key, 5) for g in gateways for key in (KEY, OTHER_KEY)))
    finally:
        for gateway in gateways:
            await gateway.stop()
    await assert_within_the_balance([o for group in outcomes for o in group], postgres_url)


async def test_the_keys_own_limit_is_named_when_it_runs_out_first(start_gateway, upstream):
    gateway = await start_gateway(acme_config(upstream, spend_limit_usd=Decimal("0.01")))
    async with gateway.client() as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
    assert refused.value.status_code == 402
    assert refused.value.body["message"].startswith("This key has $0.01 left of its spend limit of $0.01")
    assert upstream.requests == []


async def test_a_used_up_balance_is_said_plainly(start_gateway, upstream):
    gateway = await start_gateway(acme_config(upstream, balance=Decimal("0")))
    async with gateway.client(api_key=OTHER_KEY) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=MODEL, messages=HI)
    assert (refused.value.status_code, refused.value.body["type"], refused.value.body["code"]) == (
        402,
        "insufficient_quota",
        "insufficient_quota",
    )
    assert refused.value.body["message"] == "This key's organization `acme` has used up its balance of $0."
    assert upstream.requests == []


async def test_a_key_of_a_suspended_organization_gets_403_and_the_others_are_untouched(start_gateway, upstream):
    config = acme_config(upstream, suspended=True)
    free = KeyConfig(name="free", key_sha256=digest("sk-free"))  # of the default organization
    gateway = await start_gateway(replace(config, keys=(*config.keys, free)))
    for key in (KEY, OTHER_KEY):
        for stream in (False, True):  # a stream is refused before it begins, in the same envelope
            async with gateway.client(api_key=key) as client:
                with pytest.raises(openai.PermissionDeniedError) as refused:
                    await client.chat.completions.create(model=MODEL, messages=HI, stream=stream)
            assert refused.value.body["message"] == "This key's organization `acme` is suspended."
            assert (refused.value.body["type"], refused.value.body["code"]) == ("permission_error", None)
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        with pytest.raises(anthropic.PermissionDeniedError) as refused:
            await claude.messages.create(model=MODEL, max_tokens=64, messages=HI, stream=True)
    assert refused.value.body["error"] == {
        "type": "permission_error",
        "message": "This key's organization `acme` is suspended.",
    }
    assert upstream.requests == []
    async with gateway.client(api_key="sk-free") as client:
        await client.chat.completions.create(model=MODEL, messages=HI)


# --- The config file


async def check_config(tmp_path, key_fields: str) -> tuple[int, str]:
    """check-config of the serve config whose test key's table ends with `key_fields`."""
    path = tmp_path / "gateway.toml"
    path.write_text(
        SERVE_CONFIG.format(
            port=8080,
            storage_url="sqlite:///x.db",
            ratelimit_url="",
            upstream_url="http://127.0.0.1:9",
            upstream_key="k",
            model=MODEL,
            upstream_model="m",
            key=KEY,
            key_fields=key_fields,
        )
    )
    return await run_command("check-config", str(path), cwd=tmp_path)


async def test_check_config_names_a_dangling_or_repeated_organization_with_its_key_path(tmp_path):
    status, output = await check_config(
        tmp_path,
        'organization = "nowhere"\n\n[[organizations]]\nname = "acme"\nbalance_usd = -1\n\n'
        '[[organizations]]\nname = "acme"\nsuspended = "yes"\n\n[[organizations]]\nbalance_usd = 1\n',
    )
    assert status == 1
    assert output.splitlines() == [
        "organizations[0].balance_usd: expected an amount of USD from 0 to 1,000,000,000,000",
        "organizations[1].suspended: expected true or false",
        "organizations[2].name: required",
        'organizations[1].name: duplicate organization name "acme"',
    ]
    status, output = await check_config(tmp_path, 'organization = "nowhere"\n\n[[organizations]]\nname = "acme"\n')
    assert (status, output) == (1, 'keys[0].organization: no organization named "nowhere"\n')
    for fine in ('organization = "acme"\n\n[[organizations]]\nname = "acme"\n', 'organization = "default"\n'):
        status, output = await check_config(tmp_path, fine)
        assert status == 0, output


async def test_the_config_file_is_the_source_of_truth_for_the_organizations_it_declares(
    start_gateway, upstream, tmp_path
):
    storage = f"sqlite:///{tmp_path / 'orgs.db'}"
    config = acme_config(upstream, storage)
    await (await start_gateway(config)).runner.cleanup()
    status, output = await run_command("orgs", "suspend", "acme", "--storage", storage, cwd=tmp_path)
    assert (status, output) == (1, "organization 'acme' is declared in the config file: change it there\n")
    # Taken out of the file (its keys moved to default), it stays, as it was, and the CLI may change it.
    keys = tuple(replace(key, organization="default") for key in config.keys)
    await (await start_gateway(replace(config, organizations=(), keys=keys))).runner.cleanup()
    store = open_store(storage)
    await store.open()
    try:
        acme = await store.find_organization("acme")
        assert (acme.balance_usd, acme.from_config, acme.keys) == (BALANCE, False, 0)
        assert {key.organization for key in await store.list_keys()} == {"default"}
    finally:
        await store.close()
    status, output = await run_command("orgs", "suspend", "acme", "--storage", storage, cwd=tmp_path)
    assert status == 0, output


# --- The CLI


def table(text: str) -> dict[str, dict[str, str]]:
    """A CLI table's rows by their name column (blank cells read as "")."""
    header, *lines = text.splitlines()
    names = header.split()
    starts = [header.index(name) for name in names]
    rows = {}
    for line in lines:
        cells = [line[start:end].strip() for start, end in zip(starts, [*starts[1:], None])]
        rows[cells[1]] = dict(zip(names, cells))
    return rows


async def test_orgs_and_keys_commands_and_usage_by_org(start_gateway, upstream, tmp_path):
    storage = f"sqlite:///{tmp_path / 'orgs.db'}"

    async def ezat(*args: str) -> tuple[int, str]:
        return await run_command(*args, "--storage", storage, cwd=tmp_path)

    assert (await ezat("orgs", "create", "team", "--balance", "5"))[0] == 0
    status, output = await ezat("orgs", "create", "team")
    assert (status, output) == (1, "an organization named 'team' exists already\n")
    status, output = await ezat("orgs", "create", "")
    assert status == 2 and "argument name: expected 1 to 200 characters, not 0" in output, output
    status, output = await ezat("orgs", "create", "2")  # digits are an id where a path takes either
    assert status == 2 and "argument name: expected a name that is not digits alone (digits are an id)" in output
    status, output = await ezat("keys", "create", "--name", "ci", "--org", "team")
    assert status == 0, output
    (secret,) = re.findall(r"sk-ezat-[A-Za-z0-9_-]+", output)
    status, output = await ezat("keys", "create", "--name", "x", "--org", "nowhere")
    assert (status, output) == (1, "no organization named 'nowhere'\n")
    assert table((await ezat("keys", "list"))[1])["ci"]["organization"] == "team"

    gateway = await start_gateway(make_config(upstream.url, storage), key_cache_seconds=0)
    async with gateway.client(api_key=secret) as client:
        await client.chat.completions.create(model=MODEL, messages=HI)
        async with gateway.client() as default_client:  # the config's key, of the default organization
            await default_client.chat.completions.create(model=MODEL, messages=HI)

        listed = table((await ezat("orgs", "list"))[1])
        assert list(listed["team"]) == ["id", "name", "balance_usd", "spent_usd", "reserved_usd", "suspended", "keys"]
        assert (listed["team"]["balance_usd"], listed["team"]["suspended"], listed["team"]["keys"]) == (
            "5.0000",
            "False",
            "1",
        )
        assert Decimal(listed["team"]["spent_usd"]) > 0 and listed["team"]["reserved_usd"] == "0.0000"
        assert (listed["default"]["balance_usd"], listed["default"]["keys"]) == ("", "1")

        assert (await ezat("orgs", "suspend", "team"))[0] == 0
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.chat.completions.create(model=MODEL, messages=HI)
        assert refused.value.body["message"] == "This key's organization `team` is suspended."
        status, output = await ezat("orgs", "update", "team", "--unsuspend", "--balance", "0")
        assert status == 0 and table(output)["team"]["suspended"] == "False", output
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=MODEL, messages=HI)
        assert refused.value.status_code == 402
        assert "This key's organization `team` has used up its balance of $0" in refused.value.body["message"]
        assert (await ezat("orgs", "update", "team", "--balance", "none"))[0] == 0
        await client.chat.completions.create(model=MODEL, messages=HI)

    # A top-up may not take a balance past the most a balance may be.
    assert (await ezat("orgs", "update", "team", "--balance", "999999999999"))[0] == 0
    status, output = await ezat("orgs", "top-up", "team", "--amount", "1.5")
    assert (status, output) == (
        1,
        "amount_usd: the balance would be 1,000,000,000,000.5, past the most a balance may be "
        "(1,000,000,000,000): add at most 1\n",
    )
    status, output = await ezat("orgs", "top-up", "team", "--amount", "1")
    assert status == 0 and table(output)["team"]["balance_usd"] == "1000000000000.0000", output
    status, output = await ezat("orgs", "top-up", "team", "--amount", "5_000")
    assert status == 2 and "expected an amount of USD as a plain decimal number such as 12.50" in output

    status, output = await ezat("orgs", "update", "nowhere", "--suspend")
    assert (status, output) == (1, "no organization named 'nowhere'\n")
    status, output = await ezat("usage", "--by", "org", "--format", "csv")
    assert status == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("org,requests,")
    assert [line.split(",")[:2] for line in lines[1:]] == [["default", "1"], ["team", "2"]]

    status, output = await ezat("keys", "update", "ci", "--org", "default")
    assert status == 0 and table(output)["ci"]["organization"] == "default", output
