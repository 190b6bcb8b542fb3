"""Behaviours of the product page (and of the second product page, the part of it issue 8 takes)
that no other test file exercised. Each test goes through
the real interface (the official openai SDK or raw HTTP against a served gateway, the mock
upstream as a real server) and asserts what the page says, quoted above each test."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from gateway.mock.upstream import Scenario
from tests.requests_util import WEATHER_TOOLS
from tests.support import KEY, MODEL, data, make_config

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
HELLO = [{"role": "user", "content": "Hi"}]
OSLO = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
# Well above the default model's 1,024-token cache minimum (4 bytes a token).
LONG_SYSTEM = "".join(f"Rule {i}: answer in plain words, cite the manual and never guess. " for i in range(90))


async def raw_post(gateway, body: dict | bytes, headers: dict | None = None) -> tuple[aiohttp.ClientResponse, bytes]:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json", **(headers or {})}
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/openai/v1/chat/completions", headers=headers, data=payload) as response:
            return response, await response.read()


def sse_events(raw: bytes) -> list[str]:
    return [event for event in raw.decode().split("\n\n") if event]


def cache_marks(value, path: str = "") -> list[str]:
    """The paths of every `cache_control` in an upstream body."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "cache_control":
                found.append(path or "<top>")
            else:
                found += cache_marks(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += cache_marks(item, f"{path}[{i}]")
    return found


# --- Errors: "504 server_error timeout: A non-streaming request took longer than 590 seconds;
# stream it instead" (and issue 8: "streams keep going, with `: ping` comments during pauses").


async def test_a_stream_is_not_cut_by_the_non_streaming_deadline(start_gateway, upstream):
    gateway = await start_gateway(non_streaming_deadline=0.3, ping_interval=0.15)
    answer = "a slow but complete answer"
    # 13 deltas 0.1 s apart: about 1.3 s, four times the non-streaming deadline.
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], chunk_size=2, event_delay=0.1, pings=0))
    response, raw = await raw_post(
        gateway, {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "messages": HELLO}
    )
    assert response.status == 200
    events = sse_events(raw)
    assert events[-1] == "data: [DONE]"
    chunks = [data(e) for e in events[:-1] if not e.startswith(":")]
    assert not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == answer
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0

    # The same slow answer, not streamed, is the 504 the page describes.
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], delay=1.0))
    response, raw = await raw_post(gateway, {"model": MODEL, "messages": HELLO})
    assert response.status == 504
    assert json.loads(raw)["error"]["code"] == "timeout"


# --- Streaming: "During long pauses EZAT sends `: ping` comment lines" — thinking the client never
# sees is such a pause for the client (issue 2's closing note: the pinger "covers ... thinking the
# client never sees").


async def test_a_long_thinking_phase_is_filled_with_pings(start_gateway, upstream):
    gateway = await start_gateway(ping_interval=0.2)
    thinking = {"type": "thinking", "thinking": "t" * 40, "signature": "sig"}  # 20 deltas, 0.06 s apart
    upstream.enqueue(
        Scenario(blocks=[thinking, {"type": "text", "text": "Done."}], chunk_size=2, event_delay=0.06, pings=0)
    )
    response, raw = await raw_post(
        gateway, {"model": MODEL, "stream": True, "reasoning_effort": "high", "messages": HELLO}
    )
    assert response.status == 200
    events = sse_events(raw)
    assert events[-1] == "data: [DONE]"
    # About 1.2 s of thinking with nothing for the client: the pings every 0.2 s must have spoken.
    assert events.count(": ping") >= 2
    chunks = [data(e) for e in events[:-1] if not e.startswith(":")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Done."
    assert "tttt" not in raw.decode()  # the thinking text itself isn't returned


# --- Errors table: "503 server_error overloaded — No capacity right now; wait for `retry-after`
# seconds" and "429 rate_limit_error rate_limit_exceeded — Too many requests; wait for
# `retry-after` seconds". The client is told how long to wait even when the upstream did not say.


@pytest.mark.parametrize(
    ("upstream_status", "status", "type_", "code"),
    [(529, 503, "server_error", "overloaded"), (429, 429, "rate_limit_error", "rate_limit_exceeded")],
    ids=["529-to-503", "429"],
)
async def test_retry_after_is_sent_even_when_the_upstream_gave_none(
    client, upstream, upstream_status, status, type_, code
):
    upstream.enqueue(Scenario(status=upstream_status, error_message="busy"))  # no retry-after header
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.status_code == status
    assert (caught.value.type, caught.value.code) == (type_, code)
    retry_after = caught.value.response.headers.get("retry-after")
    assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1


# --- Images and PDFs: "The whole request body can be up to 32 MB." (413 only *over* it.)


async def test_a_body_of_exactly_32_mb_is_accepted(gateway, upstream):
    limit = 32 * 1024 * 1024
    # The padding is in an ignored field, so what the upstream gets stays small.
    skeleton = {"model": MODEL, "max_completion_tokens": 16, "messages": HELLO, "user": ""}
    padding = limit - len(json.dumps(skeleton).encode())
    body = json.dumps({**skeleton, "user": "u" * padding}).encode()
    assert len(body) == limit
    response, raw = await raw_post(gateway, body)
    assert response.status == 200, raw[:300]
    assert json.loads(raw)["choices"][0]["finish_reason"] == "stop"
    assert "user" not in upstream.requests[-1].body


# --- Prompt caching: "When a request has no cache breakpoints of its own *and the model supports
# caching*, EZAT marks two 5-minute breakpoints". A model without a prompt cache
# (min_cache_tokens = 0 in its config) gets none, however long the prompt.


@STREAM
async def test_a_model_without_a_prompt_cache_gets_no_automatic_breakpoints(start_gateway, upstream, stream):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "How do I open the valve?"}]
    for min_cache_tokens, expect_marks in ((1024, True), (0, False)):
        gateway = await start_gateway(make_config(upstream.url, min_cache_tokens=min_cache_tokens))
        async with gateway.client() as client:
            result = await client.chat.completions.create(model=MODEL, messages=messages, stream=stream)
            if stream:
                [chunk async for chunk in result]
        assert bool(cache_marks(upstream.requests[-1].body)) is expect_marks, min_cache_tokens


