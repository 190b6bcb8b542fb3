"""Codex CLI (conftest's CODEX) through the gateway: `codex exec` with only its documented
settings (a config.toml in CODEX_HOME with a `[model_providers.ezat]` entry speaking the Responses
API) pointed at a real gateway on loopback, answered by the mock upstream, and billed in the ledger.

`codex exec` never asks for approval; it runs with `--dangerously-bypass-approvals-and-sandbox`
because Codex's Linux sandbox needs what the host's kernel allows (user namespaces, Landlock),
which differs between machines and CI runners, and its failure would fail a test of the gateway.
The command the mock asks for writes only in the test's own temporary directory.

The answer's thinking goes out as a sealed `reasoning` item: Codex keeps it in its history and
sends it back with the tool's output, and the upstream gets the thinking block again in place."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import pytest

from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.support import KEY, MODEL, UPSTREAM_MODEL
from tests.test_images import PNG

ANSWER = "The marker file is written."
MARKER = "ezat-codex-marker"
THOUGHT = {"type": "thinking", "thinking": "A shell command writes the file.", "signature": "sig-codex"}

CONFIG = """\
model = "{model}"
model_provider = "ezat"
model_reasoning_effort = "medium"

[model_providers.ezat]
name = "ezat-gateway"
base_url = "{base_url}"
wire_api = "responses"
env_key = "EZAT_API_KEY"
"""


async def codex_exec(binary: Path, home: Path, base_url: str, prompt: str, *options: str) -> list[dict]:
    """`codex exec --json [options] -- <prompt>` with a provider at `base_url`, run in `home` (also
    HOME, with CODEX_HOME under it); the JSON events it printed. Fails unless it exits 0. `options`
    are flags (`--image FILE`) or a subcommand (`resume <thread id>`)."""
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(CONFIG.format(model=MODEL, base_url=base_url))
    process = await asyncio.create_subprocess_exec(
        str(binary),
        "exec",
        "--json",
        "--skip-git-repo-check",  # the working directory is no git repository
        "--dangerously-bypass-approvals-and-sandbox",
        *options,
        "--",  # `--image` takes several files: the prompt is not one of them
        prompt,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),  # a new user: no settings, no login, no history
            "CODEX_HOME": str(codex_home),
            "EZAT_API_KEY": KEY,  # the provider's env_key
        },
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=home,
    )
    output, errors = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, (output + errors).decode()
    return [json.loads(line) for line in output.decode().splitlines() if line.startswith("{")]


def items(events: list[dict], kind: str) -> list[dict]:
    return [event["item"] for event in events if event["type"] == "item.completed" and event["item"]["type"] == kind]


@pytest.mark.parametrize("prefix", ["/v1", "/openai/v1"])
async def test_codex_runs_a_shell_command_through_the_gateway_and_is_billed(gateway, upstream, codex, tmp_path, prefix):
    command = f"echo {MARKER} > marker.txt && cat marker.txt"
    call = {"type": "tool_use", "id": "toolu_shell", "name": "exec_command", "input": {"cmd": command}}
    upstream.enqueue(
        Scenario(blocks=[THOUGHT, call], usage={"output_tokens": 20}),
        Scenario(blocks=[{"type": "text", "text": ANSWER}], usage={"output_tokens": 9}),
    )
    events = await codex_exec(codex, tmp_path, gateway.url + prefix, "Write the marker file.")

    assert (tmp_path / "marker.txt").read_text() == MARKER + "\n"  # Codex ran the call the gateway passed on
    [ran] = items(events, "command_execution")
    assert command in ran["command"] and ran["exit_code"] == 0
    assert [item["text"] for item in items(events, "reasoning")] == [THOUGHT["thinking"]]
    assert [item["text"] for item in items(events, "agent_message")] == [ANSWER]
    assert events[-1]["type"] == "turn.completed"

    offered, answered = [request.body for request in upstream.requests]
    assert offered["model"] == answered["model"] == UPSTREAM_MODEL
    assert offered["stream"] is True
    assert offered["thinking"] == answered["thinking"] == {"type": "adaptive"}  # model_reasoning_effort
    shell = next(tool for tool in offered["tools"] if tool["name"] == "exec_command")
    assert shell["input_schema"]["required"] == ["cmd"]
    # The second request carries the thinking and the call back, then the command's output.
    assert answered["messages"][-2] == {"role": "assistant", "content": [THOUGHT, call]}
    [result] = answered["messages"][-1]["content"]
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_shell")
    assert MARKER in json.dumps(result["content"])

    rows = await gateway.app[STORE].ledger()
    assert [(row.model, row.outcome, row.deployment) for row in rows] == [(MODEL, "complete", "primary")] * 2
    assert sorted(row.output_tokens for row in rows) == [9, 20]
    assert all(row.input_tokens > 0 and row.cost_usd > 0 for row in rows)
    # Codex names its thread in prompt_cache_key: the conversation routing sticks by and the ledger records.
    [thread] = [event["thread_id"] for event in events if event["type"] == "thread.started"]
    assert [row.session for row in rows] == [thread] * 2


async def test_a_stream_that_fails_midway_is_retried_by_codex_and_billed_once(gateway, upstream, codex, tmp_path):
    """An upstream overload after the first token reaches Codex as response.failed, which Codex
    reports and retries; the failed attempt is not billed, the answer it then gets is."""
    broken = Scenario(
        blocks=[{"type": "text", "text": "An answer that breaks off midway."}], chunk_size=4, error_after=6
    )
    upstream.enqueue(broken, Scenario(blocks=[{"type": "text", "text": ANSWER}], usage={"output_tokens": 9}))
    events = await codex_exec(codex, tmp_path, gateway.url + "/v1", "Say hello")

    [reported] = [event["message"] for event in events if event["type"] == "error"]
    assert "Overloaded" in reported  # the response.failed event's error, as Codex shows it
    assert [item["text"] for item in items(events, "agent_message")] == [ANSWER]
    assert len(upstream.requests) == 2
    [row] = await gateway.app[STORE].ledger()
    assert (row.outcome, row.output_tokens) == ("complete", 9)


async def test_an_image_codex_attaches_reaches_claude(gateway, upstream, codex, tmp_path):
    (tmp_path / "chart.png").write_bytes(PNG)
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": ANSWER}]))
    events = await codex_exec(codex, tmp_path, gateway.url + "/v1", "Describe the chart.", "--image", "chart.png")

    assert [item["text"] for item in items(events, "agent_message")] == [ANSWER]
    [sent] = upstream.requests
    images = [block for message in sent.body["messages"] for block in message["content"] if block["type"] == "image"]
    assert [image["source"] for image in images] == [
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    ]


async def test_a_resumed_session_sends_its_history_back(gateway, upstream, codex, tmp_path):
    """`codex exec resume` rebuilds the conversation from the items it kept of the first run's
    stream, thinking included, and stays one conversation in the ledger."""
    upstream.enqueue(
        Scenario(blocks=[THOUGHT, {"type": "text", "text": ANSWER}]),
        Scenario(blocks=[{"type": "text", "text": "Again: " + ANSWER}]),
    )
    first = await codex_exec(codex, tmp_path, gateway.url + "/v1", "Write the marker file.")
    [thread] = [event["thread_id"] for event in first if event["type"] == "thread.started"]
    again = await codex_exec(codex, tmp_path, gateway.url + "/v1", "Once more.", "resume", thread)

    assert [item["text"] for item in items(again, "agent_message")] == ["Again: " + ANSWER]
    history = upstream.requests[1].body["messages"]
    said = [block["text"] for message in history for block in message["content"] if block["type"] == "text"]
    assert "Write the marker file." in said and said[-1] == "Once more."
    [earlier] = [message for message in history if message["role"] == "assistant"]
    assert earlier["content"] == [THOUGHT, {"type": "text", "text": ANSWER}]  # its sealed thinking, opened
    rows = await gateway.app[STORE].ledger()
    assert [row.session for row in rows] == [thread] * 2
