"""Property-based fuzzing of POST /openai/v1/chat/completions with hypothesis.

Random JSON shapes (real field names with random values of random types, random `messages` with
random roles, content, parts and tool_calls, non-object bodies, invalid JSON bytes; streamed and
not) go to a real gateway in front of the mock upstream, which answers every valid request.
Whatever comes back must be a well-formed OpenAI success (200 with a chat.completion, or an SSE
stream of chat.completion.chunk events ending in `data: [DONE]`) or a well-formed OpenAI error
envelope with a 4xx status: never a 5xx, never a body that is not the envelope.

How the servers run: hypothesis calls the test function once per example, synchronously, and
does not know about pytest-asyncio's per-test event loops (async fixtures would be set up per
test, not per example, and an async `@given` test re-enters its loop once per example). So the
test is a plain sync function, and one gateway + one mock upstream for the whole module run on
a dedicated event loop in a background thread (`LoopThread`). Each example submits its request
to that loop with `run_coroutine_threadsafe` and waits for the answer. The servers keep serving
between examples, no loop is ever re-entered or shared with pytest-asyncio, and the thread is
stopped once at module teardown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import string
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai.types.chat as chat_types
import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from gateway.app import build_app
from gateway.config import Config
from gateway.mock.upstream import MockUpstream
from tests.support import KEY, MODEL, UPSTREAM_KEY, Gateway, make_config

ENDPOINT = "/openai/v1/chat/completions"
# Spec, "Errors": status → (type, code) of OpenAI's envelope.
ERRORS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    402: ("insufficient_quota", "insufficient_quota"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}
FUZZ_SETTINGS = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),  # more for a longer hunt
    deadline=None,
    database=None,  # nothing written into the repository; a failure prints its blob instead
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- The servers, on their own loop and thread.


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes


def fuzz_config(upstream_url: str) -> Config:
    """The test config with three kinds of model: MODEL with sampling and without the xhigh
    effort, "test/small" (4096 output tokens, no sampling) and "test/no-forcing", which refuses a
    forced tool choice."""
    config = make_config(upstream_url, sampling=True, efforts=("low", "medium", "high", "max"))
    no_forcing = dataclasses.replace(config.models[1], id="test/no-forcing", forced_tool_choice=False)
    return dataclasses.replace(config, models=(*config.models, no_forcing))


class Servers:
    """One mock upstream, one gateway in front of it and one HTTP client, all on a LoopThread."""

    def __init__(self) -> None:
        self.runner = LoopThread()
        self.runner.run(self._start())

    async def _start(self) -> None:
        # Everything is made on the servers' loop, so nothing binds to another one.
        self.upstream = MockUpstream(api_key=UPSTREAM_KEY)
        await self.upstream.start()
        self.gateway = await Gateway(build_app(fuzz_config(self.upstream.url))).start()
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))

    def post(
        self, raw: bytes, headers: dict[str, str] | None = None, chunked: bool = False, path: str = ENDPOINT
    ) -> Answer:
        async def pieces():  # a chunked body, in pieces of 100 bytes
            for start in range(0, len(raw), 100):
                yield raw[start : start + 100]

        async def send() -> Answer:
            async with self.http.post(
                self.gateway.url + path,
                data=pieces() if chunked else raw,
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})},
            ) as response:
                return Answer(response.status, response.content_type, await response.read())

        return self.runner.run(send())

    def close(self) -> None:
        async def close() -> None:
            await self.http.close()
            await self.gateway.runner.cleanup()
            await self.upstream.close()

        self.runner.run(close())
        self.runner.stop()


@pytest.fixture(scope="module")
def servers():
    started = Servers()
    yield started
    started.close()


# --- Strategies.

SHORT_TEXT = st.text(max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | SHORT_TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(SHORT_TEXT, children, max_size=4),
    max_leaves=12,
)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each picked in proportion to its weight."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(pool) - 1).flatmap(lambda i: pool[i])


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right shape, sometimes any JSON at all."""
    return weighted((5, strategy), (1, JSON))


