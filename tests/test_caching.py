"""Prompt caching (spec "Prompt caching"; issue 7): the two automatic breakpoints, the client's
own breakpoints, the opt-out header, prompts too short to cache, the cache read back across the
turns of a conversation, and conversation affinity over two deployments (two mock upstreams),
with failover when the chosen one is down. Each test checks what the upstream received and what
the openai SDK client got."""

from __future__ import annotations

import base64
import dataclasses
import itertools
from collections import Counter

import openai
import orjson
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from gateway.config import Deployment
from gateway.mock.upstream import MockUpstream, Scenario
from gateway.upstream.routing import ranked
from tests.requests_util import echo
from tests.support import MODEL, UPSTREAM_KEY, make_config

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])

EPHEMERAL = {"type": "ephemeral"}  # 5 minutes: no ttl
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}

# About 6,000 characters: well above the default model's 1,024-token minimum (4 bytes a token).
SYSTEM = "".join(f"Rule {i}: answer in plain words, cite the manual and never guess. " for i in range(90))
MANUAL = "".join(f"Section {i}: the valve opens clockwise and closes counter-clockwise. " for i in range(90))
assert len(SYSTEM) > 5000 and len(MANUAL) > 5000

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather for a city", "parameters": WEATHER_SCHEMA},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}},
}
# A tool long enough on its own for the prompt to be worth caching.
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "description": MANUAL, "parameters": {"type": "object", "properties": {}}},
}

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
PDF = b"%PDF-1.4\n1 0 obj\n<</Type/Catalog>>\nendobj\ntrailer\n<</Root 1 0 R>>\n%%EOF\n"
PDF_URL = "data:application/pdf;base64," + base64.b64encode(PDF).decode()


# --- Helpers -------------------------------------------------------------------------------------


def system(content=SYSTEM) -> dict:
    return {"role": "system", "content": content}


def user(content) -> dict:
    return {"role": "user", "content": content}


def marked(part: dict, marker: dict | None = None) -> dict:
    return {**part, "cache_control": marker or EPHEMERAL}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": PNG_URL}}


def file_part() -> dict:
    return {"type": "file", "file": {"filename": "manual.pdf", "file_data": PDF_URL}}


