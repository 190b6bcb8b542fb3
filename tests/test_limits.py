"""Limits that hold under concurrency: a request reserves its worst-case cost and its token
estimate at admission, so concurrent requests cannot all pass on one balance; the reservation
is settled to what the request used, or given back when it fails; it holds across workers on
one SQLite file and across replicas on one PostgreSQL database; and several workers never
multiply a key's rate."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

import openai
import orjson
import pytest
from yarl import URL

from gateway.app import STORE
from gateway.config import ImagesConfig, KeyConfig, RateLimitConfig, ServerConfig, StorageConfig
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, SERVE_CONFIG, Link, ServeProcess, make_config, read_store, run_command
from tests.test_images import PNG, ImageServer
from tests.test_routing import both_workers_listening

# About 5,000 tokens of text (4 characters a token, the gateway's estimate), and a small output
# limit: a request's reservation is its body's size over four, plus 100.
LONG = [{"role": "user", "content": "Read this. " * 1_800}]
# A short answer of few tokens (the mock's default echoes the long question back).
SMALL = dict(
    blocks=[{"type": "text", "text": "Done."}],
    usage={"input_tokens": 20, "output_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
)


def limited_config(upstream, **key_fields):
    config = make_config(upstream.url)
    key = KeyConfig(name="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest(), **key_fields)
    return replace(config, keys=(key,))


async def ask(client, *, stream: bool = False) -> str:
    """A request's outcome, read to its end: "ok", the status it was refused with, or "failed"
    for a stream that failed after it began."""
    try:
        reply = await client.chat.completions.create(model=MODEL, max_tokens=100, messages=LONG, stream=stream)
        if stream:
            async for _ in reply:
                pass
    except openai.APIStatusError as error:
        return str(error.status_code)
    except openai.APIError:
        return "failed"
    return "ok"


async def test_concurrent_requests_admitted_only_as_far_as_their_estimates_fit_the_tpm(
    start_gateway, upstream, ratelimit_url
):
    config = replace(limited_config(upstream, tpm=20_000), ratelimit=RateLimitConfig(url=ratelimit_url))
    gateway = await start_gateway(config)
    # Each answer takes long enough (the bucket refills at 333 tokens a second) that all 30 are
    # admitted or refused before any settles; each is ~5,100 tokens.
    upstream.enqueue(*[Scenario(delay=3.0) for _ in range(30)])
    async with gateway.client() as client:
        outcomes = await asyncio.gather(*(ask(client) for _ in range(30)))
    # 20,000 tokens a minute hold three reservations of 5,100 to 5,300 tokens, not four.
    assert outcomes.count("ok") == 3
    assert outcomes.count("429") == 27
    assert len(upstream.requests) == 3


async def test_a_reservation_is_settled_to_what_the_request_used(start_gateway, upstream):
    gateway = await start_gateway(limited_config(upstream, tpm=10_000))
    # Each request reserves ~5,100 tokens and uses 30: what it did not use goes back at once, so
    # requests one after another keep passing, though two reservations would not fit together.
    upstream.enqueue(*[Scenario(**SMALL) for _ in range(6)])
    async with gateway.client() as client:
        assert [await ask(client) for _ in range(3)] == ["ok"] * 3
        assert [await ask(client, stream=True) for _ in range(3)] == ["ok"] * 3


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_request_gives_its_reservation_back(start_gateway, upstream, stream):
    gateway = await start_gateway(limited_config(upstream, tpm=10_000))
    # Refused by the upstream before any output, then overloaded (or, streamed, failed after
    # it began): none of them billed, and none keeps its ~5,100 tokens.
    failures = {"400": Scenario(status=400, error_message="prompt is too long")}
    failures.update({"failed": Scenario(error_after=6)} if stream else {"503": Scenario(status=529)})
    upstream.enqueue(*failures.values(), Scenario(**SMALL), Scenario(**SMALL))
    async with gateway.client() as client:
        assert [await ask(client, stream=stream) for _ in failures] == list(failures)
        # Two more fit, one after the other, as if the failures had never been.
        assert [await ask(client, stream=stream), await ask(client, stream=stream)] == ["ok", "ok"]


async def test_a_request_larger_than_the_tpm_still_runs_on_a_full_bucket(start_gateway, upstream):
    gateway = await start_gateway(limited_config(upstream, tpm=1_000))
    async with gateway.client() as client:
        assert await ask(client) == "ok"  # ~5,100 tokens: more than a minute's worth
        assert await ask(client) == "429"  # and the key waits for its debt


# --- Workers without Redis


async def test_serve_with_workers_refuses_rate_limited_keys_without_redis(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        SERVE_CONFIG.format(
            port=8080,
            storage_url=f"sqlite:///{tmp_path / 'gw.db'}",
            ratelimit_url="",
            upstream_url="http://127.0.0.1:9",
            upstream_key="k",
            model=MODEL,
            upstream_model="m",
            key=KEY,
            key_fields="rpm = 10",
        )
    )
    status, output = await run_command("serve", "--config", str(path), "--workers", "2", cwd=tmp_path)
    assert status == 1
    assert "--workers 2 needs [ratelimit] url (Redis) for keys with rpm, tpm or max_concurrent (test)" in output
    assert "Traceback" not in output


async def test_a_worker_refuses_a_key_that_gained_rate_limits_since_the_start(start_gateway, upstream):
    # One of two workers without Redis: a key with limits that `serve` did not see at its start
    # (one made or changed with the CLI) is refused, never let through at twice its rate.
    config = limited_config(upstream, rpm=10)
    gateway = await start_gateway(replace(config, server=ServerConfig(workers=2)))
    async with gateway.client() as client:
        with pytest.raises(openai.InternalServerError) as error:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert error.value.body["message"] == (
        "This key has rate limits, which several workers can only share through [ratelimit] url (Redis)."
    )
    assert upstream.requests == []


# --- Spend limits that concurrency cannot overshoot

# A request of 1,000 output tokens at most, answered with all of them: it may cost, and costs,
# about $0.015 (1,000 tokens at $15 a million, its ~60 input tokens at most $3.75 a million).
SPEND_LIMIT = Decimal("0.05")  # room for three such requests, not four
COSTLY = dict(blocks=[{"type": "text", "text": "Done."}], usage={"output_tokens": 1000}, delay=0.5)
HI = [{"role": "user", "content": "Tell me about Oslo."}]


async def spend(url: str, count: int) -> list[str]:
    """`count` requests at once to the gateway at `url`: each one's outcome ("ok" or a status)."""
    async with openai.AsyncOpenAI(base_url=url + "/openai/v1", api_key=KEY, max_retries=0) as client:

        async def one() -> str:
            try:
                await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
            except openai.APIStatusError as error:
                assert error.status_code == 402, error
                assert error.body["code"] == "insufficient_quota"
                message = error.body["message"]
                assert message.startswith("This key has $") and "left of its spend limit of $0.05, less than" in message
                assert message.endswith("; a lower max_tokens would fit.")
                return "402"
            return "ok"

        return await asyncio.gather(*(one() for _ in range(count)))


