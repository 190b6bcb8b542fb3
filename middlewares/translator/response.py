"""Anthropic message → OpenAI chat completion, and the pieces the stream shares with it."""

from __future__ import annotations

from typing import Any

import orjson

# Spec, "Finish reasons". A context window filled by the output is a truncation too.
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


def estimate_tokens(chars: int) -> int:
    """Tokens in `chars` characters of text, for when the upstream does not say (≈4 per token)."""
    return (chars + 3) // 4


def openai_usage(usage: dict[str, Any], thinking_chars: int = 0) -> dict[str, Any]:
    """OpenAI's usage from Anthropic's. Anthropic's input_tokens leaves out cache reads and
    writes; OpenAI's prompt_tokens counts all input, cached or not."""
    cache_read = usage.get("cache_read_input_tokens") or 0
    cache_write = usage.get("cache_creation_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cache_read + cache_write
    completion = usage.get("output_tokens") or 0
    reasoning = (usage.get("output_tokens_details") or {}).get("thinking_tokens")
    if reasoning is None:
        reasoning = min(estimate_tokens(thinking_chars), completion)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cache_read, "cache_write_tokens": cache_write},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
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
    message: dict[str, Any], *, completion_id: str, model: str, created: int, renamed: dict[str, str]
) -> dict[str, Any]:
    """`renamed` maps tool names the upstream was sent back to the client's."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking_chars = 0
    for block in message.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(tool_call(block, renamed))
        elif kind == "thinking":
            thinking_chars += len(block.get("thinking", ""))
        # redacted thinking and server-side tool blocks are not the client's to see
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
        "usage": openai_usage(message.get("usage") or {}, thinking_chars),
    }
