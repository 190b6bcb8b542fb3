"""Nothing in an answer or a log that a client did not mean to be there, and nothing that ties a
connection up: a request aiohttp cannot parse gets the envelope, never its own bytes back, and
its key is never logged; no answer names Python's or aiohttp's version; an upstream's error
message is passed on cut to a bounded length; the SQLite files are the owner's alone; and a
request's headers must arrive within the keep-alive timeout. Each through a real server on
loopback, with raw sockets where no SDK would send the bad bytes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import replace

import aiohttp
import orjson
import pytest
from aiohttp import web
from yarl import URL

from gateway.config import ServerConfig
from gateway.mock.upstream import Scenario
from gateway.storage import open_store
from middlewares.core.errors import MAX_ERROR_MESSAGE
from tests.support import KEY, MODEL, SERVE_CONFIG, Gateway, ServeProcess, data, make_config, raw_stream

MESSAGES = [{"role": "user", "content": "x"}]
NOT_HTTP = {
    "error": {"message": "The request is not valid HTTP.", "type": "invalid_request_error", "param": None, "code": None}
}
HEAD = b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
# Requests aiohttp's parser rejects, each holding the test key (a valid one) where the parser quotes it.
NOT_VALID_HTTP = {
    "header over 8,190 bytes": HEAD + b"Authorization: Bearer " + KEY.encode() + b"A" * 9000 + b"\r\n\r\n",
    "control byte in a header": HEAD + b"Authorization: Bearer " + KEY.encode() + b"\x01\r\n\r\n",
    "malformed request line": b"POST /openai/v1/" + KEY.encode() + b"\x01 HTTP/1.1\r\nHost: gateway\r\n\r\n",
}
# What would show that a key (or the header it came in) was echoed: the key, its start, the padding.
KEY_PARTS = (KEY, KEY[:7], "A" * 16, "Bearer")


async def send_raw(url: str, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Write `request` on a fresh connection and read until the gateway closes it: the status
    line, the headers (names lower-cased) and the body."""
    where = URL(url)
    reader, writer = await asyncio.open_connection(where.host, where.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the connection is closed
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status.encode(), headers, body


def assert_no_key(text: str) -> None:
    found = [part for part in KEY_PARTS if part in text]
    assert not found, f"{found} in:\n{text[-3000:]}"


# --- requests aiohttp cannot parse


@pytest.mark.parametrize("request_bytes", NOT_VALID_HTTP.values(), ids=NOT_VALID_HTTP.keys())
async def test_a_request_that_is_not_valid_http_gets_the_envelope_and_no_byte_of_itself(gateway, caplog, request_bytes):
    caplog.set_level(logging.DEBUG)
    status, headers, body = await send_raw(gateway.url, request_bytes)
    assert status.startswith(b"HTTP/1.") and status.endswith(b" 400 Bad Request")
    assert headers["content-type"] == "application/json"
    assert orjson.loads(body) == NOT_HTTP
    assert_no_key(body.decode(errors="replace"))
    assert headers["server"] == "ezat-gateway"
    # One line: the error's class and the peer, no traceback.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert warnings[0].name == "ezat.server" and warnings[0].levelno == logging.WARNING
    assert warnings[0].exc_info is None
    assert warnings[0].getMessage().startswith("a request that is not valid HTTP (")
    assert warnings[0].getMessage().endswith(") from 127.0.0.1")
    assert_no_key(caplog.text)


async def test_a_connection_that_does_not_speak_http_is_only_debug_noise(gateway, caplog):
    """As aiohttp logs it: a first line with no HTTP method (TLS to the HTTP port, a scanner)."""
    caplog.set_level(logging.DEBUG)
    _, _, body = await send_raw(gateway.url, b"\x16\x03\x01 " + KEY.encode() + b" HTTP/1.1\r\n\r\n")
    assert orjson.loads(body) == NOT_HTTP
    records = [r for r in caplog.records if r.name in ("ezat.server", "aiohttp.server")]
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("ezat.server", logging.DEBUG, "a request that is not valid HTTP (BadHttpMethod) from 127.0.0.1")
    ]
    assert_no_key(caplog.text)


