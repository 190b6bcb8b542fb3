"""Every row of the spec's field tables, through the official openai SDK, streamed and not:
messages and content parts, reasoning_effort, sampling, output length and format, finish reasons
and usage. Each test checks what the client got and what the mock upstream received (a refused
request must not reach the upstream at all)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from gateway.mock.upstream import Scenario
from tests.requests_util import WEATHER_TOOLS as TOOLS
from tests.requests_util import echo
from tests.support import MODEL, make_config

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])

IMAGES = {  # a few real leading bytes of each format, base64
    "image/jpeg": "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAgGBgcGBQgHBwcJCQgKDBQNDAsLDBkSEw8U",
    "image/png": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk",
    "image/gif": "R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7",
    "image/webp": "UklGRiQAAABXRUJQVlA4IBgAAAAwAQCdASoBAAEAAwA0JaQAA3AA/vuUAAA=",
}
PDF = "JVBERi0xLjQKJcOkw7zDtsOfCjEgMCBvYmoKPDwvVHlwZS9DYXRhbG9nPj4KZW5kb2JqCg=="
THOUGHT = "SECRET-CHAIN-OF-THOUGHT: the user wants a haiku"


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def user(*blocks: dict) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks: dict) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


@dataclass
class Answer:
    """What the client got, the same for a completion and a stream."""

    content: str | None
    finish_reason: str | None
    usage: Any
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    dump: str = ""  # everything the SDK handed back, as JSON text


async def ask(client: openai.AsyncOpenAI, stream: bool, **kwargs) -> Answer:
    """One request through the SDK; a stream asks for usage and is read to its end."""
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", [{"role": "user", "content": "Hi"}])
    if not stream:
        completion = await client.chat.completions.create(**kwargs)
        assert len(completion.choices) == 1
        choice = completion.choices[0]
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return Answer(
            choice.message.content, choice.finish_reason, completion.usage, calls, completion.model_dump_json()
        )

    chunks = [
        c
        async for c in await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    ]
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in choice_chunks)
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert finishes[:-1] == [None] * (len(finishes) - 1)  # only the last choice chunk finishes
    assert choice_chunks[-1].choices[0].delta.content is None and not choice_chunks[-1].choices[0].delta.tool_calls
    content = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in choice_chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "type": "", "function": {"name": "", "arguments": ""}})
            call["id"] += delta.id or ""
            call["type"] += delta.type or ""
            call["function"]["name"] += delta.function.name or ""
            call["function"]["arguments"] += delta.function.arguments or ""
    dump = "[" + ",".join(c.model_dump_json() for c in chunks) + "]"
    return Answer(content, finishes[-1], usage_chunk.usage, [calls[i] for i in sorted(calls)], dump)


async def refused(client: openai.AsyncOpenAI, upstream, stream: bool, **kwargs) -> dict[str, Any]:
    """The error object of a request the gateway must answer with 400 invalid_request_error,
    once it is checked that the upstream received nothing and that `param` names the field the
    message's path starts with."""
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(client, stream, **kwargs)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert error["code"] is None
    assert error["param"] == re.split(r"[.\[:]", error["message"], maxsplit=1)[0]
    assert upstream.requests == []
    return error


def received(upstream, stream: bool) -> dict[str, Any]:
    """The last body the upstream received, once its `stream` flag is checked."""
    body = dict(upstream.requests[-1].body)
    assert body.pop("stream", False) is stream
    return body


@pytest.fixture
async def client(gateway):
    """Caching off: what the upstream receives is the translator's work alone (test_caching
    covers the breakpoints a request gets)."""
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as c:
        yield c


@pytest.fixture
async def start_client(start_gateway, upstream):
    """A client of a gateway whose model has the given fields (see `make_config`)."""
    clients: list[openai.AsyncOpenAI] = []

    async def start(**model_fields) -> openai.AsyncOpenAI:
        gateway = await start_gateway(make_config(upstream.url, **model_fields))
        clients.append(gateway.client())
        return clients[-1]

    yield start
    for c in clients:
        await c.close()


