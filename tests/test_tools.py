"""Tools (spec: "Tools"; issue 3, "Tools"): function tools, tool_choice and parallel_tool_calls,
tool calls in replies (streamed and not), tool history, and the spec's full tool loop with and
without thinking. Each test checks what the openai SDK client got and what the upstream received,
and covers the translation pitfalls P2-P7 and P12 of translation-notes.md."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from gateway.mock.upstream import MockUpstream, Scenario
from tests.requests_util import echo
from tests.support import KEY, MODEL, UPSTREAM_KEY, make_config

UPSTREAM_ID = re.compile(r"[a-zA-Z0-9_-]+")
UPSTREAM_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather for a city", "parameters": WEATHER_SCHEMA},
}
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME_SCHEMA}}
NOW = {"type": "function", "function": {"name": "now"}}  # no description, no parameters
TOOLS = [WEATHER, TIME]
UPSTREAM_WEATHER = {"name": "get_weather", "description": "Current weather for a city", "input_schema": WEATHER_SCHEMA}
UPSTREAM_TIME = {"name": "get_time", "description": "Local time", "input_schema": TIME_SCHEMA}
UPSTREAM_NOW = {"name": "now", "input_schema": {"type": "object", "properties": {}}}

USER = {"role": "user", "content": "What's the weather in Oslo? Use the tool."}
UPSTREAM_USER = {"role": "user", "content": [{"type": "text", "text": USER["content"]}]}
OSLO = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
OSLO_TIME = {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"timezone": "Europe/Oslo"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
async def client(gateway):
    """Caching off: what the upstream receives is the translator's work alone (test_caching
    covers the breakpoints a request gets)."""
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as c:
        yield c


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


async def ask(client: openai.AsyncOpenAI, stream: bool, **kwargs):
    """A completion, or for stream=True the one the SDK's own accumulator builds from the chunks."""
    kwargs.setdefault("model", MODEL)
    if not stream:
        return await client.chat.completions.create(**kwargs)
    state = ChatCompletionStreamState(input_tools=kwargs.get("tools", openai.omit))
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
    return state.get_final_completion()


async def refusal(client: openai.AsyncOpenAI, upstream: MockUpstream, **kwargs) -> dict:
    """The 400 error object of a refused request, after checking nothing reached the upstream."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert upstream.requests == []
    return caught.value.body


async def raw_chunks(gateway, body: dict) -> list[dict]:
    """The `chat.completion.chunk` objects of a streamed request, read as raw SSE bytes."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": True, "messages": [USER], **body},
        ) as response:
            assert response.status == 200
            text = (await response.read()).decode()
    events = [event for event in text.split("\n\n") if event and not event.startswith(":")]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event[len("data: ") :]) for event in events[:-1]]


def calls_of(completion) -> list[tuple[str, str, str, dict]]:
    """(id, type, name, parsed arguments) of each tool call in a completion."""
    return [
        (call.id, call.type, call.function.name, json.loads(call.function.arguments))
        for call in completion.choices[0].message.tool_calls or []
    ]


# --- Tool definitions.


@pytest.mark.parametrize("stream", [False, True])
async def test_function_tools_become_upstream_tools(client, upstream, stream):
    strict_weather = strict(WEATHER)
    loose_time = {**TIME, "function": {**TIME["function"], "strict": False}}
    upstream.enqueue(Scenario(blocks=[OSLO]))
    completion = await ask(client, stream, messages=[USER], tools=[strict_weather, loose_time, NOW])

    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    tools = upstream.requests[-1].body["tools"]
    assert tools[0] == {**UPSTREAM_WEATHER, "strict": True}
    assert {k: v for k, v in tools[1].items() if k != "strict"} == UPSTREAM_TIME
    assert tools[1].get("strict") in (None, False)  # strict false says nothing
    assert tools[2] == {"name": "now", "input_schema": {"type": "object", "properties": {}}}
    assert "tool_choice" not in upstream.requests[-1].body
    assert len(upstream.requests) == 1


