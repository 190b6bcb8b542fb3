"""Anthropic's Messages API through the gateway (`POST /v1/messages`, `count_tokens`, the models),
with the official `anthropic` SDK as the client: the same keys, limits, caching, routing and
ledger as the OpenAI route, the body sent upstream as the client wrote it (model mapped), and
errors in Anthropic's envelope. Each test checks what the mock upstream received."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
from decimal import Decimal

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aioresponses import aioresponses

from gateway.app import STORE
from gateway.config import BoundsConfig, ConfigError, Deployment, ImagesConfig, KeyConfig, Pricing, parse_config
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, make_config, served
from tests.test_billing import key_id, storage_url, write_lock  # noqa: F401 (fixtures)
from tests.test_images import PNG, fake_get

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
async def client_of():
    """Makes `anthropic` SDK clients of a gateway (under `prefix`), closed after the test."""
    made: list[anthropic.AsyncAnthropic] = []

    def make(gateway, prefix: str = "", **kwargs) -> anthropic.AsyncAnthropic:
        kwargs.setdefault("api_key", KEY)
        made.append(anthropic.AsyncAnthropic(base_url=gateway.url + prefix, max_retries=0, **kwargs))
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.fixture
def claude(gateway, client_of) -> anthropic.AsyncAnthropic:
    return client_of(gateway)


def with_key(config, **fields):
    """`config` with the test key's settings replaced by `fields`."""
    key = KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), **fields)
    return dataclasses.replace(config, keys=(key,))


# --- Replies, as the upstream sent them ---------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/anthropic"])
async def test_a_message_goes_upstream_as_sent_with_the_model_mapped(start_gateway, upstream, prefix, client_of):
    gateway = await start_gateway()
    upstream.enqueue(Scenario(usage={"input_tokens": 26, "output_tokens": 20}))
    body = {
        "max_tokens": 64_000,  # the model's maximum
        "messages": HELLO,
        "metadata": {"user_id": "user-7"},
        "tool_choice": {"type": "auto"},
        "tools": [{"name": "get_time", "description": "The time.", "input_schema": {"type": "object"}}],
        "service_tier": "auto",
    }
    newer = {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}  # newer than this SDK
    raw = await client_of(gateway, prefix).messages.with_raw_response.create(  # (a timeout: the SDK
        model=MODEL, extra_headers={"x-ezat-cache": "off"}, extra_body=newer, timeout=30, **body
    )  # wants 64k streamed)
    message = await raw.parse()
    assert message.model == MODEL
    assert message.content[0].text == "Hello from the mock upstream. You said: Hello"
    assert raw.headers["x-ezat-model"] == MODEL
    [sent] = upstream.requests
    assert sent.path == "/v1/messages"
    assert sent.body == {"model": UPSTREAM_MODEL, **body, **newer}  # every other field as the client sent it
    assert sent.headers["anthropic-version"] == raw.http_request.headers["anthropic-version"]
    assert sent.headers["x-api-key"] == UPSTREAM_KEY  # the deployment's key, never the client's
    [row] = await gateway.app[STORE].ledger()
    assert (row.request_id, row.model, row.outcome) == (raw.headers["request-id"], MODEL, "complete")
    assert (row.input_tokens, row.output_tokens) == (message.usage.input_tokens, message.usage.output_tokens)


async def test_a_burst_of_text_deltas_reaches_an_anthropic_client_exactly(gateway, upstream, claude):
    # The deltas of one read are relayed as the upstream sent them: text whose escapes and raw
    # look could confuse a reader, in 3-character deltas, then a tool call.
    from tests.test_streaming import AWKWARD

    upstream.enqueue(
        Scenario(
            blocks=[
                {"type": "text", "text": AWKWARD},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
            chunk_size=3,
        )
    )
    async with claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == AWKWARD
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris"})


async def test_a_stream_comes_back_event_by_event_and_is_billed(gateway, upstream, claude):
    upstream.enqueue(Scenario(usage={"input_tokens": 12, "output_tokens": 20}, event_delay=0.01))
    async with claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello from the mock upstream. You said: Hello" and len(texts) > 1
    assert final.model == MODEL
    assert (final.usage.input_tokens, final.usage.output_tokens, final.stop_reason) == (12, 20, "end_turn")
    assert upstream.requests[0].body["stream"] is True
    [row] = await gateway.app[STORE].ledger()
    assert (row.input_tokens, row.output_tokens, row.outcome) == (12, 20, "complete")
    assert row.cost_usd == (12 * Decimal(3) + 20 * Decimal(15)) / 1_000_000


async def test_the_raw_stream_is_anthropics_framing(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Hi."}]))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": MODEL, "max_tokens": 10, "stream": True, "messages": HELLO},
        ) as response:
            text = (await response.read()).decode()
    assert response.headers["Content-Type"] == "text/event-stream"
    names = [event.split("\n")[0] for event in text.split("\n\n") if event]
    assert names == [
        "event: message_start",
        "event: content_block_start",
        "event: ping",
        "event: content_block_delta",
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]


