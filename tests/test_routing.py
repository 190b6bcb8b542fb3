"""Routing and resilience (issue 8) with several mock upstreams, each a deployment: failover
before the first token that the client never sees, no retry after it, bounded attempts,
cool-down and recovery, fallback `models`, connect and first-token timeouts, client
disconnects, and real `ezat-gateway serve` processes shutting down gracefully (one process, and
two workers sharing a port). Loopback only."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import select
import signal
import socket
import sqlite3
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.app import STORE
from gateway.config import Config, Deployment, KeyConfig, Model, Pricing, RoutingConfig
from gateway.mock.upstream import MockUpstream, Scenario
from tests.requests_util import WEATHER_TOOLS, echo
from tests.support import (
    KEY,
    MODEL,
    SERVE_CONFIG,
    UPSTREAM_KEY,
    UPSTREAM_MODEL,
    ServeProcess,
    data,
    free_port,
    make_config,
    raw_stream,
    read_store,
)

FALLBACK = "test/fallback"
FALLBACK_UPSTREAM = "fallback-1"
FALLBACK_MAX = 4096
FALLBACK_PRICING = Pricing(Decimal("1"), Decimal("2"), Decimal("1.25"), Decimal("0.10"))
MESSAGES = [{"role": "user", "content": "Say hello"}]
ANSWER = echo("Say hello")
TEXT = "One, two, three, four, five."


# --- Helpers


@pytest.fixture
async def mocks(upstream):
    """Three mock upstreams: deployments d0, d1 and d2 (d0 is the conftest `upstream`)."""
    others = [MockUpstream(api_key=UPSTREAM_KEY) for _ in range(2)]
    for mock in others:
        await mock.start()
    yield [upstream, *others]
    for mock in others:
        await mock.close()


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def routed_config(
    mocks,
    *,
    asked: tuple[str, ...] = ("d0", "d1"),
    fallback: tuple[str, ...] = ("d2",),
    routing: RoutingConfig | None = None,
    urls: dict[str, str] | None = None,
    options: dict[str, dict] | None = None,
    key_models: tuple[str, ...] | None = None,
) -> Config:
    """The test config with one deployment per mock (d0, d1, d2, in that preference order for the
    asked model), the asked model MODEL on `asked` and a fallback model FALLBACK on `fallback`.
    `urls` points deployments elsewhere, `options` sets per-deployment fields."""
    base = make_config(mocks[0].url)
    urls, options = urls or {}, options or {}
    deployments = tuple(
        Deployment(name=f"d{i}", base_url=urls.get(f"d{i}", mock.url), api_key=UPSTREAM_KEY, **options.get(f"d{i}", {}))
        for i, mock in enumerate(mocks)
    )
    asked_model = replace(base.models[0], deployments=asked)
    fallback_model = Model(
        id=FALLBACK,
        upstream_model=FALLBACK_UPSTREAM,
        deployments=fallback,
        max_output_tokens=FALLBACK_MAX,
        pricing=FALLBACK_PRICING,
    )
    config = replace(
        base,
        deployments=deployments,
        models=(asked_model, fallback_model),
        routing=routing or RoutingConfig(),
    )
    if key_models is not None:
        config = replace(config, keys=(KeyConfig(name="test", key_sha256=sha(KEY), models=key_models),))
    return config


async def ask(gateway, *, stream: bool, model: str = MODEL, **kwargs):
    """One request through the SDK: (response headers, the `model` it names, the answer's text)."""
    async with gateway.client(**kwargs.pop("client_options", {})) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, stream=stream, **kwargs
        )
        parsed = raw.parse()
        if stream:
            chunks = [chunk async for chunk in parsed]
            (answered,) = {chunk.model for chunk in chunks}
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answered, text = parsed.model, parsed.choices[0].message.content
        return raw.headers, answered, text


