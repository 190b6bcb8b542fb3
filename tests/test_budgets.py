"""Budgets per period: a key's spend limit counted over a UTC calendar day, week or month
(`budget_period`), through the real gateway on loopback on SQLite and PostgreSQL. The gateway's
clock is handed to it (`now=`), so a test moves it across a period's turn."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import openai
import pytest

from gateway.app import STORE
from gateway.config import ConfigError, KeyConfig, StorageConfig, load_config
from gateway.mock.upstream import Scenario
from gateway.storage import open_store
from middlewares.core.periods import next_start, period_start
from tests.support import KEY, MODEL, SetClock, make_config, run_command
from tests.test_admin_api import ADMIN, Admin
from tests.test_storage import opened, row, store_url  # noqa: F401 (fixtures)

# An answer's 1,000 output tokens cost $0.015 at the test model's $15 a million; a request asking
# for 1,000 reserves a little more ($0.01518, its input counted too). A long one's cost $0.03.
ANSWER = dict(blocks=[{"type": "text", "text": "Done."}], usage={"input_tokens": 0, "output_tokens": 1000})
LONG_ANSWER = dict(blocks=[{"type": "text", "text": "Done."}], usage={"input_tokens": 0, "output_tokens": 2000})
HI = [{"role": "user", "content": "Tell me about Oslo."}]


async def started(start_gateway, upstream, storage_url: str, now: SetClock, **key_fields):
    config = make_config(upstream.url)
    key = KeyConfig(name="budgeted", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), **key_fields)
    return await start_gateway(replace(config, keys=(key,), storage=StorageConfig(url=storage_url)), now=now)


async def ask(client) -> str:
    """ "ok", or the 402's message."""
    try:
        await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
    except openai.APIStatusError as error:
        assert error.status_code == 402, error
        return error.body["message"]
    return "ok"


async def test_a_monthly_budget_starts_again_at_the_months_turn(start_gateway, upstream, store_url):
    now = SetClock("2026-12-31T23:00:00Z")
    gateway = await started(
        start_gateway, upstream, store_url, now, spend_limit_usd=Decimal("0.05"), budget_period="month"
    )
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(7)))
    async with gateway.client() as client:
        assert [await ask(client) for _ in range(3)] == ["ok"] * 3
        refused = await ask(client)  # $0.045 spent: $0.005 left, less than a request may cost
        assert re.fullmatch(
            r"This key has \$0\.005 left of its monthly budget of \$0\.05, less than this request may cost "
            r"\(\$0\.015\d*\); a lower max_tokens would fit; it resets on 2027-01-01\.",
            refused,
        ), refused
        now.set("2027-01-01T00:00:30Z")  # a new month: nothing spent in it yet
        assert [await ask(client) for _ in range(3)] == ["ok"] * 3
        refused = await ask(client)
        assert refused.endswith("; it resets on 2027-02-01.")
    [key] = await gateway.app[STORE].list_keys()
    now = datetime(2027, 1, 1, 0, 1, tzinfo=UTC)
    assert (key.budget_period, key.period_start) == ("month", date(2027, 1, 1))
    assert key.spent_in_period(now) == Decimal("0.045")  # January's
    assert key.spent_usd == Decimal("0.090")  # the key's whole spend goes on counting
    assert len(upstream.requests) == 6  # the refused never went upstream


async def test_a_used_up_daily_budget_says_when_it_resets(start_gateway, upstream, tmp_path):
    now = SetClock("2026-12-31T23:59:00+00:00")
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await started(start_gateway, upstream, storage, now, spend_limit_usd=Decimal("0.03"), budget_period="day")
    upstream.enqueue(Scenario(**LONG_ANSWER), Scenario(**ANSWER))
    async with gateway.client() as client:
        assert await ask(client) == "ok"
        assert await ask(client) == "This key has used up its daily budget of $0.03; it resets on 2027-01-01."
        now.set("2027-01-01T00:00:01+00:00")
        assert await ask(client) == "ok"


