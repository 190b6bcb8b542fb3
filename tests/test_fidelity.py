"""What the client sees is what the upstream said. Usage is the upstream's own count on both
routes, streamed and not, and the ledger row says the same; the estimate from the answer's text
stands in only where that count is missing or cannot be true. The native route relays the
upstream's stream as its bytes (only message_start's model set back to the client's name), and
its anthropic-beta lines go upstream as sent."""

from __future__ import annotations

import json
import logging

import aiohttp
import anthropic
import pytest
from aiohttp import web

from gateway.app import STORE
from gateway.mock.upstream import MockUpstream, Scenario, output_tokens
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, make_config, served

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
SHORT_ANSWERS = [
    "The capital of France is Paris.",
    "Paris is the capital and largest city of France, on the river Seine.",
    "Certainly! France's capital is Paris, which has been its political centre for centuries.",
]


def estimate(text: str) -> int:
    return (len(text) + 3) // 4


def test_the_mocks_counts_are_below_four_characters_a_token():
    """Else the tests below could not tell the upstream's count from the estimate."""
    assert all(output_tokens(text) < estimate(text) for text in SHORT_ANSWERS)


async def openai_usage(gateway, stream: bool) -> tuple[int, int, str]:
    """(prompt_tokens, completion_tokens, text) of a chat completion, as the client is told."""
    async with gateway.client() as client:
        if not stream:
            reply = await client.chat.completions.create(model=MODEL, messages=HELLO)
            return reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.choices[0].message.content
        chunks = await client.chat.completions.create(
            model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        async for chunk in chunks:
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens, text


async def anthropic_usage(gateway, stream: bool) -> tuple[int, int, str]:
    """(all input, output_tokens, text) of a message on the native route, as the client is told."""
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        if stream:
            async with claude.messages.stream(model=MODEL, max_tokens=4096, messages=HELLO) as events:
                message = await events.get_final_message()
        else:
            message = await claude.messages.create(model=MODEL, max_tokens=4096, messages=HELLO)
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    return prompt, usage.output_tokens, message.content[0].text


ROUTES = {"chat": openai_usage, "messages": anthropic_usage}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("answer", SHORT_ANSWERS, ids=["7", "16", "19"])
async def test_usage_is_the_upstreams_count_and_the_ledger_says_the_same(gateway, upstream, route, stream, answer):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], usage={"input_tokens": 14}))
    prompt, completion, text = await ROUTES[route](gateway, stream)

    assert text == answer
    assert (prompt, completion) == (14, output_tokens(answer))  # the mock's numbers, not len // 4
    [row] = await gateway.app[STORE].ledger()
    assert (row.input_tokens + row.cache_read_tokens + row.cache_write_tokens, row.output_tokens) == (
        prompt,
        completion,
    )


LONG = "Every word of this answer counts as text the model produced. " * 66  # 4,026 characters


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_an_output_count_that_cannot_be_true_is_billed_by_estimate(gateway, upstream, route, stream, caplog):
    """1 output token for 4,000 characters: the estimate is billed, the client is told the same,
    and a warning names the deployment."""
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": LONG}], usage={"input_tokens": 14, "output_tokens": 1}))
    with caplog.at_level(logging.WARNING, logger="ezat.billing"):
        _, completion, text = await ROUTES[route](gateway, stream)

    assert text == LONG
    billed = estimate(LONG)
    if route == "messages" and stream:  # counted by the relayed deltas' size, not parsed
        assert billed - 2 <= completion <= billed + 2
    else:
        assert completion == billed
    [row] = await gateway.app[STORE].ledger()
    assert row.output_tokens == completion
    [warning] = [r.getMessage() for r in caplog.records if r.name == "ezat.billing"]
    assert "deployment primary" in warning and "implausible" in warning


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_count_of_one_token_per_ten_characters_is_believed(gateway, upstream, route):
    """Long words, or a language of long tokens: a count at the bound is the upstream's word."""
    answer = "Incomprehensibilities notwithstanding, characteristically." * 2  # 118 characters
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], usage={"output_tokens": 12}))
    _, completion, _ = await ROUTES[route](gateway, True)
    assert completion == 12
    [row] = await gateway.app[STORE].ledger()
    assert row.output_tokens == 12


