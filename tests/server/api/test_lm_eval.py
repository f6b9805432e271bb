"""lm-evaluation-harness (`lm_eval`, a client nobody here wrote) against a real flashpage server.

A small local task (written into a temporary folder: JSONL data and task YAML) runs twice through
`lm_eval.simple_evaluate`: with `local-completions` against a flashpage server on the embedded
model, and with lm_eval's own Hugging Face backend (`hf`) on the same checkpoint, on the CPU in
float32. The scores must be equal, and so must every document's responses: the greedy
generations exactly, each choice's log-likelihood within 1e-3 (a wrong prompt log-probability
changes these even where accuracy happens to agree).

What local-completions sends (lm_eval/models/openai_completions.py, api_models.py; tokenized
requests, so prompts are token-id lists, `batch_size` of them per request):
- log-likelihood: {"model", "prompt": [[ids], ...], "temperature": 0, "max_tokens": 1,
  "logprobs": 1, "seed": 1234, "echo": true}; it sums choices[i].logprobs.token_logprobs[ctxlen:-1]
  (the continuation's tokens; the last entry is the sampled token) and calls the continuation
  greedy when each of those equals max(top_logprobs[j].values()).
- generate_until: {"prompt": [[ids], ...], "model", "max_tokens": max_gen_toks, "temperature": 0,
  "stop": until + [the tokenizer's EOS string], "seed": 1234}; it takes choices[i].text as is.
"""

import json
import math
import signal

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (it is in the dev extra: "
                                                "pip install -e '.[dev]')")

import httpx  # noqa: E402
import yaml  # noqa: E402

from benchmarks.shared.common import REPO_ROOT, ServerProcess  # noqa: E402

EMBEDDED = REPO_ROOT / "models" / "embedded"
MAX_MODEL_LEN = 256
BATCH = 8  # prompts per request from local-completions: the server gets lists of token-id lists

# Multiple choice: lm_eval asks for log P(" " + choice | context) of every choice. Some golds are not
# the model's favourite (acc is neither 0 nor 1), choices differ in length (acc_norm, by characters,
# can differ from acc), and the first document has an empty context (lm_eval then puts the EOS
# token before the continuation: the continuation starts at the prompt's second token).
MC_DOCS = [
    {"context": "", "choices": ["Return the number of items.", "Purple elephants dance."], "gold": 0},
    {"context": "Return the absolute value of", "choices": ["a number.", "the dog.", "blue sky."], "gold": 0},
    {"context": "Open the file and return a", "choices": ["file object.", "banana split.", "red car."], "gold": 1},
    {"context": "Raise ValueError if the", "choices": ["argument is invalid.", "moon is full.", "cat sleeps."],
     "gold": 0},
    {"context": "The default value is", "choices": ["None.", "purple.", "yesterday afternoon."], "gold": 2},
    {"context": "Remove the item from the", "choices": ["list.", "ocean.", "kitchen table."], "gold": 0},
]
# generate_until, greedy, at most 8 tokens, until "\n" (local-completions adds the EOS string): the
# model's answers end on EOS, on "\n" at once (empty text) and on the token limit; two targets are
# the model's own answer, two are not (exact_match 0.5).
GEN_DOCS = [
    {"prompt": "Return True if the object is", "target": " a class."},
    {"prompt": "Raise ValueError if the", "target": " exception is raised."},
    {"prompt": "If the file does not exist,", "target": " raise an error."},
    {"prompt": "Return a new list of the", "target": " items."},
]
MC_TASK, GEN_TASK = "flashpage_mc", "flashpage_gen"


