"""Beta flags and token counts through the real gateway on each provider: a client of the Messages
route sends Claude Code's `anthropic-beta` flags; Bedrock gets the ones it takes in the body's
`anthropic_beta`, Vertex AI in a filtered header, Anthropic's API all of them as sent. The mock
clouds refuse a flag they do not know, as the real ones do, so an answer proves the rest dropped."""

from __future__ import annotations

import base64
import dataclasses
import logging

import anthropic
import orjson
import pytest

from gateway.app import STORE
from gateway.config import Config, Deployment
from gateway.mock.bedrock import BedrockMock
from gateway.mock.vertex import VERTEX_BETAS, VertexMock
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, Gateway, make_config

BEDROCK_MODEL = "us.anthropic.claude-sonnet-5-5-v1:0"
VERTEX_MODEL = "claude-sonnet-5-5@20261001"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# As Claude Code sends them: its own flag, then the features it uses.
CLAUDE_CODE_BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
    "context-management-2025-06-27",
]


@pytest.fixture
async def bedrock():
    mock = BedrockMock(region="us-east-1")
    await mock.start()
    yield mock
    await mock.close()


@pytest.fixture
async def vertex():
    mock = VertexMock()
    await mock.start()
    yield mock
    await mock.close()


def on(deployment: Deployment, upstream_model: str = UPSTREAM_MODEL) -> Config:
    """The test config with `deployment` (named "primary") as the test model's only one."""
    config = make_config(deployment.base_url)
    model = dataclasses.replace(config.models[0], upstream_models={"primary": upstream_model})
    return dataclasses.replace(config, deployments=(deployment,), models=(model,))


def bedrock_deployment(mock: BedrockMock, **fields) -> Deployment:
    """Bedrock behind a Bedrock API key (no SigV4: nothing in the environment)."""
    return Deployment(
        name="primary", provider="bedrock", region=mock.region, base_url=mock.url, api_key=mock.api_key_bearer, **fields
    )


def vertex_deployment(mock: VertexMock, **fields) -> Deployment:
    return Deployment(
        name="primary",
        provider="vertex",
        region="us-east5",
        project=mock.project,
        base_url=f"{mock.url}/v1",
        credentials_file=str(mock.key_file),
        **fields,
    )


@pytest.fixture
async def through(start_gateway):
    """(an Anthropic client of it, a gateway) whose one deployment is `deployment`."""
    clients: list[anthropic.AsyncAnthropic] = []

    async def start(
        deployment: Deployment, upstream_model: str = UPSTREAM_MODEL
    ) -> tuple[anthropic.AsyncAnthropic, Gateway]:
        gateway = await start_gateway(on(deployment, upstream_model))
        client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
        clients.append(client)
        return client, gateway

    yield start
    for client in clients:
        await client.close()


def dropped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "does not take the beta flag" in r.getMessage()]


async def test_bedrock_gets_only_its_flags_in_the_body(bedrock, through, caplog):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    client, gateway = await through(bedrock_deployment(bedrock), BEDROCK_MODEL)
    for _ in range(2):
        message = await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS)
        assert message.content[0].text.startswith("Hello from the mock upstream.")
    async with client.beta.messages.stream(
        model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS
    ) as stream:
        streamed = await stream.get_final_message()
    assert streamed.model == MODEL and streamed.stop_reason == "end_turn"

    for sent in bedrock.requests:
        assert sent.body["anthropic_beta"] == [
            "interleaved-thinking-2025-05-14",
            "fine-grained-tool-streaming-2025-05-14",
            "context-management-2025-06-27",
        ]
        assert "anthropic-beta" not in sent.headers
    assert [r.path for r in bedrock.requests] == [f"/model/{BEDROCK_MODEL}/invoke"] * 2 + [
        f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
    ]
    assert dropped(caplog) == ["deployment primary does not take the beta flag 'claude-code-20250219': dropped"]

    # None of the client's flags kept: no anthropic_beta at all, rather than an empty list.
    await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=["claude-code-20250219"])
    assert "anthropic_beta" not in bedrock.requests[-1].body

    # Bedrock's own fields written into the body by a client: the gateway sets them, not the client.
    await client.messages.create(
        model=MODEL,
        max_tokens=50,
        messages=MSGS,
        extra_body={"anthropic_beta": ["claude-code-20250219"], "anthropic_version": "bedrock-2099-01-01"},
    )
    sent = bedrock.requests[-1].body
    assert "anthropic_beta" not in sent and sent["anthropic_version"] == "bedrock-2023-05-31"


async def test_vertex_gets_only_its_flags_in_the_header(vertex, through, caplog):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    client, gateway = await through(vertex_deployment(vertex), VERTEX_MODEL)
    for _ in range(2):
        await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS)
    async with client.beta.messages.stream(
        model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS
    ) as stream:
        await stream.get_final_message()

    sent = [r for r in vertex.requests if r.path != "/token"]
    assert len(sent) == 3
    for request in sent:
        assert request.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14,context-management-2025-06-27"
        assert "anthropic_beta" not in request.body
    assert sent[-1].path.endswith(f"/models/{VERTEX_MODEL}:streamRawPredict")
    await client.beta.messages.create(
        model=MODEL, max_tokens=50, messages=MSGS, betas=["claude-code-20250219"], extra_body={"anthropic_beta": ["x"]}
    )
    assert "anthropic-beta" not in vertex.requests[-1].headers  # none kept: no header
    assert "anthropic_beta" not in vertex.requests[-1].body  # nor the client's own in the body
    assert sorted(dropped(caplog)) == [
        "deployment primary does not take the beta flag 'claude-code-20250219': dropped",
        "deployment primary does not take the beta flag 'fine-grained-tool-streaming-2025-05-14': dropped",
    ]