async def test_a_complex_schema_reaches_the_upstream_unchanged(client, upstream):
    schema = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1},
            "filters": {"type": "array", "items": {"$ref": "#/$defs/filter"}},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["query"],
        "additionalProperties": False,
        "$defs": {"filter": {"type": "object", "properties": {"field": {"type": "string"}}}},
    }
    tool = {"type": "function", "function": {"name": "search", "description": "Search", "parameters": schema}}
    completion = await client.chat.completions.create(model=MODEL, messages=[USER], tools=[tool])

    assert completion.choices[0].message.content.startswith("Hello from the mock upstream.")
    assert completion.choices[0].message.content == echo(USER["content"])
    assert upstream.requests[-1].body["tools"] == [{"name": "search", "description": "Search", "input_schema": schema}]


async def test_a_tool_that_is_not_a_function_is_refused_with_its_index(client, upstream):
    custom = {"type": "custom", "custom": {"name": "grammar_tool"}}
    error = await refusal(client, upstream, messages=[USER], tools=[WEATHER, custom])
    assert error["message"] == "tools[1].type: only function tools are supported"
    assert error["code"] is None


@pytest.mark.parametrize("schema", [{"type": "array", "items": {"type": "string"}}, {"type": "string"}])
async def test_a_tool_whose_arguments_are_not_an_object_is_refused_by_name(client, upstream, schema):
    tool = {"type": "function", "function": {"name": "tags", "parameters": schema}}
    error = await refusal(client, upstream, messages=[USER], tools=[WEATHER, tool])
    assert error["message"] == 'tools[1].function.parameters: expected a schema of "type": "object"'
    assert error["param"] == "tools"


# --- tool_choice and parallel_tool_calls.


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        (NAMED, {"type": "tool", "name": "get_weather"}),
    ],
    ids=["auto", "none", "required", "named"],
)
async def test_tool_choice(client, upstream, tool_choice, expected, stream):
    upstream.enqueue(Scenario(blocks=[OSLO]))
    completion = await ask(client, stream, messages=[USER], tools=TOOLS, tool_choice=tool_choice)

    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    body = upstream.requests[-1].body
    assert body["tool_choice"] == expected
    assert body["tools"] == [UPSTREAM_WEATHER, UPSTREAM_TIME]


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("auto", False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        (NAMED, False, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}),
        ("none", False, {"type": "none"}),  # no calls at all: nothing to serialise
        (None, True, None),
        ("auto", True, {"type": "auto"}),
    ],
    ids=["default", "auto", "required", "named", "none", "default-parallel", "auto-parallel"],
)
async def test_parallel_tool_calls(client, upstream, tool_choice, parallel, expected):
    upstream.enqueue(Scenario(blocks=[OSLO]))
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    completion = await client.chat.completions.create(
        model=MODEL, messages=[USER], tools=TOOLS, parallel_tool_calls=parallel, **choice
    )

    assert completion.choices[0].finish_reason == "tool_calls"
    body = upstream.requests[-1].body
    assert body.get("tool_choice") == expected
    assert len(body["tools"]) == 2
    assert body["tools"] == [UPSTREAM_WEATHER, UPSTREAM_TIME]
    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "none", "required", NAMED], ids=["auto", "none", "required", "named"])
async def test_without_tools_tool_choice_and_parallel_tool_calls_are_ignored(client, upstream, tool_choice, stream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "No tools here."}]))
    completion = await ask(client, stream, messages=[USER], tool_choice=tool_choice, parallel_tool_calls=False)

    assert completion.choices[0].message.content == "No tools here."
    assert completion.choices[0].finish_reason == "stop"
    body = upstream.requests[-1].body
    assert "tools" not in body and "tool_choice" not in body
    assert body["messages"] == [UPSTREAM_USER]


async def test_named_tool_choice_must_name_one_of_the_tools(client, upstream):
    choice = {"type": "function", "function": {"name": "get_stock_price"}}
    error = await refusal(client, upstream, messages=[USER], tools=TOOLS, tool_choice=choice)
    assert error["message"].startswith("tool_choice.function.name: ")
    assert error["message"] == "tool_choice.function.name: expected the name of one of the tools"
    assert error["param"] == "tool_choice"


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
async def test_model_without_forced_tool_choice_refuses_forcing(start_gateway, upstream, tool_choice):
    gateway = await start_gateway(make_config(upstream.url, forced_tool_choice=False))
    async with gateway.client() as client:
        error = await refusal(client, upstream, messages=[USER], tools=TOOLS, tool_choice=tool_choice)
    assert error["message"].startswith("tool_choice: ")
    assert error["message"] == 'tool_choice: this model cannot be forced to call a tool; use "auto"'
    assert error["param"] == "tool_choice"
    assert error["code"] is None