def obj(required: dict[str, Any] | None = None, optional: dict[str, Any] | None = None) -> st.SearchStrategy:
    """An object with the given keys (values through `maybe`) plus, sometimes, random keys."""
    known = st.fixed_dictionaries(
        {k: maybe(v) for k, v in (required or {}).items()},
        optional={k: maybe(v) for k, v in (optional or {}).items()},
    )
    extra = st.dictionaries(SHORT_TEXT, JSON, max_size=2)
    return st.builds(lambda extra, known: {**extra, **known}, weighted((3, st.just({})), (1, extra)), known)


# Tool names and call ids: valid ones, ones the upstream needs rewritten (P5, P12), and junk.
IDENTIFIERS = st.sampled_from(["get_weather", "call_1", "toolu_01", "functions.Bash:0", "a b", "x" * 130]) | st.text(
    alphabet=string.ascii_letters + string.digits + "_-.:/ ", max_size=20
)
ARGUMENTS = st.sampled_from(['{"city": "Oslo"}', "{}", "", "  ", "not json", "[1, 2]", "null", '{"a": {"b": [1]}}']) | (
    JSON.map(json.dumps)
)
DATA_URLS = st.sampled_from(
    [
        "data:image/png;base64,iVBORw0KGgo=",
        "data:image/jpeg;base64,/9j/4AAQ",
        "data:IMAGE/WEBP;base64,UklGRg==",
        "data:image/bmp;base64,Qk0=",
        "data:application/pdf;base64,JVBERi0xLjQK",
        "data:text/plain;base64,aGk=",
        "data:image/png,notbase64",
        "data:image/png;base64,",
        "data:;base64,AAAA",
        "https://example.com/photo.jpg",
        "http://127.0.0.1/cat.png",
        "ftp://example.com/x.png",
        "",
    ]
)
SCHEMAS = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.just({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}),
    st.just(
        {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}, "additionalProperties": False}
    ),
    st.just({"type": ["object", "null"], "additionalProperties": False}),
    st.just({"properties": {}}),
    st.just({"type": "array", "items": {"type": "object"}}),
    st.dictionaries(
        st.sampled_from(["type", "properties", "items", "anyOf", "additionalProperties", "$defs", "required"]),
        JSON,
        max_size=4,
    ),
)

PART = obj(
    required={
        "type": st.sampled_from(["text", "text", "image_url", "file", "input_audio", "refusal", "video", "TEXT", ""])
    },
    optional={
        "text": SHORT_TEXT | st.sampled_from(["", "   ", "\n"]),
        "image_url": obj(optional={"url": DATA_URLS, "detail": st.sampled_from(["auto", "low", "high"])}),
        "file": obj(optional={"file_data": DATA_URLS, "file_id": SHORT_TEXT, "filename": SHORT_TEXT}),
        "input_audio": obj(optional={"data": SHORT_TEXT, "format": st.sampled_from(["wav", "mp3"])}),
        "refusal": SHORT_TEXT,
        "cache_control": st.just({"type": "ephemeral"}),
    },
)
CONTENT = st.one_of(SHORT_TEXT, st.sampled_from(["", "  "]), st.none(), st.lists(PART, max_size=4))
TOOL_CALL = obj(
    required={"id": IDENTIFIERS, "function": obj(optional={"name": IDENTIFIERS, "arguments": ARGUMENTS})},
    optional={"type": st.sampled_from(["function", "custom"])},
)
MESSAGE = obj(
    required={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "robot", "USER"]),
    },
    optional={
        "content": CONTENT,
        "tool_calls": st.lists(TOOL_CALL, max_size=3),
        "tool_call_id": IDENTIFIERS,
        "name": SHORT_TEXT,
        "refusal": SHORT_TEXT,
        "function_call": obj(optional={"name": IDENTIFIERS, "arguments": ARGUMENTS}),
    },
)

# Conversations shaped like real ones, so that many requests get through the translation to the
# upstream: user turns, assistant turns, system/developer anywhere, the tool loop (calls, then a
# result per call), and now and then a random message from MESSAGE.
TEXT = st.text(min_size=1, max_size=20)
CALL_IDS = st.lists(
    st.sampled_from(["call_1", "call_2", "toolu_01", "functions.Bash:0", "call:abc.def"]),
    min_size=1,
    max_size=3,
    unique=True,
)


