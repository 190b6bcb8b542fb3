"""What the mock upstream rejects, as Anthropic's Messages API does (400 invalid_request_error).

These rules are the ones a translating gateway gets wrong (unknown fields, roles, empty text,
tool ids and names, media types): a gateway test that passes against the mock has not sent
anything the real API would refuse.
"""

from __future__ import annotations

import re

ALLOWED_FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
    "top_p", "top_k", "stream", "tools", "tool_choice", "thinking", "output_config",
    "cache_control", "metadata", "service_tier",
})

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_ID = re.compile(r"[a-zA-Z0-9_-]+")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


class Invalid(Exception):
    """A request the real API would reject with 400 invalid_request_error."""


def validate(body: object) -> None:
    if not isinstance(body, dict):
        raise Invalid("Input should be a valid dictionary")
    for key in body:
        if key not in ALLOWED_FIELDS:
            raise Invalid(f"{key}: Extra inputs are not permitted")
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            raise Invalid(f"{key}: Field required")
    if not isinstance(body["model"], str) or not body["model"]:
        raise Invalid("model: Input should be a valid string")
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise Invalid("max_tokens: Input should be a valid integer")
    if max_tokens < 1:
        raise Invalid("max_tokens: Input should be greater than or equal to 1")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise Invalid("messages: Input should be a valid list")
    if not messages:
        raise Invalid("messages: at least one message is required")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise Invalid(f"messages.{i}: Input should be a valid dictionary")
        if msg.get("role") not in ("user", "assistant"):
            raise Invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = msg.get("content")
        if not isinstance(content, (str, list)):
            raise Invalid(f"messages.{i}.content: Input should be a valid string or list")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for j, block in enumerate(blocks):
            if not isinstance(block, dict):
                raise Invalid(f"messages.{i}.content.{j}: Input should be a valid dictionary")
            _validate_block(block, f"messages.{i}.content.{j}")
    _validate_tool_pairs(messages)
    _validate_tools(body)
    _validate_thinking(body)


def _validate_block(block: dict, path: str) -> None:
    kind = block.get("type")
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
        source = block.get("source") or {}
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
    for i, tool in enumerate(body.get("tools") or []):
        if not _NAME.fullmatch(str(tool.get("name", ""))):
            raise Invalid(f"tools.{i}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
        if (tool.get("input_schema") or {}).get("type") != "object":
            raise Invalid(f"tools.{i}.input_schema.type: Input should be 'object'")


def _validate_thinking(body: dict) -> None:
    thinking = body.get("thinking")
    if not thinking or thinking.get("type") == "disabled":
        return
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
