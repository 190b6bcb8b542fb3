"""OpenAI's Responses API on Claude, the request side and the route (docs/api.md, "Responses API"):
through the real gateway on loopback in front of the mock upstream, with the official openai
SDK's `client.responses` (raw posts for what the SDK will not send). Each test checks what the
upstream received, and what the client got back."""

from __future__ import annotations

import base64
import dataclasses
from decimal import Decimal

import aiohttp
import openai
import pytest

from gateway.config import BoundsConfig, ImagesConfig, ResponsesConfig
from gateway.mock.upstream import MockUpstream, Scenario
from tests.support import KEY, MODEL, UPSTREAM_MODEL, make_config, read_store
from tests.test_admin_api import ADMIN, Admin
from tests.test_images import PNG, ImageServer
from tests.test_operations import scrape

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_SCHEMA}
UPSTREAM_WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}
OSLO = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
ENCRYPTED = "reasoning.encrypted_content"
THOUGHT = {"type": "thinking", "thinking": "The user wants Oslo's weather.", "signature": "sig-1"}


@pytest.fixture
async def client(gateway):
    """Caching off: what the upstream receives is the translation's work alone."""
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as c:
        yield c


def sent(upstream: MockUpstream) -> dict:
    """The body of the last request the upstream received."""
    return upstream.requests[-1].body


async def refused(client: openai.AsyncOpenAI, upstream: MockUpstream, **kwargs) -> dict:
    """The 400 error object of a refused request, once it is sure the upstream got nothing."""
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("input", "Hi")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert upstream.requests == []
    return caught.value.body


async def post(gateway, body: dict, path: str = "/v1/responses") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            gateway.url + path, headers={"Authorization": f"Bearer {KEY}", "x-ezat-cache": "off"}, json=body
        ) as response:
            return response.status, await response.json()


# --- input


async def test_a_string_input_is_one_user_turn_and_the_answer_reads_as_output_text(client, upstream):
    reply = await client.responses.create(model=MODEL, input="Hello there")
    assert sent(upstream) == {
        "model": UPSTREAM_MODEL,
        "max_tokens": 32000,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    }
    assert reply.output_text == "Hello from the mock upstream. You said: Hello there"
    assert reply.id.startswith("resp_") and reply.model == MODEL and reply.status == "completed"
    assert (
        reply.usage.input_tokens > 0
        and reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    )


async def test_both_paths_answer_and_a_response_id_is_the_request_id(gateway, upstream):
    for path in ("/v1/responses", "/openai/v1/responses"):
        async with aiohttp.ClientSession() as http:
            async with http.post(
                gateway.url + path, headers={"Authorization": f"Bearer {KEY}"}, json={"model": MODEL, "input": "Hi"}
            ) as response:
                assert response.status == 200
                assert (await response.json())["id"] == "resp_" + response.headers["request-id"]


async def test_instructions_then_system_and_developer_messages_make_the_system_prompt(client, upstream):
    await client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "id": "msg_from_elsewhere",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}],
            },
            {"role": "system", "content": [{"type": "input_text", "text": "No emoji."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
        ],
    )
    body = sent(upstream)
    assert body["system"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Answer in English."},
        {"type": "text", "text": "No emoji."},
    ]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]


async def test_the_mock_quotes_what_the_person_wrote_not_the_context_codex_adds(client, upstream):
    """Codex's first turn: its AGENTS.md instructions and environment as user messages before the
    prompt, which is what the mock upstream's unscripted answer quotes."""
    context = [
        "# AGENTS.md instructions for /work\n\n<INSTRUCTIONS>\nBe terse.\n</INSTRUCTIONS>",
        "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>",
        "List the files",
    ]
    reply = await client.responses.create(
        model=MODEL,
        input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]} for t in context],
    )
    assert reply.output_text == "Hello from the mock upstream. You said: List the files"


async def test_max_output_tokens_is_the_output_limit_within_the_models_maximum(client, upstream):
    await client.responses.create(model=MODEL, input="Hi", max_output_tokens=500)
    assert sent(upstream)["max_tokens"] == 500
    upstream.requests.clear()
    error = await refused(client, upstream, max_output_tokens=64001)
    assert error["message"] == "max_output_tokens: at most 64000 for this model"
    assert error["param"] == "max_output_tokens"


