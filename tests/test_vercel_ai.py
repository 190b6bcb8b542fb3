"""The Vercel AI SDK (conftest's AI_SDK) through the gateway: its OpenAI provider's default model
speaks the Responses API, so `generateText` and `streamText` (tests/node/ai_sdk.mjs) post to
/v1/responses of a real gateway on loopback, answered by the mock upstream and billed in the ledger.

With reasoning on, the SDK sends an answer's reasoning back by reference (`item_reference`) while
it stores responses (its default `store: true`), which the gateway looks up in the stored
response; with `store: false` it sends the reasoning item itself, whose sealed thinking the
upstream gets back. Either way the upstream gets the thinking back with its signature."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, UPSTREAM_MODEL

PROGRAM = Path(__file__).with_name("node") / "ai_sdk.mjs"


async def ai_sdk_case(gateway, sdk: Path, case: str) -> dict:
    """Runs one case of tests/node/ai_sdk.mjs against `gateway`; the JSON line it printed.

    Node.js resolves imports from the module's own directory upwards, so the program runs from a
    copy in a fresh directory under `sdk`, whose node_modules holds the SDK."""
    with tempfile.TemporaryDirectory(prefix="ezat-test-", dir=sdk) as where:
        module = Path(where) / PROGRAM.name
        shutil.copyfile(PROGRAM, module)
        process = await asyncio.create_subprocess_exec(
            "node",
            str(module),
            case,
            env={**os.environ, "EZAT_BASE_URL": gateway.url + "/v1", "EZAT_API_KEY": KEY, "EZAT_MODEL": MODEL},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, (output + errors).decode()
    [line] = output.decode().splitlines()
    return json.loads(line)


USAGE = {"input_tokens": 21, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 16}


async def test_generate_text(gateway, upstream, ai_sdk):
    upstream.enqueue(Scenario(usage=USAGE))  # the default echo reply, with known usage
    result = await ai_sdk_case(gateway, ai_sdk, "generate")
    assert result["text"] == "Hello from the mock upstream. You said: What is a prompt cache?"
    assert result["finish_reason"] == "stop"
    assert (result["usage"]["inputTokens"], result["usage"]["outputTokens"]) == (21, 16)

    [request] = upstream.requests
    assert request.body["model"] == UPSTREAM_MODEL and request.body["max_tokens"] == 64
    assert not request.body.get("stream")
    [row] = await gateway.app[STORE].ledger()
    assert (row.model, row.outcome, row.input_tokens, row.output_tokens) == (MODEL, "complete", 21, 16)


async def test_stream_text(gateway, upstream, ai_sdk):
    # Deltas that arrive together leave the gateway as one event: these are paced, so come apart.
    upstream.enqueue(Scenario(usage=USAGE, chunk_size=8, event_delay=0.01))
    result = await ai_sdk_case(gateway, ai_sdk, "stream")
    assert result["text"] == "Hello from the mock upstream. You said: Count from 1 to 10."
    assert result["deltas"] > 1
    assert result["finish_reason"] == "stop"
    assert (result["usage"]["inputTokens"], result["usage"]["outputTokens"]) == (21, 16)

    [request] = upstream.requests
    assert request.body["stream"] is True
    [row] = await gateway.app[STORE].ledger()
    assert (row.model, row.outcome, row.input_tokens, row.output_tokens) == (MODEL, "complete", 21, 16)


CALL = {"type": "tool_use", "id": "toolu_oslo", "name": "get_weather", "input": {"city": "Oslo"}}


async def test_a_tool_runs_then_the_answer_comes(gateway, upstream, ai_sdk):
    answer = "It is 9°C and clear in Oslo."
    upstream.enqueue(Scenario(blocks=[CALL]), Scenario(blocks=[{"type": "text", "text": answer}]))
    result = await ai_sdk_case(gateway, ai_sdk, "tools")
    assert result == {"text": answer, "steps": 2, "calls": ["Oslo"], "finish_reason": "stop"}

    offered, answered = [request.body for request in upstream.requests]
    [weather] = offered["tools"]
    assert weather["name"] == "get_weather" and weather["input_schema"]["required"] == ["city"]
    assert answered["messages"][-2] == {"role": "assistant", "content": [CALL]}
    [returned] = answered["messages"][-1]["content"]
    assert (returned["type"], returned["tool_use_id"]) == ("tool_result", "toolu_oslo")
    assert "9°C and clear in Oslo" in json.dumps(returned["content"], ensure_ascii=False)
    rows = await gateway.app[STORE].ledger()
    assert [(row.model, row.outcome) for row in rows] == [(MODEL, "complete")] * 2


async def test_a_streamed_tool_loop(gateway, upstream, ai_sdk):
    answer = "It is 9°C and clear in Oslo."
    streamed = Scenario(blocks=[{"type": "text", "text": answer}], chunk_size=8, event_delay=0.01)
    upstream.enqueue(Scenario(blocks=[CALL], chunk_size=4, event_delay=0.01), streamed)
    result = await ai_sdk_case(gateway, ai_sdk, "stream-tools")
    assert {key: result[key] for key in ("text", "steps", "calls", "finish_reason")} == {
        "text": answer,
        "steps": 2,
        "calls": ["Oslo"],
        "finish_reason": "stop",
    }
    assert result["deltas"] > 1
    assert all(request.body["stream"] is True for request in upstream.requests)
    assert upstream.requests[1].body["messages"][-2] == {"role": "assistant", "content": [CALL]}
    rows = await gateway.app[STORE].ledger()
    assert [(row.model, row.outcome) for row in rows] == [(MODEL, "complete")] * 2


THOUGHT = {"type": "thinking", "thinking": "The tool knows the weather.", "signature": "sig-ai"}


@pytest.mark.parametrize("case", ["thinking", "stored"])  # store: false, then the default store: true
async def test_the_thinking_survives_the_tool_call(gateway, upstream, ai_sdk, case):
    answer = "It is 9°C and clear in Oslo."
    upstream.enqueue(Scenario(blocks=[THOUGHT, CALL]), Scenario(blocks=[{"type": "text", "text": answer}]))
    result = await ai_sdk_case(gateway, ai_sdk, case)
    assert result == {"text": answer, "steps": 2, "calls": ["Oslo"], "finish_reason": "stop"}

    offered, answered = [request.body for request in upstream.requests]
    assert offered["thinking"] == answered["thinking"] == {"type": "adaptive"}
    assert answered["messages"][-2] == {"role": "assistant", "content": [THOUGHT, CALL]}
    assert len(await gateway.app[STORE].ledger()) == 2
