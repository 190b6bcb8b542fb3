"""The gateway reading Bedrock's event-stream frames however they arrive: split anywhere, many in
one read, with a bad checksum, an exception, events Bedrock adds, and the invocation metrics
standing in for usage. The upstream is a loopback server that writes the frames a test gives it,
in the reads it gives, so that what arrives is exactly what the test says."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import struct
import zlib
from collections.abc import Iterator

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp import web

from gateway.app import build_app
from gateway.config import Deployment
from gateway.mock.bedrock import event_frame
from tests.support import KEY, MODEL, Gateway, make_config, served

CHUNK = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}
TEXT = "Frames, read whole."
USAGE = {"input_tokens": 12, "output_tokens": 5, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
METRICS = {"inputTokenCount": 12, "outputTokenCount": 5, "invocationLatency": 40, "firstByteLatency": 10}


def chunk(event: dict) -> bytes:
    """One `chunk` frame carrying an Anthropic event, as Bedrock writes it (with its padding)."""
    payload = {"bytes": base64.b64encode(orjson.dumps(event)).decode(), "p": "abcdefghij"}
    return event_frame(CHUNK, orjson.dumps(payload))


def message_events(text: str = TEXT, *, delta_usage: bool = True) -> list[dict]:
    start = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
    start |= {"stop_reason": None, "stop_sequence": None, "usage": {**USAGE, "output_tokens": 1}}
    delta: dict = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    if delta_usage:
        delta["usage"] = {"output_tokens": USAGE["output_tokens"]}
    return [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}} for t in text),
        {"type": "content_block_stop", "index": 0},
        delta,
        {"type": "message_stop", "amazon-bedrock-invocationMetrics": METRICS},
    ]


class FrameUpstream:
    """A Bedrock runtime that answers every stream with `reads`: the bytes of each write."""

    def __init__(self) -> None:
        self.reads: list[bytes] = []
        self.bodies: list[dict] = []
        self.answer: tuple[dict, dict[str, str]] = ({}, {})  # a whole answer: its message, headers

    async def invoke_whole(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        message, headers = self.answer
        return web.json_response(message, headers=headers)

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"content-type": "application/vnd.amazon.eventstream"})
        await response.prepare(request)
        for read in self.reads:
            await response.write(read)
            await asyncio.sleep(0)  # each its own read at the gateway, as far as the loop allows
        await response.write_eof()
        return response


@pytest.fixture
async def bedrock() -> Iterator[tuple[FrameUpstream, Gateway]]:
    upstream = FrameUpstream()
    app = web.Application()
    app.router.add_post("/model/{model}/invoke-with-response-stream", upstream.invoke)
    app.router.add_post("/model/{model}/invoke", upstream.invoke_whole)
    runner, url = await served(app)
    config = make_config("http://unused")
    deployment = Deployment(name="primary", provider="bedrock", region="us-east-1", base_url=url, api_key="ABSKtest")
    gateway = await Gateway(build_app(dataclasses.replace(config, deployments=(deployment,)))).start()
    yield upstream, gateway
    await gateway.runner.cleanup()
    await runner.cleanup()


def client(gateway: Gateway) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)


async def streamed(gateway: Gateway) -> tuple[list[str], anthropic.types.Message]:
    """The event types the Messages route's client saw, and the message they made."""
    async with client(gateway).messages.stream(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        types = [event.type async for event in stream]
        return types, await stream.get_final_message()


def frames(events: list[dict]) -> bytes:
    return b"".join(chunk(event) for event in events)


@pytest.mark.parametrize(
    "split",
    [
        pytest.param(lambda data: [data], id="one read"),
        pytest.param(lambda data: [data[i : i + 1] for i in range(len(data))], id="byte by byte"),
        pytest.param(lambda data: [data[i : i + 37] for i in range(0, len(data), 37)], id="37 bytes at a time"),
    ],
)
async def test_frames_are_read_however_they_are_split(bedrock, split):
    upstream, gateway = bedrock
    upstream.reads = split(frames(message_events()))
    types, message = await streamed(gateway)
    assert message.content[0].text == TEXT
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 5)
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert upstream.bodies[0]["anthropic_version"] == "bedrock-2023-05-31"


async def test_the_metrics_stand_in_for_a_message_delta_without_usage(bedrock):
    upstream, gateway = bedrock
    upstream.reads = [frames(message_events(delta_usage=False))]
    _, message = await streamed(gateway)
    assert message.usage.output_tokens == METRICS["outputTokenCount"]


async def test_the_client_gets_anthropic_events_without_bedrock_metrics(bedrock):
    upstream, gateway = bedrock
    upstream.reads = [frames(message_events())]
    request = {"model": MODEL, "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/v1/messages", json=request, headers={"x-api-key": KEY}) as response:
            body = await response.read()
    assert b"amazon-bedrock" not in body
    assert body.startswith(b"event: message_start\ndata: ")
    assert body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


