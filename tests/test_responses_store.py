"""Stored responses (docs/api.md, "Stored responses"): `store`, `previous_response_id`, and the
routes that read a kept response, through the real gateway on loopback in front of the mock
upstream, with the official openai SDK. Each continuation test checks what the upstream received."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import sqlite3

import aiohttp
import openai
import pytest

from gateway.config import KeyConfig, ResponsesConfig
from gateway.mock.upstream import MockUpstream, Scenario
from tests.support import KEY, MODEL, make_config

OTHER_KEY = "sk-other-key"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_SCHEMA}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
THOUGHT = {"type": "thinking", "thinking": "The user wants Oslo's weather.", "signature": "sig-1"}


def text(words: str) -> Scenario:
    return Scenario(blocks=[{"type": "text", "text": words}])


def config(upstream: MockUpstream, storage_url: str = "sqlite:///:memory:", retention_days: int = 30):
    """The test config with a second key, and responses kept `retention_days`."""
    base = make_config(upstream.url, storage_url)
    other = KeyConfig(name="other", key_sha256=hashlib.sha256(OTHER_KEY.encode()).hexdigest())
    return dataclasses.replace(base, keys=(*base.keys, other), responses=ResponsesConfig(retention_days=retention_days))


@pytest.fixture
async def gateway(start_gateway, upstream):
    return await start_gateway(config(upstream))


@pytest.fixture
async def client(gateway):
    """Caching off: what the upstream receives is the translation's work alone."""
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as c:
        yield c


def sent(upstream: MockUpstream) -> dict:
    return upstream.requests[-1].body


async def not_found(call) -> dict:
    with pytest.raises(openai.NotFoundError) as caught:
        await call
    return caught.value.body


async def test_a_created_response_is_retrieved_as_it_was_answered(client, upstream):
    upstream.enqueue(text("Paris."))
    created = await client.responses.create(model=MODEL, input="Capital of France?", metadata={"topic": "geo"})
    retrieved = await client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    assert retrieved.output_text == "Paris." and retrieved.store is True


