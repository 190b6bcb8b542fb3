"""The product page's own examples (tests/product_examples.md, copied as they are written), run
against a real gateway with only their host changed: what a user copies from the page must work
unchanged."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from gateway.mock.upstream import Scenario
from tests.support import KEY, make_config

EXAMPLES = Path(__file__).resolve().parent / "product_examples.md"
PUBLIC_HOST = "https://api.router.ezat.io"


def examples(tab: str) -> list[str]:
    return re.findall(rf'```\w+ tab="{tab}" test\n(.*?)```', EXAMPLES.read_text(), re.S)


async def run(gateway, program: list[str]) -> str:
    process = await asyncio.create_subprocess_exec(
        *program,
        env={**os.environ, "EZAT_API_KEY": KEY},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,  # curl's progress meter
    )
    output, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, (output + errors).decode()
    return output.decode()


def node(gateway, sdk: Path, name: str, code: str) -> list[str]:
    """The example as an ES module beside the SDK's node_modules, where its import finds it."""
    module = sdk / f"{name}.mjs"
    module.write_text(code.replace(PUBLIC_HOST, gateway.url))
    return ["node", str(module)]


def python(gateway, code: str) -> list[str]:
    return [sys.executable, "-c", code.replace(PUBLIC_HOST, gateway.url)]


def curl(gateway, code: str) -> list[str]:
    return ["bash", "-c", code.replace(PUBLIC_HOST, gateway.url)]


async def test_python_request_and_response(gateway, upstream):
    request, *_ = examples("Python")
    output = await run(gateway, python(gateway, request))
    assert "You said: What is a prompt cache?" in output
    assert "stop CompletionUsage(" in output
    assert upstream.requests[-1].body["system"] == [{"type": "text", "text": "Answer in one sentence."}]
    assert upstream.requests[-1].body["max_tokens"] == 64


async def test_python_streaming(gateway, upstream):
    _, streaming, *_ = examples("Python")
    output = await run(gateway, python(gateway, streaming))
    assert "You said: Count from 1 to 10." in output
    assert "prompt_tokens=" in output  # the usage chunk arrived
    assert upstream.requests[-1].body["stream"] is True


async def test_python_tool_loop(gateway, upstream):
    _, _, tools, _ = examples("Python")
    call = {"type": "tool_use", "id": "toolu_oslo", "name": "get_weather", "input": {"city": "Oslo"}}
    upstream.enqueue(
        Scenario(blocks=[call]), Scenario(blocks=[{"type": "text", "text": "It is 9°C and clear in Oslo."}])
    )
    output = await run(gateway, python(gateway, tools))
    assert output.startswith("tool_calls [ChatCompletionMessageFunctionToolCall(id='toolu_oslo'")
    assert "It is 9°C and clear in Oslo." in output
    second = upstream.requests[-1].body["messages"]
    assert second[1] == {"role": "assistant", "content": [call]}
    assert second[2]["content"][0]["tool_use_id"] == "toolu_oslo"
    assert second[2]["content"][0]["content"] == [{"type": "text", "text": "9°C and clear"}]


async def test_node_request_and_response(gateway, upstream, node_sdk):
    request, _ = examples("Node.js")
    output = await run(gateway, node(gateway, node_sdk, "request", request))
    assert "You said: What is a prompt cache?" in output
    assert "stop {" in output and "prompt_tokens:" in output  # finish_reason, then the usage object
    assert upstream.requests[-1].body["system"] == [{"type": "text", "text": "Answer in one sentence."}]
    assert upstream.requests[-1].body["max_tokens"] == 64


async def test_node_streaming(gateway, upstream, node_sdk):
    _, streaming = examples("Node.js")
    output = await run(gateway, node(gateway, node_sdk, "streaming", streaming))
    assert "You said: Count from 1 to 10." in output
    assert "prompt_tokens:" in output  # the usage chunk arrived
    assert upstream.requests[-1].body["stream"] is True


OPT_OUT = '    extra_headers={"x-ezat-cache": "off"},\n'


async def test_python_prompt_cache_key_and_opt_out(start_gateway, upstream):
    *_, caching = examples("Python")
    assert OPT_OUT in caching
    # The example's prompt is far below the default cache minimum: with a minimum of one token,
    # only the header keeps the breakpoints away.
    gateway = await start_gateway(make_config(upstream.url, min_cache_tokens=1))

    output = await run(gateway, python(gateway, caching.replace(OPT_OUT, "")))
    assert "CompletionUsage(" in output
    said = {"type": "text", "text": "Say hello in five words."}
    marked = upstream.requests[-1].body
    # caching works here: the newest message carries the breakpoint (there is no prefix to mark)
    assert marked["messages"] == [{"role": "user", "content": [{**said, "cache_control": {"type": "ephemeral"}}]}]

    output = await run(gateway, python(gateway, caching))
    assert "CompletionUsage(" in output
    assert len(upstream.requests) == 2
    assert "cache_control" not in str(upstream.requests[-1].body)  # x-ezat-cache: off
    assert upstream.requests[-1].body["messages"] == [{"role": "user", "content": [said]}]


async def test_curl_examples(gateway, upstream):
    request, streaming = examples("curl")
    completion = await run(gateway, curl(gateway, request))
    assert '"object":"chat.completion"' in completion and "You said: What is a prompt cache?" in completion
    stream = await run(gateway, curl(gateway, streaming))
    assert stream.endswith("data: [DONE]\n\n")
    assert '"choices":[],"usage":{' in stream
