"""A person's budget over all their keys (`[[policies]]` budget_usd and budget_period), through the
real gateway on loopback, on SQLite and PostgreSQL: people and their keys are made in the store
as a sign-in and the console make them, the gateway applies their group's policy to each key it
reads. What one key spends counts against the others; another person of the group is not
touched; a new period lets them spend again; a policy without a budget limits nothing; requests
of two keys at once, on two gateways sharing the database, cannot together pass the budget."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import replace
from datetime import date
from decimal import Decimal

import openai
import pytest

from gateway.admin.policies import governed
from gateway.app import STORE
from gateway.config import ConfigError, OidcConfig, PolicyConfig, load_config
from gateway.mock.upstream import Scenario
from gateway.storage import open_store
from tests.support import MODEL, SetClock, make_config
from tests.test_budgets import ANSWER, HI, LONG_ANSWER, ask
from tests.test_config_oidc import ADMIN, BASE
from tests.test_limits import COSTLY
from tests.test_storage import query, store_url  # noqa: F401 (fixture)

# The identity provider is never asked: the keys are made in the store, and the gateway reads
# them through their people's policies whenever [oidc] is on.
OIDC = OidcConfig(issuer="https://idp.example", client_id="ezat-gateway", client_secret="not-a-secret")
# $0.05 a week: room for three requests of ~$0.015 worst case, not four.
WEEKLY = PolicyConfig(group="eng", budget_usd=Decimal("0.05"), budget_period="week")
UNLIMITED = PolicyConfig(group="research")
THURSDAY = "2026-12-31T12:00:00+00:00"  # its week began on Monday 2026-12-28; the next begins 2027-01-04


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def started(start_gateway, upstream, storage_url: str, now: SetClock, *policies: PolicyConfig):
    config = replace(make_config(upstream.url, storage_url), oidc=OIDC, policies=policies or (WEEKLY, UNLIMITED))
    return await start_gateway(config, now=now, key_cache_seconds=0)


async def person_with_keys(store, name: str, groups: list[str], count: int) -> list[str]:
    """A person signed in with `groups`, and the secrets of `count` keys of theirs."""
    person = await store.person_signed_in(f"idp|{name}", f"{name}@example.com", name.title(), groups)
    secrets = [f"sk-{name}-{n}" for n in range(count)]
    for secret in secrets:
        await store.create_key(digest(secret), name=secret, person_id=person.id)
    return secrets


async def asks(gateway, secret: str, count: int = 1) -> list[str]:
    """`count` requests one after another with `secret`: "ok" or each one's 402 message."""
    async with gateway.client(api_key=secret) as client:
        return [await ask(client) for _ in range(count)]


async def test_what_one_key_spends_counts_against_the_persons_other_keys(start_gateway, upstream, store_url):
    now = SetClock(THURSDAY)
    gateway = await started(start_gateway, upstream, store_url, now)
    store = gateway.app[STORE]
    laptop, desktop = await person_with_keys(store, "alice", ["eng"], 2)
    [bobs] = await person_with_keys(store, "bob", ["eng"], 1)
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(9)))

    assert await asks(gateway, laptop, 3) == ["ok"] * 3  # $0.045 of alice's $0.05 spent
    [refused] = await asks(gateway, desktop)
    assert re.fullmatch(
        r"You have \$0\.005 left of your budget for this week across all your keys \(\$0\.045 of \$0\.05 used\), "
        r"less than this request may cost \(\$0\.015\d*\); a lower max_tokens would fit; it resets on 2027-01-04\.",
        refused,
    ), refused
    assert (await asks(gateway, laptop))[0] == refused  # the first key is held to the same budget
    assert await asks(gateway, bobs, 3) == ["ok"] * 3  # bob, of the same group, has a budget of his own

    # Each key reads back with what its person spent; the policy says which period counts.
    [stored] = [key for key in await store.list_keys() if key.name == desktop]
    assert stored.spent_usd == 0 and stored.person_spend.week_usd == Decimal("0.045")
    assert (stored.person_spend.week_start, stored.person_spend.month_start) == (date(2026, 12, 28), date(2026, 12, 1))
    key = governed(stored, (WEEKLY,))
    assert (key.person_budget_usd, key.person_budget_period) == (Decimal("0.05"), "week")
    assert key.person_spent_in_period(now()) == Decimal("0.045")
    unlimited = governed(stored, (replace(UNLIMITED, group="eng"),))
    assert (unlimited.person_budget_usd, unlimited.person_spent_in_period(now())) == (None, 0)

    now.set("2027-01-04T00:00:01+00:00")  # Monday: a new week, nothing spent in it yet
    assert await asks(gateway, desktop, 3) == ["ok"] * 3
    assert len(upstream.requests) == 9  # the refused never went upstream


