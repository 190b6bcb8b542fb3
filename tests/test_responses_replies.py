"""Responses API replies: an Anthropic message becomes a `response` object, its event stream the
Responses event protocol. Every object and event is checked against the `openai` package's own
types; a stream's last event holds the same response a whole reply would."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.app import STORE
from gateway.mock.upstream import MockUpstream, Scenario
from middlewares.core.errors import error_event
from middlewares.core.usage import StreamUsage, Usage
from middlewares.responses.reply import to_response
from middlewares.responses.stream import ResponsesEncoder
from middlewares.responses.turn import ResponseTurn
from tests.support import KEY, MODEL

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {"input_tokens": 10, "cache_read_input_tokens": 300, "cache_creation_input_tokens": 40, "output_tokens": 25}
SEALED: list[list[dict[str, Any]]] = []  # what each turn's seal was given


def seal(blocks: list[dict[str, Any]]) -> str:
    """The blocks as written (a stream's must come out as the whole message's were)."""
    SEALED.append([dict(block) for block in blocks])
    return json.dumps(blocks, sort_keys=True)


def turn(**fields: Any) -> ResponseTurn:
    return ResponseTurn(
        response_id="resp_0641a3f2c1b7e9d04a2f1c3b",
        model="anthropic/claude-sonnet-5-5",
        created_at=1796151711,
        **fields,
    )


def message(blocks: list[dict[str, Any]], stop_reason: str | None = None, **usage: int) -> dict[str, Any]:
    """An Anthropic message as the upstream sends it."""
    calls = any(block["type"] == "tool_use" for block in blocks)
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-5-5",
        "content": blocks,
        "stop_reason": stop_reason or ("tool_use" if calls else "end_turn"),
        "stop_sequence": None,
        "stop_details": None,
        "usage": {**USAGE, **usage},
    }


def whole(answer: dict[str, Any], reply_turn: ResponseTurn) -> dict[str, Any]:
    reply = to_response(answer, Usage.from_message(answer), reply_turn)
    Response.model_validate(reply)
    return reply


def streamed(answer: dict[str, Any], reply_turn: ResponseTurn, *, per_batch: int = 1, **scenario: Any) -> list[dict]:
    """The answer streamed as the upstream sends it, `per_batch` events a batch, through the
    encoder; its events, each checked against the openai types, with their SSE names."""
    events = MockUpstream._events(answer, Scenario(chunk_size=5, **scenario))
    return encode(events, reply_turn, per_batch=per_batch)


def encode(events: list[dict[str, Any]], reply_turn: ResponseTurn, *, per_batch: int = 1) -> list[dict]:
    usage = StreamUsage()
    encoder = ResponsesEncoder(reply_turn, usage)
    sent = b""
    for at in range(0, len(events), per_batch):
        batch = events[at : at + per_batch]
        usage.count(batch)
        sent += encoder.encode(batch)
        if encoder.finished:
            break
    assert encoder.finished
    assert encoder.encode([{"type": "message_stop"}]) == b""  # nothing after the end
    ended = encoder.response
    parsed = []
    for frame in sent.decode().split("\n\n")[:-1]:
        if frame == ": ping":
            continue
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        EVENT.validate_python(event)
        parsed.append(event)
    assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    assert parsed[-1]["response"] == ended  # what a store keeps is what the client got last
    return parsed


def same_response(streamed_response: dict[str, Any], reply: dict[str, Any]) -> None:
    """Equal but for the moment each was completed."""
    assert {**streamed_response, "completed_at": None} == {**reply, "completed_at": None}


TEXT = "Paris is the capital of France."
THINKING = {"type": "thinking", "thinking": "The user asks about France; Paris.", "signature": "sig-1"}
REDACTED = {"type": "redacted_thinking", "data": "opaque=="}
CALL = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "days": 3}}

ANSWERS = {
    "text": message([{"type": "text", "text": TEXT}]),
    "call": message([{"type": "text", "text": "Let me look."}, CALL]),
    "thinking": message([THINKING, REDACTED, {"type": "text", "text": TEXT}]),
    "interleaved": message([THINKING, CALL, dict(THINKING, signature="sig-2"), {"type": "text", "text": TEXT}]),
    "cut": message([{"type": "text", "text": TEXT}], "max_tokens"),
    "refused": message([{"type": "text", "text": "I can't"}], "refusal"),
    "empty": message([], "max_tokens"),
    "no arguments": message([dict(CALL, input={})]),
}


# --- a whole reply


def test_a_text_answer_is_a_completed_response_with_its_usage():
    reply = whole(ANSWERS["text"], turn())
    response = Response.model_validate(reply)

    assert (response.id, response.object, response.status, response.model) == (
        "resp_0641a3f2c1b7e9d04a2f1c3b",
        "response",
        "completed",
        "anthropic/claude-sonnet-5-5",
    )
    assert response.output_text == TEXT
    [item] = response.output
    assert (item.type, item.role, item.status, item.id) == (
        "message",
        "assistant",
        "completed",
        "msg_0641a3f2c1b7e9d04a2f1c3b_0",
    )
    assert response.incomplete_details is None and response.error is None
    usage = response.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens) == (350, 300, 25)
    assert (usage.input_tokens_details.cache_write_tokens, usage.total_tokens) == (40, 375)
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_the_requests_settings_are_echoed_over_openais_defaults():
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}]
    reply = whole(ANSWERS["text"], turn(echo={"instructions": "Be brief.", "tools": tools, "temperature": 0.2}))
    response = Response.model_validate(reply)

    assert (response.instructions, response.temperature, response.tools[0].name) == ("Be brief.", 0.2, "get_weather")
    assert (response.tool_choice, response.parallel_tool_calls, response.top_p) == ("auto", True, 1.0)
    assert (response.truncation, response.text.format.type, response.store) == ("disabled", "text", True)


def test_a_tool_call_is_a_function_call_with_its_arguments_as_json():
    reply = whole(ANSWERS["call"], turn(renamed={"get_weather": "weather.get"}))
    message_item, call = Response.model_validate(reply).output

    assert message_item.content[0].text == "Let me look."
    assert (call.type, call.call_id, call.name, call.status) == (
        "function_call",
        "toolu_01",
        "weather.get",
        "completed",
    )
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert call.id.startswith("fc_") and reply["status"] == "completed"


def test_a_custom_tools_call_carries_its_string_and_a_namespaced_call_its_namespace():
    answer = message(
        [
            {"type": "tool_use", "id": "toolu_02", "name": "apply_patch", "input": {"input": "*** Begin Patch\n"}},
            {"type": "tool_use", "id": "toolu_03", "name": "crm__lookup", "input": {"id": 7}},
        ]
    )
    reply_turn = turn(
        custom_tools=frozenset({"apply_patch"}), renamed={"crm__lookup": "lookup"}, namespaces={"crm__lookup": "crm"}
    )
    custom, namespaced = Response.model_validate(whole(answer, reply_turn)).output

    assert (custom.type, custom.call_id, custom.name, custom.input) == (
        "custom_tool_call",
        "toolu_02",
        "apply_patch",
        "*** Begin Patch\n",
    )
    assert (namespaced.type, namespaced.name, namespaced.namespace) == ("function_call", "lookup", "crm")


@pytest.mark.parametrize(
    ("answer", "reason"), [("cut", "max_output_tokens"), ("refused", "content_filter"), ("empty", "max_output_tokens")]
)
def test_an_answer_cut_short_is_incomplete_and_says_why(answer, reason):
    response = Response.model_validate(whole(ANSWERS[answer], turn()))

    assert (response.status, response.incomplete_details.reason) == ("incomplete", reason)
    assert all(item.status == "incomplete" for item in response.output[-1:])


def test_thinking_is_a_reasoning_item_sealed_and_summarised_when_asked():
    SEALED.clear()
    response = Response.model_validate(whole(ANSWERS["thinking"], turn(summary=True, seal=seal)))
    reasoning, answer = response.output

    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.summary] == [THINKING["thinking"]]
    assert json.loads(reasoning.encrypted_content) == [THINKING, REDACTED]
    assert SEALED == [[THINKING, REDACTED]]  # the blocks as the upstream wrote them, signature and all
    assert response.output_text == TEXT


def test_thinking_is_neither_summarised_nor_sealed_unless_asked():
    [reasoning, _] = Response.model_validate(whole(ANSWERS["thinking"], turn())).output
    assert (reasoning.summary, reasoning.encrypted_content) == ([], None)


def test_thinking_between_tool_calls_is_a_reasoning_item_before_each():
    SEALED.clear()
    response = Response.model_validate(whole(ANSWERS["interleaved"], turn(seal=seal)))

    assert [item.type for item in response.output] == ["reasoning", "function_call", "reasoning", "message"]
    assert [blocks[0]["signature"] for blocks in SEALED] == ["sig-1", "sig-2"]
    assert len({item.id for item in response.output}) == 4


# --- a stream


@pytest.mark.parametrize("per_batch", [1, 5, 1000], ids=["event-by-event", "batches", "one-batch"])
@pytest.mark.parametrize("name", list(ANSWERS))
def test_a_streams_last_event_holds_the_response_a_whole_reply_would(name, per_batch):
    answer = ANSWERS[name]
    reply_turn = turn(summary=True, seal=seal, echo={"instructions": "Be brief."})
    events = streamed(answer, reply_turn, per_batch=per_batch)

    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    last = "response.completed" if answer["stop_reason"] in ("end_turn", "tool_use") else "response.incomplete"
    assert kinds[-1] == last and kinds.count(last) == 1
    same_response(events[-1]["response"], whole(answer, reply_turn))
    # Each item's done event holds the item the response ends with, at its index.
    done = [event for event in events if event["type"] == "response.output_item.done"]
    assert [event["item"] for event in done] == events[-1]["response"]["output"]
    assert [event["output_index"] for event in done] == list(range(len(done)))


def test_text_streams_as_deltas_between_its_items_events():
    events = streamed(ANSWERS["text"], turn())

    kinds = [event["type"] for event in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(event["delta"] for event in deltas) == TEXT
    item_id = events[2]["item"]["id"]
    assert {(event["item_id"], event["output_index"], event["content_index"]) for event in deltas} == {(item_id, 0, 0)}
    assert events[-1]["response"]["usage"]["output_tokens"] == 25


def test_a_batchs_text_deltas_leave_as_one_event():
    events = streamed(ANSWERS["text"], turn(), per_batch=1000)
    [delta] = [event for event in events if event["type"] == "response.output_text.delta"]
    assert delta["delta"] == TEXT


def test_a_calls_arguments_stream_and_end_whole():
    events = streamed(ANSWERS["call"], turn())

    added = [event for event in events if event["type"] == "response.output_item.added"][1]
    assert (added["item"]["type"], added["item"]["status"], added["item"]["arguments"]) == (
        "function_call",
        "in_progress",
        "",
    )
    deltas = [event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert "".join(deltas) == done["arguments"] and json.loads(done["arguments"]) == CALL["input"]


def test_a_call_without_arguments_ends_with_an_empty_object():
    events = streamed(ANSWERS["no arguments"], turn())
    [done] = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == "{}"


PATCH = '*** Begin Patch\n*** Update File: "caf\u00e9.py"\n+print("\\t\U0001f600")\n*** End Patch'


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7, 13])
def test_a_custom_tools_input_streams_decoded_however_its_json_is_cut(chunk_size):
    """Escapes (a surrogate pair's among them) cut anywhere reach the client whole."""
    answer = message([{"type": "tool_use", "id": "toolu_02", "name": "apply_patch", "input": {"input": PATCH}}])
    json_text = json.dumps(answer["content"][0]["input"])  # escaped as Claude writes it: \uXXXX for é and 😀
    assert "\\ud83d\\ude00" in json_text
    events = MockUpstream._events(answer, Scenario(chunk_size=chunk_size))
    for event in events:  # the JSON as json.dumps writes it, not orjson
        if event.get("delta", {}).get("type") == "input_json_delta":
            event["delta"]["partial_json"] = ""
    at = next(n for n, event in enumerate(events) if event.get("delta", {}).get("type") == "input_json_delta")
    pieces = [json_text[i : i + chunk_size] for i in range(0, len(json_text), chunk_size)]
    events[at + 1 : at + 1] = [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": piece}}
        for piece in pieces
    ]
    sent = encode(events, turn(custom_tools=frozenset({"apply_patch"})))

    deltas = [event["delta"] for event in sent if event["type"] == "response.custom_tool_call_input.delta"]
    [done] = [event for event in sent if event["type"] == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done["input"] == PATCH
    assert len(deltas) > 1
    assert sent[-1]["response"]["output"][0]["input"] == PATCH


def test_a_custom_tools_input_cut_by_the_output_limit_is_what_came():
    answer = message([{"type": "tool_use", "id": "toolu_02", "name": "apply_patch", "input": {}}], "max_tokens")
    events = [event for event in MockUpstream._events(answer, Scenario()) if event["type"] != "content_block_delta"]
    at = next(n for n, event in enumerate(events) if event["type"] == "content_block_stop")
    events[at:at] = [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": piece}}
        for piece in ['{"input": "*** Begin', " Patch\\n*** Upd"]
    ]
    sent = encode(events, turn(custom_tools=frozenset({"apply_patch"})))

    deltas = [event["delta"] for event in sent if event["type"] == "response.custom_tool_call_input.delta"]
    [done] = [event for event in sent if event["type"] == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done["input"] == "*** Begin Patch\n*** Upd"
    assert sent[-1]["type"] == "response.incomplete"
    assert sent[-1]["response"]["output"][0]["input"] == "*** Begin Patch\n*** Upd"


def test_a_custom_tools_input_of_another_shape_comes_whole_at_its_end():
    answer = message([{"type": "tool_use", "id": "toolu_02", "name": "apply_patch", "input": {"other": 1}}])
    sent = streamed(answer, turn(custom_tools=frozenset({"apply_patch"})))
    deltas = [event["delta"] for event in sent if event["type"] == "response.custom_tool_call_input.delta"]
    [done] = [event for event in sent if event["type"] == "response.custom_tool_call_input.done"]
    assert deltas == [done["input"]] == ['{"other":1}']


def test_thinking_streams_as_a_summary_only_when_asked():
    summarised = streamed(ANSWERS["thinking"], turn(summary=True))
    kinds = [event["type"] for event in summarised]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
    ]
    [done] = [event for event in summarised if event["type"] == "response.reasoning_summary_text.done"]
    assert done["text"] == THINKING["thinking"]

    plain = [event["type"] for event in streamed(ANSWERS["thinking"], turn())]
    assert not [kind for kind in plain if "reasoning_summary" in kind]
    assert plain.count("response.output_item.done") == 2


def test_upstream_pings_become_comments():
    usage = StreamUsage()
    encoder = ResponsesEncoder(turn(), usage)
    assert encoder.ping == b": ping\n\n"
    events = MockUpstream._events(ANSWERS["text"], Scenario(pings=1))
    assert b"\n\n: ping\n\n" in encoder.encode(events[:3])


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "server_error"),
        ({"type": "error", "error": {"type": "rate_limit_error", "message": "Slow down"}}, "rate_limit_exceeded"),
        (error_event("The upstream stream ended early."), "server_error"),
    ],
    ids=["upstream", "rate limit", "gateway"],
)
def test_a_failure_after_the_start_ends_the_stream_as_response_failed(error, code):
    head = MockUpstream._events(ANSWERS["text"], Scenario(chunk_size=5))[:5]  # some text, no end
    events = encode([*head, error], turn())

    failed = events[-1]
    assert failed["type"] == "response.failed"
    response = Response.model_validate(failed["response"])
    assert (response.status, response.error.code, response.error.message) == ("failed", code, error["error"]["message"])
    assert response.output_text == TEXT[:10]  # what the client had, and no more
    assert response.usage is None  # not billed
    assert "response.completed" not in [event["type"] for event in events]


