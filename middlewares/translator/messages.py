"""OpenAI `messages` → Anthropic `system` and `messages`.

Every system/developer message joins the system prompt; the rest become alternating turns:
consecutive messages that land on the same role merge, the tool results that answer one
assistant turn travel together before any text, and empty text never becomes an empty block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from middlewares.core.errors import invalid_request
from middlewares.core.media import IMAGE_TYPES, PDF
from middlewares.core.openai_shapes import (
    append_blocks,
    cached,
    call_arguments,
    data_url,
    nonblank_text,
    tool_result,
    upstream_identifier,
)


def convert_messages(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not isinstance(raw, list):
        raise invalid_request("messages: expected a list of messages", "messages")
    system: list[dict[str, Any]] = []
    turns: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = []  # role, tool results, other blocks
    spoke = False
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_request(f"{path}: expected an object", "messages")
        role = message.get("role")
        content = message.get("content")
        if role in ("system", "developer"):
            system.extend(_text_blocks(content, f"{path}.content"))
            continue
        if role == "user":
            blocks = _user_blocks(content, f"{path}.content")
        elif role == "assistant":
            blocks = _assistant_blocks(message, path)
        elif role == "tool":
            blocks = [_tool_result(message, path)]
            role = "user"
        else:
            raise invalid_request(f"{path}.role: expected one of system, developer, user, assistant, tool", "messages")
        spoke = True
        append_blocks(turns, role, blocks)
    if not spoke:
        raise invalid_request("messages: must contain at least one user message", "messages")
    if not turns:
        raise invalid_request("messages: every message is empty", "messages")
    return system, [{"role": role, "content": results + others} for role, results, others in turns]


def _parts(content: list[Any], path: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(path, type, part) for each part of a content list, once its shape is checked."""
    for j, part in enumerate(content):
        part_path = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise invalid_request(f"{part_path}: expected an object", "messages")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise invalid_request(f"{part_path}.type: required", "messages")
        yield part_path, kind, part


def _text_blocks(content: Any, path: str) -> list[dict[str, Any]]:
    """Text-only content (system, developer, tool): a string or a list of text parts."""
    if isinstance(content, str):
        return nonblank_text(content)
    if not isinstance(content, list):
        raise invalid_request(f"{path}: expected a string or a list of text parts", "messages")
    blocks = []
    for part_path, kind, part in _parts(content, path):
        if kind != "text":
            raise invalid_request(f"{part_path}.type: only text parts are allowed here", "messages")
        blocks.extend(_text_part(part, part_path))
    return blocks


def _user_blocks(content: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return nonblank_text(content)
    if not isinstance(content, list):
        raise invalid_request(f"{path}: expected a string or a list of content parts", "messages")
    blocks = []
    for part_path, kind, part in _parts(content, path):
        if kind == "text":
            blocks.extend(_text_part(part, part_path))
        elif kind == "image_url":
            blocks.append(cached(_image(part, part_path), part, part_path))
        elif kind == "file":
            blocks.append(cached(_document(part, part_path), part, part_path))
        else:
            raise invalid_request(f"{part_path}.type: expected text, image_url or file, not {kind!r}", "messages")
    return blocks


def _image(part: dict[str, Any], path: str) -> dict[str, Any]:
    image = part.get("image_url")
    if not isinstance(image, dict):
        raise invalid_request(f"{path}.image_url: expected an object with a url", "messages")
    url = _string(image.get("url"), f"{path}.image_url.url")
    if url.startswith(("http://", "https://")):
        # The images stage inlines these when it is mounted; without it the upstream fetches.
        return {"type": "image", "source": {"type": "url", "url": url}}
    media_type, data = data_url(url, f"{path}.image_url.url")
    if media_type not in IMAGE_TYPES:
        raise invalid_request(
            f"{path}.image_url.url: the image type must be image/jpeg, image/png, image/gif or image/webp",
            "messages",
        )
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _document(part: dict[str, Any], path: str) -> dict[str, Any]:
    file = part.get("file")
    if not isinstance(file, dict):
        raise invalid_request(f"{path}.file: expected an object with file_data", "messages")
    media_type, data = data_url(_string(file.get("file_data"), f"{path}.file.file_data"), f"{path}.file.file_data")
    if media_type != PDF:
        raise invalid_request(f"{path}.file.file_data: only PDF files (application/pdf) are supported", "messages")
    return {"type": "document", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _assistant_blocks(message: dict[str, Any], path: str) -> list[dict[str, Any]]:
    content = message.get("content")
    blocks: list[dict[str, Any]] = []
    if isinstance(content, str):
        blocks.extend(nonblank_text(content))
    elif isinstance(content, list):
        for part_path, kind, part in _parts(content, f"{path}.content"):
            if kind == "text":
                blocks.extend(_text_part(part, part_path))
            elif kind != "refusal":  # a past refusal says nothing the model needs
                raise invalid_request(f"{part_path}.type: expected text or refusal", "messages")
    elif content is not None:
        raise invalid_request(f"{path}.content: expected a string, a list of parts or null", "messages")
    calls = message.get("tool_calls")
    if calls is None:
        return blocks
    if not isinstance(calls, list):
        raise invalid_request(f"{path}.tool_calls: expected a list", "messages")
    for j, call in enumerate(calls):
        blocks.append(_tool_use(call, f"{path}.tool_calls[{j}]"))
    return blocks


def _tool_use(call: Any, path: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise invalid_request(f"{path}: expected an object", "messages")
    function = call.get("function")
    if not isinstance(function, dict):
        raise invalid_request(f"{path}.function: expected an object", "messages")
    arguments = call_arguments(function.get("arguments", ""), f"{path}.function.arguments", "messages")
    return {
        "type": "tool_use",
        "id": upstream_identifier(_non_empty(call.get("id"), f"{path}.id")),
        "name": upstream_identifier(_non_empty(function.get("name"), f"{path}.function.name")),
        "input": arguments,
    }


def _tool_result(message: dict[str, Any], path: str) -> dict[str, Any]:
    call_id = upstream_identifier(_non_empty(message.get("tool_call_id"), f"{path}.tool_call_id"))
    return tool_result(call_id, _text_blocks(message.get("content", ""), f"{path}.content"))


def _text_part(part: dict[str, Any], path: str) -> list[dict[str, Any]]:
    return [cached(block, part, path) for block in nonblank_text(_string(part.get("text"), f"{path}.text"))]


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise invalid_request(f"{path}: expected a string", "messages")
    return value


def _non_empty(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{path}: expected a non-empty string", "messages")
    return value
