"""The official OpenAI SDK for Node.js (conftest's NODE_SDK) against a real gateway: our own
programs in tests/node/, so that Node.js compatibility is tested in every checkout (the product
page's examples in test_spec_examples.py only run where the spec is beside the checkout)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL

PROGRAMS = Path(__file__).with_name("node")


async def node(gateway, sdk: Path, name: str) -> list[dict]:
    """Runs tests/node/<name>.mjs against `gateway`; the JSON lines it printed.

    Node.js resolves `import "openai"` from the module's own directory upwards (NODE_PATH does not
    apply to ES modules), so the program runs from a copy in a fresh directory under `sdk`, whose
    node_modules holds the SDK."""
    with tempfile.TemporaryDirectory(prefix="ezat-test-", dir=sdk) as where:
        module = Path(where) / f"{name}.mjs"
        shutil.copyfile(PROGRAMS / f"{name}.mjs", module)
        process = await asyncio.create_subprocess_exec(
            "node",
            str(module),
            env={**os.environ, "EZAT_BASE_URL": gateway.url + "/openai/v1", "EZAT_API_KEY": KEY, "EZAT_MODEL": MODEL},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, (output + errors).decode()
    return [json.loads(line) for line in output.decode().splitlines() if line.strip()]


# The echo's text is about 16 tokens (4 characters a token): the upstream's count is that, as the
# gateway bills no less than an answer's text.
USAGE = {"input_tokens": 21, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 16}
OPENAI_USAGE = {
    "prompt_tokens": 21,
    "completion_tokens": 16,
    "total_tokens": 37,
    "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0},
}


async def test_chat_completion(gateway, upstream, node_sdk):
    upstream.enqueue(Scenario(usage=USAGE))  # the default echo reply, with known usage
    [result] = await node(gateway, node_sdk, "chat")
    assert result == {
        "object": "chat.completion",
        "model": MODEL,
        "content": "Hello from the mock upstream. You said: What is a prompt cache?",
        "finish_reason": "stop",
        "usage": OPENAI_USAGE,
    }
    [request] = upstream.requests
    assert request.body["system"] == [{"type": "text", "text": "Answer in one sentence."}]
    assert request.body["max_tokens"] == 64
    assert request.body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "What is a prompt cache?"}]}
    ]
    assert not request.body.get("stream")


async def test_streamed_completion_with_usage(gateway, upstream, node_sdk):
    # Deltas that arrive together leave the gateway as one chunk: these are paced, so come apart.
    upstream.enqueue(Scenario(usage=USAGE, chunk_size=8, event_delay=0.01))
    [result] = await node(gateway, node_sdk, "stream")
    assert result["text"] == "Hello from the mock upstream. You said: Count from 1 to 10."
    assert result["finish_reason"] == "stop"
    assert result["usage"] == OPENAI_USAGE
    assert result["usage_choices"] == 0  # include_usage: the usage chunk has an empty choices list
    assert result["text_chunks"] > 1  # the text arrived as deltas, not at once
    assert result["chunks"] > result["text_chunks"]  # and the usage chunk after them
    [request] = upstream.requests
    assert request.body["stream"] is True
    assert request.body["max_tokens"] == 64


async def test_tool_call_loop(gateway, upstream, node_sdk):
    call = {"type": "tool_use", "id": "toolu_oslo", "name": "get_weather", "input": {"city": "Oslo"}}
    upstream.enqueue(
        Scenario(blocks=[call]), Scenario(blocks=[{"type": "text", "text": "It is 9°C and clear in Oslo."}])
    )
    first, second = await node(gateway, node_sdk, "tools")

    assert first["finish_reason"] == "tool_calls"
    [tool_call] = first["tool_calls"]
    assert tool_call["id"] == "toolu_oslo"
    assert tool_call["type"] == "function"
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo"}
    assert second == {"finish_reason": "stop", "content": "It is 9°C and clear in Oslo."}

    offered, answered = upstream.requests
    assert [tool["name"] for tool in offered.body["tools"]] == ["get_weather"]
    assert offered.body["tools"][0]["input_schema"]["required"] == ["city"]
    messages = answered.body["messages"]
    assert len(messages) == 3
    assert messages[1] == {"role": "assistant", "content": [call]}  # the SDK's message, sent back
    assert messages[2]["role"] == "user"
    [result] = messages[2]["content"]
    assert result["type"] == "tool_result"
    assert result["tool_use_id"] == "toolu_oslo"
    assert result["content"] == [{"type": "text", "text": "9°C and clear in Oslo"}]