# --- through the gateway, with the openai SDK

WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def without_ids(response: Response) -> dict[str, Any]:
    """A response as JSON, less what differs between two requests for the same answer: the ids
    (made from the request's), and when it was made and completed."""
    data = response.model_dump(mode="json", exclude_none=True)
    for name in ("id", "created_at", "completed_at"):
        data.pop(name, None)
    for item in data["output"]:
        item.pop("id", None)
    return data


async def test_sdk_create_answers_with_text(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], usage={"input_tokens": 12, "output_tokens": 9}))
    response = await client.responses.create(model=MODEL, input="What is the capital of France?")

    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model, response.output_text) == ("completed", MODEL, TEXT)
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (12, 9, 21)


async def test_sdk_create_calls_a_function(client, upstream):
    response = await client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=WEATHER, tool_choice="required"
    )

    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("toolu_") and json.loads(call.arguments) == {"city": "mock"}
    assert response.tools[0].name == "get_weather" and response.status == "completed"


async def test_sdk_create_says_when_the_output_limit_cut_the_answer(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Paris is"}], stop_reason="max_tokens"))
    response = await client.responses.create(model=MODEL, input="Tell me about Paris.", max_output_tokens=16)

    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.output_text == "Paris is" and response.max_output_tokens == 16


async def test_sdk_stream_gives_the_text_and_the_response_create_would(client, upstream):
    answer = [{"type": "text", "text": TEXT}]
    upstream.enqueue(Scenario(blocks=answer, chunk_size=4, event_delay=0.005), Scenario(blocks=answer))
    async with client.responses.stream(model=MODEL, input="What is the capital of France?") as stream:
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        streamed_response = await stream.get_final_response()
    created = await client.responses.create(model=MODEL, input="What is the capital of France?")

    assert len(deltas) > 1 and "".join(deltas) == TEXT == streamed_response.output_text
    assert without_ids(streamed_response) == without_ids(created)


async def test_sdk_stream_gives_a_calls_arguments(client, upstream):
    async with client.responses.stream(
        model=MODEL, input="Weather in Paris?", tools=WEATHER, tool_choice="required"
    ) as stream:
        deltas = [event.delta async for event in stream if event.type == "response.function_call_arguments.delta"]
        response = await stream.get_final_response()

    [call] = response.output
    assert call.type == "function_call" and "".join(deltas) == call.arguments
    assert json.loads(call.arguments) == {"city": "mock"}


async def test_sdk_thinking_comes_back_as_a_summary_when_asked(client, upstream):
    thinking = {"type": "thinking", "thinking": "France's capital: Paris.", "signature": "sig"}
    upstream.enqueue(Scenario(blocks=[thinking, {"type": "text", "text": TEXT}]))
    async with client.responses.stream(
        model=MODEL, input="Capital of France?", reasoning={"effort": "medium", "summary": "auto"}
    ) as stream:
        summary = [event.delta async for event in stream if event.type == "response.reasoning_summary_text.delta"]
        response = await stream.get_final_response()

    reasoning, answer = response.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.summary] == [thinking["thinking"]]
    assert "".join(summary) == thinking["thinking"] and response.output_text == TEXT