async def test_events_bedrock_adds_are_skipped(bedrock):
    upstream, gateway = bedrock
    events = message_events()
    other = event_frame({":event-type": "metadata", ":message-type": "event"}, b"{}")
    upstream.reads = [chunk(events[0]), other, frames(events[1:])]
    _, message = await streamed(gateway)
    assert message.content[0].text == TEXT


def corrupted(frame: bytes, at: int) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0xFF]) + frame[at + 1 :]


@pytest.mark.parametrize("at", [pytest.param(5, id="prelude"), pytest.param(-10, id="payload")])
async def test_a_frame_that_does_not_check_ends_the_stream_with_an_error(bedrock, at):
    upstream, gateway = bedrock
    events = message_events()
    good = frames(events[:3])  # message_start, block start, a delta: the answer has begun
    upstream.reads = [good, corrupted(chunk(events[3]), at), frames(events[4:])]
    with pytest.raises(anthropic.APIStatusError) as raised:
        await streamed(gateway)
    assert "cannot read" in str(raised.value)


async def test_an_exception_frame_after_the_first_token_ends_the_stream(bedrock):
    upstream, gateway = bedrock
    events = message_events()
    exception = {":exception-type": "modelStreamErrorException", ":message-type": "exception"}
    upstream.reads = [frames(events[:3]), event_frame(exception, orjson.dumps({"message": "The model broke."}))]
    with pytest.raises(anthropic.APIStatusError) as raised:
        await streamed(gateway)
    assert raised.value.body["error"] == {"type": "overloaded_error", "message": "The model broke."}


async def test_bytes_that_are_not_frames_end_the_stream(bedrock):
    upstream, gateway = bedrock
    upstream.reads = [struct.pack("!III", 100, 0, 0) + b"x" * 100]
    with pytest.raises(anthropic.APIStatusError) as raised:
        await streamed(gateway)
    assert raised.value.status_code == 500


async def test_a_held_message_delta_is_sent_when_message_stop_has_no_metrics(bedrock):
    """A message_delta without usage waits for the metrics; a message_stop without them still lets
    it through, stop reason and all."""
    upstream, gateway = bedrock
    events = message_events(delta_usage=False)
    events[-1] = {"type": "message_stop"}
    upstream.reads = [frames(events)]
    types, message = await streamed(gateway)
    assert types[-2:] == ["message_delta", "message_stop"] and message.stop_reason == "end_turn"


async def test_a_chunk_that_is_not_json_ends_the_stream_with_an_error(bedrock):
    upstream, gateway = bedrock
    events = message_events()
    broken = event_frame(CHUNK, orjson.dumps({"bytes": base64.b64encode(b'{"type":"message_delta",').decode()}))
    upstream.reads = [frames(events[:3]), broken]
    with pytest.raises(anthropic.APIStatusError) as raised:
        await streamed(gateway)
    assert "cannot read" in str(raised.value)


async def test_headers_longer_than_their_frame_end_the_stream(bedrock):
    """A prelude whose checksum holds but whose headers' length runs past the frame's end."""
    upstream, gateway = bedrock
    frame = bytearray(chunk(message_events()[0]))
    struct.pack_into("!I", frame, 4, len(frame))  # headers_length: the whole frame
    struct.pack_into("!I", frame, 8, zlib.crc32(frame[:8]))
    struct.pack_into("!I", frame, len(frame) - 4, zlib.crc32(frame[:-4]))
    upstream.reads = [bytes(frame)]
    with pytest.raises(anthropic.APIStatusError) as raised:
        await streamed(gateway)
    assert raised.value.status_code == 500


@pytest.mark.parametrize(
    "count", ["7", "\u00b2", "9" * 5000, "-3", ""], ids=["a count", "superscript", "5000 digits", "negative", "empty"]
)
async def test_a_whole_answers_usage_from_headers_only_where_they_count(bedrock, count):
    """A message without usage takes it from Bedrock's token-count headers; a header that is not a
    count is left out, never a 500."""
    upstream, gateway = bedrock
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn"}
    message |= {"stop_sequence": None, "content": [{"type": "text", "text": TEXT}]}
    headers = {"x-amzn-bedrock-input-token-count": "12", "x-amzn-bedrock-output-token-count": count}
    upstream.answer = (message, headers)
    async with client(gateway) as claude:
        answer = await claude.messages.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}])
    assert answer.content[0].text == TEXT and answer.usage.input_tokens == 12
    if count == "7":
        assert answer.usage.output_tokens == 7  # Bedrock's count, taken
    else:  # not a count: as if Bedrock had sent no header at all
        upstream.answer = (message, {"x-amzn-bedrock-input-token-count": "12"})
        async with client(gateway) as claude:
            without = await claude.messages.create(
                model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}]
            )
        assert answer.usage.output_tokens == without.usage.output_tokens
