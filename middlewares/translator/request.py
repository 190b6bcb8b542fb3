"""OpenAI Chat Completions request → Anthropic Messages request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from gateway.config import Model
from gateway.errors import invalid_request

# Spec, "Output length and format": with neither limit sent, 32,000 or the model's maximum.
DEFAULT_MAX_TOKENS = 32_000


def to_anthropic(body: dict[str, Any], model: Model) -> dict[str, Any]:
    """The upstream request for `body`. Fields with no use here are not copied, so nothing
    OpenAI-only ever reaches the upstream."""
    system, messages = convert_messages(body.get("messages"))
    request: dict[str, Any] = {
        "model": body["model"],
        "max_tokens": _max_tokens(body, model),
        "messages": messages,
    }
    if system:
        request["system"] = system
    stop = _stop_sequences(body.get("stop"))
    if stop:
        request["stop_sequences"] = stop
    if body.get("stream"):
        request["stream"] = True
    return request


def convert_messages(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """System text blocks (every system/developer message, in order) and alternating turns.

    Consecutive messages that land on the same role are merged, tool results go first in
    their user turn, and empty text never becomes an empty block.
    """
    if not isinstance(raw, list):
        raise invalid_request("messages: expected a list of messages", "messages")
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
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
            raise invalid_request(
                f"{path}.role: expected one of system, developer, user, assistant, tool", "messages"
            )
        spoke = True
        _append(turns, role, blocks)
    if not spoke:
        raise invalid_request("messages: must contain at least one user message", "messages")
    if not turns:
        raise invalid_request("messages: every message is empty", "messages")
    return system, turns


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        merged = turns[-1]["content"]
        if blocks[0]["type"] == "tool_result":
            # Results answer the previous assistant turn: they go before any text of this turn.
            at = next((k for k, b in enumerate(merged) if b["type"] != "tool_result"), len(merged))
            merged[at:at] = blocks
        else:
            merged.extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


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
        return _text(content)
    if not isinstance(content, list):
        raise invalid_request(f"{path}: expected a string or a list of text parts", "messages")
    blocks = []
    for part_path, kind, part in _parts(content, path):
        if kind != "text":
            raise invalid_request(f"{part_path}.type: only text parts are allowed here", "messages")
        blocks.extend(_text(_string(part.get("text"), f"{part_path}.text")))
    return blocks


def _user_blocks(content: Any, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise invalid_request(f"{path}: expected a string or a list of content parts", "messages")
    blocks = []
    for part_path, kind, part in _parts(content, path):
        if kind != "text":
            raise invalid_request(f"{part_path}.type: unsupported content part type {kind!r}", "messages")
        blocks.extend(_text(_string(part.get("text"), f"{part_path}.text")))
    return blocks


def _assistant_blocks(message: dict[str, Any], path: str) -> list[dict[str, Any]]:
    content = message.get("content")
    blocks: list[dict[str, Any]] = []
    if isinstance(content, str):
        blocks.extend(_text(content))
    elif isinstance(content, list):
        for part_path, kind, part in _parts(content, f"{path}.content"):
            if kind == "text":
                blocks.extend(_text(_string(part.get("text"), f"{part_path}.text")))
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
    arguments = function.get("arguments") or "{}"
    try:
        arguments = orjson.loads(_string(arguments, f"{path}.function.arguments"))
    except orjson.JSONDecodeError:
        raise invalid_request(f"{path}.function.arguments: not valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise invalid_request(f"{path}.function.arguments: expected a JSON object", "messages")
    return {
        "type": "tool_use",
        "id": _string(call.get("id"), f"{path}.id"),
        "name": _string(function.get("name"), f"{path}.function.name"),
        "input": arguments,
    }


def _tool_result(message: dict[str, Any], path: str) -> dict[str, Any]:
    result: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": _string(message.get("tool_call_id"), f"{path}.tool_call_id"),
    }
    blocks = _text_blocks(message.get("content", ""), f"{path}.content")
    if blocks:
        result["content"] = blocks
    return result


def _text(text: str) -> list[dict[str, Any]]:
    # The upstream rejects empty text blocks; whitespace-only text says nothing either.
    return [{"type": "text", "text": text}] if text and not text.isspace() else []


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise invalid_request(f"{path}: expected a string", "messages")
    return value


def _max_tokens(body: dict[str, Any], model: Model) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise invalid_request(f"{field}: expected a positive integer", field)
        if value > model.max_output_tokens:
            raise invalid_request(
                f"{field}: at most {model.max_output_tokens} for this model", field
            )
        return value
    return min(DEFAULT_MAX_TOKENS, model.max_output_tokens)


def _stop_sequences(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_request("stop: expected a string or a list of strings", "stop")
    # The upstream rejects whitespace-only sequences.
    return [s for s in stop if s and not s.isspace()]
