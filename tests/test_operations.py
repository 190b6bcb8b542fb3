"""What an operator sees, through the real server: GET /metrics parsed by prometheus-client's own
parser (its counters against the ledger), the access log (JSON lines from a real `serve`), GET
/readyz (the store or Redis down, and the drain after SIGTERM), OpenTelemetry spans (the SDK's
in-memory exporter, and a real OTLP/HTTP receiver on loopback) and the Grafana dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import re
import signal
import time
from decimal import Decimal
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aioresponses import aioresponses
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from gateway.app import STORE
from gateway.config import (
    ConfigError,
    Deployment,
    ImagesConfig,
    KeyConfig,
    MetricsConfig,
    RateLimitConfig,
    TracingConfig,
    parse_config,
)
from gateway.mock.bedrock import BedrockMock
from gateway.mock.upstream import Scenario
from gateway.mock.vertex import VertexMock
from gateway.ops.logs import TextFormatter
from gateway.ops.tracing import Tracing
from tests.support import (
    KEY,
    MODEL,
    SERVE_CONFIG,
    UPSTREAM_KEY,
    UPSTREAM_MODEL,
    Link,
    ServeProcess,
    free_port,
    make_config,
    read_store,
    run_command,
    served,
)
from tests.test_images import PNG, FakedResponse, fake_get

HELLO = [{"role": "user", "content": "Hello"}]
LIMITED = "sk-limited-key"
DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "ezat-gateway.json"


async def scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple], float]:
    """GET /metrics, parsed: {(sample name, sorted labels): value}."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics", headers=headers) as response:
            assert response.status == 200, await response.text()
            assert response.content_type == "text/plain"
            text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def two_deployments(upstream_url: str, second_url: str):
    config = make_config(upstream_url)
    model = dataclasses.replace(config.models[0], deployments=("primary", "second"))
    keys = (*config.keys, KeyConfig(name="limited", key_sha256=hashlib.sha256(LIMITED.encode()).hexdigest(), rpm=1))
    return dataclasses.replace(
        config,
        deployments=(*config.deployments, Deployment("second", base_url=second_url, api_key=UPSTREAM_KEY)),
        models=(model, *config.models[1:]),
        keys=keys,
    )


@pytest.fixture
async def clouds():
    """A mock Bedrock and a mock Vertex AI."""
    bedrock, vertex = BedrockMock(region="us-east-1"), VertexMock()
    await bedrock.start()
    await vertex.start()
    yield bedrock, vertex
    await bedrock.close()
    await vertex.close()


def on_three_providers(upstream_url: str, bedrock: BedrockMock, vertex: VertexMock):
    """MODEL on Bedrock first, then Vertex AI, then Anthropic's API (`primary`)."""
    config = make_config(upstream_url)
    clouds = (
        Deployment(
            "bedrock-us", provider="bedrock", region="us-east-1", base_url=bedrock.url, api_key=bedrock.api_key_bearer
        ),
        Deployment(
            "vertex-eu",
            provider="vertex",
            region="europe-west1",
            project=vertex.project,
            base_url=vertex.url + "/v1",
            credentials_file=str(vertex.key_file),
        ),
    )
    model = dataclasses.replace(
        config.models[0],
        deployments=("bedrock-us", "vertex-eu", "primary"),
        upstream_models={
            "bedrock-us": "us.anthropic.claude-sonnet-5-5-v1:0",
            "vertex-eu": "claude-sonnet-5-5@20261001",
        },
    )
    return dataclasses.replace(config, deployments=(*config.deployments, *clouds), models=(model, *config.models[1:]))


async def test_the_metrics_count_what_happened_and_agree_with_the_ledger(start_gateway, upstream, second):
    gateway = await start_gateway(two_deployments(upstream.url, second.url))
    client = gateway.client()
    upstream.enqueue(Scenario(usage={"input_tokens": 10, "output_tokens": 20}))
    await client.chat.completions.create(model=MODEL, messages=HELLO)  # plain
    upstream.enqueue(Scenario(usage={"input_tokens": 12, "output_tokens": 25}))
    async for _ in await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True):  # a stream
        pass
    upstream.enqueue(Scenario(usage={"input_tokens": 5, "cache_read_input_tokens": 2000, "output_tokens": 20}))
    await client.chat.completions.create(model=MODEL, messages=HELLO)  # cached
    upstream.enqueue(Scenario(status=529, error_message="Overloaded"))
    await client.chat.completions.create(model=MODEL, messages=HELLO)  # primary fails over to second
    upstream.enqueue(Scenario(status=529), Scenario())  # both of MODEL's fail: test/small answers, on primary
    second.enqueue(Scenario(status=500))
    await client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"models": ["test/small"]})
    limited = gateway.client(api_key=LIMITED)
    await limited.chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.RateLimitError):
        await limited.chat.completions.create(model=MODEL, messages=HELLO)  # over its rpm of 1
    with pytest.raises(openai.AuthenticationError):
        await gateway.client(api_key="sk-unknown").chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="test/none", messages=HELLO)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=HELLO, n=2)

    m = await scrape(gateway.url)
    requests = {labels: value for (name, labels), value in m.items() if name == "ezat_requests_total"}
    assert requests == {
        (("model", MODEL), ("route", "chat_completions"), ("status", "200")): 6,
        (("model", MODEL), ("route", "chat_completions"), ("status", "429")): 1,
        (("model", ""), ("route", "chat_completions"), ("status", "401")): 1,
        (("model", ""), ("route", "chat_completions"), ("status", "404")): 1,
        (("model", ""), ("route", "chat_completions"), ("status", "400")): 1,  # refusals come before the model
    }
    refused = {dict(labels)["reason"]: value for (name, labels), value in m.items() if name == "ezat_refused_total"}
    assert refused == {"rpm": 1, "auth": 1, "model": 1, "field": 1}
    attempts = {
        tuple(dict(labels).values()): value
        for (name, labels), value in m.items()
        if name == "ezat_upstream_attempts_total"
    }
    assert attempts == {("primary", "ok"): 5, ("primary", "529"): 2, ("second", "ok"): 1, ("second", "5xx"): 1}
    assert sample(m, "ezat_fallbacks_total", model=MODEL, fallback="test/small") == 1
    assert sample(m, "ezat_time_to_first_token_seconds_count", route="chat_completions", model=MODEL) == 6
    assert sample(m, "ezat_request_duration_seconds_count", route="chat_completions", model=MODEL) == 7
    assert sample(m, "ezat_open_streams") == 0 and sample(m, "ezat_ledger_pending") == 0
    assert ("ezat_open_streams", ()) in m and ("ezat_ledger_pending", ()) in m  # there, not just missing

    rows = await gateway.app[STORE].ledger()
    assert sample(m, "ezat_ledger_rows_total") == len(rows) == 6
    assert sample(m, "ezat_ledger_commit_seconds_count") >= 1
    for model in {row.answered_model for row in rows}:
        mine = [row for row in rows if row.answered_model == model]
        for kind, column in (
            ("input", "input_tokens"),
            ("output", "output_tokens"),
            ("cache_read", "cache_read_tokens"),
            ("cache_write", "cache_write_tokens"),
            ("reasoning", "reasoning_tokens"),
        ):
            assert sample(m, "ezat_tokens_total", model=model, type=kind) == sum(getattr(r, column) for r in mine), kind
        assert sample(m, "ezat_cost_usd_total", model=model) == pytest.approx(float(sum(r.cost_usd for r in mine)))
    assert sample(m, "ezat_tokens_total", model=MODEL, type="cache_read") == 2000


