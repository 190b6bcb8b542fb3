"""Prices per deployment (`pricing_by_deployment`), through the real gateway in front of two
deployments of the mock upstream, one dearer than the other: the ledger prices each request at
the deployment that answered it, failover to the dearer one bills its price, admission holds the
dearest, `usage --by deployment` adds up each one's requests (the CLI as a subprocess), and the
catalog does not show the default as the only price. Also a foreign app's model without
per-deployment prices, mounted with limits and billing: priced at its `pricing`, as before."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from decimal import Decimal

import aiohttp
import anthropic
import pytest
from aiohttp import web

from gateway.app import STORE
from gateway.config import Pricing, parse_config
from gateway.mock.upstream import Scenario
from middlewares.billing import billing_middleware
from middlewares.core import API_KEY, DEPLOYMENT, KeyRecord, MessageReply, Shortfall, checked
from middlewares.limits import limits_middleware
from middlewares.size_limit import size_limit_middleware
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, Gateway, run_command, setting

CONFIG = """
[storage]
url = "{storage_url}"

[[deployments]]
name = "global"
base_url = "{global_url}"
api_key = "{upstream_key}"

[[deployments]]
name = "regional"
base_url = "{regional_url}"
api_key = "{upstream_key}"

[[models]]
id = "{model}"
upstream_model = "{upstream_model}"
deployments = {order}
pricing = {{ input = 3, output = 15, cache_write = 3.75, cache_read = 0.30 }}
# A regional endpoint's prices: 10 % more.
pricing_by_deployment = {{ regional = {{ input = 3.30, output = 16.50, cache_write = 4.125, cache_read = 0.33 }} }}

[[models]]
id = "test/plain"
upstream_model = "plain-1"
deployments = ["global", "regional"]
pricing = {{ input = 1, output = 5, cache_write = 1.25, cache_read = 0.10 }}

[[keys]]
key = "{key}"
name = "test"
{key_fields}
"""
MILLION = Decimal(1_000_000)
USAGE = {
    "input_tokens": 1000,
    "cache_creation_input_tokens": 400,
    "cache_read_input_tokens": 2000,
    "output_tokens": 200,
}
# USAGE's cost at each deployment: input, cache write, cache read, output.
AT_GLOBAL = (1000 * Decimal("3") + 400 * Decimal("3.75") + 2000 * Decimal("0.30") + 200 * Decimal("15")) / MILLION
AT_REGIONAL = (
    1000 * Decimal("3.30") + 400 * Decimal("4.125") + 2000 * Decimal("0.33") + 200 * Decimal("16.50")
) / MILLION


def config(
    global_url: str, regional_url: str, *, order=("global", "regional"), storage_url="sqlite:///:memory:", **key
):
    """The model on both deployments, in `order` of preference; the key's fields from `key`."""
    text = CONFIG.format(
        storage_url=storage_url,
        global_url=global_url,
        regional_url=regional_url,
        upstream_key=UPSTREAM_KEY,
        model=MODEL,
        upstream_model=UPSTREAM_MODEL,
        order=json.dumps(list(order)),
        key=KEY,
        key_fields="\n".join(f"{name} = {value}" for name, value in key.items()),
    )
    return parse_config(text, env={})


async def ask(gateway, *, stream: bool = False, **request) -> None:
    """One Messages request through Anthropic's SDK, read to its end."""
    request = {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": "Hi"}], **request}
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        if stream:
            async for _ in await claude.messages.create(stream=True, **request):
                pass
        else:
            await claude.messages.create(**request)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("order", "cost"), [(("global", "regional"), AT_GLOBAL), (("regional", "global"), AT_REGIONAL)]
)
async def test_the_ledger_prices_a_request_at_the_deployment_that_answered(
    start_gateway, upstream, second, order, cost, stream
):
    gateway = await start_gateway(config(upstream.url, second.url, order=order))
    (upstream if order[0] == "global" else second).enqueue(Scenario(usage=USAGE))
    await ask(gateway, stream=stream)

    (row,) = await gateway.app[STORE].ledger()
    assert (row.deployment, row.cost_usd) == (order[0], cost)
    assert AT_GLOBAL < AT_REGIONAL


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_failover_to_the_dearer_deployment_bills_its_price(start_gateway, upstream, second, stream):
    gateway = await start_gateway(config(upstream.url, second.url))
    upstream.enqueue(Scenario(status=529, error_message="overloaded"))
    second.enqueue(Scenario(usage=USAGE))
    await ask(gateway, stream=stream)

    assert (len(upstream.requests), len(second.requests)) == (1, 1)
    (row,) = await gateway.app[STORE].ledger()
    assert (row.deployment, row.cost_usd) == ("regional", AT_REGIONAL)


