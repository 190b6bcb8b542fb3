"""Billing through the real gateway: ledger rows with exact decimal costs, written before the
reply ends ([DONE] or the body), early close billed with an estimate, failed requests not
billed, group commit under load, and the key errors (403, 402, 429, 401) as the spec says.

Every behaviour that depends on the store runs on both: a SQLite file and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import sqlite3
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal

import aiohttp
import asyncpg
import openai
import pytest
from aiohttp import web
from yarl import URL

from gateway.app import STORE, build_app
from gateway.config import KeyConfig, RateLimitConfig
from gateway.mock.upstream import MockUpstream, Scenario
from gateway.storage import LedgerRow, open_store
from middlewares.core.reply import EventStreamReply
from tests.conftest import POSTGRES_URL
from tests.requests_util import WEATHER_TOOLS as TOOLS
from tests.support import KEY, MODEL, UPSTREAM_KEY, Gateway, Link, make_config, read_store

MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@contextlib.asynccontextmanager
async def posted(gateway, *, stream: bool):
    """MESSAGES POSTed as raw HTTP with the test key, the response open: to read all of it,
    part of it, or nothing yet."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": stream, "messages": MESSAGES},
        ) as response:
            yield response


MILLION = Decimal(1_000_000)


def price(input_tokens=0, cache_write=0, cache_read=0, output=0) -> Decimal:
    """The test config's pricing (3 / 3.75 / 0.30 / 15 USD per million), written out again."""
    return (
        input_tokens * Decimal("3")
        + cache_write * Decimal("3.75")
        + cache_read * Decimal("0.30")
        + output * Decimal("15")
    ) / MILLION


# --- stores