async def test_ignored_fields_change_nothing_upstream(gateway, upstream):
    status, _ = await post(
        gateway,
        {
            "model": MODEL,
            "input": "Hi",
            "metadata": {"k": "v"},
            "user": "u1",
            "safety_identifier": "s1",
            "service_tier": "auto",
            "client_metadata": {"a": 1},
            "truncation": "disabled",
            "store": False,
            "text": {"verbosity": "low"},
            "include": ["reasoning.encrypted_content"],
            "something_new": True,
        },
    )
    assert status == 200
    assert sent(upstream) == {
        "model": UPSTREAM_MODEL,
        "max_tokens": 32000,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }


# --- tools


async def test_function_tools_with_strict_and_a_named_tool_choice(client, upstream):
    await client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[{**WEATHER, "strict": True}, {"type": "web_search"}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    body = sent(upstream)
    assert body["tools"] == [{**UPSTREAM_WEATHER, "strict": True}]  # web_search left out
    assert body["tool_choice"] == {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    await client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required")
    assert sent(upstream)["tool_choice"] == {"type": "any"}


async def test_a_function_call_and_its_outputs_round_trip(client, upstream):
    second = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}}
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": "Checking."}, OSLO, second]))
    first = await client.responses.create(model=MODEL, input="Weather in Oslo and Bergen?", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("toolu_1", "get_weather", '{"city":"Oslo"}'),
        ("toolu_2", "get_weather", '{"city":"Bergen"}'),
    ]
    history = [{"role": "user", "content": "Weather in Oslo and Bergen?"}, *[i.model_dump() for i in first.output]]
    history += [
        {"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "toolu_2", "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    second_reply = await client.responses.create(model=MODEL, input=history, tools=[WEATHER])
    assert second_reply.status == "completed"
    assert sent(upstream)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Bergen?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, OSLO, second]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "Rain"}]},
            ],
        },
    ]


async def test_a_custom_tool_gets_one_string_property_and_its_grammar(client, upstream):
    grammar = {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}
    tool = {"type": "custom", "name": "apply_patch", "description": "Applies a patch", "format": grammar}
    upstream.enqueue(
        Scenario(blocks=[{"type": "tool_use", "id": "toolu_9", "name": "apply_patch", "input": {"input": "abc"}}])
    )
    reply = await client.responses.create(
        model=MODEL, input="Patch it", tools=[tool], tool_choice={"type": "custom", "name": "apply_patch"}
    )
    (definition,) = sent(upstream)["tools"]
    assert definition["input_schema"] == {
        "type": "object",
        "properties": {"input": {"type": "string"}},
        "required": ["input"],
    }
    assert definition["description"] == "Applies a patch\n\nThe `input` string must match this regex grammar:\n[a-z]+"
    assert sent(upstream)["tool_choice"] == {"type": "tool", "name": "apply_patch"}
    (call,) = reply.output
    assert (call.type, call.call_id, call.name, call.input) == ("custom_tool_call", "toolu_9", "apply_patch", "abc")
    history = [{"role": "user", "content": "Patch it"}, call.model_dump()]
    history.append({"type": "custom_tool_call_output", "call_id": "toolu_9", "output": "applied"})
    await client.responses.create(model=MODEL, input=history, tools=[tool])
    assert sent(upstream)["messages"][1:] == [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_9", "name": "apply_patch", "input": {"input": "abc"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": [{"type": "text", "text": "applied"}]}
            ],
        },
    ]


async def test_a_namespaces_tools_are_flattened_and_their_calls_come_back_named_as_sent(gateway, upstream):
    namespace = {"type": "namespace", "name": "crm", "description": "Customer records", "tools": [WEATHER]}
    upstream.enqueue(Scenario(blocks=[{**OSLO, "name": "crm__get_weather"}]))
    status, reply = await post(gateway, {"model": MODEL, "input": "Weather?", "tools": [namespace]})
    assert status == 200
    (definition,) = sent(upstream)["tools"]
    assert definition["name"] == "crm__get_weather"
    assert definition["description"] == "Weather for a city\n\n(Part of crm: Customer records)"
    (call,) = reply["output"]
    assert (call["name"], call["namespace"]) == ("get_weather", "crm")
    history = [
        {"role": "user", "content": "Weather?"},
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"},
    ]
    status, _ = await post(gateway, {"model": MODEL, "input": history, "tools": [namespace]})
    assert status == 200
    assert sent(upstream)["messages"][1]["content"][0]["name"] == "crm__get_weather"


