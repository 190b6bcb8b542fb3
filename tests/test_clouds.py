"""Every front route on Claude through Amazon Bedrock and Google Vertex AI: Chat Completions and
Responses with the official `openai` SDK, Messages and count_tokens with the `anthropic` SDK, all
through the real gateway on loopback in front of the Bedrock and Vertex mocks (real HTTP servers
that check SigV4 signatures and OAuth tokens as the clouds do). Each test checks what the client
got and what the cloud received: the client can tell no provider from another, and each cloud
gets its own dialect (path, body, headers, credentials)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web

from gateway.app import STORE
from gateway.config import Deployment
from gateway.mock.bedrock import AwsKey, BedrockMock
from gateway.mock.upstream import Credential, MockUpstream, RecordedRequest, Scenario
from gateway.mock.vertex import VertexMock, service_account_key
from tests.support import KEY, MODEL, Gateway, make_config, read_store, served
from tests.test_images import PNG

BEDROCK = "bedrock-us"  # the deployments' names, as the ledger records them
VERTEX = "vertex-eu"
ANTHROPIC = "primary"  # make_config's deployment, in front of the `upstream` fixture's mock
# The model's id on each cloud (Model.upstream_models), as the example config has them.
CLOUD_IDS = {BEDROCK: "us.anthropic.claude-sonnet-5-5-v1:0", VERTEX: "claude-sonnet-5-5@20261001"}
BEDROCK_REGION, VERTEX_REGION = "us-east-1", "europe-west1"

HELLO = [{"role": "user", "content": "Hello"}]
ECHO = "Hello from the mock upstream. You said: Hello"
ASK = "What is the weather in Paris? Use get_weather."
ANSWERED = "Hello from the mock upstream. The tool get_weather returned: Sunny"  # the tool's result, seen
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
FUNCTION = {
    "type": "function",
    "function": {"name": "get_weather", "description": TOOL["description"], "parameters": SCHEMA},
}
RESPONSES_FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": TOOL["description"],
    "parameters": SCHEMA,
}
THINKING = {
    "type": "thinking",
    "thinking": "The user wants Paris's weather; call the tool.",
    "signature": "EqQBCgIYAhIM1gbc==",
}
CALL = {"type": "tool_use", "id": "toolu_cloud_1", "name": "get_weather", "input": {"city": "Paris"}}
TEXT = {"type": "text", "text": "It is sunny in Paris today, and warm."}
# A ValidationException worded as Bedrock words it: Claude Code matches on these words to recover.
TOO_LONG = "prompt is too long: 215000 tokens > 200000 maximum"


# --- The clouds, and a gateway in front of them ---------------------------------------------------


def use_aws_key(monkeypatch: pytest.MonkeyPatch, key: AwsKey) -> None:
    """AWS's environment credentials (the first link of the default chain) are `key`."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key.secret_access_key)
    if key.session_token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", key.session_token)
    else:
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.fixture
def mocks() -> dict[str, MockUpstream]:
    """The cloud mocks a test started (its `bedrock` and `vertex` fixtures), by deployment name:
    a test starts only those it uses (a Vertex mock makes an RSA key)."""
    return {}