# --- The native route relays the upstream's bytes -------------------------------------------------


class Replay:
    """An upstream on loopback that answers every request with the same bytes, in one write (a
    burst, as a fast upstream sends them), and keeps what it was sent."""

    def __init__(self, body: bytes, content_type: str = "text/event-stream") -> None:
        self.body, self.content_type, self.requests = body, content_type, []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        response = web.StreamResponse(headers={"content-type": self.content_type})
        await response.prepare(request)
        await response.write(self.body)
        await response.write_eof()
        return response

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/v1/messages", self.handle)
        return await served(app)


async def post(url: str, body: dict, headers: list[tuple[str, str]] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url + "/v1/messages",
            json=body,
            headers=headers or [("x-api-key", KEY), ("anthropic-version", "2023-06-01")],
        ) as response:
            return response.status, await response.read()


def events(stream: bytes) -> list[bytes]:
    return stream.split(b"\n\n")


def named_as_asked(upstream_event: bytes, upstream_model: str) -> bytes:
    """A message_start as the client should get it: the upstream's bytes, `model` as asked."""
    return upstream_event.replace(json.dumps(upstream_model).encode(), json.dumps(MODEL).encode(), 1)


ANSWERS = {
    "text-burst": [{"type": "text", "text": 'A burst of small deltas, "quoted", with \\ and é and 😀 too. ' * 3}],
    "tool-call": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
    ],
    "thinking": [
        {
            "type": "thinking",
            "thinking": "The user asks about Paris; I should answer briefly.",
            "signature": "EqQBCkYIBRgCKkA" + "x" * 300,
        },
        {"type": "text", "text": "Paris."},
    ],
}


STREAM_BODY = {"model": UPSTREAM_MODEL, "max_tokens": 1024, "stream": True, "messages": HELLO}


async def recorded_stream(scenario: Scenario) -> bytes:
    """The bytes the mock upstream streams for `scenario`, as a real upstream sends them."""
    mock = MockUpstream(api_key=UPSTREAM_KEY)
    await mock.start()
    try:
        mock.enqueue(scenario)
        status, sent = await post(
            mock.url, STREAM_BODY, [("x-api-key", UPSTREAM_KEY), ("anthropic-version", "2023-06-01")]
        )
    finally:
        await mock.close()
    assert status == 200
    return sent


async def relayed(start_gateway, sent: bytes):
    """What a client of the native route gets, and the ledger's row, from an upstream sending `sent`."""
    replay = Replay(sent)
    runner, url = await replay.start()
    try:
        gateway = await start_gateway(make_config(url))
        status, got = await post(gateway.url, {**STREAM_BODY, "model": MODEL})
        [row] = await gateway.app[STORE].ledger()
    finally:
        await runner.cleanup()
    assert status == 200
    return got, row


def assert_the_upstreams_bytes_and_count(sent: bytes, got: bytes, row) -> None:
    """The client got the upstream's events as sent (only the model's name changed), and the
    ledger billed the upstream's output count (its message_delta, third from the end)."""
    expected = events(sent)
    expected[0] = named_as_asked(expected[0], UPSTREAM_MODEL)
    assert events(got) == expected
    usage = json.loads(expected[-3].split(b"data: ", 1)[1])["usage"]
    assert row.output_tokens == usage["output_tokens"]


@pytest.mark.parametrize("answer", list(ANSWERS))
async def test_a_native_stream_is_the_upstreams_bytes_event_by_event(start_gateway, answer):
    sent = await recorded_stream(Scenario(blocks=ANSWERS[answer], chunk_size=3, pings=1))
    got, row = await relayed(start_gateway, sent)

    assert_the_upstreams_bytes_and_count(sent, got, row)
    assert got.count(b"event: content_block_delta") > 10  # deltas, none joined


def with_ids(stream: bytes) -> bytes:
    """Each event led by an `id:` line, which SSE allows before its event line."""
    parts = stream.split(b"\n\n")[:-1]
    return b"".join(b"id: %d\n%s\n\n" % (n, part) for n, part in enumerate(parts))