def tool_loop(ids: list[str], text: str | None, arguments: str) -> list[dict]:
    calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": arguments}} for i in ids]
    return [
        {"role": "assistant", "content": text, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": i, "content": "9°C"} for i in ids),
    ]


TURN = weighted(
    (3, st.builds(lambda text: [{"role": "user", "content": text}], TEXT)),
    (2, st.builds(lambda text: [{"role": "assistant", "content": text}], TEXT)),
    (
        1,
        st.builds(
            lambda role, text: [{"role": role, "content": text}], st.sampled_from(["system", "developer"]), SHORT_TEXT
        ),
    ),
    (
        2,
        st.builds(
            tool_loop,
            CALL_IDS,
            st.sampled_from([None, "", "Let me check."]),
            st.sampled_from(['{"city": "Oslo"}', "{}", ""]),
        ),
    ),
    (1, st.lists(PART, min_size=1, max_size=3).map(lambda parts: [{"role": "user", "content": parts}])),
    (1, MESSAGE.map(lambda m: [m])),
)
CONVERSATION = st.builds(
    lambda first, turns: [first, *(m for turn in turns for m in turn)],
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
    st.lists(TURN, max_size=4),
)
MESSAGES = weighted((4, CONVERSATION), (1, st.lists(MESSAGE, max_size=5)))

FUNCTION_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "lookup", "ns.tool/search", "y" * 70])},
            optional={"description": SHORT_TEXT, "parameters": SCHEMAS, "strict": st.booleans()},
        ),
    },
)
TOOL = weighted(
    (3, FUNCTION_TOOL),
    (
        1,
        obj(
            required={"type": st.sampled_from(["function", "custom", "web_search", ""])},
            optional={
                "function": obj(
                    required={"name": IDENTIFIERS},
                    optional={"description": SHORT_TEXT, "parameters": SCHEMAS, "strict": st.booleans()},
                ),
                "cache_control": st.just({"type": "ephemeral"}),
            },
        ),
    ),
)
TOOL_CHOICES = st.sampled_from(["auto", "none", "required", "any"]) | obj(
    required={"type": st.just("function"), "function": obj(optional={"name": IDENTIFIERS | st.just("get_weather")})}
)

# Fields the translator reads, and fields the spec ignores (or that belong to other APIs).
TRANSLATED: dict[str, st.SearchStrategy] = {
    "stream_options": obj(optional={"include_usage": st.booleans()}),
    "max_tokens": st.integers(min_value=-2, max_value=70_000),
    "max_completion_tokens": st.integers(min_value=-2, max_value=70_000),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "stop": SHORT_TEXT | st.lists(SHORT_TEXT | st.sampled_from([" ", "\n"]), max_size=4),
    "response_format": obj(
        required={"type": st.sampled_from(["text", "json_schema", "json_schema", "xml"])},
        optional={"json_schema": obj(optional={"name": SHORT_TEXT, "schema": SCHEMAS, "strict": st.booleans()})},
    ),
    "tools": st.lists(TOOL, max_size=3),
    "tool_choice": TOOL_CHOICES,
    "parallel_tool_calls": st.booleans(),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"]),
    "user": SHORT_TEXT,
    "seed": st.integers(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "store": st.booleans(),
    "metadata": st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=3),
    "service_tier": st.sampled_from(["auto", "default", "flex", "priority"]),
    "prompt_cache_key": SHORT_TEXT,
    "top_k": st.integers(-1, 100),
    "thinking": obj(
        optional={"type": st.sampled_from(["enabled", "adaptive", "disabled"]), "budget_tokens": st.integers()}
    ),
    "system": SHORT_TEXT,
    "anthropic_version": SHORT_TEXT,
}
# Fields the spec refuses (some values of them are accepted).
REFUSABLE: dict[str, st.SearchStrategy] = {
    "n": st.integers(min_value=0, max_value=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5),
    "logit_bias": st.dictionaries(st.integers(0, 99999).map(str), st.integers(-100, 100), max_size=2),
    "modalities": st.lists(st.sampled_from(["text", "audio"]), max_size=2),
    "audio": obj(optional={"voice": SHORT_TEXT, "format": SHORT_TEXT}),
    "web_search_options": obj(optional={"search_context_size": SHORT_TEXT}),
    "functions": st.lists(obj(optional={"name": IDENTIFIERS, "parameters": SCHEMAS}), max_size=2),
    "function_call": st.sampled_from(["auto", "none"]) | obj(optional={"name": IDENTIFIERS}),
    "response_format": st.just({"type": "json_object"}),
    "reasoning_effort": st.sampled_from(["extreme", "HIGH", "", "auto"]),
}
FIELDS = {
    **TRANSLATED,
    **REFUSABLE,
    "response_format": TRANSLATED["response_format"] | REFUSABLE["response_format"],
    "reasoning_effort": TRANSLATED["reasoning_effort"] | REFUSABLE["reasoning_effort"],
    "stream": st.booleans(),
}
# What the refusable fields accept.
ACCEPTED = {"n": st.just(1), "logprobs": st.just(False), "modalities": st.just(["text"]), "logit_bias": st.just({})}