async def test_message_stop_is_sent_only_after_the_row_is_committed(start_gateway, upstream, storage_url, write_lock):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    lock = await write_lock(storage_url, await key_id(store))
    # Paced, so message_delta arrives (and is sent on) while message_stop's row waits.
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "text", "text": "Almost done."}],
            usage={"input_tokens": 7, "output_tokens": 3},
            event_delay=0.1,
            pings=0,
        )
    )
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": MODEL, "max_tokens": 10, "stream": True, "messages": HELLO},
        ) as response:
            received = b""
            async with asyncio.timeout(5):
                while b"event: message_delta" not in received:
                    received += await response.content.readany()
            more = asyncio.create_task(response.content.readany())
            done, _ = await asyncio.wait({more}, timeout=0.5)
            assert not done, f"bytes arrived while the row could not be committed: {more.result()!r}"
            assert b"message_stop" not in received and await lock.committed_rows() == 0
            await lock.release()
            async with asyncio.timeout(15):
                received += await more + await response.content.read()
            rows_at_stop = await store.ledger()
    assert received.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    [row] = rows_at_stop
    assert (row.request_id, row.input_tokens, row.output_tokens) == (response.headers["request-id"], 7, 3)


async def test_a_long_pause_gets_anthropics_ping_event(start_gateway, upstream):
    gateway = await start_gateway(ping_interval=0.2)
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Slow."}], chunk_size=2, event_delay=0.5, pings=0))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": MODEL, "max_tokens": 10, "stream": True, "messages": HELLO},
        ) as response:
            text = (await response.read()).decode()
    assert 'event: ping\ndata: {"type":"ping"}\n\n' in text  # the gateway's own: the upstream sent none
    assert text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize("by", ["session", "system"])
async def test_a_conversation_sticks_to_one_deployment(start_gateway, upstream, second, client_of, by):
    # By its x-ezat-session header, else (as Claude Code sends none) by its system prompt, whether
    # or not a turn marks it for caching.
    claude = client_of(await start_gateway(two_deployments(upstream.url, second.url)))
    sessions = [f"conversation {n}" for n in range(8)]
    for turn in range(3):
        for session in sessions:  # each one's text says which it is
            if by == "session":
                how = {"extra_headers": {"x-ezat-session": session}}
            else:
                marked = {"cache_control": {"type": "ephemeral"}} if turn == 1 else {}
                how = {"system": [{"type": "text", "text": f"You help with {session}.", **marked}]}
            await claude.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": session}], **how
            )
    got = [[r.body["messages"][0]["content"] for r in mock.requests] for mock in (upstream, second)]
    assert sorted(got[0] + got[1]) == sorted(sessions * 3)
    assert not set(got[0]) & set(got[1])  # no conversation on both
    assert got[0] and got[1]  # and the conversations spread over both


async def test_a_tool_use_round_trip(gateway, upstream, claude):
    call = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}
    upstream.enqueue(Scenario(blocks=[call]))
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}]
    first = await claude.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=HELLO)
    assert first.stop_reason == "tool_use" and first.content[0].input == {"city": "Paris"}
    turns = [
        *HELLO,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "Sunny"}]},
    ]
    second = await claude.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=turns)
    assert second.stop_reason == "end_turn"
    assert upstream.requests[1].body["messages"][2]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": "Sunny",
    }


async def test_thinking_with_the_interleaved_thinking_beta(gateway, upstream, claude):
    thinking = {"type": "thinking", "thinking": "Let me think.", "signature": "sig-1"}
    upstream.enqueue(Scenario(blocks=[thinking, {"type": "text", "text": "Done."}], usage={"thinking_tokens": 4}))
    async with claude.beta.messages.stream(
        model=MODEL,
        max_tokens=4096,
        thinking={"type": "enabled", "budget_tokens": 2048},
        messages=HELLO,
        betas=["interleaved-thinking-2025-05-14"],
        extra_query={"beta": "true"},  # as Claude Code asks
    ) as stream:
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[0].signature) == ("Let me think.", "sig-1")
    [sent] = upstream.requests
    assert sent.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert sent.query == {"beta": "true"}
    assert sent.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    [row] = await gateway.app[STORE].ledger()
    assert row.reasoning_tokens == 4


