"""Claude Code itself (conftest's CLAUDE_CODE) through the gateway: `claude -p` with only its
documented settings pointed at a real gateway on loopback, answered by the mock upstream, and
billed in the ledger. CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC keeps it from calling anywhere but
the gateway (without it, it would send the gateway key to Anthropic's own services)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from gateway.app import STORE
from gateway.mock_upstream import Scenario
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL

ANSWER = "Hello from the mock, through the gateway."


async def claude(binary: Path, gateway, home: Path, prompt: str, key_variable: str = "ANTHROPIC_API_KEY") -> dict:
    """`claude -p <prompt> --output-format json` against `gateway`; the JSON result it printed."""
    process = await asyncio.create_subprocess_exec(
        str(binary), "-p", prompt, "--output-format", "json",
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),  # a new user: no settings, no login, no history
            "ANTHROPIC_BASE_URL": gateway.url,
            key_variable: KEY,
            "ANTHROPIC_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        },
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    output, errors = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, (output + errors).decode()
    return json.loads(output)


@pytest.mark.parametrize("key_variable", ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"])
async def test_claude_code_answers_through_the_gateway_and_is_billed(gateway, upstream, claude_code, tmp_path,
                                                                     key_variable):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": ANSWER}], usage={"output_tokens": 11}))
    result = await claude(claude_code, gateway, tmp_path, "Say hello", key_variable)
    assert (result["is_error"], result["result"]) == (False, ANSWER)

    [sent] = [r for r in upstream.requests if r.path == "/v1/messages"]
    assert sent.query == {"beta": "true"}
    assert "claude-code-20250219" in sent.headers["anthropic-beta"].split(",")  # forwarded as sent
    assert sent.headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in sent.headers
    assert sent.body["model"] == UPSTREAM_MODEL and sent.body["stream"] is True
    # Claude Code places its own breakpoints: the gateway adds none, so each is one of Claude Code's.
    marked = [block for block in sent.body["system"] if "cache_control" in block]
    assert marked and all(block["cache_control"] == {"type": "ephemeral"} for block in marked)

    [row] = await gateway.app[STORE].ledger()
    assert (row.model, row.outcome, row.deployment) == (MODEL, "complete", "primary")
    assert row.output_tokens == 11 and row.input_tokens == result["usage"]["input_tokens"]


async def test_claude_codes_context_command_counts_through_count_tokens(gateway, upstream, claude_code, tmp_path):
    """`/context` sizes the conversation with count_tokens: the deployment's own counts, never billed."""
    result = await claude(claude_code, gateway, tmp_path, "/context")
    assert result["is_error"] is False
    counts = [r for r in upstream.requests if r.path == "/v1/messages/count_tokens"]
    assert counts and all(r.body["model"] == UPSTREAM_MODEL for r in counts)
    assert not [r for r in upstream.requests if r.path == "/v1/messages"]  # every count answered
    assert await gateway.app[STORE].ledger() == []