def key_of(name: str, secret: str, **fields) -> KeyConfig:
    return KeyConfig(name=name, key_sha256=hashlib.sha256(secret.encode()).hexdigest(), **fields)


async def test_each_limit_is_counted_as_its_own_refusal(start_gateway, upstream):
    config = make_config(upstream.url)
    keys = (
        *config.keys,
        key_of("spend", "sk-spend", spend_limit_usd=Decimal("0.000001")),
        key_of("tpm", "sk-tpm", tpm=10),
        key_of("one", "sk-one", max_concurrent=1),
    )
    gateway = await start_gateway(dataclasses.replace(config, keys=keys))
    with pytest.raises(openai.APIStatusError) as caught:
        await gateway.client(api_key="sk-spend").chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.status_code == 402
    await gateway.client(api_key="sk-tpm").chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.RateLimitError):  # its minute's 10 tokens are used
        await gateway.client(api_key="sk-tpm").chat.completions.create(model=MODEL, messages=HELLO)
    upstream.enqueue(Scenario(event_delay=0.05))
    running = await gateway.client(api_key="sk-one").chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    with pytest.raises(openai.RateLimitError):  # one runs already
        await gateway.client(api_key="sk-one").chat.completions.create(model=MODEL, messages=HELLO)
    async for _ in running:
        pass
    m = await scrape(gateway.url)
    assert {dict(labels)["reason"]: value for (name, labels), value in m.items() if name == "ezat_refused_total"} == {
        "spend": 1,
        "tpm": 1,
        "concurrency": 1,
    }


async def test_each_attempt_outcome_is_counted(start_gateway, upstream):
    config = make_config(upstream.url)
    closed = Deployment("closed", base_url="http://127.0.0.1:9", api_key=UPSTREAM_KEY, connect_timeout_seconds=2)
    slow = dataclasses.replace(config.deployments[0], name="slow", first_token_timeout_seconds=0.3)
    model, small = config.models
    gateway = await start_gateway(
        dataclasses.replace(
            config,
            deployments=(*config.deployments, closed, slow),
            models=(
                dataclasses.replace(model, deployments=("closed", "primary")),
                dataclasses.replace(small, deployments=("slow",)),
            ),
        )
    )
    client = gateway.client()
    await client.chat.completions.create(model=MODEL, messages=HELLO)  # closed, then primary answers
    upstream.enqueue(Scenario(status=400, error_message="messages: bad"))
    with pytest.raises(openai.BadRequestError):  # closed, then primary refuses it: not tried again
        await client.chat.completions.create(model=MODEL, messages=HELLO)
    upstream.enqueue(Scenario(delay=1.0))
    with pytest.raises(openai.InternalServerError):  # no first output within 0.3 s
        await client.chat.completions.create(model="test/small", messages=HELLO, stream=True)
    m = await scrape(gateway.url)
    assert {
        tuple(dict(labels).values()): value
        for (name, labels), value in m.items()
        if name == "ezat_upstream_attempts_total"
    } == {("closed", "connect_error"): 2, ("primary", "ok"): 1, ("primary", "4xx"): 1, ("slow", "timeout"): 1}


async def test_a_deployment_cooling_down_shows_until_it_is_tried_again(start_gateway, upstream, second):
    gateway = await start_gateway(two_deployments(upstream.url, second.url))
    upstream.enqueue(Scenario(status=429, headers={"retry-after": "1"}))
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    m = await scrape(gateway.url)
    assert sample(m, "ezat_deployment_cooling", deployment="primary") == 1
    assert sample(m, "ezat_upstream_attempts_total", deployment="primary", outcome="429") == 1
    await asyncio.sleep(1.2)  # its rest is over, but no request has needed it since
    assert sample(await scrape(gateway.url), "ezat_deployment_cooling", deployment="primary") == 1
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)  # tried again, it answers
    assert sample(await scrape(gateway.url), "ezat_deployment_cooling", deployment="primary") == 0
    assert len(upstream.requests) == 2


