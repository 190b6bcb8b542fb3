"""Anthropic message → OpenAI chat completion, and the pieces the stream shares with it."""

from __future__ import annotations

from typing import Any

import orjson

from middlewares.core.usage import Usage

# docs/api.md, "Finish reasons". A context window filled by the output is a truncation too.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def finish_reason(stop_reason: str | None) -> str:
    return FINISH_REASONS.get(stop_reason or "", "stop")


def openai_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        },
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def tool_call(block: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    return {
        "id": block["id"],
        "type": "function",
        "function": {
            "name": renamed.get(block["name"], block["name"]),
            "arguments": orjson.dumps(block.get("input") or {}).decode(),
        },
    }


def to_completion(
    message: dict[str, Any], usage: Usage, *, completion_id: str, model: str, created: int, renamed: dict[str, str]
) -> dict[str, Any]:
    """`renamed` maps tool names the upstream was sent back to the client's."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(tool_call(block, renamed))
        # thinking (counted in usage), redacted thinking and server-side tool blocks are not the client's to see
    reply: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not calls else None,
        "refusal": None,
    }
    if calls:
        reply["tool_calls"] = calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": reply,
                "logprobs": None,
                "finish_reason": finish_reason(message.get("stop_reason")),
            }
        ],
        "usage": openai_usage(usage),
    }
