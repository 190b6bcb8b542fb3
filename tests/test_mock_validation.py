"""The mock upstream refuses what Anthropic's API refuses: the rules gateways get wrong. Read
with the official anthropic SDK, so the gateway's tests can trust a 200 from the mock."""

from __future__ import annotations

import anthropic
import pytest

from gateway.mock.upstream import MockUpstream

USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}
THINKING = {"type": "thinking", "thinking": "call the tool", "signature": "sig"}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture
async def client():
    mock = MockUpstream()
    await mock.start()
    async with anthropic.AsyncAnthropic(base_url=mock.url, api_key="k", max_retries=0) as c:
        yield c
    await mock.close()


async def create(client, **fields):
    return await client.messages.create(model="m", max_tokens=100, **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"messages": [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": "thanks"}]},
            "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1",
        ),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": [CALL]},
                    {"role": "user", "content": [{"type": "text", "text": "here"}, RESULT]},
                ]
            },
            "`tool_use` ids were found without `tool_result` blocks immediately after",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": [{**CALL, "id": "functions.Bash:0"}]}]},
            "String should match pattern",
        ),
        ({"messages": [USER], "tools": [{**TOOLS[0], "name": "github.search/issues"}]}, "String should match pattern"),
        ({"messages": [USER], "tools": [{**TOOLS[0], "input_schema": {"type": "string"}}]}, "Input should be 'object'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "text content blocks must be non-empty",
        ),
        (
            {"messages": [USER], "tools": TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}},
            "Thinking may not be enabled when tool_choice forces tool use",
        ),
        (
            {"messages": [USER], "extra_body": {"temperature": 0.5}, "thinking": {"type": "adaptive"}},
            "may not be set when thinking is enabled",
        ),
        (
            {
                "messages": [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [RESULT]}],
                "tools": TOOLS,
                "thinking": {"type": "adaptive"},
            },
            "a final `assistant` message must start with a thinking block",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "Qk0="}}
                        ],
                    }
                ]
            },
            "supported media type",
        ),
    ],
)
async def test_refused_like_the_real_api(client, fields, message):
    with pytest.raises(anthropic.BadRequestError) as caught:
        await create(client, **fields)
    assert message in caught.value.body["error"]["message"]


async def test_a_well_formed_tool_loop_with_thinking_is_accepted(client):
    reply = await create(
        client,
        thinking={"type": "adaptive"},
        tools=TOOLS,
        messages=[
            USER,
            {"role": "assistant", "content": [THINKING, CALL]},
            {"role": "user", "content": [RESULT, {"type": "text", "text": "and tomorrow?"}]},
        ],
    )
    assert reply.stop_reason == "end_turn"


async def refusal(client, **fields) -> str:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model="m", **{"messages": [USER], **fields})
    return caught.value.body["error"]["message"]


def marked(block: dict, ttl: str | None = None, kind: str = "ephemeral") -> dict:
    return {**block, "cache_control": {"type": kind, **({"ttl": ttl} if ttl else {})}}