# --- Messages ------------------------------------------------------------------------------


@STREAM
async def test_system_and_developer_anywhere_join_into_one_system_prompt(client, upstream, stream):
    upstream.enqueue(Scenario(blocks=[text("Colour.")]))
    answer = await ask(
        client,
        stream,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": [text("Use British spelling."), text("No emoji.")]},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Color?"},
            {"role": "system", "content": "Last rule."},
        ],
    )
    assert answer.content == "Colour."
    body = received(upstream, stream)
    assert body["system"] == [
        text("Be brief."),
        text("Use British spelling."),
        text("No emoji."),
        text("Answer in one word."),
        text("Last rule."),
    ]
    assert body["messages"] == [user(text("Hi")), assistant(text("Hello.")), user(text("Color?"))]


@STREAM
@pytest.mark.parametrize("role", ["system", "developer"])
@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMAGES["image/png"]}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64," + PDF}},
        {"type": "refusal", "refusal": "no"},
    ],
    ids=["image_url", "file", "refusal"],
)
async def test_a_non_text_part_in_a_system_message_names_the_path(client, upstream, stream, role, part):
    error = await refused(
        client,
        upstream,
        stream,
        messages=[{"role": "user", "content": "Hi"}, {"role": role, "content": [text("Be brief."), part]}],
    )
    assert error["message"].startswith("messages[1].content[1]")


@STREAM
async def test_user_string_and_text_parts(client, upstream, stream):
    answer = await ask(
        client,
        stream,
        messages=[
            {"role": "user", "content": "First"},
            {"role": "assistant", "content": "Ok"},
            {"role": "user", "content": [text("Second"), text("Third")]},
        ],
    )
    assert answer.content == echo("Second\nThird")
    assert received(upstream, stream)["messages"] == [
        user(text("First")),
        assistant(text("Ok")),
        user(text("Second"), text("Third")),
    ]


@STREAM
@pytest.mark.parametrize("media_type", list(IMAGES))
async def test_image_data_url_becomes_a_base64_image_source(client, upstream, stream, media_type):
    data = IMAGES[media_type]
    answer = await ask(
        client,
        stream,
        messages=[
            {
                "role": "user",
                "content": [
                    text("What is in this image?"),
                    {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}},
                ],
            }
        ],
    )
    assert answer.content == echo("What is in this image?")
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    assert received(upstream, stream)["messages"] == [user(text("What is in this image?"), image)]


@STREAM
async def test_image_detail_is_ignored(client, upstream, stream):
    url = "data:image/png;base64," + IMAGES["image/png"]
    await ask(
        client,
        stream,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
                    {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                    {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                ],
            }
        ],
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGES["image/png"]}}
    assert received(upstream, stream)["messages"] == [user(image, image, image, image)]


@STREAM
@pytest.mark.parametrize(
    "url",
    [
        "data:image/bmp;base64,Qk06AAAAAAAAADYAAAAoAAAAAQAAAAEAAAABABgAAAAAAAQAAAA=",
        "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=",
        "data:image/tiff;base64,SUkqAAgAAAA=",
        "data:application/pdf;base64," + PDF,
        "data:;base64," + IMAGES["image/png"],
    ],
    ids=["bmp", "svg", "tiff", "pdf", "no-type"],
)
async def test_image_data_url_of_an_unsupported_type_is_a_400_naming_the_part(client, upstream, stream, url):
    error = await refused(
        client,
        upstream,
        stream,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [text("Look"), {"type": "image_url", "image_url": {"url": url}}]},
        ],
    )
    assert error["message"].startswith("messages[2].content[1].image_url.url: ")


