"""What a Responses API reply needs of its request: made when the request is translated to
Anthropic's Messages API, read when the upstream's answer is translated back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ResponseTurn:
    response_id: str  # "resp_" + the request id
    model: str  # the name the client asked by, which the response carries
    created_at: int  # Unix seconds
    # The request's settings a response object echoes, under their Responses names, with
    # OpenAI's defaults where the client sent none: instructions, tools, tool_choice, temperature,
    # top_p, max_output_tokens, parallel_tool_calls, reasoning, text, metadata, store,
    # previous_response_id, truncation, user, service_tier.
    echo: dict[str, Any] = field(default_factory=dict)
    # An upstream tool name -> the name the client gave it (names Claude cannot take, and the
    # tools of a namespace, are sent under another name).
    renamed: dict[str, str] = field(default_factory=dict)
    # An upstream tool name -> its namespace, for a namespaced tool's call.
    namespaces: dict[str, str] = field(default_factory=dict)
    # Upstream names of the client's custom (free-form) tools: Claude gets each as a tool with one
    # string property, CUSTOM_INPUT, and the call goes back as a custom_tool_call with that string.
    custom_tools: frozenset[str] = frozenset()
    summary: bool = False  # reasoning.summary asked: a reasoning item's summary carries the thinking text
    # include asked for "reasoning.encrypted_content": `seal(blocks)` is that field's value, the
    # answer's thinking and redacted_thinking blocks sealed (None: not asked, or no key).
    seal: Callable[[list[dict[str, Any]]], str] | None = None
    # The conversation so far in Anthropic's format, thinking blocks included (the request's
    # messages, after those of the response it continues), and its system blocks but the
    # request's `instructions`: what a stored response keeps for the next request.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    conversation_system: list[dict[str, Any]] = field(default_factory=list)


CUSTOM_INPUT = "input"  # the one property of a custom tool's schema as Claude gets it
