"""The spec's "Ignored and refused fields", row by row, through the official openai SDK.

Refused fields get 400 `invalid_request_error` with exactly the spec's message (indexes pointing
at the refused part), `param` set, `code` null, and the upstream receives nothing. The accepted
values (`n: 1`, `logprobs: false`, …) succeed. Ignored fields never reach the upstream. Each
behaviour holds streamed and not. Fields the SDK has no argument for go in `extra_body`.
"""

from __future__ import annotations

import openai
import pytest

from tests.requests_util import SPEC_IGNORED_FIELDS, echo
from tests.support import MODEL, UPSTREAM_MODEL

HELLO = [{"role": "user", "content": "Hi"}]
# The upstream body of a plain `HELLO` request with max_completion_tokens=64: nothing else.
PLAIN_UPSTREAM_BODY = {
    "model": UPSTREAM_MODEL,
    "max_tokens": 64,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
}

FUNCTION_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
LOGPROBS = "log probabilities are not available"
LEGACY_FUNCTIONS = "functions: the legacy functions API is not supported; use tools"
JSON_OBJECT = (
    'response_format: type "json_object" is not supported; use "json_schema" with a schema '
    '(objects need "additionalProperties": false)'
)
ONLY_FUNCTION_TOOLS = "only function tools are supported"
AUDIO_INPUT = "audio input is not supported"
FILE_ID = "send the PDF as file_data (a base64 data URL); file_id is not supported"
FUNCTION_ROLE = 'the legacy "function" role is not supported; use tools'
EFFORT = "reasoning_effort: use one of none, minimal, low, medium, high, xhigh, max"

AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
FILE_ID_PART = {"type": "file", "file": {"file_id": "file-abc123"}}
TEXT_PART = {"type": "text", "text": "Listen to this."}
# Index 2 with a system message, an assistant turn and a refused part second: the indexes must
# count every message as the client sent it, and every part.
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
]


def refusal(kwargs: dict, message: str, param: str, id: str):
    return pytest.param(kwargs, message, param, id=id)


def refused_part(part: dict, suffix: str, reason: str, id: str) -> list:
    """A refused content part alone (messages[0].content[0]), and second in the third message."""
    return [
        refusal(
            {"messages": [{"role": "user", "content": [part]}]},
            f"messages[0].content[0]{suffix}: {reason}",
            "messages",
            f"{id}-0-0",
        ),
        refusal(
            {"messages": [*HISTORY, {"role": "user", "content": [TEXT_PART, part]}]},
            f"messages[2].content[1]{suffix}: {reason}",
            "messages",
            f"{id}-2-1",
        ),
    ]