@pytest.mark.parametrize("kind", ["file_search", "code_interpreter", "computer_use_preview", "image_generation", "mcp"])
async def test_other_hosted_tools_are_refused_naming_the_tool(gateway, upstream, kind):
    status, body = await post(gateway, {"model": MODEL, "input": "Hi", "tools": [WEATHER, {"type": kind}]})
    assert status == 400
    assert body["error"]["param"] == "tools[1].type"
    assert (
        body["error"]["message"]
        == f"tools[1].type: {kind!r} tools are not supported; only function, custom and namespace tools are"
    )
    assert upstream.requests == []


# --- images and PDFs


async def test_an_image_by_data_url_and_a_pdf_by_file_data(client, upstream):
    pdf = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4 test").decode()
    await client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": PNG_URL, "detail": "auto"},
                    {"type": "input_file", "filename": "a.pdf", "file_data": pdf},
                ],
            }
        ],
    )
    content = sent(upstream)["messages"][0]["content"]
    assert content[1] == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PNG_URL.split(",")[1]},
    }
    assert content[2]["type"] == "document" and content[2]["source"]["media_type"] == "application/pdf"


@pytest.fixture
async def image_server():
    server = await ImageServer().start()
    yield server
    await server.close()


async def test_an_image_by_http_url_is_downloaded_and_a_failure_names_the_part(start_gateway, upstream, image_server):
    cat = image_server.serve("/cat.png", PNG)
    config = dataclasses.replace(make_config(upstream.url), images=ImagesConfig(allow_private_hosts=True, ports=()))
    gateway = await start_gateway(config)
    async with gateway.client(default_headers={"x-ezat-cache": "off"}) as client:
        parts = [{"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": cat}]
        await client.responses.create(model=MODEL, input=[{"role": "user", "content": parts}])
        image = sent(upstream)["messages"][0]["content"][1]
        assert image["source"] == {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
        upstream.requests.clear()
        parts[1]["image_url"] = image_server.url + "/missing.png"
        error = await refused(
            client, upstream, input=[{"role": "user", "content": "Hi"}, {"role": "user", "content": parts}]
        )
    assert error["message"] == "input[1].content[1].image_url: could not download the image (HTTP 404)"
    assert error["param"] == "input[1].content[1].image_url"


async def test_an_image_that_is_not_what_its_data_url_says_is_refused_naming_the_part(client, upstream):
    bad = "data:image/jpeg;base64," + base64.b64encode(PNG).decode()
    error = await refused(
        client, upstream, input=[{"role": "user", "content": [{"type": "input_image", "image_url": bad}]}]
    )
    assert error["message"] == "input[0].content[0].image_url: the data is not a image/jpeg image"
    assert error["param"] == "input[0].content[0].image_url"


# --- output format and reasoning


async def test_a_json_schema_text_format_is_the_output_format_and_json_object_is_refused(client, upstream):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    await client.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_schema", "name": "x", "schema": schema}}
    )
    assert sent(upstream)["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    upstream.requests.clear()
    error = await refused(client, upstream, text={"format": {"type": "json_object"}})
    assert error["param"] == "text.format"
    assert error["message"] == (
        'text.format: type "json_object" is not supported; use "json_schema" with a schema '
        '(objects need "additionalProperties": false)'
    )


async def test_reasoning_effort_asks_for_effort_and_thinking_but_not_on_a_tool_answer(client, upstream):
    await client.responses.create(model=MODEL, input="Think", reasoning={"effort": "high"})
    assert sent(upstream)["output_config"] == {"effort": "high"}
    assert sent(upstream)["thinking"] == {"type": "adaptive"}
    history = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "toolu_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"},
    ]
    await client.responses.create(model=MODEL, input=history, tools=[WEATHER], reasoning={"effort": "high"})
    assert "thinking" not in sent(upstream)  # the call's thinking was not sent back
    assert sent(upstream)["output_config"] == {"effort": "high"}


