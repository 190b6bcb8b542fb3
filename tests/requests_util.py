"""Request pieces and expected replies shared by several test files."""

from __future__ import annotations

from typing import Any

# The spec's Tools example: one function tool.
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# The fields the spec's "Ignored and refused fields" lists as ignored, each with a value a client
# may send; none of them may reach the upstream.
SPEC_IGNORED_FIELDS: dict[str, Any] = {
    "user": "alice",
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "auto",
}


def echo(said: str) -> str:
    """The mock upstream's default answer to a last user turn whose text is `said` (of which it
    repeats the first 200 characters)."""
    return "Hello from the mock upstream. You said: " + said[:200]
