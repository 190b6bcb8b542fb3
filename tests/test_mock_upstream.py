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

from gateway.mock.upstream import MockUpstream, Scenario

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
VERSION = {"anthropic-version": "2023-06-01"}

THINKING = {"type": "thinking", "thinking": "The user wants weather; call the tool.", "signature": "EqQBCgIYAhIM1gbc=="}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT"}
TEXT = {"type": "text", "text": "Let me check the weather for you."}
TOOL = {
    "type": "tool_use",
    "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
    "name": "get_weather",
    "input": {"location": "Paris, France", "unit": "celsius", "days": [1, 2], "nested": {"ok": True}},
}
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
    # a token a word of up to 7 letters, or a mark: Hello from the mock upstrea m . You said : What is the weather in Paris ?
    assert msg.usage.output_tokens == 17
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0
    assert msg.usage.cache_creation.model_dump() == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
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


# What Claude Code adds to a person's turn (before and after the prompt), and what Codex adds to
# its first turn (through the gateway's translation, text blocks of one user turn).
REMINDER = "<system-reminder>\nThe user has get_time available. Do not mention this.\n</system-reminder>"
AGENTS_MD = "# AGENTS.md instructions for /work\n\n<INSTRUCTIONS>\nBe terse.\n</INSTRUCTIONS>"
ENVIRONMENT = "<environment_context>\n  <cwd>/work</cwd>\n  <shell>bash</shell>\n</environment_context>"


def said(*texts: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text} for text in texts]}


@pytest.mark.parametrize(
    ("messages", "answer"),
    [
        ([said(REMINDER, "Say hello", REMINDER)], "Hello from the mock upstream. You said: Say hello"),
        ([said(AGENTS_MD, ENVIRONMENT, "List the files")], "Hello from the mock upstream. You said: List the files"),
        # A turn of context alone: the person's words are those of the turn before.
        (
            [said("Hi"), {"role": "assistant", "content": "Hello"}, said(REMINDER)],
            "Hello from the mock upstream. You said: Hi",
        ),
        ([said(ENVIRONMENT)], "Hello from the mock upstream."),
    ],
)
async def test_the_echo_quotes_the_person_not_the_context_a_client_adds(client, messages, answer):
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]  # named only by the reminder
    msg = await client.messages.create(model="m", max_tokens=50, messages=messages, tools=tools)
    assert [block.type for block in msg.content] == ["text"]
    assert msg.content[0].text == answer


async def test_a_tool_result_is_answered_by_naming_the_tool_and_what_it_returned(client):
    calls = [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_2", "name": "read_file", "input": {"path": "notes.txt"}},
        {"type": "tool_use", "id": "toolu_3", "name": "touch", "input": {"path": "done"}},
    ]
    results = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "14:05"}]},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such file", "is_error": True},
        {"type": "tool_result", "tool_use_id": "toolu_3", "content": ""},
        {"type": "text", "text": REMINDER},  # as Claude Code sends it beside a result
    ]
    messages = [
        said("What time is it in Oslo?"),
        {"role": "assistant", "content": calls},
        {"role": "user", "content": results},
    ]
    msg = await client.messages.create(model="m", max_tokens=50, messages=messages)
    assert msg.content[0].text == (
        "Hello from the mock upstream. The tool get_time returned: 14:05\n"
        "The tool read_file failed: no such file\n"
        "The tool touch returned nothing"
    )


async def test_scenarios_are_fifo_then_default(client, mock):
    mock.enqueue(Scenario(blocks=[{"type": "text", "text": "one"}]), Scenario(blocks=[{"type": "text", "text": "two"}]))
    texts = [(await client.messages.create(model="m", max_tokens=5, messages=MSGS)).content[0].text for _ in range(3)]
    assert texts[:2] == ["one", "two"]
    assert texts[2].startswith("Hello from the mock upstream.")


async def test_usage_overrides(client, mock):
    usage = {
        "input_tokens": 3,
        "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 20,
        "output_tokens": 77,
        "thinking_tokens": 50,
    }
    mock.enqueue(Scenario(blocks=[THINKING, TEXT], usage=usage))
    msg = await client.messages.create(model="m", max_tokens=5, messages=MSGS)
    u = msg.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, u.output_tokens) == (
        3,
        1000,
        20,
        77,
    )
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
    assert (streamed.content[0].thinking, streamed.content[0].signature) == (
        THINKING["thinking"],
        THINKING["signature"],
    )
    assert streamed.content[1].data == REDACTED["data"]
    assert streamed.stop_reason == plain.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert streamed.usage.input_tokens == plain.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(blocks=[TEXT], stop_reason="stop_sequence", stop_sequence="END"),
        Scenario(blocks=[TEXT], stop_reason="max_tokens"),
        Scenario(
            blocks=[], stop_reason="refusal", stop_details={"type": "refusal", "category": "cyber", "explanation": "no"}
        ),
        Scenario(blocks=[THINKING, TEXT], usage={"thinking_tokens": 9}),
    ],
)
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