def assert_within_the_limit(outcomes: list[str], rows) -> None:
    assert outcomes.count("ok") == 3 and outcomes.count("402") == len(outcomes) - 3
    assert len(rows) == 3
    assert sum(row.cost_usd for row in rows) <= SPEND_LIMIT


async def test_40_parallel_requests_never_spend_past_the_limit(start_gateway, upstream, tmp_path):
    storage = f"sqlite:///{tmp_path / 'spend.db'}"
    config = replace(limited_config(upstream, spend_limit_usd=SPEND_LIMIT), storage=StorageConfig(url=storage))
    gateway = await start_gateway(config)
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(40)])
    outcomes = await spend(gateway.url, 40)
    await gateway.runner.cleanup()  # every row written
    rows, _ = await read_store(storage)
    assert_within_the_limit(outcomes, rows)


async def test_max_tokens_above_the_models_maximum_gets_its_400_not_a_limits(start_gateway, upstream):
    """A chat completion's max_tokens above the model's maximum is refused as such (the
    translator's 400), not held against the key's limits first: 128,000 output tokens would
    not fit $1.50 or 70,000 tpm; the model's 64,000, which is all it could write, do."""
    gateway = await start_gateway(limited_config(upstream, spend_limit_usd=Decimal("1.50"), tpm=70_000))
    async with gateway.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, max_tokens=128_000, messages=HI)
    assert caught.value.body["message"] == "max_tokens: at most 64000 for this model"
    assert upstream.requests == []