async def test_an_alias_resolves_and_the_reply_names_it(start_gateway, upstream, client_of):
    config = make_config(upstream.url)
    model = dataclasses.replace(config.models[0], aliases=(UPSTREAM_MODEL,))
    gateway = await start_gateway(dataclasses.replace(config, models=(model, *config.models[1:])))
    message = await client_of(gateway).messages.create(model=UPSTREAM_MODEL, max_tokens=10, messages=HELLO)
    assert message.model == UPSTREAM_MODEL  # the name the client sent
    assert upstream.requests[0].body["model"] == UPSTREAM_MODEL
    [row] = await gateway.app[STORE].ledger()
    assert row.model == MODEL  # the ledger names the model by its id


# --- Failover, unseen ---------------------------------------------------------------------------


def two_deployments(upstream_url: str, second_url: str):
    config = make_config(upstream_url)
    second = Deployment(name="second", base_url=second_url, api_key=UPSTREAM_KEY)
    model = dataclasses.replace(config.models[0], deployments=("primary", "second"))
    return dataclasses.replace(config, deployments=(*config.deployments, second), models=(model, *config.models[1:]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "failure",
    [
        Scenario(status=529, error_message="Overloaded"),
        Scenario(status=500),
        Scenario(status=429, headers={"retry-after": "3"}),
    ],
    ids=["529", "500", "429"],
)
async def test_a_failing_deployment_is_passed_over_unseen(start_gateway, upstream, second, failure, stream, client_of):
    gateway = await start_gateway(two_deployments(upstream.url, second.url))
    upstream.enqueue(failure)
    claude = client_of(gateway)
    if stream:
        async with claude.messages.stream(model=MODEL, max_tokens=10, messages=HELLO) as events:
            message = await events.get_final_message()
    else:
        message = await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert message.content[0].text == "Hello from the mock upstream. You said: Hello"  # the failed one's none of it
    assert (len(upstream.requests), len(second.requests)) == (1, 1)
    [row] = await gateway.app[STORE].ledger()
    assert row.deployment == "second"


async def test_a_stream_without_a_first_token_in_time_is_passed_over_unseen(start_gateway, upstream, second, client_of):
    config = two_deployments(upstream.url, second.url)
    primary = dataclasses.replace(config.deployments[0], first_token_timeout_seconds=0.3)
    upstream.enqueue(Scenario(event_delay=2))  # its status line, then nothing in time
    gateway = await start_gateway(dataclasses.replace(config, deployments=(primary, config.deployments[1])))
    async with client_of(gateway).messages.stream(model=MODEL, max_tokens=10, messages=HELLO) as events:
        message = await events.get_final_message()
    assert message.content[0].text == "Hello from the mock upstream. You said: Hello"  # none of the slow one's
    assert (len(upstream.requests), len(second.requests)) == (1, 1)
    await upstream.wait_disconnect(timeout=2)  # the slow attempt was given up upstream too
    [row] = await gateway.app[STORE].ledger()
    assert row.deployment == "second"


# --- Errors in Anthropic's envelope -------------------------------------------------------------


async def post_raw(gateway, body: dict | bytes, headers: dict | None = None, path: str = "/v1/messages"):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + path,
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})},
            **({"data": body} if isinstance(body, bytes) else {"json": body}),
        ) as response:
            return response, await response.json()


def envelope(answer: dict, kind: str, message: str, response) -> None:
    assert answer == {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": response.headers["request-id"],
    }


@pytest.mark.parametrize(
    "status, kind, message",
    [
        (400, "invalid_request_error", "messages.0.content: text content blocks must be non-empty"),
        (404, "not_found_error", "model: claude-nope"),
        (413, "request_too_large", "Request exceeds the maximum allowed number of bytes."),
        (500, "api_error", "Internal server error"),
        (529, "overloaded_error", "Overloaded"),
    ],
)
async def test_an_upstream_error_reaches_the_client_unchanged(gateway, upstream, claude, status, kind, message):
    upstream.enqueue(*[Scenario(status=status, error_message=message)] * 4)  # retried ones fail on each try
    with pytest.raises(anthropic.APIStatusError) as caught:
        await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    error = caught.value
    assert (error.status_code, error.body["error"]) == (status, {"type": kind, "message": message})
    assert error.body["request_id"] == error.response.headers["request-id"]
    if status == 529:
        assert isinstance(error, anthropic.OverloadedError) and int(error.response.headers["retry-after"]) >= 1
    assert await gateway.app[STORE].ledger() == []  # failures are not billed


async def test_no_deployment_left_to_try_is_anthropics_overloaded_529(gateway, upstream, claude):
    # The gateway's own overload, in the status and type Anthropic's clients know and retry.
    upstream.enqueue(Scenario(status=429, headers={"retry-after": "30"}, error_message="Slow down"))
    with pytest.raises(anthropic.RateLimitError):
        await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    with pytest.raises(anthropic.OverloadedError) as caught:  # the one deployment cools down for 30 s
        await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    error = caught.value
    assert (error.status_code, error.body["error"]) == (
        529,
        {"type": "overloaded_error", "message": "No deployment of this model is available right now."},
    )
    assert int(error.response.headers["retry-after"]) >= 1 and len(upstream.requests) == 1