async def ask_error(gateway, *, stream: bool, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await ask(gateway, stream=stream, **kwargs)
    return caught.value


def counts(mocks) -> list[int]:
    return [len(mock.requests) for mock in mocks]


@contextlib.contextmanager
def black_hole():
    """A loopback address where a TCP connect never completes: a listening socket with backlog 0
    whose accept queue is filled first (never accepted). Linux then drops further SYNs, so a
    new connect hangs in SYN_SENT until the client gives up."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(16):
            filler = socket.socket()
            filler.setblocking(False)
            fillers.append(filler)
            filler.connect_ex(address)
            _, writable, _ = select.select([], [filler], [], 0.3)
            if not writable:  # this connect hangs: the queue is full
                break
        else:
            pytest.fail("could not fill the accept queue of a backlog-0 listener")
        yield f"http://127.0.0.1:{address[1]}"
    finally:
        for s in fillers:
            s.close()
        listener.close()


# --- Failover before the first token: invisible to the client


def failing(status):
    """d0's failure: an upstream status, or None for a refused connection (a closed port)."""
    return pytest.param(status, id=str(status) if status else "connection-refused")


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
@pytest.mark.parametrize("status", [failing(s) for s in (429, 500, 502, 503, 504, 529, None)])
async def test_a_failure_before_the_first_token_moves_on_invisibly(start_gateway, mocks, status, stream):
    urls = {}
    if status is None:
        urls["d0"] = f"http://127.0.0.1:{free_port()}"  # nothing listens: connecting is refused at once
    else:
        mocks[0].enqueue(Scenario(status=status, error_message="first deployment failing"))
    gateway = await start_gateway(routed_config(mocks, urls=urls))

    headers, answered, text = await ask(gateway, stream=stream)

    assert text == ANSWER
    assert answered == MODEL
    assert headers["x-ezat-model"] == MODEL
    assert "x-ezat-routed-from" not in headers  # another deployment of the same model is no fallback
    assert counts(mocks) == [0 if status is None else 1, 1, 0]
    sent = [mock.requests[0].body for mock in mocks[0 if status else 1 : 2]]  # each deployment tried
    assert all(body["model"] == UPSTREAM_MODEL and body.get("stream", False) is stream for body in sent)
    assert all(body == sent[0] for body in sent)  # the next deployment got the very same request


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
@pytest.mark.parametrize(
    "status,type_,code",
    [
        (400, "invalid_request_error", None),
        (403, "permission_error", None),
        (404, "invalid_request_error", "model_not_found"),
        (413, "invalid_request_error", "request_too_large"),
    ],
)
async def test_a_client_error_from_the_upstream_is_returned_at_once(start_gateway, mocks, status, type_, code, stream):
    mocks[0].enqueue(Scenario(status=status, error_message="you asked for something wrong"))
    gateway = await start_gateway(routed_config(mocks))

    error = await ask_error(gateway, stream=stream)

    assert error.status_code == status
    assert (error.type, error.code) == (type_, code)
    assert error.body["message"] == "you asked for something wrong"
    assert counts(mocks) == [1, 0, 0]  # the next deployment received nothing


@pytest.mark.parametrize("failure", [{"error_after": 2}, {"drop_after": 3}], ids=["error-event", "dropped"])
async def test_a_stream_failing_before_its_first_token_moves_on(start_gateway, mocks, failure):
    # Events 0-2 are message_start, content_block_start and a ping: no token yet.
    mocks[0].enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, **failure))
    gateway = await start_gateway(routed_config(mocks))

    _, answered, text = await ask(gateway, stream=True)

    assert (answered, text) == (MODEL, ANSWER)
    assert counts(mocks) == [1, 1, 0]


