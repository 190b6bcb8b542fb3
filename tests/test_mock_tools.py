"""The mock upstream calls a tool when a request asks for one and no scenario is scripted (what
`make demo` answers with): a forced `tool_choice`, or a tool the last user message names. Read
through a real gateway with the official `openai` SDK (Chat Completions: `tool_calls`) and the
official `anthropic` SDK (the Messages API: a `tool_use` block), streamed and not."""

from __future__ import annotations

import json

import anthropic
import openai
import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from gateway.mock.upstream import Scenario, output_tokens
from tests.requests_util import echo
from tests.support import KEY, MODEL

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])

TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
# Every kind of property, all required but `note`: the call's arguments show what each becomes.
FORECAST_PROPERTIES = {
    "city": {"type": "string"},
    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 3, "maximum": 10},
    "threshold": {"type": "number"},
    "hourly": {"type": "boolean"},
    "sources": {"type": "array", "items": {"type": "string", "enum": ["radar", "satellite"]}},
    "extras": {"type": "array"},
    "where": {
        "type": "object",
        "properties": {"lat": {"type": "number", "minimum": -90}, "label": {"type": "string"}},
        "required": ["lat"],
    },
    "country": {"type": ["null", "string"]},
    "api": {"type": "string", "const": "v2"},
    "cursor": {"type": "null"},
    "note": {"type": "string"},
}
FORECAST_SCHEMA = {
    "type": "object",
    "properties": FORECAST_PROPERTIES,
    "required": [name for name in FORECAST_PROPERTIES if name != "note"],
}
GET_TIME = {"name": "get_time", "description": "Local time", "input_schema": TIME_SCHEMA}
FORECAST = {"name": "get_forecast", "description": "The weather to come", "input_schema": FORECAST_SCHEMA}
TOOLS = [GET_TIME, FORECAST]
FUNCTIONS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS
]
FORCE_FORECAST = {"type": "function", "function": {"name": "get_forecast"}}


def assert_forecast_arguments(arguments: dict) -> None:
    """The required properties of FORECAST_SCHEMA, each of its type (enum and const values as
    given, minimums kept), and not the optional one."""
    assert set(arguments) == set(FORECAST_SCHEMA["required"])
    assert isinstance(arguments["city"], str) and arguments["city"]
    assert isinstance(arguments["country"], str)  # the first type that is not null
    assert set(arguments["where"]) == {"lat"} and isinstance(arguments["where"]["lat"], (int, float))
    assert isinstance(arguments["threshold"], (int, float)) and not isinstance(arguments["threshold"], bool)
    rest = {k: arguments[k] for k in ("units", "days", "hourly", "sources", "extras", "api", "cursor")}
    assert rest == {
        "units": "celsius",
        "days": 3,
        "hourly": True,
        "sources": ["radar"],
        "extras": [],
        "api": "v2",
        "cursor": None,
    }


async def complete(client: openai.AsyncOpenAI, stream: bool, **kwargs):
    """A completion, or for stream=True the one the SDK's own accumulator builds from the chunks."""
    kwargs.setdefault("model", MODEL)
    if not stream:
        return await client.chat.completions.create(**kwargs)
    state = ChatCompletionStreamState(input_tools=kwargs.get("tools", openai.omit))
    async for chunk in await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture
async def claude(gateway):
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as c:
        yield c


# --- Chat Completions: tool_calls.


@STREAM
@pytest.mark.parametrize(
    ("tool_choice", "called"), [("required", "get_time"), (FORCE_FORECAST, "get_forecast")], ids=["required", "named"]
)
async def test_a_forced_tool_choice_gets_a_tool_call(client, stream, tool_choice, called):
    completion = await complete(client, stream, messages=ask("Hi"), tools=FUNCTIONS, tool_choice=tool_choice)

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == called
    assert call.id.startswith("toolu_mock_")
    arguments = json.loads(call.function.arguments)
    if called == "get_time":
        assert set(arguments) == {"timezone"} and isinstance(arguments["timezone"], str)
    else:
        assert_forecast_arguments(arguments)
    # Counted as the mock counts what it wrote: the arguments' JSON.
    assert completion.usage.completion_tokens == output_tokens(orjson.dumps(arguments).decode())


@STREAM
async def test_a_tool_the_user_names_is_called(client, stream):
    completion = await complete(
        client, stream, messages=ask("What's it like in Oslo? Use get_forecast."), tools=FUNCTIONS
    )

    assert completion.choices[0].finish_reason == "tool_calls"
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "get_forecast"
    assert_forecast_arguments(json.loads(call.function.arguments))


async def test_of_two_tools_named_the_first_named_is_called(client):
    completion = await complete(client, False, messages=ask("Run get_forecast, then get_time."), tools=FUNCTIONS)
    assert [call.function.name for call in completion.choices[0].message.tool_calls] == ["get_forecast"]


@pytest.mark.parametrize(
    "text",
    ["What's the weather in Oslo?", "Is get_times a tool?", "my_get_time is not one either"],
    ids=["unnamed", "longer-word", "inside-a-word"],
)
async def test_a_message_that_names_no_tool_gets_text(client, text):
    completion = await complete(client, False, messages=ask(text), tools=FUNCTIONS)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == echo(text) and not completion.choices[0].message.tool_calls