async def test_an_upstream_refusing_the_gateways_key_is_a_500_not_the_clients_401(gateway, upstream, claude):
    # Claude Code would otherwise tell its user that their own key is wrong.
    refused = {"type": "api_error", "message": "The upstream rejected the gateway's credentials."}
    upstream.enqueue(Scenario(status=401, error_message="invalid x-api-key"))
    with pytest.raises(anthropic.InternalServerError) as caught:
        await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert (caught.value.status_code, caught.value.body["error"]) == (500, refused)
    upstream.count_tokens_status = 401
    with pytest.raises(anthropic.InternalServerError) as caught:
        await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    assert (caught.value.status_code, caught.value.body["error"]) == (500, refused)


async def test_the_gateways_own_errors(start_gateway, upstream):
    config = make_config(upstream.url)
    gateway = await start_gateway(with_key(config, models=("test/*",), rpm=1))
    response, answer = await post_raw(
        gateway, {"model": MODEL, "max_tokens": 5, "messages": HELLO}, {"x-api-key": "sk-wrong"}
    )
    assert response.status == 401
    envelope(answer, "authentication_error", "Incorrect API key provided.", response)
    response, answer = await post_raw(gateway, {"model": MODEL, "max_tokens": 5, "messages": HELLO})
    assert response.status == 403
    envelope(answer, "permission_error", f"This key may not use the model `{MODEL}`.", response)
    response, answer = await post_raw(gateway, {"model": "test/none", "max_tokens": 5, "messages": HELLO})
    assert response.status == 404
    envelope(
        answer, "not_found_error", "The model `test/none` does not exist or you do not have access to it.", response
    )
    response, answer = await post_raw(gateway, {"model": "test/small", "max_tokens": 5, "messages": HELLO})
    assert response.status == 200  # the refusals above took nothing from the rate
    response, answer = await post_raw(gateway, {"model": "test/small", "max_tokens": 5, "messages": HELLO})
    assert response.status == 429 and response.headers["retry-after"]
    assert answer["error"]["type"] == "rate_limit_error"
    response, answer = await post_raw(gateway, b"{not json", {"Content-Type": "application/json"})
    assert response.status == 400 and answer["error"]["type"] == "invalid_request_error"
    response, answer = await post_raw(gateway, {"max_tokens": 5, "messages": HELLO}, path="/anthropic/v1/nothing")
    assert response.status == 404 and answer["error"]["type"] == "not_found_error"
    assert len(upstream.requests) == 1


async def test_a_spend_limit_is_a_billing_error(start_gateway, upstream, client_of):
    gateway = await start_gateway(with_key(make_config(upstream.url), spend_limit_usd=Decimal("0.0001")))
    with pytest.raises(anthropic.APIStatusError) as caught:
        await client_of(gateway).messages.create(model=MODEL, max_tokens=1000, messages=HELLO)
    assert caught.value.status_code == 402
    assert caught.value.body["error"]["type"] == "billing_error"
    assert upstream.requests == []


@pytest.mark.parametrize("max_tokens", [64_001, 100_000, 999_999])
async def test_max_tokens_above_the_models_configured_maximum_is_its_400_not_a_402(
    start_gateway, upstream, client_of, max_tokens
):
    """The config's max_output_tokens is the output limit here as on the OpenAI routes, with the
    same message; it is refused as such, not first held against a spend limit it may not fit
    ($1.50 left covers the model's 64,000 output tokens at $15 a million, not 128,000). At the
    limit, the mock upstream answers: it is never the one to refuse."""
    gateway = await start_gateway(with_key(make_config(upstream.url), spend_limit_usd=Decimal("1.50")))
    claude = client_of(gateway)
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(model=MODEL, max_tokens=max_tokens, messages=HELLO, timeout=30)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: at most 64000 for this model"},
        "request_id": caught.value.response.headers["request-id"],
    }
    assert upstream.requests == []
    message = await claude.messages.create(model=MODEL, max_tokens=64_000, messages=HELLO, timeout=30)
    assert message.content[0].text == "Hello from the mock upstream. You said: Hello"
    assert upstream.requests[0].body["max_tokens"] == 64_000


async def test_a_body_over_32_mb_is_request_too_large(gateway, upstream):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages", data=b"x" * (32 * 1024 * 1024 + 1), headers={"x-api-key": KEY}
        ) as response:
            answer = await response.json()
    assert response.status == 413 and answer["error"]["type"] == "request_too_large"