@pytest.mark.parametrize("tool_choice", ["auto", "none", None], ids=["auto", "none", "unset"])
async def test_model_without_forced_tool_choice_accepts_auto(start_gateway, upstream, tool_choice):
    gateway = await start_gateway(make_config(upstream.url, forced_tool_choice=False))
    upstream.enqueue(Scenario(blocks=[OSLO]))
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    async with gateway.client() as client:
        completion = await client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, **choice)

    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    body = upstream.requests[-1].body
    assert body.get("tool_choice") == (None if tool_choice is None else {"type": tool_choice})


async def test_model_without_forced_tool_choice_ignores_required_without_tools(start_gateway, upstream):
    gateway = await start_gateway(make_config(upstream.url, forced_tool_choice=False))
    async with gateway.client() as client:
        completion = await client.chat.completions.create(model=MODEL, messages=[USER], tool_choice="required")
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == echo(USER["content"])
    assert "tool_choice" not in upstream.requests[-1].body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
async def test_thinking_is_not_requested_when_tool_choice_forces_a_tool(client, upstream, tool_choice, stream):
    upstream.enqueue(Scenario(blocks=[OSLO]))
    completion = await ask(
        client, stream, messages=[USER], tools=TOOLS, tool_choice=tool_choice, reasoning_effort="high"
    )

    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    body = upstream.requests[-1].body
    assert "thinking" not in body
    assert body["output_config"] == {"effort": "high"}
    assert body["tool_choice"]["type"] in ("any", "tool")
    assert body["tool_choice"] == (
        {"type": "any"} if tool_choice == "required" else {"type": "tool", "name": "get_weather"}
    )
    assert len(upstream.requests) == 1  # the upstream (which forbids thinking here) accepted it


async def test_thinking_is_requested_with_tool_choice_auto(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "thinking", "thinking": "Use the tool.", "signature": "sig"}, OSLO]))
    completion = await client.chat.completions.create(
        model=MODEL, messages=[USER], tools=TOOLS, tool_choice="auto", reasoning_effort="high"
    )
    assert calls_of(completion) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    assert completion.choices[0].message.content is None  # the thinking text is not returned
    body = upstream.requests[-1].body
    assert body["thinking"] == {"type": "adaptive"}
    assert body["output_config"] == {"effort": "high"}


# --- Tool calls in a non-streamed reply.


async def test_reply_with_a_tool_call(client, upstream):
    upstream.enqueue(Scenario(blocks=[OSLO]))
    completion = await client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER])

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id == "toolu_1"
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, str)
    assert call.function.arguments == '{"city":"Oslo"}'
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert upstream.requests[-1].body["tools"] == [UPSTREAM_WEATHER]


async def test_reply_with_text_and_two_tool_calls(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Let me check both."}, OSLO, OSLO_TIME]))
    completion = await client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS)

    choice = completion.choices[0]
    assert choice.message.content == "Let me check both."
    assert choice.finish_reason == "tool_calls"
    assert calls_of(completion) == [
        ("toolu_1", "function", "get_weather", {"city": "Oslo"}),
        ("toolu_2", "function", "get_time", {"timezone": "Europe/Oslo"}),
    ]
    assert upstream.requests[-1].body["tools"] == [UPSTREAM_WEATHER, UPSTREAM_TIME]


# --- Tool calls in a streamed reply.


