"""Anthropic Messages request parts made from OpenAI's shapes: what the Chat Completions and the
Responses API translators both build (tool names and ids as the upstream takes them, turns of
content blocks, data URLs, cache markers, tool schemas, sampling, effort and thinking), each naming the client's field
in its errors."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

from middlewares.core.errors import invalid_request
from middlewares.core.media import THINKING_BLOCKS, is_base64, split_data_url
from middlewares.core.protocols import ModelSpec
from middlewares.core.reasoning import EFFORTS

# The upstream accepts only these characters in tool ids and tool names.
_SAFE = re.compile(r"[a-zA-Z0-9_-]+")
_UNSAFE_CHARACTER = re.compile(r"[^a-zA-Z0-9_-]")


def upstream_identifier(value: str, limit: int = 128) -> str:
    """`value` as the upstream accepts it. Unchanged when it already is; otherwise the same
    deterministic rewrite every time (ids from other providers such as `functions.Bash:0`),
    with a digest so two different values never collide."""
    if len(value) <= limit and _SAFE.fullmatch(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return _UNSAFE_CHARACTER.sub("_", value)[: limit - 9] + "_" + digest


# A turn: its role, its tool results and its other blocks.
Turn = tuple[str, list[dict[str, Any]], list[dict[str, Any]]]


def append_blocks(turns: list[Turn], role: str, blocks: list[dict[str, Any]]) -> None:
    """Messages of one role in a row make one turn. Tool results answer the assistant turn
    before it, so they go before any other block of theirs, whatever the order they came in."""
    if not blocks:
        return
    if not turns or turns[-1][0] != role:
        turns.append((role, [], []))
    _, results, others = turns[-1]
    (results if blocks[0]["type"] == "tool_result" else others).extend(blocks)


def data_url(url: str, path: str, param: str = "messages") -> tuple[str, str]:
    """(media type, base64 data) of a `data:<type>;base64,<data>` URL."""
    parts = split_data_url(url)
    if parts is None or not is_base64(parts[1]):
        raise invalid_request(f"{path}: expected a base64 data URL (data:<type>;base64,<data>)", param)
    return parts


def cached(block: dict[str, Any], source: dict[str, Any], path: str, param: str = "messages") -> dict[str, Any]:
    """`block` with the cache breakpoint its source part or tool carries, if any."""
    marker = source.get("cache_control")
    if marker is None:
        return block
    if (
        not isinstance(marker, dict)
        or marker.get("type") != "ephemeral"
        or marker.get("ttl", "5m") not in ("5m", "1h")
        or not set(marker) <= {"type", "ttl"}
    ):
        raise invalid_request(
            f'{path}.cache_control: expected {{"type": "ephemeral"}} with an optional "ttl" of "5m" or "1h"',
            param,
        )
    block["cache_control"] = marker
    return block


def tool_result(tool_use_id: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """A tool_result block answering `tool_use_id` with `blocks`. A breakpoint a client put in the
    result's text belongs on the result block itself."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id}
    for block in blocks:
        if "cache_control" in block:
            result["cache_control"] = block.pop("cache_control")
    if blocks:
        result["content"] = blocks
    return result


def nonblank_text(text: str) -> list[dict[str, Any]]:
    # The upstream rejects empty text blocks; whitespace-only text says nothing either.
    return [{"type": "text", "text": text}] if text and not text.isspace() else []


def input_schema(schema: Any, path: str, param: str) -> dict[str, Any]:
    """A function's parameters as the upstream's input_schema: none is no arguments, and a
    schema without a type is an object's."""
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise invalid_request(f"{path}: expected a JSON schema object", param)
    if "type" not in schema:
        return {"type": "object", **schema}
    if schema["type"] != "object":  # the upstream takes arguments as an object only
        raise invalid_request(f'{path}: expected a schema of "type": "object"', param)
    return schema


