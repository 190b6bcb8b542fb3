"""Real `ezat-gateway serve` processes: the ledger survives SIGKILL mid-load, and replicas
sharing PostgreSQL and Redis enforce one spend limit and one rate limit."""

from __future__ import annotations

import asyncio
import signal
import time
from decimal import Decimal

import aiohttp
import openai
import pytest

from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, read_store


def cost(input_tokens: int, output_tokens: int) -> Decimal:
    """USD at the test model's prices: 3 per million input tokens, 15 per million output."""
    return (input_tokens * Decimal(3) + output_tokens * Decimal(15)) / Decimal(1_000_000)


# --- A crash loses no row of a finished reply.

CLIENTS = 30
LOAD_SECONDS = 1.5
USAGE = {"input_tokens": 10, "output_tokens": 20}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    """A real SQLite file, or the PostgreSQL test schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("postgres_url")


async def test_sigkill_mid_load_loses_no_row_of_a_finished_reply(storage_url, tmp_path, upstream):
    # Streams take about a tenth of a second each, so some are always mid-reply when the kill lands
    # (at a few hundredths, a loaded machine once saw every reply in flight already whole).
    upstream.enqueue(*(Scenario(usage=USAGE, event_delay=0.01) for _ in range(50_000)))
    gateway = ServeProcess(tmp_path, "gateway", SERVE_CONFIG, storage_url=storage_url, upstream_url=upstream.url)

    finished: set[str] = set()  # request ids of replies the client received whole
    cut: set[str] = set()  # request ids whose reply had begun but not finished at the kill
    failures: list[str] = []  # anything going wrong before the kill
    killed = asyncio.Event()

    async def client(number: int, http: aiohttp.ClientSession) -> None:
        for n in range(1_000_000):
            if killed.is_set():
                return
            stream = (number + n) % 2 == 0
            body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": f"c{number} r{n}"}]}
            rid = None
            try:
                async with http.post(gateway.url + "/openai/v1/chat/completions", json=body) as response:
                    rid = response.headers["request-id"]
                    if response.status != 200:
                        failures.append(f"{rid}: {response.status} {await response.text()}")
                        continue
                    if stream:
                        # Noted the moment `data: [DONE]` arrives: a reply the client has seen end.
                        async for line in response.content:
                            if line.startswith(b'data: {"error"'):
                                failures.append(f"{rid}: {line!r}")
                            elif line.rstrip() == b"data: [DONE]":
                                finished.add(rid)
                    else:
                        completion = await response.json()
                        assert completion["choices"][0]["message"]["content"], completion
                        finished.add(rid)
            except (TimeoutError, aiohttp.ClientError) as exc:
                if not killed.is_set():
                    failures.append(f"{rid}: {exc!r}")
            if rid is not None and rid not in finished and killed.is_set():
                cut.add(rid)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {KEY}"}) as http:
        tasks: list[asyncio.Task] = []
        try:
            await gateway.start()
            tasks = [asyncio.create_task(client(i, http)) for i in range(CLIENTS)]
            began = time.monotonic()
            while time.monotonic() - began < LOAD_SECONDS or len(finished) < 100:
                assert time.monotonic() - began < 15, f"only {len(finished)} replies in 15 s:\n{gateway.output()}"
                assert not failures, failures[:5]
                await asyncio.sleep(0.05)
            killed.set()
            await gateway.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        finally:
            killed.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.stop()
            print(gateway.output())

    assert gateway.process.returncode == -signal.SIGKILL
    assert not failures, failures[:5]
    assert cut, "the kill landed between requests, not mid-load"

    rows, (key,) = await read_store(storage_url)
    by_id = {row.request_id: row for row in rows}
    assert len(by_id) == len(rows), "a request billed twice"
    lost = finished - by_id.keys()
    assert not lost, f"{len(lost)} of {len(finished)} finished replies have no ledger row"
    for rid in finished:
        assert by_id[rid].outcome == "complete"
        assert by_id[rid].cost_usd == cost(10, 20)
    # Each batch's rows and the key's spend are one transaction: the crash leaves them in step.
    assert key.spent_usd == sum((row.cost_usd for row in rows), Decimal(0))


# --- Two replicas sharing PostgreSQL and Redis enforce one limit.


async def start_replicas(tmp_path, postgres_url, redis_url, upstream, key_fields) -> list[ServeProcess]:
    replicas = [
        ServeProcess(
            tmp_path,
            name,
            SERVE_CONFIG,
            storage_url=postgres_url,
            ratelimit_url=redis_url,
            upstream_url=upstream.url,
            key_fields=key_fields,
        )
        for name in ("replica-a", "replica-b")
    ]
    # Started together, as replicas are: both migrate the same database and sync the same key.
    await asyncio.gather(*(replica.start() for replica in replicas))
    return replicas


async def stop_replicas(replicas: list[ServeProcess]) -> None:
    await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)
    for replica in replicas:
        print(replica.config.name, replica.output(), sep="\n")


async def ask(replica: ServeProcess, *, stream: bool = False) -> str:
    # At most 200 output tokens: a request's worst case ($0.003 and its input) fits a spend limit
    # until the key has spent it.
    request = dict(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Hi"}])
    async with replica.client() as client:
        if stream:
            chunks = await client.chat.completions.create(stream=True, **request)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        completion = await client.chat.completions.create(**request)
        return completion.choices[0].message.content


@pytest.mark.services
async def test_replicas_enforce_one_spend_limit(tmp_path, postgres_url, redis_url, upstream):
    each = cost(1000, 200)  # 0.006 USD
    assert each == Decimal("0.006")
    upstream.enqueue(*(Scenario(usage={"input_tokens": 1000, "output_tokens": 200}) for _ in range(3)))
    replicas: list[ServeProcess] = []
    try:
        replicas = a, b = await start_replicas(
            tmp_path, postgres_url, redis_url, upstream, key_fields="spend_limit_usd = 0.018"
        )
        # Alternating: after three requests the key has spent exactly its limit, in total.
        assert await ask(a)
        assert await ask(b)
        assert await ask(a, stream=True)
        for replica in (b, a):
            with pytest.raises(openai.APIStatusError) as refused:
                await ask(replica)
            assert refused.value.status_code == 402
            assert (refused.value.type, refused.value.code) == ("insufficient_quota", "insufficient_quota")
            with pytest.raises(openai.APIStatusError) as refused:
                await ask(replica, stream=True)
            assert refused.value.status_code == 402
    finally:
        await stop_replicas(replicas)

    assert len(upstream.requests) == 3  # refused requests never reach the upstream
    rows, (key,) = await read_store(postgres_url)
    assert [row.cost_usd for row in rows] == [each] * 3
    assert [row.outcome for row in rows] == ["complete"] * 3
    assert key.spent_usd == Decimal("0.018")


@pytest.mark.services
async def test_replicas_enforce_one_rate_limit(tmp_path, postgres_url, redis_url, upstream):
    replicas: list[ServeProcess] = []
    try:
        replicas = a, b = await start_replicas(tmp_path, postgres_url, redis_url, upstream, key_fields="rpm = 4")
        for replica in (a, b, a, b):
            assert await ask(replica)
        for replica in (a, b):
            with pytest.raises(openai.RateLimitError) as limited:
                await ask(replica)
            assert limited.value.status_code == 429
            assert (limited.value.type, limited.value.code) == ("rate_limit_error", "rate_limit_exceeded")
            # 4 a minute is one every 15 s; the test used a few seconds of that at most.
            assert 10 <= int(limited.value.response.headers["retry-after"]) <= 15
    finally:
        await stop_replicas(replicas)

    assert len(upstream.requests) == 4
    rows, _ = await read_store(postgres_url)
    assert len(rows) == 4  # limited requests are not billed