@pytest.mark.parametrize(
    "before",
    [
        [],
        [{"type": "text", "text": "Let me check both."}],
        [{"type": "thinking", "thinking": "Two tools.", "signature": "sig"}, {"type": "text", "text": "Checking."}],
    ],
    ids=["tools-only", "text-first", "thinking-and-text-first"],
)
async def test_raw_stream_of_two_parallel_calls(gateway, upstream, before):
    upstream.enqueue(Scenario(blocks=[*before, OSLO, OSLO_TIME], chunk_size=3))
    chunks = await raw_chunks(gateway, {"tools": TOOLS})

    assert upstream.requests[-1].body["stream"] is True
    assert upstream.requests[-1].body["tools"] == [UPSTREAM_WEATHER, UPSTREAM_TIME]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("role" not in d for d in deltas[1:])  # P3: role is sent once
    # P2: each call has its own index, 0 then 1, counting tool calls only, with no gaps.
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert all(len(d.get("tool_calls", [])) <= 1 for d in deltas)
    indexes = [entry["index"] for entry in entries]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    # Text (if any) comes before the first call.
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "".join(b.get("text", "") for b in before)
    assert all(not d.get("content") for d in deltas[first_call:])
    for index, block in enumerate([OSLO, OSLO_TIME]):
        head, *rest = [entry for entry in entries if entry["index"] == index]
        # The first delta of a call carries id, type and name, with arguments "".
        assert head == {
            "index": index,
            "id": block["id"],
            "type": "function",
            "function": {"name": block["name"], "arguments": ""},
        }
        # P3: then only arguments, in pieces; id, type and name are never repeated.
        assert len(rest) > 1
        assert all(entry.keys() == {"index", "function"} for entry in rest)
        assert all(entry["function"].keys() == {"arguments"} for entry in rest)
        assert json.loads("".join(entry["function"]["arguments"] for entry in rest)) == block["input"]
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {}
    assert last["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_sdk_stream_helper_accumulates_the_exact_calls(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Let me check both."}, OSLO, OSLO_TIME], chunk_size=2))
    tools = [strict(WEATHER), strict(TIME)]
    async with client.chat.completions.stream(model=MODEL, messages=[USER], tools=tools) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_completion()

    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.role == "assistant"  # a repeated role would be concatenated
    assert message.content == "Let me check both."
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("toolu_1", "function", "get_weather", '{"city":"Oslo"}'),
        ("toolu_2", "function", "get_time", '{"timezone":"Europe/Oslo"}'),
    ]
    assert [c.function.parsed_arguments for c in message.tool_calls] == [OSLO["input"], OSLO_TIME["input"]]
    done = [(e.name, e.index, e.parsed_arguments) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done == [("get_weather", 0, OSLO["input"]), ("get_time", 1, OSLO_TIME["input"])]
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 4  # arguments arrived in pieces
    assert upstream.requests[-1].body["tools"] == [
        {**UPSTREAM_WEATHER, "strict": True},
        {**UPSTREAM_TIME, "strict": True},
    ]


class NoArgumentDeltas(MockUpstream):
    """An upstream that streams no input_json_delta at all for a tool called without arguments."""

    @staticmethod
    def _events(message: dict, sc: Scenario) -> list[dict]:
        return [
            event
            for event in MockUpstream._events(message, sc)
            if event.get("delta", {}).get("type") != "input_json_delta"
        ]


@pytest.mark.parametrize("deltas", ["empty-json-delta", "no-delta"])
async def test_a_call_without_arguments_streams_empty_object(start_gateway, upstream, deltas):
    mock = upstream
    if deltas == "no-delta":
        mock = NoArgumentDeltas(api_key=UPSTREAM_KEY)
        await mock.start()
    try:
        gateway = await start_gateway(make_config(mock.url))
        mock.enqueue(Scenario(blocks=[{"type": "tool_use", "id": "toolu_9", "name": "now", "input": {}}]))
        chunks = await raw_chunks(gateway, {"tools": [NOW]})
        mock.enqueue(Scenario(blocks=[{"type": "tool_use", "id": "toolu_9", "name": "now", "input": {}}]))
        async with gateway.client() as client:
            final = await ask(client, True, messages=[USER], tools=[NOW])
    finally:
        if mock is not upstream:
            await mock.close()

    entries = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["function"] == {"name": "now", "arguments": ""}
    # P7: exactly "{}", not nothing, and not a placeholder prepended to the upstream's "{}".
    assert "".join(e["function"]["arguments"] for e in entries) == "{}"
    assert {e["index"] for e in entries} == {0}
    [call] = final.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_9", "now", "{}")
    assert final.choices[0].finish_reason == "tool_calls"
    assert mock.requests[-1].body["tools"] == [UPSTREAM_NOW]


async def test_a_call_without_arguments_non_streamed(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "tool_use", "id": "toolu_9", "name": "now", "input": {}}]))
    completion = await client.chat.completions.create(model=MODEL, messages=[USER], tools=[NOW])
    [call] = completion.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_9", "now", "{}")
    assert upstream.requests[-1].body["tools"] == [UPSTREAM_NOW]


