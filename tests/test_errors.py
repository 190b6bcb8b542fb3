"""Errors in OpenAI's envelope with the spec's statuses, types and codes; never a 500 with a
traceback for anything a client can send."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.config import KeyConfig
from gateway.mock.upstream import Scenario
from tests.requests_util import echo
from tests.support import KEY, MODEL, UPSTREAM_KEY, make_config, served

MESSAGES = [{"role": "user", "content": "x"}]


async def post(gateway, body: bytes | dict, headers: dict | None = None, path="/openai/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {KEY}", **(headers or {})}
    async with aiohttp.ClientSession() as http:
        kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
        async with http.post(gateway.url + path, headers=headers, **kwargs) as response:
            return response, await response.json()


def envelope(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# upstream status → (client status, OpenAI type, code)
UPSTREAM_STATUSES = [
    (400, 400, "invalid_request_error", None),
    (402, 402, "insufficient_quota", "insufficient_quota"),
    (403, 403, "permission_error", None),
    (404, 404, "invalid_request_error", "model_not_found"),
    (409, 409, "invalid_request_error", None),
    (413, 413, "invalid_request_error", "request_too_large"),
    (429, 429, "rate_limit_error", "rate_limit_exceeded"),
    (500, 500, "server_error", None),
    (502, 502, "server_error", None),
    (504, 504, "server_error", "timeout"),
    (529, 503, "server_error", "overloaded"),
]


@pytest.mark.parametrize(("upstream_status", "status", "type_", "code"), UPSTREAM_STATUSES)
async def test_each_upstream_status(gateway, upstream, upstream_status, status, type_, code):
    upstream.enqueue(Scenario(status=upstream_status, error_message=f"upstream says {upstream_status}"))
    response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert response.status == status
    error = envelope(body)
    assert (error["type"], error["code"]) == (type_, code)
    assert error["message"] == f"upstream says {upstream_status}"
    assert response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{24}", response.headers["x-request-id"])
    assert response.headers["request-id"] == response.headers["x-request-id"]


@pytest.mark.parametrize("upstream_status", [429, 529])
async def test_retry_after_is_kept(client, upstream, upstream_status):
    upstream.enqueue(Scenario(status=upstream_status, headers={"retry-after": "12"}))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.response.headers["retry-after"] == "12"
    assert caught.value.status_code == {429: 429, 529: 503}[upstream_status]


@pytest.mark.parametrize("value", ["inf", "nan", "-3", "soon", "1e400"])
async def test_an_unusable_retry_after_is_not_passed_on_nor_believed(client, upstream, value):
    upstream.enqueue(Scenario(status=529, headers={"retry-after": value}), Scenario())
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"  # the gateway's own default
    # The deployment is not cooled for good: the next request reaches it.
    completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert completion.choices[0].message.content == echo("x")


async def test_a_retry_after_is_believed_for_ten_minutes_at_most(client, upstream):
    upstream.enqueue(Scenario(status=429, headers={"retry-after": "999999"}))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert (caught.value.status_code, caught.value.response.headers["retry-after"]) == (429, "600")
    # Its one deployment is cooling: the next request is told when it may be tried again.
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.status_code == 503
    assert 590 <= int(caught.value.response.headers["retry-after"]) <= 600
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("form", ["IMF-fixdate", "asctime"])
async def test_a_retry_after_date_is_passed_on_in_seconds(client, upstream, form):
    moment = datetime.now(UTC) + timedelta(seconds=30)
    when = format_datetime(moment, usegmt=True) if form == "IMF-fixdate" else moment.strftime("%a %b %d %H:%M:%S %Y")
    upstream.enqueue(Scenario(status=429, headers={"retry-after": when}))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert 28 <= int(caught.value.response.headers["retry-after"]) <= 30


async def test_upstream_rejecting_the_gateways_credentials_is_not_the_clients_key_problem(gateway, upstream):
    upstream.enqueue(Scenario(status=401, error_message="invalid x-api-key"))
    response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert response.status == 500
    assert envelope(body)["type"] == "server_error"
    assert envelope(body)["code"] is None
    # The upstream's credentials are not the client's business: it is told whose they are.
    assert envelope(body)["message"] == "The upstream rejected the gateway's credentials."


async def test_prompt_too_long_gets_openais_code(gateway, upstream):
    upstream.enqueue(Scenario(status=400, error_message="prompt is too long: 210000 tokens > 200000 maximum"))
    response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert response.status == 400
    assert envelope(body)["code"] == "context_length_exceeded"
    assert envelope(body)["type"] == "invalid_request_error"
    assert envelope(body)["message"] == "prompt is too long: 210000 tokens > 200000 maximum"


async def test_sdk_error_classes(client, upstream):
    upstream.enqueue(Scenario(status=529, error_message="Overloaded"))
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.status_code == 503
    assert caught.value.code == "overloaded"
    assert caught.value.type == "server_error"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_unknown_model(client, upstream, stream):
    # A streamed request too gets a plain HTTP error: nothing was streamed yet.
    with pytest.raises(openai.NotFoundError) as caught:
        reply = await client.chat.completions.create(model="gpt-9", stream=stream, messages=MESSAGES)
        if stream:
            async for _ in reply:
                pass
    assert caught.value.status_code == 404
    assert caught.value.body == {
        "message": "The model `gpt-9` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert upstream.requests == []


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"}, {"x-api-key": "sk-wrong"}],
)
async def test_missing_or_unknown_key(gateway, upstream, headers):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions", headers=headers, json={"model": MODEL, "messages": MESSAGES}
        ) as response:
            body = await response.json()
    assert response.status == 401
    error = envelope(body)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert upstream.requests == []


async def test_sdk_with_a_wrong_key(gateway):
    async with gateway.client(api_key="sk-nope") as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            await wrong.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.code == "invalid_api_key"
    assert (caught.value.status_code, caught.value.type) == (401, "invalid_request_error")


async def test_x_api_key_header_is_accepted(gateway, upstream):
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"x-api-key": KEY},
            json={"model": MODEL, "messages": MESSAGES},
        ) as response:
            assert response.status == 200
            body = await response.json()
    assert body["choices"][0]["message"]["content"] == echo("x")
    # The upstream got the gateway's own credentials, never the client's key.
    assert upstream.requests[-1].headers["x-api-key"] == UPSTREAM_KEY


async def raw_post(gateway, headers: bytes) -> tuple[bytes, dict]:
    """A request written byte for byte, for header values no HTTP library would send."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps({"model": MODEL, "messages": MESSAGES})
    writer.write(
        b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )
    reply = await reader.read()
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], orjson.loads(payload)


