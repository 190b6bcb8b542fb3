"""What the clients send: each scenario as an OpenAI Chat Completions request and an OpenAI
Responses request (to the gateway's translating routes), and the equivalent Anthropic request
(to the floor and the gateway's Messages route), so that all cause the same upstream work. The
fast mock picks its reply by `model` (gateway.mock.upstream.FAST_MODELS)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from routes import GATEWAY_ROUTES, ROUTE_FIELDS, ROUTE_OF_API, route_headers


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
    # The floor's request is what the gateway sent upstream for the client's, captured through the
    # validating mock (`upstream_requests`), not written here by hand: a realistic request's
    # translation (sealed reasoning opened, images downloaded and inlined) is the gateway's to make.
    captured: bool = False
    images: int = 0  # image URLs in the request, served by bench/images.py


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
        Scenario(
            "codex",
            "bench-codex",
            True,
            True,
            "a Codex turn on the Responses route: 12 KB of instructions, developer and environment messages,"
            " 10 function tools and a namespace of 3, 30 prior items (sealed reasoning, shell calls, their"
            " output), `store: false`; streamed back with reasoning and a shell call",
            apis=("responses",),
            tool_name="shell",
            captured=True,
        ),
        Scenario(
            "agent-loop",
            "bench-tool",
            True,
            True,
            "an OpenAI SDK agent's fifth turn on the chat route: 18 KB (instructions, 5 tools, 4 rounds of tool"
            " calls and their results), streamed back with usage: a line and a tool call",
            apis=("openai",),
            captured=True,
        ),
        Scenario(
            "images",
            "bench-nonstream",
            False,
            False,
            "a chat question about two image URLs (about 100 KB each, PNG), each downloaded by the gateway from"
            " a loopback server and sent upstream inline; 400 characters back",
            apis=("openai",),
            captured=True,
            images=2,
        ),
    )
}
SLOW = Scenario("slow", "bench-slow", True, False, "each 10 deltas one second apart, 10 s")
# The scenarios with a Bedrock route (`make bench`): the gateway in front of Bedrock's fast mock,
# beside it on the scenario's own route in front of Anthropic's, and the Bedrock floor.
BEDROCK_SCENARIOS = ("stream50", "tool", "claude-code")


def bedrock_model_id(model: str) -> str:
    """A scenario's model as a Bedrock model id: the fast Bedrock mock answers anthropic.<model>
    as the Anthropic mock answers <model>."""
    return f"anthropic.{model}"


def bedrock_request(anthropic: bytes) -> bytes:
    """The Bedrock floor's request: the Anthropic request's body as the gateway sends it to
    Bedrock (no `model` or `stream`, which the path names; Bedrock's `anthropic_version`)."""
    body = {k: v for k, v in orjson.loads(anthropic).items() if k not in ("model", "stream")}
    return orjson.dumps(body | {"anthropic_version": "bedrock-2023-05-31"})


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


def openai_request(s: Scenario, images_at: str = "") -> bytes:
    """`images_at`: the base URL of bench/images.py, for a scenario with images."""
    if s.name == "agent-loop":
        return agent_loop_request(s)
    if s.images:
        return images_request(s, images_at)
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


def responses_request(s: Scenario, images_at: str = "") -> bytes:
    """The scenario as OpenAI's Responses API asks it: the system prompt as `instructions`, the
    question as one message item, the output limit as `max_output_tokens`."""
    if s.name == "codex":
        return codex_request(s)
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


def anthropic_request(s: Scenario, images_at: str = "") -> bytes:
    if s.captured:
        raise ValueError(f"{s.name}: the floor's request is the gateway's translation, see upstream_requests")
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


# The key the bench gateways seal reasoning under (their `[responses] reasoning_key`), so that a
# Codex turn's `encrypted_content` opens as a real client's would.
REASONING_KEY = bytes(range(32))
# Seals open only for the API key they were made for: the bench gateways' one key, the first in a
# new store.
BENCH_KEY_ID = 1
SHELL_LINE = "src/parser/grammar.py:120:    def parse(self, text: str) -> Node:  # one expression, or raises\n"


def codex_request(s: Scenario) -> bytes:
    """A turn of Codex CLI well into a task, as it sends it with `store: false`: its instructions,
    a developer message (sandbox and approvals), the user's AGENTS.md and environment context,
    the task, then 10 rounds of 3 items (the sealed reasoning, a shell call, its output), 10
    function tools and an MCP server's 3 as a namespace. About 40 KB; the same every time but for
    the seals' random nonces."""
    from middlewares.responses.sealing import seal

    def text_message(role: str, text: str) -> dict:
        return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}

    def function(name: str, about: str, properties: dict, required: list[str]) -> dict:
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return {"type": "function", "name": name, "description": about, "strict": False, "parameters": parameters}

    rule = "Keep changes minimal and focused; explain what you changed and why, and run the checks. "
    command = {"type": "array", "items": {"type": "string"}, "description": "The command to execute"}
    tools = [
        function(
            "shell",
            "Runs a shell command and returns its output.",
            {
                "command": command,
                "workdir": {"type": "string", "description": "The working directory"},
                "timeout_ms": {"type": "number", "description": "The timeout in milliseconds"},
            },
            ["command"],
        ),
        function("apply_patch", "Applies a patch to files.", {"input": {"type": "string"}}, ["input"]),
        function(
            "update_plan",
            "Updates the task plan.",
            {
                "explanation": {"type": "string"},
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "step": {"type": "string"},
                            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        },
                        "required": ["step", "status"],
                        "additionalProperties": False,
                    },
                },
            },
            ["plan"],
        ),
        function("view_image", "Attaches a local image to the conversation.", {"path": {"type": "string"}}, ["path"]),
        *(
            function(f"tool_{name}", f"{name.replace('_', ' ').capitalize()} in the workspace. " * 3, props, ["path"])
            for name, props in (
                ("list_dir", {"path": {"type": "string"}, "depth": {"type": "integer", "minimum": 1}}),
                (
                    "read_file",
                    {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
                ),
                ("grep_files", {"path": {"type": "string"}, "pattern": {"type": "string"}}),
                ("list_mcp_resources", {"path": {"type": "string"}, "cursor": {"type": "string"}}),
                ("read_mcp_resource", {"path": {"type": "string"}, "uri": {"type": "string"}}),
                ("list_mcp_resource_templates", {"path": {"type": "string"}, "cursor": {"type": "string"}}),
            )
        ),
        {
            "type": "namespace",
            "name": "mcp__docs",
            "description": "The project's documentation server.",
            "tools": [
                function(name, f"{name.capitalize()} the documentation.", {"query": {"type": "string"}}, ["query"])
                for name in ("search", "fetch", "outline")
            ],
        },
    ]
    items = [
        text_message(
            "developer",
            "<permissions instructions>The sandbox is workspace-write; ask before network access.</permissions instructions>",
        ),
        text_message(
            "user", "# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\n" + rule * 20 + "\n</INSTRUCTIONS>"
        ),
        text_message(
            "user",
            "<environment_context>\n  <cwd>/repo</cwd>\n  <approval_policy>on-request</approval_policy>\n"
            "  <sandbox_mode>workspace-write</sandbox_mode>\n  <shell>bash</shell>\n</environment_context>",
        ),
        text_message("user", "The parser's tests fail on nested expressions: find out why and fix it."),
    ]
    for turn in range(10):  # 30 prior items
        thinking = [
            {
                "type": "thinking",
                "thinking": f"Step {turn}: read the next part of the parser. " * 6,
                "signature": "sig" * 60,
            }
        ]
        call_id = f"call_bench_{turn:04d}"
        arguments = {"command": ["bash", "-lc", f"rg -n 'def parse' src/parser/part{turn}.py"], "workdir": "/repo"}
        items += [
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": f"**Reading part {turn}**"}],
                "encrypted_content": seal(thinking, REASONING_KEY, BENCH_KEY_ID),
            },
            {
                "type": "function_call",
                "name": "shell",
                "arguments": orjson.dumps(arguments).decode(),
                "call_id": call_id,
            },
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": "Exit code: 0\nWall time: 0.1 seconds\nOutput:\n" + SHELL_LINE * 12,
            },
        ]
    body = {
        "model": s.model,
        "instructions": ("You are Codex, a coding agent based on Claude. " + rule * 140)[:12_000],
        "input": items,
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199c0de-bench-4a11-9c0d-ex0000000001",
    }
    return orjson.dumps(body)