async def test_input_items_are_listed_with_ids_newest_first_and_page(client, upstream):
    upstream.enqueue(text("Done."))
    created = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "One"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Three"}]},
        ],
    )
    listed = await client.responses.input_items.list(created.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Three", "Two", "One", "Be brief."]  # desc by default, as OpenAI's
    assert all(item.id for item in listed.data) and len({item.id for item in listed.data}) == 4
    assert (listed.first_id, listed.last_id, listed.has_more) == (listed.data[0].id, listed.data[-1].id, False)

    first = await client.responses.input_items.list(created.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == ["Be brief.", "One"] and first.has_more
    rest = await client.responses.input_items.list(created.id, order="asc", limit=2, after=first.last_id)
    assert [item.content[0].text for item in rest.data] == ["Two", "Three"] and not rest.has_more

    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.input_items.list(created.id, limit=500)
    assert caught.value.body["param"] == "limit"


async def test_a_deleted_response_is_gone(client, gateway, upstream):
    upstream.enqueue(text("Paris."))
    created = await client.responses.create(model=MODEL, input="Capital of France?")
    async with aiohttp.ClientSession() as http:
        url = f"{gateway.url}/v1/responses/{created.id}"
        async with http.delete(url, headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200
            assert await response.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    error = await not_found(client.responses.retrieve(created.id))
    assert error == {
        "message": f"Response with id '{created.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    await not_found(client.responses.delete(created.id))  # deleted once


async def test_another_keys_response_is_not_found(client, gateway, upstream):
    upstream.enqueue(text("Paris."))
    created = await client.responses.create(model=MODEL, input="Capital of France?")
    async with gateway.client(api_key=OTHER_KEY) as other:
        await not_found(other.responses.retrieve(created.id))
        await not_found(other.responses.input_items.list(created.id))
        await not_found(other.responses.delete(created.id))
        upstream.enqueue(text("?"))
        with pytest.raises(openai.BadRequestError) as caught:
            await other.responses.create(model=MODEL, input="And Spain?", previous_response_id=created.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["message"] == f"Previous response with id '{created.id}' not found."
    assert (await client.responses.retrieve(created.id)).output_text == "Paris."  # still its maker's
    await not_found(client.responses.retrieve("resp_unknown"))


async def continuation(client: openai.AsyncOpenAI, upstream: MockUpstream) -> None:
    upstream.enqueue(text("Paris."), text("Madrid."))
    first = await client.responses.create(
        model=MODEL,
        instructions="Answer in one word.",
        input=[{"role": "developer", "content": "Geography only."}, {"role": "user", "content": "France?"}],
    )
    second = await client.responses.create(
        model=MODEL, instructions="Answer in a sentence.", input="Spain?", previous_response_id=first.id
    )
    assert second.output_text == "Madrid." and second.previous_response_id == first.id
    body = sent(upstream)
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "France?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
        {"role": "user", "content": [{"type": "text", "text": "Spain?"}]},
    ]
    # The new instructions, not the old ones (OpenAI carries none over), then the conversation's
    # developer message.
    assert [block["text"] for block in body["system"]] == ["Answer in a sentence.", "Geography only."]
    # A third turn continues the second, and so the whole conversation.
    upstream.enqueue(text("Rome."))
    await client.responses.create(model=MODEL, input="Italy?", previous_response_id=second.id)
    assert [turn["content"][0]["text"] for turn in sent(upstream)["messages"]] == [
        "France?",
        "Paris.",
        "Spain?",
        "Madrid.",
        "Italy?",
    ]
    assert [block["text"] for block in sent(upstream)["system"]] == ["Geography only."]


async def test_previous_response_id_sends_the_earlier_turns_before_the_new_one(client, upstream):
    await continuation(client, upstream)


async def test_previous_response_id_continues_on_postgresql(start_gateway, upstream, postgres_url):
    gateway = await start_gateway(config(upstream, postgres_url))
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as client:
        await continuation(client, upstream)


async def test_thinking_carries_across_a_tool_call_by_previous_response_id(client, upstream):
    upstream.enqueue(Scenario(blocks=[THOUGHT, CALL]), text("Sunny."))
    asked = {"model": MODEL, "tools": [WEATHER], "reasoning": {"effort": "high"}}
    first = await client.responses.create(input="Weather in Oslo?", **asked)
    [call] = [item for item in first.output if item.type == "function_call"]
    answer = await client.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        previous_response_id=first.id,
        **asked,
    )
    assert answer.output_text == "Sunny."
    body = sent(upstream)
    assert body["messages"][1] == {"role": "assistant", "content": [THOUGHT, CALL]}  # signature and all
    assert body["messages"][2]["content"][0]["type"] == "tool_result"
    assert body["thinking"]["type"] in ("adaptive", "enabled")


async def test_item_references_bring_back_the_stored_items_thinking_and_all(client, upstream):
    # As the Vercel AI SDK continues a tool loop while it stores responses: the reasoning and the
    # text by reference, the call itself, then its output.
    upstream.enqueue(Scenario(blocks=[THOUGHT, {"type": "text", "text": "Let me look."}, CALL]), text("Sunny."))
    asked = {"model": MODEL, "tools": [WEATHER], "reasoning": {"effort": "high"}}
    first = await client.responses.create(input="Weather in Oslo?", **asked)
    reasoning, message, call = first.output
    assert (reasoning.type, message.type, call.type) == ("reasoning", "message", "function_call")
    answer = await client.responses.create(
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "item_reference", "id": reasoning.id},
            {"type": "item_reference", "id": message.id},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
        **asked,
    )
    assert answer.output_text == "Sunny."
    body = sent(upstream)
    assert body["messages"][1] == {
        "role": "assistant",
        "content": [THOUGHT, {"type": "text", "text": "Let me look."}, CALL],  # the signature too
    }
    assert body["thinking"]["type"] in ("adaptive", "enabled")  # on, since the thinking came back
    # An input item is found by reference too, by the id input_items gives it.
    [listed, *_] = (await client.responses.input_items.list(answer.id, order="asc")).data
    upstream.enqueue(text("Still sunny."))
    await client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": listed.id}])
    assert sent(upstream)["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}]


async def test_an_item_reference_the_key_cannot_read_is_a_400_naming_it(client, gateway, upstream):
    upstream.enqueue(text("Paris."), text("Rome."))
    kept = await client.responses.create(model=MODEL, input="Capital of France?")
    unkept = await client.responses.create(model=MODEL, input="Capital of Italy?", store=False)
    async with gateway.client(api_key=OTHER_KEY) as other:
        for caller, item_id in (
            (other, kept.output[0].id),  # another key's
            (client, unkept.output[0].id),  # never stored
            (client, "msg_unknown"),  # not one of the gateway's
            (client, kept.output[0].id.replace("msg_", "fc_")),  # the response's, but no such item
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                await caller.responses.create(
                    model=MODEL, input=[{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": item_id}]
                )
            assert caught.value.body["param"] == "input[1].id"
            assert caught.value.body["message"] == (
                f"input[1].id: no stored response of this key has an item with id {item_id!r}"
            )
    assert len(upstream.requests) == 2  # each refused before any upstream call


async def test_references_to_more_than_a_hundred_responses_are_refused(client, upstream):
    references = [{"type": "item_reference", "id": f"msg_{i:04d}_0"} for i in range(101)]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}, *references])
    assert caught.value.body["param"] == "input"
    assert caught.value.body["message"] == "input: item references name 101 responses; at most 100 may be named"
    assert upstream.requests == []


async def test_store_false_keeps_nothing(client, upstream):
    upstream.enqueue(text("Paris."), text("?"))
    created = await client.responses.create(model=MODEL, input="Capital of France?", store=False)
    assert created.store is False
    await not_found(client.responses.retrieve(created.id))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input="And Spain?", previous_response_id=created.id)
    assert caught.value.body["param"] == "previous_response_id"
    assert len(upstream.requests) == 1  # refused before any upstream call


async def test_retention_days_zero_keeps_nothing(start_gateway, upstream):
    gateway = await start_gateway(config(upstream, retention_days=0))
    upstream.enqueue(text("Paris."))
    async with gateway.client() as client:
        created = await client.responses.create(model=MODEL, input="Capital of France?")
        await not_found(client.responses.retrieve(created.id))


async def test_a_streamed_response_is_kept_once_it_completes(client, upstream):
    upstream.enqueue(Scenario(blocks=[THOUGHT, CALL]), text("Sunny."))
    asked = {"model": MODEL, "tools": [WEATHER], "reasoning": {"effort": "high"}}
    async with client.responses.stream(input="Weather in Oslo?", **asked) as stream:
        final = await stream.get_final_response()
    retrieved = await client.responses.retrieve(final.id)
    assert retrieved.status == "completed" and [item.type for item in retrieved.output] == [
        "reasoning",
        "function_call",
    ]
    # Its thinking was gathered from the stream's deltas, signature and all.
    await client.responses.create(
        input=[{"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"}],
        previous_response_id=final.id,
        **asked,
    )
    assert sent(upstream)["messages"][1] == {"role": "assistant", "content": [THOUGHT, CALL]}


async def test_a_failed_stream_is_not_kept(client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Once upon a time"}], chunk_size=2, error_after=5))
    async with client.responses.stream(model=MODEL, input="A story") as stream:
        events = [event async for event in stream]
    [failed] = [event for event in events if event.type == "response.failed"]
    await not_found(client.responses.retrieve(failed.response.id))


async def test_a_write_that_fails_is_logged_and_the_answer_stands(start_gateway, upstream, tmp_path, caplog):
    path = tmp_path / "ezat.db"
    gateway = await start_gateway(config(upstream, f"sqlite:///{path}"))
    with sqlite3.connect(path) as db:  # the database refuses every stored response from now on
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON responses BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    upstream.enqueue(text("Paris."))
    async with gateway.client() as client:
        created = await client.responses.create(model=MODEL, input="Capital of France?")
        assert created.output_text == "Paris."
        await not_found(client.responses.retrieve(created.id))
    assert f"keeping response {created.id} failed, so it is not stored" in caplog.text


async def test_responses_kept_together_survive_one_the_database_refuses(start_gateway, upstream, tmp_path, caplog):
    path = tmp_path / "ezat.db"
    gateway = await start_gateway(config(upstream, f"sqlite:///{path}"))
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON responses WHEN NEW.input_items LIKE '%poison%'"
            " BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )
    questions = [f"Question {i}?" for i in range(12)] + ["poison"]
    upstream.enqueue(*(text("Yes.") for _ in questions))
    async with gateway.client() as client:
        created = await asyncio.gather(*(client.responses.create(model=MODEL, input=q) for q in questions))
        *kept, refused = created
        for response in kept:
            assert (await client.responses.retrieve(response.id)).output_text == "Yes."
        await not_found(client.responses.retrieve(refused.id))
    assert f"keeping response {refused.id} failed, so it is not stored" in caplog.text
    assert caplog.text.count("failed, so it is not stored") == 1
