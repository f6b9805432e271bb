"""What scoring a long prompt (`prompt_logprobs`) costs the engine's loop, through its Python API.

Issue 44: a ~12.5k-token prompt with `prompt_logprobs: 20` held the engine's loop 128-533 ms while
the worker and the engine built a list of tuples per prompt position (and the engine process's
outbox encoded them). Here decodes run while such a prompt arrives, and per round this records
every `engine.step()`'s wall time over the steps until the prompt's first output, the longest gap
between two tokens of the running decodes in that window, and what the prompt's output costs on the
pipe (its MessagePack bytes and encode time, as the engine process's outbox sends it): with
`prompt_logprobs` 20 and, as the baseline, the same prompt unscored. Medians over `--rounds`.

    python -m benchmarks.engine.bench_prompt_scores --label NEW_COMMIT

writes benchmarks/results/experiments/prompt_scores_<label>_<gpu>.json (an A/B experiment: nothing
renders it). Written so that an older tree runs it too (its outputs carried lists): copy this file
into that tree's benchmarks/engine/ and run it there with `--label OLD_COMMIT`. `--device cpu
--shape tiny --prompt-len 2000` checks the script itself on a CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from benchmarks.shared.checkpoint import make_random_llama
from benchmarks.shared.common import gpu_run_info, write_result
from server.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

SHAPES = {  # qwen2.5-0.5b: a 151,936-token vocabulary, so the LM head over every prompt position costs too
    "qwen2.5-0.5b": "qwen2.5-0.5b",
    "tiny": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
}


def one_round(engine: LLMEngine, prompt: list[int], scored: int | None, decodes: int, seed: int) -> dict:
    """Decodes running, then the prompt; steps until its first output (and the decodes to their end)."""
    rng = random.Random(seed)
    for i in range(decodes):
        engine.add_request(f"d{seed}-{i}", [rng.randrange(1000) for _ in range(32)],
                           SamplingParams(max_tokens=engine.max_model_len - 32, temperature=0, ignore_eos=True))
    last_token = {}  # each decode's latest token's time
    for _ in range(8):  # the decodes are decoding
        for out in engine.step():
            last_token[out.request_id] = time.perf_counter()
    rid = f"p{seed}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=scored))
    steps, gaps, first = [], [], None
    while first is None:
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - t0)
        for out in outs:
            if out.request_id == rid:
                first = out
            elif out.request_id in last_token:
                gaps.append(now - last_token[out.request_id])
            last_token[out.request_id] = now
    for i in range(decodes):
        engine.abort_request(f"d{seed}-{i}")
    while engine.has_unfinished():
        engine.step()
    t0 = time.perf_counter()
    wire = msgspec.msgpack.encode(first)  # as the outbox encodes it (server/bridge/messages.py)
    encode_s = time.perf_counter() - t0
    return dict(step_max_s=max(steps), steps_s=sum(steps), steps=len(steps), decode_gap_max_s=max(gaps, default=0.0),
                output_bytes=len(wire), encode_s=encode_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=12_500)
    p.add_argument("--prompt-logprobs", type=int, default=20)
    p.add_argument("--decodes", type=int, default=16, help="requests decoding while the prompt comes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default="", help="which tree this is (a commit), for the result's rows")
    p.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default="benchmarks/results/experiments")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_llama(Path(tmp) / "ckpt", SHAPES[args.shape], device=args.device)
        engine = LLMEngine(EngineConfig(model=str(path), device=args.device, max_model_len=args.prompt_len + 512,
                                        max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS))  # the server's budget
        prompt = [random.Random(1).randrange(1000, 100_000) for _ in range(args.prompt_len)]
        rows = []
        for scored in (None, args.prompt_logprobs, None, args.prompt_logprobs):  # warm-up pair first
            runs = [one_round(engine, prompt, scored, args.decodes, seed) for seed in range(args.rounds)]
            rows.append(dict(label=args.label, prompt_logprobs=scored, prompt_len=args.prompt_len,
                             decodes=args.decodes, rounds=args.rounds,
                             **{k: statistics.median(r[k] for r in runs) for k in runs[0]}))
        engine.close()
    rows = rows[2:]  # the measured pair
    for r in rows:
        print(f"prompt_logprobs={r['prompt_logprobs']}: longest step {r['step_max_s'] * 1e3:.1f} ms, "
              f"{r['steps']} steps {r['steps_s'] * 1e3:.1f} ms, longest decode gap {r['decode_gap_max_s'] * 1e3:.1f} ms, "
              f"output {r['output_bytes'] / 1e6:.2f} MB encoded in {r['encode_s'] * 1e3:.1f} ms", file=sys.stderr)
    if args.device != "cuda":  # a check of the script: nothing to keep
        return
    result = {**gpu_run_info("benchmarks.engine.bench_prompt_scores", argv), "shape": args.shape, "rows": rows}
    print(write_result(result, args.out_dir, "prompt_scores" + (f"_{args.label}" if args.label else "")))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