def marks(body: dict) -> dict[str, object]:
    """Every cache_control in an upstream request, by the path of the object that carries it
    ("" would be the top-level automatic-caching field)."""
    found: dict[str, object] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            if "cache_control" in value:
                found[path] = value["cache_control"]
            for key, item in value.items():
                if key != "cache_control":
                    walk(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    walk(body, "")
    return found


def prompt_size(body: dict) -> int:
    """The prompt's tokens as the mock counts them: 4 bytes of JSON a token, block by block, in
    cache order (tools, system, messages), breakpoints left out."""
    blocks = list(body.get("tools") or []) + list(body.get("system") or [])
    for message in body["messages"]:
        blocks += message["content"]
    return sum(len(orjson.dumps({k: v for k, v in b.items() if k != "cache_control"})) // 4 for b in blocks)


async def ask(client: openai.AsyncOpenAI, stream: bool = False, **kwargs):
    """A completion, or for stream=True the one the SDK's own accumulator builds (usage included)."""
    kwargs.setdefault("model", MODEL)
    if not stream:
        return await client.chat.completions.create(**kwargs)
    state = ChatCompletionStreamState(input_tools=kwargs.get("tools", openai.omit))
    chunks = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    async for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()


def cache_usage(completion) -> tuple[int, int]:
    """(cached_tokens, cache_write_tokens) the client was told."""
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens, details.cache_write_tokens


async def refusal(client: openai.AsyncOpenAI, upstreams, **kwargs) -> dict:
    """The 400 error object of a refused request, after checking nothing reached an upstream."""
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"
    assert all(mock.requests == [] for mock in upstreams)
    return caught.value.body


# --- Automatic breakpoints -----------------------------------------------------------------------


async def test_with_a_system_prompt_the_breakpoints_go_on_it_and_on_the_newest_message(client, upstream):
    history = [
        system(SYSTEM),
        user("What is a valve?"),
        {"role": "assistant", "content": "A device that controls flow."},
        user("And how do I open it?"),
    ]
    completion = await ask(client, messages=history, tools=[WEATHER])

    assert completion.choices[0].message.content.startswith("Hello from the mock upstream.")
    body = upstream.requests[-1].body
    # Exactly two 5-minute breakpoints: the system prompt (not the tools), and the newest message.
    assert marks(body) == {"system[0]": EPHEMERAL, "messages[2].content[0]": EPHEMERAL}
    assert body["system"] == [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    # String content became a text block carrying the breakpoint; older turns carry none.
    assert body["messages"] == [
        {"role": "user", "content": [text("What is a valve?")]},
        {"role": "assistant", "content": [text("A device that controls flow.")]},
        {"role": "user", "content": [marked(text("And how do I open it?"))]},
    ]
    assert "cache_control" not in body["tools"][0]
    assert "cache_control" not in body  # no top-level automatic caching field either


async def test_with_several_system_messages_the_last_system_block_is_marked(client, upstream):
    history = [
        system([text(SYSTEM), text("Always answer in English.")]),
        user("Hello"),
        {"role": "developer", "content": "Keep it short."},
    ]
    await ask(client, messages=history)

    body = upstream.requests[-1].body
    assert [b["text"] for b in body["system"]] == [SYSTEM, "Always answer in English.", "Keep it short."]
    assert marks(body) == {"system[2]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


async def test_with_only_tools_the_breakpoints_go_on_the_last_tool_and_the_newest_message(client, upstream):
    await ask(client, messages=[user("Look up how the valve opens.")], tools=[WEATHER, LOOKUP])

    body = upstream.requests[-1].body
    assert marks(body) == {"tools[1]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}
    assert body["tools"][1]["name"] == "lookup"
    assert body["messages"] == [{"role": "user", "content": [marked(text("Look up how the valve opens."))]}]


async def test_with_neither_only_the_newest_message_is_marked(client, upstream):
    history = [
        user("Here is the manual: " + MANUAL),
        {"role": "assistant", "content": "Thanks, I have read it."},
        user("Which way does the valve open?"),
    ]
    await ask(client, messages=history)

    body = upstream.requests[-1].body
    assert marks(body) == {"messages[2].content[0]": EPHEMERAL}
    assert body["messages"][2] == {"role": "user", "content": [marked(text("Which way does the valve open?"))]}


async def test_the_newest_message_s_last_part_is_marked_when_it_has_several(client, upstream):
    await ask(client, messages=[system(), user([text("What is in this picture?"), image_part()])])

    body = upstream.requests[-1].body
    assert marks(body) == {"system[0]": EPHEMERAL, "messages[0].content[1]": EPHEMERAL}
    assert body["messages"][0]["content"][1]["type"] == "image"


async def test_a_trailing_whitespace_part_does_not_lose_the_breakpoints(client, upstream):
    await ask(client, messages=[system([text(SYSTEM), text("  ")]), user([text("Which way does it open?"), text(" ")])])

    assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


async def test_a_system_message_of_blank_parts_does_not_lose_the_prefix_breakpoint(client, upstream):
    # The last system message sends nothing upstream: the system prompt before it is marked;
    await ask(
        client,
        messages=[system(SYSTEM), user("Which way does it open?"), {"role": "developer", "content": [text(" ")]}],
    )
    assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}
    # and when no system prompt is sent at all, the last tool is.
    await ask(client, messages=[system([text("  ")]), user("Look up how the valve opens.")], tools=[WEATHER, LOOKUP])
    body = upstream.requests[-1].body
    assert "system" not in body
    assert marks(body) == {"tools[1]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


TOOL_LOOP = [
    system(),
    user("What's the weather in Oslo?"),
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees and rain"},
]


async def test_a_tool_result_as_newest_message_is_marked_on_its_block(client, upstream):
    await ask(client, messages=TOOL_LOOP, tools=[WEATHER])

    body = upstream.requests[-1].body
    assert body["messages"][2]["content"][0]["type"] == "tool_result"
    assert marks(body) == {"system[0]": EPHEMERAL, "messages[2].content[0]": EPHEMERAL}


async def test_the_turn_after_a_tool_result_reads_it_back(client, upstream):
    upstream.enqueue(
        Scenario(blocks=[{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}])
    )
    await ask(client, messages=TOOL_LOOP[:2], tools=[WEATHER])
    await ask(client, messages=TOOL_LOOP, tools=[WEATHER])
    after_result = upstream.requests[-1].body
    read_through_result = prompt_size(after_result)  # everything up to and including the tool result

    follow_up = [*TOOL_LOOP, {"role": "assistant", "content": "It is 12 degrees and raining."}, user("Thanks!")]
    completion = await ask(client, messages=follow_up, tools=[WEATHER])
    cached, _ = cache_usage(completion)
    assert cached == read_through_result


# --- The client's own breakpoints ----------------------------------------------------------------


OWN_MARKS = {
    "text": (
        dict(messages=[system(), user([marked(text(MANUAL)), text("Summarize the manual.")])]),
        {"messages[0].content[0]": EPHEMERAL},
    ),
    "image_url": (
        dict(messages=[system(), user([marked(image_part()), text("Describe it.")])]),
        {"messages[0].content[0]": EPHEMERAL},
    ),
    "file": (
        dict(messages=[system(), user([marked(file_part()), text("Summarize the PDF.")])]),
        {"messages[0].content[0]": EPHEMERAL},
    ),
    "system-part": (
        dict(messages=[system([marked(text(SYSTEM), ONE_HOUR), text("Be brief.")]), user("Hello")]),
        {"system[0]": ONE_HOUR},
    ),
    "tool": (
        dict(messages=[system(), user("Weather in Oslo?")], tools=[marked(WEATHER, ONE_HOUR), TIME]),
        {"tools[0]": ONE_HOUR},
    ),
    "assistant-text": (
        dict(messages=[system(), user("Hi"), {"role": "assistant", "content": [marked(text("Hello!"))]}, user("Bye")]),
        {"messages[1].content[0]": EPHEMERAL},
    ),
}


@pytest.mark.parametrize(("request_fields", "expected"), OWN_MARKS.values(), ids=OWN_MARKS.keys())
async def test_the_client_s_own_breakpoint_passes_through_and_none_is_added(client, upstream, request_fields, expected):
    await ask(client, **request_fields)

    body = upstream.requests[-1].body
    assert marks(body) == expected


async def test_four_own_breakpoints_of_every_kind_pass_through_with_their_ttl(client, upstream):
    # Prefix order is tools, system, messages; the 1-hour breakpoint comes first, as the upstream requires.
    messages = [
        system([marked(text(SYSTEM))]),
        user([marked(file_part()), marked(image_part()), text("Compare them.")]),
    ]
    completion = await ask(client, messages=messages, tools=[marked(WEATHER, ONE_HOUR)])

    assert completion.choices[0].finish_reason == "stop"
    body = upstream.requests[-1].body
    assert marks(body) == {
        "tools[0]": ONE_HOUR,
        "system[0]": EPHEMERAL,
        "messages[0].content[0]": EPHEMERAL,
        "messages[0].content[1]": EPHEMERAL,
    }
    assert [b["type"] for b in body["messages"][0]["content"]] == ["document", "image", "text"]


async def test_own_breakpoints_decide_even_on_a_prompt_long_enough_for_automatic_ones(client, upstream):
    """A single mark on an old turn: the gateway neither adds a prefix nor a newest-message one."""
    history = [
        system(),
        user([marked(text("First question"))]),
        {"role": "assistant", "content": "Answer"},
        user("Next"),
    ]
    await ask(client, messages=history, tools=[WEATHER])

    assert marks(upstream.requests[-1].body) == {"messages[0].content[0]": EPHEMERAL}


async def test_more_than_four_breakpoints_is_a_400_naming_the_count(client, upstream):
    messages = [
        system([marked(text(SYSTEM))]),
        user([marked(text("one")), marked(image_part()), marked(file_part()), text("Compare.")]),
    ]
    error = await refusal(client, [upstream], messages=messages, tools=[marked(WEATHER)])
    assert error["message"] == "cache_control: at most 4 cache breakpoints per request; this one has 5"


MALFORMED = {
    "type": (
        dict(messages=[system(), user([{**text("Hi"), "cache_control": {"type": "persistent"}}])]),
        "messages[1].content[0].cache_control",
    ),
    "ttl": (
        dict(messages=[user("Hi")], tools=[WEATHER, {**TIME, "cache_control": {"type": "ephemeral", "ttl": "2h"}}]),
        "tools[1].cache_control",
    ),
    "not-an-object": (
        dict(messages=[system([{**text(SYSTEM), "cache_control": "ephemeral"}]), user("Hi")]),
        "messages[0].content[0].cache_control",
    ),
    "extra-key": (
        dict(
            messages=[
                user([text("Read this"), {**file_part(), "cache_control": {"type": "ephemeral", "scope": "global"}}])
            ]
        ),
        "messages[0].content[1].cache_control",
    ),
}


@pytest.mark.parametrize(("request_fields", "path"), MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_breakpoint_is_a_400_naming_its_path(client, upstream, request_fields, path):
    error = await refusal(client, [upstream], **request_fields)
    assert error["message"].startswith(path + ": ")
    assert '"ephemeral"' in error["message"]


# --- Opting out, and prompts too short to cache --------------------------------------------------


@STREAM
async def test_the_opt_out_header_leaves_the_request_without_breakpoints(client, upstream, stream):
    for _ in range(2):  # a repeated one-off prompt: nothing is written, so nothing is read back either
        completion = await ask(
            client,
            stream,
            messages=[system(), user("Say hello.")],
            tools=[WEATHER],
            extra_headers={"x-ezat-cache": "off"},
        )
        assert marks(upstream.requests[-1].body) == {}
        assert cache_usage(completion) == (0, 0)
        assert completion.usage.prompt_tokens == prompt_size(upstream.requests[-1].body)


async def test_the_opt_out_header_keeps_the_client_s_own_breakpoints(client, upstream):
    await ask(
        client,
        messages=[system([marked(text(SYSTEM), ONE_HOUR)]), user("Say hello.")],
        extra_headers={"x-ezat-cache": "off"},
    )
    assert marks(upstream.requests[-1].body) == {"system[0]": ONE_HOUR}


async def test_a_prompt_with_tools_counts_the_upstreams_tool_prompt(start_gateway, upstream):
    """With tools the upstream adds its tool-use system prompt (hundreds of tokens): a body of
    fewer bytes than the minimum can still reach it."""
    gateway = await start_gateway(make_config(upstream.url, min_cache_tokens=1200))
    messages = [system("Be brief. " + "Keep it short. " * 45), user("Hi")]  # about 700 bytes
    async with gateway.client() as client:
        await ask(client, messages=messages)
        assert marks(upstream.requests[-1].body) == {}
        await ask(client, messages=messages, tools=[WEATHER])
        assert len(orjson.dumps(upstream.requests[-1].body)) < 1200  # fewer bytes than the minimum
        assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


async def test_a_short_prompt_gets_no_breakpoints(client, upstream):
    completion = await ask(client, messages=[system("Be brief."), user("Hi")], tools=[WEATHER])

    assert marks(upstream.requests[-1].body) == {}
    assert cache_usage(completion) == (0, 0)


async def test_a_short_question_about_an_image_is_marked(client, upstream):
    """An image's tokens follow its pixels, not its bytes: a small file can be a long prompt."""
    await ask(client, messages=[system("Be brief."), user([text("What is this?"), image_part()])])

    assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[1]": EPHEMERAL}


async def test_a_prompt_of_few_bytes_a_token_is_marked(client, upstream):
    """1,100 CJK characters are 3,300 bytes and more than 1,024 tokens: long enough to cache."""
    await ask(client, messages=[system("请简要回答。" + "缓存" * 550), user("你好")])

    assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


async def test_a_model_with_a_large_minimum_gets_no_breakpoints(start_gateway, upstream):
    gateway = await start_gateway(make_config(upstream.url, min_cache_tokens=100_000))
    async with gateway.client() as client:
        completion = await ask(client, messages=[system(), user("Hi")], tools=[LOOKUP])

    assert marks(upstream.requests[-1].body) == {}
    assert cache_usage(completion) == (0, 0)


async def test_a_model_with_a_small_minimum_marks_even_a_short_prompt(start_gateway, upstream):
    gateway = await start_gateway(make_config(upstream.url, min_cache_tokens=16))
    async with gateway.client() as client:
        await ask(client, messages=[system("Be brief."), user("Hi")])

    assert marks(upstream.requests[-1].body) == {"system[0]": EPHEMERAL, "messages[0].content[0]": EPHEMERAL}


# --- Savings over a conversation -----------------------------------------------------------------


@STREAM
async def test_a_multi_turn_conversation_reads_back_what_it_already_sent(client, upstream, stream):
    history = [system()]
    questions = ["What is a valve?", "How do I open it?", "And close it?", "What if it is stuck?"]
    previous_prefix = 0  # tokens the previous turn cached (read back + written)
    for turn, question in enumerate(questions):
        history.append(user(question))
        completion = await ask(client, stream, messages=history, prompt_cache_key="valve-chat")
        answer = completion.choices[0].message.content
        assert answer.startswith("Hello from the mock upstream.")
        assert answer == echo(question)

        body = upstream.requests[-1].body
        assert marks(body) == {"system[0]": EPHEMERAL, f"messages[{2 * turn}].content[0]": EPHEMERAL}
        cached, written = cache_usage(completion)
        size = prompt_size(body)
        # prompt_tokens counts all input: uncached + read back + written, and the mock's numbers add up.
        uncached = completion.usage.prompt_tokens - cached - written
        assert uncached == max(1, size - cached - written)
        assert completion.usage.prompt_tokens >= size
        if turn == 0:
            assert cached == 0 and written > 0
        else:
            # Everything the previous turn sent is read back; only the new turn is written.
            assert cached == previous_prefix > 0
            assert 0 < written < cached
            assert cached >= 0.8 * completion.usage.prompt_tokens
        assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
        previous_prefix = cached + written
        history.append({"role": "assistant", "content": answer})
    assert len(upstream.requests) == len(questions)


# --- prompt_cache_key ----------------------------------------------------------------------------


async def test_a_prompt_cache_key_over_256_characters_is_a_400_naming_the_field(client, upstream):
    error = await refusal(client, [upstream], messages=[user("Hi")], prompt_cache_key="k" * 257)
    assert error["message"].startswith("prompt_cache_key: ")
    assert "256" in error["message"]
    assert error["code"] is None
    assert error["param"] == "prompt_cache_key"


async def test_a_prompt_cache_key_of_256_characters_is_accepted_and_not_forwarded(client, upstream):
    completion = await ask(client, messages=[user("Hi")], prompt_cache_key="k" * 256)

    assert completion.choices[0].message.content.startswith("Hello from the mock upstream.")
    assert completion.choices[0].message.content == echo("Hi")
    assert "prompt_cache_key" not in upstream.requests[-1].body


# --- Affinity over two deployments ---------------------------------------------------------------

DEPLOYMENTS = ("a", "b")


def home(name: str) -> str:
    """The deployment a conversation named `name` (header or field) ranks first: rendezvous
    hashing, the same order on every replica."""
    return ranked(DEPLOYMENTS, "session:" + name)[0]


def names_on(deployment: str, prefix: str, count: int = 1) -> list[str]:
    """`count` conversation names whose home is `deployment`."""
    names = (f"{prefix}-{i}" for i in itertools.count())
    return list(itertools.islice((n for n in names if home(n) == deployment), count))


@dataclasses.dataclass
class Pair:
    client: openai.AsyncOpenAI
    mocks: dict[str, MockUpstream]

    def counts(self) -> dict[str, int]:
        return {name: len(mock.requests) for name, mock in self.mocks.items()}

    async def where(self, stream: bool = False, **kwargs) -> tuple[str, object]:
        """Which deployment answered the request (the only one that received it), and the answer."""
        before = self.counts()
        completion = await ask(self.client, stream, **kwargs)
        grew = [name for name, n in self.counts().items() if n > before[name]]
        assert len(grew) == 1, grew
        assert self.counts()[grew[0]] == before[grew[0]] + 1
        return grew[0], completion


@pytest.fixture
async def pair(start_gateway):
    mocks = {name: MockUpstream(api_key=UPSTREAM_KEY) for name in DEPLOYMENTS}
    for mock in mocks.values():
        await mock.start()
    base = make_config(mocks["a"].url)
    model = dataclasses.replace(base.model(MODEL), deployments=DEPLOYMENTS)
    config = dataclasses.replace(
        base,
        deployments=tuple(
            Deployment(name=name, base_url=mock.url, api_key=UPSTREAM_KEY) for name, mock in mocks.items()
        ),
        models=(model,),
    )
    gateway = await start_gateway(config)
    async with gateway.client() as client:
        yield Pair(client, mocks)
    for mock in mocks.values():
        await mock.close()


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
async def test_twenty_requests_with_one_key_land_on_one_deployment(pair, deployment):
    (key,) = names_on(deployment, "conversation")
    for i in range(20):
        landed, _ = await pair.where(i % 2 == 1, messages=[user(f"Question {i}")], prompt_cache_key=key)
        assert landed == deployment
    assert pair.counts() == {name: 20 if name == deployment else 0 for name in DEPLOYMENTS}


async def test_many_keys_spread_over_both_deployments(pair):
    landed = {}
    for i in range(40):
        key = f"user-{i}"
        landed[key], _ = await pair.where(messages=[user("Hi")], prompt_cache_key=key)
        assert landed[key] == home(key)
    spread = Counter(landed.values())
    assert set(spread) == set(DEPLOYMENTS)
    assert min(spread.values()) >= 10, spread  # rendezvous hashing splits evenly, not 39 to 1


async def test_the_session_header_wins_over_the_field(pair):
    header = "session-7"
    fields = names_on(ranked(DEPLOYMENTS, "session:" + header)[1], "field", 5)  # each would go elsewhere
    # The field alone routes the conversation...
    alone, _ = await pair.where(messages=[user("Hi")], prompt_cache_key=fields[0])
    assert alone != home(header)
    # ...but with the header, the header decides: one deployment, the header's.
    for field in fields:
        landed, _ = await pair.where(
            messages=[user("Hi")], prompt_cache_key=field, extra_headers={"x-ezat-session": header}
        )
        assert landed == home(header)
    # The header and the field name a conversation the same way.
    landed, _ = await pair.where(messages=[user("Hi")], prompt_cache_key=header)
    assert landed == home(header)


async def test_without_a_key_the_same_system_prompt_sticks_to_one_deployment(pair):
    homes = {}
    for p in range(12):
        prompt = f"You are assistant number {p}. " + SYSTEM
        landed = {(await pair.where(messages=[system(prompt), user(f"Question {i}")]))[0] for i in range(5)}
        assert len(landed) == 1, (p, landed)
        homes[p] = landed.pop()
        # A later turn of the same app, with the same system prompt, stays too.
        later = [system(prompt), user("Q"), {"role": "assistant", "content": "A"}, user("Another one")]
        assert (await pair.where(True, messages=later))[0] == homes[p]
    assert set(homes.values()) == set(DEPLOYMENTS)  # different prompts do spread


async def test_a_system_prompt_sticks_to_its_deployment_whether_or_not_it_is_marked_for_the_cache(pair):
    # The caching stage marks long prompts (unless told not to); the marks must not move them.
    for p in range(12):
        prompt = f"You are assistant number {p}. " + SYSTEM
        marked, _ = await pair.where(messages=[system(prompt), user("Hi")])
        assert "cache_control" in str(pair.mocks[marked].requests[-1].body["system"])
        unmarked, _ = await pair.where(messages=[system(prompt), user("Hi")], extra_headers={"x-ezat-cache": "off"})
        assert "cache_control" not in str(pair.mocks[unmarked].requests[-1].body)
        assert unmarked == marked, p


async def test_without_a_key_the_same_tools_stick_to_one_deployment(pair):
    landed = {(await pair.where(messages=[user(f"Question {i}")], tools=[WEATHER, TIME]))[0] for i in range(8)}
    assert len(landed) == 1


async def test_without_a_key_or_a_prefix_the_preference_order_applies(pair):
    for i in range(5):
        assert (await pair.where(messages=[user(f"Question {i}")]))[0] == "a"


FAILURES = ["closed", "529", "503"]


@STREAM
@pytest.mark.parametrize("failure", FAILURES)
async def test_when_the_chosen_deployment_is_down_its_conversations_move_and_others_stay(pair, stream, failure):
    (moving,) = names_on("a", "moving")
    (staying,) = names_on("b", "staying")
    histories = {key: [system(f"Conversation {key}. " + SYSTEM)] for key in (moving, staying)}

    async def turn(key: str, question: str):
        histories[key].append(user(question))
        completion = await ask(pair.client, stream, messages=histories[key], prompt_cache_key=key)
        histories[key].append({"role": "assistant", "content": completion.choices[0].message.content})
        return completion

    def served_by(name: str, question: str) -> bool:
        last = pair.mocks[name].requests[-1].body if pair.mocks[name].requests else {}
        return bool(last) and last["messages"][-1]["content"][-1].get("text") == question

    await turn(moving, "first")
    await turn(staying, "first")
    assert served_by("a", "first") and served_by("b", "first")
    assert pair.counts() == {"a": 1, "b": 1}

    if failure == "closed":
        await pair.mocks["a"].close()
    else:
        pair.mocks["a"].enqueue(*[Scenario(status=int(failure), error_message="Overloaded")] * 2)

    # The moving conversation is answered by b: the client sees no error, only a lost cache.
    completion = await turn(moving, "second")
    assert completion.choices[0].message.content.startswith("Hello from the mock upstream.")
    assert completion.choices[0].message.content == echo("second")
    assert served_by("b", "second")
    cached, written = cache_usage(completion)
    assert cached == 0 and written > 0
    # The conversation already on b stays there, and a receives nothing of it.
    a_before = len(pair.mocks["a"].requests)
    completion = await turn(staying, "second")
    assert served_by("b", "second")
    assert len(pair.mocks["a"].requests) == a_before
    assert cache_usage(completion)[0] > 0  # its cache is still there
    # The moved conversation keeps to b while a is down, and reads its new cache back there.
    completion = await turn(moving, "third")
    assert served_by("b", "third")
    assert cache_usage(completion)[0] > 0
    expected_a = 1 if failure == "closed" else 3  # a failing deployment was still tried first
    assert pair.counts() == {"a": expected_a, "b": 4}
