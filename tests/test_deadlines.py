"""Deadlines on a stream's two peers: an upstream that goes silent or streams too long, and a
client that stops reading, are given up on, so that neither holds the gateway (or the other
peer) for ever. Through the real server, with the mock upstream as a real HTTP server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import replace

import openai
import pytest

from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, data, make_config, raw_stream


def with_deployment(upstream_url: str, **fields):
    config = make_config(upstream_url)
    return replace(config, deployments=tuple(replace(d, **fields) for d in config.deployments))


def error_and_done(events: list[str]) -> dict:
    """The error a stream ended with: its last two events are the error and [DONE]."""
    assert events[-1] == "data: [DONE]", events[-3:]
    return data(events[-2])["error"]


async def test_an_upstream_silent_after_its_first_delta_is_given_up_on(upstream, start_gateway):
    """Our own pings (every 0.2 s here) keep the client's read alive; they do not count as the
    upstream's: after 1 s without an upstream event the stream ends as a failed one does."""
    gateway = await start_gateway(with_deployment(upstream.url, stream_idle_timeout_seconds=1.0), ping_interval=0.2)
    upstream.enqueue(Scenario(stall_after=4))  # message_start, block start, ping, one delta
    started = time.monotonic()
    response, events = await asyncio.wait_for(raw_stream(gateway), 10)
    elapsed = time.monotonic() - started
    assert response.status == 200
    assert 1.0 <= elapsed < 2.0
    assert sum(event == ": ping" for event in events) >= 3
    assert error_and_done(events) == {
        "message": "The upstream sent nothing for 1 seconds.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    text = "".join(data(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.startswith("data: "))
    assert text == "Hello fr"  # the one delta (8 characters) came through first
    await upstream.wait_disconnect(1)  # the upstream's connection was closed
    assert await gateway.app[STORE].ledger() == []  # failed: not billed


async def test_upstream_pings_keep_a_slow_stream_alive(upstream, start_gateway):
    """Events that come more often than the idle timeout, pings among them, are not silence."""
    gateway = await start_gateway(with_deployment(upstream.url, stream_idle_timeout_seconds=0.5))
    upstream.enqueue(Scenario(event_delay=0.3, pings=3, chunk_size=20))
    response, events = await asyncio.wait_for(raw_stream(gateway), 10)
    assert response.status == 200
    assert events[-1] == "data: [DONE]" and "error" not in events[-2]
    assert len(await gateway.app[STORE].ledger()) == 1


async def test_a_stream_ends_at_its_maximum_duration(upstream, start_gateway):
    gateway = await start_gateway(with_deployment(upstream.url, max_stream_duration_seconds=1.0))
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "word " * 100}], chunk_size=5, event_delay=0.05))
    started = time.monotonic()
    response, events = await asyncio.wait_for(raw_stream(gateway), 10)
    assert 1.0 <= time.monotonic() - started < 1.5  # at the deadline, not before (the stream would take 5 s)
    assert response.status == 200
    assert error_and_done(events)["message"] == "The stream reached its maximum duration of 1 seconds."
    await upstream.wait_disconnect(1)
    assert await gateway.app[STORE].ledger() == []


async def test_a_stream_that_reaches_its_maximum_duration_before_its_first_output_is_an_error_not_a_stream(
    upstream, start_gateway
):
    # The client has seen nothing yet, so it gets an HTTP error it can retry, not a 200 that fails.
    gateway = await start_gateway(with_deployment(upstream.url, max_stream_duration_seconds=0.5))
    upstream.enqueue(Scenario(event_delay=1.0))  # its first delta comes after 2 s
    started = time.monotonic()
    async with gateway.client() as client:
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert 0.5 <= time.monotonic() - started < 1.8  # at the deadline, before the first delta (2 s)
    assert failed.value.body["message"] == "The stream reached its maximum duration of 0.5 seconds."
    await upstream.wait_disconnect(1)
    assert await gateway.app[STORE].ledger() == []


async def test_a_client_that_stops_reading_is_dropped_and_the_upstream_closed(upstream, start_gateway):
    """A client that sends its request and then reads nothing holds a write that never ends;
    after write_timeout_seconds the gateway drops it and closes the upstream stream behind it."""
    config = make_config(upstream.url)
    gateway = await start_gateway(replace(config, server=replace(config.server, write_timeout_seconds=1.0)))
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "x" * (16 << 20)}], chunk_size=16384))
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Go"}]}).encode()
    port = int(gateway.url.rsplit(":", 1)[1])
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(client, ("127.0.0.1", port))
    try:
        await loop.sock_sendall(
            client,
            (
                f"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body,
        )
        started = time.monotonic()
        await upstream.wait_disconnect(10)  # the gateway gave up on the client, then the upstream
        # The write blocks once the buffers (the kernel's, aiohttp's) are full: well before 1 s;
        # the client is dropped a second after that, and not before.
        assert 1.0 <= time.monotonic() - started < 3.5
        received = b""
        try:
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 1 << 20), 5):
                received = received[-64:] + chunk  # the end is all that matters
        except ConnectionResetError:
            pass  # the gateway aborted the connection (an orderly close would do as well)
        # Dropped mid-stream: the answer never ended (with 16 MB of text, it could not have yet).
        assert b"data: [DONE]" not in received
    finally:
        client.close()


def serve_in_a_thread(body_writes) -> tuple[int, threading.Thread]:
    """A one-request HTTP upstream on its own thread (its CPU is not the gateway's): it answers
    200 with the writes `body_writes()` yields, each sent on its own, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener, listener.accept()[0] as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(
                next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1]
            )
            while len(body) < length:
                body += connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            try:
                for write in body_writes():
                    connection.sendall(write)
                    time.sleep(0.0002)  # one read each, not one burst
            except OSError:
                pass  # the gateway gave up first

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


async def test_upstream_bytes_without_an_event_end_cost_linear_time(start_gateway, caplog):
    """Just over 4 MB (the most an event may take) with no event's end, in 1 KB reads: the
    scanner must not rejoin what it holds on every read (that was 2 s of event-loop time here,
    6 s on a slower machine). The CPU is this thread's, where the gateway (and the one client)
    run; the upstream has a thread of its own. Under 0.2 s, or (on a slow machine) twice what
    the same reads cost when each ends an event (a comment): the floor of 4,000 reads."""

    def writes(piece: bytes):
        def body():
            yield (
                b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n'
            )
            for _ in range(4 * 1024 + 16):
                yield piece

        return body

    async def cpu_of(piece: bytes) -> tuple[float, str]:
        port, thread = serve_in_a_thread(writes(piece))
        gateway = await start_gateway(make_config(f"http://127.0.0.1:{port}"))
        cpu = time.thread_time()
        response, events = await asyncio.wait_for(raw_stream(gateway), 30)
        cpu = time.thread_time() - cpu
        thread.join(5)
        assert response.status == 200
        return cpu, error_and_done(events)["message"]

    floor, ended = await cpu_of(b": " + b"x" * 1020 + b"\n\n")
    assert ended == "The upstream stream ended early."
    cpu, ended = await cpu_of(b"x" * 1024)
    assert ended == "The upstream sent an event the gateway cannot read."
    # Logged by its size and first bytes, never whole.
    [record] = [r for r in caplog.records if r.name == "ezat.upstream" and "without an event's end" in r.getMessage()]
    logged = record.getMessage()
    assert len(logged) < 500 and int(logged.split()[2]) > 4 * 1024 * 1024, logged[:300]
    assert cpu < max(0.2, 2 * floor), f"{cpu:.3f} s of CPU for 4 MB (the floor: {floor:.3f} s)"
