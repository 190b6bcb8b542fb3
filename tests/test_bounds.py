"""Nothing can tie the gateway up: the bounds on one request's lists and schemas (the bounds
stage, in the gateway and alone), a schema nested a thousand levels deep, compressed bodies
(decoded, capped once decoded, refused when they do not decode or use another encoding), and a
body that never finishes arriving (408, its connection closed). Through real servers on
loopback: the gateway (in this process, and as `ezat-gateway serve`) in front of the mock
upstream, and the stages in a foreign aiohttp app; the official SDK where it can send the
request, raw HTTP where it cannot. Where the gateway once failed, the log must hold no error."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib
from dataclasses import replace

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.config import BoundsConfig, Model, Pricing, ServerConfig
from middlewares.bounds import Bounds, bounds_middleware
from middlewares.core import BODY, ChainError, checked, error_envelope
from middlewares.core import MODEL as MODEL_KEY
from middlewares.size_limit import size_limit_middleware
from middlewares.translator import translator_middleware
from tests.support import KEY, MODEL, SERVE_CONFIG, ServeProcess, make_config, run_command, setting

ENDPOINT = "/openai/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
REPLY = "Hello from the mock upstream. You said: Hi"


def chain(levels: int) -> dict:
    """A schema `levels` JSON levels deep, through `items`: arrays of arrays … of strings."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def object_schema(levels: int) -> dict:
    """A closed object schema `levels` JSON levels deep (itself, its properties, then a chain)."""
    return {"type": "object", "properties": {"x": chain(levels - 2)}, "additionalProperties": False}


def wide_schema(levels: int) -> dict:
    """object_schema(levels) with twenty more properties, shallow ones whose descriptions hold
    brackets: far more brackets in its JSON than levels, which a count alone would misjudge."""
    schema = object_schema(levels)
    for i in range(20):
        schema["properties"][f"p{i}"] = {"type": "array", "items": {"type": "string"}, "description": "{[{["}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(name: str, parameters: dict | None = None) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": parameters or {"type": "object", "properties": {}}},
    }


def no_errors_logged(caplog) -> list[str]:
    """Every record at ERROR or above, and every record with a traceback: there must be none."""
    return [
        f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info
    ]


async def post(url: str, data, headers: dict | None = None) -> tuple[int, dict]:
    """POST raw bytes (or an async iterator of them: chunked) with the test key."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=data, headers=headers) as response:
            return response.status, await response.json(content_type=None)


def hello(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": HI, **fields}).encode()


# --- A schema nested a thousand levels deep -------------------------------------------------------

DEEP_ITEMS = 1_000  # under the 1,024 levels the body parser takes; far over Python's recursion limit


def deep_items_body(levels: int = DEEP_ITEMS, innermost: str = '{"type": "string"}') -> bytes:
    """A request whose response_format schema nests `levels` schemas through `items`, built as
    text (Python's json module cannot encode it)."""
    schema = '{"type": "array", "items": ' * (levels - 1) + innermost + "}" * (levels - 1)
    head = json.dumps({"model": MODEL, "messages": HI, "response_format": json_schema({})})
    return head.replace('"schema": {}', '"schema": ' + schema).encode()


async def test_a_response_format_schema_nested_1000_levels_through_items_is_a_400_and_nothing_is_logged(
    gateway, caplog
):
    caplog.set_level(logging.INFO)
    status, answer = await post(gateway.url + ENDPOINT, deep_items_body())
    assert (status, answer) == (
        400,
        {
            "error": {
                "message": "response_format.json_schema.schema: nests more than 100 levels",
                "type": "invalid_request_error",
                "param": "response_format",
                "code": None,
            }
        },
    )
    assert no_errors_logged(caplog) == []


async def translated(request: web.Request) -> web.Response:
    # (Not the body itself: no JSON encoder writes a thousand levels.)
    return web.json_response({"translated": "output_config" in request[BODY]})


@pytest.fixture
async def foreign():
    """Starts foreign aiohttp apps on loopback (`auto_decompress`: aiohttp's default, it decodes
    bodies itself); each is cleaned up after the test."""
    runners: list[web.AppRunner] = []

    async def start(middlewares, handler=None, *, auto_decompress: bool = True) -> str:
        app = web.Application(middlewares=[error_envelope, *checked(middlewares)])
        app.router.add_post("/chat", handler or echo)
        runner = web.AppRunner(app, access_log=None, auto_decompress=auto_decompress)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/chat"

    yield start
    for runner in runners:
        await runner.cleanup()


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"body": request[BODY]})


