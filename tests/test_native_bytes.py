"""The native route sends the upstream the client's own bytes when nothing changed its body and
they are exactly what the gateway would write for it (compact, as most clients write JSON: then
the upstream can read in them nothing the gateway did not), and a new encoding otherwise: a body
written another way (spaces, escapes), the model's upstream id, a fallback's clamped terms, the
gateway's `models` taken out, the automatic cache breakpoints, an image URL inlined. What the
mock upstream received is read byte for byte.

The tests' gateways are built with `check_client_bytes` (tests/conftest.py): wherever one sends
the client's bytes, they are proved to still make the body; the last tests show what a stage
that breaks the contract meets."""

from __future__ import annotations

import base64
import dataclasses
import re

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import ImagesConfig
from gateway.mock.upstream import RecordedRequest, Scenario
from middlewares.core.context import BODY, body_changed, client_bytes
from middlewares.size_limit import size_limit_middleware
from tests.support import KEY, MODEL, UPSTREAM_MODEL, make_config, served
from tests.test_images import MB, PNG, padded_png, server  # noqa: F401 (a fixture)
from tests.test_messages import two_deployments

HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def odd(model: str = UPSTREAM_MODEL, *, stream: bool = False, extra: bytes = b"") -> bytes:
    """A valid request no encoder would write: spaces and tabs, escapes (`\\u00e9`, a surrogate
    pair, `\\/`), its keys in an unusual order; asking by `model`."""
    return (
        b'{ "messages" : [ {"content" :[{ "text":"Caf\\u00e9 \\u00e9t\\u00e9 \\ud83d\\ude00 a\\/b",'
        b'\t"type":"text"}], "role":"user"} ],\n'
        b'  "metadata": {"user_id" : "user-\\u0037"},' + extra + b"\n"
        b'\t"stream" : ' + (b"true" if stream else b"false") + b',  "max_tokens":  64 ,\r\n'
        b'  "model" :"' + model.encode() + b'"   }'
    )


def long_turns(*, marked: bool) -> bytes:
    """A Claude Code-like request, long enough to be cached: a system prompt, a tool and a few
    turns, with its own cache breakpoint on the system prompt (`marked`) or none."""
    mark = b', "cache_control": {"type" :"ephemeral"}' if marked else b""
    return (
        b'{"model":"' + UPSTREAM_MODEL.encode() + b'","max_tokens":1024,\n'
        b'"system":[{"type":"text","text":"' + b"You are a coding agent. " * 200 + b'"' + mark + b"}],\n"
        b'"tools":[{"name":"Read","description":"Reads a file.","input_schema":{"type":"object",'
        b'"properties":{"path":{"type":"string"}},"required":["path"]}}],\n'
        b'"messages":[{"role":"user","content":"Read the parser, please."},'
        b'{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"Read","input":{"path":"/p.py"}}]},'
        b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"'
        + b"def parse(x): return x\\n" * 100
        + b'"}]}],  "stream":true}'
    )


def written(raw: bytes) -> bytes:
    """The request in `raw` as the gateway writes it (and JSON.stringify, serde_json and httpx
    would): its keys in their order, no spaces, non-ASCII as UTF-8."""
    return orjson.dumps(orjson.loads(raw))


async def send(gateway, raw: bytes, path: str = "/v1/messages", **headers) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + path, data=raw, headers={**HEADERS, **headers}) as response:
            return response.status, await response.read()


def same_model_config(upstream_url: str, **model_fields):
    """The test config, its model asked by a name that is its upstream id (an alias)."""
    config = make_config(upstream_url)
    model = dataclasses.replace(config.models[0], aliases=(UPSTREAM_MODEL,), **model_fields)
    return dataclasses.replace(config, models=(model, *config.models[1:]))


# --- Nothing changed it: the client's bytes ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_an_unchanged_request_arrives_byte_for_byte(start_gateway, upstream, stream):
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = written(odd(stream=stream))
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.raw == raw
    assert (b"message_stop" if stream else b"Hello from the mock upstream") in answer