async def test_sdk_stream_of_text_then_call(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "One moment."}, OSLO], chunk_size=2))
    stream = await client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER], stream=True)
    chunks = [chunk async for chunk in stream]

    deltas = [c.choices[0].delta for c in chunks]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "One moment."
    head = deltas[first_call].tool_calls[0]
    assert (head.index, head.id, head.type, head.function.name, head.function.arguments) == (
        0,
        "toolu_1",
        "function",
        "get_weather",
        "",
    )
    rest = [d.tool_calls[0] for d in deltas[first_call + 1 :] if d.tool_calls]
    assert all(c.id is None and c.type is None and c.function.name is None for c in rest)
    assert "".join(c.function.arguments for c in rest) == '{"city":"Oslo"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- Tool history sent back by the client.


def assistant_call(call_id: str = "toolu_1", name: str = "get_weather", arguments: str = '{"city":"Oslo"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result(call_id: str = "toolu_1", content: str = "9°C and clear") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def result_block(call_id: str, text: str) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": text}]}


TIME_CALL = assistant_call("toolu_2", "get_time", '{"timezone":"Europe/Oslo"}')


@pytest.mark.parametrize("stream", [False, True])
async def test_history_text_and_tool_calls_become_text_then_tool_use(client, upstream, stream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "9°C, and 14:00."}]))
    messages = [
        USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [assistant_call(), TIME_CALL],
        },
        result(),
        result("toolu_2", "14:00"),
    ]
    completion = await ask(client, stream, messages=messages, tools=TOOLS)

    assert completion.choices[0].message.content == "9°C, and 14:00."
    assert completion.choices[0].finish_reason == "stop"
    assert upstream.requests[-1].body["messages"] == [
        UPSTREAM_USER,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, OSLO, OSLO_TIME]},
        {
            "role": "user",
            "content": [
                result_block("toolu_1", "9°C and clear"),
                result_block("toolu_2", "14:00"),
            ],
        },
    ]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(
    "content",
    ["", None, " \n", [{"type": "text", "text": ""}]],
    ids=["empty", "null", "whitespace", "empty-part"],
)
async def test_history_empty_assistant_text_with_tool_calls_sends_no_text_block(client, upstream, content):
    messages = [USER, {"role": "assistant", "content": content, "tool_calls": [assistant_call()]}, result()]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)

    assert completion.choices[0].finish_reason == "stop"
    sent = upstream.requests[-1].body["messages"]
    assert sent[1] == {"role": "assistant", "content": [OSLO]}  # P6: no empty text block
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("arguments", ["", "{}", "  "], ids=["empty", "empty-object", "whitespace"])
async def test_history_empty_arguments_become_empty_input(client, upstream, arguments):
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [assistant_call("toolu_9", "now", arguments)]},
        result("toolu_9", "14:00"),
    ]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=[NOW])

    assert completion.choices[0].finish_reason == "stop"
    sent = upstream.requests[-1].body["messages"]
    assert sent[1]["content"] == [{"type": "tool_use", "id": "toolu_9", "name": "now", "input": {}}]  # P7


@pytest.mark.parametrize("arguments", ['{"city": "Oslo"', "city=Oslo", "[1, 2]", '"Oslo"'])
async def test_history_arguments_that_are_not_a_json_object_are_refused(client, upstream, arguments):
    messages = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [assistant_call(), assistant_call("toolu_2", arguments=arguments)],
        },
        result(),
        result("toolu_2"),
    ]
    error = await refusal(client, upstream, messages=messages, tools=TOOLS)
    assert error["message"].startswith("messages[1].tool_calls[1].function.arguments: ")
    assert error["code"] is None


@pytest.mark.parametrize(
    "order",
    [("tool", "tool", "user"), ("tool", "user", "tool"), ("user", "tool", "tool")],
    ids=["results-then-text", "text-between-results", "text-then-results"],
)
async def test_history_tool_results_travel_together_before_text(client, upstream, order):
    tail = iter([result(), result("toolu_2", "14:00")])
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [assistant_call(), TIME_CALL]},
        *[next(tail) if role == "tool" else {"role": "user", "content": "Thanks, and be brief."} for role in order],
    ]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)

    assert completion.choices[0].finish_reason == "stop"
    assert upstream.requests[-1].body["messages"][1:] == [
        {"role": "assistant", "content": [OSLO, OSLO_TIME]},
        {
            "role": "user",
            "content": [
                result_block("toolu_1", "9°C and clear"),
                result_block("toolu_2", "14:00"),
                {"type": "text", "text": "Thanks, and be brief."},
            ],
        },
    ]
    assert len(upstream.requests) == 1


