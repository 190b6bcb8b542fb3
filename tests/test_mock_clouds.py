"""Fidelity tests for the Bedrock and Vertex AI mocks, read through the official SDK's
AnthropicBedrock and AnthropicVertex clients (their async faces), and raw HTTP where the SDK hides
the wire (event-stream frames, CountTokens on Bedrock, a stale or incomplete signature)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import re

import aiohttp
import anthropic
import botocore.session
import orjson
import pytest
from botocore import auth as botocore_auth
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer
from google.auth import exceptions as google_exceptions
from google.auth.transport.requests import Request as GoogleRequest
from google.oauth2 import service_account

from gateway.mock.bedrock import AwsKey, BedrockMock
from gateway.mock.upstream import Credential, MockUpstream, Scenario
from gateway.mock.vertex import CLOUD_PLATFORM_SCOPE, VertexMock, service_account_key
from tests.support import free_port, spawn

BEDROCK_MODEL = "anthropic.claude-sonnet-5-5-v1:0"
VERTEX_MODEL = "claude-sonnet-5-5@20261001"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = {
    "type": "thinking",
    "thinking": "The user wants the weather; call the tool.",
    "signature": "EqQBCgIYAhIM1gbc==",
}
TEXT = {"type": "text", "text": "Let me check the weather for you."}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
async def bedrock():
    mock = BedrockMock(region="us-west-2")
    await mock.start()
    yield mock
    await mock.close()


def bedrock_client(mock: BedrockMock, key: AwsKey | None = None, **kwargs) -> anthropic.AsyncAnthropicBedrock:
    key = key or mock.temporary_key
    return anthropic.AsyncAnthropicBedrock(
        aws_access_key=key.access_key_id,
        aws_secret_key=key.secret_access_key,
        aws_session_token=key.session_token,
        aws_region=mock.region,
        base_url=mock.url,
        max_retries=0,
        **kwargs,
    )


@pytest.fixture
async def vertex():
    mock = VertexMock(project="ezat-test")
    await mock.start()
    yield mock
    await mock.close()


def vertex_client(mock: VertexMock) -> anthropic.AsyncAnthropicVertex:
    credentials = service_account.Credentials.from_service_account_file(
        str(mock.key_file), scopes=[CLOUD_PLATFORM_SCOPE]
    )
    return anthropic.AsyncAnthropicVertex(
        project_id=mock.project, region="us-east5", base_url=f"{mock.url}/v1", credentials=credentials, max_retries=0
    )


@pytest.fixture(params=["bedrock", "vertex"])
async def cloud(request, bedrock, vertex):
    """(the mock, an SDK client of it, the model id it takes) for each cloud."""
    if request.param == "bedrock":
        async with bedrock_client(bedrock) as client:
            yield bedrock, client, BEDROCK_MODEL
    else:
        async with vertex_client(vertex) as client:
            yield vertex, client, VERTEX_MODEL


# -- what both clouds answer ------------------------------------------------------------------


async def test_plain_answer(cloud):
    mock, client, model = cloud
    message = await client.messages.create(model=model, max_tokens=100, messages=MSGS)
    assert message.content[0].text == "Hello from the mock upstream. You said: What is the weather in Paris?"
    assert message.model == model and message.stop_reason == "end_turn" and message.usage.output_tokens > 0
    sent = mock.requests[-1].body
    assert "model" not in sent and sent["messages"] == MSGS and sent["anthropic_version"]


async def test_stream_read_event_by_event(cloud):
    mock, client, model = cloud
    mock.enqueue(Scenario(blocks=[TEXT], chunk_size=10))
    async with client.messages.stream(model=model, max_tokens=100, messages=MSGS) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    deltas = (len(TEXT["text"]) + 9) // 10
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta", "text"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].text == TEXT["text"] and final.stop_reason == "end_turn"


async def test_tool_call(cloud):
    mock, client, model = cloud
    message = await client.messages.create(
        model=model, max_tokens=100, messages=MSGS, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "mock"})]


async def test_thinking_and_its_signature_streamed(cloud):
    mock, client, model = cloud
    mock.enqueue(Scenario(blocks=[THINKING, TEXT]))
    async with client.messages.stream(
        model=model, max_tokens=2048, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 1024}
    ) as stream:
        signatures = [event.signature async for event in stream if event.type == "signature"]
        final = await stream.get_final_message()
    assert signatures == [THINKING["signature"]]
    assert final.content[0].type == "thinking"
    assert (final.content[0].thinking, final.content[0].signature) == (THINKING["thinking"], THINKING["signature"])
    assert mock.requests[-1].body["thinking"] == {"type": "enabled", "budget_tokens": 1024}


async def test_throttled_before_the_stream(cloud):
    mock, client, model = cloud
    mock.enqueue(Scenario(status=429, error_message="Too many requests, please wait."))
    with pytest.raises(anthropic.RateLimitError) as raised:
        async with client.messages.stream(model=model, max_tokens=100, messages=MSGS) as stream:
            await stream.get_final_message()
    if isinstance(mock, BedrockMock):
        assert raised.value.response.headers["x-amzn-ErrorType"].startswith("ThrottlingException:")
        assert raised.value.body == {"message": "Too many requests, please wait."}
    else:
        assert raised.value.body["error"]["status"] == "RESOURCE_EXHAUSTED"


async def test_error_mid_stream(cloud):
    mock, client, model = cloud
    mock.enqueue(
        Scenario(blocks=[TEXT], error_after=3, stream_error_type="rate_limit_error", stream_error_message="Slow down")
    )
    seen = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        async with client.messages.stream(model=model, max_tokens=100, messages=MSGS) as stream:
            async for event in stream:
                seen.append(event.type)
    assert "message_start" in seen and "message_stop" not in seen
    # Bedrock's exception frame, as the SDK reads it: the exception's name and message.
    kind = "throttlingException" if isinstance(mock, BedrockMock) else "rate_limit_error"
    assert raised.value.body["error"] == {"type": kind, "message": "Slow down"}


# -- Bedrock ------------------------------------------------------------------------------


async def test_bedrock_records_a_signed_session_token(bedrock):
    async with bedrock_client(bedrock) as client:
        await client.messages.create(model=BEDROCK_MODEL, max_tokens=10, messages=MSGS)
    key = bedrock.temporary_key
    assert bedrock.requests[-1].auth == Credential(
        "sigv4", key.access_key_id, session_token=key.session_token, session_token_signed=True
    )
    assert bedrock.requests[-1].path == f"/model/{BEDROCK_MODEL}/invoke"
    assert "x-amz-security-token" in bedrock.requests[-1].headers["authorization"]


async def test_bedrock_long_term_key_and_api_key(bedrock):
    async with bedrock_client(bedrock, key=bedrock.key) as client:
        await client.messages.create(model=BEDROCK_MODEL, max_tokens=10, messages=MSGS)
    assert bedrock.requests[-1].auth == Credential("sigv4", bedrock.key.access_key_id)
    async with anthropic.AsyncAnthropicBedrock(
        api_key=bedrock.api_key_bearer, aws_region=bedrock.region, base_url=bedrock.url, max_retries=0
    ) as client:
        await client.messages.create(model="us." + BEDROCK_MODEL, max_tokens=10, messages=MSGS)
    assert bedrock.requests[-1].auth == Credential("bearer", bedrock.api_key_bearer)


async def test_bedrock_model_arn_in_the_path(bedrock):
    arn = "arn:aws:bedrock:us-west-2:123456789012:inference-profile/us." + BEDROCK_MODEL
    async with bedrock_client(bedrock) as client:
        message = await client.messages.create(model=arn, max_tokens=10, messages=MSGS)
    assert message.model == arn  # signed over the path with its "/" encoded, as sent


async def test_bedrock_refuses_a_bad_signature(bedrock):
    wrong = AwsKey(bedrock.key.access_key_id, "not-the-secret")
    async with bedrock_client(bedrock, key=wrong) as client:
        with pytest.raises(anthropic.PermissionDeniedError) as raised:
            await client.messages.create(model=BEDROCK_MODEL, max_tokens=10, messages=MSGS)
    assert raised.value.response.headers["x-amzn-ErrorType"].startswith("InvalidSignatureException:")
    assert "signature we calculated does not match" in raised.value.body["message"]
    assert bedrock.requests[-1].auth is None


async def test_bedrock_refuses_an_unknown_beta(bedrock):
    async with bedrock_client(bedrock) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.beta.messages.create(
                model=BEDROCK_MODEL, max_tokens=10, messages=MSGS, betas=["made-up-feature-2099-01-01"]
            )
        assert raised.value.response.headers["x-amzn-ErrorType"].startswith("ValidationException:")
        assert "invalid beta flag" in raised.value.body["message"]
        await client.beta.messages.create(
            model=BEDROCK_MODEL, max_tokens=10, messages=MSGS, betas=["interleaved-thinking-2025-05-14"]
        )
    assert bedrock.requests[-1].body["anthropic_beta"] == ["interleaved-thinking-2025-05-14"]


def signed(mock: BedrockMock, path: str, body: dict, *, at: datetime.datetime | None = None, **headers: str):
    """The headers of a request signed by botocore with the mock's temporary key (at `at`)."""
    key = mock.temporary_key
    request = AWSRequest(
        method="POST",
        url=f"{mock.url}{path}",
        data=orjson.dumps(body),
        headers={"content-type": "application/json", **headers},
    )
    signer = SigV4Auth(Credentials(key.access_key_id, key.secret_access_key, key.session_token), "bedrock", mock.region)
    if at is None:
        signer.add_auth(request)
    else:
        now, botocore_auth.get_current_datetime = botocore_auth.get_current_datetime, lambda: at
        try:
            signer.add_auth(request)
        finally:
            botocore_auth.get_current_datetime = now
    return request.data, dict(request.headers)