@pytest.mark.parametrize("failure", [{"error_after": 5}, {"drop_after": 5}], ids=["error-event", "dropped"])
async def test_a_failure_after_the_first_token_ends_the_stream_and_is_not_retried(start_gateway, mocks, failure):
    mocks[0].enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, **failure))
    gateway = await start_gateway(routed_config(mocks))

    response, events = await raw_stream(gateway, {"messages": MESSAGES, "stream_options": {"include_usage": True}})

    assert response.status == 200
    error_event, done = events[-2:]
    assert done == "data: [DONE]"
    error = data(error_event)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error"
    if "error_after" in failure:
        assert error["code"] == "overloaded"
    texts = [data(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.startswith("data: ")]
    assert "".join(texts) == TEXT[:4]  # the two deltas sent before the failure, and nothing else
    assert counts(mocks) == [1, 0, 0]  # not retried: the client had seen output


# --- Every deployment failing


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_when_every_deployment_fails_the_client_gets_the_last_error_mapped(start_gateway, mocks, stream):
    mocks[0].enqueue(Scenario(status=500))
    mocks[1].enqueue(Scenario(status=502))
    mocks[2].enqueue(Scenario(status=529, headers={"retry-after": "7"}, error_message="all busy"))
    gateway = await start_gateway(routed_config(mocks, asked=("d0", "d1", "d2")))

    error = await ask_error(gateway, stream=stream)

    assert error.status_code == 503  # 529 becomes 503
    assert (error.type, error.code) == ("server_error", "overloaded")
    assert error.body["message"] == "all busy"
    assert error.response.headers["retry-after"] == "7"
    assert counts(mocks) == [1, 1, 1]


async def test_max_attempts_bounds_the_upstream_attempts(start_gateway, mocks):
    for mock in mocks:
        mock.enqueue(*(Scenario(status=503) for _ in range(5)))
    gateway = await start_gateway(
        routed_config(
            mocks, asked=("d0", "d1", "d2"), routing=RoutingConfig(max_attempts=2, failures_before_cooldown=10)
        )
    )

    error = await ask_error(gateway, stream=False)

    assert error.status_code == 503
    assert counts(mocks) == [1, 1, 0]


async def test_max_attempts_counts_fallback_models_too(start_gateway, mocks):
    mocks[0].enqueue(Scenario(status=500))
    mocks[1].enqueue(Scenario(status=529, headers={"retry-after": "4"}))
    gateway = await start_gateway(routed_config(mocks, routing=RoutingConfig(max_attempts=2)))

    error = await ask_error(gateway, stream=True, extra_body={"models": [FALLBACK]})

    assert (error.status_code, error.code) == (503, "overloaded")
    assert error.response.headers["retry-after"] == "4"
    assert counts(mocks) == [1, 1, 0]  # the fallback's deployment was never tried


# --- Health: cool-down and recovery


async def test_a_deployment_failing_in_a_row_is_cooled_down_then_tried_again(start_gateway, mocks):
    mocks[0].enqueue(Scenario(status=500), Scenario(status=500))
    gateway = await start_gateway(
        # Long enough for two requests on a loaded machine, which the half second it was was not.
        routed_config(mocks, routing=RoutingConfig(failures_before_cooldown=2, cooldown_seconds=2))
    )

    for _ in range(2):  # two failures in a row: each time d1 answers
        assert (await ask(gateway, stream=False))[2] == ANSWER
    assert counts(mocks) == [2, 2, 0]
    cooled_at = time.monotonic()

    assert (await ask(gateway, stream=True))[2] == ANSWER
    assert (await ask(gateway, stream=False))[2] == ANSWER
    assert counts(mocks) == [2, 4, 0]  # d0 is skipped: its mock received nothing

    await asyncio.sleep(max(0.0, cooled_at + 2.1 - time.monotonic()))
    assert (await ask(gateway, stream=False))[2] == ANSWER
    assert counts(mocks) == [3, 4, 0]  # tried again after the cool-down, and it answered
    assert (await ask(gateway, stream=True))[2] == ANSWER
    assert counts(mocks) == [4, 4, 0]  # used again as the first choice


async def test_only_failures_in_a_row_cool_a_deployment_down(start_gateway, mocks):
    mocks[0].enqueue(Scenario(status=500), Scenario(), Scenario(status=500))
    gateway = await start_gateway(
        routed_config(mocks, routing=RoutingConfig(failures_before_cooldown=2, cooldown_seconds=30))
    )
    for _ in range(4):
        assert (await ask(gateway, stream=False))[2] == ANSWER
    # fail, answer (the count starts again), fail, answer: never two in a row, never cooled
    assert counts(mocks) == [4, 2, 0]


async def test_a_429_with_retry_after_cools_the_deployment_for_that_long(start_gateway, mocks):
    mocks[0].enqueue(Scenario(status=429, headers={"retry-after": "1"}))
    gateway = await start_gateway(
        routed_config(mocks, routing=RoutingConfig(failures_before_cooldown=3, cooldown_seconds=30))
    )

    await ask(gateway, stream=False)
    failed_at = time.monotonic()
    assert counts(mocks) == [1, 1, 0]
    await ask(gateway, stream=True)
    await asyncio.sleep(max(0.0, failed_at + 0.6 - time.monotonic()))
    await ask(gateway, stream=False)
    assert counts(mocks) == [1, 3, 0]  # one failure was enough: the upstream said how long

    await asyncio.sleep(max(0.0, failed_at + 1.1 - time.monotonic()))
    assert (await ask(gateway, stream=False))[2] == ANSWER
    assert counts(mocks) == [2, 3, 0]  # back after about a second, not the 30 s cool-down


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_when_every_deployment_is_cooling_the_client_gets_503_overloaded(start_gateway, mocks, stream):
    mocks[0].enqueue(Scenario(status=500))
    mocks[1].enqueue(Scenario(status=502))
    gateway = await start_gateway(
        routed_config(mocks, routing=RoutingConfig(failures_before_cooldown=1, cooldown_seconds=2))
    )
    first = await ask_error(gateway, stream=stream)
    assert first.status_code == 502  # the last upstream error
    assert counts(mocks) == [1, 1, 0]

    error = await ask_error(gateway, stream=stream)

    assert error.status_code == 503
    assert (error.type, error.code) == ("server_error", "overloaded")
    assert error.response.headers["retry-after"] == "2"  # when the first of them may be tried again
    assert counts(mocks) == [1, 1, 0]  # nothing was sent upstream


# --- Fallback models


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_fallback_model_answers_when_the_asked_one_cannot(start_gateway, mocks, stream):
    mocks[0].enqueue(Scenario(status=529))
    mocks[1].enqueue(Scenario(status=500))
    usage = {"input_tokens": 1000, "output_tokens": 200, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    mocks[2].enqueue(Scenario(usage=usage))
    gateway = await start_gateway(routed_config(mocks))

    headers, answered, text = await ask(gateway, stream=stream, max_tokens=10_000, extra_body={"models": [FALLBACK]})

    assert text == ANSWER
    assert answered == FALLBACK  # `model` is the model that answered
    assert headers["x-ezat-model"] == FALLBACK
    assert headers["x-ezat-routed-from"] == MODEL
    assert counts(mocks) == [1, 1, 1]
    sent = mocks[2].requests[0].body
    assert sent["model"] == FALLBACK_UPSTREAM
    assert sent["max_tokens"] == FALLBACK_MAX  # 10 000 is more than the fallback may write
    assert mocks[0].requests[0].body["max_tokens"] == 10_000
    assert "models" not in sent

    (row,) = await gateway.app[STORE].ledger()
    assert row.request_id == headers["x-request-id"]
    assert (row.model, row.answered_model, row.deployment) == (MODEL, FALLBACK, "d2")
    assert row.cost_usd == (1000 * Decimal("1") + 200 * Decimal("2")) / Decimal(1_000_000)  # the fallback's prices


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_a_fallback_model_gets_only_the_effort_and_sampling_it_supports(start_gateway, mocks, stream):
    mocks[0].enqueue(Scenario(status=500))
    mocks[1].enqueue(Scenario(status=529))
    mocks[2].enqueue(Scenario())  # scripted: the echo, not the call a forced tool_choice gets unscripted
    config = routed_config(mocks)
    asked, fallback = config.models
    gateway = await start_gateway(
        replace(
            config,
            models=(
                replace(asked, sampling=True),  # every effort, xhigh included
                replace(fallback, sampling=False, efforts=("low", "medium", "high")),
            ),
        )
    )

    # A forced tool keeps thinking off, so the asked model is sent its sampling along with the effort.
    headers, answered, text = await ask(
        gateway,
        stream=stream,
        reasoning_effort="xhigh",
        temperature=0.4,
        top_p=0.8,
        tools=WEATHER_TOOLS,
        tool_choice="required",
        extra_body={"models": [FALLBACK]},
    )

    assert text == ANSWER
    assert answered == FALLBACK
    assert headers["x-ezat-model"] == FALLBACK
    assert headers["x-ezat-routed-from"] == MODEL
    assert counts(mocks) == [1, 1, 1]
    tried = [mocks[i].requests[0].body for i in (0, 1)]
    for body in tried:  # what the asked model supports, it got
        assert (body["temperature"], body["top_p"], body["output_config"]) == (0.4, 0.8, {"effort": "xhigh"})
        assert "thinking" not in body
    sent = mocks[2].requests[0].body
    assert sent["model"] == FALLBACK_UPSTREAM
    assert "temperature" not in sent and "top_p" not in sent  # the fallback has no sampling
    assert "output_config" not in sent  # nor xhigh, the only thing output_config held
    assert "thinking" not in sent
    assert sent["max_tokens"] == FALLBACK_MAX  # the default 32 000 is more than the fallback may write
    adapted = ("model", "max_tokens", "temperature", "top_p", "output_config")
    assert {k: v for k, v in sent.items() if k not in adapted} == {
        k: v for k, v in tried[0].items() if k not in adapted
    }  # the rest of the request is the same


async def test_fallback_follows_a_cooled_down_model_and_the_listed_order(start_gateway, mocks):
    # The asked model's deployments are cooling: no attempt, straight to the first fallback.
    mocks[0].enqueue(Scenario(status=429, headers={"retry-after": "30"}))
    mocks[1].enqueue(Scenario(status=429, headers={"retry-after": "30"}), Scenario())
    config = routed_config(mocks, asked=("d0",), fallback=("d1",))
    third = Model(id="test/third", upstream_model="third-1", deployments=("d2",))
    gateway = await start_gateway(replace(config, models=(*config.models, third)))

    assert (await ask_error(gateway, stream=False)).status_code == 429  # d0 now cooling
    headers, answered, _ = await ask(gateway, stream=False, extra_body={"models": [FALLBACK, "test/third"]})
    assert (answered, headers["x-ezat-model"], headers["x-ezat-routed-from"]) == ("test/third", "test/third", MODEL)
    assert counts(mocks) == [1, 1, 1]  # d0 skipped, FALLBACK's d1 failed (and now cools), third answered
    assert mocks[2].requests[0].body["model"] == "third-1"

    headers, answered, _ = await ask(gateway, stream=True, extra_body={"models": [FALLBACK, "test/third"]})
    assert (answered, headers["x-ezat-routed-from"]) == ("test/third", MODEL)
    assert counts(mocks) == [1, 1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_no_fallback_needed_means_no_routed_from(start_gateway, mocks, stream):
    gateway = await start_gateway(routed_config(mocks))

    headers, answered, _ = await ask(gateway, stream=stream, extra_body={"models": [FALLBACK]})

    assert answered == MODEL
    assert headers["x-ezat-model"] == MODEL
    assert "x-ezat-routed-from" not in headers
    assert counts(mocks) == [1, 0, 0]
    (row,) = await gateway.app[STORE].ledger()
    assert (row.model, row.answered_model) == (MODEL, MODEL)


async def test_an_unknown_model_in_models_is_404(start_gateway, mocks):
    gateway = await start_gateway(routed_config(mocks))

    error = await ask_error(gateway, stream=False, extra_body={"models": [FALLBACK, "nope/unknown"]})

    assert error.status_code == 404
    assert (error.type, error.code, error.param) == ("invalid_request_error", "model_not_found", "model")
    assert "nope/unknown" in error.message
    assert counts(mocks) == [0, 0, 0]


async def test_a_fallback_the_key_may_not_use_is_403(start_gateway, mocks):
    gateway = await start_gateway(routed_config(mocks, key_models=("anthropic/*",)))

    error = await ask_error(gateway, stream=True, extra_body={"models": [FALLBACK]})

    assert error.status_code == 403
    assert error.type == "permission_error"
    assert FALLBACK in error.message
    assert counts(mocks) == [0, 0, 0]
    # The same key may still ask for the model it is allowed, without the fallback.
    assert (await ask(gateway, stream=False))[1] == MODEL


# --- Timeouts


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_a_connect_that_never_completes_fails_over_after_the_connect_timeout(start_gateway, mocks, stream):
    with black_hole() as url:
        gateway = await start_gateway(
            routed_config(mocks, urls={"d0": url}, options={"d0": {"connect_timeout_seconds": 0.3}})
        )
        began = time.monotonic()
        headers, _, text = await ask(gateway, stream=stream)
        elapsed = time.monotonic() - began

    assert text == ANSWER
    assert headers["x-ezat-model"] == MODEL
    assert 0.3 <= elapsed < 1.5, elapsed
    assert counts(mocks) == [0, 1, 0]


@pytest.mark.parametrize("slow", [{"delay": 2}, {"event_delay": 2}], ids=["no-status-line", "no-token"])
async def test_a_stream_without_a_first_token_in_time_moves_on(start_gateway, mocks, slow):
    mocks[0].enqueue(Scenario(**slow))
    gateway = await start_gateway(routed_config(mocks, options={"d0": {"first_token_timeout_seconds": 0.3}}))

    began = time.monotonic()
    _, answered, text = await ask(gateway, stream=True)
    elapsed = time.monotonic() - began

    assert (answered, text) == (MODEL, ANSWER)
    assert 0.3 <= elapsed < 1.5, elapsed
    assert counts(mocks) == [1, 1, 0]
    await mocks[0].wait_disconnect(timeout=2)  # the slow attempt was abandoned upstream too


async def test_a_stream_no_deployment_starts_in_time_is_a_500(start_gateway, mocks):
    """Spec, "Errors": 504 `timeout` is a non-streaming request's, past 590 s ("stream it
    instead"); a stream that no deployment started in time is an error on the provider's side."""
    for mock in mocks[:2]:
        mock.enqueue(Scenario(event_delay=2))
    gateway = await start_gateway(
        routed_config(mocks, fallback=(), options={name: {"first_token_timeout_seconds": 0.3} for name in ("d0", "d1")})
    )
    error = await ask_error(gateway, stream=True)
    assert error.status_code == 500
    assert error.body == {
        "message": "The upstream produced nothing within 0.3 seconds.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert counts(mocks) == [1, 1, 0]


async def test_the_non_streaming_deadline_counts_every_attempt_together(start_gateway, mocks):
    # d0 is slow, then fails; d1 is slower still. Per attempt, a 1 s deadline would end after
    # about 1.8 s (0.8 s on d0, then 1 s on d1); for the whole request it ends after 1 s.
    mocks[0].enqueue(Scenario(delay=0.8, status=500))
    mocks[1].enqueue(Scenario(delay=5))
    gateway = await start_gateway(routed_config(mocks), non_streaming_deadline=1.0)

    began = time.monotonic()
    error = await ask_error(gateway, stream=False)
    elapsed = time.monotonic() - began

    assert error.status_code == 504
    assert (error.type, error.code) == ("server_error", "timeout")
    assert 1.0 <= elapsed < 1.5, elapsed
    assert counts(mocks) == [1, 1, 0]  # both deployments were tried within the one deadline
    await mocks[1].wait_disconnect(timeout=2)  # the attempt cut short was abandoned upstream too


# --- Client gone


async def test_closing_a_stream_midway_cancels_the_upstream_request(start_gateway, mocks):
    mocks[0].enqueue(Scenario(blocks=[{"type": "text", "text": TEXT * 10}], chunk_size=2, event_delay=0.05))
    gateway = await start_gateway(routed_config(mocks))

    async with gateway.client() as client:
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        received = 0
        async for _chunk in stream:
            received += 1
            if received == 3:
                break
        await stream.close()

    await mocks[0].wait_disconnect(timeout=2)
    assert counts(mocks) == [1, 0, 0]  # a client that left is not failed over


async def test_a_client_giving_up_on_a_slow_message_cancels_the_upstream_request(start_gateway, mocks):
    mocks[0].enqueue(Scenario(delay=5))
    gateway = await start_gateway(routed_config(mocks))

    with pytest.raises(openai.APITimeoutError):
        await ask(gateway, stream=False, client_options={"timeout": 0.5})

    await mocks[0].wait_disconnect(timeout=2)
    await asyncio.sleep(0.1)
    assert counts(mocks) == [1, 0, 0]


# --- Real `ezat-gateway serve` processes


class Served(ServeProcess):
    """`ezat-gateway serve --config FILE [args]` in front of `upstream`, its ledger in `db`."""

    def __init__(self, tmp_path: Path, upstream: MockUpstream) -> None:
        self.db = tmp_path / "ledger.db"
        super().__init__(
            tmp_path, "gateway", SERVE_CONFIG, storage_url=f"sqlite:///{self.db}", upstream_url=upstream.url
        )


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 0.5)
    except (ConnectionRefusedError, ConnectionResetError, TimeoutError):  # reset: closed as it connected
        return True
    writer.close()
    return False


async def test_sigterm_lets_streams_in_flight_finish_and_bills_them(tmp_path, upstream):
    # 14 events 0.15 s apart: about 2 s a stream, its first token after about 0.45 s.
    slow = Scenario(blocks=[{"type": "text", "text": "abcdefghijklmnop"}], chunk_size=2, event_delay=0.15)
    upstream.enqueue(slow, slow, slow)
    served = Served(tmp_path, upstream)
    started = asyncio.Semaphore(0)

    async def stream(http: aiohttp.ClientSession) -> tuple[str, str]:
        async with http.post(
            served.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": True, "messages": MESSAGES},
        ) as response:
            assert response.status == 200, await response.text()
            body = await response.content.readline()
            started.release()
            body += await response.read()
            return response.headers["x-request-id"], body.decode()

    try:
        await served.start()
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(stream(http)) for _ in range(3)]
            async with asyncio.timeout(5):
                for _ in range(3):
                    await started.acquire()
            served.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            while not await refused(served.port):
                assert time.monotonic() - signalled < 1.0, "still accepting connections 1 s after SIGTERM"
                await asyncio.sleep(0.02)
            assert not any(task.done() for task in tasks), "the streams ended before new connections were refused"

            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await asyncio.wait_for(served.process.wait(), 10)
    finally:
        await served.stop()
        print(served.output())

    assert served.process.returncode == 0
    for _, body in results:
        events = [e for e in body.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
        chunks = [data(e) for e in events[:-1] if e.startswith("data: ")]
        assert (
            "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "abcdefghijklmnop"
        )
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    rows, _ = await read_store(f"sqlite:///{served.db}")
    assert sorted(row.request_id for row in rows) == sorted(rid for rid, _ in results)
    assert {row.outcome for row in rows} == {"complete"}


@pytest.mark.parametrize("starts", ["before", "after"])
async def test_sigterm_ends_a_stream_that_outlasts_the_shutdown_timeout_unbilled(tmp_path, upstream, starts):
    """Spec, "Streaming": a request that fails after the stream started gets `data: {"error": …}`
    then `data: [DONE]`, and isn't billed; a shutdown is the gateway failing it. The streams end
    shortly before the 1 s timeout: those started by then ("before"), and one whose first token
    comes later ("after": the upstream answers after 1.1 s), as soon as it starts."""
    delay = 1.1 if starts == "after" else 0
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "x" * 60}], chunk_size=2, event_delay=0.2, delay=delay))
    db = tmp_path / "ledger.db"
    served = ServeProcess(
        tmp_path,
        "gateway",
        SERVE_CONFIG.replace("shutdown_timeout_seconds = 10", "shutdown_timeout_seconds = 1"),
        storage_url=f"sqlite:///{db}",
        upstream_url=upstream.url,
    )
    try:
        await served.start()
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(
                http.post(
                    served.url + "/openai/v1/chat/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": MODEL, "stream": True, "messages": MESSAGES},
                )
            )
            async with asyncio.timeout(5):
                while not upstream.requests:  # the upstream has the request
                    await asyncio.sleep(0.01)
            if starts == "before":
                await asyncio.sleep(0.3)  # its first events are out
            served.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            async with await request as response:
                body = await asyncio.wait_for(response.read(), 10)
            ended = time.monotonic() - signalled
        await asyncio.wait_for(served.process.wait(), 10)
    finally:
        await served.stop()
        print(served.output())

    assert served.process.returncode == 0
    assert 0.8 <= ended < (1.5 if starts == "before" else 1.9), ended
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert data(events[-2])["error"] == {
        "message": "The gateway is shutting down; send the request again.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    chunks = [data(e) for e in events[:-2] if e.startswith("data: {")]
    assert "x" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    rows, _ = await read_store(f"sqlite:///{db}")
    assert rows == []


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`: their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry)] = cmdline
    return found


def listening_sockets(port: int) -> set[str]:
    """The inodes of the loopback TCP sockets listening on `port`."""
    return _sockets_on(port, "0A")  # 0A: LISTEN


def connected_sockets(port: int) -> set[str]:
    """The inodes of the server's ends of the connections open to `port`."""
    return _sockets_on(port, "01")  # 01: ESTABLISHED


def _sockets_on(port: int, state: str) -> set[str]:
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == state:  # local address: the server's end
            inodes.add(fields[9])
    return inodes


def opened_files(pid: int) -> set[str]:
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def sockets_of(pid: int) -> set[str]:
    return {link[len("socket:[") : -1] for link in opened_files(pid) if link.startswith("socket:[")}


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def workers_of(served: Served) -> dict[int, str]:
    """multiprocessing's spawned workers (the parent may also run its resource tracker)."""
    return {pid: cmd for pid, cmd in children(served.process.pid).items() if "spawn_main" in cmd}


async def both_workers_listening(served: Served, within: float) -> tuple[dict[int, str], list[set[str]]]:
    """Wait until two workers each hold their own listening socket on the port, and serve on it
    (a worker listens before its app starts, so that a taken port fails first: it says when it serves)."""
    began = time.monotonic()
    while True:
        workers = workers_of(served)
        listening = listening_sockets(served.port)
        held = [sockets_of(pid) & listening for pid in workers]
        output = served.output()
        serving = all(f"listening on http://127.0.0.1:{served.port} (pid {pid})" in output for pid in workers)
        if len(workers) == 2 and all(len(h) == 1 for h in held) and serving:
            return workers, held
        assert time.monotonic() - began < within, f"workers {workers}, listening {listening}, held {held}\n{output}"
        await asyncio.sleep(0.05)


async def answered_on_open_connections(served: Served, workers: dict[int, str], count: int) -> list[int]:
    """Open `count` connections at once, get /healthz on each, and count, per worker, the
    connections it answered on (the server's end of each is a socket the worker holds). With
    16 the kernel leaves one worker without any once in 32,768 runs."""
    streams = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(count)]
    try:
        for reader, writer in streams:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        open_now = connected_sockets(served.port)
        return [len(sockets_of(pid) & open_now) for pid in workers]
    finally:
        for _, writer in streams:
            writer.close()


async def test_serve_with_two_workers_shares_the_port_and_stops_on_sigterm(tmp_path, upstream):
    served = Served(tmp_path, upstream)
    workers: dict[int, str] = {}
    try:
        await served.start("--workers", "2")
        workers, held = await both_workers_listening(served, within=15)
        assert held[0] != held[1]  # two sockets, one port (SO_REUSEPORT)
        assert not sockets_of(served.process.pid) & listening_sockets(served.port)  # the parent only supervises

        for n in range(6):  # separate connections: the kernel spreads them over the workers
            _, answered, text = await ask(served, stream=n % 2 == 1)
            assert (answered, text) == (MODEL, ANSWER)
        answered_by = await answered_on_open_connections(served, workers, 16)
        assert sum(answered_by) == 16 and all(answered_by), answered_by  # both workers answer

        served.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(served.process.wait(), 15)
    finally:
        await served.stop()
        print(served.output())

    assert served.process.returncode == 0
    async with asyncio.timeout(5):
        while not all(gone(pid) for pid in workers):
            await asyncio.sleep(0.05)
    assert await refused(served.port)
    rows, _ = await read_store(f"sqlite:///{served.db}")
    assert len(rows) == 6


async def test_two_workers_start_together_on_a_new_sqlite_database(tmp_path, upstream):
    """Both workers migrate the same new file at once: one does it, the other finds it done.
    (Before SQLiteStore._migrate read the schema version inside its write transaction, the
    second re-ran the migration, failed with "table keys already exists" and hung.)"""
    served = Served(tmp_path, upstream)
    # A new database while some other writer holds the write lock (another process's write):
    # both workers reach their migration before either may write, which makes the race certain.
    lock = sqlite3.connect(served.db, isolation_level=None)
    lock.execute("PRAGMA journal_mode=WAL")
    lock.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    lock.execute("BEGIN IMMEDIATE")
    try:
        await served.start("--workers", "2", wait=False)
        async with asyncio.timeout(15):  # both workers have the database open, then wait for the lock
            while sum(str(served.db) in opened_files(pid) for pid in workers_of(served)) < 2:
                assert served.process.returncode is None, served.output()
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        lock.execute("COMMIT")
        lock.close()

        await both_workers_listening(served, within=5)
        _, answered, _ = await ask(served, stream=False)
        assert answered == MODEL
        served.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(served.process.wait(), 15)
        assert served.process.returncode == 0
    finally:
        lock.close()
        await served.stop()
        print(served.output())


async def test_serve_exits_when_its_sqlite_database_cannot_be_opened(tmp_path, upstream):
    served = Served(tmp_path, upstream)
    served.db.write_bytes(b"this is not an SQLite database" * 200)
    try:
        await served.start(wait=False)
        try:
            await asyncio.wait_for(served.process.wait(), 5)
        except TimeoutError:
            pytest.fail(f"still running 5 s after failing to open its storage:\n{served.output()}")
    finally:
        if served.process.returncode is None:
            served.process.kill()
            await served.process.wait()
    assert served.process.returncode not in (0, None)
    assert "file is not a database" in served.output()
