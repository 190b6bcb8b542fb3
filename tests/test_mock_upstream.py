"""Fidelity tests for the mock Anthropic upstream, read through the official SDK."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anthropic
import httpx2  # the installed anthropic SDK's HTTP transport
import orjson
import pytest
from aiohttp import web

from gateway.mock_upstream import MockUpstream, Scenario

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
VERSION = {"anthropic-version": "2023-06-01"}

THINKING = {"type": "thinking", "thinking": "The user wants weather; call the tool.", "signature": "EqQBCgIYAhIM1gbc=="}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT"}
TEXT = {"type": "text", "text": "Let me check the weather for you."}
TOOL = {"type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather",
        "input": {"location": "Paris, France", "unit": "celsius", "days": [1, 2], "nested": {"ok": True}}}
BLOCKS = [THINKING, REDACTED, TEXT, TOOL]


@pytest.fixture
async def mock():
    upstream = MockUpstream()
    await upstream.start()
    yield upstream
    await upstream.close()


@pytest.fixture
async def client(mock):
    async with anthropic.AsyncAnthropic(base_url=mock.url, api_key="k", max_retries=0) as c:
        yield c


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def sse_events(resp: aiohttp.ClientResponse) -> list[tuple[str, dict]]:
    """Parse a raw SSE body into (event name, JSON data) pairs."""
    text = (await resp.read()).decode()
    assert text.endswith("\n\n")
    events = []
    for chunk in text.strip("\n").split("\n\n"):
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((name_line[7:], orjson.loads(data_line[6:])))
    return events


def stream_body(**extra) -> dict:
    return {"model": "claude-test", "max_tokens": 100, "messages": MSGS, "stream": True, **extra}


# -- non-streaming --------------------------------------------------------


async def test_default_echo_reply(client, mock):
    msg = await client.messages.create(model="claude-test", max_tokens=50, system="Be brief.", messages=MSGS)
    expected = "Hello from the mock upstream. You said: What is the weather in Paris?"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == expected
    assert msg.id == "msg_mock_000001" and msg.model == "claude-test" and msg.role == "assistant"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None and msg.stop_details is None
    # the prompt's blocks (system, then messages) at 4 bytes of JSON a token
    prompt_blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": MSGS[0]["content"]}]
    assert msg.usage.input_tokens == sum(len(orjson.dumps(block)) // 4 for block in prompt_blocks)
    assert msg.usage.output_tokens == len(expected) // 4
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0
    assert msg.usage.service_tier == "standard" and msg.usage.output_tokens_details is None
    assert msg._request_id.startswith("req_mock_")


async def test_echo_uses_last_user_message_and_truncates(client):
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [{"type": "text", "text": "x" * 150}, {"type": "text", "text": "y" * 150}]},
    ]
    msg = await client.messages.create(model="m", max_tokens=5, messages=messages)
    assert msg.content[0].text == "Hello from the mock upstream. You said: " + ("x" * 150 + "\n" + "y" * 150)[:200]


async def test_scenarios_are_fifo_then_default(client, mock):
    mock.enqueue(Scenario(blocks=[{"type": "text", "text": "one"}]), Scenario(blocks=[{"type": "text", "text": "two"}]))
    texts = [(await client.messages.create(model="m", max_tokens=5, messages=MSGS)).content[0].text for _ in range(3)]
    assert texts[:2] == ["one", "two"]
    assert texts[2].startswith("Hello from the mock upstream.")


async def test_usage_overrides(client, mock):
    usage = {"input_tokens": 3, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 20,
             "output_tokens": 77, "thinking_tokens": 50}
    mock.enqueue(Scenario(blocks=[THINKING, TEXT], usage=usage))
    msg = await client.messages.create(model="m", max_tokens=5, messages=MSGS)
    u = msg.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, u.output_tokens) == (3, 1000, 20, 77)
    assert u.output_tokens_details.thinking_tokens == 50


# -- streaming through the SDK ----------------------------------------------


async def test_stream_final_message_equals_non_stream(client, mock):
    mock.enqueue(Scenario(blocks=BLOCKS), Scenario(blocks=BLOCKS, chunk_size=3))
    plain = await client.messages.create(model="m", max_tokens=100, messages=MSGS)
    async with client.messages.stream(model="m", max_tokens=100, messages=MSGS) as stream:
        streamed = await stream.get_final_message()

    dump = lambda m: [b.model_dump(exclude_none=True) for b in m.content]  # noqa: E731
    assert dump(streamed) == dump(plain) == [{**b, **({"type": "text"} if b is TEXT else {})} for b in BLOCKS]
    assert streamed.content[3].input == TOOL["input"]
    assert (streamed.content[0].thinking, streamed.content[0].signature) == (THINKING["thinking"], THINKING["signature"])
    assert streamed.content[1].data == REDACTED["data"]
    assert streamed.stop_reason == plain.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert streamed.usage.input_tokens == plain.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scenario", [
    Scenario(blocks=[TEXT], stop_reason="stop_sequence", stop_sequence="END"),
    Scenario(blocks=[TEXT], stop_reason="max_tokens"),
    Scenario(blocks=[], stop_reason="refusal",
             stop_details={"type": "refusal", "category": "cyber", "explanation": "no"}),
    Scenario(blocks=[THINKING, TEXT], usage={"thinking_tokens": 9}),
])
async def test_stop_fields_and_usage_details(client, mock, stream, scenario):
    mock.enqueue(scenario)
    if stream:
        async with client.messages.stream(model="m", max_tokens=100, messages=MSGS) as s:
            msg = await s.get_final_message()
    else:
        msg = await client.messages.create(model="m", max_tokens=100, messages=MSGS)
    assert msg.stop_reason == (scenario.stop_reason or "end_turn")
    assert msg.stop_sequence == scenario.stop_sequence
    details = msg.stop_details.model_dump() if msg.stop_details else None
    assert details == scenario.stop_details
    thinking = msg.usage.output_tokens_details
    assert (thinking.thinking_tokens if thinking else None) == scenario.usage.get("thinking_tokens")


async def test_error_mid_stream_raises_api_status_error(client, mock):
    mock.enqueue(Scenario(blocks=[TEXT], error_after=4))  # message_start, block_start, ping, one delta
    seen = []
    with pytest.raises(anthropic.APIStatusError) as info:
        async with client.messages.stream(model="m", max_tokens=100, messages=MSGS) as stream:
            async for text in stream.text_stream:
                seen.append(text)
    assert seen == [TEXT["text"][:8]]
    assert info.value.status_code == 200  # the error arrives after the 200 status line
    assert info.value.type == "overloaded_error"
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}


async def test_drop_after_raises_remote_protocol_error_in_sdk(client, mock):
    mock.enqueue(Scenario(blocks=[TEXT], drop_after=4))
    seen = []
    # The SDK does not wrap this: httpx2's RemoteProtocolError escapes as is.
    with pytest.raises(httpx2.RemoteProtocolError, match="incomplete chunked read"):
        async with client.messages.stream(model="m", max_tokens=100, messages=MSGS) as stream:
            async for event in stream:
                seen.append(event.type)
    assert "message_stop" not in seen and seen[0] == "message_start"
    assert mock.disconnects == 0  # a server-side drop is not a client disconnect


async def test_drop_after_raw_client_sees_truncated_body(mock, http):
    mock.enqueue(Scenario(blocks=[TEXT], drop_after=3))
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
        assert resp.status == 200
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.content.iter_any():
                received += chunk
    names = [line[7:] for line in received.decode().splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", "ping"]


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize("status, exc_class, error_type", [
    (400, anthropic.BadRequestError, "invalid_request_error"),
    (401, anthropic.AuthenticationError, "authentication_error"),
    (402, anthropic.PaymentRequiredError, "billing_error"),
    (403, anthropic.PermissionDeniedError, "permission_error"),
    (404, anthropic.NotFoundError, "not_found_error"),
    (413, anthropic.ContentTooLargeError, "request_too_large"),
    (429, anthropic.RateLimitError, "rate_limit_error"),
    (500, anthropic.InternalServerError, "api_error"),
    (503, anthropic.ServiceUnavailableError, "api_error"),
    (504, anthropic.GatewayTimeoutError, "timeout_error"),
    (529, anthropic.OverloadedError, "overloaded_error"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_error_status_maps_to_sdk_exception(client, mock, status, exc_class, error_type, stream):
    mock.enqueue(Scenario(status=status, error_message="boom", headers={"retry-after": "7"}))
    with pytest.raises(exc_class) as info:
        if stream:
            async with client.messages.stream(model="m", max_tokens=5, messages=MSGS) as s:
                await s.get_final_message()
        else:
            await client.messages.create(model="m", max_tokens=5, messages=MSGS)
    err = info.value
    assert err.status_code == status and err.type == error_type and err.api_message == "boom"
    assert err.request_id.startswith("req_mock_") and err.body["request_id"] == err.request_id
    assert err.response.headers["retry-after"] == "7"
    assert err.response.headers["content-type"] == "application/json"


async def test_unknown_field_rejected_and_recorded(client, mock):
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="m", max_tokens=5, messages=MSGS, extra_body={"response_format": {}})
    assert info.value.api_message == "response_format: Extra inputs are not permitted"
    assert mock.requests[-1].body["response_format"] == {}


@pytest.mark.parametrize("headers, body, message", [
    ({}, stream_body(), "anthropic-version: header is required"),
    ({"anthropic-version": "2020-01-01"}, stream_body(), "anthropic-version: invalid version '2020-01-01'"),
    (VERSION, {"max_tokens": 5, "messages": MSGS}, "model: Field required"),
    (VERSION, {"model": "m", "messages": MSGS}, "max_tokens: Field required"),
    (VERSION, {"model": "m", "max_tokens": "5", "messages": MSGS}, "max_tokens: Input should be a valid integer"),
    (VERSION, {"model": "m", "max_tokens": 0, "messages": MSGS}, "max_tokens: Input should be greater than or equal to 1"),
    (VERSION, {"model": "m", "max_tokens": 5}, "messages: Field required"),
    (VERSION, {"model": "m", "max_tokens": 5, "messages": []}, "messages: at least one message is required"),
    (VERSION, {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     "messages.0.role: Input should be 'user' or 'assistant'"),
    (VERSION, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages: text content blocks must be non-empty"),
    (VERSION, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]},
     "messages.0.content: Input should be a valid string or list"),
    (VERSION, stream_body(n=1), "n: Extra inputs are not permitted"),
])
async def test_validation_errors(mock, http, headers, body, message):
    mock.enqueue(Scenario(blocks=[TEXT]))
    async with http.post(f"{mock.url}/v1/messages", json=body, headers=headers) as resp:
        payload = await resp.json()
        assert resp.status == 400 and resp.headers["request-id"] == payload["request_id"]
    assert payload["type"] == "error"
    assert payload["error"] == {"type": "invalid_request_error", "message": message}
    assert mock.requests[-1].body == body
    # A rejected request leaves the queued scenario for the next valid one.
    async with http.post(f"{mock.url}/v1/messages", json={**stream_body(), "stream": False}, headers=VERSION) as resp:
        assert (await resp.json())["content"] == [TEXT]


async def test_invalid_json_body(mock, http):
    async with http.post(f"{mock.url}/v1/messages", data=b"{nope", headers={**VERSION, "X-Api-Key": "abc"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    assert mock.requests[-1].body == {}
    assert mock.requests[-1].headers["x-api-key"] == "abc"  # names are lower-cased


async def test_unknown_path_is_anthropic_404(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.models.list()
    assert info.value.type == "not_found_error"


async def test_api_key_is_checked(http):
    upstream = MockUpstream(api_key="secret")
    url = await upstream.start()
    try:
        # The installed SDK (2.x) sends its api_key as `Authorization: Bearer`; both forms are accepted.
        async with anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await bad.messages.create(model="m", max_tokens=5, messages=MSGS)
        assert info.value.type == "authentication_error" and info.value.api_message == "invalid x-api-key"
        async with anthropic.AsyncAnthropic(base_url=url, api_key="secret", max_retries=0) as good:
            assert (await good.messages.create(model="m", max_tokens=5, messages=MSGS)).content
        body = {**stream_body(), "stream": False}
        statuses = []
        for key in ("secret", "wrong", None):
            headers = {**VERSION, **({"x-api-key": key} if key else {})}
            async with http.post(f"{url}/v1/messages", json=body, headers=headers) as resp:
                statuses.append(resp.status)
        assert statuses == [200, 401, 401]
        assert [r.headers.get("x-api-key") for r in upstream.requests] == [None, None, "secret", "wrong", None]
    finally:
        await upstream.close()


async def test_requests_are_recorded(client, mock):
    await client.messages.create(model="m", max_tokens=5, messages=MSGS, stop_sequences=["END"],
                                 extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    [rec] = mock.requests
    assert rec.path == "/v1/messages"
    assert rec.headers["authorization"] == "Bearer k"  # how this SDK version sends api_key
    assert rec.headers["anthropic-version"] == client.default_headers["anthropic-version"]
    assert rec.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert rec.body == {"model": "m", "max_tokens": 5, "messages": MSGS, "stop_sequences": ["END"]}


# -- raw wire format -------------------------------------------------------


async def test_raw_stream_event_order(mock, http):
    mock.enqueue(Scenario(blocks=[THINKING, TEXT, TOOL], chunk_size=16, pings=2))
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["request-id"].startswith("req_mock_")
        events = await sse_events(resp)
    assert all(name == data["type"] for name, data in events)

    def deltas(index, kind):
        return [d["delta"] for _, d in events if d["type"] == "content_block_delta"
                and d["index"] == index and d["delta"]["type"] == kind]

    thinking = deltas(0, "thinking_delta")
    text = deltas(1, "text_delta")
    tool = deltas(2, "input_json_delta")
    names = [d["type"] if d["type"] != "content_block_delta" else d["delta"]["type"] for _, d in events]
    assert names == [
        "message_start",
        "content_block_start", "ping", "ping", *["thinking_delta"] * len(thinking), "signature_delta", "content_block_stop",
        "content_block_start", *["text_delta"] * len(text), "content_block_stop",
        "content_block_start", *["input_json_delta"] * len(tool), "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 1
    starts = [d["content_block"] for _, d in events if d["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""},
                      {"type": "tool_use", "id": TOOL["id"], "name": TOOL["name"], "input": {}}]
    assert "".join(d["thinking"] for d in thinking) == THINKING["thinking"] and len(thinking) > 1
    assert deltas(0, "signature_delta") == [{"type": "signature_delta", "signature": THINKING["signature"]}]
    assert "".join(d["text"] for d in text) == TEXT["text"]
    assert tool[0]["partial_json"] == "" and len(tool) > 2
    assert orjson.loads("".join(d["partial_json"] for d in tool)) == TOOL["input"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert set(delta["usage"]) == {"output_tokens"} and delta["usage"]["output_tokens"] > 1


async def test_raw_stream_error_event_ends_stream(mock, http):
    mock.enqueue(Scenario(blocks=[TEXT], error_after=2))
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
        events = await sse_events(resp)  # the body ends cleanly after the error event
    assert [name for name, _ in events] == ["message_start", "content_block_start", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error"


async def test_delays_are_real(mock, http):
    mock.enqueue(Scenario(blocks=[TEXT], delay=0.2, event_delay=0.05, pings=0, chunk_size=100))
    t0 = time.monotonic()
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
        assert time.monotonic() - t0 >= 0.2  # the status line waited for `delay`
        arrivals = []
        async for line in resp.content:
            if line.startswith(b"event: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 6  # message_start, block start/delta/stop, message_delta, message_stop
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert min(gaps) >= 0.04  # each event is written (and arrives) on its own


# -- disconnects -----------------------------------------------------------


async def test_client_disconnect_mid_stream_is_counted(mock, http, caplog):
    caplog.set_level(logging.DEBUG)
    mock.enqueue(Scenario(blocks=[TEXT], chunk_size=1, event_delay=0.02))
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
        assert (await resp.content.readline()).startswith(b"event: message_start")
        resp.close()  # drop the connection after one event
    await mock.wait_disconnect(timeout=5)
    assert mock.disconnects == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_disconnect_seen_as_write_error_is_counted(http, caplog):
    # Without handler cancellation the handler notices the disconnect when a write fails.
    upstream = MockUpstream()
    runner = web.AppRunner(upstream.app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        upstream.enqueue(Scenario(blocks=[TEXT], chunk_size=1, event_delay=0.02))
        async with http.post(f"{url}/v1/messages", json=stream_body(), headers=VERSION) as resp:
            await resp.content.readline()
            resp.close()
        await upstream.wait_disconnect(timeout=5)
        assert upstream.disconnects == 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    finally:
        await runner.cleanup()


async def test_client_timeout_during_delay_is_counted(mock, http):
    mock.enqueue(Scenario(delay=2))
    with pytest.raises(asyncio.TimeoutError):
        body = {**stream_body(), "stream": False}
        await http.post(f"{mock.url}/v1/messages", json=body, headers=VERSION, timeout=aiohttp.ClientTimeout(total=0.2))
    await mock.wait_disconnect(timeout=5)
    assert mock.disconnects == 1


async def test_wait_disconnect_times_out_without_disconnect(mock):
    with pytest.raises(asyncio.TimeoutError):
        await mock.wait_disconnect(timeout=0.05)


# -- CLI entry point --------------------------------------------------------


def test_run_serves_until_interrupted():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"from gateway.mock_upstream import run; run('127.0.0.1', {port})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parent.parent)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)
        msg = client.messages.create(model="m", max_tokens=5, messages=MSGS)
        assert msg.content[0].text.startswith("Hello from the mock upstream.")
        client.close()
        proc.send_signal(subprocess.signal.SIGINT)
        assert proc.wait(timeout=5) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