@STREAM
@pytest.mark.parametrize(
    "url",
    [
        "data:image/png," + IMAGES["image/png"],  # no ;base64
        "data:image/png;charset=utf-8,%89PNG",
        "data:image/png;base64,",  # no data
        "data:image/png;base64",  # no comma
        "image/png;base64," + IMAGES["image/png"],  # no data: prefix
        "data:image/png;base64,not base64 at all!!",
        "data:image/png;base64," + IMAGES["image/png"][:-1],  # a character short
        "data:image/png;base64,iVBO=Rw0KGgo=",  # padding inside
        "data:image/png;base64,iVBORw0KGg===",  # three padding characters
        "data:image/png;base64,iVBORw0K\nGgo=",  # a line break
        "data:image/png;base64,iVBORw0KGgé=",  # not ASCII
    ],
    ids=[
        "plain",
        "percent-encoded",
        "empty",
        "no-comma",
        "no-scheme",
        "bad-base64",
        "short",
        "inner-padding",
        "three-pads",
        "line-break",
        "non-ascii",
    ],
)
async def test_a_non_base64_image_data_url_is_a_400_naming_the_part(client, upstream, stream, url):
    error = await refused(
        client,
        upstream,
        stream,
        messages=[{"role": "user", "content": [text("Look"), {"type": "image_url", "image_url": {"url": url}}]}],
    )
    assert error["message"].startswith("messages[0].content[1].image_url.url: ")


@STREAM
async def test_pdf_file_part_becomes_a_base64_document(client, upstream, stream):
    answer = await ask(
        client,
        stream,
        messages=[
            {
                "role": "user",
                "content": [
                    text("Summarise this."),
                    {
                        "type": "file",
                        "file": {"filename": "report.pdf", "file_data": "data:application/pdf;base64," + PDF},
                    },
                ],
            }
        ],
    )
    assert answer.content == echo("Summarise this.")
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}}
    assert received(upstream, stream)["messages"] == [user(text("Summarise this."), document)]


@STREAM
@pytest.mark.parametrize(
    "file",
    [
        {"file_data": "data:text/plain;base64,aGVsbG8="},
        {"file_data": "data:image/png;base64," + IMAGES["image/png"]},
        {"file_data": "data:application/pdf," + PDF},
        {"filename": "report.pdf"},
    ],
    ids=["text-plain", "png", "not-base64", "no-file-data"],
)
async def test_a_file_part_that_is_not_a_pdf_data_url_is_a_400_naming_the_part(client, upstream, stream, file):
    error = await refused(
        client, upstream, stream, messages=[{"role": "user", "content": [text("Read"), {"type": "file", "file": file}]}]
    )
    assert error["message"].startswith("messages[0].content[1].file")


@STREAM
async def test_assistant_refusal_parts_are_dropped(client, upstream, stream):
    await ask(
        client,
        stream,
        messages=[
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}, text("But this.")]},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "Still no."}]},
            {"role": "user", "content": "Q3"},
        ],
    )
    # The all-refusal turn leaves nothing, so Q2 and Q3 merge into one user turn.
    assert received(upstream, stream)["messages"] == [
        user(text("Q1")),
        assistant(text("But this.")),
        user(text("Q2"), text("Q3")),
    ]


@STREAM
@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [text("b"), text("c")]}],
            [user(text("a"), text("b"), text("c"))],
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, {"role": "user", "content": "b"}],
            [user(text("a"), text("b"))],
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": [text("c")]},
                {"role": "user", "content": "d"},
            ],
            [user(text("a")), assistant(text("b"), text("c")), user(text("d"))],
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "developer", "content": "s"},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
                {"role": "user", "content": "e"},
            ],
            [user(text("a")), assistant(text("b"), text("c")), user(text("d"), text("e"))],
        ),
    ],
    ids=["user-user", "user-system-user", "assistant-assistant", "both"],
)
async def test_consecutive_same_role_messages_are_merged(client, upstream, stream, messages, expected):
    answer = await ask(client, stream, messages=messages)
    # The mock echoes the text of the last user turn it received: the merged one.
    assert answer.content == echo("\n".join(block["text"] for block in expected[-1]["content"]))
    assert received(upstream, stream)["messages"] == expected