async def test_a_claude_code_turn_with_its_own_breakpoints_arrives_byte_for_byte(start_gateway, upstream):
    """Caching is on and the body is long enough, but the client placed its own breakpoint."""
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = written(long_turns(marked=True))
    status, answer = await send(gateway, raw, **{"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.raw == raw


async def test_every_deployment_tried_gets_the_same_bytes(start_gateway, upstream):
    """Failover between deployments of one model: each attempt is the client's request."""
    config = two_deployments(upstream.url, upstream.url)  # both on the one mock, which fails once
    model = dataclasses.replace(config.models[0], aliases=(UPSTREAM_MODEL,))
    gateway = await start_gateway(dataclasses.replace(config, models=(model, *config.models[1:])))
    upstream.enqueue(Scenario(status=529, error_message="Overloaded"))
    raw = written(odd())
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    assert [attempt.raw for attempt in upstream.requests] == [raw, raw]


async def test_an_unchanged_count_arrives_byte_for_byte(start_gateway, upstream):
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = b'{"messages":[{"role":"user","content":"Caf\xc3\xa9"}],"model":"' + UPSTREAM_MODEL.encode() + b'"}'
    status, answer = await send(gateway, raw, "/v1/messages/count_tokens")
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.path == "/v1/messages/count_tokens" and sent.raw == raw


# --- Something changed it, or it was written another way: a new encoding --------------------------


COUNT_WRITTEN_OTHERWISE = (
    b'{ "messages":[{"role":"user","content":"Caf\\u00e9"}] ,\n "model":"' + UPSTREAM_MODEL.encode() + b'"}'
)


@pytest.mark.parametrize(
    ("path", "raw"), [("/v1/messages", odd()), ("/v1/messages/count_tokens", COUNT_WRITTEN_OTHERWISE)]
)
async def test_a_request_written_otherwise_arrives_as_the_gateway_writes_it(start_gateway, upstream, path, raw):
    """Spaces, escapes and `\\/` are not how the gateway writes: it cannot tell cheaply that
    such bytes repeat no key (tests/test_duplicate_keys.py), so they never go upstream."""
    gateway = await start_gateway(same_model_config(upstream.url))
    status, answer = await send(gateway, raw, path)
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.raw == written(raw) != raw


async def test_a_request_the_gateway_cannot_write_is_refused_not_sent(start_gateway, upstream):
    """JSON nested over 255 levels, which orjson reads but cannot write: a 400, as on every
    route, rather than bytes whose repeats nobody checked."""
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = written(odd()).replace(b'"user_id":"user-7"', b'"deep":' + b"[" * 300 + b"]" * 300)
    status, answer = await send(gateway, raw)
    assert status == 400, answer
    assert orjson.loads(answer)["error"]["message"] == "The request nests JSON more than 255 levels deep."
    assert upstream.requests == []


async def test_a_model_asked_by_another_name_gets_its_upstream_id(start_gateway, upstream):
    gateway = await start_gateway()  # MODEL's upstream id is UPSTREAM_MODEL
    raw = odd(MODEL)
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.raw != raw
    assert sent.body == {**orjson.loads(raw), "model": UPSTREAM_MODEL}
    assert sent.raw == orjson.dumps(sent.body)  # the gateway's own encoding


async def test_the_gateways_models_field_is_taken_out(start_gateway, upstream):
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = odd(extra=b' "models" : ["test/small"],')
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    [sent] = upstream.requests
    expected = orjson.loads(raw)
    del expected["models"]
    assert sent.body == expected and b'"models"' not in sent.raw


async def test_automatic_cache_breakpoints_reach_the_upstream(start_gateway, upstream):
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = written(long_turns(marked=False))
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    [sent] = upstream.requests
    asked = orjson.loads(raw)
    assert sent.raw != raw
    assert sent.body["system"] == [{**asked["system"][0], "cache_control": {"type": "ephemeral"}}]
    assert sent.body["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert sent.body["messages"][:-1] == asked["messages"][:-1]
    # Turned off, nothing is added: the client's bytes again.
    upstream.requests.clear()
    status, answer = await send(gateway, raw, **{"x-ezat-cache": "off"})
    assert status == 200, answer
    assert upstream.requests[0].raw == raw


async def test_an_image_url_goes_upstream_inlined(start_gateway, upstream, server):
    config = dataclasses.replace(same_model_config(upstream.url), images=ImagesConfig(allow_private_hosts=True))
    gateway = await start_gateway(config)
    url = server.serve("/cat.png", PNG)
    image = b'{ "type":"image", "source":{"type":"url","url":"' + url.encode() + b'"}},'
    raw = odd().replace(b'"content" :[', b'"content" :[' + image)
    status, answer = await send(gateway, raw, **{"x-ezat-cache": "off"})  # an image would be marked
    assert status == 200, answer
    [sent] = upstream.requests
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    assert sent.body["messages"][0]["content"][0] == {"type": "image", "source": source}
    assert sent.body["messages"][0]["content"][1] == orjson.loads(odd())["messages"][0]["content"][0]
    assert url.encode() not in sent.raw


async def test_inlined_images_over_32_mb_are_still_a_413(start_gateway, upstream, server):
    """27 MB of downloads make a 36 MB request as base64: refused before the upstream, on this
    route too, where the request would otherwise go as the client sent it."""
    config = dataclasses.replace(same_model_config(upstream.url), images=ImagesConfig(allow_private_hosts=True))
    gateway = await start_gateway(config)
    urls = [server.serve(f"/{i}.png", padded_png(9 * MB)) for i in range(3)]
    images = b"".join(b'{"type":"image","source":{"type":"url","url":"' + u.encode() + b'"}},' for u in urls)
    status, answer = await send(gateway, odd().replace(b'"content" :[', b'"content" :[' + images))
    assert status == 413, answer
    error = orjson.loads(answer)["error"]
    assert re.fullmatch(
        r"The request is over 32 MB once its image URLs are downloaded and inlined \(3\d,\d{3},\d{3} bytes\); "
        r"send fewer or smaller images\.",
        error["message"],
    )
    assert upstream.requests == []


async def fallback_attempts(start_gateway, upstream, raw: bytes) -> tuple[dict, RecordedRequest, RecordedRequest]:
    """`raw` sent to a gateway whose asked model's one deployment fails (529) and whose fallback
    is test/small (upstream id small-1, 4,096 tokens at most, no sampling): (the request asked,
    without `models`; the first attempt; the fallback's), each attempt's bytes its body encoded."""
    gateway = await start_gateway(same_model_config(upstream.url))
    upstream.enqueue(Scenario(status=529, error_message="Overloaded"))
    status, answer = await send(gateway, raw)
    assert status == 200, answer
    first, fallback = upstream.requests
    assert first.raw == orjson.dumps(first.body) and fallback.raw == orjson.dumps(fallback.body)
    asked = orjson.loads(raw)
    del asked["models"]
    return asked, first, fallback


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_a_fallback_with_another_upstream_id_gets_its_own_terms(start_gateway, upstream, stream):
    """Each attempt names its own model; the fallback's max_tokens is clamped."""
    raw = odd(stream=stream, extra=b' "models":["test/small"],').replace(b'"max_tokens":  64', b'"max_tokens":  9000')
    asked, first, fallback = await fallback_attempts(start_gateway, upstream, raw)
    assert first.body == asked
    assert fallback.body == {**asked, "model": "small-1", "max_tokens": 4096}


async def test_a_fallback_without_sampling_gets_none(start_gateway, upstream):
    """A fallback that takes no sampling is sent the request without its temperature; the asked
    model's attempt keeps it."""
    raw = odd(extra=b' "models":["test/small"], "temperature": 0.5,')
    asked, first, fallback = await fallback_attempts(start_gateway, upstream, raw)
    assert first.body == asked
    without_sampling = {k: v for k, v in asked.items() if k != "temperature"}
    assert fallback.body == {**without_sampling, "model": "small-1"}


# --- The contract, broken: loud where it is checked, and safe where a body is replaced ------------


async def stage_app(upstream_stage, keep: bool = True) -> tuple[web.AppRunner, str]:
    """size_limit (keeping the client's bytes, or not), then `upstream_stage`, then a handler
    that answers with `client_bytes`, checked."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=client_bytes(request, check=True) or b"none")

    app = web.Application(middlewares=[size_limit_middleware(keep_client_bytes=keep), web.middleware(upstream_stage)])
    app.router.add_post("/", handler)
    return await served(app)


@pytest.mark.parametrize(
    "change",
    ["nothing", "not kept", "in place, said", "in place, unsaid", "replaced", "replaced by an equal dict"],
)
async def test_what_a_stage_does_to_the_body_decides_the_bytes(change):
    raw = written(b'{"a" : [1, {"b": "\\u00e9"}]}')

    async def changing(request: web.Request, handler):
        body = request[BODY]
        if change == "in place, said":
            body_changed(request)
            body["a"][1]["b"] = "x"
        elif change == "in place, unsaid":
            body["a"][1]["b"] = "x"  # the contract broken
        elif change == "replaced":
            request[BODY] = {"a": []}
        elif change == "replaced by an equal dict":
            request[BODY] = orjson.loads(raw)
        return await handler(request)

    runner, url = await stage_app(changing, keep=change != "not kept")
    try:
        async with aiohttp.ClientSession() as http, http.post(url, data=raw) as response:
            status, answer = response.status, await response.read()
    finally:
        await runner.cleanup()
    expected = {
        "nothing": (200, raw),
        "not kept": (200, b"none"),  # size_limit's default: a route that never sends them on
        "in place, said": (200, b"none"),
        "in place, unsaid": (500, None),  # StaleClientBytes: loud, not stale bytes upstream
        "replaced": (200, b"none"),
        "replaced by an equal dict": (200, b"none"),  # tied to the dict they were parsed into
    }[change]
    assert status == expected[0]
    if expected[1] is not None:
        assert answer == expected[1]