@pytest.fixture(params=["sqlite", "postgres"])
def storage_url(request, tmp_path) -> str:
    """A SQLite file in tmp_path, or a fresh PostgreSQL schema (skipped/failed without a server)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config_with(upstream, storage_url="sqlite:///:memory:", ratelimit_url="", **key_fields):
    """The test config on `storage_url`, its one key KEY ("test") with the given limits."""
    config = make_config(upstream.url, storage_url)
    return replace(
        config,
        keys=(KeyConfig(name="test", key_sha256=sha(KEY), **key_fields),),
        ratelimit=RateLimitConfig(url=ratelimit_url),
    )


async def key_id(store, name="test") -> int:
    return next(k.id for k in await store.list_keys() if k.name == name)


async def wait_for_rows(store, count: int, timeout: float = 5.0) -> list[LedgerRow]:
    """Poll the store (bounded) until it holds `count` rows."""
    async with asyncio.timeout(timeout):
        while len(rows := await store.ledger()) < count:
            await asyncio.sleep(0.02)
    return rows


async def settled_store(gateway, storage_url):
    """Stop the gateway (it waits for its requests, then writes every recorded row) and open
    the same database afresh: what is in it now is everything the gateway will ever bill."""
    await gateway.runner.cleanup()
    store = open_store(storage_url)
    await store.open()
    return store


class WriteLock:
    """The database's write lock, held from a connection of the test's own."""

    @classmethod
    async def take(cls, storage_url: str, key: int) -> WriteLock:
        lock = cls()
        if storage_url.startswith("sqlite:///"):
            lock.sqlite = sqlite3.connect(storage_url.removeprefix("sqlite:///"), isolation_level=None, timeout=5)
            lock.sqlite.execute("BEGIN IMMEDIATE")
            lock.pg = None
        else:
            lock.sqlite = None
            lock.pg = await asyncpg.connect(storage_url)
            lock.tx = lock.pg.transaction()
            await lock.tx.start()
            assert await lock.pg.fetch("SELECT id FROM keys WHERE id = $1 FOR UPDATE", key)
        return lock

    async def committed_rows(self) -> int:
        """Ledger rows committed so far, seen from this connection (the gateway's own store
        connection must not be used meanwhile: SQLite's would queue behind the blocked write)."""
        if self.sqlite is not None:
            return self.sqlite.execute("SELECT count(*) FROM ledger").fetchone()[0]
        return await self.pg.fetchval("SELECT count(*) FROM ledger")

    async def release(self) -> None:
        if self.sqlite is not None:
            self.sqlite.execute("ROLLBACK")
            self.sqlite.close()
            self.sqlite = None
        if self.pg is not None:
            await self.tx.rollback()
            await self.pg.close()
            self.pg = None


@pytest.fixture
async def write_lock():
    """Takes the write lock on demand; always released at the end, whatever the test did."""
    taken: list[WriteLock] = []

    async def take(storage_url: str, key: int) -> WriteLock:
        taken.append(await WriteLock.take(storage_url, key))
        return taken[-1]

    yield take
    for lock in taken:
        await lock.release()


# --- the four kinds of request


@dataclass(frozen=True)
class Case:
    blocks: list[dict]
    usage: dict  # the upstream's usage (Anthropic's names, plus the mock's thinking_tokens)
    row_tokens: tuple[int, int, int, int, int]  # input, cache write, cache read, output, reasoning
    cost: Decimal
    request: dict = field(default_factory=dict)


CASES = {
    "plain": Case(
        blocks=[{"type": "text", "text": "It is 9°C and clear in Oslo."}],
        usage={"input_tokens": 1000, "output_tokens": 500},
        row_tokens=(1000, 0, 0, 500, 0),
        cost=Decimal("0.0105"),  # 1000 × 3 + 500 × 15 = 10500 per million
    ),
    "cached": Case(
        blocks=[{"type": "text", "text": "Read mostly from the prompt cache."}],
        usage={
            "input_tokens": 10,
            "cache_creation_input_tokens": 200,
            "cache_read_input_tokens": 3000,
            "output_tokens": 20,
        },
        row_tokens=(10, 200, 3000, 20, 0),
        cost=Decimal("0.00198"),  # 10 × 3 + 200 × 3.75 + 3000 × 0.30 + 20 × 15 = 1980 per million
    ),
    "reasoning": Case(
        blocks=[
            {"type": "thinking", "thinking": "The user wants the weather. " * 4, "signature": "sig"},
            {"type": "text", "text": "Mild."},
        ],
        usage={"input_tokens": 100, "output_tokens": 50, "thinking_tokens": 30},
        row_tokens=(100, 0, 0, 50, 30),
        cost=Decimal("0.00105"),  # 100 × 3 + 50 × 15 (thinking is output, and billed as output)
        request={"reasoning_effort": "medium"},
    ),
    "estimated_reasoning": Case(  # the real API gives no thinking_tokens: estimated from the thinking text
        blocks=[
            {"type": "thinking", "thinking": "The user wants the weather. " * 4, "signature": "sig"},
            {"type": "text", "text": "Mild."},
        ],
        usage={"input_tokens": 100, "output_tokens": 50},
        row_tokens=(100, 0, 0, 50, 28),  # 112 characters of thinking, about 4 a token
        cost=Decimal("0.00105"),
        request={"reasoning_effort": "medium"},
    ),
    "tool_call": Case(
        blocks=[{"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}}],
        usage={"input_tokens": 200, "output_tokens": 40},
        row_tokens=(200, 0, 0, 40, 0),
        cost=Decimal("0.0012"),  # 200 × 3 + 40 × 15 = 1200 per million
        request={"tools": TOOLS},
    ),
}


def test_case_costs_match_the_price_list():
    for case in CASES.values():
        input_tokens, cache_write, cache_read, output, _ = case.row_tokens
        assert price(input_tokens, cache_write, cache_read, output) == case.cost


@dataclass
class Sent:
    request_id: str  # the request-id response header
    completion_id: str
    usage: openai.types.CompletionUsage
    finish_reason: str


async def send(client: openai.AsyncOpenAI, *, stream: bool, **request) -> Sent:
    """One chat completion through the SDK, read to the end."""
    kwargs = {"model": MODEL, "max_tokens": 256, "messages": MESSAGES, **request}
    if stream:
        raw = await client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        chunks = [chunk async for chunk in raw.parse()]
        (completion_id,) = {chunk.id for chunk in chunks}
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return Sent(raw.headers["request-id"], completion_id, chunks[-1].usage, finish[-1])
    raw = await client.chat.completions.with_raw_response.create(**kwargs)
    completion = raw.parse()
    return Sent(raw.headers["request-id"], completion.id, completion.usage, completion.choices[0].finish_reason)


def expected_row(sent: Sent, key: int, case: Case, row: LedgerRow, outcome: str = "complete") -> LedgerRow:
    """The row the gateway must have written for `sent` (timestamps taken from `row`)."""
    input_tokens, cache_write, cache_read, output, reasoning = case.row_tokens
    return LedgerRow(
        request_id=sent.request_id,
        key_id=key,
        model=MODEL,
        answered_model=MODEL,
        deployment="primary",
        input_tokens=input_tokens,
        cache_write_tokens=cache_write,
        cache_read_tokens=cache_read,
        output_tokens=output,
        reasoning_tokens=reasoning,
        cost_usd=case.cost,
        outcome=outcome,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", list(CASES))
async def test_ledger_row_for_each_kind_of_request(start_gateway, upstream, storage_url, kind, stream):
    case = CASES[kind]
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    upstream.enqueue(Scenario(blocks=case.blocks, usage=case.usage))

    before = datetime.now(UTC)
    async with gateway.client() as client:
        sent = await send(client, stream=stream, **case.request)
    after = datetime.now(UTC)

    # What the client was told and what it is billed for are the same numbers.
    input_tokens, cache_write, cache_read, output, reasoning = case.row_tokens
    assert sent.usage.prompt_tokens == input_tokens + cache_write + cache_read
    assert sent.usage.completion_tokens == output
    assert sent.usage.completion_tokens_details.reasoning_tokens == reasoning
    assert sent.finish_reason == ("tool_calls" if kind == "tool_call" else "stop")
    assert sent.completion_id == "chatcmpl-" + sent.request_id

    # The row is there as soon as the reply has ended: no polling.
    (row,) = await store.ledger()
    key = await key_id(store)
    assert row == expected_row(sent, key, case, row)
    assert isinstance(row.cost_usd, Decimal)
    assert before <= row.started_at <= row.finished_at <= after
    assert await store.spent(key) == case.cost
    (record,) = await store.list_keys()
    assert record.spent_usd == case.cost


async def test_key_spend_is_the_sum_of_its_rows(start_gateway, upstream, storage_url):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    sent: dict[str, Case] = {}
    async with gateway.client() as client:
        for stream in (False, True):
            for case in CASES.values():
                upstream.enqueue(Scenario(blocks=case.blocks, usage=case.usage))
                sent[(await send(client, stream=stream, **case.request)).request_id] = case

    rows = await store.ledger(key_id=await key_id(store))
    assert [row.request_id for row in rows] == list(sent)  # in the order they were made
    assert [row.cost_usd for row in rows] == [case.cost for case in sent.values()]
    total = 2 * sum(case.cost for case in CASES.values())
    assert total == Decimal("0.03156")  # 2 × (0.0105 + 0.00198 + 0.00105 + 0.00105 + 0.0012)
    key = await key_id(store)
    assert await store.spent(key) == total
    (record,) = await store.list_keys()
    assert record.spent_usd == total


# --- written before the reply ends


async def test_done_is_sent_only_after_the_row_is_committed(start_gateway, upstream, storage_url, write_lock):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    key = await key_id(store)
    # The delay puts message_delta (the finish_reason chunk) and message_stop (the row, then
    # [DONE]) in separate reads, so the finish chunk can arrive while the row waits.
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "text", "text": "Almost done."}],
            usage={"input_tokens": 7, "output_tokens": 3},
            event_delay=0.1,
            pings=0,
        )
    )
    lock = await write_lock(storage_url, key)

    async with posted(gateway, stream=True) as response:
        assert response.status == 200
        received = b""
        async with asyncio.timeout(5):
            while b'"finish_reason":"stop"' not in received:
                received += await response.content.readany()
        assert b"[DONE]" not in received

        # Nothing more while the ledger cannot commit.
        more = asyncio.create_task(response.content.readany())
        done, _ = await asyncio.wait({more}, timeout=0.5)
        assert not done, f"bytes arrived while the row could not be committed: {more.result()!r}"
        assert await lock.committed_rows() == 0

        await lock.release()
        async with asyncio.timeout(15):
            received += await more
            received += await response.content.read()
        rows_at_done = await store.ledger()

    assert received.endswith(b"data: [DONE]\n\n")
    (row,) = rows_at_done
    assert row.request_id == response.headers["request-id"]
    assert (row.input_tokens, row.output_tokens, row.cost_usd) == (7, 3, price(7, output=3))
    assert await store.spent(key) == price(7, output=3)


