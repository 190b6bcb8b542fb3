"""The mock upstream refuses what Anthropic's API refuses: the rules gateways get wrong. Read
with the official anthropic SDK, so the gateway's tests can trust a 200 from the mock."""

from __future__ import annotations

import anthropic
import pytest

from gateway.mock_upstream import MockUpstream

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
            {"messages": [USER, {"role": "assistant", "content": [CALL]},
                          {"role": "user", "content": [{"type": "text", "text": "here"}, RESULT]}]},
            "`tool_use` ids were found without `tool_result` blocks immediately after",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": [{**CALL, "id": "functions.Bash:0"}]}]},
            "String should match pattern",
        ),
        ({"messages": [USER], "tools": [{**TOOLS[0], "name": "github.search/issues"}]}, "String should match pattern"),
        ({"messages": [USER], "tools": [{**TOOLS[0], "input_schema": {"type": "string"}}]}, "Input should be 'object'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "text content blocks must be non-empty"),
        (
            {"messages": [USER], "tools": TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}},
            "Thinking may not be enabled when tool_choice forces tool use",
        ),
        (
            {"messages": [USER], "extra_body": {"temperature": 0.5}, "thinking": {"type": "adaptive"}},
            "may not be set when thinking is enabled",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [RESULT]}],
             "tools": TOOLS, "thinking": {"type": "adaptive"}},
            "a final `assistant` message must start with a thinking block",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/bmp", "data": "Qk0="}}]}]},
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
        messages=[USER, {"role": "assistant", "content": [THINKING, CALL]},
                  {"role": "user", "content": [RESULT, {"type": "text", "text": "and tomorrow?"}]}],
    )
    assert reply.stop_reason == "end_turn"