MODELS = st.sampled_from([MODEL, "test/small", "test/no-forcing", "gpt-4o", "", "anthropic/claude-sonnet-5-5 "])
# Chaos: any field may appear, most with random values.
CHAOTIC = obj(required={"model": MODELS, "messages": MESSAGES}, optional=FIELDS)
# Plausible: stream or not, a few fields, each mostly with a value of the right shape.
PLAUSIBLE = st.tuples(
    st.lists(st.sampled_from(sorted(TRANSLATED)), max_size=4, unique=True),
    st.lists(st.sampled_from(sorted(ACCEPTED)), max_size=1),
    st.lists(st.sampled_from(sorted(REFUSABLE)), max_size=1),
    st.integers(0, 9),
).flatmap(
    lambda picked: st.fixed_dictionaries(
        {
            "model": weighted(
                (12, st.just(MODEL)), (4, st.just("test/small")), (2, st.just("test/no-forcing")), (1, MODELS)
            ),
            "messages": MESSAGES,
            "stream": st.booleans(),
            **{name: weighted((9, TRANSLATED[name]), (1, JSON)) for name in picked[0]},
            **{name: ACCEPTED[name] for name in picked[1]},
            # A refused field in one request of ten.
            **({name: REFUSABLE[name] for name in picked[2]} if picked[3] == 0 else {}),
        }
    )
)
REQUESTS = weighted((1, CHAOTIC), (3, PLAUSIBLE))
# Bodies that are valid JSON but not an object, and bytes that are not JSON at all.
NOT_OBJECTS = st.one_of(SCALARS, st.lists(JSON, max_size=3), st.builds(lambda r: [r], REQUESTS))
NOT_JSON = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.just(b"\xff\xfe{}"),
    st.just(b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xc3("}]}'),
    st.builds(lambda r, cut: json.dumps(r).encode()[:cut], REQUESTS, st.integers(1, 60)),
    st.builds(lambda r: json.dumps(r).encode() + b"}", REQUESTS),
    st.builds(lambda r: json.dumps(r).encode().replace(b'"', b"'"), REQUESTS),
    st.just(b'{"model": NaN}'),
    st.just(b'{"max_tokens": 1e400, "model": "' + MODEL.encode() + b'"}'),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}], "model": "' + MODEL.encode() + b'"}'),
)

BODIES = weighted(
    (8, REQUESTS.map(lambda r: ("object", r))),
    (1, NOT_OBJECTS.map(lambda r: ("not an object", r))),
    (1, NOT_JSON.map(lambda raw: ("not JSON", raw))),
)


# --- What a well-formed answer is.

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


def check_error(answer: Answer) -> dict:
    assert 400 <= answer.status < 500, f"HTTP {answer.status}: {answer.body[:500]!r}"
    assert answer.content_type == "application/json", answer.content_type
    envelope = json.loads(answer.body)
    assert isinstance(envelope, dict) and set(envelope) == {"error"}, envelope
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert answer.status in ERRORS, f"HTTP {answer.status} is not in the spec's errors table: {error}"
    assert (error["type"], error["code"]) == ERRORS[answer.status], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def check_completion(answer: Answer, request: dict) -> None:
    assert answer.content_type == "application/json", answer.content_type
    completion = chat_types.ChatCompletion.model_validate_json(answer.body)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == request["model"]
    assert len(completion.choices) == 1
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in FINISH_REASONS
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def check_stream(answer: Answer, request: dict) -> None:
    assert answer.content_type == "text/event-stream", answer.content_type
    events = [e for e in answer.body.decode().split("\n\n") if e and not e.startswith(":")]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    chunks = []
    for line in events[:-1]:
        assert line.startswith("data: "), line
        data = json.loads(line[len("data: ") :])
        assert "error" not in data, data  # the mock never fails mid-stream here
        chunks.append(chat_types.ChatCompletionChunk.model_validate(data))
    assert {(c.object, c.model) for c in chunks} == {("chat.completion.chunk", request["model"])}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [choice.finish_reason for c in chunks for choice in c.choices if choice.finish_reason]
    assert len(finishes) == 1 and finishes[0] in FINISH_REASONS, finishes
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.usage is None and c.choices for c in chunks)