@pytest.mark.parametrize(("max_stream_duration", "expected"), [(1800.0, 3600.0), (7200.0, 7200 + 4 * 310 + 60)])
async def test_a_reservation_outlives_the_longest_a_request_may_run(
    start_gateway, upstream, tmp_path, max_stream_duration, expected
):
    """A reservation that its process never settles expires after an hour; where a deployment
    lets a stream run longer (4 attempts of 10 s to connect and 300 s to a first token, then its
    maximum duration), only after that, so that none expires under a live request."""
    storage = f"sqlite:///{tmp_path / 'spend.db'}"
    config = replace(limited_config(upstream, spend_limit_usd=SPEND_LIMIT), storage=StorageConfig(url=storage))
    deployments = tuple(replace(d, max_stream_duration_seconds=max_stream_duration) for d in config.deployments)
    gateway = await start_gateway(replace(config, deployments=deployments))
    upstream.enqueue(Scenario(**{**COSTLY, "delay": 1.0}))
    async with gateway.client() as client:
        answer = asyncio.create_task(client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI))
        async with asyncio.timeout(10):
            while not (held := await sqlite_rows(tmp_path / "spend.db", "SELECT expires_at FROM reservations")):
                await asyncio.sleep(0.02)
        await answer
    expires = datetime.fromisoformat(held[0][0])
    assert expected - 5 < (expires - datetime.now(UTC)).total_seconds() <= expected


async def sqlite_rows(path, query: str) -> list[tuple]:
    def read():
        with closing(sqlite3.connect(path)) as db:
            return db.execute(query).fetchall()

    return await asyncio.to_thread(read)


async def test_a_refused_or_failed_request_leaves_no_reservation(start_gateway, upstream):
    gateway = await start_gateway(limited_config(upstream, spend_limit_usd=SPEND_LIMIT))
    # Three that fail hold nothing afterwards: three that succeed still fit, one at a time.
    upstream.enqueue(*[Scenario(status=400) for _ in range(3)], *[Scenario(**{**COSTLY, "delay": 0}) for _ in range(3)])
    async with gateway.client() as client:
        for _ in range(3):
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
        with pytest.raises(openai.APIStatusError) as error:  # now the spend itself is near the limit
            await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
    assert error.value.status_code == 402


async def test_two_workers_on_one_sqlite_file_hold_one_spend_limit(tmp_path, upstream):
    storage = f"sqlite:///{tmp_path / 'spend.db'}"
    served = ServeProcess(
        tmp_path,
        "gateway",
        SERVE_CONFIG,
        storage_url=storage,
        upstream_url=upstream.url,
        key_fields=f"spend_limit_usd = {SPEND_LIMIT}",
    )
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(40)])
    try:
        await served.start("--workers", "2")
        # Both workers listen before the 40 connections come: the kernel spreads them over the two.
        await both_workers_listening(served, within=15)
        outcomes = await spend(served.url, 40)
    finally:
        await served.stop()
    rows, _ = await read_store(storage)
    assert_within_the_limit(outcomes, rows)


