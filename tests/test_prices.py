"""Prices beyond a token's: server tools' uses, the service tier and long requests, each from the
upstream's own usage, through the real gateway on every route, whole and streamed; the ledger's
cost checked exactly. And what the usage reports that the pricing does not price is logged once
per model."""

from __future__ import annotations

import logging
from dataclasses import replace
from decimal import Decimal

import anthropic
import pytest

from gateway.app import STORE
from gateway.config import parse_config
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, make_config, run_command

PRICING = """
[[deployments]]
name = "a"
base_url = "https://a.example"

[[models]]
id = "m"
deployments = ["a"]

[models.pricing]
input = 3
output = 15
cache_write = 3.75
cache_read = 0.30
web_search_per_1000 = 10
web_fetch_per_1000 = 2

[models.pricing.long_context]
above_input_tokens = 200000
input = 6
output = 22.50
cache_write = 7.50
cache_read = 0.60

[models.pricing.priority]
input = 5
output = 25
cache_write = 6.25
cache_read = 0.50

[models.pricing.priority.long_context]
above_input_tokens = 200000
input = 10
output = 37.50
cache_write = 12.50
cache_read = 1
"""
MILLION, THOUSAND = Decimal(1_000_000), Decimal(1_000)
# The rates above, written out again: input, cache write, cache read, output.
STANDARD = (Decimal("3"), Decimal("3.75"), Decimal("0.30"), Decimal("15"))
LONG = (Decimal("6"), Decimal("7.50"), Decimal("0.60"), Decimal("22.50"))
PRIORITY = (Decimal("5"), Decimal("6.25"), Decimal("0.50"), Decimal("25"))
PRIORITY_LONG = (Decimal("10"), Decimal("12.50"), Decimal("1"), Decimal("37.50"))


def priced_config(
    upstream_url: str,
    storage_url: str = "sqlite:///:memory:",
    *,
    pricing: str = PRICING,
    spend_limit: str | None = None,
):
    """The test config, its model priced as `pricing` says (parsed from the file's words), its
    key limited to `spend_limit` USD if given."""
    config = make_config(upstream_url, storage_url)
    rates = parse_config(pricing, env={}).models[0].pricing
    key = replace(config.keys[0], spend_limit_usd=None if spend_limit is None else Decimal(spend_limit))
    return replace(config, models=(replace(config.models[0], pricing=rates), *config.models[1:]), keys=(key,))


async def refused_then_admitted(gateway, upstream, refused: dict, admitted: dict) -> None:
    """`refused`, a Messages request, gets the 402 of a worst case past what the key has left,
    before any upstream sees it; `admitted` then reaches the upstream."""
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        with pytest.raises(anthropic.APIStatusError) as refusal:
            await claude.messages.create(model=MODEL, **refused)
        assert refusal.value.status_code == 402 and "less than this request may cost" in refusal.value.message
        assert upstream.requests == []
        await claude.messages.create(model=MODEL, **admitted)
    assert len(upstream.requests) == 1


def tokens(rates, input_tokens=0, cache_write=0, cache_read=0, output=0) -> Decimal:
    rate_in, rate_write, rate_read, rate_out = rates
    return (input_tokens * rate_in + cache_write * rate_write + cache_read * rate_read + output * rate_out) / MILLION


async def ask(gateway, route: str, stream: bool) -> dict:
    """One request on `route` through its official SDK, read to the end: the usage the client got."""
    if route == "messages":
        async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
            request = {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": "Search it"}]}
            if not stream:
                return (await claude.messages.create(**request)).usage.model_dump()
            usage: dict = {}
            async for event in await claude.messages.create(stream=True, **request):
                if event.type == "message_start":
                    usage |= event.message.usage.model_dump(exclude_none=True)
                elif event.type == "message_delta":
                    usage |= event.usage.model_dump(exclude_none=True)
            return usage
    async with gateway.client() as client:
        if route == "chat":
            request = {"model": MODEL, "messages": [{"role": "user", "content": "Search it"}]}
            if not stream:
                return (await client.chat.completions.create(**request)).usage.model_dump()
            chunks = await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **request
            )
            return [chunk async for chunk in chunks][-1].usage.model_dump()
        if not stream:
            return (await client.responses.create(model=MODEL, input="Search it")).usage.model_dump()
        async for event in await client.responses.create(model=MODEL, input="Search it", stream=True):
            if event.type == "response.completed":
                return event.response.usage.model_dump()
    raise AssertionError("the stream ended without its usage")