async def test_what_a_deployments_own_pricing_does_not_price_is_logged_naming_it(
    start_gateway, upstream, second, caplog
):
    """Neither pricing has priority rates: each is warned of once, the deployment's own naming it."""
    gateway = await start_gateway(config(upstream.url, second.url))
    priority = Scenario(usage={**USAGE, "service_tier": "priority"})
    upstream.enqueue(priority, priority, Scenario(status=503))
    second.enqueue(priority)
    with caplog.at_level(logging.WARNING, logger="ezat.billing"):
        for _ in range(3):  # global, global, then regional (global failing)
            await ask(gateway)

    rows = await gateway.app[STORE].ledger()
    assert [(row.deployment, row.cost_usd) for row in rows] == [
        ("global", AT_GLOBAL),
        ("global", AT_GLOBAL),
        ("regional", AT_REGIONAL),  # at its standard rates, as a tier without rates is
    ]
    assert [record.getMessage() for record in caplog.records if record.name == "ezat.billing"] == [
        f"model {who}: the upstream's usage reports service_tier='priority', which its pricing does not price: "
        "billed without it"
        for who in (MODEL, f"{MODEL} at deployment regional")
    ]


async def test_admission_holds_the_dearest_deployments_price(start_gateway, upstream, second):
    """The global deployment answers first, but a request may end at the regional one: 1,000
    output tokens at its $16.50 a million do not fit $0.016 left, though at the global $15 (and
    the few input tokens of "Hi") they would; 500 fit. A model without prices of its own per
    deployment is held at its one price."""
    gateway = await start_gateway(config(upstream.url, second.url, spend_limit_usd=0.016))
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        hi = [{"role": "user", "content": "Hi"}]
        with pytest.raises(anthropic.APIStatusError) as refusal:
            await claude.messages.create(model=MODEL, max_tokens=1000, messages=hi)
        assert refusal.value.status_code == 402 and "less than this request may cost" in refusal.value.message
        assert upstream.requests == second.requests == []
        await claude.messages.create(model=MODEL, max_tokens=500, messages=hi)
        await claude.messages.create(model="test/plain", max_tokens=1000, messages=hi)  # $0.005 at most
    assert (len(upstream.requests), len(second.requests)) == (2, 0)


async def test_usage_by_deployment_adds_up_each_ones_requests(start_gateway, upstream, second, tmp_path):
    storage_url = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_gateway(config(upstream.url, second.url, storage_url=storage_url))
    upstream.enqueue(Scenario(usage=USAGE), Scenario(usage=USAGE), Scenario(status=503))
    second.enqueue(Scenario(usage=USAGE))
    for _ in range(3):  # global, global, then regional (global failing)
        await ask(gateway)

    status, output = await run_command(
        "usage", "--by", "deployment", "--format", "json", "--storage", storage_url, cwd=tmp_path
    )
    assert status == 0, output
    groups = {group.pop("deployment"): group for group in json.loads(output)}
    assert {name: (group["requests"], Decimal(group["cost_usd"])) for name, group in groups.items()} == {
        "global": (2, 2 * AT_GLOBAL),
        "regional": (1, AT_REGIONAL),
    }
    assert groups["global"]["output_tokens"] == 400

    status, table = await run_command("usage", "--by", "deployment", "--storage", storage_url, cwd=tmp_path)
    assert status == 0, table
    header, *lines = table.splitlines()[-3:]
    assert header.split()[:2] == ["deployment", "requests"]
    assert [line.split()[:2] for line in lines] == [["global", "2"], ["regional", "1"]]
    assert lines[1].split()[-1] == f"{AT_REGIONAL:.4f}"


async def test_the_catalog_shows_the_dearest_price_beside_the_default(start_gateway, upstream, second):
    gateway = await start_gateway(config(upstream.url, second.url))
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/api/models") as response:
            entries = {entry["id"]: entry for entry in (await response.json())["data"]}
    priced = entries[MODEL]
    assert priced["pricing"] == {
        "input": "3",
        "output": "15",
        "cache_write": "3.75",
        "cache_read": "0.3",  # (as TOML's number reads: the decimal the file wrote)
        "cache_write_1h": "6",
    }
    assert priced["pricing_up_to"] == {
        "input": "3.3",
        "output": "16.5",
        "cache_write": "4.125",
        "cache_read": "0.33",
        "cache_write_1h": "6.6",
    }
    assert "pricing_up_to" not in entries["test/plain"]


TIERS_CONFIG = """
[[deployments]]
name = "a"
base_url = "https://a.example"

[[deployments]]
name = "b"
base_url = "https://b.example"

[[models]]
id = "by-deployment"
deployments = ["a", "b"]
pricing = { input = 3, output = 15, cache_write = 3.75, cache_read = 0.30 }

[models.pricing_by_deployment.a]
input = 3.30
output = 16.50
cache_write = 4.125
cache_read = 0.33
priority = { input = 5, output = 25 }

[models.pricing_by_deployment.b]
input = 3.30
output = 16.50
cache_write = 4.125
cache_read = 0.33
long_context = { above_input_tokens = 200000, input = 6.6, output = 24.75, cache_write = 8.25, cache_read = 0.66 }
priority = { input = 5, output = 25, cache_write = 6.25, cache_read = 0.5, long_context = { above_input_tokens = 200000, input = 10, output = 37.5, cache_write = 12.5 } }
batch = { input = 1.65, output = 8.25, cache_write = 2.0625, cache_read = 0.165 }

[[models]]
id = "own-pricing"
deployments = ["a"]

[models.pricing]
input = 3
output = 15
cache_write = 3.75
cache_read = 0.30
priority = { input = 5, output = 25 }
"""


