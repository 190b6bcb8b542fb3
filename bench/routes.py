"""The gateway's routes a benchmark drives, and how a client of each reaches it: the path, the
API it speaks, what it adds to a scenario's body, the key in the header its SDKs send it in.
Both what the clients send (scenarios.py) and the processes (systems.py) need these."""

from __future__ import annotations

import hashlib

GATEWAY_KEY = "sk-bench-" + hashlib.sha256(b"ezat bench").hexdigest()[:24]
# {route: (the path its clients POST to, the API they speak)}.
GATEWAY_ROUTES = {
    "openai": ("/v1/chat/completions", "openai"),  # Chat Completions, translated
    "responses": ("/v1/responses", "responses"),  # OpenAI's Responses API, translated; each response stored
    "responses-unstored": ("/v1/responses", "responses"),  # the same, each request with "store": false
    "native": ("/v1/messages", "anthropic"),  # Anthropic's Messages API, relayed
}
# What a route's requests add to the scenario's body: storing a response is the Responses API's
# default, and a write the chat route has not; Codex sends "store": false.
ROUTE_FIELDS = {"responses-unstored": {"store": False}}
# The gateway's route for a client of each API.
ROUTE_OF_API = {"openai": "openai", "responses": "responses", "anthropic": "native"}


def route_headers(route: str) -> list[str]:
    """The gateway key in the header the route's clients send it in (Anthropic's SDKs: x-api-key)."""
    if GATEWAY_ROUTES[route][1] == "anthropic":
        return [f"x-api-key: {GATEWAY_KEY}", "anthropic-version: 2023-06-01"]
    return [f"Authorization: Bearer {GATEWAY_KEY}"]