async def test_thinking_sent_back_sealed_is_restored_in_place_and_thinking_stays_on(client, upstream):
    upstream.enqueue(Scenario(blocks=[THOUGHT, OSLO]))
    first = await client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=[WEATHER],
        reasoning={"effort": "high"},
        include=["reasoning.encrypted_content"],
    )
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert "Oslo's weather" not in reasoning.encrypted_content  # sealed, not readable
    history = [{"role": "user", "content": "Weather?"}, reasoning.model_dump(exclude_none=True), call.model_dump()]
    history.append({"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"})
    await client.responses.create(model=MODEL, input=history, tools=[WEATHER], reasoning={"effort": "high"})
    body = sent(upstream)
    assert body["thinking"] == {"type": "adaptive"}
    assert body["messages"][1] == {"role": "assistant", "content": [THOUGHT, OSLO]}
    # One the gateway cannot open is left out, and the request goes without thinking.
    history[1] = {**history[1], "encrypted_content": "ezat1.not-a-real-seal"}
    await client.responses.create(model=MODEL, input=history, tools=[WEATHER], reasoning={"effort": "high"})
    assert "thinking" not in sent(upstream)
    assert sent(upstream)["messages"][1] == {"role": "assistant", "content": [OSLO]}


async def test_sealed_thinking_opens_only_for_the_key_it_was_sealed_for(start_gateway, upstream, tmp_path):
    """Key B sending back key A's reasoning item cannot have the model read (and repeat) A's
    thinking: the item is left out and thinking is off. A's own item opens, and still does once
    A is rotated, since the seal names the key by its id."""
    config = dataclasses.replace(make_config(upstream.url, f"sqlite:///{tmp_path / 'ezat.db'}"), admin=ADMIN)
    gateway = await start_gateway(config)
    admin = Admin(gateway)
    created = await admin.ok("POST", "/keys", 201, json={"name": "a"})

    async def ask(secret: str, **kwargs):
        async with gateway.client(api_key=secret, default_headers={"x-ezat-cache": "off"}) as client:
            return await client.responses.create(model=MODEL, tools=[WEATHER], reasoning={"effort": "high"}, **kwargs)

    def thought_through() -> bool:
        """Whether the last request went upstream with A's thinking in place, and thinking on."""
        body = sent(upstream)
        blocks = body["messages"][1]["content"]
        assert blocks in ([THOUGHT, OSLO], [OSLO]) and ("thinking" in body) == (blocks == [THOUGHT, OSLO])
        return blocks == [THOUGHT, OSLO]

    upstream.enqueue(Scenario(blocks=[THOUGHT, OSLO]))
    reasoning, call = (await ask(created["secret"], input="Weather?", include=[ENCRYPTED])).output
    history = [
        {"role": "user", "content": "Weather?"},
        reasoning.model_dump(exclude_none=True),
        call.model_dump(),
        {"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"},
    ]
    await ask(KEY, input=history)  # B, the config file's key
    assert not thought_through()
    await ask(created["secret"], input=history)
    assert thought_through()
    rotated = await admin.ok("POST", f"/keys/{created['id']}/rotate")
    assert rotated["id"] == created["id"]
    await ask(rotated["secret"], input=history)
    assert thought_through()


