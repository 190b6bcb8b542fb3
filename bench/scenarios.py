"""What the clients send: each scenario as an OpenAI Chat Completions request and an OpenAI
Responses request (to the gateway's translating routes), and the equivalent Anthropic request
(to the floor and the gateway's Messages route), so that all cause the same upstream work. The
fast mock picks its reply by `model` (gateway.mock.upstream.FAST_MODELS)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    stream: bool
    tools: bool
    what: str
    seconds: float = 0.0  # how long the mock takes over one answer (paced: 50 deltas 10 ms apart)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("nonstream", "bench-nonstream", False, False, "non-streaming small request, 400 characters back"),
        Scenario("stream50", "bench-stream50", True, False, "stream of 50 text deltas, arriving in one burst"),
        Scenario("tool", "bench-tool", True, True, "stream of a short text and a tool call (12 deltas), one burst"),
        Scenario("paced", "bench-paced", True, False, "stream of 50 text deltas arriving one by one, 10 ms apart", 0.5),
    )
}
SLOW = Scenario("slow", "bench-slow", True, False, "each 10 deltas one second apart, 10 s")

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather like in Paris this week? Please check before answering."
WEATHER = {
    "name": "get_weather",
    "description": "The forecast for a city.",
    "schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string", "description": "ISO 3166 code"},
            "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["city"],
    },
}


def openai_request(s: Scenario) -> bytes:
    body = {
        "model": s.model,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}],
        "max_tokens": 1024,
    }
    if s.stream:
        body["stream"] = True
    if s.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": WEATHER["name"],
                    "description": WEATHER["description"],
                    "parameters": WEATHER["schema"],
                },
            }
        ]
    return orjson.dumps(body)


def responses_request(s: Scenario) -> bytes:
    """The scenario as OpenAI's Responses API asks it: the system prompt as `instructions`, the
    question as one message item, the output limit as `max_output_tokens`."""
    body = {
        "model": s.model,
        "instructions": SYSTEM_PROMPT,
        "input": [{"role": "user", "content": QUESTION}],
        "max_output_tokens": 1024,
    }
    if s.stream:
        body["stream"] = True
    if s.tools:
        body["tools"] = [
            {
                "type": "function",
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "parameters": WEATHER["schema"],
            }
        ]
    return orjson.dumps(body)


def anthropic_request(s: Scenario) -> bytes:
    body = {
        "model": s.model,
        "max_tokens": 1024,
        # In content blocks, as the gateway's translator sends them.
        "system": [{"type": "text", "text": SYSTEM_PROMPT}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    }
    if s.stream:
        body["stream"] = True
    if s.tools:
        body["tools"] = [
            {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["schema"]}
        ]
    return orjson.dumps(body)


# What a client that speaks each API sends.
ENCODERS = {"openai": openai_request, "responses": responses_request, "anthropic": anthropic_request}


def request_body(api: str, s: Scenario, fields: dict | None = None) -> bytes:
    """The scenario's request in `api`, with `fields` added (systems.ROUTE_FIELDS)."""
    body = ENCODERS[api](s)
    return orjson.dumps(orjson.loads(body) | fields) if fields else body


async def upstream_differences(
    config_toml: str, scenarios: list[Scenario], routes: tuple[str, ...] = ("openai",)
) -> list[str]:
    """Send each scenario's request on each of the gateway's `routes` (systems.GATEWAY_ROUTES)
    through the gateway's app (in this process) to the project's validating mock, and compare
    what reached the mock with the floor's request. Returns the differences (none: every system
    asks the same of the upstream). The mock's validation also proves the floor's requests are
    ones the real API accepts."""
    import aiohttp
    from systems import GATEWAY_ROUTES, ROUTE_FIELDS, route_headers

    from gateway.app import build_app
    from gateway.config import parse_config
    from gateway.mock.upstream import MockUpstream

    differences = []
    mock = MockUpstream()
    url = await mock.start()
    config = parse_config(config_toml.replace("{UPSTREAM}", url))
    runner = aiohttp.web.AppRunner(build_app(config))
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gateway = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            for route in routes:
                path, api = GATEWAY_ROUTES[route]
                headers = dict(h.split(": ", 1) for h in route_headers(route)) | {"Content-Type": "application/json"}
                for s in scenarios:
                    body = request_body(api, s, ROUTE_FIELDS.get(route))
                    async with session.post(gateway + path, data=body, headers=headers) as response:
                        await response.read()
                    sent = mock.requests[-1].body if mock.requests else None
                    if response.status != 200 or sent != orjson.loads(anthropic_request(s)):
                        differences.append(
                            f"{route} {s.name}: status {response.status}; the gateway sent upstream {sent}"
                        )
    finally:
        await runner.cleanup()
        await mock.close()
    return differences


def closing_marker(api: str, s: Scenario) -> str:
    """What the end of a complete response body contains (checked by the asyncio client, which
    keeps a body's last 64 bytes), for a system whose clients speak `api` ("openai", "responses"
    or "anthropic"). A Responses stream has no [DONE]: it ends with `response.completed`, whose
    response ends with its usage (a failed one's usage is null)."""
    if not s.stream:
        return ""
    return {"openai": "[DONE]", "responses": '"total_tokens":', "anthropic": "message_stop"}[api]