async def test_a_stream_that_fails_midway_ends_with_an_error_event_unbilled(gateway, upstream, claude):
    upstream.enqueue(Scenario(error_after=4, stream_error_message="Overloaded"))
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with claude.messages.stream(model=MODEL, max_tokens=10, messages=HELLO) as stream:
            async for _ in stream:
                pass
    assert caught.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert await gateway.app[STORE].ledger() == []


async def test_a_client_that_leaves_is_billed_for_what_was_produced(gateway, upstream, claude):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "word " * 400}], chunk_size=4, event_delay=0.01))
    async with claude.messages.stream(model=MODEL, max_tokens=1000, messages=HELLO) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                break
    await upstream.wait_disconnect()
    store = gateway.app[STORE]
    async with asyncio.timeout(5):
        while not (rows := await store.ledger()):
            await asyncio.sleep(0.02)
    [row] = rows
    assert row.outcome == "client_closed" and 0 < row.output_tokens < 500


# --- count_tokens -------------------------------------------------------------------------------


async def test_count_tokens_is_the_deployments_own_count_and_never_billed(gateway, upstream, claude):
    counted = await claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=HELLO)
    [sent] = upstream.requests
    assert sent.path == "/v1/messages/count_tokens"
    assert sent.body == {"model": UPSTREAM_MODEL, "system": "Be brief.", "messages": HELLO}
    message = await claude.messages.create(model=MODEL, max_tokens=10, system="Be brief.", messages=HELLO)
    usage = message.usage
    assert (
        counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    )
    assert len(await gateway.app[STORE].ledger()) == 1  # the message's row only


async def test_count_tokens_counts_against_rpm_and_passes_upstream_errors(start_gateway, upstream, client_of):
    gateway = await start_gateway(with_key(make_config(upstream.url), rpm=1))
    claude = client_of(gateway)
    upstream.count_tokens_status = 400
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    assert caught.value.body["error"] == {"type": "invalid_request_error", "message": "mock error"}  # the upstream's
    with pytest.raises(anthropic.RateLimitError) as caught:
        await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert len(upstream.requests) == 1


async def test_count_tokens_past_the_deadline_is_a_504(start_gateway, client_of):
    """An upstream that never answers a count holds it no longer than a non-streaming request."""
    answer = asyncio.Event()

    async def never(request):
        await answer.wait()

    app = web.Application()
    app.router.add_post("/v1/messages/count_tokens", never)
    runner, url = await served(app)
    try:
        gateway = await start_gateway(make_config(url), non_streaming_deadline=0.5)
        with pytest.raises(anthropic.APIStatusError) as caught:
            await client_of(gateway).messages.count_tokens(model=MODEL, messages=HELLO, timeout=10)
    finally:
        answer.set()
        await runner.cleanup()
    assert caught.value.status_code == 504
    assert caught.value.body["error"]["message"] == "The request took longer than 0.5 seconds."


# --- Models ------------------------------------------------------------------------------------


async def test_models_in_anthropics_shape_and_openais(start_gateway, upstream, client_of):
    gateway = await start_gateway(with_key(make_config(upstream.url), models=("anthropic/*",)))
    claude = client_of(gateway)
    page = await claude.models.list()
    assert [m.id for m in page.data] == [MODEL]  # only the models the key may use
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL, MODEL)
    model = await claude.models.retrieve(MODEL)  # sent as anthropic%2Fclaude-sonnet-5-5
    assert (model.type, model.id, model.display_name) == ("model", MODEL, MODEL)
    with pytest.raises(anthropic.NotFoundError):
        await claude.models.retrieve("test/small")
    openai_client = gateway.client()
    listed = await openai_client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    retrieved = await openai_client.models.retrieve(MODEL)
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (MODEL, "model", "anthropic")
    with pytest.raises(openai.NotFoundError):
        await openai_client.models.retrieve("test/small")


async def test_the_anthropic_model_list_pages(gateway):
    async with aiohttp.ClientSession() as http:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        async with http.get(gateway.url + "/v1/models?limit=1", headers=headers) as response:
            first = await response.json()
        async with http.get(gateway.url + f"/v1/models?limit=1&after_id={MODEL}", headers=headers) as response:
            second = await response.json()
        async with http.get(gateway.url + "/v1/models?limit=0", headers=headers) as response:
            refused = await response.json()
    assert ([m["id"] for m in first["data"]], first["has_more"]) == ([MODEL], True)
    assert ([m["id"] for m in second["data"]], second["has_more"]) == (["test/small"], False)
    assert (response.status, refused["error"]["type"]) == (400, "invalid_request_error")


# --- Caching, images and the 1-hour cache --------------------------------------------------------