@STREAM
async def test_empty_or_whitespace_text_is_never_sent_as_a_block(client, upstream, stream):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    await ask(
        client,
        stream,
        tools=TOOLS,
        messages=[
            {"role": "system", "content": "  \n "},
            {"role": "developer", "content": [text("")]},
            {"role": "user", "content": [text(""), text("Weather?"), text("\t")]},
            {"role": "user", "content": "   "},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "9°C"},
            {"role": "user", "content": [text(" "), text("Thanks.")]},
            {"role": "assistant", "content": "\n\n"},
            {"role": "user", "content": "More?"},
        ],
    )
    body = received(upstream, stream)
    assert "system" not in body
    assert body["messages"] == [
        user(text("Weather?")),
        assistant({"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}),
        user(
            {"type": "tool_result", "tool_use_id": "call_1", "content": [text("9°C")]},
            text("Thanks."),
            text("More?"),
        ),
    ]


@STREAM
@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"extra_body": {"messages": {"role": "user", "content": "Hi"}}}, "messages"),
        ({"extra_body": {"messages": "Hi"}}, "messages"),
        ({"messages": ["Hi"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": {"type": "text", "text": "Hi"}}]}, "messages[0].content"),
        ({"messages": [{"role": "system", "content": 5}, {"role": "user", "content": "Hi"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 5}]},
            "messages[1].content",
        ),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hi"}]}, "messages[1].role"),
        ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
        ({"messages": [{"role": 7, "content": "Hi"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": [{"text": "no type"}]},
                ]
            },
            "messages[2].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [text("a"), "b"]}]}, "messages[0].content[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "image_url"}]},
                ]
            },
            "messages[1].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": {"id": "call_1"}},
                ]
            },
            "messages[1].tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": ["x"]},
                ]
            },
            "messages[1].tool_calls[0]",
        ),
    ],
    ids=[
        "messages-object",
        "messages-string",
        "message-string",
        "content-number",
        "content-object",
        "system-content-number",
        "assistant-content-number",
        "unknown-role",
        "missing-role",
        "role-number",
        "part-without-type",
        "part-string",
        "text-number",
        "unknown-part-type",
        "image_url-string",
        "image-url-number",
        "assistant-part-type",
        "tool_calls-object",
        "tool_call-string",
    ],
)
async def test_wrong_types_are_a_400_naming_the_path(client, upstream, stream, fields, path):
    error = await refused(client, upstream, stream, **fields)
    assert error["message"].startswith(path + ": ")


@STREAM
@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "system", "content": "Be brief."}],
        [{"role": "developer", "content": "Be brief."}],
        [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": [text("Be kind.")]}],
    ],
    ids=["empty", "system", "developer", "both"],
)
async def test_only_system_or_developer_messages(client, upstream, stream, messages):
    error = await refused(client, upstream, stream, messages=messages)
    assert error["message"] == "messages: must contain at least one user message"


# --- Reasoning -----------------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    ("reasoning_effort", "effort", "thinking"),
    [
        ("none", "low", False),
        ("minimal", "low", False),
        ("low", "low", True),
        ("medium", "medium", True),
        ("high", "high", True),
        ("xhigh", "xhigh", True),
        ("max", "max", True),
    ],
)
async def test_reasoning_effort_table(client, upstream, stream, reasoning_effort, effort, thinking):
    answer = await ask(client, stream, reasoning_effort=reasoning_effort)
    assert answer.content == "Hello from the mock upstream. You said: Hi"
    assert answer.finish_reason == "stop"
    body = received(upstream, stream)
    assert body["output_config"] == {"effort": effort}
    if thinking:
        assert body["thinking"] == {"type": "adaptive"}
    else:
        assert "thinking" not in body


@STREAM
async def test_without_reasoning_effort_neither_effort_nor_thinking_is_sent(client, upstream, stream):
    await ask(client, stream)
    body = received(upstream, stream)
    assert "output_config" not in body
    assert "thinking" not in body


@STREAM
async def test_a_level_the_model_lacks_is_a_400_naming_the_field(start_client, upstream, stream):
    client = await start_client(efforts=("low", "medium", "high", "max"))
    error = await refused(client, upstream, stream, reasoning_effort="xhigh")  # upstream got nothing
    assert error["param"] == "reasoning_effort"
    assert error["type"] == "invalid_request_error"
    assert (
        error["message"]
        == "reasoning_effort: 'xhigh' is not available for this model; use one of low, medium, high, max"
    )

    await ask(client, stream, reasoning_effort="max")  # a level it has still works
    assert received(upstream, stream)["output_config"] == {"effort": "max"}