async def test_without_bounds_the_translator_walks_a_schema_1000_levels_deep(foreign, caplog):
    caplog.set_level(logging.INFO)
    url = await foreign(
        [
            size_limit_middleware(),
            setting("the_model", MODEL_KEY, Model(id=MODEL, upstream_model="m", deployments=("x",), pricing=Pricing())),
            translator_middleware(),
        ],
        translated,
    )
    assert await post(url, deep_items_body()) == (200, {"translated": True})
    # The walk reaches the bottom: an open object there is found, and named by its path.
    status, answer = await post(url, deep_items_body(innermost='{"type": "object"}'))
    assert status == 400
    path = "response_format.json_schema.schema" + ".items" * (DEEP_ITEMS - 1)
    assert answer["error"]["message"] == f'{path}: objects need "additionalProperties": false'
    assert no_errors_logged(caplog) == []


# --- The bounds in the gateway ---------------------------------------------------------------------


async def test_200000_messages_are_refused_naming_messages(gateway, upstream):
    # Raw HTTP: the SDK takes half a minute to prepare 200,000 messages.
    status, answer = await post(gateway.url + ENDPOINT, json.dumps({"model": MODEL, "messages": HI * 200_000}).encode())
    assert (status, answer) == (
        400,
        {
            "error": {
                "message": "messages: at most 100,000 messages per request (this one has 200,000)",
                "type": "invalid_request_error",
                "param": "messages",
                "code": None,
            }
        },
    )
    assert upstream.requests == []


SMALL = BoundsConfig(max_messages=4, max_content_parts=5, max_tools=2, max_stop=3, max_schema_depth=6)
PARTS = [{"type": "text", "text": "Hi"}]
# bound: (the fields of a request just at it, of one just over it, the message and param of the 400)
AT_AND_OVER = {
    "messages": (
        {"messages": HI * 4},
        {"messages": HI * 5},
        "messages: at most 4 messages per request (this one has 5)",
        "messages",
    ),
    "content parts": (
        {
            "messages": [
                {"role": "user", "content": PARTS * 3},
                {"role": "assistant", "content": "Yes?"},
                {"role": "user", "content": PARTS * 2},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": PARTS * 3},
                {"role": "assistant", "content": "Yes?"},
                {"role": "user", "content": PARTS * 3},
            ]
        },
        "messages: at most 5 content parts per request (this one has 6)",
        "messages",
    ),
    "tools": (
        {"tools": [tool("a"), tool("b")]},
        {"tools": [tool("a"), tool("b"), tool("c")]},
        "tools: at most 2 tools per request (this one has 3)",
        "tools",
    ),
    "stop": (
        {"stop": ["x", "y", "z"]},
        {"stop": ["w", "x", "y", "z"]},
        "stop: at most 3 stop sequences per request (this one has 4)",
        "stop",
    ),
    "tool schema": (
        {"tools": [tool("a"), tool("b", object_schema(6))]},
        {"tools": [tool("a"), tool("b", object_schema(7))]},
        "tools[1].function.parameters: nests more than 6 levels",
        "tools",
    ),
    "wide tool schema": (
        {"tools": [tool("a"), tool("b", wide_schema(6))]},
        {"tools": [tool("a"), tool("b", wide_schema(7))]},
        "tools[1].function.parameters: nests more than 6 levels",
        "tools",
    ),
    "response_format schema": (
        {"response_format": json_schema(object_schema(6))},
        {"response_format": json_schema(object_schema(7))},
        "response_format.json_schema.schema: nests more than 6 levels",
        "response_format",
    ),
}


@pytest.mark.parametrize("bound", sorted(AT_AND_OVER))
async def test_a_request_over_a_bound_is_refused_naming_it_and_one_at_it_is_answered(start_gateway, upstream, bound):
    at, over, message, param = AT_AND_OVER[bound]
    gateway = await start_gateway(replace(make_config(upstream.url), bounds=SMALL))
    async with gateway.client() as client:
        answer = await client.chat.completions.create(**{"model": MODEL, "messages": HI, **at})
        assert answer.choices[0].message.content.startswith("Hello from the mock upstream.")
        before = len(upstream.requests)
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(**{"model": MODEL, "messages": HI, **over})
    assert error.value.body == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert len(upstream.requests) == before


# --- The bounds stage alone, on a native Anthropic request's fields --------------------------------