# --- refusals


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"background": True},
            "background",
            "background: background responses are not supported; send the request without it",
        ),
        (
            {"conversation": "conv_1"},
            "conversation",
            "conversation: conversations are not supported; send the whole conversation in input",
        ),
        (
            {"prompt": {"id": "pmpt_1"}},
            "prompt",
            "prompt: stored prompts are not supported; send the instructions and input themselves",
        ),
        ({"truncation": "auto"}, "truncation", 'truncation: only "disabled" is supported'),
        (
            {"include": ["file_search_call.results"]},
            "include[0]",
            "include[0]: 'file_search_call.results' is not supported; use 'reasoning.encrypted_content'",
        ),
        ({"include": [{}]}, "include[0]", "include[0]: {} is not supported; use 'reasoning.encrypted_content'"),
        ({"n": 2}, "n", "n: only 1 response per request is supported"),
    ],
)
async def test_refused_fields_get_a_400_naming_them_before_admission(gateway, upstream, fields, param, message):
    status, body = await post(gateway, {"model": "no/such-model", "input": "Hi", **fields})
    assert status == 400  # before the model is looked up
    assert body["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": 3}, "input", "input: expected a string or a list of items"),
        (
            {"input": [{"type": "local_shell_call", "id": "x"}]},
            "input[0].type",
            "input[0].type: expected message, function_call, function_call_output, custom_tool_call, custom_tool_call_output, reasoning or item_reference, not 'local_shell_call'",
        ),
        (
            {"input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]},
            "input[1].id",
            "input[1].id: no stored response of this key has an item with id 'msg_1'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input[0].content[0].type",
            "input[0].content[0].type: expected input_text, input_image or input_file, not 'input_audio'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "https://x/a.pdf"}]}]},
            "input[0].content[0].file_url",
            "input[0].content[0].file_url: send the PDF as file_data (a base64 data URL); file_url is not supported",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
            "input[0].arguments: not valid JSON",
        ),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            "tool_choice.name",
            "tool_choice.name: expected the name of one of the function tools",
        ),
        (
            {"input": [{"role": "developer", "content": [{"type": "input_image", "image_url": PNG_URL}]}]},
            "input[0].content[0].type",
            "input[0].content[0].type: only text parts are allowed in developer messages, not 'input_image'",
        ),
        (
            {"reasoning": {"effort": "huge"}},
            "reasoning.effort",
            "reasoning.effort: use one of none, minimal, low, medium, high, xhigh, max",
        ),
    ],
)
async def test_invalid_fields_get_a_400_naming_the_field(gateway, upstream, body, param, message):
    status, answer = await post(gateway, {"model": MODEL, "input": "Hi", **body})
    assert status == 400
    assert (answer["error"]["param"], answer["error"]["message"]) == (param, message)
    assert upstream.requests == []


async def test_too_many_input_items_are_refused_by_the_bounds(start_gateway, upstream):
    gateway = await start_gateway(dataclasses.replace(make_config(upstream.url), bounds=BoundsConfig(max_messages=2)))
    status, body = await post(gateway, {"model": MODEL, "input": [{"role": "user", "content": "a"}] * 3})
    assert status == 400
    assert body["error"]["message"] == "input: at most 2 items per request (this one has 3)"


# --- streams, conversations and the ledger


async def test_a_stream_ends_with_response_completed_and_the_ledger_names_the_conversation(
    start_gateway, upstream, tmp_path
):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gateway = await start_gateway(make_config(upstream.url, storage_url=url))
    async with gateway.client() as client:
        async with client.responses.stream(model=MODEL, input="Hi", prompt_cache_key="conv-42") as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        await client.responses.create(
            model=MODEL, input="Hi", prompt_cache_key="conv-42", extra_headers={"x-ezat-session": "header-wins"}
        )
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.output_text == "Hello from the mock upstream. You said: Hi"
    await gateway.runner.cleanup()
    rows, _ = await read_store(url)
    assert [(row.session, row.model, row.request_id) for row in rows] == [
        ("conv-42", MODEL, final.id.removeprefix("resp_")),
        ("header-wins", MODEL, rows[1].request_id),
    ]
    assert rows[0].output_tokens == final.usage.output_tokens


