"""Tool calling on /v1/chat/completions over HTTP, through the official `openai` client, on random
Qwen2.5-, Qwen3- and Llama-3.2-shaped checkpoints carrying their families' tool templates
(tests/server/api/tool_models.py; the package's `tool_servers`): required and named choices make
calls that parse and validate against their schemas for every seed, streamed and whole (and alike);
OpenAI's delta shapes; a two-turn exchange with a tool result; tools beside a JSON response_format;
an auto call started by the model is a whole call; reasoning split out; vLLM's errors; and
return_token_ids, prompt_token_ids and /get_load for routers and RL loops."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import openai_client

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"]}
ALARM = {"type": "object", "properties": {"at": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "repeat": {"type": "boolean"}}, "required": ["at"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ["qwen2.5", "qwen3", "llama3.2", "plain"]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen3's template closes the block itself
SEEDS = range(3)  # x streamed/whole x required/named: 12 calls a family
# What ends a reply of calls: the end-of-turn ids, and the plain format's closing bracket
ENDINGS = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3.2": "<|eot_id|>", "plain": "<|eot_id|>]"}


def ending_bias(url: str, family: str) -> dict:
    """logit_bias toward what ends a reply: random weights would otherwise add call after call
    until max_tokens wherever the grammar lets the reply end or go on (it still decides where)."""
    ids = httpx.post(url + "/tokenize", json={"prompt": ENDINGS[family] + "<|endoftext|>",
                                              "add_special_tokens": False}).json()["tokens"]
    return {str(i): 6 for i in ids}


def ask(url: str, seed: int, stream: bool, **kw):
    """(finish_reason, content, [(name, arguments)]) of one choice, from the whole response or the
    joined stream deltas (checked against OpenAI's shapes on the way)."""
    client = openai_client(url, timeout=600)
    body = {"model": client.models.list().data[0].id, "messages": MSGS, "tools": TOOLS, "max_tokens": 400,
            "temperature": 1.0, "seed": seed, "extra_body": NO_THINKING, **kw}
    if not stream:
        c = client.chat.completions.create(**body).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert all(t.type == "function" and t.id.startswith("call_") for t in c.message.tool_calls or [])
        return c.finish_reason, c.message.content, calls
    finish, content, calls = None, None, {}
    for chunk in client.chat.completions.create(stream=True, **body):
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        if c.delta.content:
            content = (content or "") + c.delta.content
        for t in c.delta.tool_calls or []:
            if t.index not in calls:  # a call's first delta: id, type and name, arguments empty
                assert t.id.startswith("call_") and t.type == "function" and t.function.name
                assert t.function.arguments == "" and t.index == len(calls)
                calls[t.index] = [t.function.name, ""]
            else:  # then only the index and pieces of the arguments
                assert t.id is None and t.function.name is None
                calls[t.index][1] += t.function.arguments
    return finish, content, [tuple(v) for v in calls.values()]


def validate(calls) -> None:
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named_calls_parse_and_validate_for_every_seed(tool_servers, family):
    url = tool_servers[family]
    bias = ending_bias(url, family)
    choices = {"required": "required", "named": {"type": "function", "function": {"name": "set_alarm"}}}
    jobs = [(seed, stream, choice, parallel) for seed in SEEDS for stream in (False, True)
            for choice, parallel in (("required", seed % 2 == 0), ("named", None))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # together: constrained rows share batches
        results = list(pool.map(lambda j: ask(url, j[0], j[1], tool_choice=choices[j[2]], logit_bias=bias, **(
            {} if j[3] is None else {"parallel_tool_calls": j[3]})), jobs))
    by_job = dict(zip(jobs, results))
    for (seed, stream, choice, parallel), (finish, content, calls) in by_job.items():
        assert finish == "tool_calls" and not content and calls, (seed, stream, choice, content)
        validate(calls)
        if choice != "required":
            assert [c[0] for c in calls] == ["set_alarm"]
        elif parallel is False:
            assert len(calls) == 1
        if stream:  # the same seed, the same calls, streamed or whole
            assert [c[0] for c in calls] == [c[0] for c in by_job[(seed, False, choice, parallel)][2]]
            assert [c[1] for c in calls] == [c[1] for c in by_job[(seed, False, choice, parallel)][2]]


def test_a_two_turn_exchange_renders_the_result_and_answers(tool_servers):
    for family, seen in [("qwen2.5", "<tool_response>\n18 degrees, sunny\n</tool_response>"),
                         ("llama3.2", "ipython<|end_header_id|>\n\n18 degrees, sunny")]:
        url = tool_servers[family]
        client = openai_client(url)
        model = client.models.list().data[0].id
        first = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=320, temperature=0)
        [call] = first.choices[0].message.tool_calls
        history = [*MSGS, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
        second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
        assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
        assert not second.choices[0].message.tool_calls
        rendered = httpx.post(url + "/v1/chat/completions/render", json={"model": model, "messages": history,
                                                                        "tools": TOOLS, "tool_choice": "none"}).json()
        text = detokenize(url, rendered[0]["token_ids"])
        assert seen in text and call.function.name in text  # the call and its result, as the template writes them


def detokenize(url: str, ids: list[int]) -> str:
    """The text of `ids`, special tokens included (the server's /detokenize)."""
    return httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_tools_beside_a_json_response_format_give_a_call_or_the_object(tool_servers):
    url = tool_servers["qwen2.5"]
    answer = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]},
                                               "temp": {"type": "integer", "minimum": -30, "maximum": 40}},
              "required": ["sky", "temp"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": answer}}
    bias = ending_bias(url, "qwen2.5")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: ask(url, s, s % 2 == 1, response_format=fmt, logit_bias=bias,
                                              parallel_tool_calls=False), range(8)))
    for finish, content, calls in results:
        if calls:
            assert finish == "tool_calls" and not content
            validate(calls)
        else:
            assert finish == "stop"
            jsonschema.validate(json.loads(content), answer)


