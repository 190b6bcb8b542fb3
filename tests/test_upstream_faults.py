"""An upstream that misbehaves in ways the faithful mock never does: the client still gets a
well-formed OpenAI error, never an HTML page or a traceback."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from gateway.app import STORE, build_app
from tests.support import KEY, MODEL, Gateway, make_config, served


def sse(*events: dict | bytes) -> bytes:
    return b"".join(
        e if isinstance(e, bytes) else b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
        for e in events
    )


START = {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3, "output_tokens": 1}}}
TEXT_START = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}


@pytest.fixture
async def serve_upstream():
    """Serves one canned HTTP answer as the upstream; yields a function that starts a gateway.
    `start.gone` is set when the gateway closes the connection before the answer is written."""
    runners = []
    gone = asyncio.Event()

    async def start(
        status: int, body: bytes | list[bytes], content_type: str = "text/event-stream", piece: int = 0
    ) -> Gateway:
        """`body` whole, or cut into pieces of `piece` bytes, or a list of pieces: each piece a
        write of its own, shortly after the one before, so that each arrives in a read of its own."""

        async def answer(request: web.Request) -> web.StreamResponse:
            await request.read()
            if not piece and isinstance(body, bytes):
                return web.Response(status=status, body=body, content_type=content_type)
            response = web.StreamResponse(status=status, headers={"content-type": content_type})
            await response.prepare(request)
            pieces = body if isinstance(body, list) else [body[i : i + piece] for i in range(0, len(body), piece)]
            try:
                for part in pieces:  # events and lines split across reads
                    await response.write(part)
                    await asyncio.sleep(0.001 if piece else 0.02)
            except ConnectionError:
                gone.set()
            return response

        app = web.Application()
        app.router.add_post("/v1/messages", answer)
        runner, url = await served(app)
        runners.append(runner)
        gateway = await Gateway(build_app(make_config(url))).start()
        runners.append(gateway.runner)
        return gateway

    start.gone = gone
    yield start
    for runner in reversed(runners):
        await runner.cleanup()


async def call(gateway: Gateway, stream: bool, include_usage: bool = False) -> tuple[int, str]:
    body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "x"}]}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body
        ) as response:
            return response.status, await response.text()


@pytest.mark.parametrize("body", [b"<html>oops</html>", b"[1, 2]", b'{"content": "not a list"}'])
async def test_a_non_message_reply_is_a_server_error(serve_upstream, body):
    gateway = await serve_upstream(200, body, "application/json")
    status, text = await call(gateway, stream=False)
    assert status == 500
    assert json.loads(text)["error"]["type"] == "server_error"
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (None, None)
    assert error["message"] and "Traceback" not in error["message"]


async def test_an_html_error_page_keeps_the_status(serve_upstream):
    gateway = await serve_upstream(502, b"<html>Bad Gateway</html>", "text/html")
    status, text = await call(gateway, stream=False)
    assert status == 502
    error = json.loads(text)["error"]
    assert error["type"] == "server_error"
    assert error["message"] == "<html>Bad Gateway</html>"


TEXT = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hello"}}
END = (
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}},
    {"type": "message_stop"},
)
# Events that lack (or mistype) what the gateway reads of them.
MALFORMED = {
    "delta missing": {"type": "content_block_delta", "index": 0},
    "delta not an object": {"type": "content_block_delta", "index": 0, "delta": "hi"},
    "text not a string": {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}},
    "index missing": {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": "{"}},
    "block missing": {"type": "content_block_start", "index": 1},
    "tool without a name": {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "t"},
    },
    "stop without index": {"type": "content_block_stop"},
    "usage not an object": {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": 7},
    "delta null": {"type": "message_delta", "delta": None},
    "error not an object": {"type": "error", "error": "overloaded"},
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED)
@pytest.mark.parametrize("read", ["with its end", "in a read of its own"])
async def test_a_malformed_event_mid_stream_ends_with_an_error_and_done_unbilled(serve_upstream, bad, read):
    """Spec, "Streaming": "If the request fails after the stream has started, you get
    `data: {"error": {…}}` and then `data: [DONE]`, with no usage chunk, and the request isn't
    billed." Also when the event that breaks it arrives in the same read as message_stop."""
    if read == "with its end":
        body = sse(START, TEXT_START, TEXT, bad, *END)
    else:
        body = [sse(START, TEXT_START, TEXT), sse(bad), sse(*END)]
    gateway = await serve_upstream(200, body)
    status, text = await call(gateway, stream=True, include_usage=True)
    assert status == 200
    events = [e for e in text.split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"] == {
        "message": "The upstream sent an event the gateway cannot read.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    # No usage chunk and no finish: the failure is the stream's last word before [DONE].
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "hello"
    assert all("error" not in c and c.get("usage") is None for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert await gateway.app[STORE].ledger() == []


@pytest.mark.parametrize(
    "bad",
    [sse(MALFORMED["delta missing"]), b"data: " + b"x" * (5 * 1024 * 1024)],
    ids=["malformed", "over 4 MB without an end"],
)
async def test_a_stream_the_gateway_cannot_read_is_closed_upstream_at_once(serve_upstream, bad):
    """The upstream is still answering: its connection is closed, not kept for the body's end."""
    gateway = await serve_upstream(200, [sse(START, TEXT_START, TEXT), bad] + [sse(TEXT)] * 200)  # 4 s more
    status, text = await call(gateway, stream=True)
    assert status == 200
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert (
        json.loads(events[-2][len("data: ") :])["error"]["message"]
        == "The upstream sent an event the gateway cannot read."
    )
    await asyncio.wait_for(serve_upstream.gone.wait(), 1)
    assert await gateway.app[STORE].ledger() == []


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": 5}],
        [{"type": "tool_use", "id": "t", "input": {}}],
        [7],
        [{"type": ["text"], "text": "x"}],
    ],
)
async def test_a_malformed_message_is_a_server_error_unbilled(serve_upstream, content):
    """Spec, "Errors": failed requests aren't billed."""
    message = {
        "type": "message",
        "role": "assistant",
        "content": content,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 5},
    }
    gateway = await serve_upstream(200, json.dumps(message).encode(), "application/json")
    status, text = await call(gateway, stream=False)
    assert status == 500
    assert json.loads(text)["error"] == {
        "message": "The upstream sent a reply the gateway cannot read.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert await gateway.app[STORE].ledger() == []


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


NOT_A_MESSAGE = {
    "empty": {},
    "an error": {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    "no content": {"type": "message", "role": "assistant", "stop_reason": "end_turn", "usage": {"output_tokens": 1}},
    # JSON orjson reads (1,024 levels) but cannot write (255): a reply the gateway cannot send on.
    "nested 300 deep": {
        "type": "message",
        "role": "assistant",
        "stop_reason": "end_turn",
        "usage": {"output_tokens": 1},
        "content": [{"type": "text", "text": "x", "citations": nested(300)}],
    },
}


@pytest.mark.parametrize("route", ["openai", "anthropic"])
@pytest.mark.parametrize("reply", NOT_A_MESSAGE.values(), ids=NOT_A_MESSAGE.keys())
async def test_a_200_that_is_no_message_the_gateway_can_send_is_a_server_error_unbilled(serve_upstream, reply, route):
    gateway = await serve_upstream(200, json.dumps(reply).encode(), "application/json")
    if route == "openai":
        status, text = await call(gateway, stream=False)
        error = json.loads(text)["error"]
    else:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                gateway.url + "/v1/messages",
                headers={"x-api-key": KEY},
                json={"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]},
            ) as response:
                status, error = response.status, (await response.json())["error"]
    assert status == 500
    assert error["message"] == "The upstream sent a reply the gateway cannot read."
    assert await gateway.app[STORE].ledger() == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_answer_larger_than_any_message_is_not_read(serve_upstream, chunked):
    """Over 32 MB (a message is far smaller): not held in memory, a server error, unbilled."""
    text = "x" * (33 * 1024 * 1024)
    reply = json.dumps(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "usage": {"output_tokens": 1},
        }
    ).encode()
    gateway = await serve_upstream(200, reply, "application/json", piece=1024 * 1024 if chunked else 0)
    status, body = await call(gateway, stream=False)
    assert status == 500
    assert json.loads(body)["error"]["message"] == "The upstream sent a reply the gateway cannot read."
    assert await gateway.app[STORE].ledger() == []


@pytest.mark.parametrize("route", ["openai", "anthropic"])
async def test_a_stream_event_nested_deeper_than_the_gateway_can_send_ends_it_unbilled(serve_upstream, route):
    """The burst ends with message_stop, but one of its events cannot be written out again: the
    stream ends with an error there, and is not billed (it was, then the write failed)."""
    deep = {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "text", "text": "", "citations": nested(300)},
    }
    gateway = await serve_upstream(
        200,
        sse(
            START,
            TEXT_START,
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
            {"type": "content_block_stop", "index": 0},
            deep,
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
            {"type": "message_stop"},
        ),
    )
    if route == "openai":
        status, text = await call(gateway, stream=True)
    else:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                gateway.url + "/v1/messages",
                headers={"x-api-key": KEY},
                json={"model": MODEL, "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            ) as response:
                status, text = response.status, await response.text()
    assert status == 200
    assert "The upstream sent an event the gateway cannot read." in text
    assert await gateway.app[STORE].ledger() == []


async def test_a_stream_cut_before_any_output_is_a_plain_error(serve_upstream):
    gateway = await serve_upstream(200, sse(START, TEXT_START))  # ends without a token or message_stop
    status, text = await call(gateway, stream=True)
    assert status == 500
    assert json.loads(text)["error"]["message"] == "The upstream stream ended early."
    assert json.loads(text)["error"]["type"] == "server_error"


async def test_garbage_lines_and_unknown_events_are_skipped(serve_upstream):
    body = sse(
        START,
        b": a comment\n\n",
        b"data: not json\n\n",
        {"type": "some_future_event", "x": 1},
        TEXT_START,
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "fine"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "future_delta"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": ["text_delta"]}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    ).replace(b"\n", b"\r\n")  # CRLF framing is valid SSE too
    gateway = await serve_upstream(200, body)
    status, text = await call(gateway, stream=True)
    assert status == 200
    chunks = [json.loads(e[len("data: ") :]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "fine"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
@pytest.mark.parametrize("piece", [1, 7])
async def test_events_split_across_reads_are_reassembled(serve_upstream, newline, piece):
    """Pieces of 1 byte split every "\r\n" and every event's end across two reads."""
    text = "split across many small reads"
    deltas = [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word + " "}}
        for word in text.split()
    ]
    body = sse(
        START,
        TEXT_START,
        *deltas,
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}},
        {"type": "message_stop"},
    ).replace(b"\n", newline)
    gateway = await serve_upstream(200, body, piece=piece)
    status, reply = await call(gateway, stream=True)
    assert status == 200
    chunks = [json.loads(e[len("data: ") :]) for e in reply.split("\n\n") if e.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text + " "
    assert reply.endswith("data: [DONE]\n\n")


SERVER_TOOL_BLOCKS = [
    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "oslo weather"}},
    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
    {"type": "text", "text": "It is mild."},
]


async def test_server_tool_blocks_are_not_client_tool_calls(serve_upstream):
    """Pitfall P8: the client would try to run `web_search` itself."""
    message = {
        "id": "m",
        "type": "message",
        "role": "assistant",
        "model": "x",
        "content": SERVER_TOOL_BLOCKS,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 5, "output_tokens": 5},
    }
    gateway = await serve_upstream(200, json.dumps(message).encode(), "application/json")
    status, text = await call(gateway, stream=False)
    assert status == 200
    reply = json.loads(text)["choices"][0]
    assert reply["message"] == {"role": "assistant", "content": "It is mild.", "refusal": None}
    assert reply["finish_reason"] == "stop"


async def test_server_tool_blocks_in_a_stream_are_not_client_tool_calls(serve_upstream):
    server_use, result, _ = SERVER_TOOL_BLOCKS
    body = sse(
        START,
        {"type": "content_block_start", "index": 0, "content_block": {**server_use, "input": {}}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": '{"query": "oslo"}'},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": result},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "It is mild."}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}},
        {"type": "message_stop"},
    )
    gateway = await serve_upstream(200, body)
    status, text = await call(gateway, stream=True)
    assert status == 200
    chunks = [json.loads(e[len("data: ") :]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "It is mild."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
