"""A deterministic mock of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``).

Used by the gateway's tests, its benchmarks and its demo mode. It validates
requests the way the real API does (so tests can prove the gateway never
forwards OpenAI-only fields), replies with a scripted ``Scenario`` per request
and streams Anthropic's exact SSE event sequence.

With no scenario queued it answers as a model would without a script: a tool call when the
request's ``tool_choice`` forces one or the person's last words name one of its tools (arguments
made from the tool's ``input_schema``); after a tool result, the tool's name and what it
returned; otherwise a quote of the last text the person wrote (not the context a client such as
Claude Code or Codex adds to the turn).

``MockUpstream(fast=True)`` is the benchmarks' upstream: no validation, no
recording, and replies sent from bytes encoded once, chosen by the request's
``model`` (see ``FAST_MODELS``), so that the mock costs as little as it can.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import deque
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from gateway import runtime
from gateway.mock.cache import PromptCache, prompt_tokens
from gateway.mock.validation import ALLOWED_FIELDS, COUNT_TOKENS_FIELDS, Invalid, validate, validate_betas
from gateway.server import LISTEN_BACKLOG

# 2023-06-01 is the documented version; the installed SDK (2.x) sends 2026-10-21.
ANTHROPIC_VERSIONS = frozenset({"2023-06-01", "2026-10-21"})

MAX_BODY_BYTES = 32 * 1024 * 1024  # the real API answers 413 above this

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@dataclass
class Scenario:
    """What the mock answers to one request."""

    blocks: list[dict] | None = None  # None = the default echo reply
    stop_reason: str | None = None  # default: "tool_use" if any tool_use block else "end_turn"
    stop_sequence: str | None = None
    stop_details: dict | None = None
    # Overrides, plus "thinking_tokens". "ephemeral_5m_input_tokens" / "ephemeral_1h_input_tokens" force
    # cache_creation's split; cache_creation_input_tokens is then their sum unless forced too (forced
    # alone, it is all 5-minute tokens). "service_tier" is the tier reported ("standard" unless
    # given). Any other key is reported as given: "server_tool_use" ({"web_search_requests": n,
    # "web_fetch_requests": n}, in a stream by its message_delta, as the real API counts uses to
    # the end), or a field a gateway may not know ("speed").
    usage: dict = field(default_factory=dict)
    status: int = 200  # non-200: Anthropic's error envelope for that status
    error_message: str = "mock error"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before the response starts (status line included)
    event_delay: float = 0.0  # between stream events
    pings: int = 1  # sent right after the first content_block_start
    chunk_size: int = 8  # characters per streamed delta
    error_after: int | None = None  # stream: send `event: error` after N events
    stream_error_message: str = "Overloaded"  # that event's message
    stream_error_type: str = "overloaded_error"  # that event's type (Bedrock: the exception frame it maps to)
    drop_after: int | None = None  # stream: close the connection after N events
    stall_after: int | None = None  # stream: after N events, send nothing more (the connection stays open)
    end_delay: float = 0.0  # stream: between the last event and the body's end (its last chunk)


@dataclass(frozen=True)
class Credential:
    """How a request was authenticated, for tests to assert on. `scheme`: "x-api-key" or
    "bearer" (an Anthropic or Bedrock API key), "sigv4" (`key` is the access key id) or "oauth"
    (a Vertex access token). `session_token_signed`: SigV4 with temporary credentials, whether
    the X-Amz-Security-Token header was among the signed ones."""

    scheme: str
    key: str
    session_token: str | None = None
    session_token_signed: bool = False


@dataclass
class RecordedRequest:
    path: str  # without the query string
    query: dict[str, str]  # e.g. {"beta": "true"}, as Claude Code sends
    headers: dict[str, str]  # lower-cased names; a header sent on several lines, its values joined by ", "
    body: dict
    connection: int = 0  # which TCP connection it came on (the client's port)
    header_lines: list[tuple[str, str]] = field(default_factory=list)  # (lower-cased name, value), as sent
    raw: bytes = b""  # the body's bytes, as sent
    auth: Credential | None = None  # set once the request is authenticated (None: not, or no key required)


# fast=True: the reply to each model, as (content blocks, streamed?, seconds between deltas).
# A pause of 0 sends the whole stream in one write; otherwise each delta is a write of its own,
# as real tokens arrive.
_FAST_TEXT = ("Tokens arrive eight characters at a time here. " * 9)[:400]  # 50 deltas of 8
FAST_MODELS: dict[str, tuple[list[dict], bool, float]] = {
    "bench-nonstream": ([{"type": "text", "text": _FAST_TEXT}], False, 0.0),
    "bench-stream50": ([{"type": "text", "text": _FAST_TEXT}], True, 0.0),
    "bench-tool": (
        [
            {"type": "text", "text": "Let me look that up."},
            {
                "type": "tool_use",
                "id": "toolu_bench",
                "name": "get_weather",
                "input": {"city": "Paris", "country": "FR", "units": "celsius", "days": 3},
            },
        ],
        True,
        0.0,
    ),
    # A Claude Code turn's answer: it thinks, says a line, and runs a command.
    "bench-claude-code": (
        [
            {"type": "thinking", "thinking": _FAST_TEXT * 2, "signature": "bench-signature-" + "s" * 200},
            {"type": "text", "text": "I'll run the tests to see what fails."},
            {
                "type": "tool_use",
                "id": "toolu_bench_bash",
                "name": "Bash",
                "input": {"command": "python -m pytest -q tests/test_parser.py", "description": "Run the tests"},
            },
        ],
        True,
        0.0,
    ),
    # A Codex turn's answer: it thinks, then runs a command with its shell tool.
    "bench-codex": (
        [
            {"type": "thinking", "thinking": _FAST_TEXT, "signature": "bench-signature-" + "s" * 200},
            {
                "type": "tool_use",
                "id": "toolu_bench_shell",
                "name": "shell",
                "input": {"command": ["bash", "-lc", "python -m pytest -q tests/test_parser.py"], "workdir": "/repo"},
            },
        ],
        True,
        0.0,
    ),
    "bench-paced": ([{"type": "text", "text": _FAST_TEXT}], True, 0.01),  # 50 deltas, 0.5 s
    "bench-slow": ([{"type": "text", "text": _FAST_TEXT[:80]}], True, 1.0),  # 10 deltas, 10 s
}


# Scenario.usage's keys that shape the usage reported rather than appear in it.
_SHAPING = frozenset({"thinking_tokens", "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"})
# The usage a stream reports only at its end, in message_delta.
_FINAL_USAGE = ("output_tokens_details", "server_tool_use")

# A token, as the mock counts the output it writes: a word of up to 7 letters, or one other
# character (short English words are a token each, as in Anthropic's counts, which are well
# under one token for every 4 characters of English prose).
_TOKEN = re.compile(r"\w{1,7}|[^\w\s]")


def output_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def _sse(event: dict) -> bytes:
    # The event name always equals the JSON `type`, as on the real API.
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def _chunks(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)]


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text")


# Text a client adds to the person's turn as context, which the person did not write: Claude
# Code's <system-reminder> blocks, Codex's <environment_context> and its AGENTS.md instructions.
_INJECTED = re.compile(r"\s*(?:<[A-Za-z][\w-]*>|# AGENTS\.md instructions for )")


def _persons_text(messages: list) -> str:
    """The last text the person wrote: the text of the newest user turn that has any, less the
    context a client injected ("" when there is none)."""
    for message in reversed(messages):
        content = message["content"] if message["role"] == "user" else []
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [
            block["text"]
            for block in blocks
            if isinstance(block, dict)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
            and not _INJECTED.match(block["text"])
        ]
        if texts:
            return "\n".join(texts)
    return ""


def _tool_results(messages: list) -> list[str]:
    """What the last user turn's tool results say, one line each naming its tool."""
    last = next((m for m in reversed(messages) if m["role"] == "user"), None)
    content = last["content"] if last is not None and isinstance(last["content"], list) else []
    results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    if not results:
        return []
    names = {
        block.get("id"): block.get("name")
        for message in messages
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "tool_use"
    }
    said = []
    for result in results:
        name = names.get(result.get("tool_use_id")) or result.get("tool_use_id")
        text = _text_of(result.get("content"))[:200]
        outcome = ("failed: " if result.get("is_error") else "returned: ") + text if text else "returned nothing"
        said.append(f"The tool {name} {outcome}")
    return said