def test_an_auto_call_the_model_starts_is_a_whole_call(tool_servers, tool_ckpts):
    """Under auto the model may write anything; once it writes <tool_call> (pushed here by a bias on
    that token), the grammar holds it to a whole call of a listed tool."""
    url = tool_servers["qwen2.5"]
    from transformers import AutoTokenizer

    tag = AutoTokenizer.from_pretrained(tool_ckpts["qwen2.5"]).convert_tokens_to_ids("<tool_call>")
    bias = {str(tag): 8}  # one call at most: the grammar ends the reply after it
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: ask(url, s, s % 2 == 0, logit_bias=bias, parallel_tool_calls=False),
                                range(4)))
    for finish, content, calls in results:
        assert finish == "tool_calls" and len(calls) == 1
        validate(calls)


def test_reasoning_is_split_out_streamed_and_whole(tool_servers, tool_ckpts):
    """Qwen3's template opens the think block (enable_thinking by default): the reply reasons until
    </think> (pushed by a bias), then makes its call; enable_thinking false leaves no reasoning."""
    from transformers import AutoTokenizer

    url = tool_servers["qwen3"]
    end = AutoTokenizer.from_pretrained(tool_ckpts["qwen3"]).convert_tokens_to_ids("</think>")
    client = openai_client(url, timeout=600)
    for bias in (2, 3, 4):  # the first strength that leaves some reasoning before </think> (random weights)
        kw = dict(model="qwen3", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=400, temperature=0, logit_bias={**ending_bias(url, "qwen3"), str(end): bias})
        whole = client.chat.completions.create(**kw).choices[0]
        reasoning = whole.message.model_extra["reasoning_content"]
        if reasoning:
            break
    assert reasoning and whole.message.model_extra["reasoning"] == reasoning and "</think>" not in reasoning
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    validate([(t.function.name, t.function.arguments) for t in whole.message.tool_calls])
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == reasoning
    off = client.chat.completions.create(**{**kw, "extra_body": NO_THINKING}).choices[0]
    assert off.message.model_extra["reasoning_content"] is None and off.message.tool_calls