async def test_body_is_sent_only_after_the_row_is_committed(start_gateway, upstream, storage_url, write_lock):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    key = await key_id(store)
    upstream.enqueue(
        Scenario(blocks=[{"type": "text", "text": "Whole."}], usage={"input_tokens": 11, "output_tokens": 4})
    )
    lock = await write_lock(storage_url, key)

    async def post() -> tuple[aiohttp.ClientResponse, dict]:
        async with posted(gateway, stream=False) as response:
            return response, await response.json()

    reply = asyncio.create_task(post())
    async with asyncio.timeout(5):  # the upstream has the request (and answers it at once)
        while not upstream.requests:
            await asyncio.sleep(0.01)
    done, _ = await asyncio.wait({reply}, timeout=0.5)
    assert not done, "the reply arrived while its row could not be committed"
    assert await lock.committed_rows() == 0

    await lock.release()
    async with asyncio.timeout(15):
        response, body = await reply
    (row,) = await store.ledger()
    assert response.status == 200
    assert body["id"] == "chatcmpl-" + row.request_id == "chatcmpl-" + response.headers["request-id"]
    assert (row.input_tokens, row.output_tokens, row.cost_usd) == (11, 4, price(11, output=4))


# --- early close


LONG_TEXT = "".join(f"word{i:04d} " for i in range(300))  # 3000 characters, 375 deltas of 8


async def test_early_close_is_billed_with_an_estimate(start_gateway, upstream, storage_url):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "text", "text": LONG_TEXT}],
            usage={
                "input_tokens": 321,
                "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 50,
                "output_tokens": 750,
            },
            chunk_size=8,
            event_delay=0.05,
            pings=0,
        )
    )
    seen, content_chunks = "", 0
    async with gateway.client() as client:
        stream = await client.chat.completions.create(model=MODEL, stream=True, messages=MESSAGES)
        async for chunk in stream:
            completion_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                seen += chunk.choices[0].delta.content
                content_chunks += 1
                if content_chunks == 5:
                    break
        await stream.close()

    (row,) = await wait_for_rows(store, 1)
    assert row.outcome == "client_closed"
    assert row.request_id == completion_id.removeprefix("chatcmpl-")
    assert (row.model, row.answered_model, row.deployment) == (MODEL, MODEL, "primary")
    # Input as message_start said; the output was never reported, so it is estimated.
    assert (row.input_tokens, row.cache_read_tokens, row.cache_write_tokens) == (321, 1000, 50)
    assert row.reasoning_tokens == 0
    # At least the text the client received (≈ 4 characters a token, rounded up) ...
    assert row.output_tokens >= (len(seen) + 3) // 4
    # ... and not more than what was produced by the time the close was noticed: allow ten more
    # deltas (half a second of upstream at event_delay 0.05), far less than the whole answer.
    assert row.output_tokens <= (len(seen) + 10 * 8 + 3) // 4
    assert row.output_tokens < 750
    assert row.cost_usd == price(321, 50, 1000, row.output_tokens)
    assert row.started_at <= row.finished_at
    assert await store.spent(await key_id(store)) == row.cost_usd