async def test_automatic_breakpoints_when_the_request_has_none(gateway, upstream, claude):
    system = "You are a careful assistant. " * 60  # over 1,024 tokens' worth of bytes
    await claude.messages.create(model=MODEL, max_tokens=10, system=system, messages=HELLO)
    sent = upstream.requests[0].body
    assert sent["system"] == [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}
    ]


async def test_a_request_with_its_own_breakpoints_keeps_them(gateway, upstream, claude):
    system = [
        {
            "type": "text",
            "text": "You are a careful assistant. " * 60,
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]
    await claude.messages.create(model=MODEL, max_tokens=10, system=system, messages=HELLO)
    sent = upstream.requests[0].body
    assert (sent["system"], sent["messages"]) == (system, HELLO)


async def test_without_a_system_prompt_the_last_tool_takes_the_prefix_breakpoint(gateway, upstream, claude):
    tools = [
        {"name": f"tool_{n}", "description": "A tool. " * 40, "input_schema": {"type": "object"}} for n in range(2)
    ]
    await claude.messages.create(model=MODEL, max_tokens=10, tools=tools, messages=HELLO)
    sent = upstream.requests[0].body
    assert [tool.get("cache_control") for tool in sent["tools"]] == [None, {"type": "ephemeral"}]
    assert sent["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral"}


async def test_a_mark_inside_a_tool_result_or_at_the_top_counts_as_the_clients_own(gateway, upstream, claude):
    system = "You are a careful assistant. " * 60
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "Sunny.", "cache_control": {"type": "ephemeral"}}],
    }
    turns = [
        *HELLO,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
        {"role": "user", "content": [result]},
    ]
    await claude.messages.create(model=MODEL, max_tokens=10, system=system, messages=turns)
    await claude.messages.create(
        model=MODEL, max_tokens=10, system=system, messages=HELLO, extra_body={"cache_control": {"type": "ephemeral"}}
    )
    assert [r.body["system"] for r in upstream.requests] == [system, system]  # no breakpoint added to either
    assert upstream.requests[0].body["messages"] == turns


async def test_the_1_hour_cache_is_priced_apart(gateway, upstream, claude):
    usage = {
        "input_tokens": 10,
        "ephemeral_5m_input_tokens": 1000,
        "ephemeral_1h_input_tokens": 2000,
        "output_tokens": 20,
    }
    upstream.enqueue(Scenario(usage=usage), Scenario(usage=usage))
    message = await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert message.usage.cache_creation.ephemeral_1h_input_tokens == 2000
    completion = await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    assert completion.usage.model_dump()["prompt_tokens_details"]["cache_write_tokens"] == 3000  # both kinds
    rows = await gateway.app[STORE].ledger()
    # input 3, 5-minute write 3.75, 1-hour write 6 (twice input), output 15 USD per million
    cost = (10 * Decimal(3) + 1000 * Decimal("3.75") + 2000 * Decimal(6) + 20 * Decimal(15)) / 1_000_000
    assert [(r.cache_write_tokens, r.cache_write_1h_tokens, r.cost_usd) for r in rows] == [(3000, 2000, cost)] * 2