@pytest.mark.parametrize(
    "status, exc_class, error_type",
    [
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
    ],
)
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


@pytest.mark.parametrize(
    "headers, body, message",
    [
        ({}, stream_body(), "anthropic-version: header is required"),
        ({"anthropic-version": "2020-01-01"}, stream_body(), "anthropic-version: invalid version '2020-01-01'"),
        (VERSION, {"max_tokens": 5, "messages": MSGS}, "model: Field required"),
        (VERSION, {"model": "m", "messages": MSGS}, "max_tokens: Field required"),
        (VERSION, {"model": "m", "max_tokens": "5", "messages": MSGS}, "max_tokens: Input should be a valid integer"),
        (
            VERSION,
            {"model": "m", "max_tokens": -1, "messages": MSGS},
            "max_tokens: Input should be greater than or equal to 0",
        ),
        (VERSION, {"model": "m", "max_tokens": 5}, "messages: Field required"),
        (VERSION, {"model": "m", "max_tokens": 5, "messages": []}, "messages: at least one message is required"),
        (
            VERSION,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            'messages: Unexpected role "system". The Messages API accepts a top-level `system` parameter, not "system" as an '
            "input message role.",
        ),
        (
            VERSION,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role: Input should be 'user', 'assistant' or 'system'",
        ),
        (
            VERSION,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages: text content blocks must be non-empty",
        ),
        (
            VERSION,
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]},
            "messages.0.content: Input should be a valid string or list",
        ),
        (VERSION, stream_body(n=1), "n: Extra inputs are not permitted"),
    ],
)
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
    await client.messages.create(
        model="m",
        max_tokens=5,
        messages=MSGS,
        stop_sequences=["END"],
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    [rec] = mock.requests
    assert rec.path == "/v1/messages" and rec.query == {}
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
        return [
            d["delta"]
            for _, d in events
            if d["type"] == "content_block_delta" and d["index"] == index and d["delta"]["type"] == kind
        ]

    thinking = deltas(0, "thinking_delta")
    text = deltas(1, "text_delta")
    tool = deltas(2, "input_json_delta")
    names = [d["type"] if d["type"] != "content_block_delta" else d["delta"]["type"] for _, d in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "ping",
        *["thinking_delta"] * len(thinking),
        "signature_delta",
        "content_block_stop",
        "content_block_start",
        *["text_delta"] * len(text),
        "content_block_stop",
        "content_block_start",
        *["input_json_delta"] * len(tool),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 1
    starts = [d["content_block"] for _, d in events if d["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": TOOL["id"], "name": TOOL["name"], "input": {}},
    ]
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


# -- count_tokens ------------------------------------------------------------

MANUAL = "".join(f"Section {i}: the valve opens clockwise and closes counter-clockwise. " for i in range(90))
LOOKUP = {"name": "lookup", "description": MANUAL, "input_schema": {"type": "object", "properties": {}}}
BRIEF = "Be brief. " * 50


def tokens(*blocks) -> int:
    """The mock's count: 4 bytes of JSON a token, block by block, breakpoints left out."""
    return sum(len(orjson.dumps({k: v for k, v in b.items() if k != "cache_control"})) // 4 for b in blocks)


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


async def post(http, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(url, json=body, headers=VERSION if headers is None else headers) as resp:
        return resp.status, await resp.json()


async def test_count_tokens_counts_the_prompt_as_usage_does(client, mock):
    prompt = dict(model="m", system=BRIEF, tools=[LOOKUP], messages=MSGS)
    counted = await client.messages.count_tokens(**prompt)
    prompt_blocks = [LOOKUP, {"type": "text", "text": BRIEF}, {"type": "text", "text": MSGS[0]["content"]}]
    assert counted.input_tokens == tokens(*prompt_blocks)
    assert counted._request_id.startswith("req_mock_")
    [rec] = mock.requests
    assert rec.path == "/v1/messages/count_tokens" and rec.query == {}
    assert rec.body == {"model": "m", "system": BRIEF, "tools": [LOOKUP], "messages": MSGS}
    assert rec.headers["authorization"] == "Bearer k"
    msg = await client.messages.create(max_tokens=5, **prompt)
    assert total_input(msg.usage) == counted.input_tokens
    assert [r.path for r in mock.requests] == ["/v1/messages/count_tokens", "/v1/messages"]


async def test_count_tokens_leaves_the_cache_alone(client):
    system = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    prompt = dict(model="m", system=system, messages=MSGS)
    size = tokens(*system, {"type": "text", "text": MSGS[0]["content"]})
    assert (await client.messages.count_tokens(**prompt)).input_tokens == size
    first = await client.messages.create(max_tokens=5, **prompt)  # the count wrote nothing: this one writes
    assert (first.usage.cache_read_input_tokens, first.usage.cache_creation_input_tokens) == (0, tokens(*system))
    assert (await client.messages.count_tokens(**prompt)).input_tokens == size  # the same count, cached or not
    second = await client.messages.create(max_tokens=5, **prompt)
    assert (second.usage.cache_read_input_tokens, second.usage.cache_creation_input_tokens) == (tokens(*system), 0)
    assert total_input(first.usage) == total_input(second.usage) == size


async def test_count_tokens_never_consumes_scenarios_and_fails_by_its_own_status(client, mock):
    mock.enqueue(Scenario(status=529))
    assert (await client.messages.count_tokens(model="m", messages=MSGS)).input_tokens > 0
    with pytest.raises(anthropic.OverloadedError):
        await client.messages.create(model="m", max_tokens=5, messages=MSGS)

    mock.count_tokens_status = 429
    mock.enqueue(Scenario(blocks=[TEXT]))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.count_tokens(model="m", messages=MSGS)
    assert info.value.type == "rate_limit_error" and info.value.api_message == "mock error"
    assert info.value.request_id.startswith("req_mock_")
    assert (await client.messages.create(model="m", max_tokens=5, messages=MSGS)).content[0].text == TEXT["text"]
    mock.count_tokens_status = 200
    assert (await client.messages.count_tokens(model="m", messages=MSGS)).input_tokens > 0


COUNT = {"model": "m", "messages": MSGS}


@pytest.mark.parametrize(
    "headers, body, message",
    [
        ({}, COUNT, "anthropic-version: header is required"),
        (
            {**VERSION, "anthropic-beta": "token-counting"},
            COUNT,
            "Unexpected value(s) `token-counting` for the `anthropic-beta` header. "
            "Please consult our documentation at docs.claude.com or try again without the header.",
        ),
        (VERSION, {**COUNT, "max_tokens": 5}, "max_tokens: Extra inputs are not permitted"),
        (VERSION, {**COUNT, "stream": False}, "stream: Extra inputs are not permitted"),
        (VERSION, {**COUNT, "container": "c"}, "container: Extra inputs are not permitted"),
        (VERSION, {"model": "m"}, "messages: Field required"),
        (VERSION, {"messages": MSGS}, "model: Field required"),
        (VERSION, {**COUNT, "messages": []}, "messages: at least one message is required"),
        (
            VERSION,
            {**COUNT, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages: text content blocks must be non-empty",
        ),
        (
            VERSION,
            {**COUNT, "thinking": {"type": "enabled", "budget_tokens": 1000}},
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        ),
        (
            VERSION,
            {**COUNT, "cache_control": {"type": "ephemeral", "ttl": "2h"}},
            "cache_control.ttl: Input should be '5m' or '1h'",
        ),
    ],
)
async def test_count_tokens_validation(mock, http, headers, body, message):
    status, payload = await post(http, f"{mock.url}/v1/messages/count_tokens", body, headers)
    assert status == 400
    assert payload["error"] == {"type": "invalid_request_error", "message": message}
    assert mock.requests[-1].path == "/v1/messages/count_tokens" and mock.requests[-1].body == body


async def test_count_tokens_takes_the_fields_the_real_api_takes(mock, http):
    body = {
        **COUNT,
        "system": [{"type": "text", "text": "Be brief."}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 50_000},  # no max_tokens to stay under
        "output_config": {"effort": "low"},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}],
    }
    status, payload = await post(http, f"{mock.url}/v1/messages/count_tokens", body)
    assert status == 200
    prompt = [body["tools"][0], body["system"][0], {"type": "text", "text": MSGS[0]["content"]}]
    assert payload == {"input_tokens": tokens(*prompt)}


async def test_count_tokens_checks_the_api_key(http):
    upstream = MockUpstream(api_key="secret")
    url = await upstream.start()
    try:
        statuses = []
        for key in ("secret", "wrong"):
            status, _ = await post(http, f"{url}/v1/messages/count_tokens", COUNT, {**VERSION, "x-api-key": key})
            statuses.append(status)
        assert statuses == [200, 401]
        assert [r.path for r in upstream.requests] == ["/v1/messages/count_tokens"] * 2
    finally:
        await upstream.close()


async def test_fast_mode_has_no_count_tokens(http):
    upstream = MockUpstream(fast=True)
    url = await upstream.start()
    try:
        status, payload = await post(http, f"{url}/v1/messages/count_tokens", COUNT)
        assert status == 404 and payload["error"]["type"] == "not_found_error"
    finally:
        await upstream.close()


# -- the query string and anthropic-beta ---------------------------------------


async def test_query_and_betas_are_recorded(client, mock):
    # As Claude Code sends them (this SDK's beta client sends its betas, but no ?beta=true).
    betas = ["interleaved-thinking-2025-05-14", "claude-code-20250219"]
    beta = {"betas": betas, "extra_query": {"beta": "true"}}
    await client.beta.messages.create(model="m", max_tokens=5, messages=MSGS, **beta)
    await client.beta.messages.count_tokens(model="m", messages=MSGS, **beta)
    assert [(r.path, r.query) for r in mock.requests] == [
        ("/v1/messages", {"beta": "true"}),
        ("/v1/messages/count_tokens", {"beta": "true"}),
    ]
    assert [r.headers["anthropic-beta"] for r in mock.requests] == [
        ",".join(betas),
        ",".join([*betas, "token-counting-2024-11-01"]),
    ]  # the SDK adds its own for counting


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "betas, unexpected",
    [
        ("context-1m-2025-08-07 , interleaved-thinking-2025-05-14", None),
        ("claude-code-20250219,oauth-2025-04-20,fine-grained-tool-streaming-2025-05-14", None),
        ("prompt-caching-2024-07-31,", None),  # an empty name is skipped
        ("interleaved-thinking", "interleaved-thinking"),
        ("max-tokens-2025-05-14, Context-1m-2025-08-07,2025-05-14", "Context-1m-2025-08-07, 2025-05-14"),
        ("tools_2025-05-14;context-1m-2025-8-7", "tools_2025-05-14;context-1m-2025-8-7"),
    ],
)
async def test_anthropic_beta_names_are_checked(mock, http, path, betas, unexpected):
    body = {**COUNT, "max_tokens": 5} if path == "/v1/messages" else COUNT
    headers = {**VERSION, "anthropic-beta": betas}
    status, payload = await post(http, f"{mock.url}{path}?beta=true", body, headers)
    assert mock.requests[-1].query == {"beta": "true"} and mock.requests[-1].headers["anthropic-beta"] == betas
    if unexpected is None:
        assert status == 200
        return
    assert status == 400
    assert payload["error"] == {
        "type": "invalid_request_error",
        "message": (
            f"Unexpected value(s) `{unexpected}` for the `anthropic-beta` header. "
            "Please consult our documentation at docs.claude.com or try again without the header."
        ),
    }


# -- more of the real body ---------------------------------------------------


async def test_newer_body_fields_are_accepted(mock, http):
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": MSGS,
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}],
        "container": "container_011CQ",
        "inference_geo": "us",
    }
    status, payload = await post(http, f"{mock.url}/v1/messages", body)
    assert status == 200 and payload["stop_reason"] == "end_turn"
    assert mock.requests[-1].body == body