def check(servers: Servers, raw: bytes, request: dict | None, kind: str, **sending) -> None:
    """POST `raw` (`sending`: headers, chunked); the answer must be well-formed. `request` is
    the body as an object (None when it is not one), for what a success must echo."""
    note(f"sent: {raw[:3000]!r} {sending}")
    before = len(servers.upstream.requests)
    answer = servers.post(raw, **sending)
    note(f"got: HTTP {answer.status} {answer.content_type} {answer.body[:2000]!r}")
    assert answer.status < 500, f"HTTP {answer.status}: {answer.body[:500]!r}"
    if answer.status != 200:
        error = check_error(answer)
        # For --hypothesis-show-statistics: where the answers come from.
        reached = len(servers.upstream.requests) > before
        event(f"{kind}: {answer.status} {'from the upstream' if reached else 'from the gateway'}")
        event(f"{'upstream' if reached else 'gateway'} said: {error['message'][:50]}")
        return
    assert request is not None, "only a JSON object can succeed"
    if request.get("stream") is True:
        check_stream(answer, request)
        event("200 stream")
    else:
        check_completion(answer, request)
        event("200 completion")


@FUZZ_SETTINGS
@given(case=BODIES)
def test_fuzz_every_answer_is_well_formed(servers, case):
    kind, body = case
    if kind == "not JSON":
        check(servers, body, None, kind)
    else:
        check(servers, json.dumps(body).encode(), body if kind == "object" else None, kind)


# --- Deep nesting: the same property for JSON nested up to 1,100 levels deep, which random shapes
# never reach. The body parser accepts 1,024 levels but orjson encodes only 255, so a deep value
# the gateway forwards (tool parameters, tool_call arguments, a json_schema) once failed with a
# 500 when the upstream request was encoded. Also where it is ignored (metadata, unknown fields)
# or refused (wrong types). The body is built as text: Python's json module cannot encode it.

DEEP = "__deep__"
PLACES = {
    "tool parameters": {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": DEEP}}}}
        ],
    },
    "whole tool parameters": {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "s",
                "schema": {"type": "object", "additionalProperties": False, "properties": {"x": DEEP}},
            },
        },
    },
    "tool_call arguments": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "9°C"},
        ],
    },
    "metadata": {"metadata": {"x": DEEP}},
    "unknown field": {"x_unknown": DEEP},
    "message content": {"messages": [{"role": "user", "content": DEEP}]},
    "stop": {"stop": DEEP},
    "logit_bias": {"logit_bias": {"1": DEEP}},
}


def nested(depth: int, container: str) -> str:
    return ('{"a":' * depth + "0" + "}" * depth) if container == "object" else ("[" * depth + "0" + "]" * depth)


def deep_body(place: str, depth: int, container: str, stream: bool) -> tuple[bytes, dict]:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": stream, **PLACES[place]}
    value = nested(depth, container)
    if place == "tool_call arguments":
        value = json.dumps('{"x": ' + value + "}")  # arguments are a JSON string
    return json.dumps(request).encode().replace(json.dumps(DEEP).encode(), value.encode()), request


@FUZZ_SETTINGS
@given(
    place=st.sampled_from(sorted(PLACES)),
    depth=st.integers(min_value=1, max_value=1100),
    container=st.sampled_from(["object", "array"]),
    stream=st.booleans(),
)
@example(place="tool parameters", depth=300, container="object", stream=False)
@example(place="tool_call arguments", depth=300, container="array", stream=True)
@example(place="json_schema", depth=300, container="object", stream=False)
def test_fuzz_deeply_nested_json(servers, place, depth, container, stream):
    raw, request = deep_body(place, depth, container, stream)
    check(servers, raw, request, "deep " + place)