async def test_image_and_document_urls_are_sent_inline(start_gateway, upstream, client_of):
    config = dataclasses.replace(make_config(upstream.url), images=ImagesConfig(allow_private_hosts=True))
    gateway = await start_gateway(config)
    pdf = b"%PDF-1.4\n%fake but well begun\n"
    content = [
        {"type": "image", "source": {"type": "url", "url": "https://images.example.com/cat.png"}},
        {"type": "document", "source": {"type": "url", "url": "https://docs.example.com/paper.pdf"}},
        {"type": "text", "text": "Describe both."},
    ]
    with aioresponses(passthrough=["http://127.0.0.1"]) as outside:
        fake_get(outside, "https://images.example.com/cat.png", body=PNG)
        fake_get(outside, "https://docs.example.com/paper.pdf", body=pdf)
        await client_of(gateway).messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": content}]
        )
        fake_get(outside, "https://images.example.com/gone.png", status=404)
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client_of(gateway).messages.create(
                model=MODEL,
                max_tokens=10,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://images.example.com/gone.png"}}
                        ],
                    }
                ],
            )
    sent = upstream.requests[0].body["messages"][0]["content"]
    assert sent[0]["source"] == {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    assert sent[1]["source"]["media_type"] == "application/pdf"
    assert caught.value.body["error"]["message"] == (
        "messages[0].content[0].source.url: could not download the image (HTTP 404)"
    )
    assert len(upstream.requests) == 1


async def test_a_configured_1_hour_cache_price(start_gateway, upstream, client_of):
    """A configured cache_write_1h replaces the default (twice input)."""
    config = make_config(upstream.url)
    model = dataclasses.replace(
        config.models[0], pricing=Pricing(Decimal(3), Decimal(15), Decimal("3.75"), Decimal("0.30"), Decimal(5))
    )
    gateway = await start_gateway(dataclasses.replace(config, models=(model, *config.models[1:])))
    upstream.enqueue(
        Scenario(
            usage={
                "input_tokens": 1,
                "ephemeral_5m_input_tokens": 0,
                "ephemeral_1h_input_tokens": 1000,
                "output_tokens": 20,
            }
        )
    )
    await client_of(gateway).messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    [row] = await gateway.app[STORE].ledger()
    assert row.cost_usd == (3 + 1000 * 5 + 20 * 15) / Decimal(1_000_000)


def test_model_aliases_are_checked():
    text = """
[[deployments]]
name = "d"
base_url = "http://127.0.0.1:1"
[[models]]
id = "a/one"
aliases = ["one", "a/two"]
deployments = ["d"]
free = true
[[models]]
id = "a/two"
aliases = ["one"]
deployments = ["d"]
free = true
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert caught.value.problems == [
        'models[0].aliases[1]: "a/two" already names a model',
        'models[1].aliases[0]: "one" already names a model',
    ]


# --- Edges of the routes -----------------------------------------------------------------------


async def test_count_tokens_under_anthropic_takes_no_fallbacks_upstream_and_no_tokens(
    start_gateway, upstream, client_of
):
    # tpm 10: a message's estimate would use it all; counts are held to rpm alone.
    gateway = await start_gateway(with_key(make_config(upstream.url), tpm=10))
    claude = client_of(gateway, "/anthropic")
    for _ in range(3):
        counted = await claude.messages.count_tokens(model=MODEL, messages=HELLO, extra_body={"models": ["test/small"]})
        assert counted.input_tokens > 0
    assert [r.body for r in upstream.requests] == [{"model": UPSTREAM_MODEL, "messages": HELLO}] * 3


@pytest.mark.parametrize(
    "method, path, status, kind",
    [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("GET", "/anthropic/v1/messages", 405, "invalid_request_error"),
        ("POST", "/anthropic/v1/nothing", 404, "not_found_error"),
    ],
)
async def test_aiohttps_own_errors_in_anthropics_envelope(gateway, method, path, status, kind):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, gateway.url + path, headers={"x-api-key": KEY}) as response:
            answer = await response.json()
    assert (response.status, answer["type"], answer["error"]["type"]) == (status, "error", kind)


async def test_a_stream_field_that_is_no_boolean_is_refused(gateway, upstream):
    response, answer = await post_raw(gateway, {"model": MODEL, "max_tokens": 5, "messages": HELLO, "stream": "yes"})
    assert response.status == 400
    envelope(answer, "invalid_request_error", "stream: Input should be a valid boolean", response)
    assert upstream.requests == []


async def test_models_under_anthropic_paging_back_and_by_alias(start_gateway, upstream):
    config = make_config(upstream.url)
    model = dataclasses.replace(config.models[0], aliases=(UPSTREAM_MODEL,))
    gateway = await start_gateway(dataclasses.replace(config, models=(model, *config.models[1:])))
    async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as http:  # no anthropic-version
        async with http.get(gateway.url + "/anthropic/v1/models?limit=1&before_id=test/small") as response:
            page = await response.json()
        async with http.get(gateway.url + f"/anthropic/v1/models/{UPSTREAM_MODEL}") as response:
            one = await response.json()
    assert (page["data"][0]["id"], page["has_more"], page["first_id"]) == (MODEL, False, MODEL)
    assert (one["type"], one["id"]) == ("model", MODEL)  # an alias finds its model


async def test_private_hosts_and_files_that_are_no_pdf_are_refused(start_gateway, upstream, client_of):
    claude = client_of(await start_gateway())  # the default: public addresses only
    private = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/cat.png"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [private]}]}],
        )
    assert caught.value.body["error"]["message"] == (
        "messages[0].content[0].content[0].source.url: the host is not a public address"
    )
    config = dataclasses.replace(make_config(upstream.url), images=ImagesConfig(allow_private_hosts=True))
    claude = client_of(await start_gateway(config))
    with aioresponses(passthrough=["http://127.0.0.1"]) as outside:
        fake_get(outside, "https://docs.example.com/paper.pdf", body=PNG)
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(
                model=MODEL,
                max_tokens=10,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "url", "url": "https://docs.example.com/paper.pdf"}}
                        ],
                    }
                ],
            )
    assert caught.value.body["error"]["message"] == "messages[0].content[0].source.url: the file is not a PDF document"
    assert upstream.requests == []


async def test_an_unreachable_deployment_is_passed_over(start_gateway, upstream, client_of):
    config = two_deployments(upstream.url, upstream.url)
    closed = Deployment(name="primary", base_url="http://127.0.0.1:9", api_key=UPSTREAM_KEY, connect_timeout_seconds=2)
    claude = client_of(await start_gateway(dataclasses.replace(config, deployments=(closed, config.deployments[1]))))
    message = await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    assert message.content[0].text == "Hello from the mock upstream. You said: Hello" and len(upstream.requests) == 1


async def test_a_fallback_keeps_a_thinking_budget_below_its_own_limit(start_gateway, upstream, client_of):
    upstream.enqueue(Scenario(status=529, error_message="Overloaded"))  # the asked model's one deployment
    claude = client_of(await start_gateway())
    await claude.messages.create(
        model=MODEL,
        max_tokens=32_000,
        thinking={"type": "enabled", "budget_tokens": 16_000},
        messages=HELLO,
        extra_body={"models": ["test/small"]},
        timeout=30,
    )
    first, fallback = upstream.requests
    assert (first.body["max_tokens"], first.body["thinking"]["budget_tokens"]) == (32_000, 16_000)
    assert (fallback.body["model"], fallback.body["max_tokens"]) == ("small-1", 4096)  # test/small's most
    assert fallback.body["thinking"] == {"type": "enabled", "budget_tokens": 4095}
    assert "models" not in fallback.body


async def test_every_anthropic_beta_line_goes_upstream(gateway, upstream):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages",
            json={"model": MODEL, "max_tokens": 5, "messages": HELLO},
            headers=[
                ("x-api-key", KEY),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "interleaved-thinking-2025-05-14"),
                ("anthropic-beta", "effort-2025-11-24"),
            ],
        ) as response:
            assert response.status == 200
    assert upstream.requests[0].headers["anthropic-beta"] == "interleaved-thinking-2025-05-14, effort-2025-11-24"


async def test_count_tokens_forwards_the_betas_and_the_query(gateway, upstream, claude):
    await claude.beta.messages.count_tokens(
        model=MODEL, messages=HELLO, betas=["context-management-2025-06-27"], extra_query={"beta": "true"}
    )
    [sent] = upstream.requests
    assert sent.query == {"beta": "true"}
    assert "context-management-2025-06-27" in sent.headers["anthropic-beta"].split(",")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_count_tokens_and_messages_are_refused_a_bad_key_or_a_model_not_the_keys(start_gateway, upstream, path):
    gateway = await start_gateway(with_key(make_config(upstream.url), models=("test/*",)))
    body = {"model": MODEL, "messages": HELLO, **({"max_tokens": 5} if path == "/v1/messages" else {})}
    response, answer = await post_raw(gateway, body, {"x-api-key": "sk-wrong"}, path=path)
    assert response.status == 401
    envelope(answer, "authentication_error", "Incorrect API key provided.", response)
    response, answer = await post_raw(gateway, body, path=path)
    assert response.status == 403
    envelope(answer, "permission_error", f"This key may not use the model `{MODEL}`.", response)
    assert upstream.requests == []


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_the_bounds_hold_on_anthropics_routes(start_gateway, upstream, path):
    gateway = await start_gateway(dataclasses.replace(make_config(upstream.url), bounds=BoundsConfig(max_messages=2)))
    body = {"model": MODEL, "messages": HELLO * 3, **({"max_tokens": 5} if path == "/v1/messages" else {})}
    response, answer = await post_raw(gateway, body, path=path)
    assert response.status == 400
    envelope(answer, "invalid_request_error", "messages: at most 2 messages per request (this one has 3)", response)
    assert upstream.requests == []


async def test_x_ezat_cache_off_leaves_a_long_request_unmarked(gateway, upstream, claude):
    system = "You are a careful assistant. " * 60
    await claude.messages.create(
        model=MODEL, max_tokens=10, system=system, messages=HELLO, extra_headers={"x-ezat-cache": "off"}
    )
    sent = upstream.requests[0].body
    assert (sent["system"], sent["messages"]) == (system, HELLO)


async def test_a_silent_upstream_ends_the_stream_with_an_error_event_unbilled(start_gateway, upstream):
    config = make_config(upstream.url)
    deployments = tuple(dataclasses.replace(d, stream_idle_timeout_seconds=1.0) for d in config.deployments)
    gateway = await start_gateway(dataclasses.replace(config, deployments=deployments), ping_interval=0.2)
    upstream.enqueue(Scenario(stall_after=4))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/messages",
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            json={"model": MODEL, "max_tokens": 10, "stream": True, "messages": HELLO},
        ) as response:
            text = (await asyncio.wait_for(response.read(), 5)).decode()
    events = [event for event in text.split("\n\n") if event]
    assert events[-1] == (
        'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        '"message":"The upstream sent nothing for 1 seconds."}}'
    )
    assert "message_stop" not in text
    await upstream.wait_disconnect(1)
    assert await gateway.app[STORE].ledger() == []