async def test_the_metrics_name_each_deployments_provider(start_gateway, upstream, clouds):
    gateway = await start_gateway(on_three_providers(upstream.url, *clouds))
    m = await scrape(gateway.url)  # before any request: set when the app is made
    info = {labels: value for (name, labels), value in m.items() if name == "ezat_deployment_info"}
    assert info == {
        (("deployment", "primary"), ("provider", "anthropic")): 1,
        (("deployment", "bedrock-us"), ("provider", "bedrock")): 1,
        (("deployment", "vertex-eu"), ("provider", "vertex")): 1,
    }


async def test_every_api_route_is_counted_and_image_downloads_too(start_gateway, upstream):
    config = dataclasses.replace(make_config(upstream.url), images=ImagesConfig(allow_private_hosts=True))
    gateway = await start_gateway(config)
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
    await claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO)
    await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    await claude.models.list()
    await gateway.client().models.retrieve(MODEL)
    picture = {"type": "image_url", "image_url": {"url": "https://images.example.com/cat.png"}}
    gone = {"type": "image_url", "image_url": {"url": "https://images.example.com/gone.png"}}
    with aioresponses(passthrough=["http://127.0.0.1"]) as outside:
        fake_get(outside, "https://images.example.com/cat.png", body=PNG)
        fake_get(outside, "https://images.example.com/gone.png", status=404)
        await gateway.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [picture]}])
        with pytest.raises(openai.BadRequestError):
            await gateway.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [gone]}])
    await claude.close()
    m = await scrape(gateway.url)
    for route, count in (("messages", 1), ("count_tokens", 1), ("models", 2)):
        assert (
            sample(m, "ezat_requests_total", route=route, model=MODEL if route != "models" else "", status="200")
            == count
        )
    assert sample(m, "ezat_time_to_first_token_seconds_count", route="messages", model=MODEL) == 1
    # Only answers with a first output have a series: none for counts, model lists or refusals.
    assert {dict(labels)["route"] for (name, labels) in m if name == "ezat_time_to_first_token_seconds_count"} == {
        "messages",
        "chat_completions",
    }
    assert ("ezat_time_to_first_token_seconds_count", (("model", ""), ("route", "chat_completions"))) not in m
    assert sample(m, "ezat_image_downloads_total", outcome="ok") == 1
    assert sample(m, "ezat_image_downloads_total", outcome="http_error") == 1
    assert sample(m, "ezat_refused_total", reason="field") == 1  # the image that could not be downloaded


async def test_metrics_take_a_token_when_configured_and_can_be_off(start_gateway, upstream):
    gateway = await start_gateway(dataclasses.replace(make_config(upstream.url), metrics=MetricsConfig(token="s3cret")))
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            async with http.get(gateway.url + "/metrics", headers=headers) as response:
                assert response.status == 401
    assert "ezat_requests_total" not in str(await scrape(gateway.url, "s3cret"))  # nothing yet, but it answers
    off = await start_gateway(dataclasses.replace(make_config(upstream.url), metrics=MetricsConfig(enabled=False)))
    async with aiohttp.ClientSession() as http:
        async with http.get(off.url + "/metrics") as response:
            assert response.status == 404


# --- Logs


JSON_LOGS = (
    SERVE_CONFIG
    + """
[logging]
format = "json"
"""
)


def access_lines(served: ServeProcess) -> list[dict]:
    lines = [json.loads(line) for line in served.log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "ezat.access"]


async def test_each_request_has_one_json_access_line_matching_its_ledger_row(tmp_path, upstream):
    served = ServeProcess(
        tmp_path, "gateway", JSON_LOGS, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        upstream.enqueue(Scenario(usage={"input_tokens": 9, "cache_read_input_tokens": 100, "output_tokens": 30}))
        raw = await served.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO)
        upstream.enqueue(Scenario(event_delay=0.01))
        async for _ in await served.client().chat.completions.create(model=MODEL, messages=HELLO, stream=True):
            pass
        with pytest.raises(openai.AuthenticationError):
            await served.client(api_key="sk-wrong-secret").chat.completions.create(model=MODEL, messages=HELLO)
        upstream.enqueue(Scenario(status=401))  # the gateway's own credential refused: it logs an error
        with pytest.raises(openai.InternalServerError):
            failed = await served.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO)
    finally:
        await served.stop()
    rows = {row.request_id: row for row in (await read_store(f"sqlite:///{tmp_path / 'db'}"))[0]}
    lines = access_lines(served)
    assert len(lines) == 4
    plain, streamed, refused, failed = lines
    [error] = [
        json.loads(line)
        for line in served.log.read_text().splitlines()
        if line.startswith("{") and json.loads(line)["logger"] == "ezat.errors"
    ]
    assert error["request_id"] == failed["request_id"]  # a line of its own names its request too
    assert (failed["status"], failed["outcome"]) == (500, "failed")
    row = rows[raw.headers["x-request-id"]]
    assert plain["request_id"] == raw.headers["x-request-id"]
    assert {
        k: plain[k]
        for k in (
            "route",
            "model",
            "answered_model",
            "deployment",
            "provider",
            "status",
            "key",
            "stream",
            "outcome",
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
            "cost_usd",
            "client",
        )
    } == {
        "route": "chat_completions",
        "model": MODEL,
        "answered_model": MODEL,
        "deployment": "mock",
        "provider": "anthropic",
        "status": 200,
        "key": "test",
        "stream": False,
        "outcome": "ok",
        "input_tokens": 9,
        "output_tokens": row.output_tokens,
        "cache_read_tokens": 100,
        "cache_write_tokens": 0,
        "reasoning_tokens": 0,
        "cost_usd": str(row.cost_usd),
        "client": "127.0.0.1",
    }
    assert plain["duration_ms"] >= plain["ttft_ms"] > 0 and plain["level"] == "INFO"
    assert (streamed["stream"], streamed["outcome"], streamed["output_tokens"]) == (
        True,
        "ok",
        rows[streamed["request_id"]].output_tokens,
    )
    assert 0 < streamed["ttft_ms"] < streamed["duration_ms"]  # its first output, then the rest, 10 ms apart
    assert (refused["status"], refused["outcome"], refused["key"]) == (401, "refused:auth", None)
    log = served.log.read_text()
    assert KEY not in log and "sk-wrong-secret" not in log  # no key, anywhere in the log
    assert UPSTREAM_KEY not in log  # the gateway's own either, though the upstream refused it
    assert all(json.loads(line) for line in log.splitlines() if line.strip())  # every line is JSON