async def test_a_key_without_a_period_keeps_its_lifetime_limit(start_gateway, upstream, tmp_path):
    now = SetClock("2026-12-31T23:59:00Z")
    gateway = await started(
        start_gateway, upstream, f"sqlite:///{tmp_path / 'ezat.db'}", now, spend_limit_usd=Decimal("0.03")
    )
    upstream.enqueue(Scenario(**LONG_ANSWER))
    async with gateway.client() as client:
        assert await ask(client) == "ok"
        now.set("2027-01-01T00:00:01Z")  # no period: a new month changes nothing
        assert await ask(client) == "This key has reached its spend limit of $0.03."


@pytest.mark.parametrize(
    ("period", "now", "start", "next"),
    [
        ("day", "2026-12-31T23:59:59", "2026-12-31", "2027-01-01"),
        ("week", "2026-12-31T12:00:00", "2026-12-28", "2027-01-04"),  # weeks begin on Monday
        ("week", "2026-12-28T00:00:00", "2026-12-28", "2027-01-04"),
        ("month", "2026-12-15T08:00:00", "2026-12-01", "2027-01-01"),
        ("month", "2027-02-28T23:00:00", "2027-02-01", "2027-03-01"),
    ],
)
def test_periods_follow_the_utc_calendar(period, now, start, next):
    moment = datetime.fromisoformat(now).replace(tzinfo=UTC)
    assert (period_start(period, moment).isoformat(), next_start(period, moment).isoformat()) == (start, next)


def test_an_unknown_budget_period_is_a_config_error(tmp_path):
    path = tmp_path / "ezat.toml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    path.write_text(f'[[keys]]\nkey_sha256 = "{digest}"\nspend_limit_usd = 5\nbudget_period = "year"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert 'budget_period: expected "day", "week" or "month"' in str(error.value)


async def test_the_admin_api_sets_a_keys_budget_period(start_gateway, upstream, tmp_path):
    config = replace(make_config(upstream.url, f"sqlite:///{tmp_path / 'ezat.db'}"), admin=ADMIN)
    admin = Admin(await start_gateway(config, now=SetClock("2027-03-10T12:00:00Z")))
    made = await admin.ok(
        "POST", "/keys", 201, json={"name": "team", "spend_limit_usd": "0.05", "budget_period": "week"}
    )
    assert (made["budget_period"], made["period_spent_usd"]) == ("week", "0.000000000")
    upstream.enqueue(Scenario(**ANSWER))
    async with admin.gateway.client(api_key=made["secret"]) as client:
        assert await ask(client) == "ok"
    key = await admin.ok("GET", f"/keys/{made['id']}")
    assert (key["period_spent_usd"], key["spent_usd"]) == ("0.015000000", "0.015000000")
    status, body, _ = await admin.call("PATCH", f"/keys/{made['id']}", json={"budget_period": "year"})
    assert status == 400 and body["error"]["message"].startswith('budget_period: expected "day", "week", "month"')
    cleared = await admin.ok("PATCH", f"/keys/{made['id']}", json={"budget_period": None})
    assert (cleared["budget_period"], cleared["period_spent_usd"]) == (None, None)
    [entry, *_] = (await admin.ok("GET", "/audit"))["data"]
    assert (entry["before"]["budget_period"], entry["after"]["budget_period"]) == ("week", None)


async def test_the_cli_sets_a_keys_budget_period(tmp_path):
    storage = ("--storage", f"sqlite:///{tmp_path / 'ezat.db'}")
    status, output = await run_command(
        "keys", "create", "--name", "team", "--spend-limit", "5", "--budget-period", "month", *storage
    )
    assert status == 0, output
    key = await listed_key(*storage)
    assert (key["spend_limit_usd"], key["budget_period"], key["period_spent_usd"]) == ("5.0000", "month", "0.0000")
    status, output = await run_command("keys", "update", "team", "--budget-period", "year", *storage)
    assert status != 0 and "expected day, week, month or \"none\", not 'year'" in output