TEXT = {"type": "text", "text": "Be brief."}
MUST_PRECEDE = (
    "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. "
    "Note that blocks are processed in the following order: `tools`, `system`, `messages`."
)
BUDGET_DOCS = (
    "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
    "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size"
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"max_tokens": 4000, "thinking": {"type": "enabled", "budget_tokens": 1023}},
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        ),
        ({"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 2048}}, BUDGET_DOCS),
        ({"max_tokens": 0, "thinking": {"type": "enabled", "budget_tokens": 1024}}, BUDGET_DOCS),
        ({"max_tokens": 4000, "thinking": {"type": "enabled"}}, "thinking.enabled.budget_tokens: Field required"),
        (
            {"max_tokens": 4000, "thinking": {"type": "enabled", "budget_tokens": "2000"}},
            "thinking.enabled.budget_tokens: Input should be a valid integer",
        ),
        (
            {"max_tokens": 100, "thinking": {"type": "on"}},
            "thinking: Input tag 'on' found using 'type' does not match any of the expected tags: "
            "'adaptive', 'disabled', 'enabled'",
        ),
        ({"max_tokens": 0, "stream": True}, "max_tokens: 0 (cache pre-warming) does not support `stream`"),
        (
            {"max_tokens": 0, "thinking": {"type": "adaptive"}},
            "max_tokens: 0 (cache pre-warming) does not support `thinking`",
        ),
        (
            {"max_tokens": 0, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "max_tokens: 0 (cache pre-warming) does not support `output_config.format`",
        ),
    ],
)
async def test_thinking_and_warming_refusals(client, fields, message):
    assert await refusal(client, **fields) == message


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 100, "thinking": {"type": "adaptive", "display": "omitted"}},
        {"max_tokens": 1025, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"max_tokens": 100, "thinking": {"type": "disabled"}},
        {"max_tokens": 0, "thinking": {"type": "disabled"}, "output_config": {"effort": "low"}},
    ],
)
async def test_thinking_and_warming_accepted(client, fields):
    reply = await client.messages.create(model="m", messages=[USER], **fields)
    assert reply.stop_reason == ("max_tokens" if fields["max_tokens"] == 0 else "end_turn")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [TOOLS[0], marked(TOOLS[0], "2h")]}, "tools.1.cache_control.ttl: Input should be '5m' or '1h'"),
        ({"system": [marked(TEXT, kind="persistent")]}, "system.0.cache_control.type: Input should be 'ephemeral'"),
        (
            {"messages": [{"role": "user", "content": [TEXT, marked(TEXT, "10m")]}]},
            "messages.0.content.1.cache_control.ttl: Input should be '5m' or '1h'",
        ),
        ({"cache_control": {"type": "ephemeral", "ttl": "1d"}}, "cache_control.ttl: Input should be '5m' or '1h'"),
        ({"tools": [marked(TOOLS[0])], "system": [marked(TEXT, "1h")]}, "system.0.cache_control.ttl: " + MUST_PRECEDE),
        (
            {"system": [marked(TEXT, "5m")], "messages": [{"role": "user", "content": [marked(TEXT, "1h")]}]},
            "messages.0.content.0.cache_control.ttl: " + MUST_PRECEDE,
        ),
        (
            {"system": [marked(TEXT)], "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            "cache_control.ttl: " + MUST_PRECEDE,
        ),
        (
            {"system": [marked(TEXT)] * 3, "messages": [{"role": "user", "content": [marked(TEXT), marked(TEXT)]}]},
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        ),
        (
            {"tools": [marked(TOOLS[0])], "system": [marked(TEXT)] * 3, "cache_control": {"type": "ephemeral"}},
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        ),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": [marked(THINKING), {"type": "text", "text": "Sunny."}]},
                    {"role": "user", "content": "Thanks"},
                ]
            },
            "messages.1.content.0.thinking.cache_control: Extra inputs are not permitted",
        ),
    ],
)
async def test_breakpoints_refused_like_the_real_api(client, fields, message):
    fields = {"max_tokens": 100, **fields}
    assert await refusal(client, **fields) == message


@pytest.mark.parametrize(
    "fields",
    [
        {
            "tools": [marked(TOOLS[0], "1h")],
            "system": [marked(TEXT, "1h")],
            "messages": [{"role": "user", "content": [marked(TEXT, "5m"), marked(TEXT)]}],
        },
        {"system": [marked(TEXT, "1h")] * 3, "cache_control": {"type": "ephemeral", "ttl": "5m"}},
        {"system": [{**TEXT, "cache_control": None}], "cache_control": None},
    ],
)
async def test_breakpoints_accepted(client, fields):
    reply = await client.messages.create(model="m", max_tokens=100, **{"messages": [USER], **fields})
    assert reply.stop_reason == "end_turn"


async def test_a_system_message_needs_the_mid_conversation_system_beta(client):
    """As newer models take it, under its beta (Claude Code sends one); refused without it."""
    messages = [USER, {"role": "system", "content": "Prefer short answers."}]
    reply = await create(
        client, messages=messages, extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"}
    )
    assert reply.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as caught:
        await create(client, messages=messages)
    assert 'Unexpected role "system"' in caught.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("model", "most"),
    [
        ("claude-sonnet-4-5-20250929", 64_000),
        ("claude-haiku-4-5", 64_000),
        ("claude-opus-4-1-20250805", 32_000),
        ("claude-opus-4-6", 128_000),
        ("claude-3-5-haiku-20241022", 8_192),
        ("m", 128_000),  # a name the mock does not know: the largest any model allows
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
async def test_max_tokens_above_the_models_maximum_is_refused_as_the_real_api_does(client, model, most, stream):
    for asked in (999_999, most + 1):
        with pytest.raises(anthropic.BadRequestError) as caught:
            # (a timeout: without one the SDK refuses so large a max_tokens unstreamed itself)
            await client.messages.create(model=model, max_tokens=asked, messages=[USER], stream=stream, timeout=30)
        assert caught.value.status_code == 400
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"] == {
            "type": "invalid_request_error",
            "message": f"max_tokens: {asked} > {most}, which is the maximum allowed number of output tokens for {model}",
        }
    reply = await client.messages.create(model=model, max_tokens=most, messages=[USER], timeout=30)
    assert reply.stop_reason == "end_turn"