async def test_a_used_up_budget_says_so_and_when_it_resets(start_gateway, upstream, tmp_path):
    now = SetClock("2026-12-31T23:59:00+00:00")
    daily = PolicyConfig(group="eng", budget_usd=Decimal("0.03"), budget_period="day")
    gateway = await started(start_gateway, upstream, f"sqlite:///{tmp_path / 'ezat.db'}", now, daily)
    first, second = await person_with_keys(gateway.app[STORE], "alice", ["eng"], 2)
    upstream.enqueue(Scenario(**LONG_ANSWER), Scenario(**ANSWER))
    assert await asks(gateway, first) == ["ok"]  # $0.03: all of today's
    assert await asks(gateway, second) == [
        "You have used up your budget for today across all your keys ($0.03 of $0.03 used); it resets on 2027-01-01."
    ]
    now.set("2027-01-01T00:00:01+00:00")
    assert await asks(gateway, second) == ["ok"]


async def test_a_policy_without_a_budget_limits_nothing(start_gateway, upstream, tmp_path):
    gateway = await started(start_gateway, upstream, f"sqlite:///{tmp_path / 'ezat.db'}", SetClock(THURSDAY))
    first, second = await person_with_keys(gateway.app[STORE], "carol", ["research"], 2)
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(8)))
    assert await asks(gateway, first, 4) + await asks(gateway, second, 4) == ["ok"] * 8  # $0.12, past any $0.05


async def test_a_changed_policy_counts_what_its_period_has_spent_at_once(start_gateway, upstream, store_url):
    # The gateway started again with another policy on the same database: the person's spend in
    # each kind of period is kept, so a new period or amount applies to what was spent already.
    now = SetClock(THURSDAY)
    weekly = await started(start_gateway, upstream, store_url, now)
    [laptop] = await person_with_keys(weekly.app[STORE], "alice", ["eng"], 1)
    upstream.enqueue(*(Scenario(**ANSWER) for _ in range(4)))
    assert await asks(weekly, laptop, 3) == ["ok"] * 3
    await weekly.runner.cleanup()  # every row written

    monthly = replace(WEEKLY, budget_period="month")
    gateway = await started(start_gateway, upstream, store_url, now, monthly)
    [refused] = await asks(gateway, laptop)
    assert "budget for this month across all your keys ($0.045 of $0.05 used)" in refused, refused
    assert refused.endswith("; it resets on 2027-01-01.")

    larger = replace(WEEKLY, budget_usd=Decimal("0.07"))
    gateway = await started(start_gateway, upstream, store_url, now, larger)
    assert await asks(gateway, laptop) == ["ok"]  # $0.06 of $0.07


async def test_the_keys_own_limit_is_named_when_it_runs_out_first(start_gateway, upstream, tmp_path):
    gateway = await started(start_gateway, upstream, f"sqlite:///{tmp_path / 'ezat.db'}", SetClock(THURSDAY))
    store = gateway.app[STORE]
    [laptop] = await person_with_keys(store, "alice", ["eng"], 1)
    [key] = await store.list_person_keys((await store.find_person_by_subject("idp|alice")).id)
    await store.update_key(key.id, spend_limit_usd=Decimal("0.01"))
    [refused] = await asks(gateway, laptop)
    assert refused.startswith("This key has $0.01 left of its spend limit of $0.01"), refused