async def raw_stream(gateway, body: dict[str, Any]) -> str:
    """A streamed request's body, as sent."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/responses",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": True, "input": "Hello", **body},
        ) as reply:
            assert reply.status == 200 and reply.content_type == "text/event-stream"
            return (await reply.read()).decode()


async def raw_events(gateway, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed request's SSE events, as (event name, data), the `: ping` comments left out."""
    events = []
    for frame in (await raw_stream(gateway, body)).split("\n\n")[:-1]:
        if frame.startswith(":"):
            continue
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_a_stream_ends_with_response_completed_and_no_done_line(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}]))
    events = await raw_events(gateway, {})

    assert [name for name, _ in events][:2] == ["response.created", "response.in_progress"]
    assert (
        events[-1][0] == "response.completed" and events[-1][1]["response"]["output"][0]["content"][0]["text"] == TEXT
    )
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)


async def test_the_gateway_pings_a_quiet_stream_with_comments(start_gateway, upstream):
    gateway = await start_gateway(ping_interval=0.2)
    # 0.7 s between events: with nothing to send for 0.2 s the gateway sends its own ping.
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "slow"}], pings=0, event_delay=0.7, chunk_size=2))
    text = await raw_stream(gateway, {})

    assert text.count("\n\n: ping\n\n") >= 3
    assert text.endswith("\n\n") and '"type":"response.completed"' in text.rsplit("\n\n", 2)[-2]