@pytest.fixture
async def bedrock(mocks, monkeypatch, tmp_path):
    """The Bedrock mock; AWS's default chain finds its temporary key (with a session token) in the
    environment, and nothing of this machine's own (no shared files, no profile, no instance role)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mock = BedrockMock(region=BEDROCK_REGION)
    await mock.start()
    use_aws_key(monkeypatch, mock.temporary_key)
    mocks[BEDROCK] = mock
    yield mock
    await mock.close()


@pytest.fixture
async def vertex(mocks):
    """The Vertex mock, with the service-account key file it generated."""
    mock = VertexMock()
    await mock.start()
    mocks[VERTEX] = mock
    yield mock
    await mock.close()


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
def start_clouds(start_gateway, upstream, mocks) -> StartGateway:
    """Starts a gateway whose model (MODEL) has `deployments`, in that order, among BEDROCK,
    VERTEX (the test asks for their mocks' fixtures) and ANTHROPIC; `deployment` changes fields
    of a deployment by name, `model` fields of the model (upstream_models default to CLOUD_IDS)."""

    async def start(
        *deployments: str,
        deployment: dict[str, dict[str, Any]] | None = None,
        storage_url: str = "sqlite:///:memory:",
        **model: Any,
    ) -> Gateway:
        config = make_config(upstream.url, storage_url)
        every = {ANTHROPIC: config.deployments[0]}
        if isinstance(bedrock := mocks.get(BEDROCK), BedrockMock):
            every[BEDROCK] = Deployment(name=BEDROCK, provider="bedrock", region=BEDROCK_REGION, base_url=bedrock.url)
        if isinstance(vertex := mocks.get(VERTEX), VertexMock):
            every[VERTEX] = Deployment(
                name=VERTEX,
                provider="vertex",
                region=VERTEX_REGION,
                project=vertex.project,
                base_url=f"{vertex.url}/v1",
                credentials_file=str(vertex.key_file),
            )
        for name, fields in (deployment or {}).items():
            every[name] = dataclasses.replace(every[name], **fields)
        model.setdefault("upstream_models", {name: CLOUD_IDS[name] for name in deployments if name in CLOUD_IDS})
        claude = dataclasses.replace(config.models[0], deployments=deployments, **model)
        return await start_gateway(
            dataclasses.replace(config, deployments=tuple(every.values()), models=(claude, *config.models[1:]))
        )

    return start


@dataclasses.dataclass
class Cloud:
    """A gateway in front of one cloud deployment (`name`), its mock, and clients of the gateway."""

    name: str
    mock: MockUpstream
    gateway: Gateway
    openai: openai.AsyncOpenAI
    claude: anthropic.AsyncAnthropic

    @property
    def model_id(self) -> str:
        return CLOUD_IDS[self.name]

    @property
    def is_bedrock(self) -> bool:
        return self.name == BEDROCK

    def sent(self) -> RecordedRequest:
        """The last request the cloud received."""
        return self.mock.requests[-1]

    def path(self, stream: bool = False) -> str:
        """The path a request for the model takes on this cloud (as the cloud decodes it)."""
        if self.is_bedrock:
            return f"/model/{self.model_id}/{'invoke-with-response-stream' if stream else 'invoke'}"
        method = "streamRawPredict" if stream else "rawPredict"
        return (
            f"/v1/projects/mock-project/locations/{VERTEX_REGION}/publishers/anthropic/models/{self.model_id}:{method}"
        )


def clients(gateway: Gateway) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    return gateway.client(), anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)


@pytest.fixture(params=[BEDROCK, VERTEX], ids=["bedrock", "vertex"])
def cloud_mock(request) -> tuple[str, MockUpstream]:
    """Bedrock's mock, then Vertex AI's, and its deployment's name."""
    return request.param, request.getfixturevalue("bedrock" if request.param == BEDROCK else "vertex")


@pytest.fixture
async def cloud(cloud_mock, start_clouds):
    """A gateway whose model has one deployment: on Bedrock, then on Vertex AI."""
    name, mock = cloud_mock
    gateway = await start_clouds(name)
    chat, claude = clients(gateway)
    async with chat, claude:
        yield Cloud(name, mock, gateway, chat, claude)


def dumped(blocks) -> list[dict]:
    """The SDK's content blocks, as a client sends them back."""
    return [block.model_dump(exclude_none=True) for block in blocks]


# --- Plain and streamed answers on every route -----------------------------------------------------


async def test_chat_completions_plain_and_streamed(cloud):
    reply = await cloud.openai.chat.completions.create(model=MODEL, messages=HELLO)
    assert reply.choices[0].message.content == ECHO and reply.choices[0].finish_reason == "stop"
    assert reply.model == MODEL and reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    stream = await cloud.openai.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == ECHO
    assert (usage.prompt_tokens, usage.completion_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert [r.path for r in cloud.mock.requests] == [cloud.path(), cloud.path(stream=True)]


async def test_responses_plain_and_streamed(cloud):
    reply = await cloud.openai.responses.create(model=MODEL, input="Hello")
    assert reply.output_text == ECHO and reply.status == "completed" and reply.usage.output_tokens > 0
    stream = await cloud.openai.responses.create(model=MODEL, input="Hello", stream=True)
    deltas, completed = [], None
    async for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert "".join(deltas) == ECHO and completed.output_text == ECHO
    assert completed.usage.output_tokens == reply.usage.output_tokens
    assert [r.path for r in cloud.mock.requests] == [cloud.path(), cloud.path(stream=True)]


async def test_messages_plain_and_streamed_and_count_tokens(cloud):
    message = await cloud.claude.messages.create(model=MODEL, max_tokens=100, messages=HELLO)
    assert message.content[0].text == ECHO and message.model == MODEL and message.stop_reason == "end_turn"
    async with cloud.claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == ECHO and final.model == MODEL and final.usage == message.usage
    counted = await cloud.claude.messages.with_raw_response.count_tokens(model=MODEL, messages=HELLO)
    assert "x-ezat-input-tokens" not in counted.headers  # the cloud's own count, not an estimate
    assert (await counted.parse()).input_tokens == message.usage.input_tokens
    count_path = (
        f"/model/{cloud.model_id}/count-tokens"
        if cloud.is_bedrock
        else cloud.path().replace(f"{cloud.model_id}:rawPredict", "count-tokens:rawPredict")
    )
    assert [r.path for r in cloud.mock.requests] == [cloud.path(), cloud.path(stream=True), count_path]
    assert len(await cloud.gateway.app[STORE].ledger()) == 2  # a count is never billed


async def test_count_tokens_with_thinking_and_tools(cloud):
    """Bedrock's count is an InvokeModel body, whose max_tokens must exceed the thinking budget."""
    ask = {"messages": [{"role": "user", "content": ASK}], "tools": [TOOL]}
    thinking = {"type": "enabled", "budget_tokens": 2048}
    counted = await cloud.claude.messages.with_raw_response.count_tokens(model=MODEL, thinking=thinking, **ask)
    assert "x-ezat-input-tokens" not in counted.headers
    message = await cloud.claude.messages.create(model=MODEL, max_tokens=4096, thinking=thinking, **ask)
    assert (await counted.parse()).input_tokens == message.usage.input_tokens


async def test_a_long_stream_arrives_whole(cloud):
    """Deltas of 48 KB: on Bedrock, frames larger than a read, put back together."""
    text = "".join(f"{n:05d} " for n in range(40_000))  # 240 KB, each part distinct
    cloud.mock.enqueue(Scenario(blocks=[{"type": "text", "text": text}], chunk_size=48_000))
    stream = await cloud.openai.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(parts) == text


# --- Tools, and thinking kept across a tool call -----------------------------------------------------


async def test_chat_completions_tool_call_then_its_result(cloud):
    messages: list[dict] = [{"role": "user", "content": ASK}]
    stream = await cloud.openai.chat.completions.create(model=MODEL, messages=messages, tools=[FUNCTION], stream=True)
    calls: dict[int, dict] = {}
    async for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, {"id": call.id, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
    [call] = calls.values()
    assert call["arguments"] == '{"city":"mock"}'  # the mock's call, put together from its deltas
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"},
    ]
    answer = await cloud.openai.chat.completions.create(model=MODEL, messages=messages, tools=[FUNCTION])
    assert answer.choices[0].message.content == ANSWERED
    assert cloud.sent().body["messages"][2]["content"][0]["type"] == "tool_result"


async def test_responses_function_call_then_its_output(cloud):
    first = await cloud.openai.responses.create(model=MODEL, input=ASK, tools=[RESPONSES_FUNCTION])
    [call] = first.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city":"mock"}')
    history = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    answer = await cloud.openai.responses.create(model=MODEL, input=history, tools=[RESPONSES_FUNCTION])
    assert answer.output_text == ANSWERED


async def test_messages_thinking_kept_across_a_tool_call(cloud):
    """The thinking block comes back with its signature as the cloud wrote it (streamed: through
    Bedrock's event-stream frames), and goes back to the cloud unchanged."""
    cloud.mock.enqueue(Scenario(blocks=[THINKING, CALL]))
    thinking = {"type": "enabled", "budget_tokens": 1024}
    ask = [{"role": "user", "content": ASK}]
    async with cloud.claude.messages.stream(
        model=MODEL, max_tokens=2048, thinking=thinking, tools=[TOOL], messages=ask
    ) as stream:
        signatures = [event.signature async for event in stream if event.type == "signature"]
        first = await stream.get_final_message()
    assert signatures == [THINKING["signature"]] and first.stop_reason == "tool_use"
    assert dumped(first.content) == [THINKING, CALL]
    turns = [
        *ask,
        {"role": "assistant", "content": dumped(first.content)},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL["id"], "content": "Sunny"}]},
    ]
    answer = await cloud.claude.messages.create(
        model=MODEL, max_tokens=2048, thinking=thinking, tools=[TOOL], messages=turns
    )
    assert answer.content[-1].text == ANSWERED
    sent = cloud.sent().body
    assert sent["messages"][1] == {"role": "assistant", "content": [THINKING, CALL]}
    assert sent["thinking"] == thinking