def _unscripted_text(messages: list) -> str:
    """The reply with no scenario and no tool to call: what the tool results say, else a quote of
    the person's last words."""
    said = "\n".join(_tool_results(messages))
    if not said:
        quoted = _persons_text(messages)[:200]
        said = "You said: " + quoted if quoted else ""
    return "Hello from the mock upstream." + (" " + said if said else "")


def called_tool(body: dict) -> dict | None:
    """The tool an unscripted reply calls: the one `tool_choice` forces (`any`: the first tool), or
    with `auto` or none given, the tool whose name comes first in what the person wrote in the
    last user message (see `_persons_text`), as a whole word. A user turn that answers a tool
    call calls none by name, so an agent's loop ends (a forced choice still calls one, as it
    would upstream); `none` never calls one."""
    tools = [tool for tool in body.get("tools") or [] if isinstance(tool, dict) and isinstance(tool.get("name"), str)]
    if not tools:
        return None
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "any":
        return tools[0]
    if kind == "tool":
        return next((tool for tool in tools if tool["name"] == choice.get("name")), None)
    if kind != "auto":
        return None
    last_user = next((m for m in reversed(body["messages"]) if m["role"] == "user"), None)
    if last_user is None:
        return None
    content = last_user["content"]
    if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
        return None
    text = _persons_text([last_user])
    named = []
    for tool in tools:
        # A whole word: a tool named `now` is not called by "know".
        found = re.search(rf"(?<![\w-]){re.escape(tool['name'])}(?![\w-])", text)
        if found:
            named.append((found.start(), tool))
    return min(named, key=lambda pair: pair[0])[1] if named else None


