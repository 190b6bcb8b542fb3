"""The OpenAI Agents SDK (`openai-agents`) through the gateway: an agent with a function tool runs
on the Responses API of a real gateway on loopback, the mock upstream scripted to call the tool
and then to answer; billed in the ledger.

The SDK's default model provider reads a `/` in a model name as a provider prefix
(`anthropic/...` is "Unknown prefix: anthropic"): an agent names the model by its upstream name
there, or is given an `OpenAIResponsesModel`, which takes any name (docs/clients.md)."""

from __future__ import annotations

import json

from agents import Agent, ModelSettings, MultiProvider, OpenAIResponsesModel, RunConfig, Runner, function_tool
from openai.types.shared import Reasoning

from gateway.app import STORE
from gateway.mock.upstream import Scenario
from tests.support import MODEL, UPSTREAM_MODEL

CALL = {"type": "tool_use", "id": "toolu_oslo", "name": "get_weather", "input": {"city": "Oslo"}}
ANSWER = "It is 9°C and clear in Oslo."
RUN = RunConfig(tracing_disabled=True)  # traces would go to OpenAI's own service, with the gateway key


def weather_agent(model, asked: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        asked.append(city)
        return f"9°C and clear in {city}"

    return Agent(name="Weather", instructions="Answer in one sentence.", model=model, tools=[get_weather])


async def check_the_tool_loop(gateway, upstream) -> None:
    """The tool's call went out with its schema, its result came back, both turns are billed."""
    offered, answered = [request.body for request in upstream.requests]
    assert offered["model"] == UPSTREAM_MODEL
    assert offered["system"][0]["text"] == "Answer in one sentence."
    [tool] = offered["tools"]
    assert tool["name"] == "get_weather" and tool["input_schema"]["required"] == ["city"]
    assert answered["messages"][-2] == {"role": "assistant", "content": [CALL]}
    [result] = answered["messages"][-1]["content"]
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_oslo")
    assert "9°C and clear in Oslo" in json.dumps(result["content"], ensure_ascii=False)

    rows = await gateway.app[STORE].ledger()
    assert [(row.model, row.outcome, row.deployment) for row in rows] == [(MODEL, "complete", "primary")] * 2
    assert all(row.input_tokens > 0 and row.output_tokens > 0 for row in rows)


async def test_an_agent_calls_its_tool_then_answers(gateway, upstream, client):
    upstream.enqueue(Scenario(blocks=[CALL]), Scenario(blocks=[{"type": "text", "text": ANSWER}]))
    asked: list[str] = []
    agent = weather_agent(OpenAIResponsesModel(model=MODEL, openai_client=client), asked)
    result = await Runner.run(agent, "What's the weather in Oslo?", run_config=RUN)

    assert asked == ["Oslo"]
    assert result.final_output == ANSWER
    await check_the_tool_loop(gateway, upstream)


async def test_a_streamed_run_by_the_upstream_name_on_the_default_provider(gateway, upstream, client):
    # Deltas that arrive together leave the gateway as one event: these are paced, so come apart.
    answer = Scenario(blocks=[{"type": "text", "text": ANSWER}], chunk_size=8, event_delay=0.01)
    upstream.enqueue(Scenario(blocks=[CALL]), answer)
    asked: list[str] = []
    # The SDK's default provider, with the client set_default_openai_client would give it.
    provider = MultiProvider(openai_client=client, openai_use_responses=True)
    agent = weather_agent(UPSTREAM_MODEL, asked)
    result = Runner.run_streamed(
        agent, "What's the weather in Oslo?", run_config=RunConfig(model_provider=provider, tracing_disabled=True)
    )
    deltas = [
        event.data.delta
        async for event in result.stream_events()
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
    ]

    assert asked == ["Oslo"]
    assert result.final_output == ANSWER == "".join(deltas)
    assert len(deltas) > 1
    assert all(request.body["stream"] is True for request in upstream.requests)
    await check_the_tool_loop(gateway, upstream)


THOUGHT = {"type": "thinking", "thinking": "The tool knows the weather.", "signature": "sig-agents"}


async def test_the_thinking_survives_the_tool_call_with_encrypted_reasoning(gateway, upstream, client):
    """With `response_include=["reasoning.encrypted_content"]`, the agent's next turn carries the
    sealed reasoning item back, and the upstream gets the thinking in place."""
    upstream.enqueue(Scenario(blocks=[THOUGHT, CALL]), Scenario(blocks=[{"type": "text", "text": ANSWER}]))
    asked: list[str] = []
    agent = weather_agent(OpenAIResponsesModel(model=MODEL, openai_client=client), asked)
    agent.model_settings = ModelSettings(
        reasoning=Reasoning(effort="medium"), response_include=["reasoning.encrypted_content"]
    )
    result = await Runner.run(agent, "What's the weather in Oslo?", run_config=RUN)

    assert (asked, result.final_output) == (["Oslo"], ANSWER)
    offered, answered = [request.body for request in upstream.requests]
    assert offered["thinking"] == answered["thinking"] == {"type": "adaptive"}
    assert answered["messages"][-2] == {"role": "assistant", "content": [THOUGHT, CALL]}
