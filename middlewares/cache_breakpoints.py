"""The cache_breakpoints stage (docs/api.md, "Prompt caching").

A request with no cache breakpoints of its own gets two 5-minute ones, unless it opts out with
`x-ezat-cache: off` or is certainly too short to be cached: one after the stable prefix (the last system
text, or the last tool when there is no system prompt) and one on the newest message, which
the next turn reads back. A request that places its own (`cache_control` on content parts or
tools, OpenRouter style) keeps them and gets none added.

The stage also names the conversation for routing and the ledger: `x-ezat-session`, else
`prompt_cache_key` (on Anthropic's API, which has no such field, the `X-Claude-Code-Session-Id`
Claude Code sends on every request of a session; behind the Responses API's translation, the
`prompt_cache_key` it took out of the body, `request[CONVERSATION]`); routing falls back on the
stable prefix. So
requests that can share a cache go to one deployment.

On Anthropic's Messages API (`api="anthropic"`) the same two go on the last block of `system` (or
the last tool) and on the newest message's last block; a request with a `cache_control` of its
own anywhere, top-level automatic caching included, keeps its own.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import BODY, BODY_BYTES, CONVERSATION, MODEL, SESSION, body_changed
from middlewares.core.errors import invalid_request
from middlewares.core.media import MEDIA_BLOCKS, THINKING_BLOCKS

MAX_BREAKPOINTS = 4  # the upstream's limit per request
# Tokens the upstream adds to a request with tools (its tool-use system prompt: 346 at most on
# the models documented), more than the body's bytes could tell.
TOOL_PROMPT_TOKENS = 400
MAX_CACHE_KEY = 256
EPHEMERAL = {"type": "ephemeral"}  # the upstream's default time to live: 5 minutes


def cache_breakpoints_middleware(*, min_cache_tokens: int = 1024, api: str = "openai") -> Stage:
    """Adds the automatic breakpoints to `request[BODY]`, an OpenAI chat completion request (or,
    with `api="anthropic"`, an Anthropic Messages request), and sets `request[SESSION]`. The
    model's `min_cache_tokens` (`request[MODEL]`, when a stage before this one resolved it;
    `min_cache_tokens` here otherwise) is the shortest prompt its cache takes: 0 means it has none."""
    if not isinstance(min_cache_tokens, int) or min_cache_tokens < 0:
        raise ValueError("cache_breakpoints_middleware: min_cache_tokens must be 0 or more")
    if api not in _APIS:
        raise ValueError('cache_breakpoints_middleware: api must be "openai" or "anthropic"')
    session, scan, mark_prefix, mark_newest, most = _APIS[api]

    @stage("cache_breakpoints", requires=(BODY, BODY_BYTES), provides=(SESSION,), reads=(MODEL, CONVERSATION))
    async def cache_breakpoints(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = request[BODY]
        request[SESSION] = session(request, body)
        placed, media = scan(body)
        if most is not None and placed > most:
            raise invalid_request(
                f"cache_control: at most {MAX_BREAKPOINTS} cache breakpoints per request; this one has {placed}",
                "messages",
            )
        model = request.get(MODEL)
        least = model.min_cache_tokens if model is not None else min_cache_tokens
        if (
            not placed
            and least
            and request.headers.get("x-ezat-cache", "").lower() != "off"
            # A token of text is at least one byte of it: a shorter body can never be cached. An
            # image's or a PDF's tokens follow its pixels and pages, not its bytes (nor its URL).
            and (media or _most_tokens(request, body) >= least)
        ):
            body_changed(request)
            mark_prefix(body)
            mark_newest(body)
        return await handler(request)

    return cache_breakpoints


def _most_tokens(request: web.Request, body: dict[str, Any]) -> int:
    """The most tokens a request of text can make: a byte each, and the tool-use prompt."""
    return request[BODY_BYTES] + (TOOL_PROMPT_TOKENS if body.get("tools") else 0)


def _session(request: web.Request, body: dict[str, Any]) -> str | None:
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > MAX_CACHE_KEY):
        raise invalid_request(
            f"prompt_cache_key: expected a string of at most {MAX_CACHE_KEY} characters", "prompt_cache_key"
        )
    return request.headers.get("x-ezat-session") or key or None


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


_MEDIA = ("image_url", "file")  # a tuple: a part's "type" may be anything, unhashable too


def _scan(body: dict[str, Any]) -> tuple[int, bool]:
    """The breakpoints the request placed itself, and whether it holds an image or a file."""
    tools = body.get("tools")
    count = sum(1 for tool in tools if _marked(tool)) if isinstance(tools, list) else 0
    media = False
    for message in _messages(body):
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if _marked(part))
            media = media or any(isinstance(part, dict) and part.get("type") in _MEDIA for part in content)
    return count, media


def _marked(item: Any) -> bool:
    return isinstance(item, dict) and item.get("cache_control") is not None


def _mark_prefix(body: dict[str, Any]) -> None:
    """The system prompt's last part that reaches the upstream (a message of blank parts sends
    none), else, with no system prompt, the last tool."""
    system = [m for m in _messages(body) if m.get("role") in ("system", "developer")]
    if not any(_mark_last_part(message) for message in reversed(system)):
        _mark_last_tool(body)


def _mark_last_tool(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[-1], dict):
        tools[-1]["cache_control"] = dict(EPHEMERAL)


def _mark_newest_message(body: dict[str, Any]) -> None:
    turns = [m for m in _messages(body) if m.get("role") not in ("system", "developer")]
    if turns:
        _mark_last_part(turns[-1])


def _mark_last_part(message: dict[str, Any]) -> bool:
    """Put the breakpoint on the message's last part that can take one; string content becomes
    one text part. False when none can (blank text is never sent)."""
    content = message.get("content")
    if isinstance(content, str):
        if not content.strip():
            return False
        message["content"] = _marked_text(content)
        return True
    return isinstance(content, list) and _mark_last_block(content)


def _marked_text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "cache_control": dict(EPHEMERAL)}]


def _mark_last_block(blocks: list[Any]) -> bool:
    """Put the breakpoint on the last block (or part) that reaches the upstream and can take
    one: not blank text, which is never sent (its mark would go with it), nor thinking, which
    the upstream refuses a mark on. False when none can."""
    for block in reversed(blocks):
        if not isinstance(block, dict) or block.get("type") in THINKING_BLOCKS:
            continue
        if block.get("type") == "text" and not (isinstance(block.get("text"), str) and block["text"].strip()):
            continue
        block["cache_control"] = dict(EPHEMERAL)
        return True
    return False


# --- Anthropic's Messages API: system and tools at the top, blocks in every message.


def _anthropic_session(request: web.Request, body: dict[str, Any]) -> str | None:
    # The gateway's own header first: a client that names its conversations means that name. Then
    # the name a translation took out of the body (the Responses API's prompt_cache_key).
    headers = request.headers
    return headers.get("x-ezat-session") or request.get(CONVERSATION) or headers.get("x-claude-code-session-id") or None


def _blocks(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def _scan_anthropic(body: dict[str, Any]) -> tuple[int, bool]:
    """The breakpoints the request placed itself (top-level automatic caching counts as one),
    and whether it holds an image or a document."""
    count = int(body.get("cache_control") is not None)
    count += sum(1 for item in (*_blocks(body.get("tools")), *_blocks(body.get("system"))) if _marked(item))
    media = False
    for message in _messages(body):
        for block in _blocks(message.get("content")):
            count += _marked(block)
            if isinstance(block, dict):
                media = media or block.get("type") in MEDIA_BLOCKS
                if block.get("type") == "tool_result":
                    inner = _blocks(block.get("content"))
                    count += sum(1 for part in inner if _marked(part))
                    media = media or any(isinstance(part, dict) and part.get("type") in MEDIA_BLOCKS for part in inner)
    return count, media


def _mark_anthropic_prefix(body: dict[str, Any]) -> None:
    system = body.get("system")
    if isinstance(system, str) and system.strip():
        body["system"] = _marked_text(system)
    elif not (isinstance(system, list) and _mark_last_block(system)):
        _mark_last_tool(body)


def _mark_anthropic_newest_message(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    newest = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(newest, dict):
        return
    content = newest.get("content")
    if isinstance(content, str) and content.strip():
        newest["content"] = _marked_text(content)
    elif isinstance(content, list):
        _mark_last_block(content)


# Per API: the conversation's name, the breakpoints placed and media held, the two placements,
# and the most breakpoints refused here (on Anthropic's the upstream refuses them in its own
# words, which its clients read).
_APIS = {
    "openai": (_session, _scan, _mark_prefix, _mark_newest_message, MAX_BREAKPOINTS),
    "anthropic": (_anthropic_session, _scan_anthropic, _mark_anthropic_prefix, _mark_anthropic_newest_message, None),
}