async def test_an_upstream_cut_mid_stream_is_response_failed(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, event_delay=0.005, drop_after=5))
    events = await raw_events(gateway, {})

    name, data = events[-1]
    assert name == "response.failed"
    assert data["response"]["error"] == {"code": "server_error", "message": "The upstream stream ended early."}
    assert data["response"]["output"][0]["status"] == "incomplete"


async def test_a_failure_mid_stream_is_response_failed_and_unbilled(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": TEXT}], chunk_size=2, error_after=5))
    events = await raw_events(gateway, {})

    name, data = events[-1]
    assert name == "response.failed"
    assert data["response"]["status"] == "failed" and data["response"]["error"]["code"] == "server_error"
    assert "response.completed" not in [name for name, _ in events]
    assert await gateway.app[STORE].ledger() == []


async def test_a_streams_done_items_sent_back_restore_its_thinking(client, upstream):
    """As Codex keeps a conversation: the items of each output_item.done, sent back with the
    call's output; the sealed thinking goes upstream again as Claude wrote it."""
    thought = {"type": "thinking", "thinking": "The user wants Oslo's weather.", "signature": "sig-1"}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    upstream.enqueue(Scenario(blocks=[thought, call]), Scenario(blocks=[{"type": "text", "text": "Sunny."}]))
    asked = {
        "model": MODEL,
        "tools": WEATHER,
        "reasoning": {"effort": "high"},
        "include": ["reasoning.encrypted_content"],
    }
    async with client.responses.stream(input="Weather in Oslo?", **asked) as stream:
        done = [event.item async for event in stream if event.type == "response.output_item.done"]

    assert [item.type for item in done] == ["reasoning", "function_call"]
    assert done[0].encrypted_content and "Oslo" not in done[0].encrypted_content
    history = [{"role": "user", "content": "Weather in Oslo?"}, *(item.model_dump(exclude_none=True) for item in done)]
    history.append({"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"})
    answer = await client.responses.create(input=history, **asked)

    assert answer.output_text == "Sunny."
    body = upstream.requests[-1].body
    assert body["messages"][1] == {"role": "assistant", "content": [thought, call]}
    assert body["thinking"]["type"] in ("adaptive", "enabled")


# --- the official OpenAI SDK for Node.js (conftest's NODE_SDK)

NODE_STREAM = """
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.EZAT_BASE_URL, apiKey: process.env.EZAT_API_KEY, maxRetries: 0 });
const tools = [{
  type: "function", name: "get_weather", strict: false,
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
}];
const stream = client.responses.stream({ model: process.env.EZAT_MODEL, input: "Weather in Paris?", tools });
const kinds = [];
let text = "";
for await (const event of stream) {
  kinds.push(event.type);
  if (event.type === "response.output_text.delta") text += event.delta;
}
const response = await stream.finalResponse();
const created = await client.responses.create({ model: process.env.EZAT_MODEL, input: "Hello" });
console.log(JSON.stringify({ kinds, text, response, created_text: created.output_text }));
"""


async def test_node_sdk_streams_a_response_and_creates_one(gateway, upstream, node_sdk):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Let me look."}, call]))
    with tempfile.TemporaryDirectory(prefix="ezat-test-", dir=node_sdk) as where:  # beside its node_modules
        program = Path(where) / "responses.mjs"
        program.write_text(NODE_STREAM)
        process = await asyncio.create_subprocess_exec(
            "node",
            str(program),
            env={**os.environ, "EZAT_BASE_URL": gateway.url + "/openai/v1", "EZAT_API_KEY": KEY, "EZAT_MODEL": MODEL},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, (output + errors).decode()
    result = json.loads(output)

    assert result["kinds"][:2] == ["response.created", "response.in_progress"]
    assert result["kinds"][-1] == "response.completed" and result["text"] == "Let me look."
    response = Response.model_validate(result["response"])
    assert response.output_text == "Let me look." and response.output[1].name == "get_weather"
    assert json.loads(response.output[1].arguments) == {"city": "Paris"}
    assert result["created_text"] == "Hello from the mock upstream. You said: Hello"
