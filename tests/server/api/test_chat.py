"""POST /v1/chat/completions through real uvicorn servers on loopback, driven by the official
`openai` client: the chat template path (the same tokens as /v1/completions of the rendered prompt,
BOS not doubled), streaming, n > 1 with seeds, logprobs, max_completion_tokens / max_tokens, stop
strings, content parts, --chat-template, and errors in OpenAI's shape.

The checkpoint is the session's tiny GPT-2 with a chat template in its tokenizer_config.json and a
tokenizer that adds BOS itself (as Llama's does), so a server that let the tokenizer add special
tokens to the rendered prompt would double it. Three servers (the first two start together) and an app:
- `chat`: that checkpoint;
- `slow`: the chat checkpoint with steps slowed (test-only fault hook) and --request-timeout 3;
- `bare`: the plain tiny checkpoint, which has no chat template (the session's shared server);
- `override`: the chat checkpoint with `--chat-template` (a template of another shape, no BOS), the
  app in-process (tests/helpers.py's app_client): the flag changes only what the API layer renders.
"""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from benchmarks.shared.common import ServerProcess
from tests.helpers import app_client, openai_client, sse_events, with_chat_template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system message must be first') }}"
            "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OVERRIDE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
NO_EOS = {"ignore_eos": True}  # flashpage extension: random weights may sample EOS early


@pytest.fixture(scope="module")
def chat_ckpt(tiny_ckpt, tmp_path_factory):
    return with_chat_template(tiny_ckpt, tmp_path_factory.mktemp("chat-gpt2") / "ckpt", TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(chat_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_ckpt)


@pytest.fixture(scope="module")
def servers(chat_ckpt, plain_server):
    specs = {"chat": ([chat_ckpt], {}),
             "slow": ([chat_ckpt, "--request-timeout", "3"], {"FLASHPAGE_FAULT_INJECT": "sleep=0.02"})}
    started = {name: ServerProcess.python_server(["--model", *map(str, args), "--device", "cpu", "--num-blocks", "64"],
                                                 extra_env=env) for name, (args, env) in specs.items()}
    try:
        # `bare`: the plain tiny checkpoint, the session's shared server (tests/conftest.py)
        yield {"bare": plain_server, **{name: srv.wait_healthy(120).url for name, srv in started.items()}}
    finally:
        # SIGKILL: a graceful exit (1-2 s of CPU per process) is not what this file tests
        # (test_reliability's SIGTERM test is); nothing here read the exit code.
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def client(servers):
    return openai_client(servers["chat"])


@pytest.fixture(scope="module")
def override(chat_ckpt, tmp_path_factory):
    """The official client on the chat checkpoint's app with --chat-template OVERRIDE."""
    template = tmp_path_factory.mktemp("template") / "override.jinja"
    template.write_text(OVERRIDE)
    with app_client(["--model", str(chat_ckpt), "--device", "cpu", "--num-blocks", "64", "--chat-template",
                     str(template)]) as app:
        yield openai_client("http://testserver", http_client=app)


def chat(client, model, **kw):
    return client.chat.completions.create(**{"model": model, "messages": MSGS, "temperature": 0,
                                             "extra_body": NO_EOS, **kw})


def streamed_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


def test_chat_is_completion_of_rendered_prompt(client, model, tokenizer):
    rendered = tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|endoftext|><|system|>Be brief.\n<|user|>The quick brown fox\n<|assistant|>"
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert tokenizer(rendered).input_ids == [tokenizer.bos_token_id] + ids  # the tokenizer would add a 2nd BOS
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MSGS, max_completion_tokens=10,
                                                           temperature=0, extra_body=NO_EOS)
    c = raw.parse()
    assert c.object == "chat.completion" and c.model == model and c.id == "chatcmpl-" + raw.headers["x-request-id"]
    assert len(c.choices) == 1 and c.choices[0].index == 0 and c.choices[0].logprobs is None
    msg = c.choices[0].message
    assert msg.role == "assistant" and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (len(ids), 10, len(ids) + 10)
    comp = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, extra_body=NO_EOS)
    assert msg.content == comp.choices[0].text and comp.usage.prompt_tokens == len(ids)
    # As text, /v1/completions lets the tokenizer add its BOS: one token more than the chat prompt.
    assert client.completions.create(model=model, prompt=rendered, max_tokens=1).usage.prompt_tokens == len(ids) + 1