ALONE = dict(max_messages=3, max_content_parts=3, max_tools=2, max_stop=2, max_schema_depth=3)
BLOCK = {"type": "text", "text": "Be brief."}
# (fields of an Anthropic Messages request, the 400's message and param; None: within the bounds)
ANTHROPIC = [
    ({"system": [BLOCK, BLOCK], "messages": [{"role": "user", "content": [BLOCK]}]}, None),
    (
        {"system": [BLOCK, BLOCK], "messages": [{"role": "user", "content": [BLOCK, BLOCK]}]},
        ("messages: at most 3 content parts per request (this one has 4)", "messages"),
    ),
    ({"stop_sequences": ["a", "b"]}, None),
    (
        {"stop_sequences": ["a", "b", "c"]},
        ("stop_sequences: at most 2 stop sequences per request (this one has 3)", "stop_sequences"),
    ),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]}, None),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}]}, None),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"items": {}}}}}]},
        ("tools[0].input_schema: nests more than 3 levels", "tools"),
    ),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {}}}}}, None),
    (
        {"output_config": {"format": {"type": "json_schema", "schema": {"properties": {"x": {"items": {}}}}}}},
        ("output_config.format.schema: nests more than 3 levels", "output_config"),
    ),
    ({"messages": HI * 3}, None),
    ({"messages": HI * 4}, ("messages: at most 3 messages per request (this one has 4)", "messages")),
]


@pytest.mark.parametrize(
    ("fields", "refused"), ANTHROPIC, ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None
)
async def test_the_bounds_stage_alone_reads_anthropic_field_names(foreign, fields, refused):
    url = await foreign([size_limit_middleware(), bounds_middleware(Bounds(**ALONE))])
    body = {"model": "claude", "max_tokens": 10, "messages": HI, **fields}
    status, answer = await post(url, json.dumps(body).encode())
    if refused is None:
        assert (status, answer) == (200, {"body": body})
    else:
        message, param = refused
        assert (status, answer["error"]) == (
            400,
            {"message": message, "type": "invalid_request_error", "param": param, "code": None},
        )


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "10", None])
def test_the_bounds_stage_refuses_a_bad_setting_when_built(value):
    with pytest.raises(ValueError, match="^Bounds: max_tools must be a positive integer$"):
        bounds_middleware(Bounds(max_tools=value))


def test_the_bounds_stage_needs_size_limit_before_it():
    with pytest.raises(ChainError, match="^bounds needs the request's body, which size_limit provides"):
        checked([bounds_middleware(), size_limit_middleware()])


# --- Compressed bodies -------------------------------------------------------------------------------

ENCODERS = {
    "gzip": ("gzip", gzip.compress),
    "deflate": ("deflate", zlib.compress),
    "raw deflate": ("deflate", lambda data: zlib.compress(data)[2:-4]),  # what some clients send as deflate
}


async def chunks(data: bytes, size: int = 7):
    for start in range(0, len(data), size):
        yield data[start : start + size]


def framed(data: bytes, framing: str):
    return data if framing == "Content-Length" else chunks(data)


FRAMINGS = pytest.mark.parametrize("framing", ["Content-Length", "chunked"])


@FRAMINGS
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
async def test_a_compressed_body_is_decoded_and_answered(gateway, upstream, encoder, framing):
    encoding, compress = ENCODERS[encoder]
    status, answer = await post(
        gateway.url + ENDPOINT, framed(compress(hello()), framing), {"Content-Encoding": encoding}
    )
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == REPLY
    assert len(upstream.requests) == 1


@FRAMINGS
@pytest.mark.parametrize("encoding", ["identity", "IDENTITY", "GZIP", " gzip "])
async def test_identity_and_any_case_are_accepted(gateway, encoding, framing):
    data = gzip.compress(hello()) if "gzip" in encoding.lower() else hello()
    status, answer = await post(gateway.url + ENDPOINT, framed(data, framing), {"Content-Encoding": encoding})
    assert (status, answer["choices"][0]["message"]["content"]) == (200, REPLY)


NOT_DECODABLE = {
    "gzip": ("gzip", b"this is not gzip at all"),
    "truncated gzip": ("gzip", gzip.compress(hello())[:20]),
    "deflate": ("deflate", b"\x78\x9cthis is not deflate"),
}


