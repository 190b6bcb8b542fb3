"""A key written twice in one JSON object: the gateway reads the last copy, an upstream may read
the first. The upstream never reads a value the gateway did not check: a key repeated at a body's
top level is a 400 naming it on every route, in its API's envelope, before anything is checked,
reserved or sent; a body repeating a key deeper goes upstream as the gateway's own writing of
what it read, never as the client's bytes. Through the real gateway and mock upstream, raw HTTP
(no SDK writes a key twice)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.support import KEY, MODEL, UPSTREAM_MODEL
from tests.test_native_bytes import same_model_config

MESSAGES = b'"messages":[{"role":"user","content":"Hi"}]'
# Checked as the last copies (the key's model, 5 tokens), served as the first by a parser that
# keeps it: test/small, 4,000 tokens.
REPEATED = (
    b'{"model":"test/small","max_tokens":4000,"model":"' + MODEL.encode() + b'","max_tokens":5,' + MESSAGES + b"}"
)
OPENAI_HEADERS = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
ANTHROPIC_HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}
ROUTES = {
    "chat completions": (
        "/openai/v1/chat/completions",
        OPENAI_HEADERS,
        REPEATED.replace(b"max_tokens", b"max_completion_tokens"),
    ),
    "responses": (
        "/openai/v1/responses",
        OPENAI_HEADERS,
        REPEATED.replace(b"max_tokens", b"max_output_tokens").replace(MESSAGES, b'"input":"Hi"'),
    ),
    "messages": ("/v1/messages", ANTHROPIC_HEADERS, REPEATED),
    "count_tokens": ("/v1/messages/count_tokens", ANTHROPIC_HEADERS, REPEATED.replace(b',"max_tokens":5', b"")),
}


async def post(gateway, path: str, headers: dict, raw: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + path, data=raw, headers=headers) as response:
            return response.status, await response.json()


@pytest.mark.parametrize("spacing", ["compact", "spaced"])
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_a_key_repeated_at_the_top_level_is_a_400_naming_it(gateway, upstream, route, spacing):
    path, headers, raw = ROUTES[route]
    if spacing == "spaced":  # as no encoder writes it: the slower reading finds it too
        raw = raw.replace(b",", b", ").replace(b'":', b'" : ')
    status, answer = await post(gateway, path, headers, raw)
    assert status == 400, answer
    message = "model: appears more than once in the request body; send it once"
    if headers is ANTHROPIC_HEADERS:
        assert answer["type"] == "error"
        assert answer["error"] == {"type": "invalid_request_error", "message": message}
    else:
        assert answer["error"] == {"message": message, "type": "invalid_request_error", "param": "model", "code": None}
    assert upstream.requests == []


async def test_the_first_repeated_key_is_the_one_named(gateway, upstream):
    raw = (
        b'{"model":"'
        + MODEL.encode()
        + b'","stream":false,"max_tokens":5,"stream":true,"max_tokens":6,'
        + MESSAGES
        + b"}"
    )
    status, answer = await post(gateway, "/v1/messages", ANTHROPIC_HEADERS, raw)
    assert status == 400, answer
    assert answer["error"]["message"] == "stream: appears more than once in the request body; send it once"


@pytest.mark.parametrize("spacing", ["compact", "spaced"])
async def test_a_key_repeated_deeper_goes_upstream_as_the_gateways_writing(start_gateway, upstream, spacing):
    """The model asked by its upstream id, nothing to add: the client's bytes would go as they
    came, and an upstream keeping the first `content` would answer another prompt than the one
    the gateway checked, counted and billed."""
    gateway = await start_gateway(same_model_config(upstream.url))
    raw = (
        b'{"model":"' + UPSTREAM_MODEL.encode() + b'","max_tokens":64,'
        b'"messages":[{"role":"user","content":"' + b"Tell me everything. " * 50 + b'","content":"Hi"}]}'
    )
    if spacing == "spaced":
        raw = raw.replace(b'":', b'": ')
    # Caching off: no automatic breakpoint changes the body.
    status, answer = await post(gateway, "/v1/messages", {**ANTHROPIC_HEADERS, "x-ezat-cache": "off"}, raw)
    assert status == 200, answer
    [sent] = upstream.requests
    assert sent.body["messages"] == [{"role": "user", "content": "Hi"}]
    assert sent.raw == orjson.dumps(orjson.loads(raw)) and sent.raw.count(b'"content"') == 1


async def test_a_long_repeated_key_is_named_in_part(gateway, upstream):
    """The key is the client's text: the 400 echoes its first 64 characters, not all of it."""
    long = "k" * 10_000
    raw = b'{"model":"' + MODEL.encode() + b'","' + long.encode() + b'":1,"' + long.encode() + b'":2,' + MESSAGES + b"}"
    status, answer = await post(gateway, "/openai/v1/chat/completions", OPENAI_HEADERS, raw)
    named = "k" * 64 + "…"
    assert (status, answer["error"]["param"]) == (400, named)
    assert answer["error"]["message"] == f"{named}: appears more than once in the request body; send it once"
    assert upstream.requests == []