async def test_text_logs_name_the_request(gateway, upstream, caplog):
    caplog.set_level("INFO", logger="ezat.access")
    raw = await gateway.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO)
    [record] = [r for r in caplog.records if r.name == "ezat.access"]
    assert record.fields["outcome"] == "ok" and record.fields["status"] == 200
    line = TextFormatter("%(message)s").format(record)
    assert line.startswith(f"POST /openai/v1/chat/completions 200 request_id={raw.headers['x-request-id']} route=")


async def test_access_lines_say_what_answered_and_how_each_stream_ended(start_gateway, upstream, caplog):
    gateway = await start_gateway()
    caplog.set_level("INFO", logger="ezat.access")
    client = gateway.client()
    upstream.enqueue(Scenario(status=529), Scenario())  # the model's one deployment fails: test/small answers
    await client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"models": ["test/small"]})
    upstream.enqueue(Scenario(error_after=5))
    with pytest.raises(openai.APIError):  # the stream ends with an error chunk
        async for _ in await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True):
            pass
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "word " * 200}], chunk_size=5, event_delay=0.02))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "messages": HELLO, "stream": True},
        ) as response:
            await response.content.readany()  # the client leaves after its first bytes
    await upstream.wait_disconnect()
    async with asyncio.timeout(5):
        while len(records := [r for r in caplog.records if r.name == "ezat.access"]) < 3:
            await asyncio.sleep(0.02)
    fallback, failed, left = (record.fields for record in records)
    assert (fallback["model"], fallback["answered_model"], fallback["outcome"]) == (MODEL, "test/small", "ok")
    assert (failed["stream"], failed["status"], failed["outcome"], "input_tokens" in failed) == (
        True,
        200,
        "failed",
        False,
    )
    assert (left["stream"], left["outcome"], left["input_tokens"] > 0) == (True, "client_closed", True)  # billed


async def test_a_counts_access_line_names_the_deployment_that_answered(gateway, upstream, caplog):
    caplog.set_level("INFO", logger="ezat.access")
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    [record] = [r for r in caplog.records if r.name == "ezat.access"]
    assert (record.fields["route"], record.fields["deployment"], record.fields["answered_model"]) == (
        "count_tokens",
        "primary",
        MODEL,
    )


async def test_an_access_line_names_the_provider_that_answered(start_gateway, upstream, clouds, caplog):
    bedrock, vertex = clouds
    gateway = await start_gateway(on_three_providers(upstream.url, bedrock, vertex))
    caplog.set_level("INFO", logger="ezat.access")
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    bedrock.enqueue(Scenario(status=429))  # throttled: Vertex AI answers
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.NotFoundError):  # no deployment answers: none is named
        await gateway.client().chat.completions.create(model="test/none", messages=HELLO)
    on_bedrock, on_vertex, refused = (r for r in caplog.records if r.name == "ezat.access")
    assert [(r.fields["deployment"], r.fields["provider"]) for r in (on_bedrock, on_vertex, refused)] == [
        ("bedrock-us", "bedrock"),
        ("vertex-eu", "vertex"),
        (None, None),
    ]
    assert " deployment=vertex-eu provider=vertex " in TextFormatter("%(message)s").format(on_vertex)
    assert "provider=" not in TextFormatter("%(message)s").format(refused)