@FRAMINGS
@pytest.mark.parametrize("case", sorted(NOT_DECODABLE))
async def test_a_body_that_does_not_decode_is_a_400_and_nothing_is_logged(gateway, caplog, case, framing):
    caplog.set_level(logging.INFO)
    encoding, data = NOT_DECODABLE[case]
    status, answer = await post(gateway.url + ENDPOINT, framed(data, framing), {"Content-Encoding": encoding})
    assert (status, answer["error"]) == (
        400,
        {
            "message": f"The request body is not valid {encoding}.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        },
    )
    assert no_errors_logged(caplog) == []


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_an_empty_compressed_body_is_a_400_about_its_json(gateway, caplog, encoding):
    """No bytes at all under a Content-Encoding: aiohttp's reader of an empty body counts none
    (it was a 500 and a logged traceback)."""
    caplog.set_level(logging.INFO)
    status, answer = await post(gateway.url + ENDPOINT, b"", {"Content-Encoding": encoding})
    assert (status, answer["error"]["type"]) == (400, "invalid_request_error")
    assert answer["error"]["message"].startswith("The request body is not valid JSON")
    assert no_errors_logged(caplog) == []


@FRAMINGS
@pytest.mark.parametrize("decoder", ["aiohttp", "the stage"])
async def test_in_a_foreign_app_gzip_works_and_bad_gzip_is_a_400_whoever_decodes(foreign, caplog, decoder, framing):
    """aiohttp decodes gzip itself by default: bad bytes were a 500 and two logged tracebacks
    (the error envelope's, and aiohttp's own as it read on after the answer)."""
    caplog.set_level(logging.INFO)
    url = await foreign([size_limit_middleware()], auto_decompress=decoder == "aiohttp")
    status, answer = await post(url, framed(gzip.compress(hello()), framing), {"Content-Encoding": "gzip"})
    assert (status, answer["body"]["messages"]) == (200, HI)
    status, answer = await post(url, framed(b"not gzip" * 1000, framing), {"Content-Encoding": "gzip"})
    assert (status, answer["error"]["message"]) == (400, "The request body is not valid gzip.")
    await asyncio.sleep(0.1)  # aiohttp's own reading after the answer, if any, is done
    assert no_errors_logged(caplog) == []


def bomb(decoded_size: int) -> bytes:
    """A JSON request body that is `decoded_size` bytes once decoded, gzip'd to a few KB."""
    head, tail = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "', b'"}]}'
    compress = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    filler = decoded_size - len(head) - len(tail)
    parts = [compress.compress(head)]
    block = b"a" * (1024 * 1024)
    while filler > 0:
        parts.append(compress.compress(block[:filler]))
        filler -= len(block)
    return b"".join([*parts, compress.compress(tail), compress.flush()])


@FRAMINGS
@pytest.mark.parametrize("decoder", ["aiohttp", "the stage"])
async def test_the_limit_counts_the_decoded_body(foreign, decoder, framing):
    url = await foreign([size_limit_middleware(max_bytes=1024)], auto_decompress=decoder == "aiohttp")
    small = bomb(1024)
    assert len(small) < 1024
    status, _ = await post(url, framed(small, framing), {"Content-Encoding": "gzip"})
    assert status == 200
    status, answer = await post(url, framed(bomb(1025), framing), {"Content-Encoding": "gzip"})
    assert (status, answer["error"]["code"], answer["error"]["message"]) == (
        413,
        "request_too_large",
        "The request body is over 1,024 bytes.",
    )
    status, answer = await post(url, framed(bomb(100 * 1024 * 1024), framing), {"Content-Encoding": "gzip"})
    assert (status, answer["error"]["code"]) == (413, "request_too_large")