REFUSED = [
    # n above 1
    refusal({"n": 2}, "n: only 1 choice per request is supported", "n", "n-2"),
    refusal({"n": 16}, "n: only 1 choice per request is supported", "n", "n-16"),
    # logprobs: true
    refusal({"logprobs": True}, f"logprobs: {LOGPROBS}", "logprobs", "logprobs-true"),
    # top_logprobs (any value: the row names the field)
    refusal({"top_logprobs": 3}, f"top_logprobs: {LOGPROBS}", "top_logprobs", "top_logprobs-3"),
    refusal({"logprobs": False, "top_logprobs": 0}, f"top_logprobs: {LOGPROBS}", "top_logprobs", "top_logprobs-0"),
    # logit_bias (not empty)
    refusal({"logit_bias": {"50256": -100}}, "logit_bias: is not supported", "logit_bias", "logit_bias"),
    # audio, or modalities other than ["text"]
    refusal(
        {"audio": {"voice": "alloy", "format": "wav"}},
        "modalities: only text output is supported",
        "modalities",
        "audio",
    ),
    refusal(
        {"modalities": ["text"], "audio": {"voice": "alloy", "format": "mp3"}},
        "modalities: only text output is supported",
        "modalities",
        "audio-with-text-modality",
    ),
    refusal({"modalities": ["audio"]}, "modalities: only text output is supported", "modalities", "modalities-audio"),
    refusal(
        {"modalities": ["text", "audio"]},
        "modalities: only text output is supported",
        "modalities",
        "modalities-text-audio",
    ),
    # web_search_options
    refusal(
        {"web_search_options": {}}, "web_search_options: is not supported", "web_search_options", "web_search-empty"
    ),
    refusal(
        {"web_search_options": {"search_context_size": "low"}},
        "web_search_options: is not supported",
        "web_search_options",
        "web_search",
    ),
    # functions, function_call
    refusal(
        {"functions": [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}]},
        LEGACY_FUNCTIONS,
        "functions",
        "functions",
    ),
    refusal({"function_call": "auto"}, LEGACY_FUNCTIONS, "functions", "function_call"),
    refusal(
        {"functions": [{"name": "f"}], "function_call": {"name": "f"}},
        LEGACY_FUNCTIONS,
        "functions",
        "functions-and-call",
    ),
    # response_format type json_object
    refusal({"response_format": {"type": "json_object"}}, JSON_OBJECT, "response_format", "json_object"),
    # a tool whose type isn't function; the index points at it
    refusal(
        {"tools": [{"type": "custom", "custom": {"name": "grep"}}]},
        f"tools[0].type: {ONLY_FUNCTION_TOOLS}",
        "tools",
        "tools0-custom",
    ),
    refusal(
        {"tools": [FUNCTION_TOOL, {"type": "web_search"}]},
        f"tools[1].type: {ONLY_FUNCTION_TOOLS}",
        "tools",
        "tools1-web_search",
    ),
    refusal(
        {"tools": [FUNCTION_TOOL, FUNCTION_TOOL, {"function": {"name": "no_type"}}]},
        f"tools[2].type: {ONLY_FUNCTION_TOOLS}",
        "tools",
        "tools2-missing-type",
    ),
    # an unknown reasoning_effort (every other value: test_unknown_reasoning_effort_is_refused)
    refusal({"reasoning_effort": "extreme"}, EFFORT, "reasoning_effort", "reasoning_effort"),
    # input_audio content part, and a file part with file_id
    *refused_part(AUDIO_PART, "", AUDIO_INPUT, "input_audio"),
    *refused_part(FILE_ID_PART, ".file", FILE_ID, "file_id"),
    refusal(
        {
            "messages": [
                {"role": "user", "content": "Read these."},
                {"role": "assistant", "content": "Send them."},
                {
                    "role": "user",
                    "content": [
                        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0xLjQK"}},
                        TEXT_PART,
                        FILE_ID_PART,
                    ],
                },
            ]
        },
        f"messages[2].content[2].file: {FILE_ID}",
        "messages",
        "file_id-after-file_data",
    ),
    # function role
    refusal(
        {"messages": [{"role": "function", "name": "get_weather", "content": "9°C"}]},
        f"messages[0].role: {FUNCTION_ROLE}",
        "messages",
        "function-role-0",
    ),
    refusal(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
                {"role": "function", "name": "get_weather", "content": "9°C"},
            ]
        },
        # The assistant's function_call is not a top-level `function_call`: the role is what is refused.
        f"messages[2].role: {FUNCTION_ROLE}",
        "messages",
        "function-role-2",
    ),
]


async def create(client: openai.AsyncOpenAI, stream: bool, **kwargs):
    """One request through the SDK; a stream is read to the end. Fields the SDK has no
    argument for go in extra_body."""
    kwargs.setdefault("messages", HELLO)
    kwargs.setdefault("max_completion_tokens", 64)
    result = await client.chat.completions.create(model=MODEL, stream=stream, **kwargs)
    if stream:
        return [chunk async for chunk in result]
    return result


def assert_answered(result, stream: bool) -> None:
    """The mock upstream's default echo reply arrived as a chat completion (or its chunks)."""
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in result if c.choices)
        finish = [c.choices[0].finish_reason for c in result if c.choices][-1]
    else:
        assert result.object == "chat.completion"
        text, finish = result.choices[0].message.content, result.choices[0].finish_reason
    assert text.startswith("Hello from the mock upstream.")
    assert text == echo("Hi")
    assert finish == "stop"


def upstream_body(stream: bool) -> dict:
    return {**PLAIN_UPSTREAM_BODY, "stream": True} if stream else PLAIN_UPSTREAM_BODY


