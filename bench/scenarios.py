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
    # The APIs a client of this scenario speaks: the tiny ones every API; a realistic one only its
    # client's (a Claude Code turn is Anthropic's), which the routes driven must match.
    apis: tuple[str, ...] = ("openai", "responses", "anthropic")
    tool_name: str = "get_weather"  # the tool the answer calls, with `tools`


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("nonstream", "bench-nonstream", False, False, "non-streaming small request, 400 characters back"),
        Scenario("stream50", "bench-stream50", True, False, "stream of 50 text deltas, arriving in one burst"),
        Scenario("tool", "bench-tool", True, True, "stream of a short text and a tool call (12 deltas), one burst"),
        Scenario("paced", "bench-paced", True, False, "stream of 50 text deltas arriving one by one, 10 ms apart", 0.5),
        Scenario(
            "claude-code",
            "bench-claude-code",
            True,
            True,
            "a Claude Code turn: 150 KB (20 KB system prompt, 25 tools, 40 turns of history with tool calls and"
            " results, cache_control set by the client), streamed back with thinking, a line and a tool call",
            apis=("anthropic",),
            tool_name="Bash",
        ),
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
    if s.name == "claude-code":
        return claude_code_request(s)
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


def claude_code_request(s: Scenario) -> bytes:
    """A request the size and shape of a Claude Code turn well into a session: its system prompt
    (about 20 KB), 25 tools with their schemas, and 40 turns of history (the assistant's thinking,
    a line and a tool call; the tool's result, a few KB of a file or a command's output), with
    the client's own cache breakpoints on the system prompt, the last tool and the newest turn.
    About 150 KB; the same bytes every time (no randomness)."""
    rule = "When you edit a file, read it first, keep its style, and run its tests after. "
    system = [
        {"type": "text", "text": "You are Claude Code, a coding agent working in the user's repository."},
        {"type": "text", "text": (rule * 260)[:20_000], "cache_control": {"type": "ephemeral"}},
    ]
    tools = []
    for i in range(25):
        tools.append(
            {
                "name": f"Tool{i:02d}",
                "description": f"Tool {i}: " + "Does one thing to the workspace and reports what it did. " * 7,
                "input_schema": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "An absolute path in the workspace."},
                        "pattern": {"type": "string", "description": "A glob or a regular expression."},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
                        "mode": {"type": "string", "enum": ["read", "write", "append", "list"]},
                        "options": {
                            "type": "object",
                            "properties": {"recursive": {"type": "boolean"}, "hidden": {"type": "boolean"}},
                            "additionalProperties": False,
                        },
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
            }
        )
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    line = "    def parse(self, text: str) -> Node:  # reads one expression of the grammar, or raises\n"
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "The parser's tests fail: fix it."}]}]
    for turn in range(20):  # 20 calls and 20 results: 40 turns after the question
        call_id = f"toolu_{turn:04d}"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": f"Step {turn}: look at the next file. " * 8,
                        "signature": "sig" * 60,
                    },
                    {"type": "text", "text": f"Let me read part {turn} of the parser."},
                    {
                        "type": "tool_use",
                        "id": call_id,
                        "name": f"Tool{turn % 25:02d}",
                        "input": {"path": f"/repo/src/parser/part{turn}.py", "limit": 400, "mode": "read"},
                    },
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": line * 50}],
            }
        )
    messages[-1]["content"].append({"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}})
    body = {
        "model": s.model,
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "system": system,
        "tools": tools,
        "messages": messages,
        "metadata": {"user_id": "user_bench_session_0001"},
        "stream": True,
    }
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