def agent_loop_request(s: Scenario) -> bytes:
    """An OpenAI Agents SDK agent's fifth model call on the chat route: its instructions, 5 function
    tools, the user's question, and 4 rounds of a tool call and its result (a few KB of JSON
    each). About 18 KB, streamed with `stream_options.include_usage` as the SDK asks for it."""

    def tool(name: str, about: str, properties: dict) -> dict:
        schema = {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }
        return {
            "type": "function",
            "function": {"name": name, "description": about, "parameters": schema, "strict": True},
        }

    tools = [
        tool(WEATHER["name"], WEATHER["description"], {"city": {"type": "string"}, "days": {"type": "integer"}}),
        tool(
            "search_flights",
            "Flights between two airports on a day.",
            {"origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string"}},
        ),
        tool(
            "search_hotels",
            "Hotels in a city with their prices.",
            {"city": {"type": "string"}, "nights": {"type": "integer"}},
        ),
        tool(
            "convert_currency",
            "An amount in another currency.",
            {"amount": {"type": "number"}, "to": {"type": "string"}},
        ),
        tool("book", "Books an offer by its id.", {"offer_id": {"type": "string"}}),
    ]
    instructions = "You are a travel agent. Use the tools to check every fact; never invent prices. " * 20
    messages: list[dict] = [
        {"role": "system", "content": instructions},
        {
            "role": "user",
            "content": "Plan three days in Paris next week for two: flights from Berlin, a hotel, the weather.",
        },
    ]
    calls = [
        ("search_flights", {"origin": "BER", "destination": "CDG", "date": "2026-12-10"}),
        ("search_hotels", {"city": "Paris", "nights": 3}),
        ("convert_currency", {"amount": 642.5, "to": "EUR"}),
        ("get_weather", {"city": "Paris", "days": 3}),
    ]
    offer = {"id": "offer-0000", "name": "Hotel du Parc", "price": {"amount": 214.17, "currency": "USD"}, "rating": 4.4}
    for n, (name, arguments) in enumerate(calls):
        call_id = f"call_agent_{n:02d}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
                    }
                ],
            }
        )
        result = {"results": [offer | {"id": f"offer-{n}{k:03d}"} for k in range(30)]}
        messages.append({"role": "tool", "tool_call_id": call_id, "content": orjson.dumps(result).decode()})
    body = {
        "model": s.model,
        "messages": messages,
        "tools": tools,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return orjson.dumps(body)


IMAGE_NAMES = ("chart.png", "photo.png")


def images_request(s: Scenario, images_at: str) -> bytes:
    """A chat question about two image URLs on bench/images.py (`images_at`, its base URL)."""
    content = [{"type": "text", "text": "What do these two images show? Compare them."}]
    content += [{"type": "image_url", "image_url": {"url": f"{images_at}/{name}"}} for name in IMAGE_NAMES[: s.images]]
    body = {"model": s.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1024}
    return orjson.dumps(body)


# What a client that speaks each API sends.
ENCODERS = {"openai": openai_request, "responses": responses_request, "anthropic": anthropic_request}


def request_body(api: str, s: Scenario, fields: dict | None = None, images_at: str = "") -> bytes:
    """The scenario's request in `api`, with `fields` added (routes.ROUTE_FIELDS)."""
    body = ENCODERS[api](s, images_at)
    return orjson.dumps(orjson.loads(body) | fields) if fields else body


async def upstream_requests(
    config_toml: str, scenarios: list[Scenario], routes: tuple[str, ...], images_at: str = "", bedrock: bool = False
) -> dict[tuple[str, str], tuple[int, dict | None]]:
    """Send each scenario's request on each of the gateway's `routes` (routes.GATEWAY_ROUTES)
    that speaks one of its APIs, through the gateway's app (in this process) to the project's
    validating mock: {(route, scenario name): (the gateway's status, what reached the mock)}. The
    mock's validation also proves these requests ones the real API accepts. `bedrock`: the
    config's deployment is Bedrock's (systems.gateway_config), and the mock Bedrock's, which
    accepts the config's API key."""
    import aiohttp

    from gateway.app import build_app
    from gateway.config import parse_config
    from gateway.mock.bedrock import BedrockMock
    from gateway.mock.upstream import MockUpstream

    sent = {}
    mock = BedrockMock(api_keys=["bench"]) if bedrock else MockUpstream()
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
                    if api not in s.apis:
                        continue
                    before = len(mock.requests)
                    body = request_body(api, s, ROUTE_FIELDS.get(route), images_at)
                    async with session.post(gateway + path, data=body, headers=headers) as response:
                        await response.read()
                    reached = mock.requests[-1].body if len(mock.requests) > before else None
                    sent[(route, s.name)] = (response.status, reached)
    finally:
        await runner.cleanup()
        await mock.close()
    return sent


def floor_requests(
    sent: dict[tuple[str, str], tuple[int, dict | None]], scenarios: list[Scenario]
) -> tuple[dict[str, bytes], list[str]]:
    """From `upstream_requests`' answer: each scenario's request to the floor (written here, or,
    `captured`, what the gateway sent upstream on the scenario's own route), and the differences
    between the floor's request and what each route sent (none: every system asks the same of
    the upstream)."""
    floor, differences = {}, []
    for s in scenarios:
        if s.captured:
            status, reached = sent.get((ROUTE_OF_API[s.apis[0]], s.name), (None, None))
            if status != 200 or reached is None:
                raise RuntimeError(f"{s.name}: the gateway answered {status}; it sent upstream {reached}")
            floor[s.name] = orjson.dumps(reached)
        else:
            floor[s.name] = anthropic_request(s)
    for (route, name), (status, reached) in sent.items():
        if status != 200 or reached != orjson.loads(floor[name]):
            differences.append(f"{route} {name}: status {status}; the gateway sent upstream {reached}")
    return floor, differences


def bedrock_floor_requests(
    sent: dict[tuple[str, str], tuple[int, dict | None]], floor: dict[str, bytes]
) -> tuple[dict[str, bytes], list[str]]:
    """The Bedrock floor's request of each Bedrock scenario (`bedrock_request` of the floor's),
    and the differences between it and what the gateway sent Bedrock's validating mock on each
    route (`upstream_requests(..., bedrock=True)`)."""
    bedrock = {name: bedrock_request(floor[name]) for name in BEDROCK_SCENARIOS if name in floor}
    differences = [
        f"bedrock {route} {name}: status {status}; the gateway sent Bedrock {reached}"
        for (route, name), (status, reached) in sent.items()
        if status != 200 or reached != orjson.loads(bedrock[name])
    ]
    return bedrock, differences


def closing_marker(api: str, s: Scenario) -> str:
    """What the end of a complete response body contains (checked by the asyncio client, which
    keeps a body's last 64 bytes), for a system whose clients speak `api` ("openai", "responses"
    or "anthropic"). A Responses stream has no [DONE]: it ends with `response.completed`, whose
    response ends with its usage (a failed one's usage is null)."""
    if not s.stream:
        return ""
    # Bedrock's frames carry each event in base64, their CRC last: the check before measuring
    # decodes the whole stream (drive.check); the load only needs a complete 200.
    return {"openai": "[DONE]", "responses": '"total_tokens":', "anthropic": "message_stop", "bedrock": ""}[api]