async def test_a_failure_after_the_stream_began_is_response_failed_and_not_billed(start_gateway, upstream, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    gateway = await start_gateway(make_config(upstream.url, storage_url=url))
    text = [{"type": "text", "text": "A long answer, cut short by the upstream. " * 4}]
    upstream.enqueue(Scenario(blocks=text, error_after=8, stream_error_message="Overloaded"))
    async with gateway.client() as client:
        stream = await client.responses.create(model=MODEL, input="Hi", stream=True)
        events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "Overloaded"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    await gateway.runner.cleanup()
    rows, _ = await read_store(url)
    assert rows == []


async def test_a_fallback_model_that_answers_is_the_responses_model(start_gateway, upstream):
    config = make_config(upstream.url)
    gateway = await start_gateway(config)
    upstream.enqueue(Scenario(status=529))
    async with gateway.client() as client:
        reply = await client.responses.create(model=MODEL, input="Hi", extra_body={"models": ["test/small"]})
    assert reply.model == "test/small"
    assert [r.body["model"] for r in upstream.requests] == [UPSTREAM_MODEL, "small-1"]


async def test_a_namespaced_tool_can_be_forced_by_its_own_name(gateway, upstream):
    namespace = {"type": "namespace", "name": "crm", "description": "Customer records", "tools": [WEATHER]}
    status, _ = await post(
        gateway,
        {
            "model": MODEL,
            "input": "Weather?",
            "tools": [namespace],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
    )
    assert status == 200
    assert sent(upstream)["tool_choice"] == {"type": "tool", "name": "crm__get_weather"}


async def test_replicas_with_one_reasoning_key_open_each_others_reasoning_items(start_gateway, upstream):
    shared = ResponsesConfig(reasoning_key=base64.b64encode(bytes(range(32))).decode())
    first, second = [
        await start_gateway(dataclasses.replace(make_config(upstream.url), responses=shared)) for _ in "ab"
    ]
    stranger = await start_gateway(make_config(upstream.url))  # a key of its own
    upstream.enqueue(Scenario(blocks=[THOUGHT, OSLO]))
    async with first.client() as client:
        reply = await client.responses.create(
            model=MODEL, input="Weather?", tools=[WEATHER], reasoning={"effort": "high"}, include=[ENCRYPTED]
        )
    history = [{"role": "user", "content": "Weather?"}, *(item.model_dump(exclude_none=True) for item in reply.output)]
    history.append({"type": "function_call_output", "call_id": "toolu_1", "output": "Sunny"})
    for gateway, restored in ((second, True), (stranger, False)):
        async with gateway.client() as client:
            await client.responses.create(model=MODEL, input=history, tools=[WEATHER], reasoning={"effort": "high"})
        assert (sent(upstream)["messages"][1]["content"][0] == THOUGHT) is restored
        assert ("thinking" in sent(upstream)) is restored


async def test_the_metrics_call_the_route_responses(gateway, upstream):
    status, _ = await post(gateway, {"model": MODEL, "input": "Hi"})
    assert status == 200
    status, _ = await post(gateway, {"model": MODEL, "input": "Hi", "background": True})
    assert status == 400
    samples = await scrape(gateway.url)
    assert samples[("ezat_requests_total", (("model", MODEL), ("route", "responses"), ("status", "200")))] == 1
    assert samples[("ezat_requests_total", (("model", ""), ("route", "responses"), ("status", "400")))] == 1
    first_token = ("ezat_time_to_first_token_seconds_count", (("model", MODEL), ("route", "responses")))
    assert samples[first_token] == 1


async def test_the_metrics_call_the_stored_responses_routes_stored_responses(gateway, upstream):
    async with gateway.client() as client:
        created = await client.responses.create(model=MODEL, input="Hi")
        await client.responses.retrieve(created.id)
        await client.responses.input_items.list(created.id)
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
    samples = await scrape(gateway.url)
    stored = (("model", ""), ("route", "stored_responses"))
    assert samples[("ezat_requests_total", (*stored, ("status", "200")))] == 3
    assert samples[("ezat_requests_total", (*stored, ("status", "404")))] == 1


async def test_admission_reserves_max_output_tokens_as_the_output(start_gateway, upstream):
    config = make_config(upstream.url)
    key = dataclasses.replace(config.keys[0], spend_limit_usd=Decimal("0.01"))
    gateway = await start_gateway(dataclasses.replace(config, keys=(key,)))
    # Its worst case, 64,000 tokens at $15 a million, is over the limit; 100 tokens are not.
    status, body = await post(gateway, {"model": MODEL, "input": "Hi", "max_output_tokens": 64000})
    assert status == 402
    assert body["error"]["message"] == (
        "This key has $0.01 left of its spend limit of $0.01, less than this request may cost ($0.960126); a lower max_output_tokens would fit."
    )
    assert upstream.requests == []
    status, _ = await post(gateway, {"model": MODEL, "input": "Hi", "max_output_tokens": 100})
    assert status == 200


async def test_the_automatic_cache_breakpoints_go_on_the_translated_request(gateway, upstream):
    async with gateway.client() as client:  # caching on, as by default
        await client.responses.create(model=MODEL, instructions="You are helpful. " * 500, input="Hi")
    body = sent(upstream)
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][-1]["content"][-1] == {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