def sampling(body: dict[str, Any], request: dict[str, Any]) -> None:
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None:
        if not _is_number(temperature) or temperature < 0:
            raise invalid_request("temperature: expected a number from 0 to 2", "temperature")
        request["temperature"] = min(temperature, 1)  # the upstream's range ends at 1
    if top_p is not None:
        if not _is_number(top_p) or not 0 <= top_p <= 1:
            raise invalid_request("top_p: expected a number from 0 to 1", "top_p")
        if top_p < 1:  # 1 is the default: sending it says nothing
            request["top_p"] = top_p


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- Output format.


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def check_closed_objects(schema: Any, path: str, param: str = "response_format") -> None:
    """Every object in the schema must say `"additionalProperties": false` (docs/api.md, "Structured output").
    Depth first, in the order the keys are listed, with an explicit stack: a schema nested a
    thousand levels deep is no RecursionError (a 500) where the bounds stage is not mounted."""
    stack = [(schema, path)]
    while stack:
        schema, path = stack.pop()
        if not isinstance(schema, dict):
            continue
        kind = schema.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
        if is_object and schema.get("additionalProperties") is not False:
            raise invalid_request(f'{path}: objects need "additionalProperties": false', param)
        children: list[tuple[Any, str]] = []
        for key in _SUBSCHEMA_MAPS:
            subschemas = schema.get(key)
            if isinstance(subschemas, dict):
                children += ((sub, f"{path}.{key}.{name}") for name, sub in subschemas.items())
        for key in _SUBSCHEMA_LISTS:
            subschemas = schema.get(key)
            if isinstance(subschemas, list):
                children += ((sub, f"{path}.{key}[{i}]") for i, sub in enumerate(subschemas))
        if "items" in schema:
            children.append((schema["items"], f"{path}.items"))
        stack += reversed(children)  # the first child is checked next, as a recursive walk would


def call_arguments(value: Any, path: str, param: str) -> dict[str, Any]:
    """A function call's `arguments` (a JSON object written as a string; "" for a call of no
    arguments) as the tool_use's `input`."""
    if not isinstance(value, str):
        raise invalid_request(f"{path}: expected a string", param)
    try:
        arguments = orjson.loads(value) if value.strip() else {}
    except orjson.JSONDecodeError:
        raise invalid_request(f"{path}: not valid JSON", param) from None
    if not isinstance(arguments, dict):
        raise invalid_request(f"{path}: expected a JSON object", param)
    return arguments


def effort_and_thinking(
    name: str, field: str, model: ModelSpec, request: dict[str, Any], forced_tool: bool, messages: list[dict[str, Any]]
) -> bool:
    """Sets the upstream's effort, and adaptive thinking, for the reasoning effort `name` (one of
    `EFFORTS`) that the client's `field` asks; True when thinking is requested."""
    effort, think = EFFORTS[name]
    if effort not in model.efforts:
        if not think:
            return False  # "no thinking" needs no effort level on a model without one
        raise invalid_request(
            f"{field}: {name!r} is not available for this model; use one of " + ", ".join(model.efforts), field
        )
    request["output_config"] = {"effort": effort}
    # Forced tool use excludes thinking (the upstream refuses both). So does continuing a tool
    # call without the thinking that led to it (an OpenAI chat client cannot send it back, a
    # Responses client may not have, or the gateway could not open it): the upstream insists on it.
    if not think or forced_tool or _continues_tool_use_unthought(messages):
        return False
    request["thinking"] = {"type": "adaptive"}
    return True


def _continues_tool_use_unthought(messages: list[dict[str, Any]]) -> bool:
    """Whether the last assistant turn calls a tool with no thinking block before it."""
    for turn in reversed(messages):
        if turn["role"] == "assistant":
            blocks = turn["content"]
            return any(b["type"] == "tool_use" for b in blocks) and not any(
                b["type"] in THINKING_BLOCKS for b in blocks
            )
    return False