@STREAM
@pytest.mark.parametrize("value", ["extreme", "HIGH", ""])
async def test_an_unknown_reasoning_effort_is_refused(client, upstream, stream, value):
    error = await refused(client, upstream, stream, reasoning_effort=value)
    assert error["message"] == "reasoning_effort: use one of none, minimal, low, medium, high, xhigh, max"
    assert error["param"] == "reasoning_effort"


@STREAM
async def test_reasoning_tokens_are_reported_and_the_thinking_text_is_not_returned(client, upstream, stream):
    upstream.enqueue(
        Scenario(
            blocks=[
                {"type": "thinking", "thinking": THOUGHT, "signature": "c2lnbmF0dXJl"},
                text("Autumn moon rises"),
            ],
            usage={"input_tokens": 12, "output_tokens": 57, "thinking_tokens": 45},
        )
    )
    answer = await ask(client, stream, reasoning_effort="high")
    assert answer.content == "Autumn moon rises"
    assert THOUGHT not in answer.dump and "SECRET" not in answer.dump and "c2lnbmF0dXJl" not in answer.dump
    assert answer.usage.completion_tokens_details.reasoning_tokens == 45
    assert answer.usage.completion_tokens == 57  # thinking is billed as output
    assert answer.usage.prompt_tokens == 12
    assert answer.usage.total_tokens == 69
    assert received(upstream, stream)["thinking"] == {"type": "adaptive"}


# --- Sampling ------------------------------------------------------------------------------


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}


@STREAM
@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.7},
        {"top_p": 0.5},
        {"temperature": 0.2, "reasoning_effort": "none"},
    ],
)
async def test_sampling_is_dropped_silently_for_a_model_without_sampling(client, upstream, stream, fields):
    answer = await ask(client, stream, **fields)
    assert answer.content == "Hello from the mock upstream. You said: Hi"
    assert sampling_of(received(upstream, stream)) == {}


@STREAM
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"temperature": 0.3, "top_p": 0.9}, {"temperature": 0.3, "top_p": 0.9}),
        ({"temperature": 0}, {"temperature": 0}),
        ({"temperature": 1}, {"temperature": 1}),
        ({"temperature": 1.7}, {"temperature": 1}),  # capped at 1
        ({"temperature": 2}, {"temperature": 1}),
        ({"top_p": 1}, {}),  # sent only below 1
        ({"top_p": 0.9}, {"top_p": 0.9}),
        ({"temperature": 1.5, "top_p": 1}, {"temperature": 1}),
        ({"temperature": 0.5, "top_p": 0.9, "reasoning_effort": "none"}, {"temperature": 0.5, "top_p": 0.9}),
        ({"temperature": 0.5, "top_p": 0.9, "reasoning_effort": "minimal"}, {"temperature": 0.5, "top_p": 0.9}),
        ({"temperature": 0.5, "top_p": 0.9, "reasoning_effort": "low"}, {}),  # thinking on
        ({"temperature": 0.5, "top_p": 0.9, "reasoning_effort": "high"}, {}),
        ({"temperature": 0.5, "top_p": 0.9, "reasoning_effort": "max"}, {}),
    ],
)
async def test_sampling_on_a_model_with_sampling(start_client, upstream, stream, fields, expected):
    client = await start_client(sampling=True)
    answer = await ask(client, stream, **fields)
    assert answer.content == "Hello from the mock upstream. You said: Hi"
    body = received(upstream, stream)
    assert sampling_of(body) == expected
    assert ("thinking" in body) == (fields.get("reasoning_effort") in ("low", "high", "max"))


