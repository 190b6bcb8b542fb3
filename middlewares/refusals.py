"""The refusals stage: fields that would change the answer and have no equivalent upstream are
refused with a 400 naming the field, in the exact words the API promises (docs/api.md).

Ignored fields need no work here: the translator copies only what the upstream understands.
Refusing here, before the images stage, means a refused request downloads no image.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from middlewares.core.chain import Stage, stage
from middlewares.core.context import BODY
from middlewares.core.errors import invalid_request
from middlewares.core.reasoning import UNKNOWN_EFFORT, known_effort

__all__ = ["refusals_middleware", "refused"]

LEGACY_FUNCTIONS = "functions: the legacy functions API is not supported; use tools"
LOG_PROBABILITIES = "log probabilities are not available"


def refused(body: dict[str, Any]) -> tuple[str, str] | None:
    """(message, param) for the first refused field of a request, or None."""
    n = body.get("n")
    if n is not None and n != 1:
        return "n: only 1 choice per request is supported", "n"
    if body.get("logprobs") not in (None, False):
        return f"logprobs: {LOG_PROBABILITIES}", "logprobs"
    if body.get("top_logprobs") is not None:
        return f"top_logprobs: {LOG_PROBABILITIES}", "top_logprobs"
    if body.get("logit_bias"):
        return "logit_bias: is not supported", "logit_bias"
    modalities = body.get("modalities")
    if body.get("audio") is not None or (modalities is not None and modalities != ["text"]):
        return "modalities: only text output is supported", "modalities"
    if body.get("web_search_options") is not None:
        return "web_search_options: is not supported", "web_search_options"
    if body.get("functions") is not None or body.get("function_call") is not None:
        return LEGACY_FUNCTIONS, "functions"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        return (
            'response_format: type "json_object" is not supported; use "json_schema" with a schema '
            '(objects need "additionalProperties": false)',
            "response_format",
        )
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                return f"tools[{i}].type: only function tools are supported", "tools"
    if not known_effort(body.get("reasoning_effort")):
        return UNKNOWN_EFFORT, "reasoning_effort"
    messages = body.get("messages")
    return _refused_in_messages(messages) if isinstance(messages, list) else None


def _refused_in_messages(messages: list[Any]) -> tuple[str, str] | None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "function":
            return f'messages[{i}].role: the legacy "function" role is not supported; use tools', "messages"
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_audio":
                return f"messages[{i}].content[{j}]: audio input is not supported", "messages"
            if kind == "file" and isinstance(part.get("file"), dict) and "file_id" in part["file"]:
                return (
                    f"messages[{i}].content[{j}].file: send the PDF as file_data (a base64 data URL); "
                    "file_id is not supported",
                    "messages",
                )
    return None


def refusals_middleware() -> Stage:
    """A request in `request[BODY]` (an OpenAI chat completion request) with a refused field
    gets its 400, naming the field; any other goes on unchanged."""

    @stage("refusals", requires=(BODY,))
    async def refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
        found = refused(request[BODY])
        if found is not None:
            raise invalid_request(*found)
        return await handler(request)

    return refusals