_MAX_SCHEMA_DEPTH = 16  # a recursive $ref stops here


def example_input(schema: object) -> dict:
    """A tool call's arguments made from its JSON Schema: every required property and no other;
    {} for a schema that is missing or not an object's."""
    value = _example(schema, schema, 0) if isinstance(schema, dict) else None
    return value if isinstance(value, dict) else {}


def _example(schema: object, root: dict, depth: int) -> object:
    """A value `schema` accepts: its `const`, its first `enum` value, or one made from its type."""
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: object = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _example(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for combined in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combined)
        if isinstance(options, list) and options:
            # Optional[X] is anyOf X or null: X is the one worth showing.
            usable = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")] or options
            return _example(usable[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:  # a type left implicit by what the schema describes
        kind = "object" if "properties" in schema else "array" if "items" in schema else None
    if kind == "string":
        return "mock"
    if kind in ("integer", "number"):
        if isinstance(schema.get("minimum"), (int, float)):
            return schema["minimum"]
        maximum = schema.get("maximum")
        return min(1, maximum) if isinstance(maximum, (int, float)) else 1
    if kind == "boolean":
        return True
    if kind == "array":
        items = schema.get("items")
        return [_example(items, root, depth + 1)] if isinstance(items, dict) else []
    if kind == "object":
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        names = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
        return {name: _example(properties.get(name), root, depth + 1) for name in names}
    return None


class MockUpstream:
    """Scenarios are for /v1/messages only: count_tokens never consumes one, so a gateway that
    counts before it sends leaves the queue to the messages it was meant for. count_tokens fails
    instead while `count_tokens_status` is not 200 (Anthropic's error envelope for that status)."""

    REQUEST_ID_HEADER = "request-id"
    FAST_STREAM_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}

    def __init__(self, *, api_key: str | None = None, fast: bool = False):
        self.api_key = api_key
        self.requests: list[RecordedRequest] = []
        self.count_tokens_status = 200
        self.disconnects = 0
        self.prompt_cache = PromptCache()
        self._queue: deque[Scenario] = deque()
        self.url: str | None = None  # set by start()
        self._msg_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._tool_ids = itertools.count(1)
        self._seen_disconnects = 0
        self._disconnected = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self._add_routes(self.app.router, fast)
        self.app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._fast_replies = self._encode_fast_replies() if fast else {}

    def _add_routes(self, router: web.UrlDispatcher, fast: bool) -> None:
        """The API's routes (a cloud's mock adds its own instead)."""
        router.add_post("/v1/messages", self._fast if fast else self._handle)
        if not fast:
            router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def enqueue(self, *scenarios: Scenario) -> None:
        self._queue.extend(scenarios)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # handler_cancellation: a client disconnect cancels the handler, which we count.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG).start()  # as a real upstream's, not 128
        real_port = self._runner.addresses[0][1]  # port=0 picks a free one
        self.url = f"http://{host}:{real_port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_disconnect(self, timeout: float = 5.0) -> None:
        """Wait for the next disconnect not yet awaited (earlier ones count too)."""

        async def wait() -> None:
            while self.disconnects <= self._seen_disconnects:
                self._disconnected.clear()
                await self._disconnected.wait()

        await asyncio.wait_for(wait(), timeout)
        self._seen_disconnects += 1

    # -- request handling ------------------------------------------------

    def _request_id(self) -> str:
        return f"req_mock_{next(self._req_ids):06d}"

    def _error(self, status: int, message: str, headers: dict | None = None) -> web.Response:
        request_id = self._request_id()
        error = {"type": ERROR_TYPES.get(status, "api_error"), "message": message}
        return web.Response(
            status=status,
            body=orjson.dumps({"type": "error", "error": error, "request_id": request_id}),
            content_type="application/json",
            headers={**(headers or {}), "request-id": request_id},
        )

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._error(404, f"Not found: {request.method} {request.path}")

    async def _record(self, request: web.Request) -> tuple[RecordedRequest, object]:
        """Records the request before any check, so tests can inspect rejected requests too: the
        record and the parsed body (None when it is not JSON)."""
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        header_lines = [
            (name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in request.raw_headers
        ]
        headers: dict[str, str] = {}
        for name, value in header_lines:  # a header on several lines is one list (RFC 9110)
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        peer = request.transport.get_extra_info("peername") if request.transport else None
        recorded = RecordedRequest(
            path=request.path,
            query=dict(request.query),
            headers=headers,
            header_lines=header_lines,
            body=body if isinstance(body, dict) else {},
            connection=peer[1] if peer else 0,
            raw=raw,
        )
        self.requests.append(recorded)
        return recorded, body

    async def _admit(self, request: web.Request, fields: frozenset[str]) -> dict | web.Response:
        """Records the request, then checks it as the real API does: its body, or the error to answer."""
        recorded, body = await self._record(request)
        headers = recorded.headers
        if self.api_key is not None:
            authorization = headers.get("authorization", "")
            if headers.get("x-api-key") == self.api_key:
                recorded.auth = Credential("x-api-key", self.api_key)
            elif authorization == f"Bearer {self.api_key}":
                recorded.auth = Credential("bearer", self.api_key)
            else:
                return self._error(401, "invalid x-api-key")
        version = headers.get("anthropic-version")
        if version is None:
            return self._error(400, "anthropic-version: header is required")
        if version not in ANTHROPIC_VERSIONS:
            return self._error(400, f"anthropic-version: invalid version {version!r}")
        if not isinstance(body, dict):
            return self._error(400, "There was an error parsing the body of your request as JSON")
        try:
            validate(body, fields, validate_betas(headers.get("anthropic-beta", "")))
        except Invalid as exc:
            return self._error(400, str(exc))
        return body

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as usage counts them, without reading or writing the cache."""
        body = await self._admit(request, COUNT_TOKENS_FIELDS)
        if isinstance(body, web.Response):
            return body
        if self.count_tokens_status != 200:
            return self._error(self.count_tokens_status, "mock error")
        return web.Response(
            body=orjson.dumps({"input_tokens": prompt_tokens(body)}),
            content_type="application/json",
            headers={"request-id": self._request_id()},
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await self._admit(request, ALLOWED_FIELDS)
        if isinstance(body, web.Response):
            return body
        return await self._answer(request, body, stream=bool(body.get("stream")))

    async def _answer(self, request: web.Request, body: dict, *, stream: bool) -> web.StreamResponse:
        """The reply to a valid request (an Anthropic body, `model` included): the next scenario's."""
        # Only valid requests consume a scenario; without one, the request decides the reply.
        sc = self._queue.popleft() if self._queue else Scenario(blocks=self._unscripted_blocks(body))
        try:
            if sc.delay:
                await asyncio.sleep(sc.delay)
            if sc.status != 200:
                return self._error(sc.status, sc.error_message, sc.headers)
            message = self._message(body, sc)
            if stream:
                return await self._stream(request, message, sc)
            return web.Response(
                body=orjson.dumps(message),
                content_type="application/json",
                headers={**sc.headers, **self._message_headers(message)},
            )
        except asyncio.CancelledError:
            # handler_cancellation=True: the client went away while we were answering.
            self._note_disconnect()
            raise

    def _encode_fast_replies(self) -> dict[str, bytes | tuple[list[bytes], float]]:
        """FAST_MODELS encoded once: a message's JSON, or a stream's writes and the pause before each."""
        replies: dict[str, bytes | tuple[list[bytes], float]] = {}
        for model, (blocks, stream, pause) in FAST_MODELS.items():
            request = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
            message = self._message(request, Scenario(blocks=blocks))
            if not stream:
                replies[model] = orjson.dumps(message)
                continue
            writes = [b""]
            for event in self._events(message, Scenario(blocks=blocks)):
                if pause and event["type"] == "content_block_delta":
                    writes.append(b"")
                writes[-1] += self._frame(event, message)
            replies[model] = (writes, pause)
        return replies

    async def _fast_model(self, request: web.Request) -> str | None:
        """The model a fast request names: the body's `model` (a cloud's mock: the path's)."""
        return orjson.loads(await request.read()).get("model")

    async def _fast(self, request: web.Request) -> web.StreamResponse:
        model = await self._fast_model(request)
        reply = self._fast_replies.get(model)  # type: ignore[arg-type]
        if reply is None:
            return self._error(404, f"fast mode: unknown model {model!r} (known: {', '.join(FAST_MODELS)})")
        if isinstance(reply, bytes):
            return web.Response(body=reply, content_type="application/json")
        writes, pause = reply
        resp = web.StreamResponse(headers=self.FAST_STREAM_HEADERS)
        try:
            await resp.prepare(request)
            for n, data in enumerate(writes):
                if n:
                    await asyncio.sleep(pause)
                await resp.write(data)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away; the benchmark counts it
        return resp

    def _unscripted_blocks(self, body: dict) -> list[dict] | None:
        """A tool call when the request asks for one (see `called_tool`), else None: the echo."""
        tool = called_tool(body)
        if tool is None:
            return None
        call = {
            "type": "tool_use",
            "id": f"toolu_mock_{next(self._tool_ids):06d}",
            "name": tool["name"],
            "input": example_input(tool.get("input_schema")),
        }
        if (body.get("thinking") or {}).get("type") in ("enabled", "adaptive"):
            # The real API thinks before a call; and the turn, sent back, must start with its thinking.
            thinking = f"The user asked for {tool['name']}; call it."
            return [{"type": "thinking", "thinking": thinking, "signature": "mock-signature"}, call]
        return [call]

    def _note_disconnect(self) -> None:
        self.disconnects += 1
        self._disconnected.set()

    def _message(self, body: dict, sc: Scenario) -> dict:
        """The complete (non-stream) Message the scenario describes. With max_tokens 0 (a cache
        pre-warm) nothing is generated: no blocks, stop_reason "max_tokens", no output tokens."""
        warming = body.get("max_tokens") == 0
        blocks = [] if warming else sc.blocks
        if blocks is None:
            blocks = [{"type": "text", "text": _unscripted_text(body["messages"])}]
        produced = sum(
            output_tokens(b.get("text", ""))
            + output_tokens(b.get("thinking", ""))
            + (output_tokens(orjson.dumps(b.get("input", {})).decode()) if b.get("type") == "tool_use" else 0)
            for b in blocks
        )
        overrides = sc.usage
        cached = self.prompt_cache.usage(body)
        written = overrides.get("cache_creation_input_tokens")
        one_hour = overrides.get(
            "ephemeral_1h_input_tokens", cached["ephemeral_1h_input_tokens"] if written is None else 0
        )
        five_minutes = overrides.get(
            "ephemeral_5m_input_tokens", cached["ephemeral_5m_input_tokens"] if written is None else written - one_hour
        )
        usage = {
            "input_tokens": overrides.get("input_tokens", cached["input_tokens"]),
            "cache_creation_input_tokens": one_hour + five_minutes if written is None else written,
            "cache_read_input_tokens": overrides.get("cache_read_input_tokens", cached["cache_read_input_tokens"]),
            "cache_creation": {"ephemeral_5m_input_tokens": five_minutes, "ephemeral_1h_input_tokens": one_hour},
            "output_tokens": overrides.get("output_tokens", 0 if warming else max(1, produced)),
            "service_tier": overrides.get("service_tier", "standard"),
        }
        usage |= {name: value for name, value in overrides.items() if name not in usage and name not in _SHAPING}
        if "thinking_tokens" in overrides:
            usage["output_tokens_details"] = {"thinking_tokens": overrides["thinking_tokens"]}
        has_tool = any(b.get("type") == "tool_use" for b in blocks)
        return {
            "id": f"msg_mock_{next(self._msg_ids):06d}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": blocks,
            "stop_reason": "max_tokens" if warming else sc.stop_reason or ("tool_use" if has_tool else "end_turn"),
            "stop_sequence": None if warming else sc.stop_sequence,
            "stop_details": None if warming else sc.stop_details,
            "usage": usage,
        }

    @staticmethod
    def _events(message: dict, sc: Scenario) -> list[dict]:
        """Anthropic's SSE event sequence for a complete message."""
        usage = message["usage"]
        start_usage = {k: v for k, v in usage.items() if k not in _FINAL_USAGE} | {"output_tokens": 1}
        head = {k: message[k] for k in ("id", "type", "role", "model")}
        events: list[dict] = [
            {
                "type": "message_start",
                "message": {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage},
            }
        ]
        pings = [{"type": "ping"}] * sc.pings
        for i, block in enumerate(message["content"]):
            kind = block.get("type")
            deltas: list[dict] = []
            start: dict
            if kind == "text":
                start = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": t} for t in _chunks(block["text"], sc.chunk_size)]
            elif kind == "tool_use":
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                # Like the real API: the first fragment is "", the placeholder input is not part of the JSON.
                raw = orjson.dumps(block.get("input", {})).decode()
                deltas = [{"type": "input_json_delta", "partial_json": p} for p in ["", *_chunks(raw, sc.chunk_size)]]
            elif kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [{"type": "thinking_delta", "thinking": t} for t in _chunks(block["thinking"], sc.chunk_size)]
                deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
            else:  # redacted_thinking (and anything else) arrives whole
                start = block
            events.append({"type": "content_block_start", "index": i, "content_block": start})
            if i == 0:
                events += pings
            events += [{"type": "content_block_delta", "index": i, "delta": d} for d in deltas]
            events.append({"type": "content_block_stop", "index": i})
        if not message["content"]:
            events += pings
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        if message["stop_details"] is not None:
            delta["stop_details"] = message["stop_details"]
        delta_usage = {"output_tokens": usage["output_tokens"]} | {k: usage[k] for k in _FINAL_USAGE if k in usage}
        events.append({"type": "message_delta", "delta": delta, "usage": delta_usage})
        events.append({"type": "message_stop"})
        return events

    # -- how a reply is written (a cloud's mock writes the same events its own way) ----------

    def _message_headers(self, message: dict) -> dict[str, str]:
        return {"request-id": self._request_id()}

    def _stream_headers(self) -> dict[str, str]:
        return {"content-type": "text/event-stream", "cache-control": "no-cache", "request-id": self._request_id()}

    def _frame(self, event: dict, message: dict) -> bytes:
        """One stream event as written; `message` is the whole answer it is part of."""
        return _sse(event)

    def _stream_error(self, sc: Scenario, request_id: str) -> bytes:
        """The failure after the status (200) is sent: an event, after which the stream ends."""
        error = {"type": sc.stream_error_type, "message": sc.stream_error_message}
        return _sse({"type": "error", "error": error, "request_id": request_id})

    async def _stream(self, request: web.Request, message: dict, sc: Scenario) -> web.StreamResponse:
        headers = self._stream_headers()
        resp = web.StreamResponse(headers={**sc.headers, **headers})
        try:
            await resp.prepare(request)
            for n, event in enumerate(self._events(message, sc)):
                if n and sc.event_delay:
                    await asyncio.sleep(sc.event_delay)
                if n == sc.drop_after:
                    # Abrupt close: no terminating chunk, so the client sees a truncated body.
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if n == sc.stall_after:
                    await asyncio.Event().wait()  # until the client goes (handler_cancellation)
                if n == sc.error_after:
                    await resp.write(self._stream_error(sc, headers[self.REQUEST_ID_HEADER]))
                    break
                await resp.write(self._frame(event, message))
            if sc.end_delay:
                await asyncio.sleep(sc.end_delay)
            await resp.write_eof()
        except ConnectionError:
            # A write hit a closed socket (aiohttp's ClientConnectionResetError); not a server bug.
            self._note_disconnect()
        return resp


def run(host: str, port: int, *, fast: bool = False) -> None:
    """Serve the mock until Ctrl-C or SIGTERM (the `ezat-gateway mock-upstream` command; with
    fast=True, the benchmarks' upstream, bench/mock.py)."""

    async def serve() -> None:
        mock = MockUpstream(fast=fast)
        url = await mock.start(host, port)
        runtime.tune_garbage_collector()  # as the gateway's, so a benchmark's processes all run alike
        what = "Fast mock" if fast else "Mock"
        routes = "POST /v1/messages" if fast else "POST /v1/messages, /v1/messages/count_tokens"
        print(f"{what} Anthropic upstream listening on {url} ({routes})", flush=True)
        await runtime.until_stopped()
        await mock.close()

    runtime.run(serve())