async def test_the_access_log_can_be_off(tmp_path, upstream):
    config = JSON_LOGS.replace('format = "json"', 'format = "json"\naccess_log = false')
    served = ServeProcess(
        tmp_path, "gateway", config, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        await served.client().chat.completions.create(model=MODEL, messages=HELLO)
    finally:
        await served.stop()
    assert access_lines(served) == []
    lines = [json.loads(line) for line in served.log.read_text().splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("ezat-gateway listening") for line in lines)  # the rest of the log is on


# --- Several workers


async def both_listening(served) -> None:
    """Until both workers listen: /healthz answered from one, the other may still be starting."""
    for _ in range(200):
        lines = [json.loads(line) for line in served.log.read_text().splitlines() if line.startswith("{")]
        if len({line["pid"] for line in lines if line["message"].startswith("ezat-gateway listening")}) == 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("both workers did not log that they listen within 10 s:\n" + served.log.read_text())


async def test_one_scrape_counts_every_workers_requests(tmp_path, upstream):
    served = ServeProcess(
        tmp_path, "gateway", JSON_LOGS, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start("--workers", "2")
        await both_listening(served)
        for _ in range(24):  # a connection each: the kernel spreads connections over the workers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                async with http.post(
                    served.url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": MODEL, "messages": HELLO},
                ) as response:
                    assert response.status == 200
        m = await scrape(served.url)
    finally:
        await served.stop()
    assert sample(m, "ezat_requests_total", route="chat_completions", model=MODEL, status="200") == 24
    assert sample(m, "ezat_ledger_rows_total") == 24
    assert sample(m, "ezat_deployment_info", deployment="mock", provider="anthropic") == 1  # however many workers
    assert len({line["pid"] for line in access_lines(served)}) == 2  # both workers answered some


# Streams open at once, a connection each: the kernel puts a connection on either worker as it
# hashes it, so all of four landed on one about one run in eight; all of twelve, one in 2,000.
STREAMS = 12


async def test_every_scrape_counts_every_workers_open_streams(tmp_path, upstream):
    """The open streams of both workers, in whichever worker answers the scrape, as they are:
    set when a stream starts or ends, not when the worker itself last answered a scrape."""
    served = ServeProcess(
        tmp_path, "gateway", JSON_LOGS, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    upstream.enqueue(
        *[
            Scenario(blocks=[{"type": "text", "text": "slow " * 20}], chunk_size=2, event_delay=0.05)
            for _ in range(STREAMS)
        ]
    )
    try:
        await served.start("--workers", "2")
        await both_listening(served)
        async with contextlib.AsyncExitStack() as streams:
            responses = []
            for _ in range(STREAMS):  # a connection each: the kernel spreads them over the workers
                http = await streams.enter_async_context(
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
                )
                response = await streams.enter_async_context(
                    http.post(
                        served.url + "/v1/chat/completions",
                        headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "messages": HELLO, "stream": True},
                    )
                )
                await response.content.readany()  # it has begun
                responses.append(response)
            while_open = [sample(await scrape(served.url), "ezat_open_streams") for _ in range(6)]
            for response in responses:
                await response.read()
        async with asyncio.timeout(5):  # each stream's end comes after its last bytes
            while any([sample(await scrape(served.url), "ezat_open_streams") for _ in range(6)]):
                await asyncio.sleep(0.02)
    finally:
        await served.stop()
    assert len({line["pid"] for line in access_lines(served)}) == 2  # both workers answered streams
    assert while_open == [STREAMS] * 6


# --- Readiness


async def test_readyz_fails_while_the_database_is_unreachable(start_gateway, upstream, postgres_url):
    link = await Link(5432).start()
    try:
        gateway = await start_gateway(make_config(upstream.url, link.url(postgres_url)))
        async with aiohttp.ClientSession() as http:
            async with http.get(gateway.url + "/readyz") as response:
                assert (response.status, await response.json()) == (200, {"status": "ready"})
            link.cut()
            async with http.get(gateway.url + "/readyz") as response:
                assert (response.status, await response.json()) == (503, {"status": "not ready", "failing": ["store"]})
            async with http.get(gateway.url + "/healthz") as response:
                assert response.status == 200  # liveness: the process serves
            link.restore()
            async with http.get(gateway.url + "/readyz") as response:
                assert response.status == 200
    finally:
        await link.close()


async def test_a_stream_being_answered_is_counted_open(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "slow " * 20}], chunk_size=2, event_delay=0.05))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "messages": HELLO, "stream": True},
        ) as response:
            await response.content.readany()  # it has begun
            assert sample(await scrape(gateway.url), "ezat_open_streams") == 1
            await response.read()
    async with asyncio.timeout(5):
        while sample(await scrape(gateway.url), "ezat_open_streams") != 0:
            await asyncio.sleep(0.02)


async def test_readyz_is_ready_with_a_reachable_redis(start_gateway, upstream, redis_url):
    config = dataclasses.replace(make_config(upstream.url), ratelimit=RateLimitConfig(url=redis_url))
    gateway = await start_gateway(config)
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/readyz") as response:
            assert (response.status, await response.json()) == (200, {"status": "ready"})


async def test_readyz_stays_ready_without_redis_and_says_so(start_gateway, upstream):
    """Rate limits fail open without Redis, so requests are still served; and every replica
    shares the one Redis: failing readiness for it would take them all out of service at once."""
    config = dataclasses.replace(
        make_config(upstream.url), ratelimit=RateLimitConfig(url=f"redis://127.0.0.1:{free_port()}/0")
    )
    gateway = await start_gateway(config)
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/readyz") as response:
            assert (response.status, await response.json()) == (200, {"status": "ready", "degraded": ["ratelimit"]})
    answer = await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    assert answer.choices[0].message.content.startswith("Hello from the mock upstream")


DRAINING = SERVE_CONFIG.replace("shutdown_timeout_seconds = 10", "shutdown_timeout_seconds = 10\ndrain_seconds = 2")


async def test_readyz_fails_at_once_on_sigterm_while_a_stream_drains(tmp_path, upstream):
    served = ServeProcess(
        tmp_path, "gateway", DRAINING, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "slow " * 40}], chunk_size=10, event_delay=0.15))
        async with aiohttp.ClientSession() as http:
            async with http.get(served.url + "/readyz") as response:
                assert response.status == 200
            async with http.post(
                served.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "messages": HELLO, "stream": True},
            ) as stream:
                assert stream.status == 200
                await stream.content.readany()  # it has begun
                served.process.send_signal(signal.SIGTERM)
                async with asyncio.timeout(5):  # the signal arrives, while new connections are still accepted
                    while (ready := await readiness(served.url)) == (200, {"status": "ready"}):
                        await asyncio.sleep(0.02)
                assert ready == (503, {"status": "shutting down"})
                assert not stream.content.at_eof()  # it drains
                body = await stream.content.read()
            assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body  # it finished
        assert await asyncio.wait_for(served.process.wait(), 15) == 0
    finally:
        await served.stop()