async def test_responses_thinking_kept_across_a_tool_call(cloud):
    """Streamed, sealed in encrypted_content, and restored in place, signature and all."""
    cloud.mock.enqueue(Scenario(blocks=[THINKING, CALL]))
    stream = await cloud.openai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[RESPONSES_FUNCTION],
        reasoning={"effort": "high"},
        include=["reasoning.encrypted_content"],
        stream=True,
    )
    first = [event.response async for event in stream if event.type == "response.completed"][0]
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and THINKING["signature"] not in reasoning.encrypted_content
    history = [
        {"role": "user", "content": ASK},
        reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    answer = await cloud.openai.responses.create(
        model=MODEL, input=history, tools=[RESPONSES_FUNCTION], reasoning={"effort": "high"}
    )
    assert answer.output_text == ANSWERED
    sent = cloud.sent().body
    assert sent["messages"][1] == {"role": "assistant", "content": [THINKING, CALL]}
    assert sent["thinking"] == {"type": "adaptive"}


# --- Images ------------------------------------------------------------------------------------------


async def test_a_data_url_image_reaches_the_cloud_as_a_base64_block(cloud):
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    reply = await cloud.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert reply.choices[0].message.content.startswith("Hello from the mock upstream.")
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()},
    }
    sent = cloud.sent().body["messages"][0]["content"]
    assert [{k: v for k, v in block.items() if k != "cache_control"} for block in sent][1] == image


