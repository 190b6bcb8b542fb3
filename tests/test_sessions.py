"""A request's conversation, its session: what names it on each route (`x-ezat-session`, then
`prompt_cache_key` on Chat Completions or Claude Code's `X-Claude-Code-Session-Id` on the Messages
API), the deployment it sticks to, and how the ledger keeps it (as sent up to 64 characters, a
digest beyond). Through a real gateway on two mock deployments, with the official SDKs."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import anthropic
import pytest

from gateway.app import STORE
from gateway.config import Deployment
from gateway.upstream.routing import ranked
from tests.support import KEY, MODEL, UPSTREAM_KEY, make_config
from tests.test_errors import raw_post

DEPLOYMENTS = ("primary", "second")
SYSTEM = "You are the same assistant in every conversation here."  # one stable prefix for all
CLAUDE_CODE_SESSION = "x-claude-code-session-id"


def home(name: str) -> str:
    """The deployment a conversation of this name ranks first."""
    return ranked(DEPLOYMENTS, "session:" + name)[0]


def named_on(deployment: str, prefix: str) -> str:
    """A conversation name whose home is `deployment`."""
    return next(name for name in (f"{prefix}-{i}" for i in itertools.count()) if home(name) == deployment)


def digest(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()[:32]


@pytest.fixture(params=["sqlite", "postgres"])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def gateway(start_gateway, upstream, second, storage_url):
    """The test model on two deployments, `primary` (the conftest upstream) and `second`."""
    config = make_config(upstream.url, storage_url)
    model = dataclasses.replace(config.models[0], deployments=DEPLOYMENTS)
    deployments = (*config.deployments, Deployment(name="second", base_url=second.url, api_key=UPSTREAM_KEY))
    return await start_gateway(dataclasses.replace(config, deployments=deployments, models=(model, *config.models[1:])))


@pytest.fixture
async def claude(gateway):
    client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
    yield client
    await client.close()


async def message(claude, text: str, headers: dict[str, str]):
    raw = await claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=10, system=SYSTEM, messages=[{"role": "user", "content": text}], extra_headers=headers
    )
    return raw


def served(upstream, second) -> dict[str, list[str]]:
    """Each deployment's requests, by their text."""
    return {
        name: [r.body["messages"][0]["content"] for r in mock.requests]
        for name, mock in zip(DEPLOYMENTS, (upstream, second))
    }


async def sessions(gateway) -> dict[str, tuple[str | None, str]]:
    """Each ledger row's session and deployment, by its request id."""
    return {row.request_id: (row.session, row.deployment) for row in await gateway.app[STORE].ledger()}


async def test_claude_codes_session_header_keeps_a_conversation_on_one_deployment(gateway, claude, upstream, second):
    # One system prompt for all: without the header's name they would all go to one deployment.
    names = [named_on("primary", "claude-code"), named_on("second", "claude-code")]
    ids = {}
    for _turn in range(3):
        for name in names:
            raw = await message(claude, name, {CLAUDE_CODE_SESSION: name})
            ids[raw.headers["request-id"]] = (name, home(name))
    assert served(upstream, second) == {"primary": [names[0]] * 3, "second": [names[1]] * 3}
    assert await sessions(gateway) == ids


async def test_x_ezat_session_wins_over_claude_codes_header(gateway, claude, upstream, second):
    ours, claude_codes = named_on("second", "ours"), named_on("primary", "claude-code")
    raw = await message(claude, "Hi", {"x-ezat-session": ours, CLAUDE_CODE_SESSION: claude_codes})
    assert served(upstream, second) == {"primary": [], "second": ["Hi"]}
    assert await sessions(gateway) == {raw.headers["request-id"]: (ours, "second")}


async def test_chat_completions_name_it_by_x_ezat_session_then_prompt_cache_key(gateway, upstream, second):
    """Claude Code speaks the Messages API only: on Chat Completions its header names nothing."""
    header, field = named_on("second", "header"), named_on("primary", "field")
    async with gateway.client() as client:
        asked = [
            (header, dict(prompt_cache_key=field, extra_headers={"x-ezat-session": header})),
            (field, dict(prompt_cache_key=field, extra_headers={CLAUDE_CODE_SESSION: header})),
            (None, dict(extra_headers={CLAUDE_CODE_SESSION: header})),
        ]
        recorded = {}
        for session, options in asked:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], **options
            )
            recorded[raw.headers["x-request-id"]] = session
    assert {rid: session for rid, (session, _) in (await sessions(gateway)).items()} == recorded
    # Each on its name's home; without one, by the model's preference order (no system prompt).
    assert [deployment for _, deployment in (await sessions(gateway)).values()] == ["second", "primary", "primary"]


async def test_the_ledger_keeps_a_session_of_64_characters_as_sent_and_a_digest_beyond(
    gateway, claude, upstream, second
):
    longest, longer = "s" * 64, "s" * 65
    assert len(digest(longer)) <= 64
    # Characters, not bytes, are counted; a name holding a control character is never kept as sent.
    names = {
        longest: longest,
        longer: digest(longer),
        "ü" * 64: "ü" * 64,
        "ü" * 65: digest("ü" * 65),
        "tab\there": digest("tab\there"),
    }
    recorded = {}
    for name, kept in names.items():
        for header in ("x-ezat-session", CLAUDE_CODE_SESSION):
            raw = await message(claude, "Hi", {header: name})  # sent as UTF-8
            # A digest is the same for every request of its conversation, which stays on one deployment.
            recorded[raw.headers["request-id"]] = (kept, home(name))
    assert await sessions(gateway) == recorded
    # A prompt_cache_key of 256 characters, and one holding NUL (which PostgreSQL's text refuses).
    async with gateway.client() as client:
        for key in ("k" * 256, "conversation\x00one"):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], prompt_cache_key=key
            )
            recorded[raw.headers["x-request-id"]] = (digest(key), home(key))
    assert await sessions(gateway) == recorded


async def test_a_session_header_that_is_not_utf8_is_recorded_as_a_digest(gateway, upstream, second):
    status, body = await raw_post(
        gateway, f"Authorization: Bearer {KEY}\r\n".encode() + b"x-ezat-session: conv-\xff\r\n"
    )
    assert status == b"HTTP/1.1 200 OK", body
    [row] = await gateway.app[STORE].ledger()
    assert row.session.startswith("sha256:") and len(row.session) == len(digest("x"))