async def test_anthropic_gets_every_flag_as_sent(upstream, through, caplog):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    client, gateway = await through(Deployment(name="primary", base_url=upstream.url, api_key=UPSTREAM_KEY))
    await client.beta.messages.create(
        model=MODEL, max_tokens=50, messages=MSGS, betas=[*CLAUDE_CODE_BETAS, "made-up-feature-2099-01-01"]
    )
    assert upstream.requests[-1].headers["anthropic-beta"] == ",".join(
        [*CLAUDE_CODE_BETAS, "made-up-feature-2099-01-01"]
    )
    assert dropped(caplog) == []


async def test_a_deployments_own_list_overrides_the_providers(bedrock, upstream, through, caplog):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    client, gateway = await through(
        bedrock_deployment(bedrock, betas=("context-management-2025-06-27",)), BEDROCK_MODEL
    )
    await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS)
    assert bedrock.requests[-1].body["anthropic_beta"] == ["context-management-2025-06-27"]
    assert len(dropped(caplog)) == 3

    # On Anthropic's API too, where without a list every flag goes.
    client, gateway = await through(
        Deployment(name="primary", base_url=upstream.url, api_key=UPSTREAM_KEY, betas=("claude-code-20250219",))
    )
    await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS)
    assert upstream.requests[-1].headers["anthropic-beta"] == "claude-code-20250219"
    # Nothing listed is left: no header at all, rather than an empty one.
    await client.messages.create(
        model=MODEL, max_tokens=50, messages=MSGS, extra_headers={"anthropic-beta": "context-management-2025-06-27"}
    )
    assert "anthropic-beta" not in upstream.requests[-1].headers


async def test_a_listed_flag_goes_where_the_providers_list_lacks_it(through):
    """A region that has a flag before the gateway's list knows it: the deployment lists it."""
    newer = VERTEX_BETAS | {"fine-grained-tool-streaming-2025-05-14"}
    mock = VertexMock(betas=newer)
    await mock.start()
    try:
        client, gateway = await through(vertex_deployment(mock, betas=tuple(sorted(newer))), VERTEX_MODEL)
        await client.beta.messages.create(model=MODEL, max_tokens=50, messages=MSGS, betas=CLAUDE_CODE_BETAS)
        assert mock.requests[-1].headers["anthropic-beta"] == (
            "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14,context-management-2025-06-27"
        )
    finally:
        await mock.close()


# -- count_tokens -------------------------------------------------------------------------


async def test_count_tokens_on_bedrock(bedrock, through):
    client, gateway = await through(bedrock_deployment(bedrock), BEDROCK_MODEL)
    counted = await client.beta.messages.with_raw_response.count_tokens(
        model=MODEL, messages=MSGS, betas=CLAUDE_CODE_BETAS
    )
    message = await client.messages.create(model=MODEL, max_tokens=50, messages=MSGS)
    assert (await counted.parse()).input_tokens == message.usage.input_tokens > 0
    assert "x-ezat-input-tokens" not in counted.headers

    count = bedrock.requests[0]
    assert count.path == f"/model/{BEDROCK_MODEL}/count-tokens"
    invoke = orjson.loads(base64.b64decode(count.body["input"]["invokeModel"]["body"]))  # a blob: base64
    assert invoke["anthropic_beta"] == [
        "interleaved-thinking-2025-05-14",
        "fine-grained-tool-streaming-2025-05-14",
        "context-management-2025-06-27",
    ]
    assert invoke["messages"] == MSGS and "model" not in invoke
    assert [row.model for row in await gateway.app[STORE].ledger()] == [MODEL]  # the count unbilled


async def test_count_tokens_on_vertex(vertex, through):
    client, gateway = await through(vertex_deployment(vertex), VERTEX_MODEL)
    counted = await client.beta.messages.with_raw_response.count_tokens(
        model=MODEL, messages=MSGS, betas=CLAUDE_CODE_BETAS
    )
    message = await client.messages.create(model=MODEL, max_tokens=50, messages=MSGS)
    assert (await counted.parse()).input_tokens == message.usage.input_tokens > 0
    assert "x-ezat-input-tokens" not in counted.headers

    [count, _] = [r for r in vertex.requests if r.path != "/token"]
    assert (
        count.path
        == f"/v1/projects/{vertex.project}/locations/us-east5/publishers/anthropic/models/count-tokens:rawPredict"
    )
    assert count.body["model"] == VERTEX_MODEL
    assert count.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14,context-management-2025-06-27"


async def test_count_tokens_estimated_where_bedrock_cannot_count(bedrock, through):
    bedrock.counts_tokens = False
    client, gateway = await through(bedrock_deployment(bedrock), BEDROCK_MODEL)
    short = await client.messages.with_raw_response.count_tokens(model=MODEL, messages=MSGS)
    longer = await client.messages.with_raw_response.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris? " * 50}]
    )
    for answer in (short, longer):
        assert answer.status_code == 200
        assert answer.headers["x-ezat-input-tokens"] == "estimated"
    assert 0 < (await short.parse()).input_tokens < (await longer.parse()).input_tokens
    assert [r.path for r in bedrock.requests] == [
        f"/model/{BEDROCK_MODEL}/count-tokens"
    ] * 2  # each refused by Bedrock, then estimated
    assert await gateway.app[STORE].ledger() == []