async def test_a_33_mb_body_gzipped_small_is_a_413(gateway, upstream):
    data = bomb(33 * 1024 * 1024)
    assert len(data) < 100 * 1024
    status, answer = await post(gateway.url + ENDPOINT, data, {"Content-Encoding": "gzip"})
    assert (status, answer["error"]) == (
        413,
        {
            "message": "The request body is over 32 MB.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        },
    )
    assert upstream.requests == []


UNSUPPORTED = ["br", "zstd", "compress", "x-gzip", "snappy", "gzip, br", "gzip, gzip", "identity, gzip"]


@pytest.mark.parametrize("encoding", UNSUPPORTED)
async def test_another_content_encoding_is_a_415_and_nothing_is_logged(gateway, caplog, encoding):
    caplog.set_level(logging.INFO)
    status, answer = await post(gateway.url + ENDPOINT, b"\x1b\x00 whatever the bytes", {"Content-Encoding": encoding})
    assert (status, answer["error"]) == (
        415,
        {
            "message": f"Content-Encoding: {encoding} is not supported; send the body as gzip, deflate or uncompressed",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_media_type",
        },
    )
    assert no_errors_logged(caplog) == []


async def test_the_served_gateway_decodes_gzip_and_refuses_br_without_a_traceback(tmp_path, upstream):
    """`ezat-gateway serve` itself: its aiohttp server leaves bodies to the stage, which alone
    can answer br with a 415 in the envelope (aiohttp would answer a plain-text 400, and log it)."""
    served = ServeProcess(
        tmp_path, "gateway", SERVE_CONFIG, storage_url=f"sqlite:///{tmp_path / 'db'}", upstream_url=upstream.url
    )
    try:
        await served.start()
        url = served.url + ENDPOINT
        status, answer = await post(url, gzip.compress(hello()), {"Content-Encoding": "gzip"})
        assert (status, answer["choices"][0]["message"]["content"]) == (200, REPLY)
        status, answer = await post(url, b"\x1b\x00\x00", {"Content-Encoding": "br"})
        assert (status, answer["error"]["code"]) == (415, "unsupported_media_type")
        status, answer = await post(url, b"not gzip", {"Content-Encoding": "gzip"})
        assert (status, answer["error"]["message"]) == (400, "The request body is not valid gzip.")
    finally:
        await served.stop()
    log = served.output()
    assert "Traceback" not in log and " ERROR " not in log, log


# --- A body that never finishes arriving ---------------------------------------------------------------


async def slow_request(url: str, head: bytes, dribble: bytes = b"", every: float = 0.0) -> tuple[bytes, float, bytes]:
    """Sends `head` (request line, headers and the body's start), then `dribble` a byte at a time,
    one every `every` seconds. The answer's head, the seconds it took, and what follows its body
    until the connection closes (b"" if the server closed it, by a FIN or by a reset)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()

    async def trickle():
        for byte in dribble:
            await asyncio.sleep(every)
            writer.write(bytes([byte]))

    sending = asyncio.create_task(trickle())
    try:
        writer.write(head)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        took = time.monotonic() - started
        length = int(
            next(line.split(b":")[1] for line in answer.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        answer += await reader.readexactly(length)
        try:
            after = await asyncio.wait_for(reader.read(), 2)  # times out if the connection stays open
        except ConnectionResetError:  # closed while bytes were still arriving: TCP answers them with a reset
            after = b""
    finally:
        sending.cancel()
        writer.close()
    return answer, took, after


HEADERS = (
    f"POST {ENDPOINT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
).encode()
STARTS = {
    "Content-Length": HEADERS + b'Content-Length: 1000\r\n\r\n{"model": ',
    "chunked": HEADERS + b'Transfer-Encoding: chunked\r\n\r\na\r\n{"model": \r\n',
}


@pytest.mark.parametrize("framing", sorted(STARTS))
@pytest.mark.parametrize("sender", ["stops", "dribbles"])
async def test_a_body_that_never_completes_gets_408_within_the_deadline_and_its_connection_closed(
    start_gateway, upstream, framing, sender
):
    """Stops: 10 bytes, then nothing. Dribbles: a byte every 0.1 s, each read well within the
    deadline: it covers the whole body, not each read."""
    config = make_config(upstream.url)
    gateway = await start_gateway(replace(config, server=ServerConfig(body_timeout_seconds=0.5)))
    dribble = (b'"' + b"x" * 30) if framing == "Content-Length" else b""
    if framing == "chunked" and sender == "dribbles":
        dribble = b"".join(b"1\r\nx\r\n" for _ in range(10))
    answer, took, after = await slow_request(
        gateway.url, STARTS[framing], dribble if sender == "dribbles" else b"", 0.1 / 6
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"Connection: close" in head
    assert json.loads(body) == {
        "error": {
            "message": "The request body did not arrive within 0.5 seconds.",
            "type": "invalid_request_error",
            "param": None,
            "code": "timeout",
        }
    }
    assert 0.45 <= took < 2, took
    assert after == b""  # closed: the rest of the body is never read
    assert upstream.requests == []


async def test_a_body_that_arrives_in_time_in_pieces_is_answered(start_gateway, upstream):
    gateway = await start_gateway(replace(make_config(upstream.url), server=ServerConfig(body_timeout_seconds=2)))

    async def slowly():  # about 1 s in all, half the deadline
        data = hello()
        for start in range(0, len(data), 5):
            await asyncio.sleep(1 / (len(data) / 5))
            yield data[start : start + 5]

    status, answer = await post(gateway.url + ENDPOINT, slowly())
    assert (status, answer["choices"][0]["message"]["content"]) == (200, REPLY)


# --- The config ------------------------------------------------------------------------------------------


async def test_check_config_lists_bad_bounds_and_body_timeout(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        "[server]\nbody_timeout_seconds = 0\n\n[bounds]\nmax_tools = 0\nmax_schema_depth = 1.5\nmax_stops = 4\n"
    )
    status, output = await run_command("check-config", str(path), cwd=tmp_path)
    assert (status, output.splitlines()) == (
        1,
        [
            "server.body_timeout_seconds: expected a positive number",
            "bounds.max_stops: unknown key",
            "bounds.max_tools: expected a positive integer",
            "bounds.max_schema_depth: expected an integer",
        ],
    )
