"""Anthropic message → OpenAI Responses API `response` object, and the pieces its stream shares:
the output items, the envelope, the status and the usage, so a stream's last event and a whole
reply are made by the same code."""

from __future__ import annotations

import time
from typing import Any

import orjson

from middlewares.core.usage import Usage
from middlewares.responses.turn import CUSTOM_INPUT, ResponseTurn

# The settings a response echoes, as OpenAI says them when the request left them out.
ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "prompt_cache_key": None,
    "reasoning": {"effort": None, "summary": None},
    "safety_identifier": None,
    "service_tier": "default",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "metadata": {},
}

# Anthropic stop_reason → why a response is incomplete; any other reason completes it.
INCOMPLETE_REASONS = {
    "max_tokens": "max_output_tokens",
    "model_context_window_exceeded": "max_output_tokens",
    "refusal": "content_filter",
}

# Item id prefixes, as OpenAI's.
MESSAGE, REASONING, FUNCTION_CALL, CUSTOM_TOOL_CALL = "msg", "rs", "fc", "ctc"
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def item_id(turn: ResponseTurn, prefix: str, output_index: int) -> str:
    """An output item's id: its response's and its place, so a stream and its last event, made
    apart, name each item alike."""
    return f"{prefix}_{turn.response_id.removeprefix('resp_')}_{output_index}"


def incomplete_reason(stop_reason: str | None) -> str | None:
    return INCOMPLETE_REASONS.get(stop_reason or "")


def responses_usage(usage: Usage) -> dict[str, Any]:
    """The gateway's usage in the Responses API's words: input counts cache reads and writes."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        },
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
    }


def response_object(
    turn: ResponseTurn,
    output: list[dict[str, Any]],
    *,
    status: str,
    usage: Usage | None = None,
    reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response envelope around `output`: `reason` says why it is incomplete, `error` why
    it failed."""
    return {
        "id": turn.response_id,
        "object": "response",
        "created_at": turn.created_at,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": None if reason is None else {"reason": reason},
        **ECHO_DEFAULTS,
        **turn.echo,
        "model": turn.model,
        "output": output,
        "usage": None if usage is None else responses_usage(usage),
    }


def message_item(turn: ResponseTurn, index: int, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id(turn, MESSAGE, index),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(turn: ResponseTurn, index: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer's thinking blocks in a row as one item: their text as its summary when asked,
    the blocks themselves sealed in `encrypted_content` when asked, for a later turn to send back."""
    item: dict[str, Any] = {"id": item_id(turn, REASONING, index), "type": "reasoning", "summary": []}
    if turn.summary:
        item["summary"] = [
            {"type": "summary_text", "text": block["thinking"]}
            for block in blocks
            if block.get("type") == "thinking" and block.get("thinking")
        ]
    if turn.seal is not None:
        item["encrypted_content"] = turn.seal(blocks)
    return item


def tool_call_item(
    turn: ResponseTurn, index: int, block: dict[str, Any], arguments: str, status: str = "completed"
) -> dict[str, Any]:
    """A tool_use block as the client's call: a custom_tool_call for a custom tool (its input
    the one string property), else a function_call with `arguments`, its input's JSON."""
    upstream_name = block["name"]
    name = turn.renamed.get(upstream_name, upstream_name)
    if upstream_name in turn.custom_tools:
        item: dict[str, Any] = {
            "id": item_id(turn, CUSTOM_TOOL_CALL, index),
            "type": "custom_tool_call",
            "call_id": block["id"],
            "name": name,
            "input": custom_input(arguments),
        }
    else:
        item = {
            "id": item_id(turn, FUNCTION_CALL, index),
            "type": "function_call",
            "status": status,
            "call_id": block["id"],
            "name": name,
            "arguments": arguments,
        }
    namespace = turn.namespaces.get(upstream_name)
    if namespace is not None:
        item["namespace"] = namespace
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's input: the string Claude put in its one property. Anything else it wrote
    goes as its JSON, for the client to see what came; nothing at all is ""."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return arguments  # cut short (the output limit): what came is all there is
    if isinstance(value, dict) and CUSTOM_INPUT in value:
        value = value[CUSTOM_INPUT]
    elif value == {}:
        return ""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def to_response(message: dict[str, Any], usage: Usage, turn: ResponseTurn) -> dict[str, Any]:
    """The upstream's whole message as a `response`: its thinking blocks in a row as a
    reasoning item, its text blocks in a row as one message, each tool call an item."""
    output: list[dict[str, Any]] = []
    texts: list[str] | None = None  # the open message's text
    thinking: list[dict[str, Any]] | None = None  # the open reasoning item's blocks

    def close() -> None:
        nonlocal texts, thinking
        if texts is not None:
            output.append(message_item(turn, len(output), "".join(texts)))
        elif thinking is not None:
            output.append(reasoning_item(turn, len(output), thinking))
        texts = thinking = None

    for block in message.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            if texts is None:
                close()
                texts = []
            texts.append(block.get("text") or "")
        elif kind in THINKING_BLOCKS:
            if thinking is None:
                close()
                thinking = []
            thinking.append(block)
        elif kind == "tool_use":
            close()
            output.append(tool_call_item(turn, len(output), block, orjson.dumps(block.get("input") or {}).decode()))
        # server tools' blocks (a web search the client asked for) are not the client's to see
    close()
    reason = incomplete_reason(message.get("stop_reason"))
    if reason is not None and output and output[-1]["type"] in ("message", "function_call"):
        output[-1]["status"] = "incomplete"  # the item the limit cut short
    return response_object(
        turn, output, status="completed" if reason is None else "incomplete", usage=usage, reason=reason
    )