# --- Sampling: "`temperature` and `top_p` are forwarded only to models whose capabilities.sampling
# is `true`, and only when thinking is off." Reasoning: "Thinking isn't requested when
# `tool_choice` forces a tool." So a forced tool call on a sampling model keeps its sampling.


@STREAM
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
async def test_sampling_is_forwarded_when_a_forced_tool_turns_thinking_off(
    start_gateway, upstream, stream, tool_choice
):
    gateway = await start_gateway(make_config(upstream.url, sampling=True))
    upstream.enqueue(Scenario(blocks=[OSLO]))
    async with gateway.client() as client:
        result = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=WEATHER_TOOLS,
            tool_choice=tool_choice,
            reasoning_effort="high",
            temperature=0.4,
            top_p=0.8,
            stream=stream,
        )
        if stream:
            [chunk async for chunk in result]
    body = upstream.requests[-1].body
    assert "thinking" not in body
    assert (body.get("temperature"), body.get("top_p")) == (0.4, 0.8)


# --- Messages: "`tool` — A tool result for `tool_call_id`." OpenAI clients may send the result's
# content as text parts rather than a string; it still becomes that call's tool_result.


@STREAM
async def test_a_tool_result_given_as_text_parts(client, upstream, stream):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_1",
            "content": [{"type": "text", "text": "9°C"}, {"type": "text", "text": "clear sky"}],
        },
    ]
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "It is 9°C and clear in Oslo."}]))
    result = await client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER_TOOLS, stream=stream)
    if stream:
        text = "".join([c.choices[0].delta.content or "" async for c in result if c.choices])
    else:
        text = result.choices[0].message.content
    assert text == "It is 9°C and clear in Oslo."
    last = upstream.requests[-1].body["messages"][-1]
    assert last["role"] == "user"
    [block] = last["content"]
    assert block["type"] == "tool_result" and block["tool_use_id"] == "toolu_1"
    content = block["content"]
    texts = [content] if isinstance(content, str) else [part["text"] for part in content if part["type"] == "text"]
    assert " ".join(texts).split() == ["9°C", "clear", "sky"]


# --- Page 004 (issue 8): "Every response also has these headers: x-request-id ..., the model that
# answered [x-ezat-model]; only after smart routing: the model you asked for [x-ezat-routed-from]."
# Without `models` at all, too.


@STREAM
async def test_every_response_names_the_model_that_answered(gateway, upstream, stream):
    response, raw = await raw_post(gateway, {"model": MODEL, "stream": stream, "messages": HELLO})
    assert response.status == 200
    assert response.headers["x-ezat-model"] == MODEL
    assert "x-ezat-routed-from" not in response.headers
    request_id = response.headers["x-request-id"]
    assert response.headers["request-id"] == request_id
    if stream:
        first = data(sse_events(raw)[0])
    else:
        first = json.loads(raw)
    assert first["id"] == "chatcmpl-" + request_id
    assert first["model"] == MODEL