@pytest.mark.parametrize("header", [b"Authorization: Bearer sk-\xff\xfe", b"x-api-key: sk-\xff"])
async def test_a_key_that_is_not_utf8_is_401(gateway, upstream, header):
    status, body = await raw_post(gateway, header + b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized"
    assert envelope(body) == {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert upstream.requests == []


async def test_a_session_header_that_is_not_utf8_still_routes(start_gateway, upstream):
    """The session picks one of several deployments by hashing its bytes, whatever they are."""
    config = make_config(upstream.url)
    config = replace(
        config,
        deployments=(*config.deployments, replace(config.deployments[0], name="secondary")),
        models=(replace(config.models[0], deployments=("primary", "secondary")), *config.models[1:]),
    )
    gateway = await start_gateway(config)
    status, body = await raw_post(
        gateway, f"Authorization: Bearer {KEY}\r\n".encode() + b"x-ezat-session: conv-\xff\r\n"
    )
    assert status == b"HTTP/1.1 200 OK"
    assert body["choices"][0]["message"]["content"] == echo("x")


async def test_body_over_32_mb_is_refused_before_it_is_read(gateway, upstream):
    oversized = b" " * (32 * 1024 * 1024 + 1)
    response, body = await post(gateway, oversized)
    assert response.status == 413
    assert envelope(body)["code"] == "request_too_large"
    assert envelope(body)["type"] == "invalid_request_error"
    assert upstream.requests == []


async def test_chunked_body_over_32_mb_is_refused(gateway, upstream):
    async def chunks():
        for _ in range(33):
            yield b" " * (1024 * 1024)

    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            data=chunks(),
        ) as response:
            assert response.status == 413
            assert envelope(await response.json())["code"] == "request_too_large"
    assert upstream.requests == []


async def test_a_body_just_under_the_limit_is_read(gateway, upstream):
    text = "a" * (31 * 1024 * 1024)
    response, body = await post(gateway, {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert response.status == 200
    assert body["choices"][0]["message"]["content"] == echo("a" * 200)  # the mock echoes 200 characters
    assert upstream.requests[-1].body["messages"][0]["content"][0]["text"] == text


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"model": ', "The request body is not valid JSON"),
        (b"", "The request body is not valid JSON"),
        (b"[1, 2]", "The request body must be a JSON object."),
        (b'"text"', "The request body must be a JSON object."),
    ],
)
async def test_invalid_json(gateway, upstream, raw, message):
    response, body = await post(gateway, raw, {"content-type": "application/json"})
    assert response.status == 400
    error = envelope(body)
    assert error["message"].startswith(message)
    assert (error["type"], error["code"]) == ("invalid_request_error", None)
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": MESSAGES}, "model: required"),
        ({"model": 5, "messages": MESSAGES}, "model: required"),
        ({"model": MODEL}, "messages: expected a list of messages"),
        ({"model": MODEL, "messages": "hi"}, "messages: expected a list of messages"),
        ({"model": MODEL, "messages": []}, "messages: must contain at least one user message"),
        (
            {"model": MODEL, "messages": [{"role": "system", "content": "x"}]},
            "messages: must contain at least one user message",
        ),
        ({"model": MODEL, "messages": [5]}, "messages[0]: expected an object"),
        (
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role: expected one of system, developer, user, assistant, tool",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content: expected a string or a list of content parts",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages[0].content[0].type: required",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text: expected a string",
        ),
        ({"model": MODEL, "messages": MESSAGES, "stream": "yes"}, "stream: expected a boolean"),
        ({"model": MODEL, "messages": MESSAGES, "stop": 5}, "stop: expected a string or a list of strings"),
    ],
)
async def test_malformed_requests_name_the_path(gateway, upstream, body, message):
    response, reply = await post(gateway, body)
    assert response.status == 400
    assert envelope(reply)["message"] == message
    assert upstream.requests == []