# --- Errors before the first token and after it ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refusal_reaches_each_client_in_its_envelope_as_written(cloud, stream):
    """A 400 (Bedrock's ValidationException) keeps the cloud's message word for word."""
    cloud.mock.enqueue(Scenario(status=400, error_message=TOO_LONG), Scenario(status=400, error_message=TOO_LONG))
    with pytest.raises(openai.BadRequestError) as chat:
        await cloud.openai.chat.completions.create(model=MODEL, messages=HELLO, stream=stream)
    assert chat.value.body["type"] == "invalid_request_error" and chat.value.body["message"] == TOO_LONG
    with pytest.raises(anthropic.BadRequestError) as claude:
        if stream:
            async with cloud.claude.messages.stream(model=MODEL, max_tokens=10, messages=HELLO) as events:
                await events.get_final_message()
        else:
            await cloud.claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert claude.value.body["error"] == {"type": "invalid_request_error", "message": TOO_LONG}
    assert len(cloud.mock.requests) == 2  # one each: a refusal is not tried again


async def test_a_refusing_exception_frame_before_the_first_token_is_the_clients_400(cloud):
    """On Bedrock, a validationException frame after message_start: still the client's 400, as written."""
    cloud.mock.enqueue(
        Scenario(error_after=1, stream_error_type="invalid_request_error", stream_error_message=TOO_LONG)
    )
    with pytest.raises(anthropic.BadRequestError) as claude:
        async with cloud.claude.messages.stream(model=MODEL, max_tokens=10, messages=HELLO) as events:
            await events.get_final_message()
    assert claude.value.body["error"] == {"type": "invalid_request_error", "message": TOO_LONG}