async def test_history_foreign_tool_ids_are_rewritten_on_both_sides(client, upstream):
    ids = ["functions.Bash:0", "call:abc.def", "toolu_01Abc-_"]
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [assistant_call(i) for i in ids]},
        *[result(i, f"result {n}") for n, i in enumerate(ids)],
    ]
    for _ in range(2):
        completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert completion.choices[0].finish_reason == "stop"
    assert len(upstream.requests) == 2  # the upstream accepted both

    first, second = (r.body["messages"] for r in upstream.requests)
    assert first == second  # deterministic: every turn of a conversation rewrites the same way
    uses = [block["id"] for block in first[1]["content"]]
    results = [block["tool_use_id"] for block in first[2]["content"]]
    assert uses == results  # P5: identical on tool_use.id and tool_result.tool_use_id
    assert all(UPSTREAM_ID.fullmatch(i) for i in uses)
    assert len(set(uses)) == 3
    assert uses[2] == "toolu_01Abc-_"  # a valid id is left alone


async def test_history_ids_that_differ_only_in_unsafe_characters_stay_distinct(client, upstream):
    ids = ["call.1", "call:1"]
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [assistant_call(i) for i in ids]},
        *[result(i) for i in ids],
    ]
    await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    uses = [block["id"] for block in upstream.requests[-1].body["messages"][1]["content"]]
    assert len(set(uses)) == 2 and all(UPSTREAM_ID.fullmatch(i) for i in uses)


# --- Tool names the upstream does not accept (MCP style).

MCP_NAMES = ["github.search/issues", "fs.read", "a.b", "a/b"]
MCP_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"MCP tool {name}", "parameters": WEATHER_SCHEMA}}
    for name in MCP_NAMES
]


async def upstream_names(client, upstream) -> dict[str, str]:
    """client name → the name the upstream was sent, learnt from one plain request."""
    await client.chat.completions.create(model=MODEL, messages=[USER], tools=MCP_TOOLS)
    tools = upstream.requests[-1].body["tools"]
    assert [t["description"] for t in tools] == [f"MCP tool {name}" for name in MCP_NAMES]
    assert all(t["input_schema"] == WEATHER_SCHEMA for t in tools)
    return dict(zip(MCP_NAMES, (t["name"] for t in tools)))


async def test_mcp_tool_names_are_sanitized_upstream(client, upstream):
    names = await upstream_names(client, upstream)
    assert all(UPSTREAM_NAME.fullmatch(name) for name in names.values())
    assert len(set(names.values())) == len(MCP_NAMES)  # "a.b" and "a/b" do not collide
    assert names == await upstream_names(client, upstream)  # the same on every request

    choice = {"type": "function", "function": {"name": "github.search/issues"}}
    await client.chat.completions.create(model=MODEL, messages=[USER], tools=MCP_TOOLS, tool_choice=choice)
    assert upstream.requests[-1].body["tool_choice"] == {"type": "tool", "name": names["github.search/issues"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_mcp_tool_names_come_back_under_the_original_name(client, upstream, stream):
    names = await upstream_names(client, upstream)
    blocks = [
        {"type": "tool_use", "id": "toolu_1", "name": names["github.search/issues"], "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_2", "name": names["a/b"], "input": {"city": "Bergen"}},
    ]
    upstream.enqueue(Scenario(blocks=blocks, chunk_size=3))
    completion = await ask(client, stream, messages=[USER], tools=MCP_TOOLS)

    assert completion.choices[0].finish_reason == "tool_calls"
    assert calls_of(completion) == [
        ("toolu_1", "function", "github.search/issues", {"city": "Oslo"}),
        ("toolu_2", "function", "a/b", {"city": "Bergen"}),
    ]


async def test_mcp_tool_names_in_the_raw_stream(gateway, client, upstream):
    names = await upstream_names(client, upstream)
    upstream.enqueue(Scenario(blocks=[{**OSLO, "name": names["fs.read"]}], chunk_size=3))
    chunks = await raw_chunks(gateway, {"tools": MCP_TOOLS})
    entries = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "fs.read"
    assert all("name" not in e["function"] for e in entries[1:])


async def test_mcp_tool_names_in_history_use_the_upstream_name(client, upstream):
    names = await upstream_names(client, upstream)
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [assistant_call(name="github.search/issues")]},
        result(),
    ]
    completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=MCP_TOOLS)

    assert completion.choices[0].finish_reason == "stop"
    body = upstream.requests[-1].body
    assert body["messages"][1]["content"] == [{**OSLO, "name": names["github.search/issues"]}]
    assert body["tools"][0]["name"] == names["github.search/issues"]