async def test_max_tokens_zero_warms_the_cache_and_generates_nothing(client, mock):
    system = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    mock.enqueue(Scenario(blocks=[TEXT], stop_reason="stop_sequence", stop_sequence="END"), Scenario(blocks=[TEXT]))
    warm = await client.messages.create(model="m", max_tokens=0, system=system, messages=MSGS)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.stop_sequence is None
    assert warm.usage.output_tokens == 0
    assert warm.usage.cache_creation_input_tokens == tokens(*system) and warm.usage.cache_read_input_tokens == 0
    real = await client.messages.create(model="m", max_tokens=100, system=system, messages=MSGS)
    assert real.content[0].text == TEXT["text"]  # the warm-up consumed the first scenario
    assert (real.usage.cache_read_input_tokens, real.usage.cache_creation_input_tokens) == (tokens(*system), 0)


async def test_max_tokens_zero_can_fail_by_scenario(client, mock):
    mock.enqueue(Scenario(status=529))
    with pytest.raises(anthropic.OverloadedError):
        await client.messages.create(model="m", max_tokens=0, messages=MSGS)


# -- the 1-hour cache ----------------------------------------------------------


def marked(block: dict, ttl: str | None = None) -> dict:
    return {**block, "cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}}


def split(usage) -> tuple[int, int]:
    """cache_creation as (5-minute tokens, 1-hour tokens)."""
    return usage.cache_creation.ephemeral_5m_input_tokens, usage.cache_creation.ephemeral_1h_input_tokens


async def test_cache_writes_are_split_by_ttl(client):
    """Tokens written up to the last 1-hour breakpoint are 1-hour ones; the rest 5-minute ones."""
    tool = marked(LOOKUP, "1h")
    system = [marked({"type": "text", "text": BRIEF})]
    first = await client.messages.create(model="m", max_tokens=5, tools=[tool], system=system, messages=MSGS)
    u = first.usage
    assert split(u) == (tokens(*system), tokens(LOOKUP))
    assert u.cache_creation_input_tokens == tokens(LOOKUP, *system) and u.cache_read_input_tokens == 0

    again = await client.messages.create(model="m", max_tokens=5, tools=[tool], system=system, messages=MSGS)
    assert again.usage.cache_read_input_tokens == tokens(LOOKUP, *system)
    assert split(again.usage) == (0, 0)

    # A new system prompt: the tools are read back (1 hour), the system prompt written (5 minutes).
    other = [marked({"type": "text", "text": "Be thorough. " * 40})]
    changed = await client.messages.create(model="m", max_tokens=5, tools=[tool], system=other, messages=MSGS)
    assert changed.usage.cache_read_input_tokens == tokens(LOOKUP)
    assert split(changed.usage) == (tokens(*other), 0)


async def test_a_1h_breakpoint_too_short_to_cache_writes_nothing_for_an_hour(client):
    tool = marked({"name": "get_weather", "input_schema": {"type": "object"}}, "1h")
    system = [marked({"type": "text", "text": MANUAL})]
    msg = await client.messages.create(model="m", max_tokens=5, tools=[tool], system=system, messages=MSGS)
    assert split(msg.usage) == (tokens(tool, *system), 0)


async def test_automatic_caching_marks_the_last_block(client):
    history = [{"role": "user", "content": MANUAL}]
    one_hour = {"type": "ephemeral", "ttl": "1h"}
    first = await client.messages.create(model="m", max_tokens=5, messages=history, cache_control=one_hour)
    size = tokens({"type": "text", "text": MANUAL})
    u = first.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, split(u)) == (
        1,
        0,
        size,
        (0, size),
    )
    history += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Which way does it open?"}]
    second = await client.messages.create(
        model="m", max_tokens=5, messages=history, cache_control={"type": "ephemeral"}
    )
    written = tokens({"type": "text", "text": "Noted."}, {"type": "text", "text": "Which way does it open?"})
    assert (second.usage.cache_read_input_tokens, second.usage.cache_creation_input_tokens) == (size, written)
    assert split(second.usage) == (written, 0)


