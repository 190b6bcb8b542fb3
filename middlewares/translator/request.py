"""OpenAI Chat Completions request → Anthropic Messages request: the top-level fields."""

from __future__ import annotations

from typing import Any

from middlewares.core.errors import invalid_request
from middlewares.core.openai_shapes import (
    cached,
    check_closed_objects,
    effort_and_thinking,
    input_schema,
    sampling,
    upstream_identifier,
)
from middlewares.core.protocols import ModelSpec
from middlewares.core.reasoning import UNKNOWN_EFFORT, known_effort
from middlewares.core.sizes import DEFAULT_MAX_TOKENS
from middlewares.translator.messages import convert_messages


def to_anthropic(body: dict[str, Any], model: ModelSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The upstream request for `body`, and the tool names it renamed (upstream → client).

    Only fields that mean something upstream are copied, so nothing OpenAI-only (or ignored
    by the gateway) ever reaches it.
    """
    system, messages = convert_messages(body.get("messages"))
    request: dict[str, Any] = {
        "model": model.id,
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

    renamed = _tools(body, model, request)
    forced = request.get("tool_choice", {}).get("type") in ("any", "tool")
    thinking = _reasoning(body.get("reasoning_effort"), model, request, forced, messages)
    if model.sampling and not thinking:
        sampling(body, request)
    _response_format(body.get("response_format"), request)
    return request, renamed


def _max_tokens(body: dict[str, Any], model: ModelSpec) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise invalid_request(f"{field}: expected a positive integer", field)
        if value > model.max_output_tokens:
            raise invalid_request(f"{field}: at most {model.max_output_tokens} for this model", field)
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


# --- Tools.


def _tools(body: dict[str, Any], model: ModelSpec, request: dict[str, Any]) -> dict[str, str]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return {}  # without tools, tool_choice and parallel_tool_calls are ignored
    if not isinstance(tools, list):
        raise invalid_request("tools: expected a list of tools", "tools")
    converted, renamed = [], {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise invalid_request(f"tools[{i}].function: expected an object", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"tools[{i}].function.name: expected a non-empty string", "tools")
        upstream_name = upstream_identifier(name)
        if upstream_name != name:
            renamed[upstream_name] = name
        schema = input_schema(function.get("parameters"), f"tools[{i}].function.parameters", "tools")
        definition: dict[str, Any] = {"name": upstream_name, "input_schema": schema}
        description = function.get("description")
        if isinstance(description, str) and description:
            definition["description"] = description
        if function.get("strict") is True:
            definition["strict"] = True
        converted.append(cached(definition, tool, f"tools[{i}]", "tools"))
    request["tools"] = converted
    choice = _tool_choice(body.get("tool_choice"), model, {t["name"] for t in converted})
    if body.get("parallel_tool_calls") is False and choice.get("type") != "none":
        choice = {"type": "auto", **choice, "disable_parallel_tool_use": True}
    if choice:
        request["tool_choice"] = choice
    return renamed


def _tool_choice(choice: Any, model: ModelSpec, names: set[str]) -> dict[str, Any]:
    if choice is None:
        return {}
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        forced = {"type": "any"}
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or upstream_identifier(name) not in names:
            raise invalid_request("tool_choice.function.name: expected the name of one of the tools", "tool_choice")
        forced = {"type": "tool", "name": upstream_identifier(name)}
    else:
        raise invalid_request(
            'tool_choice: expected "auto", "none", "required" or {"type": "function", "function": {"name": …}}',
            "tool_choice",
        )
    if not model.forced_tool_choice:
        raise invalid_request('tool_choice: this model cannot be forced to call a tool; use "auto"', "tool_choice")
    return forced


# --- Reasoning and sampling.


def _reasoning(
    value: Any, model: ModelSpec, request: dict[str, Any], forced_tool: bool, messages: list[dict[str, Any]]
) -> bool:
    """Set effort (and adaptive thinking) from reasoning_effort; True when thinking is requested."""
    if value is None:
        return False
    if not known_effort(value):
        raise invalid_request(UNKNOWN_EFFORT, "reasoning_effort")  # when the refusals stage is not mounted
    return effort_and_thinking(value, "reasoning_effort", model, request, forced_tool, messages)


def _response_format(value: Any, request: dict[str, Any]) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind != "json_schema":
        raise invalid_request('response_format.type: expected "json_schema" or "text"', "response_format")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid_request("response_format.json_schema.schema: expected a JSON schema object", "response_format")
    check_closed_objects(schema, "response_format.json_schema.schema")
    request.setdefault("output_config", {})["format"] = {"type": "json_schema", "schema": schema}