INVOKE_BODY = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 50, "messages": MSGS}


async def test_bedrock_event_stream_frames_on_the_wire(bedrock):
    """What the SDK hides: each frame, as botocore's decoder reads it, and the headers."""
    path = f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
    data, headers = signed(bedrock, path, INVOKE_BODY)
    async with aiohttp.ClientSession() as http, http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/vnd.amazon.eventstream"
        assert resp.headers["x-amzn-RequestId"]
        frames = EventStreamBuffer()
        frames.add_data(await resp.read())
        messages = list(frames)  # each prelude and message CRC checked by botocore
    events = []
    for message in messages:
        assert message.headers == {
            ":event-type": "chunk",
            ":content-type": "application/json",
            ":message-type": "event",
        }
        events.append(orjson.loads(base64.b64decode(orjson.loads(message.payload)["bytes"])))
    assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"]
    assert events[-1]["type"] == "message_stop"
    metrics = events[-1]["amazon-bedrock-invocationMetrics"]
    assert metrics["inputTokenCount"] == events[0]["message"]["usage"]["input_tokens"]
    assert metrics["outputTokenCount"] == events[-2]["usage"]["output_tokens"]
    assert {"invocationLatency", "firstByteLatency"} <= metrics.keys()


async def test_bedrock_fast_mode_sends_the_fast_answers_as_frames():
    """The benchmarks' Bedrock: the Anthropic fast mock's events for the path's model id, each
    in a frame botocore reads, message_stop with its invocation metrics; no credential asked."""
    fast, anthropic_fast = BedrockMock(fast=True), MockUpstream(fast=True)
    bedrock_url, anthropic_url = await fast.start(), await anthropic_fast.start()
    try:
        async with aiohttp.ClientSession() as http:
            path = "/model/us.anthropic.bench-tool/invoke-with-response-stream"
            async with http.post(f"{bedrock_url}{path}", data=orjson.dumps(INVOKE_BODY)) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"] == "application/vnd.amazon.eventstream"
                frames = EventStreamBuffer()
                frames.add_data(await resp.read())
            body = {"model": "bench-tool", "max_tokens": 50, "messages": MSGS, "stream": True}
            async with http.post(f"{anthropic_url}/v1/messages", data=orjson.dumps(body)) as resp:
                sse = await resp.text()
            async with http.post(f"{bedrock_url}/model/anthropic.bench-nonstream/invoke", data=b"{}") as resp:
                message = await resp.json()
    finally:
        await fast.close()
        await anthropic_fast.close()
    events = [orjson.loads(base64.b64decode(orjson.loads(frame.payload)["bytes"])) for frame in frames]
    metrics = events[-1].pop("amazon-bedrock-invocationMetrics")
    expected = [orjson.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == [e["type"] for e in expected]
    assert events[1:] == expected[1:]  # message_start's id is each mock's own
    assert metrics["outputTokenCount"] == events[-2]["usage"]["output_tokens"]
    assert message["type"] == "message" and message["content"][0]["type"] == "text"
    assert fast.requests == []


async def test_bedrock_exception_frame_on_the_wire(bedrock):
    bedrock.enqueue(Scenario(error_after=2, stream_error_message="Model overloaded"))
    path = f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
    data, headers = signed(bedrock, path, INVOKE_BODY)
    async with aiohttp.ClientSession() as http, http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
        frames = EventStreamBuffer()
        frames.add_data(await resp.read())
        last = list(frames)[-1]
    assert last.headers[":message-type"] == "exception"
    assert last.headers[":exception-type"] == "modelStreamErrorException"
    assert orjson.loads(last.payload)["message"] == "Model overloaded"


async def test_bedrock_invoke_headers_and_count_tokens(bedrock):
    async with aiohttp.ClientSession() as http:
        path = f"/model/{BEDROCK_MODEL}/invoke"
        data, headers = signed(bedrock, path, INVOKE_BODY)
        async with http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
            message = await resp.json()
            assert resp.headers["x-amzn-bedrock-input-token-count"] == str(message["usage"]["input_tokens"])
            assert resp.headers["x-amzn-bedrock-output-token-count"] == str(message["usage"]["output_tokens"])
    # CountTokens as AWS's own SDK sends it (botocore's client: the body a base64 blob).
    key = bedrock.temporary_key
    client = botocore.session.get_session().create_client(
        "bedrock-runtime",
        region_name=bedrock.region,
        endpoint_url=bedrock.url,
        aws_access_key_id=key.access_key_id,
        aws_secret_access_key=key.secret_access_key,
        aws_session_token=key.session_token,
    )
    counted = await asyncio.to_thread(
        client.count_tokens, modelId=BEDROCK_MODEL, input={"invokeModel": {"body": orjson.dumps(INVOKE_BODY)}}
    )
    assert counted["inputTokens"] == message["usage"]["input_tokens"]


async def test_bedrock_count_tokens_on_a_model_it_cannot_count(bedrock):
    bedrock.counts_tokens = False
    path = f"/model/{BEDROCK_MODEL}/count-tokens"
    count = {"input": {"invokeModel": {"body": base64.b64encode(orjson.dumps(INVOKE_BODY)).decode()}}}
    data, headers = signed(bedrock, path, count)
    async with aiohttp.ClientSession() as http, http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
        assert resp.status == 400
        assert resp.headers["x-amzn-ErrorType"].startswith("ValidationException:")
        assert await resp.json() == {"message": "The provided model doesn't support counting tokens."}
    assert bedrock.requests[-1].auth.session_token_signed  # checked as any request is, then refused


async def test_bedrock_refuses_a_stale_date_and_a_missing_signed_header(bedrock):
    path = f"/model/{BEDROCK_MODEL}/invoke"
    stale = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) - datetime.timedelta(minutes=6)
    async with aiohttp.ClientSession() as http:
        data, headers = signed(bedrock, path, INVOKE_BODY, at=stale)
        async with http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
            assert resp.status == 403
            assert resp.headers["x-amzn-ErrorType"].startswith("InvalidSignatureException:")
            assert "Signature expired" in (await resp.json())["message"]
        data, headers = signed(bedrock, path, INVOKE_BODY, **{"x-amz-target": "InvokeModel"})
        del headers["x-amz-target"]
        async with http.post(f"{bedrock.url}{path}", data=data, headers=headers) as resp:
            assert resp.status == 403
            assert "x-amz-target" in (await resp.json())["message"]
        data, headers = signed(bedrock, path, INVOKE_BODY)
        async with http.post(f"{bedrock.url}{path}", data=data + b" ", headers=headers) as resp:
            assert resp.status == 403  # the body is signed too