async def test_the_served_gateways_log_holds_no_key_of_a_request_it_cannot_parse(tmp_path, upstream):
    served = ServeProcess(
        tmp_path, "gateway", SERVE_CONFIG, storage_url=f"sqlite:///{tmp_path / 'gateway.db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        for request_bytes in NOT_VALID_HTTP.values():
            _, headers, body = await send_raw(served.url, request_bytes)
            assert orjson.loads(body) == NOT_HTTP
            assert_no_key(body.decode(errors="replace"))
        async with served.client() as client:  # and the gateway serves on, a valid request included
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    finally:
        await served.stop()
    log = served.output()
    assert_no_key(log)
    assert "Traceback" not in log and " ERROR " not in log
    for error in ("LineTooLong", "BadHttpMessage", "InvalidURLError"):
        assert (
            f"WARNING {served.process.pid} ezat.server: a request that is not valid HTTP ({error}) from 127.0.0.1"
            in log
        )


async def test_a_handlers_exception_still_gets_aiohttps_500():
    """Only the parser's errors are answered differently: a foreign app's handler that fails gets
    aiohttp's own 500, logged with its traceback as aiohttp logs it."""

    async def fail(request: web.Request) -> web.Response:
        raise RuntimeError("the handler failed")

    app = web.Application()
    app.router.add_get("/", fail)
    gateway = await Gateway(app).start()
    try:
        async with aiohttp.ClientSession() as http, http.get(gateway.url) as response:
            assert response.status == 500
            assert (await response.text()).startswith("500 Internal Server Error")
    finally:
        await gateway.runner.cleanup()


# --- the Server header


async def test_no_answer_names_a_version(gateway, upstream):
    upstream.enqueue(Scenario(), Scenario())
    answers = []
    async with aiohttp.ClientSession() as http:
        chat = gateway.url + "/openai/v1/chat/completions"
        for method, url, headers, body in [
            ("POST", chat, {"Authorization": f"Bearer {KEY}"}, {"model": MODEL, "messages": MESSAGES}),  # 200
            ("POST", chat, {"Authorization": "Bearer sk-wrong"}, {"model": MODEL, "messages": MESSAGES}),  # 401
            ("GET", gateway.url + "/nowhere", {}, None),  # 404
            ("GET", gateway.url + "/healthz", {}, None),
        ]:
            async with http.request(method, url, headers=headers, json=body) as response:
                await response.read()
                answers.append((response.status, response.headers.get("Server")))
    response, events = await raw_stream(gateway)
    assert events[-1] == "data: [DONE]"
    answers.append((response.status, response.headers.get("Server")))
    _, headers, _ = await send_raw(gateway.url, NOT_VALID_HTTP["control byte in a header"])
    answers.append((400, headers.get("server")))
    assert answers == [
        (200, "ezat-gateway"),
        (401, "ezat-gateway"),
        (404, "ezat-gateway"),
        (200, "ezat-gateway"),
        (200, "ezat-gateway"),
        (400, "ezat-gateway"),
    ]


# --- an upstream's error messages


async def post(gateway, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as response:
            return response.status, await response.read()


@pytest.mark.parametrize(
    ("message", "passed_on"),
    [
        ("prompt is too long: 210000 tokens > 200000 maximum", "prompt is too long: 210000 tokens > 200000 maximum"),
        ("m" * MAX_ERROR_MESSAGE, "m" * MAX_ERROR_MESSAGE),  # the longest passed on whole
        ("x" * 50_000, "x" * (MAX_ERROR_MESSAGE - 1) + "…"),
    ],
    ids=["real", "longest", "long"],
)
async def test_an_upstream_errors_message_is_cut_to_a_bounded_length(gateway, upstream, message, passed_on):
    upstream.enqueue(Scenario(status=400, error_message=message))
    status, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert status == 400
    assert orjson.loads(body)["error"]["message"] == passed_on


async def test_an_upstream_streams_error_message_is_cut_to_a_bounded_length(gateway, upstream):
    long = "y" * 1_000_000  # an SSE event may be up to 4 MB
    text = [{"type": "text", "text": "One, two, three, four, five."}]
    upstream.enqueue(
        Scenario(blocks=text, error_after=5, stream_error_message=long),  # after the first token
        Scenario(blocks=text, error_after=2, stream_error_message=long),  # before it: an HTTP error
        Scenario(blocks=text, error_after=5, stream_error_message="Overloaded"),
    )
    cut = "y" * (MAX_ERROR_MESSAGE - 1) + "…"
    response, events = await raw_stream(gateway)
    assert response.status == 200 and events[-1] == "data: [DONE]"
    assert data(events[-2])["error"]["message"] == cut
    status, body = await post(gateway, {"model": MODEL, "messages": MESSAGES, "stream": True})
    assert status == 503
    assert orjson.loads(body)["error"]["message"] == cut
    _, events = await raw_stream(gateway)
    assert data(events[-2])["error"]["message"] == "Overloaded"


# --- the SQLite files


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_a_fresh_sqlite_database_and_its_wal_and_shm_are_the_owners_alone(tmp_path, upstream):
    db = tmp_path / "gateway.db"
    served = ServeProcess(tmp_path, "gateway", SERVE_CONFIG, storage_url=f"sqlite:///{db}", upstream_url=upstream.url)
    try:
        await served.start()
        async with served.client() as client:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # a ledger row: the WAL is written
        files = [db, db.with_name("gateway.db-wal"), db.with_name("gateway.db-shm")]
        assert os.path.getsize(files[1]) > 0
        assert [mode(path) for path in files] == [0o600] * 3
    finally:
        await served.stop()


async def test_an_existing_sqlite_database_keeps_its_mode(tmp_path):
    db = tmp_path / "shared.db"
    db.touch()
    db.chmod(0o640)  # chosen by its owner
    store = open_store(f"sqlite:///{db}")
    await store.open()
    try:
        assert mode(db) == 0o640
        assert mode(db.with_name("shared.db-wal")) == 0o640
    finally:
        await store.close()


# --- the keep-alive timeout, also the deadline for a request's headers


async def test_headers_that_never_end_are_dropped_at_the_keep_alive_timeout(tmp_path, upstream):
    config = SERVE_CONFIG.replace(
        "shutdown_timeout_seconds = 10", "shutdown_timeout_seconds = 10\nkeepalive_timeout_seconds = 1"
    )
    served = ServeProcess(
        tmp_path, "gateway", config, storage_url=f"sqlite:///{tmp_path / 'gateway.db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        writer.write(HEAD)

        async def trickle() -> None:  # a header line now and then: it does not put the deadline off
            with contextlib.suppress(OSError):
                while True:
                    await asyncio.sleep(0.1)
                    writer.write(b"x-slow: 1\r\n")
                    await writer.drain()

        trickling = asyncio.create_task(trickle())
        try:
            answer = await asyncio.wait_for(reader.read(), 5)
        except ConnectionResetError:
            answer = b""
        elapsed = loop.time() - started
        trickling.cancel()
        writer.close()
        assert answer == b""  # closed, unanswered
        assert 0.9 <= elapsed < 2.0, elapsed
    finally:
        await served.stop()


async def test_the_tests_gateway_takes_its_configs_keep_alive(start_gateway, upstream):
    gateway = await start_gateway(
        replace(make_config(upstream.url), server=ServerConfig(keepalive_timeout_seconds=0.3))
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", URL(gateway.url).port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert 0.25 <= loop.time() - started < 1.5