async def test_a_client_gone_while_its_row_is_written_is_settled_as_used(
    start_gateway, upstream, storage_url, write_lock
):
    """The client leaves while its row waits for the database: the row is written all the same,
    so the key's tpm is charged what the request used (50,010 tokens), not given back its
    whole reservation as if it had failed."""
    config = replace(
        make_config(upstream.url, storage_url), keys=(KeyConfig(name="test", key_sha256=sha(KEY), tpm=60_000),)
    )
    gateway = await start_gateway(config)
    store = gateway.app[STORE]
    upstream.enqueue(
        Scenario(blocks=[{"type": "text", "text": "Read."}], usage={"input_tokens": 50_000, "output_tokens": 10})
    )
    lock = await write_lock(storage_url, await key_id(store))

    async def post() -> None:
        async with posted(gateway, stream=False):
            pass

    reply = asyncio.create_task(post())
    async with asyncio.timeout(5):
        while not upstream.requests:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # the answer is in; its row waits for the lock
    reply.cancel()  # the client hangs up
    await asyncio.sleep(0.3)
    await lock.release()
    (row,) = await wait_for_rows(store, 1)
    assert (row.input_tokens, row.output_tokens) == (50_000, 10)
    # 60,000 a minute, 50,010 used: a request that may take 20,000 more waits its turn.
    async with gateway.client() as client:
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model=MODEL, max_tokens=20_000, messages=MESSAGES)


async def test_early_close_stops_the_upstream_before_the_row_is_written(
    start_gateway, upstream, storage_url, write_lock
):
    """A client gone cancels the upstream at once, however long its row then takes to commit."""
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    upstream.enqueue(Scenario(blocks=long_text_blocks(), usage={"input_tokens": 40}, event_delay=0.05, pings=0))
    lock = await write_lock(storage_url, await key_id(store))
    async with posted(gateway, stream=True) as response:
        async with asyncio.timeout(5):
            while b'"content":"' not in await response.content.readany():
                pass
    # The client is gone; the ledger cannot commit while the lock is held.
    await upstream.wait_disconnect(timeout=1)
    assert await lock.committed_rows() == 0
    await lock.release()
    (row,) = await wait_for_rows(store, 1)
    assert (row.outcome, row.input_tokens) == ("client_closed", 40)


async def test_early_close_bills_the_reasoning_and_tool_arguments_produced(start_gateway, upstream, storage_url):
    # Thinking the client never sees, then a tool call whose arguments it sees in part.
    thinking, notes = "Let me check the forecast. " * 20, "n" * 600  # 540 characters; 600
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    upstream.enqueue(
        Scenario(
            blocks=[
                {"type": "thinking", "thinking": thinking, "signature": "sig"},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "get_weather",
                    "input": {"city": "Oslo", "notes": notes},
                },
            ],
            usage={"input_tokens": 100, "output_tokens": 900},
            chunk_size=8,
            event_delay=0.02,
            pings=0,
        )
    )
    arguments = ""
    async with gateway.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL, stream=True, messages=MESSAGES, tools=TOOLS, reasoning_effort="medium"
        )
        async for chunk in stream:
            calls = chunk.choices[0].delta.tool_calls if chunk.choices else None
            if calls and calls[0].function.arguments:
                arguments += calls[0].function.arguments
                if len(arguments) >= 40:
                    break
        await stream.close()

    (row,) = await wait_for_rows(store, 1)
    assert row.outcome == "client_closed"
    assert row.reasoning_tokens == (len(thinking) + 3) // 4  # all of it was produced before the tool call
    # The output: that reasoning, and at least the arguments the client received, far less than 900.
    assert row.output_tokens >= row.reasoning_tokens + (len(arguments) + 3) // 4
    assert row.output_tokens <= row.reasoning_tokens + (len(arguments) + 10 * 8 + 3) // 4
    assert row.cost_usd == price(100, 0, 0, row.output_tokens)


# --- output billed at least as the text the answer carried


class UncountedUpstream(MockUpstream):
    """The mock, its answers giving no output count: a message without `usage` at all, a stream
    whose message_delta has none (message_start's `output_tokens`, 1, is all it says)."""

    def _message(self, body, sc):
        message = super()._message(body, sc)
        if not body.get("stream"):
            del message["usage"]
        return message

    @staticmethod
    def _events(message, sc):
        events = MockUpstream._events(message, sc)
        for event in events:
            if event["type"] == "message_delta":
                del event["usage"]
        return events


@pytest.fixture
async def uncounted():
    mock = UncountedUpstream(api_key=UPSTREAM_KEY)
    await mock.start()
    yield mock
    await mock.close()


class RepeatingUpstream(MockUpstream):
    """The mock, its streams' message_delta repeating the input numbers: the input changed, the
    cache numbers null (as an Anthropic-format proxy may send them)."""

    @staticmethod
    def _events(message, sc):
        events = MockUpstream._events(message, sc)
        for event in events:
            if event["type"] == "message_delta":
                event["usage"] |= {
                    "input_tokens": 120,
                    "cache_read_input_tokens": None,
                    "cache_creation_input_tokens": None,
                }
        return events