async def readiness(url: str) -> tuple[int, dict]:
    """GET /readyz on a new connection: its status and its JSON."""
    async with aiohttp.ClientSession() as http, http.get(url + "/readyz") as response:
        return response.status, await response.json()


# --- Traces


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Tracing(provider)


async def test_spans_follow_the_genai_conventions(start_gateway, upstream, spans):
    exporter, tracing = spans
    gateway = await start_gateway(make_config(upstream.url), tracing=tracing)
    upstream.enqueue(
        Scenario(
            usage={
                "input_tokens": 7,
                "cache_read_input_tokens": 50,
                "cache_creation_input_tokens": 20,
                "output_tokens": 30,
            }
        )
    )
    await gateway.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A secret prompt"}]
    )
    upstream.enqueue(Scenario(status=529))
    with pytest.raises(openai.InternalServerError):
        await gateway.client().chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    finished = exporter.get_finished_spans()
    servers = [s for s in finished if s.kind == SpanKind.SERVER]
    clients = [s for s in finished if s.kind == SpanKind.CLIENT]
    assert [s.name for s in servers] == ["POST /openai/v1/chat/completions"] * 2
    assert [s.name for s in clients] == [f"chat {UPSTREAM_MODEL}"] * 2
    server, client = servers[0], clients[0]
    assert client.parent.span_id == server.context.span_id and client.context.trace_id == server.context.trace_id
    [row] = await gateway.app[STORE].ledger()
    assert {
        k: server.attributes[k]
        for k in (
            "gen_ai.provider.name",
            "gen_ai.operation.name",
            "gen_ai.request.model",
            "gen_ai.response.model",
            "gen_ai.response.finish_reasons",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "gen_ai.usage.cache_read.input_tokens",
            "gen_ai.usage.cache_creation.input_tokens",
            "http.response.status_code",
        )
    } == {
        "gen_ai.provider.name": "anthropic",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": 77,
        "gen_ai.usage.output_tokens": row.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": 50,
        "gen_ai.usage.cache_creation.input_tokens": 20,
        "http.response.status_code": 200,
    }
    assert server.attributes["gen_ai.response.id"].startswith("msg_mock_")
    assert client.attributes["gen_ai.response.id"] == server.attributes["gen_ai.response.id"]
    # The attempt's usage is on its own span, as the conventions put it on the inference span.
    assert {k: client.attributes[k] for k in USAGE} == {k: server.attributes[k] for k in USAGE}
    # The upstream's own name for the model it answered with (the mock's: the name asked), and where it is.
    assert {k: client.attributes[k] for k in ("gen_ai.response.model", "server.address", "server.port")} == {
        "gen_ai.response.model": UPSTREAM_MODEL,
        "server.address": "127.0.0.1",
        "server.port": URL(upstream.url).port,
    }
    assert upstream.requests[0].headers["traceparent"].split("-")[1] == format(client.context.trace_id, "032x")
    assert (servers[1].attributes["error.type"], clients[1].attributes["error.type"]) == ("503", "529")
    assert not any("secret" in str(value) for s in finished for value in s.attributes.values())  # no prompt text


async def test_spans_name_the_provider_of_each_attempt_and_of_the_answer(start_gateway, upstream, clouds, spans):
    exporter, tracing = spans
    bedrock, vertex = clouds
    gateway = await start_gateway(on_three_providers(upstream.url, bedrock, vertex), tracing=tracing)
    bedrock.enqueue(Scenario(status=429))  # throttled: Vertex AI answers
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    vertex.enqueue(Scenario(status=429))
    bedrock.enqueue(Scenario(status=429))  # both clouds throttled: Anthropic's API answers
    await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    with pytest.raises(openai.NotFoundError):  # no deployment answers: the request's span names no provider
        await gateway.client().chat.completions.create(model="test/none", messages=HELLO)
    finished = exporter.get_finished_spans()
    clients = [
        (s.attributes["gen_ai.provider.name"], s.attributes["server.address"], s.attributes["server.port"])
        for s in finished
        if s.kind == SpanKind.CLIENT
    ]
    at = {name: ("127.0.0.1", URL(mock.url).port) for name, mock in (("b", bedrock), ("v", vertex), ("a", upstream))}
    assert clients == [
        ("aws.bedrock", *at["b"]),
        ("gcp.vertex_ai", *at["v"]),
        ("aws.bedrock", *at["b"]),
        ("gcp.vertex_ai", *at["v"]),
        ("anthropic", *at["a"]),
    ]
    assert [s.attributes.get("gen_ai.provider.name") for s in finished if s.kind == SpanKind.SERVER] == [
        "gcp.vertex_ai",
        "anthropic",
        None,
    ]


USAGE = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.cache_creation.input_tokens",
)