@pytest.mark.parametrize("server,kw,param,words", [
    ("plain", {"tools": TOOLS}, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
    ("qwen2.5", {"tools": []}, "tools", "must not be an empty array"),
    ("qwen2.5", {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ("qwen2.5", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ("qwen2.5", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
                 "response_format": {"type": "json_object"}}, "tool_choice", "not both"),
    ("qwen2.5", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ("qwen2.5", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
                 "tool_choice": "required"}, "tools", "invalid tool-call grammar"),
    ("qwen2.5", {"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs", "may not set tools"),
    ("qwen2.5", {"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages", "tool_call_id"),
])
def test_what_cannot_be_served_is_a_400_naming_it(tool_servers, server, kw, param, words):
    client = openai_client(tool_servers[server])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": server, "messages": MSGS, "max_tokens": 4, **kw})
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_return_token_ids_round_trip(tool_servers, tool_ckpts):
    """The ids detokenize to the text; sent back as prompt_token_ids (no second render), the same
    answer; streamed, the same ids in pieces; /v1/completions returns them per choice."""
    from transformers import AutoTokenizer

    url, tok = tool_servers["qwen2.5"], AutoTokenizer.from_pretrained(tool_ckpts["qwen2.5"])
    client = openai_client(url, timeout=600)
    kw = dict(model="qwen2.5", max_tokens=12, temperature=0)
    first = client.chat.completions.create(messages=MSGS, extra_body={"return_token_ids": True}, **kw)
    ids, prompt = first.choices[0].model_extra["token_ids"], first.model_extra["prompt_token_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == first.choices[0].message.content
    assert prompt == tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)["input_ids"]
    again = client.chat.completions.create(messages=[{"role": "user", "content": "(rendered before)"}], extra_body={
        "return_token_ids": True, "prompt_token_ids": prompt}, **kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].model_extra["token_ids"] == ids and again.model_extra["prompt_token_ids"] == prompt
    chunks = list(client.chat.completions.create(messages=MSGS, stream=True, extra_body={"return_token_ids": True},
                                                 **kw))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert [i for c in chunks for i in (c.choices[0].model_extra.get("token_ids") or [])] == ids
    assert "prompt_token_ids" not in chunks[1].model_extra
    c = client.completions.create(model="qwen2.5", prompt="The quick", max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True}).choices[0]
    assert c.model_extra["prompt_token_ids"] == tok.encode("The quick")
    assert tok.decode(c.model_extra["token_ids"], skip_special_tokens=True) == c.text


def test_get_load_counts_what_runs(tool_servers):
    url = tool_servers["llama3.2"]
    body = {"model": "llama3.2", "prompt": "The", "max_tokens": 200, "ignore_eos": True}
    # Polled over one kept-alive connection, without a pause: a CI run's 100 tokens finished between
    # two 50 ms polls, and once between two polls that each opened a connection (loads [0, 0]). A
    # request counts from its admission to its last token, so up to three requests are watched.
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(1) as pool:
        assert client.get("/get_load").json() == {"load": 0}
        loads = []
        for _ in range(3):
            running = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=600)
            while not running.done():
                loads.append(client.get("/get_load").json()["load"])
            assert running.result().status_code == 200
            if 1 in loads:
                break
        assert max(loads) == 1, loads  # never more: one request at a time
        assert client.get("/get_load").json() == {"load": 0}


def test_tokenize_counts_the_prompt_the_tools_make(tool_servers):
    url = tool_servers["qwen2.5"]
    counted = httpx.post(url + "/tokenize", json={"messages": MSGS, "tools": TOOLS}).json()
    run = openai_client(url, timeout=600).chat.completions.create(
        model="qwen2.5", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=1, temperature=0)
    assert counted["count"] == run.usage.prompt_tokens > httpx.post(url + "/tokenize", json={"messages": MSGS}).json()[
        "count"]
