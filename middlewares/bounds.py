"""The bounds stage: refuses a request whose lists are too long, or whose JSON schemas nest too
deep, before any later stage walks them. A 32 MB body can hold millions of messages, parts or
stop sequences, and a schema nested a thousand levels deep; every stage after this one may walk
them without a thought for their size (the translator's schema check, the refusals' pass over
the messages).

It reads the OpenAI field names, the Anthropic ones (`stop_sequences`, `input_schema`,
`output_config`) and the Responses API's (`input`'s items count as messages, their content and
tool outputs as parts; a namespace's tools as tools; `text.format`), so the native Anthropic
Messages route and the Responses route mount it as it is: no field of one API means something
else in another.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import BODY
from middlewares.core.errors import invalid_request

__all__ = ["DEFAULT_BOUNDS", "Bounds", "bounds_middleware", "out_of_bounds"]


@dataclass(frozen=True)
class Bounds:
    """The most of each list one request may hold, and how deep its schemas may nest. The
    defaults are far above what a real conversation holds, and far below what would hold a
    later stage up: the stage's defaults, and the gateway's `[bounds]`."""

    max_messages: int = 100_000
    max_content_parts: int = 100_000  # over all the messages
    max_tools: int = 1_000
    max_stop: int = 100  # stop sequences
    max_schema_depth: int = 100  # levels of JSON in a tool's or the output's schema

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Bounds: {name} must be a positive integer")


DEFAULT_BOUNDS = Bounds()


def bounds_middleware(limits: Bounds = DEFAULT_BOUNDS) -> Stage:
    """A request in `request[BODY]` with more messages, content parts (over all messages, and an
    Anthropic `system` list's blocks), tools or stop sequences than `limits`, or a tool's or the
    output format's schema nesting more levels than their `max_schema_depth`, gets a 400 naming
    the field, its limit and its count; any other goes on unchanged."""

    @stage("bounds", requires=(BODY,))
    async def bounds(request: web.Request, handler: Handler) -> web.StreamResponse:
        found = out_of_bounds(request[BODY], limits)
        if found is not None:
            raise invalid_request(*found)
        return await handler(request)

    return bounds


def out_of_bounds(body: dict[str, Any], bounds: Bounds) -> tuple[str, str] | None:
    """(message, param) for the first bound a request is over, or None. The lengths first (each
    one len()), then one pass over the messages for their parts, then the schemas."""
    messages, listed = body.get("messages"), "messages"
    if not isinstance(messages, list):
        messages, listed = body.get("input"), "input"  # the Responses API's items
        messages = messages if isinstance(messages, list) else []
    tools = body.get("tools")
    tools = tools if isinstance(tools, list) else []
    if len(messages) > bounds.max_messages:
        return _over(listed, bounds.max_messages, "messages" if listed == "messages" else "items", len(messages))
    count = len(tools) + sum(len(t["tools"]) for t in tools if isinstance(t, dict) and isinstance(t.get("tools"), list))
    if count > bounds.max_tools:
        return _over("tools", bounds.max_tools, "tools", count)
    for field in ("stop", "stop_sequences"):
        stop = body.get(field)
        if isinstance(stop, list) and len(stop) > bounds.max_stop:
            return _over(field, bounds.max_stop, "stop sequences", len(stop))
    system = body.get("system")
    parts = len(system) if isinstance(system, list) else 0
    for message in messages:
        if isinstance(message, dict):
            for key in ("content", "output"):  # a Responses tool output's parts are parts too
                content = message.get(key)
                if isinstance(content, list):
                    parts += len(content)
    if parts > bounds.max_content_parts:
        return _over(listed, bounds.max_content_parts, "content parts", parts)
    for path, param, schema in _schemas(body, tools):
        if _nests_deeper(schema, bounds.max_schema_depth):
            return f"{path}: nests more than {bounds.max_schema_depth:,} levels", param
    return None


def _over(field: str, limit: int, what: str, count: int) -> tuple[str, str]:
    return f"{field}: at most {limit:,} {what} per request (this one has {count:,})", field


def _schemas(body: dict[str, Any], tools: list[Any]) -> Iterator[tuple[str, str, Any]]:
    """(path, param, schema) of every JSON schema in the request: each tool's, OpenAI's,
    Anthropic's and the Responses API's, and the output format's."""
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        if isinstance(function, dict):
            yield f"tools[{i}].function.parameters", "tools", function.get("parameters")
        yield f"tools[{i}].input_schema", "tools", tool.get("input_schema")
        yield f"tools[{i}].parameters", f"tools[{i}].parameters", tool.get("parameters")  # the Responses API's
        members = tool.get("tools")  # a Responses namespace's
        for k, member in enumerate(members if isinstance(members, list) else ()):
            if isinstance(member, dict):
                path = f"tools[{i}].tools[{k}].parameters"
                yield path, path, member.get("parameters")
    response_format = body.get("response_format")
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if isinstance(spec, dict):
        yield "response_format.json_schema.schema", "response_format", spec.get("schema")
    text = body.get("text")
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict):
        yield "text.format.schema", "text.format.schema", text_format.get("schema")
    output_config = body.get("output_config")
    output_format = output_config.get("format") if isinstance(output_config, dict) else None
    if isinstance(output_format, dict):
        yield "output_config.format.schema", "output_config", output_format.get("schema")


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests objects and arrays more than `limit` levels deep (`{}` is one level,
    a scalar none). An explicit stack: no depth is too deep for the walk itself."""
    if not isinstance(value, (dict, list)):
        return False
    # Each level opens a bracket: a schema whose JSON opens no more than `limit` (its strings'
    # own counted too) nests no deeper, which two counts say in a fraction of the walk's time.
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:
        pass  # deeper than orjson writes (255 levels): the walk decides
    else:
        if text.count(b"{") + text.count(b"[") <= limit:
            return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                if depth == limit:
                    return True
                stack.append((child, depth + 1))
    return False