# -- Vertex AI ----------------------------------------------------------------------------


async def test_vertex_fetches_a_token_once_for_many_requests(vertex):
    async with vertex_client(vertex) as client:
        for _ in range(3):
            await client.messages.create(model=VERTEX_MODEL, max_tokens=10, messages=MSGS)
    assert vertex.token_requests == 1
    tokens = {request.auth for request in vertex.requests if request.path != "/token"}
    assert len(tokens) == 1 and next(iter(tokens)).scheme == "oauth"
    assert vertex.requests[-1].path == (
        f"/v1/projects/{vertex.project}/locations/us-east5/publishers/anthropic/models/{VERTEX_MODEL}:rawPredict"
    )


async def test_vertex_count_tokens(vertex):
    async with vertex_client(vertex) as client:
        counted = await client.messages.count_tokens(model=VERTEX_MODEL, messages=MSGS)
        message = await client.messages.create(model=VERTEX_MODEL, max_tokens=10, messages=MSGS)
    assert counted.input_tokens == message.usage.input_tokens
    assert vertex.requests[-2].path.endswith("/models/count-tokens:rawPredict")


async def test_vertex_refuses_an_unknown_beta(vertex):
    async with vertex_client(vertex) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.beta.messages.create(
                model=VERTEX_MODEL,
                max_tokens=10,
                messages=MSGS,
                betas=["interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14"],
            )
        assert raised.value.body["error"] == {
            "type": "invalid_request_error",
            "message": "invalid beta flag: fine-grained-tool-streaming-2025-05-14",
        }
        with pytest.raises(anthropic.BadRequestError, match="invalid beta flag"):
            await client.beta.messages.count_tokens(model=VERTEX_MODEL, messages=MSGS, betas=["claude-code-20250219"])
        await client.beta.messages.create(
            model=VERTEX_MODEL, max_tokens=10, messages=MSGS, betas=["interleaved-thinking-2025-05-14"]
        )
    assert vertex.requests[-1].headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"