def without_event_lines(stream: bytes) -> bytes:
    """Each event as its data line alone, the type only in its JSON."""
    return b"".join(line + b"\n\n" for line in stream.split(b"\n") if line.startswith(b"data:"))


@pytest.mark.parametrize("rewrite", [with_ids, without_event_lines])
async def test_a_stream_whose_events_do_not_start_with_their_name_is_relayed_and_billed(start_gateway, rewrite):
    sent = rewrite(await recorded_stream(Scenario(blocks=ANSWERS["text-burst"], chunk_size=3)))
    got, row = await relayed(start_gateway, sent)

    assert_the_upstreams_bytes_and_count(sent, got, row)


def written_as_another_would(event: dict) -> bytes:
    """An SSE event with its JSON spaced and its keys in the reverse order."""

    def reorder(value):
        if isinstance(value, dict):
            return {k: reorder(v) for k, v in reversed(value.items())}
        return [reorder(v) for v in value] if isinstance(value, list) else value

    return (
        f"event: {event['type']}\n" + "data: " + json.dumps(reorder(event), separators=(", ", " : ")) + "\n\n"
    ).encode()


async def test_json_spaced_and_reordered_by_the_upstream_reaches_the_client_as_written(start_gateway):
    answer = [{"type": "text", "text": "Spaced out, but whole: caf\u00e9."}]
    scripted = MockUpstream._events(
        {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": UPSTREAM_MODEL,
            "content": answer,
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "stop_details": None,
            "usage": {"input_tokens": 9, "output_tokens": 9},
        },
        Scenario(chunk_size=5),
    )
    sent = b"".join(map(written_as_another_would, scripted))
    replay = Replay(sent)
    runner, url = await replay.start()
    try:
        gateway = await start_gateway(make_config(url))
        status, got = await post(gateway.url, {"model": MODEL, "max_tokens": 64, "stream": True, "messages": HELLO})
        async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
            async with claude.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
                message = await stream.get_final_message()
    finally:
        await runner.cleanup()

    assert status == 200
    assert b'"model" : "claude-sonnet-5-5"' in sent
    assert got == sent.replace(b'"model" : "claude-sonnet-5-5"', b'"model" : "%s"' % MODEL.encode())
    assert (message.content[0].text, message.model, message.usage.output_tokens) == (answer[0]["text"], MODEL, 9)


async def test_a_native_message_keeps_every_field_in_its_order(start_gateway):
    reply = {
        "type": "message",
        "id": "msg_01",
        "future_field": {"b": 1, "a": [2, 1]},
        "role": "assistant",
        "content": [{"type": "text", "text": "Paris.", "citations": None}],
        "model": UPSTREAM_MODEL,
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"output_tokens": 2, "input_tokens": 9, "server_tool_use": {"web_search_requests": 0}},
    }
    replay = Replay(json.dumps(reply).encode(), "application/json")
    runner, url = await replay.start()
    try:
        gateway = await start_gateway(make_config(url))
        status, got = await post(gateway.url, {"model": MODEL, "max_tokens": 64, "messages": HELLO})
    finally:
        await runner.cleanup()
    assert status == 200
    assert list(json.loads(got).items()) == list({**reply, "model": MODEL}.items())


async def test_anthropic_beta_lines_go_upstream_byte_for_byte(gateway, upstream):
    lines = [
        ("anthropic-beta", "interleaved-thinking-2025-05-14,effort-2025-11-24"),
        ("anthropic-beta", "context-management-2025-06-27"),
    ]
    status, _ = await post(
        gateway.url,
        {"model": MODEL, "max_tokens": 5, "messages": HELLO},
        [("x-api-key", KEY), ("anthropic-version", "2023-06-01"), *lines],
    )
    assert status == 200
    [sent] = upstream.requests
    assert [line for line in sent.header_lines if line[0] == "anthropic-beta"] == lines
    assert [line for line in sent.header_lines if line[0] == "anthropic-version"] == [
        ("anthropic-version", "2023-06-01")
    ]
