"""Agent frameworks as clients (on the package's `tool_servers`, random Qwen2.5-shaped weights): the
OpenAI Agents SDK runs an agent with a function tool through /v1/responses and through
/v1/chat/completions, and LangChain's ChatOpenAI calls a bound tool. Random weights decide
nothing, so the tool choice is required (or the tool named): the grammar makes the call, the
framework parses it, runs the tool and ends the run with its result (`stop_on_first_tool`)."""

import asyncio
from typing import Literal

import pytest

agents = pytest.importorskip("agents")


def run_agent(url: str, model_class) -> tuple:
    from openai import AsyncOpenAI

    seen = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"18 degrees in {city}"

    async def run():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        agent = agents.Agent(name="forecaster", instructions="Answer with the tool.", tools=[get_weather],
                             model=model_class("qwen2.5", client), tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=300,
                                                                 parallel_tool_calls=False))
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)  # no traces sent anywhere
    return asyncio.run(run()), seen


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_openai_agents_sdk_runs_a_function_tool(tool_servers, model_class):
    result, seen = run_agent(tool_servers["qwen2.5"], getattr(agents, model_class))
    assert len(seen) == 1 and result.final_output == f"18 degrees in {seen[0]}"
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]


def test_langchain_calls_a_bound_tool(tool_servers):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"18 degrees in {city}"

    llm = langchain_openai.ChatOpenAI(model="qwen2.5", base_url=tool_servers["qwen2.5"] + "/v1", api_key="x",
                                      temperature=0, max_tokens=300, max_retries=0, timeout=600)
    for choice in ("get_weather", "required"):
        message = llm.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
        [call] = message.tool_calls[:1]
        assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
        assert get_weather.invoke(call["args"]).startswith("18 degrees")