async def test_a_message_delta_overrides_the_numbers_it_repeats_but_not_with_null(start_gateway, storage_url):
    upstream = RepeatingUpstream(api_key=UPSTREAM_KEY)
    await upstream.start()
    try:
        gateway = await start_gateway(make_config(upstream.url, storage_url))
        upstream.enqueue(
            Scenario(
                usage={
                    "input_tokens": 100,
                    "cache_read_input_tokens": 5000,
                    "cache_creation_input_tokens": 200,
                    "output_tokens": 30,
                }
            )
        )
        async with gateway.client() as client:
            sent = await send(client, stream=True)
    finally:
        await upstream.close()
    (row,) = await gateway.app[STORE].ledger()
    assert (row.input_tokens, row.cache_read_tokens, row.cache_write_tokens, row.output_tokens) == (120, 5000, 200, 30)
    assert row.cost_usd == price(120, cache_write=200, cache_read=5000, output=30)
    assert sent.usage.prompt_tokens == 120 + 5000 + 200


THINKING = "Where is Oslo, and what is its weather now? " * 5  # 220 characters
ANSWER = [  # thinking, text and a tool call: all of it output
    {"type": "thinking", "thinking": THINKING, "signature": "sig"},
    {"type": "text", "text": LONG_TEXT[:1001]},
    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo", "notes": "n" * 100}},
]
# What it carried, about 4 characters a token, rounded up: its text and its arguments' JSON
# (1001 + 126 characters), its thinking (220).
ARGUMENTS = json.dumps(ANSWER[2]["input"], separators=(",", ":"))
THOUGHT = (len(THINKING) + 3) // 4
CARRIED = (len(ANSWER[1]["text"]) + len(ARGUMENTS) + 3) // 4 + THOUGHT


def test_the_answers_estimate_is_worked_out_right():
    assert (len(ARGUMENTS), THOUGHT, CARRIED) == (126, 55, 337)


async def send_the_answer(gateway, stream: bool) -> Sent:
    async with gateway.client() as client:
        return await send(client, stream=stream, max_tokens=4096, tools=TOOLS, reasoning_effort="medium")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_answer_without_an_output_count_is_billed_its_text(start_gateway, uncounted, storage_url, stream):
    """A stream whose message_delta has no usage is not billed message_start's 1 output token,
    nor a message without usage 0: both are billed what their text could be, and told so."""
    gateway = await start_gateway(make_config(uncounted.url, storage_url))
    store = gateway.app[STORE]
    uncounted.enqueue(Scenario(blocks=ANSWER, usage={"input_tokens": 100}))
    sent = await send_the_answer(gateway, stream)

    (row,) = await store.ledger()
    # The input is as reported: message_start's in a stream; a message without usage says none.
    input_tokens = 100 if stream else 0
    assert (row.input_tokens, row.output_tokens, row.reasoning_tokens) == (input_tokens, CARRIED, THOUGHT)
    assert (row.outcome, row.cost_usd) == ("complete", price(input_tokens, output=CARRIED))
    # What the client is told is what it is billed for.
    assert (sent.usage.prompt_tokens, sent.usage.completion_tokens) == (input_tokens, CARRIED)
    assert sent.usage.completion_tokens_details.reasoning_tokens == THOUGHT
    assert sent.finish_reason == "tool_calls"