async def test_vertex_refuses_a_token_it_did_not_issue(vertex):
    async with anthropic.AsyncAnthropicVertex(
        project_id=vertex.project, region="us-east5", base_url=f"{vertex.url}/v1", access_token="ya29.forged"
    ) as client:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await client.messages.create(model=VERTEX_MODEL, max_tokens=10, messages=MSGS)
    assert raised.value.body["error"]["status"] == "UNAUTHENTICATED"


async def test_vertex_token_endpoint_refuses_another_keys_assertion(vertex, tmp_path):
    other, _ = service_account_key(vertex.project, f"{vertex.url}/token")
    other["client_email"] = vertex.client_email  # the same account, signed with another key
    credentials = service_account.Credentials.from_service_account_info(other, scopes=[CLOUD_PLATFORM_SCOPE])
    with pytest.raises(google_exceptions.RefreshError, match="invalid_grant"):
        await asyncio.to_thread(credentials.refresh, GoogleRequest())
    assert vertex.token_requests == 1 and not vertex.tokens


async def test_vertex_answer_is_anthropics_sse(vertex):
    async with vertex_client(vertex) as client:
        await client.messages.create(model=VERTEX_MODEL, max_tokens=10, messages=MSGS)  # a token
    token = vertex.requests[-1].auth.key
    path = f"/v1/projects/{vertex.project}/locations/global/publishers/anthropic/models/{VERTEX_MODEL}:streamRawPredict"
    body = {"anthropic_version": "vertex-2023-10-16", "max_tokens": 10, "messages": MSGS, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{vertex.url}{path}", json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
            assert resp.headers["content-type"] == "text/event-stream"
            text = (await resp.read()).decode()
        assert text.startswith("event: message_start\ndata: ") and text.endswith(
            "event: message_stop\n" + 'data: {"type":"message_stop"}\n\n'
        )
        async with http.post(
            f"{vertex.url}{path.replace('ezat-test', 'other')}", json=body, headers={"Authorization": f"Bearer {token}"}
        ) as resp:
            assert resp.status == 403 and (await resp.json())["error"]["status"] == "PERMISSION_DENIED"


async def test_sync_clients(bedrock, vertex):
    """AnthropicBedrock and AnthropicVertex themselves (blocking: in a thread beside the mocks' loop)."""
    key = bedrock.temporary_key
    sync_bedrock = anthropic.AnthropicBedrock(
        aws_access_key=key.access_key_id,
        aws_secret_key=key.secret_access_key,
        aws_session_token=key.session_token,
        aws_region=bedrock.region,
        base_url=bedrock.url,
        max_retries=0,
    )
    credentials = service_account.Credentials.from_service_account_file(
        str(vertex.key_file), scopes=[CLOUD_PLATFORM_SCOPE]
    )
    sync_vertex = anthropic.AnthropicVertex(
        project_id=vertex.project,
        region="europe-west1",
        base_url=f"{vertex.url}/v1",
        credentials=credentials,
        max_retries=0,
    )
    for client, model in ((sync_bedrock, BEDROCK_MODEL), (sync_vertex, VERTEX_MODEL)):
        with client:
            message = await asyncio.to_thread(client.messages.create, model=model, max_tokens=10, messages=MSGS)
        assert message.content[0].text.startswith("Hello from the mock upstream.")
    assert bedrock.requests[-1].auth.session_token_signed and vertex.token_requests == 1


async def read_until(process: asyncio.subprocess.Process, marker: str) -> str:
    """The command's output up to and including the line that holds `marker`."""
    output = ""
    while marker not in output:
        line = await asyncio.wait_for(process.stdout.readline(), 20)
        assert line, output
        output += line.decode()
    return output


async def test_the_command_prints_what_a_client_needs():
    """`ezat-gateway mock-upstream --provider bedrock|vertex`, called with only what it printed."""
    bedrock_port, vertex_port = free_port(), free_port()
    processes = [
        await spawn("mock-upstream", "--provider", "bedrock", "--port", str(bedrock_port)),
        await spawn("mock-upstream", "--provider", "vertex", "--port", str(vertex_port)),
    ]
    try:
        said = await read_until(processes[0], "Bedrock API key")
        key = re.search(r"temporary access key: (\S+) secret: (\S+) session token: (\S+)", said)
        region = re.search(r"region: (\S+)", said)
        assert key and region, said
        async with anthropic.AsyncAnthropicBedrock(
            aws_access_key=key[1],
            aws_secret_key=key[2],
            aws_session_token=key[3],
            aws_region=region[1],
            base_url=f"http://127.0.0.1:{bedrock_port}",
            max_retries=0,
        ) as client:
            await client.messages.create(model=BEDROCK_MODEL, max_tokens=10, messages=MSGS)

        said = await read_until(processes[1], "service-account key file")
        found = re.search(r"project: ([\w-]+).*base URL: (\S+)\n.*key file: (\S+)", said, re.DOTALL)
        assert found, said
        credentials = service_account.Credentials.from_service_account_file(found[3], scopes=[CLOUD_PLATFORM_SCOPE])
        async with anthropic.AsyncAnthropicVertex(
            project_id=found[1], region="us-east5", base_url=found[2], credentials=credentials, max_retries=0
        ) as client:
            await client.messages.create(model=VERTEX_MODEL, max_tokens=10, messages=MSGS)
    finally:
        for process in processes:
            process.terminate()
            await process.wait()
