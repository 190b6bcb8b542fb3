"""Non-streaming chat completions through the official openai SDK, checked on both sides:
what the client got and what the upstream received."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import openai
import pytest

from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.requests_util import SPEC_IGNORED_FIELDS, echo
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, make_config


async def test_plain_text_round_trip(gateway, client, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "A prompt cache stores prefixes."}]))
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        max_completion_tokens=64,
        messages=[
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is a prompt cache?"},
        ],
    )
    completion = raw.parse()

    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == "A prompt cache stores prefixes."
    assert choice.message.refusal is None
    assert choice.finish_reason == "stop"
    request_id = raw.headers["request-id"]
    assert raw.headers["x-request-id"] == request_id
    assert completion.id == "chatcmpl-" + request_id
    assert raw.request_id == request_id

    sent = upstream.requests[-1]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == UPSTREAM_KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.body == {
        "model": UPSTREAM_MODEL,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Answer in one sentence."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is a prompt cache?"}]}],
    }


async def test_sync_client(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "sync works"}]))
    with gateway.sync_client() as sync:
        completion = await asyncio.to_thread(
            sync.chat.completions.create, model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert completion.choices[0].message.content == "sync works"
    assert completion.model == MODEL


@pytest.mark.parametrize("stream", [False, True])
async def test_an_alias_is_answered_under_the_name_sent(start_gateway, upstream, stream):
    config = make_config(upstream.url)
    model = dataclasses.replace(config.models[0], aliases=("sonnet",))
    gateway = await start_gateway(dataclasses.replace(config, models=(model, *config.models[1:])))
    async with gateway.client() as client:
        if stream:
            chunks = [
                chunk
                async for chunk in await client.chat.completions.create(
                    model="sonnet", stream=True, messages=[{"role": "user", "content": "hi"}]
                )
            ]
            assert {chunk.model for chunk in chunks} == {"sonnet"}
        else:
            completion = await client.chat.completions.create(
                model="sonnet", messages=[{"role": "user", "content": "hi"}]
            )
            assert completion.model == "sonnet"  # exactly the name sent, not the model's id
    assert upstream.requests[0].body["model"] == UPSTREAM_MODEL
    [row] = await gateway.app[STORE].ledger()
    assert row.model == MODEL  # the ledger names the model by its id


async def test_stream_null_is_a_request_not_streamed(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "not streamed"}]))
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/openai/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL, "stream": None, "messages": [{"role": "user", "content": "hi"}]},
        ) as response:
            assert (response.status, response.content_type) == (200, "application/json")
            body = await response.json()
    assert body["choices"][0]["message"]["content"] == "not streamed"
    assert "stream" not in upstream.requests[0].body


async def test_each_request_gets_its_own_id(client):
    raw_first = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}]
    )
    raw_second = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "b"}]
    )
    first, second = raw_first.parse(), raw_second.parse()
    assert first.id.startswith("chatcmpl-") and second.id.startswith("chatcmpl-")
    assert first.id != second.id
    # Each id is its own request's id, the one in the request-id header.
    assert first.id == "chatcmpl-" + raw_first.headers["request-id"]
    assert second.id == "chatcmpl-" + raw_second.headers["request-id"]


async def test_system_and_developer_messages_join_wherever_they_are(client, upstream):
    await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": [{"type": "text", "text": "Use British spelling."}]},
            {"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "text", "text": "Now."}]},
        ],
    )
    body = upstream.requests[-1].body
    assert body["system"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Use British spelling."},
    ]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "text", "text": "Now."}]},
    ]


async def test_consecutive_same_role_messages_merge_and_empty_text_is_dropped(client, upstream):
    await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "one"},
            {"role": "user", "content": "   "},
            {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "two"}]},
        ],
    )
    assert upstream.requests[-1].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    ]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_completion_tokens": 100, "max_tokens": 50}, 100),  # max_completion_tokens wins
        ({"max_tokens": 50}, 50),
        ({}, 32000),  # neither: 32,000 ...
    ],
)
async def test_output_limit(client, upstream, fields, expected):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **fields)
    assert upstream.requests[-1].body["max_tokens"] == expected


async def test_output_limit_defaults_to_a_lower_model_maximum(client, upstream):
    await client.chat.completions.create(model="test/small", messages=[{"role": "user", "content": "x"}])
    assert upstream.requests[-1].body == {
        "model": "small-1",  # ... or the model's maximum when that is lower
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: expected a positive integer"),
        ({"max_completion_tokens": "10"}, "max_completion_tokens: expected a positive integer"),
        ({"max_completion_tokens": 64001}, "max_completion_tokens: at most 64000 for this model"),
    ],
)
async def test_bad_output_limit_is_a_400(client, upstream, fields, message):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **fields)
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "message": message,
        "type": "invalid_request_error",
        "param": message.split(":")[0],
        "code": None,
    }
    assert caught.value.body["message"] == message
    assert caught.value.body["param"] in fields
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("stop", "sequences"),
    [("END", ["END"]), (["\n\nUser:", "STOP", " ", "\n"], ["\n\nUser:", "STOP"]), ([], None)],
)
async def test_stop_sequences(client, upstream, stop, sequences):
    upstream.enqueue(
        Scenario(blocks=[{"type": "text", "text": "up to"}], stop_reason="stop_sequence", stop_sequence="END")
    )
    completion = await client.chat.completions.create(
        model=MODEL, stop=stop, messages=[{"role": "user", "content": "x"}]
    )
    assert upstream.requests[-1].body.get("stop_sequences") == sequences
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == "up to"


async def test_openai_only_fields_never_reach_the_upstream(client, upstream):
    # The mock rejects unknown fields as the real API does ("Extra inputs are not permitted").
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        **SPEC_IGNORED_FIELDS,
        stream=False,
        extra_body={"some_unknown_field": 1},
    )
    assert completion.choices[0].message.content
    assert completion.choices[0].message.content == echo("x")
    assert set(upstream.requests[-1].body) == {"model", "max_tokens", "messages"}
    assert upstream.requests[-1].body == {
        "model": UPSTREAM_MODEL,
        "max_tokens": 32000,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }


async def test_usage_counts_all_input_cached_or_not(client, upstream):
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "ok"}],
            usage={
                "input_tokens": 21,
                "cache_read_input_tokens": 188086,
                "cache_creation_input_tokens": 1000,
                "output_tokens": 393,
                "thinking_tokens": 250,
            },
        )
    )
    completion = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    usage = completion.usage
    assert usage.prompt_tokens == 21 + 188086 + 1000
    assert usage.completion_tokens == 393
    assert usage.total_tokens == 21 + 188086 + 1000 + 393
    assert usage.prompt_tokens_details.cached_tokens == 188086
    assert usage.prompt_tokens_details.cache_write_tokens == 1000
    assert usage.completion_tokens_details.reasoning_tokens == 250
    assert completion.choices[0].message.content == "ok"  # thinking text is not returned


async def test_reasoning_tokens_are_estimated_from_thinking_text_when_the_upstream_does_not_say(client, upstream):
    thinking = "x" * 400  # ≈ 100 tokens at 4 characters a token
    upstream.enqueue(
        Scenario(
            blocks=[{"type": "thinking", "thinking": thinking, "signature": "s"}, {"type": "text", "text": "ok"}],
            usage={"output_tokens": 150},
        )
    )
    completion = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert completion.usage.completion_tokens_details.reasoning_tokens == 100
    assert completion.usage.completion_tokens == 150


async def test_raw_http_response_shape(gateway, upstream):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "hi"}], usage={"input_tokens": 5, "output_tokens": 2}))
    before = int(time.time())
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + "/v1/chat/completions",  # the alias without /openai
            headers={"x-api-key": KEY},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        ) as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            body = await response.json()
    after = int(time.time())
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert isinstance(body["created"], int)
    assert before <= body["created"] <= after  # Unix seconds, when the request was answered
    assert body["id"] == "chatcmpl-" + response.headers["request-id"]
    assert (body["object"], body["model"]) == ("chat.completion", MODEL)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


async def test_many_concurrent_requests_share_one_upstream_pool(client, upstream):
    results = await asyncio.gather(
        *(
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"n{i}"}])
            for i in range(50)
        )
    )
    assert [r.choices[0].message.content.rsplit(" ", 1)[-1] for r in results] == [f"n{i}" for i in range(50)]
    assert len(upstream.requests) == 50


async def test_request_ids_are_unique_and_later_ones_sort_later(gateway, client, upstream):
    # The ledger's unique index on request ids grows at its end only if later ids sort later.
    async def ask() -> str:
        upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "ok"}]))
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        return raw.headers["x-request-id"]

    in_turn = []
    for _ in range(3):
        before = time.time_ns() // 1000
        in_turn.append(await ask())
        assert before <= int(in_turn[-1][:13], 16) <= time.time_ns() // 1000  # its first 13 digits: when, in µs
        await asyncio.sleep(0.002)
    assert in_turn == sorted(in_turn)
    assert len(set(in_turn)) == 3
    together = await asyncio.gather(*(ask() for _ in range(50)))
    assert len(set(together) | set(in_turn)) == 53
    assert all(len(rid) == 24 and int(rid, 16) >= 0 for rid in together)