async def spend(url: str, secret: str, count: int) -> list[str]:
    """`count` requests at once with `secret`: each one's outcome ("ok", or "402" naming the person's budget)."""
    async with openai.AsyncOpenAI(base_url=url + "/openai/v1", api_key=secret, max_retries=0) as client:

        async def one() -> str:
            try:
                await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
            except openai.APIStatusError as error:
                assert error.status_code == 402, error
                assert error.body["code"] == error.body["type"] == "insufficient_quota"
                message = error.body["message"]
                assert re.fullmatch(
                    r"You have \$0\.0\d+ left of your budget for this week across all your keys \(\$0\.0\d+ of \$0\.05 "
                    r"used\), less than this request may cost \(\$0\.015\d*\); a lower max_tokens would fit; "
                    r"it resets on 2027-01-04\.",
                    message,
                ), message
                return "402"
            return "ok"

        return await asyncio.gather(*(one() for _ in range(count)))


async def test_requests_of_two_keys_on_two_gateways_at_once_never_spend_past_the_budget(
    start_gateway, upstream, store_url
):
    # Two gateways on one database, as two replicas: each holds its reservations in the store,
    # which serialises them (SQLite's write transaction, PostgreSQL's row locks on the person).
    now = SetClock(THURSDAY)
    gateways = [await started(start_gateway, upstream, store_url, now) for _ in range(2)]
    first, second = await person_with_keys(gateways[0].app[STORE], "alice", ["eng"], 2)
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(20)])
    outcomes = await asyncio.gather(*(spend(g.url, secret, 5) for g in gateways for secret in (first, second)))
    for gateway in gateways:
        await gateway.runner.cleanup()  # every row written
    outcomes = [outcome for group in outcomes for outcome in group]
    assert outcomes.count("ok") == 3 and outcomes.count("402") == 17

    store = open_store(store_url, now=now)
    await store.open()
    try:
        rows = await store.ledger()
        keys = await store.list_keys()
    finally:
        await store.close()
    assert len(rows) == 3 and sum(row.cost_usd for row in rows) <= WEEKLY.budget_usd
    [spend_] = {key.person_spend for key in keys if key.person_id is not None}
    assert spend_.week_usd == spend_.month_usd == spend_.day_usd == sum(row.cost_usd for row in rows)
    assert await query(store_url, "SELECT count(*) FROM reservations") == [(0,)]  # every reservation ended
    if store_url.startswith("sqlite"):  # its holds' running total went back to nothing
        assert await query(store_url, "SELECT reserved_nano_usd FROM people") == [(0,)]


def test_a_policy_budget_is_monthly_unless_it_says_and_needs_an_amount(tmp_path):
    path = tmp_path / "gateway.toml"
    oidc = '[oidc]\nissuer = "https://idp.example"\nclient_id = "c"\nclient_secret = "s"\n'

    def load(policy: str):
        path.write_text(BASE + ADMIN + oidc + '[[policies]]\ngroup = "eng"\n' + policy)
        return load_config(path).policies[0]

    assert (load("budget_usd = 50\n").budget_usd, load("budget_usd = 50\n").budget_period) == (Decimal(50), "month")
    assert load('budget_usd = 5\nbudget_period = "day"\n').budget_period == "day"
    assert (load("").budget_usd, load("").budget_period) == (None, None)
    for policy, problem in (
        (
            'budget_period = "week"\n',
            "policies[0].budget_period: a budget period (week) needs a budget to count over: give the policy a "
            "budget_usd too, or no budget_period",
        ),
        ("budget_usd = 0\n", "policies[0].budget_usd: expected an amount of USD above 0"),
        ("budget_usd = -5\n", "policies[0].budget_usd: expected an amount of USD from 0 to 1,000,000,000,000"),
        ('budget_usd = 5\nbudget_period = "year"\n', 'policies[0].budget_period: expected "day", "week" or "month"'),
    ):
        with pytest.raises(ConfigError) as error:
            load(policy)
        assert problem in str(error.value), str(error.value)
