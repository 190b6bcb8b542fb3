"""What the mock upstream rejects, as Anthropic's Messages API does (400 invalid_request_error).

These rules are the ones a gateway gets wrong (unknown fields, roles, empty text, tool ids and
names, media types, output limits, thinking budgets, cache breakpoints, beta names): a gateway
test that passes against the mock has not sent anything the real API would refuse.
"""

from __future__ import annotations

import re

ALLOWED_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        "metadata",
        "service_tier",
        "context_management",
        "mcp_servers",
        "container",
        "inference_geo",
    }
)
# /v1/messages/count_tokens: no max_tokens, no stream, nothing about sampling or billing.
COUNT_TOKENS_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        "context_management",
        "mcp_servers",
    }
)
MAX_BREAKPOINTS = 4

# The most output tokens a model may be asked for, by the start of its name (the first match wins,
# so a family's newer members come before it). The real API's figures for its models; a name it
# does not know (the tests' and the demo's) gets the largest any of them allows, so every limit a
# gateway might pass on is accepted, and only an impossible one (max_tokens: 999999) is refused.
MAX_OUTPUT_TOKENS: tuple[tuple[str, int], ...] = (
    ("claude-opus-4-7", 128_000),
    ("claude-opus-4-6", 128_000),
    ("claude-opus-4-5", 64_000),
    ("claude-opus-4", 32_000),  # claude-opus-4-1, claude-opus-4-0, claude-opus-4-20250514
    ("claude-sonnet-4", 64_000),
    ("claude-haiku-4", 64_000),
    ("claude-3-7-sonnet", 64_000),
    ("claude-3-5-", 8_192),
    ("claude-3-", 4_096),
)
DEFAULT_MAX_OUTPUT_TOKENS = 128_000

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_ID = re.compile(r"[a-zA-Z0-9_-]+")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
# A beta name ends in its date: interleaved-thinking-2025-05-14, claude-code-20250219.
_BETA = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-(?:\d{4}-\d{2}-\d{2}|\d{8})")


class Invalid(Exception):
    """A request the real API would reject with 400 invalid_request_error."""


def max_output_tokens(model: str) -> int:
    """The most `max_tokens` may be for `model` (see MAX_OUTPUT_TOKENS)."""
    return next((most for prefix, most in MAX_OUTPUT_TOKENS if model.startswith(prefix)), DEFAULT_MAX_OUTPUT_TOKENS)


def validate_betas(header: str) -> frozenset[str]:
    """The `anthropic-beta` header: beta names, comma-separated (empty names are skipped)."""
    names = [name.strip() for name in header.split(",")]
    unexpected = [name for name in names if name and not _BETA.fullmatch(name)]
    if unexpected:
        raise Invalid(
            f"Unexpected value(s) `{', '.join(unexpected)}` for the `anthropic-beta` header. "
            "Please consult our documentation at docs.claude.com or try again without the header."
        )
    return frozenset(name for name in names if name)


# The beta under which a message may have the role "system" (Claude Code sends such messages).
MID_CONVERSATION_SYSTEM = "mid-conversation-system-2026-04-07"
# What the API answers without it: Claude Code reads it, and sends no such message again.
UNEXPECTED_SYSTEM_ROLE = (
    'messages: Unexpected role "system". The Messages API accepts a top-level `system` '
    'parameter, not "system" as an input message role.'
)