async def test_the_cli_takes_ezat_now_as_it_starts(tmp_path, opened):
    url = f"sqlite:///{tmp_path / 'ezat.db'}"
    store = await opened(url, open_store(url, now=SetClock("2026-12-31T12:00:00Z")))
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    monthly = KeyConfig(name="team", key_sha256=digest, spend_limit_usd=Decimal("1"), budget_period="month")
    await store.sync_config_keys([monthly])
    await store.write_ledger([row("req-1", (await store.find_key(digest)).id, "0.25")])
    december = await listed_key("--storage", url, env={"EZAT_NOW": "2026-12-31T23:59:00Z"})
    january = await listed_key("--storage", url, env={"EZAT_NOW": "2027-01-01T00:00:01Z"})
    assert (december["period_spent_usd"], january["period_spent_usd"]) == ("0.2500", "0.0000")


async def listed_key(*storage: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`keys list`'s one key, by its columns."""
    status, listed = await run_command("keys", "list", *storage, env=env)
    assert status == 0, listed
    header, line = listed.splitlines()
    starts = [header.index(name) for name in header.split()]  # the table's columns, blank where a value is none
    return {name: line[start:end].strip() for name, start, end in zip(header.split(), starts, [*starts[1:], None])}


async def test_a_new_budget_period_counts_what_it_has_spent(start_gateway, upstream, store_url):
    # Switching a key's period neither carries one period's spend into another nor forgets it:
    # what the new period has spent is read from the ledger.
    now = SetClock(datetime.now(UTC).isoformat())  # the ledger's rows are stamped with the real time
    config = replace(make_config(upstream.url, store_url), admin=ADMIN)
    admin = Admin(await start_gateway(config, now=now))
    made = await admin.ok("POST", "/keys", 201, json={"name": "team", "spend_limit_usd": "1", "budget_period": "day"})
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(2)))
    async with admin.gateway.client(api_key=made["secret"]) as client:
        assert [await ask(client) for _ in range(2)] == ["ok"] * 2  # $0.03 today
    month = await admin.ok("PATCH", f"/keys/{made['id']}", json={"budget_period": "month"})
    assert month["period_spent_usd"] == "0.030000000"  # this month's spend includes today's
    now.set((datetime.now(UTC) + timedelta(days=40)).isoformat())
    later = await admin.ok("PATCH", f"/keys/{made['id']}", json={"budget_period": "week"})
    assert later["period_spent_usd"] == "0.000000000"  # a week 40 days on has spent nothing


async def test_a_config_files_new_budget_period_counts_what_it_has_spent(store_url, opened):
    now = SetClock(datetime.now(UTC).isoformat())
    store = await opened(store_url, open_store(store_url, now=now))
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    daily = KeyConfig(name="filed", key_sha256=digest, spend_limit_usd=Decimal("1"), budget_period="day")
    await store.sync_config_keys([daily])
    key = await store.find_key(digest)
    await store.write_ledger([row("req-1", key.id, "0.25")])
    await store.sync_config_keys([replace(daily, budget_period="month")])  # the file changed, the gateway restarted
    key = await store.find_key(digest)
    assert (key.budget_period, key.spent_in_period(now())) == ("month", Decimal("0.25"))
    await store.sync_config_keys([replace(daily, budget_period=None)])
    assert (await store.find_key(digest)).spent_in_period(now()) == Decimal("0.25")  # lifetime


async def test_a_period_begun_by_a_clock_ahead_does_not_go_back(store_url, opened):
    """Replicas' clocks differ by a moment at a period's turn: a row billed by one already in
    the new month, then one by another still in the old, both count in the new month, which a
    key's spend never leaves again."""
    now = SetClock("2026-12-31T23:00:00Z")
    store = await opened(store_url, open_store(store_url, now=now))
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    monthly = KeyConfig(name="turning", key_sha256=digest, spend_limit_usd=Decimal("1"), budget_period="month")
    await store.sync_config_keys([monthly])
    key = await store.find_key(digest)
    now.set("2027-01-01T00:00:01Z")  # the replica a moment ahead
    await store.write_ledger([row("req-ahead", key.id, "0.10")])
    now.set("2026-12-31T23:59:59Z")  # the one a moment behind
    await store.write_ledger([row("req-behind", key.id, "0.20")])
    key = await store.find_key(digest)
    assert (key.period_start, key.period_spent_usd) == (date(2027, 1, 1), Decimal("0.30"))
    now.set("2027-01-01T00:00:02Z")
    assert key.spent_in_period(now()) == Decimal("0.30")
