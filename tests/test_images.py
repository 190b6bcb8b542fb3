"""Images and PDFs (spec "Images and PDFs", issue 6): image URLs downloaded by the gateway and
sent inline, data URLs checked, PDFs as document blocks, and the SSRF guard.

Everything goes through the real interface: the official openai SDK, the real gateway on
loopback, the mock upstream as a real server and a real loopback image server started here that
counts connections and requests per path (and, for connections that fail, one that misbehaves on
purpose). Each test checks what the client got and what the upstream received (nothing, for a
refusal).

Network safety: these tests may only ever connect to loopback. The autouse `loopback_only`
fixture enforces it below the code under test: every socket connect to a non-loopback address
is refused (and fails the test), and every name lookup is numeric-only (`localhost` is answered
from a fixed table), so not even a DNS query leaves the machine. Outside hosts and private
addresses are therefore faked: `aioresponses` for outside hosts and for literal private IPs (it
replaces aiohttp's client, so no connection can happen even if the check failed), and a fake
inner resolver for `PublicOnlyResolver`.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import ipaddress
import re
import shutil
import socket
import ssl
import struct
import subprocess
import time
import zlib
from collections import Counter
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from aiohttp import ClientResponse, web
from aiohttp.abc import AbstractResolver
from aioresponses import aioresponses

from gateway.config import ImagesConfig
from middlewares.core.addresses import PrivateAddress, PublicOnlyResolver, is_public
from tests.requests_util import echo
from tests.support import MODEL, make_config

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
MB = 1024 * 1024
PUBLIC_REASON = "the host is not a public address"


# --- Real tiny images ---------------------------------------------------------------------------


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1×1, 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00"))
        + chunk(b"IEND", b"")
    )


PNG = _png()
JPEG = (
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xdb\x00C\x00" + bytes(64) + b"\xff\xd9"
)
GIF = base64.b64decode("R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7")
WEBP = base64.b64decode("UklGRiQAAABXRUJQVlA4IBgAAAAwAQCdASoBAAEAAwA0JaQAA3AA/vuUAAA=")
IMAGES = {"image/png": PNG, "image/jpeg": JPEG, "image/gif": GIF, "image/webp": WEBP}
PDF = b"%PDF-1.4\n1 0 obj\n<</Type/Catalog>>\nendobj\ntrailer\n<</Root 1 0 R>>\n%%EOF\n"
HTML = b"<!doctype html><html><head><title>Not found</title></head><body>nope</body></html>"


def padded_png(size: int) -> bytes:
    """A PNG signature and header, padded to `size` bytes (the type is judged from the first bytes)."""
    return PNG[:33] + bytes(size - 33)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- Safety net: loopback only ------------------------------------------------------------------


def _loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False  # a name: connecting to it would mean a lookup we did not check
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Refuses (and reports) any connect to a non-loopback address and any DNS query."""
    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    violations: list[Any] = []

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name == "localhost":  # the hosts file, without asking anyone
            answers = [(socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port, 0, 0))]
            return [
                (fam, type or socket.SOCK_STREAM, proto or socket.IPPROTO_TCP, "", address)
                for fam, address in answers
                if family in (0, fam)
            ]
        return real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)

    def guard(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(str(address[0])):
            violations.append(address)
            raise ConnectionRefusedError(f"test safety net: no connection to {address!r}")

    def connect(sock, address):
        guard(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        guard(sock, address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield
    assert violations == [], f"a connection to a non-loopback address was attempted: {violations}"


# --- A real loopback image server ---------------------------------------------------------------


class ImageServer:
    """Serves what a test puts at each path; counts TCP connections and requests per path."""

    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}
        self.hits: Counter[str] = Counter()
        self.connections = 0
        self.in_flight = self.max_in_flight = 0
        self.sent: dict[str, int] = {}  # bytes of body written by `streamed` paths
        self.completed: set[str] = set()  # `streamed` paths whose whole body was written
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ImageServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        handler_factory = self.runner.server

        def protocol():
            self.connections += 1
            return handler_factory()

        self.server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        handler = self.routes.get(request.path)
        if handler is None:
            return web.Response(status=404, text="not found")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1

    def serve(
        self, path: str, body: bytes, content_type: str = "image/png", *, delay: float = 0.0, status: int = 200
    ) -> str:
        async def handler(request):
            await asyncio.sleep(delay)
            return web.Response(status=status, body=body, headers={"Content-Type": content_type})

        self.routes[path] = handler
        return self.url + path

    def redirect(self, path: str, location: str, status: int = 302) -> str:
        async def handler(request):
            return web.Response(status=status, headers={"Location": location})

        self.routes[path] = handler
        return self.url + path

    def streamed(self, path: str, size: int, *, content_length: bool, stall_after: int | None = None) -> str:
        """A PNG of `size` bytes written 64 KB at a time (chunked unless `content_length`);
        with `stall_after`, the body stops after that many bytes and never goes on."""

        async def handler(request):
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            if content_length:
                response.content_length = size
            else:
                response.enable_chunked_encoding()
            await response.prepare(request)
            sent, block = 0, bytes(64 * 1024)
            try:
                if stall_after is not None:
                    await response.write(padded_png(stall_after))
                    sent = stall_after
                    await asyncio.sleep(30)
                while sent < size:
                    piece = (PNG[:33] + block[33:] if sent == 0 else block)[: size - sent]
                    await response.write(piece)
                    sent += len(piece)
                await response.write_eof()
                self.completed.add(path)
            finally:
                self.sent[path] = sent
            return response

        self.routes[path] = handler
        return self.url + path


@pytest.fixture
async def server():
    s = await ImageServer().start()
    yield s
    await s.close()


@pytest.fixture
async def other_server():
    s = await ImageServer().start()
    yield s
    await s.close()


# --- Outside hosts, faked ----------------------------------------------------------------------


class FakedResponse(ClientResponse):
    """aioresponses 0.7.9 builds its responses without the `stream_writer` argument that aiohttp
    3.14's ClientResponse requires; this supplies one that has written nothing."""

    def __init__(self, *args, stream_writer=None, **kwargs) -> None:
        super().__init__(*args, stream_writer=stream_writer or SimpleNamespace(output_size=0), **kwargs)


def fake_get(mocked: aioresponses, url: str, **kwargs) -> None:
    mocked.get(url, response_class=FakedResponse, **kwargs)


# --- Gateway, client and message helpers --------------------------------------------------------


@pytest.fixture
async def start_client(start_gateway, upstream):
    """A client of a gateway with the given `[images]` settings (the spec's defaults otherwise)."""
    clients: list[openai.AsyncOpenAI] = []

    async def start(**images) -> openai.AsyncOpenAI:
        config = dataclasses.replace(make_config(upstream.url), images=ImagesConfig(**images))
        gateway = await start_gateway(config)
        # Caching off: what reaches the upstream is the images stage's work alone (test_caching
        # covers the breakpoints a request with images gets).
        clients.append(gateway.client(default_headers={"x-ezat-cache": "off"}))
        return clients[-1]

    yield start
    for c in clients:
        await c.close()


@pytest.fixture
async def client(start_client):
    """A client of a gateway with the spec's defaults (caching off, as in start_client)."""
    return await start_client()


@pytest.fixture
async def open_client(start_client):
    """The address check off and any port: the loopback image server can be reached."""
    return await start_client(allow_private_hosts=True, ports=())


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def image_url(url: str, **extra) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def look(*parts: dict) -> list[dict[str, Any]]:
    """One user message: a question, then the parts (the first part is content[1])."""
    return [{"role": "user", "content": [text("What is in this image?"), *parts]}]


def image_block(media_type: str, data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}


async def ask(client: openai.AsyncOpenAI, stream: bool, messages: list[dict[str, Any]]) -> str:
    """The answer's text, from a completion or a whole stream."""
    if not stream:
        completion = await client.chat.completions.create(model=MODEL, max_tokens=64, messages=messages)
        return completion.choices[0].message.content
    chunks = [
        c
        async for c in await client.chat.completions.create(model=MODEL, max_tokens=64, messages=messages, stream=True)
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def answered(client, upstream, stream: bool, messages) -> list[dict[str, Any]]:
    """Asks, checks the client got the mock's answer, and returns the messages the upstream received."""
    answer = await ask(client, stream, messages)
    assert answer.startswith("Hello from the mock upstream. You said: ")
    body = upstream.requests[-1].body
    # The mock's answer, unchanged: it echoes the text parts of the last user turn it received.
    said = "\n".join(b["text"] for b in body["messages"][-1]["content"] if b["type"] == "text")
    assert answer == echo(said)
    assert body.get("stream", False) is stream
    return body["messages"]


async def refused(client, upstream, stream: bool, messages) -> str:
    """The message of the 400 invalid_request_error the request must get; the upstream got nothing."""
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(client, stream, messages)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == ("messages", None)
    assert upstream.requests == []
    return error["message"]


# --- Downloads that work ------------------------------------------------------------------------


@STREAM
async def test_downloaded_images_go_inline_typed_by_their_bytes_not_their_content_type(
    open_client, upstream, server, stream
):
    urls = [
        server.serve("/cat.png", PNG, "image/jpeg"),  # the content-type lies
        server.serve("/dog.jpg", JPEG, "image/png"),
        server.serve("/anim", GIF, "application/octet-stream"),
        server.serve("/photo.webp", WEBP, "text/plain"),
    ]
    messages = await answered(open_client, upstream, stream, look(*map(image_url, urls)))
    assert messages == [
        {
            "role": "user",
            "content": [
                text("What is in this image?"),
                image_block("image/png", PNG),
                image_block("image/jpeg", JPEG),
                image_block("image/gif", GIF),
                image_block("image/webp", WEBP),
            ],
        }
    ]
    assert server.hits == {"/cat.png": 1, "/dog.jpg": 1, "/anim": 1, "/photo.webp": 1}


async def test_images_in_several_messages_are_all_inlined(open_client, upstream, server):
    png, jpeg = server.serve("/a.png", PNG), server.serve("/b.jpg", JPEG, "image/jpeg")
    messages = [
        {"role": "user", "content": [image_url(png), text("First")]},
        {"role": "assistant", "content": "Ok"},
        {"role": "user", "content": [text("Second"), image_url(jpeg)]},
    ]
    received = await answered(open_client, upstream, False, messages)
    assert received[0]["content"] == [image_block("image/png", PNG), text("First")]
    assert received[2]["content"] == [text("Second"), image_block("image/jpeg", JPEG)]


@STREAM
async def test_the_same_url_twice_is_fetched_once(open_client, upstream, server, stream):
    url = server.serve("/once.png", PNG)
    messages = await answered(open_client, upstream, stream, look(image_url(url), text("and again"), image_url(url)))
    assert messages[0]["content"] == [
        text("What is in this image?"),
        image_block("image/png", PNG),
        text("and again"),
        image_block("image/png", PNG),
    ]
    assert server.hits["/once.png"] == 1


async def test_downloads_of_one_request_run_concurrently(open_client, upstream, server):
    urls = [server.serve(f"/slow{i}.png", PNG, delay=0.3) for i in range(5)]
    started = time.monotonic()
    messages = await answered(open_client, upstream, False, look(*map(image_url, urls)))
    elapsed = time.monotonic() - started
    assert messages[0]["content"][1:] == [image_block("image/png", PNG)] * 5
    assert elapsed < 1.0, f"5 downloads of 0.3 s each took {elapsed:.2f} s: not concurrent"
    assert server.max_in_flight == 5


async def test_downloads_share_one_connection_pool(open_client, upstream, server):
    first, second = server.serve("/1.png", PNG), server.serve("/2.png", PNG)
    await answered(open_client, upstream, False, look(image_url(first)))
    await answered(open_client, upstream, False, look(image_url(second)))
    assert server.hits == {"/1.png": 1, "/2.png": 1}
    assert server.connections == 1  # the second request's download reused the kept-alive connection


@STREAM
async def test_detail_is_ignored(open_client, upstream, server, stream):
    url = server.serve("/d.png", PNG)
    parts = [image_url(url, detail=detail) for detail in ("high", "low", "auto")]
    parts.append(image_url("data:image/png;base64," + b64(PNG), detail="high"))
    messages = await answered(open_client, upstream, stream, look(*parts))
    assert messages[0]["content"][1:] == [image_block("image/png", PNG)] * 4


@pytest.mark.parametrize("hops", [1, 3])
async def test_up_to_3_redirects_are_followed(open_client, upstream, server, hops):
    server.serve("/r0.png", PNG)
    statuses = [301, 302, 303, 307, 308]
    for n in range(1, hops + 1):
        # relative and absolute Locations, each redirect status
        location = f"/r{n - 1}{'.png' if n == 1 else ''}" if n % 2 else f"{server.url}/r{n - 1}"
        server.redirect(f"/r{n}", location, statuses[n % len(statuses)])
    messages = await answered(open_client, upstream, False, look(image_url(f"{server.url}/r{hops}")))
    assert messages[0]["content"][1] == image_block("image/png", PNG)
    assert server.hits == {f"/r{n}": 1 for n in range(1, hops + 1)} | {"/r0.png": 1}


# --- Downloads that fail: a 400 naming the part, each with its own reason ------------------------


@STREAM
async def test_http_404_names_the_part(open_client, upstream, server, stream):
    message = await refused(open_client, upstream, stream, look(image_url(server.url + "/missing.png")))
    assert message == "messages[0].content[1].image_url.url: could not download the image (HTTP 404)"
    assert server.hits["/missing.png"] == 1


async def test_a_failure_names_the_failing_part_not_the_first(open_client, upstream, server):
    good = server.serve("/good.png", PNG)
    messages = [
        {"role": "user", "content": [image_url(good), text("Hi")]},
        {"role": "assistant", "content": "Ok"},
        {"role": "user", "content": [text("And"), image_url(good), image_url(server.url + "/gone.png")]},
    ]
    message = await refused(open_client, upstream, False, messages)
    assert message == "messages[2].content[2].image_url.url: could not download the image (HTTP 404)"


@pytest.mark.parametrize("status", [403, 500])
async def test_other_http_errors_name_their_status(open_client, upstream, server, status):
    url = server.serve("/err.png", PNG, status=status)
    message = await refused(open_client, upstream, False, look(image_url(url)))
    assert message == f"messages[0].content[1].image_url.url: could not download the image (HTTP {status})"


@STREAM
async def test_4_redirects_are_refused(open_client, upstream, server, stream):
    server.serve("/r0.png", PNG)
    server.redirect("/r1", "/r0.png", 301)
    for n, status in zip(range(2, 5), [308, 302, 301]):
        server.redirect(f"/r{n}", f"/r{n - 1}", status)
    message = await refused(open_client, upstream, stream, look(image_url(server.url + "/r4")))
    assert message == "messages[0].content[1].image_url.url: could not download the image (more than 3 redirects)"
    assert server.hits == {"/r4": 1, "/r3": 1, "/r2": 1, "/r1": 1}  # the 4th redirect is not followed


async def test_a_redirect_loop_is_refused(open_client, upstream, server):
    server.redirect("/loop", "/loop")
    message = await refused(open_client, upstream, False, look(image_url(server.url + "/loop")))
    assert message.endswith("(more than 3 redirects)")
    assert server.hits["/loop"] == 4


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
async def test_an_image_over_10_mb_is_refused_without_reading_it_all(open_client, upstream, server, content_length):
    url = server.streamed("/huge.png", 64 * MB, content_length=content_length)
    started = time.monotonic()
    message = await refused(open_client, upstream, False, look(image_url(url)))
    assert message == "messages[0].content[1].image_url.url: the image is over 10 MB"
    assert time.monotonic() - started < 10
    await asyncio.sleep(0.2)  # let the server's handler see the closed connection
    assert "/huge.png" not in server.completed  # the gateway stopped reading and closed the connection
    # Refused at the header (Content-Length) or at 10 MB (chunked): the rest never left the server
    # but for what the loopback socket buffers held.
    assert server.sent["/huge.png"] < (16 if content_length else 32) * MB


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
async def test_the_image_limit_is_exact(start_client, upstream, server, content_length):
    client = await start_client(allow_private_hosts=True, ports=(), max_image_mb=1)
    exact = server.streamed("/exact.png", MB, content_length=content_length)
    over = server.streamed("/over.png", MB + 1, content_length=content_length)
    messages = await answered(client, upstream, False, look(image_url(exact)))
    assert messages[0]["content"][1] == image_block("image/png", padded_png(MB))
    upstream.requests.clear()
    message = await refused(client, upstream, False, look(image_url(over)))
    assert message == "messages[0].content[1].image_url.url: the image is over 1 MB"


@pytest.mark.parametrize("stall", ["before-headers", "mid-body"])
async def test_a_download_past_the_timeout_is_refused(start_client, upstream, server, stall):
    client = await start_client(allow_private_hosts=True, ports=(), timeout_seconds=0.5)
    if stall == "before-headers":
        url = server.serve("/slow.png", PNG, delay=30)
    else:
        url = server.streamed("/slow.png", 100_000, content_length=True, stall_after=1000)
    started = time.monotonic()
    message = await refused(client, upstream, False, look(image_url(url)))
    elapsed = time.monotonic() - started
    assert message == "messages[0].content[1].image_url.url: could not download the image (timed out after 0.5 s)"
    assert 0.4 < elapsed < 3


# --- Connections that fail: said in words, never an exception's class name ----------------------


class BrokenServer:
    """A loopback server that misbehaves as `answer` says, for each connection: reads the
    request's head, then closes with nothing, closes mid-answer, resets the connection, says
    its body is gzip when it is not, or answers with what is not HTTP; `no-tls` answers an HTTPS
    client's handshake with plain HTTP."""

    HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"

    def __init__(self, answer: str, tls: ssl.SSLContext | None = None) -> None:
        self.answer, self.tls = answer, tls
        self.connections = 0

    async def __aenter__(self) -> BrokenServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.answer == "no-tls":
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            else:
                await reader.readuntil(b"\r\n\r\n")
            if self.answer == "cut-short":
                writer.write(self.HEAD + b"Content-Length: 100000\r\n\r\n" + PNG)
            elif self.answer == "cut-short-chunked":
                writer.write(self.HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % 100_000 + PNG)
            elif self.answer == "bad-gzip":
                writer.write(self.HEAD + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(PNG) + PNG)
            elif self.answer == "not-http":
                writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            elif self.answer == "reset":
                # A zero linger time: closing sends a reset, not the orderly end of the stream.
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        writer.close()


async def test_a_host_name_that_does_not_resolve_is_said_so(start_client, upstream):
    """`.invalid` never resolves (RFC 2606); the safety net answers every lookup of a name with
    "not known" anyway, so no query leaves the machine. With the address check on, as by default,
    and off."""
    for allow_private_hosts in (False, True):
        client = await start_client(allow_private_hosts=allow_private_hosts, ports=())
        message = await refused(client, upstream, False, look(image_url("http://images.example.invalid/cat.png")))
        assert message == (
            "messages[0].content[1].image_url.url: could not download the image (the host name could not be resolved)"
        )


@STREAM
async def test_a_port_where_nothing_listens_is_said_so(open_client, upstream, stream):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # bound, never listened on: a connection to it is refused
    message = await refused(open_client, upstream, stream, look(image_url(f"http://127.0.0.1:{port}/cat.png")))
    assert message == "messages[0].content[1].image_url.url: could not download the image (the connection was refused)"


@pytest.mark.parametrize(
    "answer, reason",
    [
        ("cut-short", "the connection closed before the whole image arrived"),
        ("cut-short-chunked", "the connection closed before the whole image arrived"),
        ("nothing", "the server closed the connection before answering"),
        ("reset", "the connection was reset"),
        ("not-http", "the server's answer was not valid HTTP"),
        ("bad-gzip", "the image's Content-Encoding could not be decoded"),
    ],
)
async def test_a_server_that_breaks_the_connection_is_said_so(open_client, upstream, answer, reason):
    async with BrokenServer(answer) as broken:
        url = f"http://127.0.0.1:{broken.port}/cat.png"
        message = await refused(open_client, upstream, False, look(image_url(url)))
    assert message == f"messages[0].content[1].image_url.url: could not download the image ({reason})"
    assert broken.connections >= 1


async def test_a_tls_handshake_that_fails_is_said_so(open_client, upstream):
    async with BrokenServer("no-tls") as plain:
        message = await refused(open_client, upstream, False, look(image_url(f"https://127.0.0.1:{plain.port}/a.png")))
    assert message == "messages[0].content[1].image_url.url: could not download the image (the TLS handshake failed)"


async def test_a_certificate_that_cannot_be_verified_is_said_so(open_client, upstream, tmp_path):
    """A self-signed certificate, made here for the test: the gateway trusts only real CAs."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with BrokenServer("nothing", tls=tls) as server:
        message = await refused(open_client, upstream, False, look(image_url(f"https://127.0.0.1:{server.port}/a.png")))
    assert message == (
        "messages[0].content[1].image_url.url: could not download the image "
        "(the server's TLS certificate could not be verified)"
    )


@STREAM
@pytest.mark.parametrize(
    "body, content_type",
    [
        (HTML, "image/png"),
        (HTML, "text/html"),
        (b"", "image/png"),
        (PDF, "image/jpeg"),
        (b"BM" + bytes(60), "image/bmp"),
    ],
    ids=["html-as-png", "html", "empty", "pdf-as-jpeg", "bmp"],
)
async def test_a_file_that_is_not_an_image_is_refused(open_client, upstream, server, stream, body, content_type):
    url = server.serve("/fake.png", body, content_type)
    message = await refused(open_client, upstream, stream, look(image_url(url)))
    assert message == "messages[0].content[1].image_url.url: the file is not a JPEG, PNG, GIF or WebP image"


@pytest.mark.parametrize("layout", ["one-message", "two-messages"])
async def test_more_than_20_image_urls_are_refused_at_the_21st(open_client, upstream, server, layout):
    urls = [server.serve(f"/{i}.png", PNG) for i in range(21)]
    if layout == "one-message":
        messages, path = look(*map(image_url, urls)), "messages[0].content[21]"
    else:
        messages = [
            {"role": "user", "content": [image_url(u) for u in urls[:10]]},
            {"role": "assistant", "content": "Ok"},
            {"role": "user", "content": [text("More")] + [image_url(u) for u in urls[10:]]},
        ]
        path = "messages[2].content[11]"
    message = await refused(open_client, upstream, False, messages)
    assert message == f"{path}.image_url.url: more than 20 image URLs in one request"
    assert server.hits["/20.png"] == 0


async def test_20_image_urls_work(open_client, upstream, server):
    urls = [server.serve(f"/{i}.png", PNG) for i in range(20)]
    messages = await answered(open_client, upstream, False, look(*map(image_url, urls)))
    assert messages[0]["content"][1:] == [image_block("image/png", PNG)] * 20
    assert server.hits == {f"/{i}.png": 1 for i in range(20)}


async def test_the_total_download_limit(start_client, upstream, server):
    client = await start_client(allow_private_hosts=True, ports=(), max_total_mb=2)
    body = padded_png(900 * 1024)
    urls = [server.serve(f"/{i}.png", body) for i in range(3)]
    # two images (1.8 MB) fit, three (2.7 MB) do not, though each is far under the per-image limit
    messages = await answered(client, upstream, False, look(*map(image_url, urls[:2])))
    assert messages[0]["content"][1:] == [image_block("image/png", body)] * 2
    upstream.requests.clear()
    message = await refused(client, upstream, False, look(*map(image_url, urls)))
    assert re.fullmatch(
        r"messages\[0\]\.content\[[123]\]\.image_url\.url: the images of this request are over 2 MB in total", message
    )


async def test_32_mb_in_total_with_the_default_limits(start_client, upstream, server):
    client = await start_client(allow_private_hosts=True, ports=())
    body = padded_png(9 * MB)  # each under 10 MB; four are 36 MB
    urls = [server.serve(f"/{i}.png", body) for i in range(4)]
    message = await refused(client, upstream, False, look(*map(image_url, urls)))
    assert re.fullmatch(
        r"messages\[0\]\.content\[[1-4]\]\.image_url\.url: the images of this request are over 32 MB in total", message
    )


@STREAM
async def test_downloads_too_large_once_inlined_are_a_413_before_the_upstream(start_client, upstream, server, stream):
    """27 MB of downloads are within the spec's 32 MB, but as base64 they make a 36 MB request,
    more than the upstream takes: refused with a message that says why, without sending it."""
    client = await start_client(allow_private_hosts=True, ports=())
    urls = [server.serve(f"/{i}.png", padded_png(9 * MB)) for i in range(3)]
    with pytest.raises(openai.APIStatusError) as caught:
        await ask(client, stream, look(*map(image_url, urls)))
    assert caught.value.status_code == 413
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["code"] == "request_too_large"
    assert re.fullmatch(
        r"The request is over 32 MB once its image URLs are downloaded and inlined \(3\d,\d{3},\d{3} bytes\); "
        r"send fewer or smaller images\.",
        caught.value.body["message"],
    )
    assert upstream.requests == []


# --- A request refused for another field downloads nothing ----------------------------------------


@STREAM
async def test_an_unknown_reasoning_effort_is_refused_before_any_image_is_fetched(
    open_client, upstream, server, stream
):
    server.serve("/cat.png", PNG)
    kwargs = dict(model=MODEL, max_tokens=64, messages=look(image_url(f"{server.url}/cat.png")), stream=stream)
    with pytest.raises(openai.BadRequestError) as caught:
        await open_client.chat.completions.create(**kwargs, extra_body={"reasoning_effort": "extreme"})
    assert caught.value.body == {
        "message": "reasoning_effort: use one of none, minimal, low, medium, high, xhigh, max",
        "type": "invalid_request_error",
        "param": "reasoning_effort",
        "code": None,
    }
    assert server.connections == 0 and upstream.requests == []
    await ask(open_client, stream, kwargs["messages"])  # the same request without it: the image is fetched
    assert server.hits == {"/cat.png": 1}


# --- Scheme, credentials, ports: refused before any connection ----------------------------------


@STREAM
async def test_a_url_with_credentials_is_refused_with_no_connection(open_client, upstream, server, stream):
    server.serve("/x.png", PNG)
    for userinfo in ("user:pass@", "user@"):
        url = f"http://{userinfo}127.0.0.1:{server.port}/x.png"
        message = await refused(open_client, upstream, stream, look(image_url(url)))
        assert message == "messages[0].content[1].image_url.url: URLs with credentials are not allowed"
    assert server.connections == 0


@STREAM
async def test_a_port_not_in_ports_is_refused_with_no_connection(start_client, upstream, server, stream):
    client = await start_client(allow_private_hosts=True, ports=(80, 443))
    url = server.serve("/x.png", PNG)
    message = await refused(client, upstream, stream, look(image_url(url)))
    assert message == f"messages[0].content[1].image_url.url: port {server.port} is not allowed"
    assert server.connections == 0


async def test_a_redirect_to_a_port_not_in_ports_is_refused_with_no_connection(
    start_client, upstream, server, other_server
):
    client = await start_client(allow_private_hosts=True, ports=(server.port,))
    target = other_server.serve("/x.png", PNG)
    url = server.redirect("/jump", target)
    message = await refused(client, upstream, False, look(image_url(url)))
    assert message == f"messages[0].content[1].image_url.url: port {other_server.port} is not allowed"
    assert server.hits == {"/jump": 1}
    assert other_server.connections == 0


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1/x.png", "file:///etc/passwd", "gopher://127.0.0.1:70/_x", "//127.0.0.1/x.png", "127.0.0.1/x.png"],
)
async def test_only_http_and_https_urls(open_client, upstream, url):
    message = await refused(open_client, upstream, False, look(image_url(url)))
    assert message == "messages[0].content[1].image_url.url: expected an http(s) URL or a base64 data URL"


@pytest.mark.parametrize("location", ["ftp://127.0.0.1/x.png", "file:///etc/passwd"])
async def test_a_redirect_to_another_scheme_is_refused(open_client, upstream, server, location):
    url = server.redirect("/jump", location)
    message = await refused(open_client, upstream, False, look(image_url(url)))
    assert message == "messages[0].content[1].image_url.url: only http and https URLs can be downloaded"


# --- SSRF, end to end, with the address check on ------------------------------------------------

# Every spelling here means this machine; the check must refuse each before connecting.
LOOPBACK_SPELLINGS = {
    "127.0.0.1": "127.0.0.1",
    "localhost": "localhost",
    "ipv6": "[::1]",
    "decimal": "2130706433",
    "octal": "0177.0.0.1",
    "short": "127.1",
    "ipv4-mapped": "[::ffff:127.0.0.1]",
    "unspecified": "0.0.0.0",
    "other-loopback": "127.0.0.2",
}


@pytest.mark.parametrize("host", list(LOOPBACK_SPELLINGS.values()), ids=list(LOOPBACK_SPELLINGS))
async def test_loopback_in_any_spelling_is_refused_with_no_connection(start_client, upstream, server, host):
    client = await start_client(ports=())  # the address check on (the default); any port
    server.serve("/x.png", PNG)
    message = await refused(client, upstream, False, look(image_url(f"http://{host}:{server.port}/x.png")))
    assert message.startswith("messages[0].content[1].image_url.url: ")
    assert server.connections == 0
    assert server.hits == {}


@pytest.mark.parametrize(
    "host",
    [pytest.param(host, id=name) for name, host in LOOPBACK_SPELLINGS.items()],
)
async def test_loopback_in_any_spelling_gets_the_private_host_reason(start_client, upstream, server, host):
    client = await start_client(ports=())
    server.serve("/x.png", PNG)
    message = await refused(client, upstream, False, look(image_url(f"http://{host}:{server.port}/x.png")))
    assert message == f"messages[0].content[1].image_url.url: {PUBLIC_REASON}"
    assert server.connections == 0


@STREAM
async def test_the_address_check_is_on_by_default(client, upstream, server, stream):
    """The shared `client` fixture: a gateway with the spec's defaults."""
    server.serve("/x.png", PNG)
    message = await refused(client, upstream, stream, look(image_url(f"http://127.0.0.1:{server.port}/x.png")))
    assert message == f"messages[0].content[1].image_url.url: {PUBLIC_REASON}"
    assert server.connections == 0


PRIVATE_LITERALS = [
    "10.0.0.1",
    "10.255.255.53",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # CGNAT
    "224.0.0.1",  # multicast
    "239.255.255.250",
    "240.0.0.1",  # reserved
    "255.255.255.255",
    "[::]",
    "[fc00::1]",
    "[fd00:ec2::254]",  # AWS's IPv6 metadata address
    "[fe80::1]",
    "[ff02::1]",
    "[::ffff:10.0.0.1]",  # IPv4-mapped
    "[::ffff:169.254.169.254]",
    "[::ffff:a9fe:a9fe]",
    "[::10.0.0.1]",  # IPv4-compatible
    "[::169.254.169.254]",
    "[2002:a9fe:a9fe::1]",  # 6to4 of 169.254.169.254
    "[2002:c0a8:101::1]",  # 6to4 of 192.168.1.1
    "[64:ff9b::a9fe:a9fe]",  # NAT64 of 169.254.169.254
    "[64:ff9b::10.0.0.1]",
]


@pytest.mark.parametrize("host", PRIVATE_LITERALS)
async def test_a_private_address_is_refused_before_any_request(client, upstream, host):
    """The default gateway (the check on). aioresponses replaces aiohttp's client, so
    nothing could be reached even if the check failed; it records every request it is asked for."""
    with aioresponses(passthrough=[upstream.url]) as mocked:
        message = await refused(client, upstream, False, look(image_url(f"http://{host}/latest/meta-data/iam.png")))
    assert message == f"messages[0].content[1].image_url.url: {PUBLIC_REASON}"
    assert mocked.requests == {}


async def test_a_cookie_a_host_sets_goes_with_no_later_download(start_client, upstream, server):
    """One download pool serves every key: a cookie one key's download was given (a signed
    URL's session, say) must not open that host's images to the next request."""
    cookies = []

    async def handler(request):
        cookies.append(request.headers.get("Cookie"))
        return web.Response(body=PNG, headers={"Content-Type": "image/png", "Set-Cookie": "session=first-key; Path=/"})

    server.routes["/signed.png"] = handler
    client = await start_client(allow_private_hosts=True, ports=())
    for _ in range(2):
        # By name: aiohttp's cookie jar keeps no cookie of an IP address's.
        await answered(client, upstream, False, look(image_url(f"http://localhost:{server.port}/signed.png")))
    assert cookies == [None, None]


async def test_a_redirect_to_a_private_address_is_refused(client, upstream):
    with aioresponses(passthrough=[upstream.url]) as mocked:
        fake_get(
            mocked,
            "https://images.example.com/cat.png",
            status=302,
            headers={"Location": "http://169.254.169.254/latest/meta-data/"},
        )
        fake_get(mocked, "http://169.254.169.254/latest/meta-data/", body=PNG, content_type="image/png")
        message = await refused(client, upstream, False, look(image_url("https://images.example.com/cat.png")))
    assert message == f"messages[0].content[1].image_url.url: {PUBLIC_REASON}"
    assert [str(url) for _, url in mocked.requests] == ["https://images.example.com/cat.png"]


@STREAM
async def test_an_outside_host_is_downloaded(client, upstream, stream):
    """Outside hosts are faked (aioresponses bypasses the resolver): this proves the download and
    the inlining with the default settings, not the address check."""
    with aioresponses(passthrough=[upstream.url]) as mocked:
        fake_get(mocked, "https://images.example.com/cat.png", body=PNG, content_type="text/plain")
        fake_get(mocked, "https://images.example.com/go", status=301, headers={"Location": "/photo"})
        fake_get(mocked, "https://images.example.com/photo", body=JPEG, content_type="image/gif")
        parts = [image_url("https://images.example.com/cat.png"), image_url("https://images.example.com/go")]
        messages = await answered(client, upstream, stream, look(*parts))
    assert messages[0]["content"][1:] == [image_block("image/png", PNG), image_block("image/jpeg", JPEG)]
    assert len(mocked.requests) == 3


async def test_an_outside_host_on_any_port_is_downloaded(client, upstream):
    """The spec limits the host (a public address), not the port."""
    with aioresponses(passthrough=[upstream.url]) as mocked:
        fake_get(mocked, "https://images.example.com:8443/cat.png", body=PNG)
        messages = await answered(client, upstream, False, look(image_url("https://images.example.com:8443/cat.png")))
    assert messages[0]["content"][1:] == [image_block("image/png", PNG)]


# --- The address check itself: is_public and PublicOnlyResolver ---------------------------------

NOT_PUBLIC = [
    "0.0.0.0",
    "0.1.2.3",
    "127.0.0.1",
    "127.255.255.254",
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.0.1",
    "169.254.0.1",
    "169.254.169.254",
    "100.64.0.1",
    "100.127.255.254",
    "192.0.0.1",
    "192.0.2.1",
    "198.18.0.1",
    "198.51.100.1",
    "203.0.113.1",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "febf::1",
    "fec0::1",
    "feff::1",
    "ff02::1",
    "ff0e::1",
    "2001:db8::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "::ffff:192.168.1.1",
    "::ffff:169.254.169.254",
    "::ffff:100.64.0.1",
    "::127.0.0.1",
    "::10.0.0.1",
    "::169.254.169.254",  # IPv4-compatible
    "2002:7f00:1::1",
    "2002:a00:1::",
    "2002:c0a8:101::1",
    "2002:a9fe:a9fe::",  # 6to4
    "64:ff9b::127.0.0.1",
    "64:ff9b::10.0.0.1",
    "64:ff9b::169.254.169.254",
    "64:ff9b::192.168.1.1",  # NAT64
    # Special-purpose blocks that Python before 3.11.10 and 3.12.4 calls global:
    "192.0.0.8",
    "192.0.0.170",
    "192.88.99.1",
    "2001:2::1",
    "2001:10::1",
    "3fff::1",
    "64:ff9b:1::a00:1",
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e"]


@pytest.mark.parametrize("address", NOT_PUBLIC)
def test_is_public_refuses(address):
    assert is_public(ipaddress.ip_address(address)) is False


@pytest.mark.parametrize("address", PUBLIC)
def test_is_public_accepts(address):
    assert is_public(ipaddress.ip_address(address)) is True


class FakeDNS(AbstractResolver):
    """A resolver answering from a table (DNS is an outside system; no connection happens)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.closed = False

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        self.asked.append(host)
        return [
            {
                "hostname": host,
                "host": ip,
                "port": port,
                "family": socket.AF_INET6 if ":" in ip else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for ip in self.answers[host]
        ]

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("address", NOT_PUBLIC + ["fe80::1%eth0", "fe80::1%2"])
async def test_public_only_resolver_refuses_a_name_of_a_private_address(address):
    resolver = PublicOnlyResolver(FakeDNS({"evil.example": [address]}))
    with pytest.raises(PrivateAddress):
        await resolver.resolve("evil.example", 80)


async def test_public_only_resolver_keeps_only_the_public_addresses():
    dns = FakeDNS(
        {
            "mixed.example": ["10.0.0.1", "93.184.216.34", "169.254.169.254", "::1", "2606:4700:4700::1111"],
            "all-private.example": ["127.0.0.1", "::1", "10.0.0.1", "fd00::1"],
        }
    )
    resolver = PublicOnlyResolver(dns)
    kept = await resolver.resolve("mixed.example", 443, socket.AF_UNSPEC)
    assert [entry["host"] for entry in kept] == ["93.184.216.34", "2606:4700:4700::1111"]
    assert all(entry["port"] == 443 for entry in kept)
    with pytest.raises(PrivateAddress):
        await resolver.resolve("all-private.example", 443)
    assert dns.asked == ["mixed.example", "all-private.example"]
    await resolver.close()
    assert dns.closed


@pytest.mark.parametrize(
    "host",
    [
        "2130706433",
        "0177.0.0.1",
        "127.1",
        "0x7f.1",
        "167772161",
        "012.0.0.1",
        "10.1",
        "0xa9fea9fe",
        "0251.0376.0251.0376",
        "3232235777",
    ],
)
async def test_public_only_resolver_judges_odd_ipv4_spellings_by_their_address(host):
    """The real default resolver: these are numbers, so the lookup is local (and `loopback_only`
    makes sure no lookup leaves the machine)."""
    resolver = PublicOnlyResolver()
    with pytest.raises(PrivateAddress):
        await resolver.resolve(host, 80, socket.AF_UNSPEC)
    await resolver.close()


# --- Data URLs ----------------------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize("media_type", list(IMAGES))
async def test_a_data_url_of_each_allowed_type(open_client, upstream, server, stream, media_type):
    data = IMAGES[media_type]
    messages = await answered(open_client, upstream, stream, look(image_url(f"data:{media_type};base64,{b64(data)}")))
    assert messages[0]["content"][1] == image_block(media_type, data)
    assert server.connections == 0


@STREAM
@pytest.mark.parametrize(
    "url",
    [
        "data:image/bmp;base64," + b64(b"BM" + bytes(60)),
        "data:image/svg+xml;base64," + b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>"),
        "data:image/tiff;base64," + b64(b"II*\x00" + bytes(8)),
        "data:application/pdf;base64," + b64(PDF),
        "data:image/png," + b64(PNG),  # not base64
        "data:image/png;charset=utf-8,%89PNG",
        "data:image/png;base64,!!!not base64!!!",
        "data:;base64," + b64(PNG),
    ],
    ids=["bmp", "svg", "tiff", "pdf", "no-base64-marker", "percent-encoded", "bad-base64", "no-type"],
)
async def test_a_data_url_that_is_not_a_base64_image_of_an_allowed_type_is_refused(open_client, upstream, stream, url):
    message = await refused(open_client, upstream, stream, look(text("x"), image_url(url)))
    assert message.startswith("messages[0].content[2].image_url.url: ")


@pytest.mark.parametrize(
    "declared, data",
    [
        ("image/png", JPEG),
        ("image/jpeg", PNG),
        ("image/gif", WEBP),
        ("image/webp", GIF),
        ("image/png", HTML),
        ("image/png", b""),
    ],
    ids=["jpeg-as-png", "png-as-jpeg", "webp-as-gif", "gif-as-webp", "html-as-png", "empty"],
)
async def test_a_data_url_whose_bytes_are_not_its_type_is_refused(open_client, upstream, declared, data):
    message = await refused(open_client, upstream, False, look(image_url(f"data:{declared};base64,{b64(data)}")))
    assert message.startswith("messages[0].content[1].image_url.url: ")


# --- PDFs ---------------------------------------------------------------------------------------


@STREAM
async def test_a_pdf_file_part_becomes_a_document_block(open_client, upstream, stream):
    part = {"type": "file", "file": {"filename": "report.pdf", "file_data": "data:application/pdf;base64," + b64(PDF)}}
    messages = await answered(open_client, upstream, stream, [{"role": "user", "content": [text("Summarise."), part]}])
    assert messages[0]["content"] == [
        text("Summarise."),
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": b64(PDF)}},
    ]


@STREAM
@pytest.mark.parametrize(
    "file",
    [
        {"file_data": "data:text/plain;base64," + b64(b"hello")},
        {"file_data": "data:image/png;base64," + b64(PNG)},
        {"file_data": "data:application/pdf," + b64(PDF)},
        {"filename": "report.pdf"},
    ],
    ids=["text", "png", "not-base64", "no-file-data"],
)
async def test_a_file_part_that_is_not_a_pdf_is_refused(open_client, upstream, stream, file):
    message = await refused(
        open_client, upstream, stream, [{"role": "user", "content": [text("Read"), {"type": "file", "file": file}]}]
    )
    assert message.startswith("messages[0].content[1].file")


@STREAM
async def test_file_id_is_refused_with_the_spec_message(open_client, upstream, stream):
    messages = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc123"}}, text("Read it")]}]
    message = await refused(open_client, upstream, stream, messages)
    assert (
        message
        == "messages[0].content[0].file: send the PDF as file_data (a base64 data URL); file_id is not supported"
    )