# --- Refused.


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("kwargs", "message", "param"), REFUSED)
async def test_refused_field(client, upstream, kwargs, message, param, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        await create(client, stream, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert upstream.requests == []


UNKNOWN_EFFORTS = [
    "",
    "extreme",
    "maximum",
    "default",
    "auto",
    "ultra",
    "HIGH",
    "Low",
    " low",
    "medium ",
    "x-high",
    "x_high",
    "extra_high",
    "none\n",
    0,
    1,
    3.5,
    True,
    False,
    ["high"],
    {"effort": "high"},
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("effort", UNKNOWN_EFFORTS, ids=repr)
async def test_unknown_reasoning_effort_is_refused(client, upstream, effort, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        await create(client, stream, extra_body={"reasoning_effort": effort})
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": EFFORT,
        "type": "invalid_request_error",
        "param": "reasoning_effort",
        "code": None,
    }
    assert upstream.requests == []


# --- Accepted values of refusable fields.

ACCEPTED = [
    pytest.param({"n": 1}, id="n-1"),
    pytest.param({"logprobs": False}, id="logprobs-false"),
    pytest.param({"modalities": ["text"]}, id="modalities-text"),
    pytest.param({"logit_bias": {}}, id="logit_bias-empty"),
    pytest.param({"response_format": {"type": "text"}}, id="response_format-text"),
    pytest.param(
        {"n": 1, "logprobs": False, "modalities": ["text"], "logit_bias": {}, "response_format": {"type": "text"}},
        id="all-together",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kwargs", ACCEPTED)
async def test_accepted_value(client, upstream, kwargs, stream):
    result = await create(client, stream, **kwargs)
    assert_answered(result, stream)
    assert len(upstream.requests) == 1
    assert upstream.requests[-1].body == upstream_body(stream)


# --- Ignored.

IGNORED = [
    pytest.param({"user": "alice@example.com"}, id="user"),
    pytest.param({"seed": 42}, id="seed"),
    pytest.param({"presence_penalty": 0.5}, id="presence_penalty"),
    pytest.param({"frequency_penalty": -1.5}, id="frequency_penalty"),
    pytest.param({"store": True}, id="store"),
    pytest.param({"metadata": {"customer": "42", "purpose": "test"}}, id="metadata"),
    pytest.param({"service_tier": "priority"}, id="service_tier"),
    # Fields this page does not describe: the SDK's own, and ones it does not know.
    pytest.param({"verbosity": "low"}, id="verbosity"),
    pytest.param({"safety_identifier": "user-1234"}, id="safety_identifier"),
    pytest.param({"prediction": {"type": "content", "content": "Hello"}}, id="prediction"),
    pytest.param({"extra_body": {"top_k": 5}}, id="top_k"),
    pytest.param({"extra_body": {"thinking": {"type": "enabled", "budget_tokens": 2048}}}, id="thinking"),
    pytest.param({"extra_body": {"stop_sequences": ["END"]}}, id="stop_sequences"),
    pytest.param({"extra_body": {"system": "You are a pirate."}}, id="system"),
    pytest.param({"extra_body": {"x_unknown": {"nested": [1, 2, 3]}, "foo": None}}, id="unknown"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kwargs", IGNORED)
async def test_ignored_field_never_reaches_the_upstream(client, upstream, kwargs, stream):
    result = await create(client, stream, **kwargs)
    assert_answered(result, stream)
    assert len(upstream.requests) == 1
    assert upstream.requests[-1].body == upstream_body(stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_all_ignored_fields_together(client, upstream, stream):
    result = await create(
        client,
        stream,
        **SPEC_IGNORED_FIELDS,
        # The accepted values too: none of them is sent either.
        n=1,
        logprobs=False,
        logit_bias={},
        modalities=["text"],
        response_format={"type": "text"},
        extra_body={"top_k": 40, "unknown_field": "value", "anthropic_version": "2023-06-01"},
    )
    assert_answered(result, stream)
    assert len(upstream.requests) == 1
    assert upstream.requests[-1].body == upstream_body(stream)
