"""Claude Code itself (conftest's CLAUDE_CODE) through the gateway: `claude -p` with only its
documented settings pointed at a real gateway on loopback, answered by the mock upstream, and
billed in the ledger. CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC keeps it from calling anywhere but
the gateway (without it, it would send the gateway key to Anthropic's own services).

Claude Code names its session in an `X-Claude-Code-Session-Id` header on every request (the id
its JSON result reports; `--session-id` sets it, `--resume` and `--continue` keep it), which the
gateway routes by and records."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import uuid
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.app import STORE
from gateway.config import Deployment
from gateway.mock.upstream import Scenario
from gateway.upstream.routing import ranked
from tests.support import KEY, MODEL, UPSTREAM_KEY, UPSTREAM_MODEL, make_config, run_command

ANSWER = "Hello from the mock, through the gateway."


async def claude(
    binary: Path, gateway, home: Path, prompt: str, *options: str, key_variable: str = "ANTHROPIC_API_KEY"
) -> dict:
    """`claude -p <prompt> --output-format json [options]` against `gateway`, run in `home`; the
    JSON result it printed."""
    process = await asyncio.create_subprocess_exec(
        str(binary),
        "-p",
        prompt,
        "--output-format",
        "json",
        *options,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),  # a new user: no settings, no login, no history
            "ANTHROPIC_BASE_URL": gateway.url,
            key_variable: KEY,
            "ANTHROPIC_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        },
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=home,
    )
    output, errors = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, (output + errors).decode()
    return json.loads(output)


@pytest.mark.parametrize("key_variable", ["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"])
async def test_claude_code_answers_through_the_gateway_and_is_billed(
    gateway, upstream, claude_code, tmp_path, key_variable
):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": ANSWER}], usage={"output_tokens": 11}))
    result = await claude(claude_code, gateway, tmp_path, "Say hello", key_variable=key_variable)
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
    assert row.session == result["session_id"]  # the session Claude Code made up for itself


async def test_claude_codes_context_command_counts_through_count_tokens(gateway, upstream, claude_code, tmp_path):
    """`/context` sizes the conversation with count_tokens: the deployment's own counts, never billed."""
    result = await claude(claude_code, gateway, tmp_path, "/context")
    assert result["is_error"] is False
    counts = [r for r in upstream.requests if r.path == "/v1/messages/count_tokens"]
    assert counts and all(r.body["model"] == UPSTREAM_MODEL for r in counts)
    assert not [r for r in upstream.requests if r.path == "/v1/messages"]  # every count answered
    assert await gateway.app[STORE].ledger() == []


DEPLOYMENTS = ("a", "b")


def session_on(deployment: str, seed: int) -> str:
    """A session id (a UUID, as `--session-id` wants) whose conversation ranks `deployment` first;
    the same one on every run."""
    draw = random.Random(seed)
    while True:
        session = str(uuid.UUID(int=draw.getrandbits(128), version=4))
        if ranked(DEPLOYMENTS, "session:" + session)[0] == deployment:
            return session


async def test_a_claude_code_session_stays_on_one_deployment_and_usage_shows_its_cost(
    upstream, second, start_gateway, claude_code, tmp_path
):
    """Two sessions, two runs each (`--session-id`, then `--resume`): each session's requests all
    go to its deployment, though every run sends the same system prompt and tools (which alone
    would put all four on one), and `usage --by session` adds up each one's cost."""
    storage = f"sqlite:///{tmp_path / 'ezat.db'}"
    config = make_config(upstream.url, storage)
    model = dataclasses.replace(config.models[0], deployments=DEPLOYMENTS)
    deployments = tuple(
        Deployment(name=name, base_url=mock.url, api_key=UPSTREAM_KEY)
        for name, mock in zip(DEPLOYMENTS, (upstream, second))
    )
    gateway = await start_gateway(dataclasses.replace(config, deployments=deployments, models=(model,)))
    sessions = {session_on(deployment, seed): deployment for seed, deployment in enumerate(DEPLOYMENTS)}
    home = tmp_path / "home"  # one user, one working directory: one system prompt for every run
    home.mkdir()
    for session in sessions:
        first = await claude(claude_code, gateway, home, "Say hello", "--session-id", session)
        again = await claude(claude_code, gateway, home, "Again", "--resume", session)
        assert (first["session_id"], again["session_id"], again["is_error"]) == (session, session, False)

    assert [len(upstream.requests), len(second.requests)] == [2, 2]
    rows = await gateway.app[STORE].ledger()
    assert sorted((row.session, row.deployment) for row in rows) == sorted(
        (session, deployment) for session, deployment in sessions.items() for _ in range(2)
    )

    status, output = await run_command("usage", "--storage", storage, "--by", "session", "--format", "json")
    assert status == 0, output
    report = {line["session"]: line for line in json.loads(output)}
    assert set(report) == set(sessions)
    for session in sessions:
        mine = [row for row in rows if row.session == session]
        assert report[session]["requests"] == 2
        assert Decimal(report[session]["cost_usd"]) == sum(row.cost_usd for row in mine) > 0