def validate(body: object, fields: frozenset[str] = ALLOWED_FIELDS, betas: frozenset[str] = frozenset()) -> None:
    """A request body for /v1/messages, or with fields=COUNT_TOKENS_FIELDS for count_tokens,
    which takes (and so requires) no max_tokens; `betas`, the request's beta names."""
    if not isinstance(body, dict):
        raise Invalid("Input should be a valid dictionary")
    for key in body:
        if key not in fields:
            raise Invalid(f"{key}: Extra inputs are not permitted")
    for key in ("model", "max_tokens", "messages"):
        if key in fields and key not in body:
            raise Invalid(f"{key}: Field required")
    if not isinstance(body["model"], str) or not body["model"]:
        raise Invalid("model: Input should be a valid string")
    max_tokens = body.get("max_tokens", 1)  # count_tokens takes none
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise Invalid("max_tokens: Input should be a valid integer")
    if max_tokens < 0:  # 0 only warms the prompt cache
        raise Invalid("max_tokens: Input should be greater than or equal to 0")
    most = max_output_tokens(body["model"])
    if max_tokens > most:
        raise Invalid(
            f"max_tokens: {max_tokens} > {most}, which is the maximum allowed number of output tokens for {body['model']}"
        )
    messages = body["messages"]
    if not isinstance(messages, list):
        raise Invalid("messages: Input should be a valid list")
    if not messages:
        raise Invalid("messages: at least one message is required")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise Invalid(f"messages.{i}: Input should be a valid dictionary")
        if msg.get("role") == "system" and MID_CONVERSATION_SYSTEM not in betas:
            raise Invalid(UNEXPECTED_SYSTEM_ROLE)
        if msg.get("role") not in ("user", "assistant", "system"):
            raise Invalid(f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'")
        content = msg.get("content")
        if not isinstance(content, (str, list)):
            raise Invalid(f"messages.{i}.content: Input should be a valid string or list")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for j, block in enumerate(blocks):
            if not isinstance(block, dict):
                raise Invalid(f"messages.{i}.content.{j}: Input should be a valid dictionary")
            _validate_block(block, f"messages.{i}.content.{j}")
    _validate_system(body.get("system"))
    _validate_tool_pairs(messages)
    _validate_tools(body)
    _validate_thinking(body)
    _validate_breakpoints(body)
    if max_tokens == 0:
        _validate_warming(body)


def _validate_system(system: object) -> None:
    """A string, or a list of text blocks."""
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise Invalid("system: Input should be a valid string or list")
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise Invalid(f"system.{i}: Input should be a valid text block")


def _validate_block(block: dict, path: str) -> None:
    kind = block.get("type")
    if not isinstance(kind, str):
        raise Invalid(f"{path}.type: Input should be a valid string")
    if kind == "text" and not block.get("text"):
        raise Invalid("messages: text content blocks must be non-empty")
    if kind == "tool_use":
        if not _ID.fullmatch(str(block.get("id", ""))):
            raise Invalid(f"{path}.id: String should match pattern '^[a-zA-Z0-9_-]+$'")
        if not isinstance(block.get("input"), dict):
            raise Invalid(f"{path}.input: Input should be a valid dictionary")
    if kind == "tool_result" and not _ID.fullmatch(str(block.get("tool_use_id", ""))):
        raise Invalid(f"{path}.tool_use_id: String should match pattern '^[a-zA-Z0-9_-]+$'")
    if kind in ("image", "document"):
        source = block.get("source")
        if not isinstance(source, dict):
            raise Invalid(f"{path}.source: Input should be a valid dictionary")
        if source.get("type") == "base64" and (kind == "image") != (source.get("media_type") in IMAGE_TYPES):
            raise Invalid(f"{path}.source.media_type: Input should be a supported media type")


def _validate_tool_pairs(messages: list) -> None:
    """Each assistant turn's tool_use ids are answered first thing in the next user turn."""
    for i, msg in enumerate(messages):
        content = msg["content"] if isinstance(msg["content"], list) else []
        ids = [b.get("id") for b in content if b.get("type") == "tool_use"]
        if msg["role"] != "assistant" or not ids or i + 1 == len(messages):
            continue
        following = messages[i + 1]["content"]
        following = following if isinstance(following, list) else [{"type": "text"}]
        leading = []
        for block in following:
            if block.get("type") != "tool_result":
                break
            leading.append(block.get("tool_use_id"))
        missing = [tool_id for tool_id in ids if tool_id not in leading]
        if missing:
            raise Invalid(
                f"messages.{i + 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                + ", ".join(missing)
            )


def _validate_tools(body: dict) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise Invalid("tools: Input should be a valid list")
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise Invalid(f"tools.{i}: Input should be a valid dictionary")
        if not _NAME.fullmatch(str(tool.get("name", ""))):
            raise Invalid(f"tools.{i}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
        if (tool.get("input_schema") or {}).get("type") != "object":
            raise Invalid(f"tools.{i}.input_schema.type: Input should be 'object'")


def _validate_thinking(body: dict) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict):
        raise Invalid("thinking: Input should be a valid dictionary")
    kind = thinking.get("type")
    if kind not in ("adaptive", "disabled", "enabled"):
        raise Invalid(
            f"thinking: Input tag {kind!r} found using 'type' does not match any of the expected tags: "
            "'adaptive', 'disabled', 'enabled'"
        )
    if kind == "disabled":
        return
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is None:
            raise Invalid("thinking.enabled.budget_tokens: Field required")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise Invalid("thinking.enabled.budget_tokens: Input should be a valid integer")
        if budget < 1024:
            raise Invalid("thinking.enabled.budget_tokens: Input should be greater than or equal to 1024")
        if "max_tokens" in body and budget >= body["max_tokens"]:
            raise Invalid(
                "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
                "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size"
            )
    if (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
        raise Invalid("Thinking may not be enabled when tool_choice forces tool use.")
    if "temperature" in body or "top_p" in body or "top_k" in body:
        raise Invalid("temperature, top_p and top_k may not be set when thinking is enabled")
    assistants = [(i, m) for i, m in enumerate(body["messages"]) if m["role"] == "assistant"]
    if assistants:
        i, last = assistants[-1]
        content = last["content"] if isinstance(last["content"], list) else []
        calls_tool = any(b.get("type") == "tool_use" for b in content)
        if calls_tool and content[0].get("type") not in ("thinking", "redacted_thinking"):
            raise Invalid(
                f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
                f"`{content[0].get('type')}`. When `thinking` is enabled, a final `assistant` message must "
                "start with a thinking block."
            )


def _prompt_blocks(body: dict) -> list[tuple[str, object]]:
    """The blocks that may carry a breakpoint, with their paths, in cache order: tools, system, messages."""
    system = body.get("system")
    blocks = [(f"tools.{i}", tool) for i, tool in enumerate(body.get("tools") or [])]
    blocks += [(f"system.{i}", block) for i, block in enumerate(system)] if isinstance(system, list) else []
    for i, msg in enumerate(body["messages"]):
        if isinstance(msg["content"], list):
            blocks += [(f"messages.{i}.content.{j}", block) for j, block in enumerate(msg["content"])]
    return blocks


def _validate_breakpoints(body: dict) -> None:
    """Each cache_control, at most 4 of them (a top-level one, automatic caching, counts as one) and
    no 1-hour breakpoint after a 5-minute one."""
    marked = []
    for path, block in _prompt_blocks(body):
        if not isinstance(block, dict) or block.get("cache_control") is None:
            continue
        if block.get("type") in ("thinking", "redacted_thinking"):
            raise Invalid(f"{path}.{block['type']}.cache_control: Extra inputs are not permitted")
        marked.append((f"{path}.cache_control", block["cache_control"]))
    if body.get("cache_control") is not None:
        marked.append(("cache_control", body["cache_control"]))
    five_minutes = False
    for path, marker in marked:
        if not isinstance(marker, dict):
            raise Invalid(f"{path}: Input should be a valid dictionary")
        if marker.get("type") != "ephemeral":
            raise Invalid(f"{path}.type: Input should be 'ephemeral'")
        ttl = marker.get("ttl", "5m")
        if ttl not in ("5m", "1h"):
            raise Invalid(f"{path}.ttl: Input should be '5m' or '1h'")
        if ttl == "1h" and five_minutes:
            raise Invalid(
                f"{path}.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. "
                "Note that blocks are processed in the following order: `tools`, `system`, `messages`."
            )
        five_minutes = five_minutes or ttl == "5m"
    if len(marked) > MAX_BREAKPOINTS:
        raise Invalid(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(marked)}.")


def _validate_warming(body: dict) -> None:
    """max_tokens 0 only warms the prompt cache: reported as refused with a stream, thinking or
    structured output (the wording is the mock's)."""
    if body.get("stream"):
        raise Invalid("max_tokens: 0 (cache pre-warming) does not support `stream`")
    if (body.get("thinking") or {}).get("type", "disabled") != "disabled":
        raise Invalid("max_tokens: 0 (cache pre-warming) does not support `thinking`")
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        raise Invalid("max_tokens: 0 (cache pre-warming) does not support `output_config.format`")