# --- Output length and format -------------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    ("model_fields", "model", "fields", "expected"),
    [
        ({}, MODEL, {"max_completion_tokens": 100, "max_tokens": 50}, 100),
        ({}, MODEL, {"max_completion_tokens": 50, "max_tokens": 100}, 50),
        ({}, MODEL, {"max_completion_tokens": 77}, 77),
        ({}, MODEL, {"max_tokens": 64}, 64),
        ({}, MODEL, {}, 32000),
        ({"max_output_tokens": 128000}, MODEL, {}, 32000),
        ({"max_output_tokens": 8192}, MODEL, {}, 8192),
        ({}, "test/small", {}, 4096),
    ],
    ids=["mct-wins", "mct-wins-lower", "mct", "max_tokens", "default", "default-big-model", "lower-max", "small"],
)
async def test_output_limit(start_client, upstream, stream, model_fields, model, fields, expected):
    client = await start_client(**model_fields)
    answer = await ask(client, stream, model=model, **fields)
    assert answer.finish_reason == "stop"
    assert received(upstream, stream)["max_tokens"] == expected


@STREAM
@pytest.mark.parametrize(
    ("stop", "sequences"),
    [
        ("END", ["END"]),
        (["END", "\n\nHuman:"], ["END", "\n\nHuman:"]),
        (["  ", "END"], ["END"]),  # whitespace-only sequences are not sent
    ],
    ids=["string", "list", "whitespace"],
)
async def test_stop_as_a_string_or_a_list(client, upstream, stream, stop, sequences):
    upstream.enqueue(Scenario(blocks=[text("one two")], stop_reason="stop_sequence", stop_sequence="END"))
    answer = await ask(client, stream, stop=stop)
    assert answer.content == "one two"
    assert answer.finish_reason == "stop"
    assert received(upstream, stream)["stop_sequences"] == sequences


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "address", "tags"],
    "additionalProperties": False,
}


@STREAM
@pytest.mark.parametrize(
    ("reasoning_effort", "output_config"),
    [
        (None, {"format": {"type": "json_schema", "schema": PERSON}}),
        ("medium", {"effort": "medium", "format": {"type": "json_schema", "schema": PERSON}}),
        ("none", {"effort": "low", "format": {"type": "json_schema", "schema": PERSON}}),
    ],
)
async def test_json_schema_becomes_the_upstreams_structured_output(
    client, upstream, stream, reasoning_effort, output_config
):
    reply = '{"name":"Ada","address":{"city":"London"},"tags":[]}'
    upstream.enqueue(Scenario(blocks=[text(reply)]))
    fields = {"reasoning_effort": reasoning_effort} if reasoning_effort else {}
    answer = await ask(
        client,
        stream,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}},
        **fields,
    )
    assert json.loads(answer.content) == {"name": "Ada", "address": {"city": "London"}, "tags": []}
    body = received(upstream, stream)
    assert body["output_config"] == output_config
    assert "response_format" not in body


def _open(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k != "additionalProperties"}


def _with(name: str, subschema: dict, **top) -> dict:
    """PERSON with property `name` replaced (and top-level keys added)."""
    return {**PERSON, "properties": {**PERSON["properties"], name: subschema}, **top}


OPEN_ADDRESS = _open(PERSON["properties"]["address"])


ROOT = "response_format.json_schema.schema"