async def test_two_gateways_on_one_postgresql_database_hold_one_spend_limit(tmp_path, upstream, postgres_url):
    gateways = [
        ServeProcess(
            tmp_path,
            name,
            SERVE_CONFIG,
            storage_url=postgres_url,
            upstream_url=upstream.url,
            key_fields=f"spend_limit_usd = {SPEND_LIMIT}",
        )
        for name in ("one", "two")
    ]
    upstream.enqueue(*[Scenario(**COSTLY) for _ in range(40)])
    try:
        for gateway in gateways:
            await gateway.start()
        halves = await asyncio.gather(spend(gateways[0].url, 20), spend(gateways[1].url, 20))
    finally:
        for gateway in gateways:
            await gateway.stop()
    rows, _ = await read_store(postgres_url)
    assert_within_the_limit([*halves[0], *halves[1]], rows)


# --- Requests at once


async def test_a_client_gone_while_its_place_is_taken_gives_the_place_back(start_gateway, upstream, redis_url):
    """The client hangs up while the gateway waits for Redis to give it a place among the key's
    running requests: Redis gives it all the same, and the request, cancelled, gives it back.
    Else the key's one place stays taken for an hour."""
    link = await Link(URL(redis_url).port or 6379).start()
    config = replace(limited_config(upstream, max_concurrent=1), ratelimit=RateLimitConfig(url=link.url(redis_url)))
    gateway = await start_gateway(config)
    async with gateway.client() as client:  # a first request: Redis has the limiter's scripts from here on
        await client.chat.completions.create(model=MODEL, messages=HI)
    link.reply_delay = 0.3  # Redis answers slowly
    asked = link.arrived(b"EVALSHA")  # the limiter's script that gives a place
    body = orjson.dumps({"model": MODEL, "messages": HI})
    reader, writer = await asyncio.open_connection("127.0.0.1", URL(gateway.url).port)
    writer.write(
        b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    try:
        await asyncio.wait_for(asked.wait(), 10)  # the gateway asked Redis for a place: gone before the answer
        writer.close()
        await asyncio.sleep(1)  # Redis's answer, then what the cancelled request gives back
        async with gateway.client() as client:
            answer = await client.chat.completions.create(model=MODEL, messages=HI)
    finally:
        await link.close()
    assert answer.choices[0].message.content.startswith("Hello from the mock upstream")
    assert len(upstream.requests) == 2  # the one whose client left never reached it


async def test_max_concurrent_refuses_the_third_stream_and_the_first_two_finish(start_gateway, upstream, ratelimit_url):
    config = replace(limited_config(upstream, max_concurrent=2), ratelimit=RateLimitConfig(url=ratelimit_url))
    gateway = await start_gateway(config)
    # Two slow streams, then a quick answer for the request that comes after they end.
    upstream.enqueue(Scenario(event_delay=0.2), Scenario(event_delay=0.2), Scenario())
    async with gateway.client() as client:

        async def stream() -> str:
            chunks = await client.chat.completions.create(model=MODEL, stream=True, messages=HI)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

        first, second = asyncio.create_task(stream()), asyncio.create_task(stream())
        async with asyncio.timeout(10):
            while len(upstream.requests) < 2:  # both have begun
                await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=MODEL, messages=HI)
        assert refused.value.body["message"] == (
            "This key already runs 2 requests, the most it may at once; wait for one to finish."
        )
        assert refused.value.response.headers["retry-after"] == "1"
        assert await first == await second == "Hello from the mock upstream. You said: Tell me about Oslo."
        # Both done: their places are free again.
        await client.chat.completions.create(model=MODEL, messages=HI)
    assert len(upstream.requests) == 3


# --- One key's image URLs cannot take every download