async def test_throttled_with_no_other_deployment_is_a_rate_limit(cloud):
    message = "Too many requests, please wait before trying again."
    cloud.mock.enqueue(Scenario(status=429, error_message=message), Scenario(status=429, error_message=message))
    with pytest.raises(openai.RateLimitError) as chat:
        await cloud.openai.chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as claude:
        await cloud.claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert message in chat.value.body["message"]  # Vertex puts its quota's words before it
    assert claude.value.body["error"]["type"] == "rate_limit_error" and message in claude.value.body["error"]["message"]


async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error(cloud):
    """On Bedrock, an exception frame (modelStreamErrorException) mid-stream."""
    failing = Scenario(blocks=[TEXT], chunk_size=4, error_after=5, stream_error_message="Model overloaded")
    cloud.mock.enqueue(failing, dataclasses.replace(failing))
    received = []
    stream = await cloud.openai.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    with pytest.raises(openai.APIError) as chat:
        async for chunk in stream:
            received.append(chunk)
    assert received and chat.value.code == "overloaded"
    seen = []
    with pytest.raises(anthropic.APIStatusError) as claude:
        async with cloud.claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as events:
            async for event in events:
                seen.append(event.type)
    assert "content_block_delta" in seen and "message_stop" not in seen
    assert claude.value.body["error"] == {"type": "overloaded_error", "message": "Model overloaded"}
    assert await cloud.gateway.app[STORE].ledger() == []  # a failed stream is not billed


# --- A throttled Bedrock, passed over unseen ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("status", "other"),
    [(429, VERTEX), (429, ANTHROPIC), (503, VERTEX)],
    ids=["throttled-to-vertex", "throttled-to-anthropic", "unavailable-to-vertex"],
)
async def test_a_failing_bedrock_is_passed_over_unseen(start_clouds, bedrock, vertex, upstream, status, other, stream):
    """ThrottlingException (429) or ServiceUnavailableException (503): the next deployment answers."""
    gateway = await start_clouds(BEDROCK, other)
    bedrock.enqueue(Scenario(status=status, error_message="Too many requests, please wait before trying again."))
    async with gateway.client() as chat:
        raw = await chat.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, stream=stream)
        if stream:
            parts = [c.choices[0].delta.content or "" async for c in raw.parse() if c.choices]
            text = "".join(parts)
        else:
            text = raw.parse().choices[0].message.content
    assert text == ECHO and raw.status_code == 200
    assert raw.headers["x-ezat-model"] == MODEL and "x-ezat-routed-from" not in raw.headers
    answered_by = vertex if other == VERTEX else upstream
    assert (len(bedrock.requests), len(answered_by.requests)) == (1, 1)
    [row] = await gateway.app[STORE].ledger()
    assert row.deployment == other and row.outcome == "complete"


@pytest.mark.parametrize(
    "exception", ["rate_limit_error", "overloaded_error"], ids=["throttling", "model-stream-error"]
)
async def test_an_exception_frame_before_the_first_token_fails_over(start_clouds, bedrock, vertex, exception):
    """Bedrock's stream starts (200, message_start), then an exception frame: nothing has reached
    the client, so Vertex answers."""
    gateway = await start_clouds(BEDROCK, VERTEX)
    bedrock.enqueue(Scenario(blocks=[TEXT], error_after=1, stream_error_type=exception))
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        async with claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
            headers = stream.response.headers
            final = await stream.get_final_message()
    assert final.content[0].text == ECHO and headers["x-ezat-model"] == MODEL
    assert bedrock.requests[-1].path.endswith("/invoke-with-response-stream") and len(vertex.requests) == 1
    [row] = await gateway.app[STORE].ledger()
    assert row.deployment == VERTEX


# --- Credentials -------------------------------------------------------------------------------------


async def test_bedrock_signs_with_a_session_token(start_clouds, bedrock):
    gateway = await start_clouds(BEDROCK)
    async with gateway.client() as chat:
        await chat.chat.completions.create(model=MODEL, messages=HELLO)
    key = bedrock.temporary_key
    assert bedrock.requests[-1].auth == Credential(
        "sigv4", key.access_key_id, session_token=key.session_token, session_token_signed=True
    )