@STREAM
@pytest.mark.parametrize(
    ("schema", "path"),
    [
        (_open(PERSON), ROOT),
        ({**PERSON, "additionalProperties": True}, ROOT),
        ({"type": "object", "properties": {}}, ROOT),
        (_with("address", OPEN_ADDRESS), ROOT + ".properties.address"),
        (_with("tags", {"type": "array", "items": OPEN_ADDRESS}), ROOT + ".properties.tags.items"),
        (
            _with("address", {"$ref": "#/$defs/Address"}, **{"$defs": {"Address": OPEN_ADDRESS}}),
            ROOT + ".$defs.Address",
        ),
        (_with("address", {"anyOf": [{"type": "string"}, OPEN_ADDRESS]}), ROOT + ".properties.address.anyOf[1]"),
        (
            _with("address", {"type": ["object", "null"], "properties": {"city": {"type": "string"}}}),
            ROOT + ".properties.address",
        ),
    ],
    ids=["top", "top-true", "top-empty", "properties", "items", "defs", "anyOf", "nullable-object"],
)
async def test_an_open_object_in_the_schema_is_a_400_naming_its_path(client, upstream, stream, schema, path):
    error = await refused(
        client,
        upstream,
        stream,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert error["message"] == f'{path}: objects need "additionalProperties": false'


@STREAM
async def test_json_object_is_refused(client, upstream, stream):
    error = await refused(client, upstream, stream, response_format={"type": "json_object"})
    assert error["message"] == (
        'response_format: type "json_object" is not supported; use "json_schema" with a schema '
        '(objects need "additionalProperties": false)'
    )
    assert error["param"] == "response_format"


@STREAM
async def test_response_format_text_changes_nothing(client, upstream, stream):
    answer = await ask(client, stream, response_format={"type": "text"})
    assert answer.content == "Hello from the mock upstream. You said: Hi"
    assert "output_config" not in received(upstream, stream)


# --- Finish reasons ------------------------------------------------------------------------

WEATHER_CALL = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}}


@STREAM
@pytest.mark.parametrize(
    ("scenario", "finish_reason"),
    [
        (Scenario(blocks=[text("Done.")], stop_reason="end_turn"), "stop"),
        (Scenario(blocks=[text("Done.")], stop_reason="stop_sequence", stop_sequence="END"), "stop"),
        (Scenario(blocks=[text("Done.")], stop_reason="max_tokens"), "length"),
        (Scenario(blocks=[text("Done.")], stop_reason="model_context_window_exceeded"), "length"),
        (Scenario(blocks=[text("Done."), WEATHER_CALL], stop_reason="tool_use"), "tool_calls"),
        (
            Scenario(
                blocks=[text("Done.")],
                stop_reason="refusal",
                stop_details={"type": "refusal", "category": None, "explanation": None},
            ),
            "content_filter",
        ),
        (Scenario(blocks=[text("Done.")], stop_reason="pause_turn"), "stop"),
    ],
    ids=lambda value: value.stop_reason if isinstance(value, Scenario) else value,
)
async def test_finish_reasons(client, upstream, stream, scenario, finish_reason):
    upstream.enqueue(scenario)
    answer = await ask(client, stream, tools=TOOLS, stop="END")
    assert answer.finish_reason == finish_reason
    assert answer.content == "Done."
    if finish_reason == "tool_calls":
        assert answer.tool_calls == [
            {"id": "toolu_01", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
        ]
    else:
        assert answer.tool_calls == []
    body = received(upstream, stream)
    assert body["stop_sequences"] == ["END"]
    assert [tool["name"] for tool in body["tools"]] == ["get_weather"]


# --- Usage (pitfall P1) --------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    ("uncached", "read", "written", "output", "prompt"),
    [
        (21, 188086, 0, 393, 188107),  # the notes' worked example
        (21, 0, 4000, 10, 4021),
        (7, 3000, 1500, 93, 4507),
        (30, 0, 0, 5, 30),
    ],
    ids=["reads", "writes", "reads-and-writes", "no-cache"],
)
async def test_usage_counts_every_input_token_once(client, upstream, stream, uncached, read, written, output, prompt):
    """Anthropic's input_tokens leaves out cache reads and writes; OpenAI's prompt_tokens counts all input."""
    upstream.enqueue(
        Scenario(
            blocks=[text("ok")],
            usage={
                "input_tokens": uncached,
                "cache_read_input_tokens": read,
                "cache_creation_input_tokens": written,
                "output_tokens": output,
            },
        )
    )
    answer = await ask(client, stream)
    usage = answer.usage
    assert usage.prompt_tokens == prompt
    assert usage.prompt_tokens_details.cached_tokens == read
    assert usage.prompt_tokens_details.cache_write_tokens == written
    assert usage.completion_tokens == output
    assert usage.total_tokens == prompt + output
    assert usage.completion_tokens_details.reasoning_tokens == 0
    assert received(upstream, stream)["messages"] == [user(text("Hi"))]