COUNTS = {  # the upstream's usage → the output and reasoning billed
    "output-too-low": ({"output_tokens": 5}, CARRIED, THOUGHT),
    "reasoning-above-output": ({"output_tokens": 5, "thinking_tokens": 400}, CARRIED, CARRIED),
    "higher-than-the-text": ({"output_tokens": 2000, "thinking_tokens": 5000}, 2000, 2000),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("count", list(COUNTS))
async def test_output_is_billed_as_the_larger_of_the_count_and_the_text(
    start_gateway, upstream, storage_url, count, stream
):
    """An output count below what the text could be is raised to it; a higher one stands. The
    reasoning is never more than the output."""
    usage, output, reasoning = COUNTS[count]
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    upstream.enqueue(Scenario(blocks=ANSWER, usage={"input_tokens": 100, **usage}))
    sent = await send_the_answer(gateway, stream)

    (row,) = await store.ledger()
    assert (row.input_tokens, row.output_tokens, row.reasoning_tokens) == (100, output, reasoning)
    assert row.cost_usd == price(100, output=output)
    assert (sent.usage.completion_tokens, sent.usage.completion_tokens_details.reasoning_tokens) == (output, reasoning)


# --- failed requests are not billed


def long_text_blocks() -> list[dict]:
    return [{"type": "text", "text": LONG_TEXT[:400]}]


FAILURES = {
    "upstream-429": (dict(status=429), False, 429),
    "upstream-529": (dict(status=529), False, 503),
    "upstream-500": (dict(status=500), False, 500),
    "deadline": (dict(delay=1.0), False, 504),
    "upstream-429-streamed": (dict(status=429), True, 429),
    "upstream-529-streamed": (dict(status=529), True, 503),
    "error-before-first-token": (dict(error_after=1), True, 503),
    "mid-stream-error": (dict(blocks=long_text_blocks(), error_after=8), True, None),
    "dropped-stream": (dict(blocks=long_text_blocks(), drop_after=8), True, None),
}


@pytest.mark.parametrize("failure", list(FAILURES))
async def test_failed_requests_are_not_billed(start_gateway, upstream, storage_url, failure):
    scenario, stream, status = FAILURES[failure]
    # "deadline": a non-streaming request that outlasts it ends in 504 timeout (here 0.3 s, not 590).
    gateway = await start_gateway(make_config(upstream.url, storage_url), non_streaming_deadline=0.3)
    upstream.enqueue(Scenario(usage={"input_tokens": 500, "output_tokens": 500}, **scenario))

    text = ""
    async with gateway.client() as client:
        if status is not None:
            with pytest.raises(openai.APIStatusError) as caught:
                await send(client, stream=stream)
            assert caught.value.status_code == status
        else:  # the stream had started: the error arrives in it
            with pytest.raises(openai.APIError) as caught:
                chunks = await client.chat.completions.create(model=MODEL, stream=True, messages=MESSAGES)
                async for chunk in chunks:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
            assert not isinstance(caught.value, openai.APIStatusError)
            assert text, "the failure should come after some text"
    assert len(upstream.requests) == 1

    store = await settled_store(gateway, storage_url)
    try:
        assert await store.ledger() == []
        assert await store.spent(await key_id(store)) == 0
        assert [k.spent_usd for k in await store.list_keys()] == [0]
    finally:
        await store.close()


class BreakingEncoder:
    """The translator's encoder, made to fail on the second batch that holds text: a fault of
    the gateway's own, after the stream has started."""

    def __init__(self, encoder) -> None:
        self._encoder = encoder
        self._texts = 0

    @property
    def finished(self) -> bool:
        return self._encoder.finished

    def encode(self, batch):
        if any(event["type"] == "content_block_delta" for event in batch):
            self._texts += 1
            if self._texts == 2:
                raise RuntimeError("a fault of the gateway's own")
        return self._encoder.encode(batch)


@web.middleware
async def break_the_encoder(request, handler):
    reply = await handler(request)
    if isinstance(reply, EventStreamReply):
        reply.encoder = BreakingEncoder(reply.encoder)
    return reply


async def test_a_stream_the_gateway_fails_is_not_billed(upstream, storage_url):
    """Spec, "Streaming": "If the request fails after the stream has started, you get
    `data: {"error": {…}}` and then `data: [DONE]` […] and the request isn't billed", also
    when the gateway is what failed."""
    app = build_app(make_config(upstream.url, storage_url))
    app.middlewares.append(break_the_encoder)  # innermost of the app's: it sees the translated reply
    gateway = await Gateway(app).start()
    upstream.enqueue(Scenario(blocks=long_text_blocks(), event_delay=0.01, usage={"input_tokens": 500}))
    text = ""
    async with gateway.client() as client:
        with pytest.raises(openai.APIError) as caught:
            chunks = await client.chat.completions.create(model=MODEL, stream=True, messages=MESSAGES)
            async for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
    assert caught.value.message == "The gateway failed mid-stream."
    assert text, "the failure should come after some text"

    store = await settled_store(gateway, storage_url)
    try:
        assert await store.ledger() == []
        assert [k.spent_usd for k in await store.list_keys()] == [0]
    finally:
        await store.close()


# --- the ledger's database failing (PostgreSQL, through a link the test cuts)


@pytest.fixture
async def linked_gateway(upstream, postgres_url):
    """A gateway whose PostgreSQL is reached through a Link; yields (gateway, link)."""
    link = await Link(URL(POSTGRES_URL).port).start()
    gateway = await Gateway(build_app(make_config(upstream.url, link.url(postgres_url)))).start()
    yield gateway, link
    await gateway.runner.cleanup()
    await link.close()


async def post_reading_all(gateway, stream: bool) -> tuple[int, bytes]:
    async with posted(gateway, stream=stream) as response:
        return response.status, await response.read()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_commit_whose_answer_is_lost_is_billed_once(linked_gateway, upstream, postgres_url, stream):
    """The database commits the row, then the connection breaks before the gateway hears so: the
    ledger writes the batch again, which must neither fail the request nor charge it twice."""
    gateway, link = linked_gateway
    upstream.enqueue(Scenario(usage={"input_tokens": 10, "output_tokens": 20}))
    link.cut_after_sending = b"COMMIT"
    status, body = await post_reading_all(gateway, stream)
    assert status == 200
    if stream:
        assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"stop"' in body
        assert b'"error"' not in body
    else:
        assert json.loads(body)["object"] == "chat.completion"
    assert link.cut_after_sending is None, "the link never saw the commit"
    rows, keys = await read_store(postgres_url)
    assert [(r.outcome, r.cost_usd) for r in rows] == [("complete", price(10, output=20))]
    assert [k.spent_usd for k in keys] == [price(10, output=20)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_reply_whose_row_cannot_be_written_fails_unbilled(
    linked_gateway, upstream, postgres_url, caplog, stream
):
    """The database is out of reach while the reply ends (the connection refused: a
    ConnectionError, which the stream must not take for the client leaving). The outage is
    logged once and the reply counted among its refusals, a stream's as a whole reply's."""
    gateway, link = linked_gateway
    async with gateway.client() as client:  # the key is looked up (and cached) while the link is up
        await client.models.list()
    upstream.enqueue(Scenario(blocks=long_text_blocks(), event_delay=0.02, usage={"input_tokens": 10}))
    link.cut()
    status, body = await post_reading_all(gateway, stream)
    # The row could not be written because the database is out of reach: the error says so.
    unavailable = "The gateway's database is unavailable; try again shortly."
    if stream:
        assert status == 200
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error == {"message": unavailable, "type": "server_error", "param": None, "code": None}
    else:
        assert status == 503
        error = json.loads(body)["error"]
        assert error == {"message": unavailable, "type": "server_error", "param": None, "code": "store_unavailable"}
    outage = [r.getMessage() for r in caplog.records if "database is unavailable" in r.getMessage()]
    assert len(outage) == 1 and not [r for r in caplog.records if "stream to the client failed" in r.getMessage()]
    async with aiohttp.ClientSession() as http, http.get(gateway.url + "/metrics") as response:
        assert "\nezat_store_unavailable_total 1.0\n" in await response.text()
    link.restore()
    rows, keys = await read_store(postgres_url)
    assert rows == []
    assert [k.spent_usd for k in keys] == [0]


async def test_a_client_gone_during_an_outage_is_counted_not_a_traceback(linked_gateway, upstream, caplog):
    """The client leaves mid-stream while the database is out of reach: its row cannot be
    written as the stream closes, which the outage tells once and counts, with no traceback."""
    gateway, link = linked_gateway
    async with gateway.client() as client:  # the key is looked up (and cached) while the link is up
        await client.models.list()
    upstream.enqueue(Scenario(blocks=long_text_blocks(), event_delay=0.05, usage={"input_tokens": 40}, pings=0))
    async with posted(gateway, stream=True) as response:
        async with asyncio.timeout(5):
            while b'"content":"' not in await response.content.readany():
                pass
        link.cut()
    await upstream.wait_disconnect(timeout=1)
    async with asyncio.timeout(5):
        while not any("database is unavailable" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # anything the stream's end would log, logged
    assert not [r for r in caplog.records if r.exc_info or "stream to the client failed" in r.getMessage()]
    async with aiohttp.ClientSession() as http, http.get(gateway.url + "/metrics") as metrics:
        assert "\nezat_store_unavailable_total 1.0\n" in await metrics.text()
    link.restore()


# --- group commit under load


async def test_200_concurrent_requests_give_200_rows_and_the_exact_total(start_gateway, upstream, storage_url):
    gateway = await start_gateway(make_config(upstream.url, storage_url))
    store = gateway.app[STORE]
    count = 200
    # Each output at least what its text could be ("answer 199": 3 tokens), so billed as reported.
    usages = [{"input_tokens": 100 + i, "output_tokens": 3 + i % 37} for i in range(count)]
    upstream.enqueue(
        *(Scenario(blocks=[{"type": "text", "text": f"answer {i}"}], usage=u) for i, u in enumerate(usages))
    )

    async with gateway.client() as client:
        sent = await asyncio.gather(*(send(client, stream=i % 2 == 0) for i in range(count)))

    rows = await store.ledger()
    assert len(rows) == count
    assert len({row.request_id for row in rows}) == count
    by_id = {row.request_id: row for row in rows}
    assert set(by_id) == {s.request_id for s in sent}
    for s in sent:  # each row bills exactly what its reply reported
        row = by_id[s.request_id]
        assert (row.input_tokens, row.output_tokens) == (s.usage.prompt_tokens, s.usage.completion_tokens)
        assert row.cost_usd == price(row.input_tokens, output=row.output_tokens)
        assert row.outcome == "complete"
    total = sum(price(u["input_tokens"], output=u["output_tokens"]) for u in usages)
    assert sum(row.cost_usd for row in rows) == total
    key = await key_id(store)
    assert await store.spent(key) == total
    assert (await store.list_keys())[0].spent_usd == total


# --- the key's errors: 403, 402, 429, 401


FORBIDDEN_MODEL = f"This key may not use the model `{MODEL}`."
RATE_LIMITED = "Too many requests for this key; wait and try again."
REVOKED = "This API key has been revoked."


def assert_error(exc: openai.APIStatusError, status: int, type_: str, code: str | None, message: str) -> None:
    assert exc.status_code == status
    assert (exc.type, exc.code) == (type_, code)
    assert exc.body["message"]
    assert exc.body == {"message": message, "type": type_, "param": None, "code": code}


async def assert_rate_limited(client: openai.AsyncOpenAI, waits: range) -> None:
    """The key is over its rate: a 429 whose retry-after is the whole seconds until its bucket
    has a token again (one of `waits`: a little time passes between the requests), streamed and not."""
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as caught:
            await send(client, stream=stream)
        assert_error(caught.value, 429, "rate_limit_error", "rate_limit_exceeded", RATE_LIMITED)
        retry_after = caught.value.response.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert int(retry_after) in waits


async def test_model_outside_the_keys_globs_is_403(start_gateway, upstream):
    gateway = await start_gateway(config_with(upstream, models=("test/*", "openai/*")))
    async with gateway.client() as client:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await send(client, stream=False)
        assert_error(caught.value, 403, "permission_error", None, FORBIDDEN_MODEL)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await send(client, stream=True)
        assert_error(caught.value, 403, "permission_error", None, FORBIDDEN_MODEL)
        assert upstream.requests == []
        await send(client, stream=False, model="test/small")  # a model the globs do match
    assert len(upstream.requests) == 1
    assert len(await gateway.app[STORE].ledger()) == 1
    assert [row.model for row in await gateway.app[STORE].ledger()] == ["test/small"]


async def test_matching_glob_allows_the_model(start_gateway, upstream):
    gateway = await start_gateway(config_with(upstream, models=("anthropic/claude-*",)))
    async with gateway.client() as client:
        await send(client, stream=False)
        await send(client, stream=True)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await send(client, stream=False, model="test/small")
        assert_error(caught.value, 403, "permission_error", None, "This key may not use the model `test/small`.")
    assert len(upstream.requests) == 2
    assert [row.model for row in await gateway.app[STORE].ledger()] == [MODEL, MODEL]


async def test_spend_limit_reached_is_402(start_gateway, upstream, storage_url):
    plain = CASES["plain"]
    limit = 2 * plain.cost  # two plain requests reach it exactly
    gateway = await start_gateway(config_with(upstream, storage_url, spend_limit_usd=limit))
    store = gateway.app[STORE]
    upstream.enqueue(*(Scenario(blocks=plain.blocks, usage=plain.usage) for _ in range(3)))

    async with gateway.client() as client:
        await send(client, stream=False)  # spent 0
        await send(client, stream=True)  # spent 0.0105, below the limit
        assert await store.spent(await key_id(store)) == limit
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as caught:
                await send(client, stream=stream)
            assert_error(
                caught.value,
                402,
                "insufficient_quota",
                "insufficient_quota",
                f"This key has reached its spend limit of ${limit}.",
            )
    assert len(upstream.requests) == 2
    assert len(await store.ledger()) == 2
    assert (await store.list_keys())[0].spent_usd == limit


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_rpm_exceeded_is_429_with_retry_after(start_gateway, upstream, ratelimit_url):
    gateway = await start_gateway(config_with(upstream, ratelimit_url=ratelimit_url, rpm=2))
    async with gateway.client() as client:
        await send(client, stream=False)
        await send(client, stream=True)
        await assert_rate_limited(client, range(25, 31))  # 2 a minute: a request every 30 s
    assert len(upstream.requests) == 2
    assert len(await gateway.app[STORE].ledger()) == 2


async def test_rpm_limit_is_shared_by_two_gateways_through_redis(start_gateway, upstream, redis_url, tmp_path):
    # Two replicas of one deployment: the same key store, the same Redis.
    config = config_with(upstream, f"sqlite:///{tmp_path / 'shared.db'}", ratelimit_url=redis_url, rpm=3)
    first, second = await start_gateway(config), await start_gateway(config)
    async with first.client() as a, second.client() as b:
        await send(a, stream=False)
        await send(b, stream=False)
        await send(a, stream=True)
        for client in (a, b):
            with pytest.raises(openai.RateLimitError) as caught:
                await send(client, stream=False)
            assert_error(caught.value, 429, "rate_limit_error", "rate_limit_exceeded", RATE_LIMITED)
    assert len(upstream.requests) == 3


async def test_tpm_exceeded_after_a_large_response_is_429(start_gateway, upstream, ratelimit_url):
    gateway = await start_gateway(config_with(upstream, ratelimit_url=ratelimit_url, tpm=1000))
    upstream.enqueue(Scenario(usage={"input_tokens": 10, "output_tokens": 5000}))
    async with gateway.client() as client:
        first = await send(client, stream=True)
        assert first.usage.total_tokens == 5010  # five times the key's tokens per minute
        # 4010 tokens over the limit, plus what the next request reserves (its 256 output
        # tokens and its input, estimated from a body of a few hundred bytes), at 1000 a
        # minute: 240.6 s for the debt and 15.4 s or a little more for the reservation.
        await assert_rate_limited(client, range(250, 275))
    assert len(upstream.requests) == 1


async def test_rate_limits_fail_open_when_redis_is_unreachable(start_gateway, upstream):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    gateway = await start_gateway(config_with(upstream, ratelimit_url=url, rpm=1, tpm=10))
    async with gateway.client() as client:
        started = time.monotonic()
        for stream in (False, True, False, True):
            await send(client, stream=stream)
        assert time.monotonic() - started < 10  # no long wait per request for the dead Redis
    assert len(upstream.requests) == 4
    assert len(await gateway.app[STORE].ledger()) == 4  # and they are billed as usual


# --- revocation


async def test_revoked_key_is_refused_at_once_without_a_key_cache(start_gateway, upstream, storage_url):
    gateway = await start_gateway(make_config(upstream.url, storage_url), key_cache_seconds=0)
    store = gateway.app[STORE]
    async with gateway.client() as client:
        await send(client, stream=False)
        assert (await store.update_key(await key_id(store), revoked=True)).revoked
        for stream in (False, True):
            with pytest.raises(openai.AuthenticationError) as caught:
                await send(client, stream=stream)
            assert_error(caught.value, 401, "invalid_request_error", "invalid_api_key", REVOKED)
    assert len(upstream.requests) == 1
    assert len(await store.ledger()) == 1


async def test_revoked_key_is_refused_within_the_key_cache_time(start_gateway, upstream, storage_url):
    cache_seconds = 0.5
    gateway = await start_gateway(make_config(upstream.url, storage_url), key_cache_seconds=cache_seconds)
    store = gateway.app[STORE]
    async with gateway.client() as client:
        await send(client, stream=False)
        await store.update_key(await key_id(store), revoked=True)
        revoked_at = time.monotonic()
        refused = None
        async with asyncio.timeout(cache_seconds + 5):
            while refused is None:
                try:
                    await send(client, stream=False)
                except openai.AuthenticationError as exc:
                    refused = exc
                else:
                    await asyncio.sleep(0.05)
        assert time.monotonic() - revoked_at <= cache_seconds + 1
        assert_error(refused, 401, "invalid_request_error", "invalid_api_key", REVOKED)
