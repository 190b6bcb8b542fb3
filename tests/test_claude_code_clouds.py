"""Claude Code itself (conftest's CLAUDE_CODE) through a gateway whose deployment is Claude on a
cloud: it speaks Anthropic's API to the gateway as always (ANTHROPIC_BASE_URL), with its own beta
flags (`claude-code-…` first), which Bedrock and Vertex AI refuse. The mock clouds refuse a flag
they do not know as the real ones do, so an answer proves the gateway dropped them."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from gateway.app import STORE
from gateway.config import Config, Deployment
from gateway.mock.bedrock import BEDROCK_BETAS, BedrockMock
from gateway.mock.upstream import Credential, Scenario
from gateway.mock.vertex import VERTEX_BETAS, VertexMock
from tests.support import MODEL, make_config
from tests.test_claude_code import ANSWER, claude

BEDROCK_MODEL = "us.anthropic.claude-sonnet-5-5-v1:0"
VERTEX_MODEL = "claude-sonnet-5-5@20261001"
CLAUDE_CODE_BETA = "claude-code-20250219"
THINKING = {"type": "thinking", "thinking": "The user wants the note: read it.", "signature": "EqQBCgIYAhIM1gbc=="}


def on(deployment: Deployment, upstream_model: str) -> Config:
    """The test config with `deployment` (named "primary") as the test model's only one."""
    config = make_config(deployment.base_url)
    model = dataclasses.replace(config.models[0], upstream_models={"primary": upstream_model})
    return dataclasses.replace(config, deployments=(deployment,), models=(model,))


def dropped(caplog) -> set[str]:
    """The flags the gateway logged as dropped."""
    return {r.args[1] for r in caplog.records if "does not take the beta flag" in r.getMessage()}


@pytest.fixture
async def bedrock(monkeypatch, tmp_path):
    """The Bedrock mock, and its temporary credentials in this test's environment (AWS's
    chain finds them there), with no shared files or instance metadata to find instead."""
    mock = BedrockMock(region="eu-west-1")
    await mock.start()
    key = mock.temporary_key
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_BEARER_TOKEN_BEDROCK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key.secret_access_key)
    monkeypatch.setenv("AWS_SESSION_TOKEN", key.session_token)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield mock
    await mock.close()


async def test_claude_code_answers_and_uses_a_tool_through_bedrock(
    bedrock, start_gateway, claude_code, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    deployment = Deployment(name="primary", provider="bedrock", region=bedrock.region, base_url=bedrock.url)
    gateway = await start_gateway(on(deployment, BEDROCK_MODEL))
    home = tmp_path / "home"
    home.mkdir()

    bedrock.enqueue(Scenario(blocks=[{"type": "text", "text": ANSWER}], usage={"output_tokens": 11}))
    result = await claude(claude_code, gateway, home, "Say hello")
    assert (result["is_error"], result["result"]) == (False, ANSWER)

    [sent] = bedrock.requests
    assert sent.path == f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
    key = bedrock.temporary_key
    assert sent.auth == Credential("sigv4", key.access_key_id, key.session_token, session_token_signed=True)
    kept = sent.body.get("anthropic_beta", [])
    assert kept and set(kept) <= BEDROCK_BETAS  # what Bedrock takes of Claude Code's flags
    assert CLAUDE_CODE_BETA in dropped(caplog) and not dropped(caplog) & BEDROCK_BETAS
    assert "model" not in sent.body and "stream" not in sent.body and "anthropic-beta" not in sent.headers

    [row] = await gateway.app[STORE].ledger()
    assert (row.model, row.outcome, row.deployment, row.output_tokens) == (MODEL, "complete", "primary", 11)
    assert row.input_tokens == result["usage"]["input_tokens"]

    # A turn with a tool: the model thinks and reads a file, Claude Code runs Read and sends its
    # result back after the signed thinking (the mock's next answer says what the tool returned).
    note = home / "note.txt"
    note.write_text("the password is swordfish\n")
    read = {"type": "tool_use", "id": "toolu_bedrock_1", "name": "Read", "input": {"file_path": str(note)}}
    bedrock.enqueue(Scenario(blocks=[THINKING, read]))
    result = await claude(claude_code, gateway, home, "What does note.txt say?", "--allowedTools", "Read")
    assert result["is_error"] is False and "swordfish" in result["result"]
    call, answer = bedrock.requests[1:]
    assert any(tool["name"] == "Read" for tool in call.body["tools"])
    [tool_result] = [
        block
        for block in answer.body["messages"][-1]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    assert tool_result["tool_use_id"] == "toolu_bedrock_1"
    assert answer.body["messages"][-2]["content"][0] == THINKING  # kept, signature and all
    assert {r.auth for r in bedrock.requests} == {sent.auth}
    assert [row.outcome for row in await gateway.app[STORE].ledger()] == ["complete"] * 3


async def test_claude_code_answers_through_vertex(start_gateway, claude_code, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ezat.upstream")
    vertex = VertexMock()
    await vertex.start()
    try:
        deployment = Deployment(
            name="primary",
            provider="vertex",
            region="global",
            project=vertex.project,
            base_url=f"{vertex.url}/v1",
            credentials_file=str(vertex.key_file),
        )
        gateway = await start_gateway(on(deployment, VERTEX_MODEL))
        vertex.enqueue(Scenario(blocks=[{"type": "text", "text": ANSWER}]))
        result = await claude(claude_code, gateway, tmp_path, "Say hello")
        assert (result["is_error"], result["result"]) == (False, ANSWER)
        [sent] = [r for r in vertex.requests if r.path != "/token"]
        assert sent.path.endswith(f"/locations/global/publishers/anthropic/models/{VERTEX_MODEL}:streamRawPredict")
        assert set(sent.headers.get("anthropic-beta", "").split(",")) - {""} <= VERTEX_BETAS
        assert CLAUDE_CODE_BETA in dropped(caplog) and not dropped(caplog) & VERTEX_BETAS
        assert sent.auth.scheme == "oauth" and vertex.token_requests == 1
    finally:
        await vertex.close()