async def test_non_streaming_request_past_the_deadline_is_a_504(start_gateway, upstream):
    gateway = await start_gateway(non_streaming_deadline=0.3)
    upstream.enqueue(Scenario(delay=2.0))
    response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert response.status == 504
    error = envelope(body)
    assert (error["type"], error["code"]) == ("server_error", "timeout")
    assert "stream it instead" in error["message"]
    await upstream.wait_disconnect(timeout=2)  # the abandoned upstream request was closed


async def test_an_upstream_redirect_is_not_followed(start_gateway, upstream):
    """Followed, a redirect would take the deployment's key and the prompt to whatever host it
    names (aiohttp keeps a custom x-api-key header across hosts): it is an error instead."""

    async def redirect(request):
        return web.Response(status=307, headers={"Location": upstream.url + "/v1/messages"})

    app = web.Application()
    app.router.add_post("/v1/messages", redirect)
    runner, url = await served(app)
    try:
        gateway = await start_gateway(make_config(url))
        response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    finally:
        await runner.cleanup()
    assert response.status == 500
    assert envelope(body) == {
        "message": "The upstream answered with HTTP 307.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert upstream.requests == []


async def test_unreachable_upstream(start_gateway, unused_tcp_port):
    gateway = await start_gateway(make_config(f"http://127.0.0.1:{unused_tcp_port}"))
    response, body = await post(gateway, {"model": MODEL, "messages": MESSAGES})
    assert response.status == 500
    assert envelope(body)["type"] == "server_error"
    assert envelope(body) == {
        "message": "Could not reach the upstream.",
        "type": "server_error",
        "param": None,
        "code": None,
    }


async def test_unknown_path_and_method_use_the_envelope(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/openai/v1/nothing-here") as response:
            assert response.status == 404
            assert envelope(await response.json())["type"] == "invalid_request_error"
        async with http.get(gateway.url + "/openai/v1/chat/completions") as response:
            assert response.status == 405
            assert envelope(await response.json())["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"revoked": True}, "This API key has been revoked."),
        ({"expires_at": datetime(2020, 1, 1, tzinfo=UTC)}, "This API key has expired."),
    ],
)
async def test_revoked_or_expired_key(start_gateway, upstream, fields, message):
    config = make_config(upstream.url)
    old = KeyConfig(name="old", key_sha256=hashlib.sha256(b"sk-old").hexdigest(), **fields)
    gateway = await start_gateway(replace(config, keys=(*config.keys, old)))
    async with gateway.client(api_key="sk-old") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.body["message"] == message
    assert caught.value.code == "invalid_api_key"
    assert caught.value.status_code == 401
    assert upstream.requests == []


async def test_an_oversized_body_is_refused_without_waiting_for_it(gateway, upstream):
    """The 413 comes from the Content-Length alone: the client has sent 1 KB of the 33 MB it announced."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {33 * 1024 * 1024}\r\n\r\n".encode()
        + b" " * 1024
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 5)  # never came if the gateway waited for the body
    writer.close()
    assert status_line.startswith(b"HTTP/1.1 413 ")
    assert upstream.requests == []