@pytest.mark.parametrize(
    "usage, written, split",
    [
        ({"ephemeral_1h_input_tokens": 300, "ephemeral_5m_input_tokens": 200}, 500, (200, 300)),
        ({"ephemeral_1h_input_tokens": 300}, 300, (0, 300)),
        ({"cache_creation_input_tokens": 20}, 20, (20, 0)),
        ({"cache_creation_input_tokens": 50, "ephemeral_1h_input_tokens": 30}, 50, (20, 30)),
        ({"cache_creation_input_tokens": 9, "ephemeral_1h_input_tokens": 1, "ephemeral_5m_input_tokens": 2}, 9, (2, 1)),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_cache_creation_overrides(mock, http, usage, written, split, stream):
    mock.enqueue(Scenario(blocks=[TEXT], usage=usage))
    async with http.post(f"{mock.url}/v1/messages", json=stream_body(stream=stream), headers=VERSION) as resp:
        got = (await sse_events(resp))[0][1]["message"]["usage"] if stream else (await resp.json())["usage"]
    assert got["cache_creation_input_tokens"] == written
    assert got["cache_creation"] == {"ephemeral_5m_input_tokens": split[0], "ephemeral_1h_input_tokens": split[1]}


async def test_stream_message_start_carries_the_cache_usage(mock, http):
    body = stream_body(tools=[marked(LOOKUP, "1h")])
    async with http.post(f"{mock.url}/v1/messages", json=body, headers=VERSION) as resp:
        start = (await sse_events(resp))[0][1]["message"]["usage"]
    assert start == {
        "input_tokens": tokens({"type": "text", "text": MSGS[0]["content"]}),
        "cache_creation_input_tokens": tokens(LOOKUP),
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": tokens(LOOKUP)},
        "output_tokens": 1,
        "service_tier": "standard",
    }


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
    code = f"from gateway.mock.upstream import run; run('127.0.0.1', {port})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
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
