"""Issue 23, case 8: a setting the server cannot run with stops it at start, before anything loads,
with a message naming the flag and its allowed range (server/cli.py; `Bound` in server/api/limit_flags.py).
Before: --max-num-seqs 0 and --max-num-batched-tokens 0 started a healthy server that hung every
request, --block-size 0 crashed with ZeroDivisionError, --num-blocks 0 and --max-model-len 0 meant
"the default"."""

import argparse
import resource
import subprocess
import sys
import time

import pytest

from server.api.connections import FD_RESERVE, raise_fd_limit
from server.api.guards import ServerLimits
from server.cli import build_parser
from server.config import SPEC_ROUND_COST


@pytest.mark.parametrize("argv,words", [
    (["--max-num-seqs", "0"], ["0 is out of range", "an integer >= 1"]),
    (["--max-num-batched-tokens", "0"], ["an integer >= 1"]),
    (["--block-size", "0"], ["a power of two from 1 to 256"]),
    (["--block-size", "12"], ["a power of two"]),
    (["--block-size", "512"], ["a power of two"]),
    (["--num-blocks", "0"], [">= 1"]),  # not "the default": leave the flag out for that
    (["--max-model-len", "0"], [">= 1"]),
    (["--max-model-len", "-5"], [">= 1"]),
    (["--kv-cache-memory", "0"], ["a size in bytes", ">= 1"]),
    (["--cpu-kv-cache-memory", "0MiB"], [">= 1"]),
    (["--gpu-memory-utilization", "0"], ["a number > 0 and <= 1"]),
    (["--gpu-memory-utilization", "1.5"], ["> 0 and <= 1"]),
    (["--gpu-memory-utilization", "nan"], ["> 0 and <= 1"]),
    (["--max-admit-delay", "-1"], [">= 0"]),
    (["--seed", "-1"], ["from 0 to"]),
    (["--port", "70000"], ["from 0 to 65535"]),
    (["--port", "http"], ["'http' is not an integer"]),
    (["--log-stats-interval", "inf"], [">= 0"]),
    (["--max-body-bytes", "10"], [">= 64"]),
    (["--max-body-bytes", "lots"], ["'lots' is not a size in bytes"]),
    (["--max-prompt-chars", "0"], [">= 1"]),
    (["--max-prompt-tokens", "-1"], [">= 0"]),
    (["--max-waiting-requests", "0"], [">= 1, or -1 (no bound)"]),  # nothing could ever wait
    (["--max-waiting-requests", "-2"], [">= 1, or -1 (no bound)"]),
    (["--request-timeout", "-1"], [">= 0"]),
    (["--shutdown-grace", "nan"], [">= 0"]),
    (["--max-connections", "0"], [">= 1"]),
    (["--keep-alive-timeout", "0"], ["> 0"]),
    (["--header-timeout", "-1"], ["> 0"]),
    (["--body-timeout", "0"], ["> 0"]),
    (["--max-header-bytes", "100"], [">= 1024"]),
    (["--max-structured-spec-bytes", "0"], ["a size in bytes", ">= 1"]),
    (["--max-structured-depth", "0"], [">= 1"]),
    (["--structured-compile-timeout", "0"], ["> 0"]),
    (["--device", "gpu"], ["cpu, cuda or cuda:N"]),
    (["--api-server-count", "0"], ["from 1 to 64"]),
    (["--api-key", ""], ["non-empty", "leave the flag out"]),  # `--api-key "$UNSET"` must not turn auth off
    (["--api-key", "has space"], ["without spaces"]),
    (["--served-model-name", ""], ["must not be empty"]),
    (["--model", " "], ["must not be empty"]),
])
def test_impossible_settings_exit_2_naming_the_flag_and_its_range(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {argv[0]}" in err and all(w in err for w in words), err


def test_every_setting_is_checked_as_it_is_parsed():
    """Each option has a checked type, fixed choices or is a switch; --host is checked by the bind."""
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        checked = action.type is not None or action.choices or isinstance(action, argparse.BooleanOptionalAction)
        assert checked or action.dest == "host", action.dest


def test_the_ends_of_each_range_are_accepted():
    args = build_parser().parse_args([
        "--max-num-seqs", "1", "--block-size", "1", "--num-blocks", "1", "--max-model-len", "1",
        "--gpu-memory-utilization", "1", "--max-waiting-requests", "-1", "--port", "0", "--kv-cache-memory", "512MiB",
        "--max-admit-delay", "0", "--request-timeout", "0", "--max-prompt-tokens", "0", "--max-header-bytes", "1KiB",
        "--device", "cuda:1", "--api-key", "sk-abc_123.XYZ="])
    assert (args.block_size, args.num_blocks, args.max_waiting_requests, args.kv_cache_memory) == (1, 1, -1, 512 << 20)
    assert args.max_header_bytes == 1024 and args.gpu_memory_utilization == 1.0
    defaults = build_parser().parse_args([])
    assert defaults.num_blocks is None and defaults.max_model_len is None  # left out: sized from the budget / model


def test_the_server_stops_before_loading_anything():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "server", "--max-num-seqs", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "argument --max-num-seqs: 0 is out of range" in out.stderr
    assert time.monotonic() - t0 < 20  # argparse's exit, not a model load


def test_a_connection_cap_over_the_descriptor_limit_stops_the_server():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    out = subprocess.run([sys.executable, "-m", "server", "--max-connections", str(hard)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and f"--max-connections {hard}" in out.stderr and "ulimit" in out.stderr


def test_the_descriptor_limit_is_raised_to_fit_the_cap(monkeypatch):
    limits = {"now": (1024, 65536)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    raise_fd_limit(2048)
    assert limits["now"] == (2048 + FD_RESERVE, 65536)
    raise_fd_limit(100)  # fits already: unchanged
    assert limits["now"] == (2048 + FD_RESERVE, 65536)


@pytest.mark.parametrize("value,words", [
    ("ngram", ["not JSON"]),
    ("[1]", ["must be a JSON object"]),
    ('{"method": "ngram"}', ["num_speculative_tokens must be an integer from 1 to 16"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["from 1 to 16"]),
    ('{"method": "medusa", "num_speculative_tokens": 2}', ["'medusa' is not supported"]),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 2}', ["'eagle' (EAGLE-1 heads) is not supported",
                                                                         '"method": "eagle3"']),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', ["eagle3 needs `model`"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', ["needs `model`"]),
    ('{"num_speculative_tokens": 2}', ["method must be one of"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     ["prompt_lookup_min (4) is above prompt_lookup_max (2)"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}', ["must be an integer >= 1"]),
    ('{"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', ["belong to the ngram method"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model_tp": 1}', ["unknown key"]),
    ('{"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}',
     ["draft_tensor_parallel_size must be 1, got 2", "runs the draft whole"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', [">= 1"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance": 2}', ["from 0 to 1"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "backoff": "never"}', ["backoff must be one of"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "round_cost": -1}', ["round_cost must be a number"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}', ["quantization belongs to the draft_model"]),
    ('{"model": "d", "num_speculative_tokens": 2, "quantization": "int8"}', ["quantization must be one of", "'fp8'"]),
])
def test_a_speculative_config_that_cannot_run_exits_2_saying_why(value, words, capsys):
    test_impossible_settings_exit_2_naming_the_flag_and_its_range(["--speculative-config", value], words, capsys)


def test_speculative_config_reads_vllm_keys():
    parse = lambda v: build_parser().parse_args(["--speculative-config", v]).speculative_config  # noqa: E731
    assert build_parser().parse_args([]).speculative_config is None
    s = parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 4, 3, 3)
    s = parse('{"model": "[ngram]", "num_speculative_tokens": 2}')  # vLLM's other spelling; bounds 5 and 5
    assert (s.method, s.model, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", None, 5, 5)
    s = parse('{"model": "/models/draft", "num_speculative_tokens": 5, "disable_by_batch_size": 8}')
    assert (s.method, s.model, s.disable_by_batch_size) == ("draft_model", "/models/draft", 8)
    s = parse('{"method": "eagle3", "model": "/models/head", "num_speculative_tokens": 3}')
    assert (s.method, s.model, s.num_speculative_tokens, s.min_acceptance) == ("eagle3", "/models/head", 3, 0.25)
    # the back-off rule and its round cost by method (server/config.py SPEC_BACKOFF, SPEC_ROUND_COST), or as given
    assert (s.backoff, s.round_cost) == ("batch", SPEC_ROUND_COST["eagle3"])
    assert parse('{"method": "ngram", "num_speculative_tokens": 2}').backoff == "per_sequence"
    s = parse('{"model": "d", "num_speculative_tokens": 2, "backoff": "per_sequence", "round_cost": 0.5}')
    assert (s.backoff, s.round_cost) == ("per_sequence", 0.5)
    s = parse('{"model": "/models/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}')
    assert s.draft_tensor_parallel_size == 1  # the draft whole on rank 0 (the only value taken)
    assert s.quantization is None
    assert parse('{"model": "d", "num_speculative_tokens": 4, "quantization": "fp8"}').quantization == "fp8"


def test_custom_all_reduce_is_on_by_default_and_the_flag_turns_it_off():
    """--disable-custom-all-reduce (vLLM's flag and default; models/parallel/symm_all_reduce.py): the
    one-shot for what it serves unless the flag says NCCL's, and what the flag says reaches
    EngineConfig, which every tensor-parallel rank's Start carries."""
    from server.cli import config_from_args

    def parse(*argv):
        return config_from_args(build_parser().parse_args(list(argv))).disable_custom_all_reduce

    assert parse() is False and parse("--no-disable-custom-all-reduce") is False
    assert parse("--disable-custom-all-reduce") is True


def test_auto_tool_choice_needs_a_parser(capsys):
    from server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--enable-auto-tool-choice"])
    assert e.value.code == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    args = build_parser().parse_args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                      "--reasoning-parser", "qwen3"])
    tools = ServerLimits.from_args(args).tools
    assert (tools.parser, tools.auto, tools.reasoning) == ("hermes", True, "qwen3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "nope"])