ROUTES = ["chat", "responses", "messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ROUTES)
async def test_server_tools_and_the_priority_tier_are_billed_as_reported(start_gateway, upstream, route, stream):
    gateway = await start_gateway(priced_config(upstream.url))
    upstream.enqueue(
        Scenario(
            usage={
                "input_tokens": 1200,
                "cache_creation_input_tokens": 400,
                "cache_read_input_tokens": 3000,
                "output_tokens": 70,
                "service_tier": "priority",
                "server_tool_use": {"web_search_requests": 3, "web_fetch_requests": 2},
            }
        )
    )
    usage = await ask(gateway, route, stream)

    (row,) = await gateway.app[STORE].ledger()
    assert row.cost_usd == tokens(PRIORITY, 1200, 400, 3000, 70) + (3 * Decimal(10) + 2 * Decimal(2)) / THOUSAND
    assert (row.input_tokens, row.cache_write_tokens, row.cache_read_tokens, row.output_tokens) == (1200, 400, 3000, 70)
    if route == "messages":  # the client gets the upstream's usage as it is
        assert usage["service_tier"] == "priority"
        assert usage["server_tool_use"] == {"web_search_requests": 3, "web_fetch_requests": 2}
    else:
        prompt = usage["prompt_tokens"] if route == "chat" else usage["input_tokens"]
        assert prompt == 1200 + 400 + 3000


@pytest.mark.parametrize(
    ("tier", "cache_read", "rates"),
    [
        ("standard", 200_000 - 1_300, STANDARD),  # 200,000 in all: not above the threshold
        ("standard", 200_000 - 1_299, LONG),  # 200,001, most of it read from the cache
        ("priority", 200_000 - 1_300, PRIORITY),
        ("priority", 200_000 - 1_299, PRIORITY_LONG),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_long_request_has_every_token_at_the_long_context_rates(
    start_gateway, upstream, tier, cache_read, rates, stream
):
    gateway = await start_gateway(priced_config(upstream.url))
    usage = {"input_tokens": 1000, "cache_creation_input_tokens": 300, "cache_read_input_tokens": cache_read}
    upstream.enqueue(Scenario(usage={**usage, "output_tokens": 90, "service_tier": tier}))
    await ask(gateway, "messages", stream)

    (row,) = await gateway.app[STORE].ledger()
    assert row.cost_usd == tokens(rates, 1000, 300, cache_read, 90)


async def test_admission_holds_the_dearest_tier_a_request_may_be_billed_at(start_gateway, upstream):
    """The worst case a spend limit must hold is the priority tier's, which Anthropic's default
    service tier (`auto`) may answer in: 1,000 output tokens at $25 a million do not fit $0.02
    left, though at the standard tier's $15 they would."""
    gateway = await start_gateway(priced_config(upstream.url, spend_limit="0.02"))
    hi = [{"role": "user", "content": "Hi"}]
    # 500 output tokens, $0.0125 at priority's rate: it fits.
    await refused_then_admitted(
        gateway, upstream, dict(max_tokens=1000, messages=hi), dict(max_tokens=500, messages=hi)
    )


async def test_admission_holds_the_long_context_rates_of_a_long_request(start_gateway, upstream):
    """A request whose estimated input is past the long-context threshold (here 1,000 tokens) is
    reserved at the long-context rates, which then price every token of it: 1,000 output tokens
    at $22.50 a million and its input at $7.50 do not fit $0.03, though at the standard rates they
    would; the same request without the long text does."""
    standard_only = PRICING[: PRICING.index("[models.pricing.priority]")].replace("200000", "1000")
    gateway = await start_gateway(priced_config(upstream.url, pricing=standard_only, spend_limit="0.03"))
    long = [{"role": "user", "content": "x" * 8000}]  # about 2,000 tokens by the estimate
    hi = [{"role": "user", "content": "Hi"}]
    await refused_then_admitted(
        gateway, upstream, dict(max_tokens=1000, messages=long), dict(max_tokens=1000, messages=hi)
    )


async def test_a_model_without_server_tool_prices_bills_anthropics(start_gateway, upstream):
    """A pricing that names no server tool fee bills the upstream's own: $10 per 1,000 searches."""
    gateway = await start_gateway(make_config(upstream.url))
    upstream.enqueue(
        Scenario(
            usage={
                "input_tokens": 100,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 10,
                "server_tool_use": {"web_search_requests": 7, "web_fetch_requests": 4},
            }
        )
    )
    await ask(gateway, "messages", stream=False)
    (row,) = await gateway.app[STORE].ledger()
    assert row.cost_usd == tokens(STANDARD, 100, output=10) + 7 * Decimal(10) / THOUSAND


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_what_the_pricing_does_not_price_is_logged_once_per_model(start_gateway, upstream, caplog, stream):
    gateway = await start_gateway(priced_config(upstream.url))
    reported = {
        "input_tokens": 100,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 10,
        "service_tier": "batch",  # no batch rates: the standard tier's
        "speed": "fast",  # a mode the ledger has no price for
        "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0, "code_execution_requests": 1},
    }
    upstream.enqueue(Scenario(usage=reported), Scenario(usage=reported))
    with caplog.at_level(logging.WARNING, logger="ezat.billing"):
        await ask(gateway, "messages", stream)
        await ask(gateway, "chat", stream)

    rows = await gateway.app[STORE].ledger()
    assert [row.cost_usd for row in rows] == [tokens(STANDARD, 100, output=10)] * 2
    warnings = [record.getMessage() for record in caplog.records if record.name == "ezat.billing"]
    assert warnings == [
        f"model {MODEL}: the upstream's usage reports {what}, which its pricing does not price: billed without it"
        for what in ("speed='fast'", "server_tool_use.code_execution_requests", "service_tier='batch'")
    ]


async def test_a_usage_the_ledger_knows_is_not_logged(start_gateway, upstream, caplog):
    gateway = await start_gateway(priced_config(upstream.url))
    upstream.enqueue(
        Scenario(usage={"service_tier": "priority", "speed": "standard", "inference_geo": "global"}),
        Scenario(usage={"server_tool_use": {"web_search_requests": 1, "web_fetch_requests": 0}}),
    )
    with caplog.at_level(logging.WARNING, logger="ezat.billing"):
        await ask(gateway, "messages", stream=False)
        await ask(gateway, "messages", stream=True)
    assert len(await gateway.app[STORE].ledger()) == 2
    assert [record for record in caplog.records if record.name == "ezat.billing"] == []


async def test_check_config_names_each_missing_rate(tmp_path):
    prices = "input = 3, output = 15, cache_write = 3.75, cache_read = 0.30"
    config = tmp_path / "gateway.toml"
    config.write_text(
        PRICING.split("[models.pricing]")[0]
        + f"pricing = {{ {prices}, web_search_per_1000 = -1,"
        + " long_context = { input = 6, output = 22.5, cache_write = 7.5, cache_read = 0.6 },"
        + f" priority = {{ input = 5, cache_write = 6.25, cache_read = 0.5 }}, batch = {{ {prices}, flex = 1 }} }}\n"
    )
    status, output = await run_command("check-config", str(config))
    assert status != 0
    problems = [
        "models[0].pricing.web_search_per_1000: expected a non-negative number",
        "models[0].pricing.long_context.above_input_tokens: required",
        "models[0].pricing.batch.flex: unknown key",
        "models[0].pricing.priority.output: required",
        "models[0].pricing.priority.long_context: required while pricing has long_context (its own long requests' rates)",
        "models[0].pricing.batch.long_context: required while pricing has long_context (its own long requests' rates)",
    ]
    for problem in problems:
        assert problem in output