# --- The spec's tool loop, exactly as its Python example.

ANSWER = "It is 9°C and clear in Oslo."
LOOP_TOOLS = [WEATHER]
THINKING = {"type": "thinking", "thinking": "The user wants the weather; call the tool.", "signature": "sig"}


def loop_request(messages: list, effort: dict) -> dict:
    return {"model": MODEL, "max_tokens": 64, "messages": messages, "tools": LOOP_TOOLS, **effort}


def answer_tool_calls(messages: list, first) -> bool:
    """The spec's middle step: send the reply and a result for each call back, if there are calls."""
    if first.choices[0].finish_reason != "tool_calls":
        return False
    reply = first.choices[0].message
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "9°C and clear"})
    return True


def sync_tool_loop(client: openai.OpenAI, effort: dict) -> tuple:
    messages = [{"role": "user", "content": "What's the weather in Oslo? Use the tool."}]
    first = client.chat.completions.create(**loop_request(messages, effort))
    second = None
    if answer_tool_calls(messages, first):
        second = client.chat.completions.create(**loop_request(messages, effort))
    return first, second


async def async_tool_loop(client: openai.AsyncOpenAI, effort: dict) -> tuple:
    messages = [{"role": "user", "content": "What's the weather in Oslo? Use the tool."}]
    first = await client.chat.completions.create(**loop_request(messages, effort))
    second = None
    if answer_tool_calls(messages, first):
        second = await client.chat.completions.create(**loop_request(messages, effort))
    return first, second


@pytest.mark.parametrize("effort", [None, "high"], ids=["plain", "reasoning-high"])
@pytest.mark.parametrize("sdk", ["sync", "async"])
async def test_spec_tool_loop(gateway, upstream, sdk, effort):
    first_blocks = [THINKING, OSLO] if effort else [OSLO]
    upstream.enqueue(Scenario(blocks=first_blocks), Scenario(blocks=[{"type": "text", "text": ANSWER}]))
    options = {"reasoning_effort": effort} if effort else {}
    if sdk == "sync":
        with gateway.sync_client() as sync:
            first, second = await asyncio.to_thread(sync_tool_loop, sync, options)
    else:
        async with gateway.client() as client:
            first, second = await async_tool_loop(client, options)

    # The client's view: a tool call, then the answer.
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.content is None
    assert calls_of(first) == [("toolu_1", "function", "get_weather", {"city": "Oslo"})]
    assert second is not None
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop"

    # The upstream's view: two requests, both accepted (a rejected one would be recorded too).
    assert len(upstream.requests) == 2
    call, answer = (r.body for r in upstream.requests)
    assert call["tools"] == answer["tools"] == [UPSTREAM_WEATHER]
    assert call["max_tokens"] == answer["max_tokens"] == 64
    assert call["messages"] == [UPSTREAM_USER]
    assert answer["messages"] == [
        UPSTREAM_USER,
        {"role": "assistant", "content": [OSLO]},  # the client cannot send thinking back
        {
            "role": "user",
            "content": [result_block("toolu_1", "9°C and clear")],
        },
    ]
    if effort:
        assert call["thinking"] == {"type": "adaptive"}
        assert call["output_config"] == {"effort": "high"}
        # The gateway's decision: the turn that answers a tool call made without the thinking
        # blocks the upstream would require runs without thinking, at the same effort.
        assert "thinking" not in answer
        assert answer["output_config"] == {"effort": "high"}
    else:
        assert "thinking" not in call and "thinking" not in answer
        assert "output_config" not in call and "output_config" not in answer


async def test_thinking_returns_once_the_tool_loop_is_over(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Tomorrow: rain."}]))
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [assistant_call()]},
        result(),
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And tomorrow?"},
    ]
    completion = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=LOOP_TOOLS, reasoning_effort="high"
    )

    assert completion.choices[0].message.content == "Tomorrow: rain."
    body = upstream.requests[-1].body
    assert body["thinking"] == {"type": "adaptive"}  # the last assistant turn calls no tool
    assert body["output_config"] == {"effort": "high"}
    assert body["messages"][-2:] == [
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert len(upstream.requests) == 1