async def test_a_streamed_answer_and_a_count_have_their_spans(start_gateway, upstream, spans):
    exporter, tracing = spans
    gateway = await start_gateway(make_config(upstream.url), tracing=tracing)
    usage = {"input_tokens": 7, "cache_read_input_tokens": 40, "cache_creation_input_tokens": 5, "output_tokens": 30}
    upstream.enqueue(Scenario(usage=usage, event_delay=0.02))
    first_chunk_at = None
    async for _ in await gateway.client().chat.completions.create(model=MODEL, messages=HELLO, stream=True):
        first_chunk_at = first_chunk_at or time.time_ns()
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
    await claude.messages.count_tokens(model=MODEL, messages=HELLO)
    await claude.close()
    stream_server, count_server = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    [row] = await gateway.app[STORE].ledger()
    assert (
        stream_server.attributes["gen_ai.usage.input_tokens"],
        stream_server.attributes["gen_ai.usage.output_tokens"],
        stream_server.attributes["gen_ai.response.finish_reasons"],
    ) == (52, row.output_tokens, ("end_turn",))
    # The attempt's span ends with the stream, not at its first output: its stop reason and
    # usage are known only then.
    stream_client, count_client = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]
    assert first_chunk_at < stream_client.end_time <= stream_server.end_time
    assert {k: stream_client.attributes[k] for k in (*USAGE, "gen_ai.response.finish_reasons")} == {
        "gen_ai.usage.input_tokens": 52,
        "gen_ai.usage.output_tokens": row.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": 40,
        "gen_ai.usage.cache_creation.input_tokens": 5,
        "gen_ai.response.finish_reasons": ("end_turn",),
    }
    assert not any(k.startswith("gen_ai.usage.") for k in count_client.attributes)
    assert (count_server.name, count_server.attributes["gen_ai.operation.name"]) == (
        "POST /v1/messages/count_tokens",
        "count_tokens",
    )
    assert [s.name for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT] == [
        f"chat {UPSTREAM_MODEL}",
        f"count_tokens {UPSTREAM_MODEL}",
    ]
    assert not any(
        "mock upstream" in str(value) for s in exporter.get_finished_spans() for value in s.attributes.values()
    )  # no completion text ("Hello from the mock upstream…")


async def test_a_streamed_messages_request_has_its_access_line_and_span(start_gateway, upstream, spans, caplog):
    # Claude Code's way in: Anthropic's Messages API, streamed.
    exporter, tracing = spans
    gateway = await start_gateway(make_config(upstream.url), tracing=tracing)
    caplog.set_level("INFO", logger="ezat.access")
    upstream.enqueue(Scenario(usage={"input_tokens": 9, "cache_read_input_tokens": 40, "output_tokens": 30}))
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
    async with claude.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
        message = await stream.get_final_message()
    await claude.close()
    [row] = await gateway.app[STORE].ledger()
    [record] = [r for r in caplog.records if r.name == "ezat.access"]
    line = record.fields
    assert (line["route"], line["stream"], line["status"], line["outcome"], line["model"], line["answered_model"]) == (
        "messages",
        True,
        200,
        "ok",
        MODEL,
        MODEL,
    )
    assert (
        (line["input_tokens"], line["cache_read_tokens"], line["output_tokens"])
        == (9, 40, message.usage.output_tokens)
        == (row.input_tokens, row.cache_read_tokens, row.output_tokens)
    )
    assert line["ttft_ms"] is not None and line["ttft_ms"] <= line["duration_ms"]
    [server] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert (
        server.name,
        server.attributes["gen_ai.usage.input_tokens"],
        server.attributes["gen_ai.usage.output_tokens"],
        server.attributes["gen_ai.response.finish_reasons"],
        server.attributes["gen_ai.response.id"],
    ) == ("POST /v1/messages", 49, row.output_tokens, ("end_turn",), message.id)
    # The upstream's bytes are relayed on this route: its attempt's span has the usage all the same.
    [client] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]
    assert {k: client.attributes[k] for k in (*USAGE, "gen_ai.response.finish_reasons")} == {
        "gen_ai.usage.input_tokens": 49,
        "gen_ai.usage.output_tokens": row.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": 40,
        "gen_ai.usage.cache_creation.input_tokens": 0,
        "gen_ai.response.finish_reasons": ("end_turn",),
    }


async def test_an_attempts_span_names_the_model_the_upstream_answered_with_and_its_host(start_gateway, spans):
    # An upstream on https with no port in its URL, answering with a dated name of the model asked.
    exporter, tracing = spans
    config = make_config("https://upstream.example")
    gateway = await start_gateway(config, tracing=tracing)
    answered = UPSTREAM_MODEL + "-20261101"
    message = {
        "id": "msg_dated",
        "type": "message",
        "role": "assistant",
        "model": answered,
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    start = {**message, "content": [], "stop_reason": None, "id": "msg_dated_stream"}
    events = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 2},
        },
        {"type": "message_stop"},
    ]
    stream = "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in events)
    with aioresponses(passthrough=["http://127.0.0.1"]) as outside:
        outside.post("https://upstream.example/v1/messages", payload=message, response_class=FakedResponse)
        outside.post(
            "https://upstream.example/v1/messages",
            body=stream,
            content_type="text/event-stream",
            response_class=FakedResponse,
        )
        await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
        async for _ in await gateway.client().chat.completions.create(model=MODEL, messages=HELLO, stream=True):
            pass
    finished = exporter.get_finished_spans()
    clients = [s for s in finished if s.kind == SpanKind.CLIENT]
    assert [
        (
            s.attributes["gen_ai.response.id"],
            s.attributes["gen_ai.response.model"],
            s.attributes["gen_ai.request.model"],
            s.attributes["server.address"],
            s.attributes["server.port"],
        )
        for s in clients
    ] == [
        ("msg_dated", answered, UPSTREAM_MODEL, "upstream.example", 443),
        ("msg_dated_stream", answered, UPSTREAM_MODEL, "upstream.example", 443),
    ]
    # The request's span names the configured model that answered, not the upstream's name for it.
    assert [s.attributes["gen_ai.response.model"] for s in finished if s.kind == SpanKind.SERVER] == [MODEL, MODEL]