# --- Deep schemas: the same property for schemas nested through `items`, `anyOf` and `$defs` up
# to 1,100 levels, where the tools' and the output format's schemas are. The structured-output
# check once walked them recursively: a schema 1,000 levels deep through `items` was a
# RecursionError, a 500. (The bounds stage now refuses any over 100 levels first.)

SCHEMA_NESTING = {
    "items": ('{"type": "array", "items": ', "}"),
    "anyOf": ('{"anyOf": [', "]}"),
    "$defs": ('{"$defs": {"a": ', "}}"),
    "properties": ('{"type": "object", "additionalProperties": false, "properties": {"a": ', "}}"),
}
SCHEMA_PLACES = ("tool parameters", "whole tool parameters", "json_schema")


def deep_schema_body(place: str, via: str, levels: int, stream: bool) -> tuple[bytes, dict]:
    opening, closing = SCHEMA_NESTING[via]
    schema = opening * levels + '{"type": "string"}' + closing * levels
    if place == "whole tool parameters":  # parameters must be an object schema at the top
        schema = '{"type": "object", "properties": {"x": ' + schema + "}}"
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": stream, **PLACES[place]}
    return json.dumps(request).encode().replace(json.dumps(DEEP).encode(), schema.encode()), request


@FUZZ_SETTINGS
@given(
    place=st.sampled_from(SCHEMA_PLACES),
    via=st.sampled_from(sorted(SCHEMA_NESTING)),
    levels=st.integers(min_value=1, max_value=1100),
    stream=st.booleans(),
)
@example(place="json_schema", via="items", levels=1000, stream=False)
@example(place="tool parameters", via="anyOf", levels=500, stream=False)
@example(place="json_schema", via="$defs", levels=99, stream=True)
def test_fuzz_deeply_nested_schemas(servers, place, via, levels, stream):
    raw, request = deep_schema_body(place, via, levels, stream)
    check(servers, raw, request, f"deep schema via {via}")


# --- Compressed bodies: random requests gzip'd or deflated (zlib's format, and the raw deflate
# some clients send), whole or chunked, intact or corrupted (cut short, a byte changed, or not
# compressed at all), and with encodings the gateway does not take. A body that did not decode
# was once a 500 with two tracebacks; gzip with a Content-Length never worked.

COMPRESSORS = {
    "gzip": ("gzip", gzip.compress),
    "deflate": ("deflate", zlib.compress),
    "raw deflate": ("deflate", lambda data: zlib.compress(data)[2:-4]),
}


def corrupt(data: bytes, how: str, at: int) -> bytes:
    if how == "cut short":
        return data[: at % max(len(data), 1)]
    if how == "a byte changed":
        at %= len(data)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    if how == "not compressed":
        return b'{"model": "x"}'
    return data


@FUZZ_SETTINGS
@given(
    case=REQUESTS,
    compressor=st.sampled_from(sorted(COMPRESSORS)),
    # A byte changed in raw deflate, which has no checksum, could decode to another request.
    how=st.sampled_from(["intact", "intact", "cut short", "a byte changed", "not compressed"]),
    at=st.integers(min_value=0, max_value=10_000),
    chunked=st.booleans(),
    other_encoding=st.sampled_from([None, None, None, None, "br", "zstd", "gzip, deflate", "x-gzip", "compress"]),
)
@example(
    case={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    compressor="gzip",
    how="intact",
    at=0,
    chunked=False,
    other_encoding=None,
)
@example(
    case={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    compressor="gzip",
    how="not compressed",
    at=0,
    chunked=False,
    other_encoding=None,
)
def test_fuzz_compressed_bodies(servers, case, compressor, how, at, chunked, other_encoding):
    encoding, compress = COMPRESSORS[compressor]
    if compressor == "raw deflate" and how == "a byte changed":
        how = "cut short"
    raw = corrupt(compress(json.dumps(case).encode()), how, at)
    # gzip and zlib carry a checksum: a changed byte that still decodes left the request as it was.
    check(
        servers,
        raw,
        case,
        f"{compressor} {how}",
        headers={"Content-Encoding": other_encoding or encoding},
        chunked=chunked,
    )