async def test_one_keys_downloads_cannot_starve_another_keys(start_gateway, upstream):
    server = await ImageServer().start()
    try:
        slow = [server.serve(f"/slow/{i}.png", PNG, delay=3.0) for i in range(60)]
        quick = server.serve("/quick.png", PNG)
        keys = tuple(
            KeyConfig(name=name, key_sha256=hashlib.sha256(name.encode()).hexdigest()) for name in ("sk-a", "sk-b")
        )
        config = replace(make_config(upstream.url), keys=keys, images=ImagesConfig(allow_private_hosts=True))
        gateway = await start_gateway(config)

        def look(urls):
            return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]}]

        async with gateway.client(api_key="sk-a") as a, gateway.client(api_key="sk-b") as b:
            flood = [
                asyncio.create_task(a.chat.completions.create(model=MODEL, messages=look(slow[i : i + 20])))
                for i in (0, 20, 40)
            ]
            async with asyncio.timeout(10):
                while server.in_flight < 16:  # key a's downloads are under way...
                    await asyncio.sleep(0.01)
            await b.chat.completions.create(model=MODEL, messages=look([quick]))  # ...and b's goes past them
            # None of key a's first 16 downloads had ended (one ending would have started a 17th):
            # b's image did not wait for them.
            assert sum(server.hits[f"/slow/{i}.png"] for i in range(60)) == 16
            await asyncio.gather(*flood)
    finally:
        await server.close()
    assert server.max_in_flight <= 16 + 1  # key a's 16 at once, and b's one


# --- What the operator sees


async def test_keys_list_shows_each_keys_spend_reservations_and_limits(tmp_path, upstream):
    storage = f"sqlite:///{tmp_path / 'gw.db'}"
    made = ["keys", "create", "--storage", storage, "--name", "batch", "--spend-limit", "2", "--max-concurrent", "3"]
    assert (await run_command(*made, cwd=tmp_path))[0] == 0
    served = ServeProcess(
        tmp_path,
        "gateway",
        SERVE_CONFIG,
        storage_url=storage,
        upstream_url=upstream.url,
        key_fields=f"spend_limit_usd = {SPEND_LIMIT}",
    )
    upstream.enqueue(Scenario(**{**COSTLY, "delay": 6.0}))
    try:
        await served.start()
        answer = asyncio.create_task(spend(served.url, 1))
        async with asyncio.timeout(10):
            while not upstream.requests:  # admitted, and so holding its worst case
                await asyncio.sleep(0.02)
        status, listed = await run_command("keys", "list", "--storage", storage, cwd=tmp_path)
        assert status == 0, listed
        await answer
    finally:
        await served.stop()
    header, *lines = listed.splitlines()
    names = header.split()
    starts = [header.index(name) for name in names]  # the table's columns, blank where a value is none
    rows = {}
    for line in lines:
        cells = [line[start:end].strip() for start, end in zip(starts, [*starts[1:], None])]
        rows[cells[1]] = dict(zip(names, cells))
    assert names[:6] == ["id", "name", "models", "spent_usd", "reserved_usd", "spend_limit_usd"]
    assert (rows["batch"]["spend_limit_usd"], rows["batch"]["max_concurrent"], rows["batch"]["reserved_usd"]) == (
        "2.0000",
        "3",
        "0.0000",
    )
    assert Decimal("0.015") < Decimal(rows["test"]["reserved_usd"]) < Decimal("0.016")  # its request's worst case


async def test_a_request_refused_after_admission_gives_back_all_it_held(start_gateway, upstream):
    key_limits = dict(spend_limit_usd=SPEND_LIMIT, tpm=20_000, max_concurrent=1)
    gateway = await start_gateway(
        replace(limited_config(upstream, **key_limits), storage=StorageConfig(url="sqlite:///:memory:"))
    )
    private_image = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}
    ]
    upstream.enqueue(*[Scenario(**{**COSTLY, "delay": 0}) for _ in range(3)])
    async with gateway.client() as client:
        # Admitted by limits (its spend, its tokens, its one place), then refused: by the
        # translator (a bad field), by the images stage (a private host).
        for refused in ({"messages": HI, "stop": 5}, {"messages": private_image}):
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, max_tokens=1000, **refused)
        assert await gateway.app[STORE].reserved() == {}
        # Nothing is left held: three worst cases fit, one at a time in the key's one place.
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, max_tokens=1000, messages=HI)
    assert len(await gateway.app[STORE].ledger()) == 3  # the refused ones are not billed