@STREAM
async def test_tool_choice_none_never_calls_one(client, stream):
    text = "Use get_time."
    completion = await complete(client, stream, messages=ask(text), tools=FUNCTIONS, tool_choice="none")
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == echo(text) and not completion.choices[0].message.tool_calls


async def test_the_tool_loop_ends_with_an_answer(client):
    """The call's result answers the turn that named the tool: the next reply is text, not
    another call, so an agent looping until it gets text stops."""
    messages = ask("Use get_time for Oslo.")
    first = await complete(client, False, messages=messages, tools=FUNCTIONS)
    [call] = first.choices[0].message.tool_calls
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "14:05"},
    ]
    second = await complete(client, False, messages=messages, tools=FUNCTIONS)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.choices[0].message.content == "Hello from the mock upstream. The tool get_time returned: 14:05"


async def test_a_tool_without_parameters_is_called_with_none(client):
    now = {"type": "function", "function": {"name": "now"}}
    completion = await complete(client, False, messages=ask("What time is it? Call now."), tools=[now])
    [call] = completion.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("now", "{}")


class Place(BaseModel):
    city: str
    population: int


class Trip(BaseModel):
    destination: Place
    stops: list[Place]
    nights: int | None
    direct: bool


async def test_arguments_validate_against_the_pydantic_model_of_the_tool(client):
    """The SDK's own schema for a Pydantic model ($defs and $ref, anyOf with null): the call's
    arguments are a valid instance of it."""
    tool = openai.pydantic_function_tool(Trip, name="plan_trip")
    completion = await complete(client, False, messages=ask("Plan it"), tools=[tool], tool_choice="required")
    [call] = completion.choices[0].message.tool_calls
    trip = Trip.model_validate_json(call.function.arguments)
    assert len(trip.stops) == 1 and isinstance(trip.nights, int) and trip.direct is True


@STREAM
async def test_a_scripted_scenario_keeps_priority(client, upstream, stream):
    upstream.enqueue(Scenario(), Scenario(blocks=[{"type": "text", "text": "Scripted."}]))
    for expected in (echo("Use get_time."), "Scripted."):
        completion = await complete(
            client, stream, messages=ask("Use get_time."), tools=FUNCTIONS, tool_choice="required"
        )
        assert completion.choices[0].finish_reason == "stop"
        assert completion.choices[0].message.content == expected


# --- The Messages API: a tool_use block.


@pytest.mark.parametrize(
    ("fields", "called"),
    [
        ({"tool_choice": {"type": "any"}}, "get_time"),
        ({"tool_choice": {"type": "tool", "name": "get_forecast"}}, "get_forecast"),
        ({"tool_choice": {"type": "auto"}, "messages": ask("Use get_forecast for Oslo")}, "get_forecast"),
        ({"messages": ask("Use get_forecast for Oslo")}, "get_forecast"),
    ],
    ids=["any", "tool", "auto-named", "named"],
)
async def test_a_message_calls_the_tool(claude, fields, called):
    message = await claude.messages.create(
        model=MODEL, max_tokens=1000, tools=TOOLS, **{"messages": ask("Hi"), **fields}
    )

    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert (block.type, block.name) == ("tool_use", called) and block.id.startswith("toolu_mock_")
    if called == "get_forecast":
        assert_forecast_arguments(block.input)
    assert message.usage.output_tokens == output_tokens(orjson.dumps(block.input).decode())


async def test_a_streamed_message_sends_the_input_as_json_deltas(claude):
    async with claude.messages.stream(
        model=MODEL,
        max_tokens=1000,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_forecast"},
        messages=ask("Hi"),
    ) as stream:
        events = [event async for event in stream]
        message = await stream.get_final_message()

    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    assert start.content_block.id == message.content[0].id and start.content_block.name == "get_forecast"
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(fragments) > 2 and all(
        e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta"
    )
    assert json.loads("".join(fragments)) == message.content[0].input
    assert [e.type for e in events if e.type in ("content_block_stop", "message_delta", "message_stop")] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "tool_use" and message.stop_reason == "tool_use"
    assert_forecast_arguments(message.content[0].input)


async def test_tool_choice_none_gets_text_on_the_messages_api(claude):
    message = await claude.messages.create(
        model=MODEL, max_tokens=100, tools=TOOLS, tool_choice={"type": "none"}, messages=ask("Use get_time.")
    )
    assert message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == echo("Use get_time.")


async def test_with_thinking_the_call_comes_after_thinking_and_goes_back_accepted(claude):
    """As the real API answers with thinking on, so the turn can be sent back: an assistant
    turn that calls a tool must start with its thinking then."""
    messages = ask("Use get_time for Oslo.")
    first = await claude.messages.create(
        model=MODEL, max_tokens=2000, tools=TOOLS, thinking={"type": "adaptive"}, messages=messages
    )
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id, "content": "14:05"}]},
    ]
    second = await claude.messages.create(
        model=MODEL, max_tokens=2000, tools=TOOLS, thinking={"type": "adaptive"}, messages=messages
    )
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