async def test_check_config_holds_a_deployments_tiers_to_the_rules_of_the_models_own(tmp_path):
    """A tier of a deployment's pricing is checked as the model's own pricing's tier is: a caching
    model's priority rates without cache prices would bill its cache at 0, and a tier without its
    own long_context would bill a long request at the short rates. Each problem names the
    deployment by its key path; the same priority table under `pricing` is refused alike."""
    path = tmp_path / "gateway.toml"
    path.write_text(TIERS_CONFIG)
    status, output = await run_command("check-config", str(path))
    assert status == 1, output
    caches = "required while the model caches (min_cache_tokens > 0)"
    assert sorted(output.splitlines()) == sorted(
        [
            f"models[0].pricing_by_deployment.a.priority.cache_write: {caches}",
            f"models[0].pricing_by_deployment.a.priority.cache_read: {caches}",
            f"models[0].pricing_by_deployment.b.priority.long_context.cache_read: {caches}",
            "models[0].pricing_by_deployment.b.batch.long_context: required while pricing_by_deployment.b has"
            " long_context (its own long requests' rates)",
            f"models[1].pricing.priority.cache_write: {caches}",
            f"models[1].pricing.priority.cache_read: {caches}",
        ]
    )


async def test_check_config_refuses_a_free_model_priced_per_deployment(tmp_path):
    """A free model costs nothing anywhere, so prices for one of its deployments would be dropped
    without a word: they are a problem, as `pricing` beside free = true is. An empty table prices
    nothing, and passes."""
    path = tmp_path / "gateway.toml"
    path.write_text("""
[[deployments]]
name = "a"
base_url = "https://a.example"

[[models]]
id = "free-but-priced"
deployments = ["a"]
free = true
pricing_by_deployment = { a = { input = 3.30, output = 16.50, cache_write = 4.125, cache_read = 0.33 } }

[[models]]
id = "free-and-empty"
deployments = ["a"]
free = true
pricing_by_deployment = {}
""")
    status, output = await run_command("check-config", str(path))
    assert (status, output.splitlines()) == (
        1,
        ["models[0].pricing_by_deployment: not with free = true (a free model costs nothing at every deployment)"],
    )


# --- A foreign app's model, without prices per deployment


@dataclass(frozen=True)
class PlainModel:
    """A foreign app's model: ModelSpec's attributes, no `pricing_at` nor `every_pricing`."""

    id: str = "any"
    max_output_tokens: int = 100
    sampling: bool = False
    efforts: tuple[str, ...] = ()
    forced_tool_choice: bool = True
    min_cache_tokens: int = 0
    pricing: Pricing = Pricing(Decimal("1"), Decimal("2"), Decimal("1"), Decimal("0.5"))  # a 1-hour write: $2


class HeldSpending:
    """A spend store that holds whatever it is asked to, and remembers the amounts."""

    def __init__(self) -> None:
        self.held: list[Decimal] = []

    async def reserve(self, request_id, key_id, amount, limit, ttl, **balance) -> Shortfall | None:
        self.held.append(amount)
        return None

    async def release(self, request_id: str) -> None:
        pass


async def test_a_foreign_model_without_prices_per_deployment_is_priced_at_its_pricing():
    model, spending, rows = PlainModel(), HeldSpending(), []

    async def record(row) -> None:
        rows.append(row)

    async def answer(request: web.Request) -> web.StreamResponse:
        request[DEPLOYMENT] = "somewhere"  # the foreign handler says where it answered, as the gateway's does
        usage = {"input_tokens": 30, "output_tokens": 40}
        return MessageReply({"id": "msg_1", "type": "message", "content": [], "usage": usage})

    key = KeyRecord(id=3, name="solo", key_sha256="", spend_limit_usd=Decimal(1))
    stages = [
        size_limit_middleware(),
        setting("the_key", API_KEY, key),
        limits_middleware(find_model=lambda name: model if name == "any" else None, spending=spending),
        billing_middleware(record=record),
    ]
    app = web.Application(middlewares=checked(stages))
    app.router.add_post("/chat", answer)
    served = await Gateway(app).start()
    try:
        body = json.dumps({"model": "any", "messages": [{"role": "user", "content": "Hi"}]}).encode()
        async with aiohttp.ClientSession() as http:
            async with http.post(served.url + "/chat", data=body) as response:
                assert response.status == 200, await response.text()
    finally:
        await served.runner.cleanup()

    input_estimate = (len(body) + 3) // 4
    assert spending.held == [(input_estimate * 2 + 100 * 2) / MILLION]  # its dearest input kind, its maximum output
    (row,) = rows
    assert (row.deployment, row.cost_usd) == ("somewhere", (30 * 1 + 40 * 2) / MILLION)
