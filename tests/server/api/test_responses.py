"""POST /v1/responses over HTTP through the official `openai` client (on the package's
`tool_servers`): text and item input, instructions, a function call and its output in a second
turn, text.format, max_output_tokens, reasoning items, the stream's events in OpenAI's shapes and
order, and the 400s of what a stateless server cannot do."""

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.helpers import openai_client

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True}]


@pytest.fixture(scope="module")
def client(tool_servers):
    return openai_client(tool_servers["qwen2.5"], timeout=600)


def test_text_in_text_out(client):
    r = client.responses.create(model="qwen2.5", input="Say hi.", instructions="Be brief.", max_output_tokens=6,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "qwen2.5"
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":  # random weights rarely end by themselves within 6 tokens
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6
    assert r.instructions == "Be brief." and r.max_output_tokens == 6


def test_a_call_then_its_output(client):
    first = client.responses.create(model="qwen2.5", input=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=300, temperature=0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(model="qwen2.5", tools=TOOLS, tool_choice="none", max_output_tokens=5,
                                     temperature=0, input=[
                                         {"role": "user", "content": "Weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "18 degrees"}])
    assert [o.type for o in second.output] == ["message"] and second.output_text
    named = client.responses.create(model="qwen2.5", input="Weather?", tools=TOOLS, max_output_tokens=300,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert [o.name for o in named.output] == ["get_weather"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="qwen2.5", input="JSON please", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "o", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text) in ({"ok": True}, {"ok": False})
    assert r.text.format.type == "json_schema"


def test_the_stream_in_openai_shapes_and_order(client):
    events = list(client.responses.create(model="qwen2.5", input="Weather in Oslo?", tools=TOOLS, stream=True,
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=300,
                                          temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[-2].item
    assert added.arguments == "" and added.status == "in_progress" and done.status == "completed"
    assert "".join(e.delta for e in events[3:-3]) == done.arguments == events[-3].arguments
    final = events[-1].response
    assert final.status == "completed" and final.output[0].arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    text = list(client.responses.create(model="qwen2.5", input="Hi", stream=True, max_output_tokens=4,
                                        temperature=0))
    assert [e.type for e in text[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                          "response.content_part.added"]
    assert text[-1].type == "response.incomplete" and text[-1].response.incomplete_details.reason == \
        "max_output_tokens"
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert deltas == text[-1].response.output_text


def test_reasoning_comes_out_as_a_reasoning_item(tool_servers, tool_ckpts):
    """Qwen3's template opens the think block; a bias on </think> ends the reasoning somewhere (the
    first of a few strengths that leaves some reasoning before it: the weights are random)."""
    end = AutoTokenizer.from_pretrained(tool_ckpts["qwen3"]).convert_tokens_to_ids("</think>")
    client = openai_client(tool_servers["qwen3"], timeout=600)
    for bias in (2, 3, 4):
        kw = dict(model="qwen3", input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=300, temperature=0,
                  extra_body={"logit_bias": {str(end): bias}})
        r = client.responses.create(**kw)
        if r.output and r.output[0].type == "reasoning":
            break
    assert [o.type for o in r.output] == ["reasoning", "function_call"], r.output
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "function_call"]


@pytest.mark.parametrize("kw,param,words", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, "input",
     "'input_image'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
])
def test_what_a_stateless_server_cannot_do_is_a_400(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "qwen2.5", "input": "hi", **kw})
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_unknown_model_is_a_404(tool_servers):
    r = httpx.post(tool_servers["qwen2.5"] + "/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
