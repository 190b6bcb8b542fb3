"""Micro-benchmark: what one upstream request costs the process that makes it, with aiohttp's
client set up as the gateway's (gateway.upstream.client.UpstreamClient: one pooled ClientSession) and
with a bare asyncio Protocol that writes the request's bytes and reads a Content-Length reply,
the least any HTTP/1.1 client on asyncio can do. Both POST the `nonstream` scenario's Anthropic
request to the fast mock (a process of its own) over `concurrency` keep-alive connections.

The floor and the gateway both pay the first figure on every request; the difference is what a
client of our own would save (issue 5's notes), before the code it would need for chunked
bodies, TLS, pooling, timeouts and flow control.

    python bench/upstream_client.py [--requests 6000] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import orjson
from scenarios import SCENARIOS, anthropic_request
from systems import mock_system

from gateway.config import Deployment
from gateway.runtime import run, tune_garbage_collector
from gateway.upstream.client import UpstreamClient

BODY = anthropic_request(SCENARIOS["nonstream"])


class BareClient(asyncio.Protocol):
    """One keep-alive connection; one request at a time; Content-Length replies only."""

    def __init__(self) -> None:
        self._buffer = b""
        self._reply: asyncio.Future[bytes] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self._buffer[:end].lower()
        start = head.index(b"content-length:") + 15
        line_end = head.find(b"\r\n", start)
        length = int(head[start : line_end if line_end >= 0 else len(head)])
        if len(self._buffer) >= end + 4 + length:
            body, self._buffer = self._buffer[end + 4 : end + 4 + length], self._buffer[end + 4 + length :]
            self._reply.set_result(body)

    def post(self, request: bytes) -> asyncio.Future[bytes]:
        self._reply = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._reply


async def per_request(send, requests: int, concurrency: int) -> float:
    """CPU µs per request of this process, `concurrency` senders sharing `requests`."""

    async def sender(count: int) -> None:
        for _ in range(count):
            await send()

    await sender(200)  # warm up: connections open, caches filled
    start = time.process_time()
    await asyncio.gather(*(sender(requests // concurrency) for _ in range(concurrency)))
    return (time.process_time() - start) / (requests // concurrency * concurrency) * 1e6


async def measure(port: int, requests: int, concurrency: int, rounds: int) -> None:
    tune_garbage_collector()
    deployment = Deployment(name="mock", base_url=f"http://127.0.0.1:{port}", api_key="bench")
    upstream = UpstreamClient()
    lifespan = upstream.lifespan(None)
    await anext(lifespan)
    body = orjson.loads(BODY)

    async def with_aiohttp() -> None:
        async with await upstream.post(deployment, body) as response:
            await response.read()

    request = (
        b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nx-api-key: bench\r\n"
        b"anthropic-version: 2023-06-01\r\ncontent-type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (port, len(BODY))
    ) + BODY
    loop = asyncio.get_running_loop()
    bare = [(await loop.create_connection(BareClient, "127.0.0.1", port))[1] for _ in range(concurrency)]
    free = list(bare)

    async def with_bare_protocol() -> None:
        client = free.pop()
        try:
            await client.post(request)
        finally:
            free.append(client)

    try:
        for round_ in range(1, rounds + 1):
            aiohttp_us = await per_request(with_aiohttp, requests, concurrency)
            bare_us = await per_request(with_bare_protocol, requests, concurrency)
            print(
                f"round {round_}: aiohttp client {aiohttp_us:5.1f} µs/request, bare protocol {bare_us:5.1f} µs/request"
            )
    finally:
        for client in bare:
            client.transport.close()
        await anext(lifespan, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        mock = mock_system().start(Path(workdir))
        try:
            run(measure(mock.port, args.requests, args.concurrency, args.rounds))
        finally:
            mock.stop()


if __name__ == "__main__":
    main()