async def test_a_bedrock_api_key_is_sent_as_a_bearer_token(start_clouds, bedrock, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)  # no AWS credentials are needed
    gateway = await start_clouds(BEDROCK, deployment={BEDROCK: {"api_key": bedrock.api_key_bearer}})
    async with gateway.client() as chat:
        reply = await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert reply.choices[0].message.content == ECHO
    sent = bedrock.requests[-1]
    assert sent.auth == Credential("bearer", bedrock.api_key_bearer)
    assert sent.headers["authorization"] == f"Bearer {bedrock.api_key_bearer}" and "x-amz-date" not in sent.headers


async def test_a_bedrock_aws_profile_from_the_shared_files(start_clouds, bedrock, monkeypatch, tmp_path):
    """The named profile's long-term key signs, though the environment holds another key."""
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(
        f"[team]\naws_access_key_id = {bedrock.key.access_key_id}\n"
        f"aws_secret_access_key = {bedrock.key.secret_access_key}\n"
    )
    config.write_text(f"[profile team]\nregion = {BEDROCK_REGION}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    gateway = await start_clouds(BEDROCK, deployment={BEDROCK: {"aws_profile": "team"}})
    async with gateway.client() as chat:
        await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert bedrock.requests[-1].auth == Credential("sigv4", bedrock.key.access_key_id)


async def test_credentials_near_expiry_are_refreshed_once_in_the_background(
    start_clouds, bedrock, monkeypatch, tmp_path
):
    """A credential_process whose keys expire in 12 minutes: inside botocore's advisory window
    (15), outside its mandatory one (10). Requests keep signing with the current keys while one
    refresh runs beside them, not one refresh a request."""
    key, runs = bedrock.temporary_key, tmp_path / "runs"
    process = tmp_path / "credentials.py"
    process.write_text(
        "import datetime, json\n"
        f"open({str(runs)!r}, 'a').write('run\\n')\n"
        "expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=12)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {key.access_key_id!r}, "
        f"'SecretAccessKey': {key.secret_access_key!r}, 'SessionToken': {key.session_token!r}, "
        "'Expiration': expires.isoformat()}))\n"
    )
    config = tmp_path / "config"
    config.write_text(f"[profile rotating]\ncredential_process = {sys.executable} {process}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    gateway = await start_clouds(BEDROCK, deployment={BEDROCK: {"aws_profile": "rotating"}})
    async with gateway.client() as chat:
        for _ in range(6):
            await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert len(bedrock.requests) == 6 and all(r.auth.session_token == key.session_token for r in bedrock.requests)
    # Found and refreshed once before the first request; then one refresh in the background.
    assert runs.read_text().count("run") <= 3


STS_REFUSAL = b"""<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <Error><Type>Sender</Type><Code>AccessDenied</Code><Message>not authorized to perform: sts:AssumeRole</Message></Error>
  <RequestId>4d5a8a3e-0000-4000-8000-000000000000</RequestId>
</ErrorResponse>"""


async def test_a_role_sts_refuses_to_assume_fails_over(start_clouds, bedrock, upstream, monkeypatch, tmp_path):
    """The profile's role: STS (a real HTTP server here) refuses AssumeRole, which botocore raises
    as a ClientError. It is the gateway's 500 inside, never the client's: each request is answered
    by Anthropic, and each asks STS again (one failure does not cool a deployment)."""
    assumed: list[str] = []

    async def sts(request: web.Request) -> web.Response:
        assumed.append((await request.post()).get("Action", ""))
        return web.Response(status=403, body=STS_REFUSAL, content_type="text/xml")

    app = web.Application()
    app.router.add_post("/", sts)
    runner, sts_url = await served(app)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(
        f"[base]\naws_access_key_id = {bedrock.key.access_key_id}\n"
        f"aws_secret_access_key = {bedrock.key.secret_access_key}\n"
    )
    config.write_text(
        f"[profile team]\nrole_arn = arn:aws:iam::123456789012:role/claude\nsource_profile = base\n"
        f"region = {BEDROCK_REGION}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts_url)
    try:
        gateway = await start_clouds(BEDROCK, ANTHROPIC, deployment={BEDROCK: {"aws_profile": "team"}})
        async with gateway.client() as chat:
            reply = await chat.chat.completions.create(model=MODEL, messages=HELLO)
            again = await chat.chat.completions.create(model=MODEL, messages=HELLO)
        assert reply.choices[0].message.content == again.choices[0].message.content == ECHO
        assert assumed == ["AssumeRole"] * 2 and bedrock.requests == [] and len(upstream.requests) == 2
        rows = await gateway.app[STORE].ledger()
        assert [row.deployment for row in rows] == [ANTHROPIC] * 2
    finally:
        await runner.cleanup()


async def test_bedrock_access_denied_is_the_clients_403_and_cools_nothing(start_clouds, bedrock, upstream):
    """AccessDeniedException (a model the account may not use, cache_control on a model without
    caching) is the request's: the client's 403 in each API's envelope, no other deployment tried,
    and the next request still goes to Bedrock."""
    denied = "You don't have access to the model with the specified model ID."
    bedrock.enqueue(*(Scenario(status=403, error_message=denied) for _ in range(2)))
    gateway = await start_clouds(BEDROCK, ANTHROPIC)
    chat, claude = clients(gateway)
    async with chat, claude:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await chat.chat.completions.create(model=MODEL, messages=HELLO)
        with pytest.raises(anthropic.PermissionDeniedError) as native:
            await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
        reply = await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert refused.value.status_code == 403 and refused.value.body["message"] == denied
    assert native.value.body["error"] == {"type": "permission_error", "message": denied}
    assert reply.choices[0].message.content == ECHO
    assert len(bedrock.requests) == 3 and upstream.requests == []


async def test_a_refused_bedrock_api_key_is_a_500_and_fails_over(start_clouds, bedrock, upstream):
    """A Bedrock API key the cloud does not know: AccessDeniedException about the key, which is the
    gateway's own credential: Anthropic answers instead."""
    gateway = await start_clouds(BEDROCK, ANTHROPIC, deployment={BEDROCK: {"api_key": "ABSKnot-a-key-it-knows"}})
    async with gateway.client() as chat:
        reply = await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert reply.choices[0].message.content == ECHO
    assert len(bedrock.requests) == 1 and len(upstream.requests) == 1
    # With Bedrock alone, the client sees the gateway's 500, naming neither the key nor Bedrock's words.
    alone = await start_clouds(BEDROCK, deployment={BEDROCK: {"api_key": "ABSKnot-a-key-it-knows"}})
    async with alone.client() as chat:
        with pytest.raises(openai.InternalServerError) as refused:
            await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert refused.value.body["type"] == "server_error"
    assert refused.value.body["message"] == "The upstream rejected the gateway's credentials."
    assert "ABSKnot" not in refused.value.response.text and "API Key" not in refused.value.response.text


async def test_vertex_fetches_one_token_for_many_concurrent_requests(start_clouds, vertex):
    gateway = await start_clouds(VERTEX)
    async with gateway.client() as chat:
        replies = await asyncio.gather(*(chat.chat.completions.create(model=MODEL, messages=HELLO) for _ in range(10)))
    assert [r.choices[0].message.content for r in replies] == [ECHO] * 10
    assert vertex.token_requests == 1
    tokens = {request.auth for request in vertex.requests}
    assert len(tokens) == 1 and next(iter(tokens)).scheme == "oauth"


async def test_a_refused_gateway_credential_is_a_500_naming_no_secret(start_clouds, bedrock, monkeypatch):
    wrong = "wrong/secret+of+forty+characters+0000000"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    gateway = await start_clouds(BEDROCK)
    chat, claude = clients(gateway)
    async with chat, claude:
        with pytest.raises(openai.InternalServerError) as refused:
            await chat.chat.completions.create(model=MODEL, messages=HELLO)
        with pytest.raises(anthropic.InternalServerError) as native:
            await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert refused.value.status_code == 500 and refused.value.body["type"] == "server_error"
    assert native.value.status_code == 500
    for said in (refused.value.response.text, native.value.response.text):
        for secret in (wrong, bedrock.temporary_key.access_key_id, bedrock.temporary_key.session_token):
            assert secret not in said
        assert "signature" not in said.lower()  # Bedrock's own words stay in the gateway's log
    assert bedrock.requests[-1].auth is None  # refused by the cloud


async def test_a_vertex_key_the_token_endpoint_refuses_is_a_500(start_clouds, vertex, tmp_path):
    """A service-account key Google does not know: the gateway cannot sign in, and says no more."""
    other, _ = service_account_key(vertex.project, f"{vertex.url}/token")
    other["client_email"] = vertex.client_email  # the same account, another (unknown) key
    key_file = tmp_path / "other-key.json"
    key_file.write_text(json.dumps(other))
    gateway = await start_clouds(VERTEX, deployment={VERTEX: {"credentials_file": str(key_file)}})
    async with gateway.client() as chat:
        with pytest.raises(openai.InternalServerError) as refused:
            await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert refused.value.status_code == 500 and refused.value.body["type"] == "server_error"
    assert other["private_key_id"] not in refused.value.response.text
    assert vertex.token_requests == 1 and vertex.requests == []  # no model was called


# --- What each cloud received --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_request_each_cloud_receives(cloud, stream):
    betas = "interleaved-thinking-2025-05-14,claude-code-20250219"  # the second is no cloud's
    if stream:
        async with cloud.claude.messages.stream(
            model=MODEL, max_tokens=100, messages=HELLO, extra_headers={"anthropic-beta": betas}
        ) as events:
            await events.get_final_message()
    else:
        await cloud.claude.messages.create(
            model=MODEL, max_tokens=100, messages=HELLO, extra_headers={"anthropic-beta": betas}
        )
    sent = cloud.sent()
    assert sent.path == cloud.path(stream)
    assert "model" not in sent.body and sent.body["messages"] == HELLO and sent.body["max_tokens"] == 100
    assert "x-api-key" not in sent.headers and "anthropic-version" not in sent.headers
    if cloud.is_bedrock:
        assert "stream" not in sent.body  # the path says it
        assert sent.body["anthropic_version"] == "bedrock-2023-05-31"
        assert sent.body["anthropic_beta"] == ["interleaved-thinking-2025-05-14"]
        assert not [name for name in sent.headers if name.startswith("anthropic")]
    else:
        assert sent.body.get("stream", False) is stream
        assert sent.body["anthropic_version"] == "vertex-2023-10-16" and "anthropic_beta" not in sent.body
        assert sent.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"


async def test_a_bedrock_arn_goes_in_the_path_with_its_slash_encoded(start_clouds, bedrock):
    arn = f"arn:aws:bedrock:{BEDROCK_REGION}:123456789012:inference-profile/{CLOUD_IDS[BEDROCK]}"
    gateway = await start_clouds(BEDROCK, upstream_models={BEDROCK: arn})
    async with gateway.client() as chat:
        reply = await chat.chat.completions.create(model=MODEL, messages=HELLO)
    assert reply.choices[0].message.content == ECHO and reply.model == MODEL
    # Signed over the path as sent ("/" as %2F): the mock recomputed the signature and accepted it.
    assert bedrock.requests[-1].path == f"/model/{arn}/invoke" and bedrock.requests[-1].auth is not None


# --- The ledger --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_ledger_row_of_a_cloud_request(start_clouds, cloud_mock, tmp_path, stream):
    """The usage as the cloud reported it and the deployment that answered, in the row the
    store kept."""
    provider, mock = cloud_mock
    storage_url = f"sqlite:///{tmp_path / 'ezat.db'}"
    gateway = await start_clouds(provider, storage_url=storage_url)
    mock.enqueue(Scenario(blocks=[TEXT], usage={"input_tokens": 26, "output_tokens": 20}))
    async with gateway.client() as chat:
        if stream:
            reply = await chat.chat.completions.create(
                model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
            )
            usage = [chunk.usage async for chunk in reply if chunk.usage][-1]
        else:
            usage = (await chat.chat.completions.create(model=MODEL, messages=HELLO)).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (26, 20)
    [row], _ = await read_store(storage_url)
    assert (row.model, row.answered_model, row.deployment, row.outcome) == (MODEL, MODEL, provider, "complete")
    assert (row.input_tokens, row.output_tokens, row.cache_read_tokens, row.cache_write_tokens) == (26, 20, 0, 0)
    assert row.cost_usd == (26 * Decimal("3") + 20 * Decimal("15")) / 1_000_000  # make_config's prices
