"""A model answers to its upstream_model name, the name Claude Code and the Anthropic SDKs send
(`claude-haiku-4-5`, a dated `claude-haiku-4-5-20251001`), with no `aliases`: through a real
gateway and the mock upstream, with the official SDKs, and the embedded demo as a real
`ezat-gateway serve` process."""

from __future__ import annotations

import dataclasses
import hashlib
from decimal import Decimal

import aiohttp
import anthropic
import pytest

from gateway.app import STORE
from gateway.config import KeyConfig, Model, Pricing
from tests.support import KEY, ServeProcess, make_config

HAIKU = Model(
    id="anthropic/claude-haiku-4-5",
    upstream_model="claude-haiku-4-5",
    deployments=("primary",),
    pricing=Pricing(Decimal("1"), Decimal("5"), Decimal("1.25"), Decimal("0.10")),
)
DATED = Model(
    id="anthropic/claude-haiku-4-5-dated",
    upstream_model="claude-haiku-4-5-20251001",
    deployments=("primary",),
    pricing=HAIKU.pricing,
)
HELLO = [{"role": "user", "content": "Hello"}]


def with_models(upstream, *models: Model, key_models: tuple[str, ...] = ("*",)):
    config = make_config(upstream.url)
    key = KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), models=key_models)
    return dataclasses.replace(config, models=(*config.models, *models), keys=(key,))


@pytest.fixture
async def client_of():
    made: list[anthropic.AsyncAnthropic] = []

    def make(url: str, key: str = KEY) -> anthropic.AsyncAnthropic:
        made.append(anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.mark.parametrize("model", [HAIKU, DATED], ids=["undated", "dated"])
async def test_the_anthropic_sdk_asks_for_a_model_by_its_upstream_name(start_gateway, upstream, client_of, model):
    # A key limited to the model's id glob may use it by its upstream name: it is the same model.
    gateway = await start_gateway(with_models(upstream, HAIKU, DATED, key_models=("anthropic/claude-haiku-*",)))
    raw = await client_of(gateway.url).messages.with_raw_response.create(
        model=model.upstream_model, max_tokens=10, messages=HELLO
    )
    message = await raw.parse()
    assert message.model == model.upstream_model  # named as the client asked
    assert raw.headers["x-ezat-model"] == model.id
    [sent] = upstream.requests
    assert sent.body["model"] == model.upstream_model
    [row] = await gateway.app[STORE].ledger()
    assert (row.model, row.answered_model) == (model.id, model.id)
    usage = message.usage
    assert row.cost_usd == (Decimal(usage.input_tokens) * 1 + Decimal(usage.output_tokens) * 5) / 1_000_000  # its price


async def test_the_openai_route_takes_the_upstream_name_too(start_gateway, upstream):
    gateway = await start_gateway(with_models(upstream, HAIKU))
    async with gateway.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="claude-haiku-4-5", messages=HELLO)
    assert (raw.parse().model, raw.headers["x-ezat-model"]) == ("claude-haiku-4-5", HAIKU.id)  # as an alias is
    assert upstream.requests[0].body["model"] == "claude-haiku-4-5"
    [row] = await gateway.app[STORE].ledger()
    assert row.model == HAIKU.id


async def test_an_upstream_name_two_models_share_is_404_and_each_id_still_answers(start_gateway, upstream, client_of):
    cheap = dataclasses.replace(HAIKU, id="cheap/haiku")
    gateway = await start_gateway(with_models(upstream, HAIKU, cheap))
    claude = client_of(gateway.url)
    # The test model's upstream name is its alone: it answers to it.
    assert (await claude.messages.create(model="claude-sonnet-5-5", max_tokens=10, messages=HELLO)).content
    upstream.requests.clear()
    with pytest.raises(anthropic.NotFoundError) as caught:
        await claude.messages.create(model="claude-haiku-4-5", max_tokens=10, messages=HELLO)
    assert "claude-haiku-4-5" in caught.value.message
    assert upstream.requests == []
    for model in (HAIKU, cheap):
        assert (await claude.messages.create(model=model.id, max_tokens=10, messages=HELLO)).model == model.id
    assert [r.body["model"] for r in upstream.requests] == ["claude-haiku-4-5"] * 2


async def test_the_model_list_names_each_model_once_and_finds_it_by_its_upstream_name(
    start_gateway, upstream, client_of
):
    gateway = await start_gateway(with_models(upstream, HAIKU))
    claude = client_of(gateway.url)
    listed = [model.id async for model in claude.models.list()]
    assert listed == ["anthropic/claude-sonnet-5-5", "test/small", HAIKU.id]
    assert (await claude.models.retrieve("claude-haiku-4-5")).id == HAIKU.id
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/api/models", headers={"Authorization": f"Bearer {KEY}"}) as response:
            catalog = await response.json()
    assert [entry["id"] for entry in catalog["data"]] == listed


async def test_the_demo_answers_to_claude_sonnet_5_5(tmp_path, client_of):
    """The embedded defaults' one model, `anthropic/claude-sonnet-5-5`, by its upstream name: what
    `ANTHROPIC_MODEL=claude-sonnet-5-5 claude` sends."""
    demo = ServeProcess(tmp_path, env={"EZAT_API_KEY": KEY})
    await demo.start("--port", str(demo.port))
    try:
        message = await client_of(demo.url).messages.create(model="claude-sonnet-5-5", max_tokens=10, messages=HELLO)
        assert message.model == "claude-sonnet-5-5"
        assert message.content[0].text.startswith("Hello from the mock upstream.")
    finally:
        await demo.stop()