def test_stream_matches_whole(servers, client, model):
    whole = chat(client, model, max_tokens=10).choices[0].message.content
    chunks = list(chat(client, model, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    usage, pieces = chunks[-1], chunks[:-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert all(ch.object == "chat.completion.chunk" and ch.usage is None and len(ch.choices) == 1 for ch in pieces)
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    first, last = pieces[0].choices[0], pieces[-1].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    assert last.finish_reason == "length" and last.delta.content is None and last.delta.role is None
    assert all(ch.choices[0].finish_reason is None and ch.choices[0].delta.role is None for ch in pieces[1:-1])
    assert streamed_texts(pieces) == {0: whole}
    # The wire: the last chunk of a choice has an empty delta; no usage chunk unless asked; then [DONE].
    body = {"model": model, "messages": MSGS, "max_tokens": 4, "temperature": 0, "stream": True, **NO_EOS}
    with httpx.stream("POST", servers["chat"] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                    "finish_reason": "length"}
    assert all(e["choices"] and "usage" not in e for e in events[:-1])


def test_n_choices_seeded_reproducible(client, model):
    kw = dict(max_completion_tokens=8, temperature=1.0, seed=123)
    a, b = chat(client, model, n=2, **kw), chat(client, model, n=2, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1] and texts == [c.message.content for c in b.choices]
    assert texts[0] != texts[1]  # each choice has its own seed: seed + index
    assert a.usage.completion_tokens == 16
    assert chat(client, model, **{**kw, "seed": 124}).choices[0].message.content == texts[1]
    chunks = list(chat(client, model, n=2, stream=True, **kw))
    assert streamed_texts(chunks) == {0: texts[0], 1: texts[1]}
    roles = [(c.index, c.delta.role) for ch in chunks for c in ch.choices if c.delta.role]
    ends = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(roles) == [(0, "assistant"), (1, "assistant")] and sorted(ends) == [(0, "length"), (1, "length")]


def test_logprobs_match_completions(client, model, tokenizer):
    c = chat(client, model, max_tokens=6, logprobs=True, top_logprobs=3).choices[0]
    content = c.logprobs.content
    assert len(content) == 6
    for t in content:
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [alt.logprob for alt in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] == pytest.approx(t.logprob, abs=1e-6)  # greedy
        assert t.top_logprobs[0].token == t.token
    ids = tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(ids, add_special_tokens=False).input_ids
    legacy = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body=NO_EOS).choices[0].logprobs
    assert [t.token for t in content] == legacy.tokens
    assert [t.logprob for t in content] == pytest.approx(legacy.token_logprobs, abs=1e-5)
    streamed = [t for ch in chat(client, model, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
                for x in ch.choices if x.logprobs for t in x.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    bare = chat(client, model, max_tokens=2, logprobs=True).choices[0].logprobs.content
    assert len(bare) == 2 and all(t.top_logprobs == [] for t in bare)


def test_max_completion_tokens_and_max_tokens(client, model):
    new = chat(client, model, max_completion_tokens=5)
    old = chat(client, model, max_tokens=5)
    both = chat(client, model, max_tokens=5, max_completion_tokens=5)
    assert new.usage.completion_tokens == old.usage.completion_tokens == both.usage.completion_tokens == 5
    assert new.choices[0].message.content == old.choices[0].message.content == both.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=5, max_completion_tokens=6)
    assert e.value.body["param"] == "max_tokens" and "max_completion_tokens" in e.value.message
    rest = chat(client, model)  # neither: up to the end of the context (256 tokens; the engine ends at 255 today)
    assert rest.usage.total_tokens >= 255 and rest.choices[0].finish_reason == "length"


def test_stop_strings_stream_and_whole_agree(client, model):
    text = chat(client, model, max_tokens=12).choices[0].message.content
    i = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[i:i + 2]
    c = chat(client, model, max_tokens=12, stop=[stop, "never-there"]).choices[0]
    assert c.finish_reason == "stop" and c.message.content == text[:text.find(stop)]
    chunks = list(chat(client, model, max_tokens=12, stop=stop, stream=True))
    assert streamed_texts(chunks) == {0: c.message.content} and chunks[-1].choices[0].finish_reason == "stop"


def test_text_parts_are_joined(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown"}]}]
    a = chat(client, model, messages=parts, max_tokens=6)
    b = chat(client, model, messages=[{"role": "user", "content": "The quick\nbrown"}], max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage


def test_chat_template_flag_overrides(override, client, model, tokenizer):
    c = chat(override, model, max_tokens=8)
    rendered = tokenizer.apply_chat_template(MSGS, chat_template=OVERRIDE, tokenize=False, add_generation_prompt=True)
    assert rendered == "[SYSTEM] Be brief.\n[USER] The quick brown fox\n[ASSISTANT]"
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert c.usage.prompt_tokens == len(ids) != chat(client, model, max_tokens=1).usage.prompt_tokens
    # With no BOS in this template, /v1/completions of the rendered text is the same request.
    comp = override.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert c.choices[0].message.content == comp.choices[0].text
    # The flag's template replaces the model's: the model's raise_exception no longer applies.
    late_system = [MSGS[1], MSGS[0]]
    assert chat(override, model, messages=late_system, max_tokens=1).choices[0].finish_reason == "length"


def test_missing_template_names_the_flag(servers, tiny_ckpt):
    bare = openai_client(servers["bare"])
    with pytest.raises(openai.BadRequestError) as e:
        bare.chat.completions.create(model=str(tiny_ckpt), messages=MSGS)
    assert "--chat-template" in e.value.message and e.value.body["type"] == "invalid_request_error"
    assert bare.completions.create(model=str(tiny_ckpt), prompt="hi", max_tokens=1).choices  # completions still work


def test_template_that_fails_to_render_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, messages=[MSGS[1], MSGS[0]])
    assert "system message must be first" in e.value.message and e.value.body["param"] == "messages"


@pytest.mark.parametrize("kw,param,words", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages", "'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]}, "messages", "text part"),
    ({"messages": [{"role": "user", "content": []}]}, "messages", "empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages", "tool_calls"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "content"),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "user", "content": "x " * 300}], "max_tokens": 10}, "messages", "context length"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"n": 0}, "n", "n"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
    ({"max_tokens": "5"}, "max_tokens", "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"stop": ["x"] * 17}, "stop", "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
    ({"logit_bias": {"99999": 10}}, "logit_bias", "outside the vocabulary"),
    # tools (tests/server/api/test_tool_calls.py has the rest): vLLM's errors
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "invalid JSON schema"),
])
def test_bad_requests_are_openai_400s(client, model, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": model, "messages": MSGS, **kw})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_error_details_and_defaults(servers, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSGS)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, functions=[{"name": "f"}])
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert e.value.code == "unsupported_content_type" and "'input_audio'" in e.value.message
    ok = chat(client, model, max_tokens=2, presence_penalty=0, frequency_penalty=0, logit_bias={}, user="alice",
              tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=True, store=False,
              messages=[{"role": "user", "content": "hi", "name": "alice"}])
    assert ok.usage.completion_tokens == 2
    url = servers["chat"] + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, content=b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
                   % model.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": model})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert [m.id for m in client.models.list().data] == [model]


def kv(url: str) -> dict:
    return httpx.get(url + "/debug/kv", timeout=5).json()


def wait_all_free(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (k := kv(url))["kv_blocks_free"] != k["kv_blocks_total"] or k["requests_active"]:
        assert time.monotonic() < deadline, f"blocks or requests leaked: {k}"
        time.sleep(0.05)
    return k


def test_deadline_is_finish_reason_timeout(servers, model):
    slow = openai_client(servers["slow"])
    # 20 ms steps: 200 tokens take 4 s, the deadline is 3 s. The plain and the streamed request run
    # at once (each has its own deadline), so the test waits for one deadline, not two.
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(chat, slow, model, max_tokens=200)
        streamed = pool.submit(lambda: list(chat(slow, model, max_tokens=200, stream=True)))
        c, chunks = plain.result(), streamed.result()
    assert c.choices[0].finish_reason == "timeout" and 0 < c.usage.completion_tokens < 200
    assert chunks[-1].choices[0].finish_reason == "timeout" and streamed_texts(chunks)[0]
    wait_all_free(servers["slow"])


def test_disconnects_abort(servers, model):
    url = servers["slow"]
    body = {"model": model, "messages": MSGS, "max_tokens": 100, **NO_EOS}
    before = wait_all_free(url)["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    after = wait_all_free(url)["generated_tokens"]
    assert after - before < 100  # aborted, not run to the end
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))  # one chunk, then hang up
    assert wait_all_free(url)["generated_tokens"] - after < 100


def test_cli_flag(tmp_path, capsys):
    from server.api.guards import ServerLimits
    from server.cli import build_parser

    good, bad = tmp_path / "t.jinja", tmp_path / "bad.jinja"
    good.write_text(OVERRIDE)
    bad.write_text("{% for m in messages %}")
    args = build_parser().parse_args(["--chat-template", str(good)])
    assert ServerLimits.from_args(args).chat_template == OVERRIDE
    assert ServerLimits.from_args(build_parser().parse_args([])).chat_template is None
    for path, words in [(tmp_path / "missing.jinja", "cannot read"), (bad, "line 1")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--chat-template", str(path)])
        err = capsys.readouterr().err
        assert "--chat-template" in err and words in err
