"""What the gateway reads of the upstream's messages and stream events, checked once, where they
arrive. Past this check, billing and the translator index them freely. A reply that fails it is
the upstream's error, not the gateway's: it is never billed (docs/api.md, "Errors": failed requests
aren't billed), and before the first token it moves on to the next deployment, as a 5xx does.

Only what the gateway reads is checked; fields it does not know pass as they are.
"""

from __future__ import annotations

from typing import Any

import orjson

from middlewares.core.errors import cut, error_event

# The usage numbers billing reads: whole numbers of 0 or more, or absent (None).
_COUNTS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
# A delta's text, by the delta's type.
_DELTA_TEXT = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}


def readable_message(message: Any) -> bool:
    """A whole (non-streamed) message: a JSON object of type "message" with a list of readable
    content blocks, which the gateway can send on (see _sendable)."""
    if not isinstance(message, dict) or message.get("type", "message") != "message":
        return False
    content = message.get("content")
    return (
        isinstance(content, list)
        and all(_readable_block(block) for block in content)
        and _readable_usage(message.get("usage"))
        and _readable_stop(message.get("stop_reason"))
        and _sendable(message)
    )


def readable_event(event: dict[str, Any]) -> bool:
    """One stream event (a JSON object with a string `type`), which the gateway can send on."""
    kind = event["type"]
    if kind == "content_block_delta":
        delta = event.get("delta")
        if not isinstance(delta, dict) or type(event.get("index")) is not int:
            return False
        dtype = delta.get("type")
        field = _DELTA_TEXT.get(dtype) if isinstance(dtype, str) else None  # a list is no key
        if field is not None:  # nearly every event: a string, nothing nested to check
            return isinstance(delta.get(field), str)
    elif kind == "content_block_start":
        if not (type(event.get("index")) is int and _readable_block(event.get("content_block"))):
            return False
    elif kind == "content_block_stop":
        return type(event.get("index")) is int
    elif kind == "message_start":
        message = event.get("message")
        if not (isinstance(message, dict) and _readable_usage(message.get("usage"))):
            return False
    elif kind == "message_delta":
        delta = event.get("delta", {})
        if not (
            isinstance(delta, dict) and _readable_stop(delta.get("stop_reason")) and _readable_usage(event.get("usage"))
        ):
            return False
    elif kind == "error":
        return isinstance(event.get("error") or {}, dict)
    return _sendable(event)


def _sendable(value: Any) -> bool:
    """Whether the gateway can write `value` out again: orjson reads JSON nested 1,024 deep, and
    writes it only 255 deep. A reply it could not send on is never billed."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def passed_on_error(event: dict[str, Any]) -> dict[str, Any]:
    """An upstream's `error` event as the gateway passes it on: its type (when it is one), its
    message cut to a bounded length, nothing else."""
    error = event.get("error") or {}
    return error_event(cut(str(error.get("message") or "upstream error")), error_type(error.get("type")) or "api_error")


def error_type(kind: Any) -> str | None:
    """An upstream error's type, if it is one (a short string), else None."""
    return kind if isinstance(kind, str) and 0 < len(kind) <= 64 else None


def _readable_block(block: Any) -> bool:
    if not isinstance(block, dict):
        return False
    kind = block.get("type")
    if not isinstance(kind, str):
        return False
    if kind == "text":
        return isinstance(block.get("text", ""), str)
    if kind == "tool_use":
        return isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
    if kind == "thinking":
        return isinstance(block.get("thinking", ""), str)
    return True


def _readable_usage(usage: Any) -> bool:
    if usage is None:  # absent: nothing to count
        return True
    if not isinstance(usage, dict):
        return False
    if not all(_count(usage.get(name)) for name in _COUNTS):
        return False
    return _counts(usage.get("output_tokens_details"), "thinking_tokens") and _counts(
        usage.get("cache_creation"), "ephemeral_1h_input_tokens"
    )


def _counts(details: Any, name: str) -> bool:
    """A usage's breakdown (absent, or an object whose `name` is a count)."""
    return details is None or (isinstance(details, dict) and _count(details.get(name)))


def _count(value: Any) -> bool:
    return value is None or (type(value) is int and value >= 0)


def _readable_stop(reason: Any) -> bool:
    return reason is None or isinstance(reason, str)