async def test_spans_reach_an_otlp_receiver(start_gateway, upstream):
    received: list[tuple[str, bytes]] = []

    async def traces(request: web.Request) -> web.Response:
        received.append((request.content_type, await request.read()))
        return web.Response(status=200)

    receiver = web.Application()
    receiver.router.add_post("/v1/traces", traces)
    runner, endpoint = await served(receiver)
    try:
        config = dataclasses.replace(make_config(upstream.url), tracing=TracingConfig(endpoint=endpoint))
        gateway = await start_gateway(config)
        await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
        await gateway.runner.cleanup()  # the batch still buffered is sent on the way out
    finally:
        await runner.cleanup()
    assert received and all(kind == "application/x-protobuf" for kind, _ in received)
    assert f"chat {UPSTREAM_MODEL}".encode() in b"".join(body for _, body in received)


# --- The dashboard


async def exported_names(url: str) -> set[str]:
    """Every series name /metrics declares, whether it has values yet or not."""
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as response:
            text = await response.text()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in text_string_to_metric_families(text) for suffix in suffixes[family.type]}


async def test_every_dashboard_panel_queries_a_metric_the_gateway_exports(gateway):
    exported = await exported_names(gateway.url)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(queries) >= 10
    for query in queries:
        named = set(re.findall(r"ezat_[a-z0-9_]+", query))
        assert named and named <= exported, (query, named - exported)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_operations_settings_are_checked():
    with pytest.raises(ConfigError) as caught:
        parse_config(
            '[tracing]\nendpoint = "collector:4318"\n[logging]\nformat = "xml"\n[server]\ndrain_seconds = -1\n'
        )
    assert caught.value.problems == [
        "server.drain_seconds: expected a non-negative number",
        'logging.format: expected "text" or "json"',
        "tracing.endpoint: expected an http(s) URL with a host",
    ]


async def test_an_attempt_past_the_deadline_counts_as_a_timeout(start_gateway, upstream):
    gateway = await start_gateway(non_streaming_deadline=0.3)
    upstream.enqueue(Scenario(delay=2))
    with pytest.raises(openai.InternalServerError) as caught:  # 504: stream it instead
        await gateway.client().chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.status_code == 504
    m = await scrape(gateway.url)
    assert sample(m, "ezat_upstream_attempts_total", deployment="primary", outcome="timeout") == 1


async def test_a_refusal_leaves_no_client_text_in_its_span_nor_in_the_log(start_gateway, upstream, spans, caplog):
    exporter, tracing = spans
    gateway = await start_gateway(tracing=tracing)
    caplog.set_level("INFO", logger="ezat.access")
    typed = "my secret prompt\nPOST /v1/chat/completions 200 key=admin"
    with pytest.raises(openai.NotFoundError):
        await gateway.client().chat.completions.create(model=typed, messages=HELLO)
    [span] = exporter.get_finished_spans()
    assert span.status.is_ok and not span.events  # a refusal is no error of the span's, and records no exception
    assert span.attributes["error.type"] == "404"
    [record] = [r for r in caplog.records if r.name == "ezat.access"]
    assert record.fields["model"] is None and record.fields["outcome"] == "refused:model"
    assert "secret" not in TextFormatter("%(message)s").format(record)


async def test_serve_log_format_overrides_the_file(tmp_path, upstream):
    served = ServeProcess(
        tmp_path, "gateway", SERVE_CONFIG, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start("--log-format", "json")  # the file says nothing: text, but for this
        await served.client().chat.completions.create(model=MODEL, messages=HELLO)
    finally:
        await served.stop()
    [line] = access_lines(served)
    assert (line["status"], line["outcome"]) == (200, "ok")


async def test_ezat_log_format_sets_the_log_format_unless_the_option_does(tmp_path, upstream):
    config = JSON_LOGS.replace('format = "json"', 'format = "text"')  # the variable wins over the file
    served = ServeProcess(
        tmp_path,
        "gateway",
        config,
        env={"EZAT_LOG_FORMAT": "json"},
        storage_url=f"sqlite:///{tmp_path / 'db'}",
        upstream_url=upstream.url,
    )
    try:
        await served.start("--workers", "1")
        await served.client().chat.completions.create(model=MODEL, messages=HELLO)
    finally:
        await served.stop()
    assert [json.loads(line)["logger"] for line in served.log.read_text().splitlines()].count("ezat.access") == 1
    texts = ServeProcess(
        tmp_path,
        "texts",
        config,
        env={"EZAT_LOG_FORMAT": "json"},
        storage_url=f"sqlite:///{tmp_path / 'db'}",
        upstream_url=upstream.url,
    )
    try:
        await texts.start("--log-format", "text")  # the option wins over the variable
    finally:
        await texts.stop()
    lines = texts.output().splitlines()
    assert lines and all(" INFO " in line and not line.startswith("{") for line in lines)
    status, output = await run_command(
        "keys", "list", "--storage", f"sqlite:///{tmp_path / 'db'}", env={"EZAT_LOG_FORMAT": "xml"}
    )
    assert (status, output.splitlines()[-1]) == (
        2,
        "ezat-gateway: error: EZAT_LOG_FORMAT: expected text or json, not 'xml'",
    )


async def test_a_responses_request_has_its_span_and_the_ledger_row(start_gateway, upstream, spans):
    exporter, tracing = spans
    gateway = await start_gateway(make_config(upstream.url), tracing=tracing)
    upstream.enqueue(Scenario(usage={"input_tokens": 7, "output_tokens": 30}))
    response = await gateway.client().responses.create(model=MODEL, input="Hello")
    [server] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    [row] = await gateway.app[STORE].ledger()
    assert response.status == "completed"
    assert (server.name, server.attributes["gen_ai.operation.name"]) == ("POST /openai/v1/responses", "chat")
    assert (server.attributes["gen_ai.usage.input_tokens"], server.attributes["gen_ai.usage.output_tokens"]) == (
        7,
        row.output_tokens,
    )
