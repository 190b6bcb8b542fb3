"""Streamed chat completions: the SDKs' view and the raw SSE bytes, in the spec's order."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from gateway.mock.upstream import Scenario
from gateway.upstream import client as gateway_upstream
from tests.requests_util import WEATHER_TOOLS
from tests.support import KEY, MODEL, data, raw_stream

TEXT = "One, two, three, four, five."


async def test_sdk_stream_with_usage(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], usage={"input_tokens": 12, "output_tokens": 9}))
    stream = await client.chat.completions.create(
        model=MODEL,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count from 1 to 5."}],
    )
    chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 12
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.total_tokens == 21
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert {c.model for c in chunks} == {MODEL}
    assert upstream.requests[-1].body["stream"] is True


async def test_sync_sdk_stream(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=3, event_delay=0.01))

    def read() -> str:
        with gateway.sync_client() as sync:
            stream = sync.chat.completions.create(
                model=MODEL, stream=True, messages=[{"role": "user", "content": "Count"}]
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert await asyncio.to_thread(read) == TEXT


async def test_sdk_stream_helper_accumulates_the_message(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, event_delay=0.002))
    async with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Count"}]) as stream:
        final = await stream.get_final_completion()
    # Repeated identity fields (role, id) would be concatenated here by the SDK's accumulator.
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].message.content == TEXT
    assert final.choices[0].finish_reason == "stop"


async def test_raw_chunk_order_without_usage(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=4, event_delay=0.005, pings=0))
    response, events = await raw_stream(gateway, {})

    assert response.status == 200
    assert response.content_type == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert events[-1] == "data: [DONE]"
    chunks = [data(e) for e in events[:-1]]
    first, *middle, last = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == TEXT
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["id"] == "chatcmpl-" + response.headers["request-id"]
        assert chunk["model"] == MODEL
        assert "usage" not in chunk  # only with include_usage


async def test_raw_usage_chunk_comes_last_before_done(gateway, upstream):
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "text", "text": "hi"}],
            usage={
                "input_tokens": 10,
                "cache_read_input_tokens": 90,
                "cache_creation_input_tokens": 5,
                "output_tokens": 3,
            },
        )
    )
    _, events = await raw_stream(gateway, {"stream_options": {"include_usage": True}})
    *chunks, usage_event, done = events
    assert done == "data: [DONE]"
    usage_chunk = data(usage_event)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 105,
        "completion_tokens": 3,
        "total_tokens": 108,
        "prompt_tokens_details": {"cached_tokens": 90, "cache_write_tokens": 5},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    parsed = [data(e) for e in chunks if not e.startswith(":")]
    assert all(c["usage"] is None for c in parsed)  # the others carry "usage": null
    assert parsed[-1]["choices"][0]["finish_reason"] == "stop"


async def test_reasoning_tokens_in_stream_estimated_from_thinking(gateway, upstream):
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "thinking", "thinking": "t" * 80, "signature": "s"}, {"type": "text", "text": "ok"}],
            usage={"output_tokens": 40},
        )
    )
    _, events = await raw_stream(gateway, {"stream_options": {"include_usage": True}})
    usage = data(events[-2])["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 20
    text = "".join(data(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.startswith("data"))
    assert text == "ok"  # the thinking text is not returned


# Text whose JSON escapes and raw look could confuse the joining of a burst's text deltas.
AWKWARD = 'He wrote "}}", then\n\nevent: content_block_delta\ndata: {"type":"x"} \\ é 日本 😀\tend.'


async def test_a_burst_of_text_deltas_reaches_the_client_exactly(client, upstream):
    # One burst (no delay between events): thinking, text in 3-character deltas, a tool call,
    # more text. The text deltas that arrive together are joined before they are parsed.
    upstream.enqueue(
        Scenario(
            blocks=[
                {"type": "thinking", "thinking": "Let me think. " * 6, "signature": "s"},
                {"type": "text", "text": AWKWARD},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "text", "text": "After the call."},
            ],
            chunk_size=3,
        )
    )
    stream = await client.chat.completions.create(
        model=MODEL, stream=True, messages=[{"role": "user", "content": "Go"}], tools=WEATHER_TOOLS
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == AWKWARD + "After the call."
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather"
    assert "".join(call.function.arguments or "" for call in calls) == '{"city":"Paris"}'


def test_parsing_joins_a_text_blocks_deltas_into_one_and_leaves_the_rest():
    pieces = [AWKWARD[i : i + 5] for i in range(0, len(AWKWARD), 5)]
    events = [
        {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 5}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": t}}
            for t in ("a", "b", "c")
        ),
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        *({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": t}} for t in pieces),
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    ]
    burst = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)

    parsed = gateway_upstream._parse_events(burst)

    text_deltas = [e for e in parsed if e.get("delta", {}).get("type") == "text_delta"]
    assert text_deltas == [
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": AWKWARD}}
    ]
    others = [e for e in events if e.get("delta", {}).get("type") != "text_delta"]
    assert [e for e in parsed if e not in text_deltas] == others  # thinking deltas, the empty start: untouched


async def test_upstream_pings_become_comment_lines(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], pings=2, event_delay=0.01))
    _, events = await raw_stream(gateway, {})
    assert events.count(": ping") == 2
    assert events[-1] == "data: [DONE]"


async def test_gateway_pings_during_a_long_pause(start_gateway, upstream):
    gateway = await start_gateway(ping_interval=0.2)
    # 0.7 s between events: with nothing to send for 0.2 s the gateway sends its own ping.
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "slow"}], pings=0, event_delay=0.7, chunk_size=2))
    _, events = await raw_stream(gateway, {})
    assert events.count(": ping") >= 3
    assert (
        "".join(data(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.startswith("data"))
        == "slow"
    )


@pytest.mark.parametrize("failure", [{"error_after": 5}, {"drop_after": 5}])
async def test_failure_after_the_stream_started(gateway, upstream, failure):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, event_delay=0.005, **failure))
    response, events = await raw_stream(gateway, {"stream_options": {"include_usage": True}})
    assert response.status == 200
    error_event, done = events[-2:]
    assert done == "data: [DONE]"
    error = data(error_event)["error"]
    assert error["type"] == "server_error"
    assert error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if "error_after" in failure:
        assert error["code"] == "overloaded"
    # no usage chunk: the failed request reports no usage
    assert not any(e.startswith("data: {") and data(e).get("usage") for e in events[:-2])


async def test_sdk_raises_on_a_mid_stream_error(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, error_after=5))
    stream = await client.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "x"}])
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk)
    assert received  # the error came after the stream had started
    assert caught.value.code == "overloaded"


async def test_client_disconnect_closes_the_upstream_stream(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT * 10}], chunk_size=2, event_delay=0.05))
    async with aiohttp.ClientSession() as http:
        response = await http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]},
        )
        await response.content.readline()  # the stream has started
        response.close()
    await upstream.wait_disconnect(timeout=2)
    assert upstream.disconnects == 1
    # nothing is left behind: the gateway drops the client connection with its request
    async with asyncio.timeout(2):
        while gateway.runner.server.connections:
            await asyncio.sleep(0.01)


async def test_error_before_the_first_token_is_a_plain_http_error(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], error_after=2))  # before any delta
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 503
    assert caught.value.code == "overloaded"


async def test_upstream_error_status_on_a_streamed_request(client, upstream):
    upstream.enqueue(Scenario(status=429, headers={"retry-after": "7"}, error_message="slow down"))
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.headers["retry-after"] == "7"
    assert caught.value.body["message"] == "slow down"


async def test_a_finished_streams_connection_serves_the_next_once_its_body_ends(gateway, upstream):
    # message_stop comes before the chunked body's last bytes: the gateway answers at once, and
    # the connection goes back to the pool when those bytes arrive (no new TLS handshake upstream).
    for _ in range(3):
        upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], end_delay=0.1))
        _, events = await raw_stream(gateway, {})
        assert events[-1] == "data: [DONE]"
        await asyncio.sleep(0.3)
    assert len({request.connection for request in upstream.requests}) == 1


async def test_a_finished_streams_connection_is_closed_when_its_body_never_ends(gateway, upstream, monkeypatch):
    monkeypatch.setattr(gateway_upstream, "_LAST_BYTES_WITHIN", 0.2)
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], end_delay=3.0))
    _, events = await raw_stream(gateway, {})
    assert events[-1] == "data: [DONE]"  # not held back by the missing end
    await upstream.wait_disconnect(timeout=2.0)  # the gateway hung up long before the end came
