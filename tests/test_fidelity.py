"""What the client sees is what the upstream said. Usage is the upstream's own count on both
routes, streamed and not, and the ledger row says the same; the estimate from the answer's text
stands in only where that count is missing or cannot be true."""

from __future__ import annotations

import logging

import anthropic
import pytest

from gateway.app import STORE
from gateway.mock_upstream import Scenario, output_tokens
from tests.support import KEY, MODEL

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
SHORT_ANSWERS = [
    "The capital of France is Paris.",
    "Paris is the capital and largest city of France, on the river Seine.",
    "Certainly! France's capital is Paris, which has been its political centre for centuries.",
]


def estimate(text: str) -> int:
    return (len(text) + 3) // 4


def test_the_mocks_counts_are_below_four_characters_a_token():
    """Else the tests below could not tell the upstream's count from the estimate."""
    assert all(output_tokens(text) < estimate(text) for text in SHORT_ANSWERS)


async def openai_usage(gateway, stream: bool) -> tuple[int, int, str]:
    """(prompt_tokens, completion_tokens, text) of a chat completion, as the client is told."""
    async with gateway.client() as client:
        if not stream:
            reply = await client.chat.completions.create(model=MODEL, messages=HELLO)
            return reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.choices[0].message.content
        chunks = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True,
                                                      stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in chunks:
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens, text


async def anthropic_usage(gateway, stream: bool) -> tuple[int, int, str]:
    """(all input, output_tokens, text) of a message on the native route, as the client is told."""
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        if stream:
            async with claude.messages.stream(model=MODEL, max_tokens=4096, messages=HELLO) as events:
                message = await events.get_final_message()
        else:
            message = await claude.messages.create(model=MODEL, max_tokens=4096, messages=HELLO)
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    return prompt, usage.output_tokens, message.content[0].text


ROUTES = {"chat": openai_usage, "messages": anthropic_usage}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("answer", SHORT_ANSWERS, ids=["7", "16", "19"])
async def test_usage_is_the_upstreams_count_and_the_ledger_says_the_same(gateway, upstream, route, stream, answer):
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], usage={"input_tokens": 14}))
    prompt, completion, text = await ROUTES[route](gateway, stream)

    assert text == answer
    assert (prompt, completion) == (14, output_tokens(answer))  # the mock's numbers, not len // 4
    [row] = await gateway.app[STORE].ledger()
    assert (row.input_tokens + row.cache_read_tokens + row.cache_write_tokens, row.output_tokens) == (prompt, completion)


LONG = "Every word of this answer counts as text the model produced. " * 66  # 4,026 characters


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_an_output_count_that_cannot_be_true_is_billed_by_estimate(gateway, upstream, route, stream, caplog):
    """1 output token for 4,000 characters: the estimate is billed, the client is told the same,
    and a warning names the deployment."""
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": LONG}], usage={"input_tokens": 14, "output_tokens": 1}))
    with caplog.at_level(logging.WARNING, logger="ezat.billing"):
        _, completion, text = await ROUTES[route](gateway, stream)

    assert text == LONG
    assert completion == estimate(LONG)
    [row] = await gateway.app[STORE].ledger()
    assert row.output_tokens == completion
    [warning] = [r.getMessage() for r in caplog.records if r.name == "ezat.billing"]
    assert "deployment primary" in warning and "implausible" in warning


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_count_of_one_token_per_ten_characters_is_believed(gateway, upstream, route):
    """Long words, or a language of long tokens: a count at the bound is the upstream's word."""
    answer = "Incomprehensibilities notwithstanding, characteristically." * 2  # 118 characters
    upstream.enqueue(Scenario(blocks=[{"type": "text", "text": answer}], usage={"output_tokens": 12}))
    _, completion, _ = await ROUTES[route](gateway, True)
    assert completion == 12
    [row] = await gateway.app[STORE].ledger()
    assert row.output_tokens == 12