def _write_tasks(root) -> None:
    """The two tasks' data (JSONL) and configs (YAML) under `root`, for TaskManager(include_path=root)."""
    datasets_cache = root / "hf_datasets_cache"  # the json loader's cache stays out of ~/.cache
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1.0}}
    metric = lambda name: {"metric": name, "aggregation": "mean", "higher_is_better": True}  # noqa: E731
    tasks = {
        MC_TASK: (MC_DOCS, {"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
                            "doc_to_target": "gold", "metric_list": [metric("acc"), metric("acc_norm")]}),
        GEN_TASK: (GEN_DOCS, {"output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "target",
                              "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False,
                                                    "temperature": 0.0},
                              "metric_list": [metric("exact_match")]}),
    }
    for name, (docs, config) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = {"task": name, **common, **config,
                  "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(datasets_cache)}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_tasks(root)
    return root


@pytest.fixture(scope="module")
def server():
    # the engine on a thread of the server process (one Python process to start, not two): what
    # lm_eval's scores check is the answers, wherever the engine steps
    srv = ServerProcess.python_server(["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                                       "--num-blocks", "64", "--no-engine-process"]).wait_healthy(120)
    yield srv
    srv.stop(30, sig=signal.SIGKILL)  # its graceful exit is not what this file tests (test_reliability's is)


def _evaluate(model: str, model_args: dict, task: str, task_dir, batch_size: int) -> dict:
    from lm_eval.tasks import TaskManager  # here: it imports datasets and pandas (~1 s), collection need not

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], batch_size=batch_size, log_samples=True,
        bootstrap_iters=0, random_seed=0, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    assert out is not None
    return out


def _hf(task: str, task_dir) -> dict:
    """lm_eval's own transformers backend on the embedded checkpoint: the reference."""
    return _evaluate("hf", {"pretrained": str(EMBEDDED), "dtype": "float32", "device": "cpu"}, task, task_dir, 1)


def _model_id(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _served(srv: ServerProcess, task: str, task_dir) -> dict:
    """local-completions against the server. max_retries=1: a refused or failed request fails the
    test at once instead of after lm_eval's back-off."""
    args = {"model": _model_id(srv), "base_url": srv.url + "/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(EMBEDDED), "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
            "max_length": MAX_MODEL_LEN, "timeout": 60}
    try:
        return _evaluate("local-completions", args, task, task_dir, BATCH)
    except BaseException:
        print("server log (tail):\n" + srv.log_tail(60))
        raise


def _samples(out: dict, task: str, count: int) -> list[dict]:
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(count))
    return samples


def _metrics(out: dict, task: str) -> dict:
    return {k: v for k, v in out["results"][task].items() if k.endswith(",none") and "_stderr" not in k}


def test_generate_until_equals_hf(server, task_dir):
    served, hf = _served(server, GEN_TASK, task_dir), _hf(GEN_TASK, task_dir)
    got = [s["resps"][0][0] for s in _samples(served, GEN_TASK, len(GEN_DOCS))]
    want = [s["resps"][0][0] for s in _samples(hf, GEN_TASK, len(GEN_DOCS))]
    assert got == want
    assert want[0] == GEN_DOCS[0]["target"] and want[2] == ""  # an answer ended by EOS; one by "\n" at once
    assert _metrics(served, GEN_TASK) == _metrics(hf, GEN_TASK) == {"exact_match,none": 0.5}


def test_multiple_choice_loglikelihoods_equal_hf(server, task_dir):
    # First the body local-completions sends for log-likelihoods, so that a server without prompt
    # log-probabilities fails here, saying so, rather than in lm_eval's sum() of nulls (a TypeError).
    prompt = [464, 2068, 286, 262, 2393]
    body = {"model": _model_id(server), "prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:]), (
        f"echo + logprobs: the prompt tokens after the first need log-probabilities, got {lp['token_logprobs']}")
    assert all(isinstance(t, dict) and lp["token_logprobs"][i] in t.values()
               for i, t in enumerate(lp["top_logprobs"]) if i), lp["top_logprobs"]

    served, hf = _served(server, MC_TASK, task_dir), _hf(MC_TASK, task_dir)
    got, want = _samples(served, MC_TASK, len(MC_DOCS)), _samples(hf, MC_TASK, len(MC_DOCS))
    for doc, g, w in zip(MC_DOCS, got, want):
        # resps: per choice [(log-likelihood, is_greedy)]
        assert len(g["resps"]) == len(w["resps"]) == len(doc["choices"])
        for choice, ((g_ll, g_greedy),), ((w_ll, w_greedy),) in zip(doc["choices"], g["resps"], w["resps"]):
            where = f"doc {g['doc_id']} {doc['context']!r} + {choice!r}"
            assert isinstance(g_ll, float) and math.isfinite(g_ll), where
            assert g_ll == pytest.approx(w_ll, abs=1e-3), where
            assert g_greedy == w_greedy, where
    values = _metrics(hf, MC_TASK)
    assert 0 < values["acc,none"] < 1  # the task tells right from wrong
    assert _metrics(served, MC_TASK) == values
