#!/usr/bin/env python3
"""How often speculative decoding's proposals stand for the embedded model on held-out docstrings:
the n-gram method, the distilled draft (train_draft.py) and the EAGLE-3 head (train_eagle3.py), each
alone, greedy, on the CPU.

Prompts are the first `--prompt-tokens` tokens of the validation split's documents (prepare_data.py
holds them out of both models' training), continued `--max-tokens` greedy tokens. Each method runs
with its back-off off (per_sequence, min_acceptance 0: every step proposes, so the rates are the proposer's own),
and its tokens are checked against decoding without speculation. Written to
benchmarks/results/embedded_draft_acceptance.json: per method, verifications, proposals, accepted
proposals, acceptance rate, mean accepted length (1 + accepted / verifications, vLLM's), acceptance
by position, and the wall time beside decoding without speculation (CPU, indicative only).
`--methods` runs some of them (decoding without speculation always: the tokens to check against);
`--merge` keeps the file's rows of the others, the new rows carrying their own date and command.

    python tools/embedded/measure_acceptance.py --data-dir .corpus --draft models/embedded-draft
    python tools/embedded/measure_acceptance.py --data-dir .corpus --methods eagle3 --merge
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


# --methods' names -> (the row's method, its speculative config); decoding without speculation always runs
METHODS = {
    "ngram13": ("ngram (prompt_lookup 1-3)", lambda a: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    "ngram5": ("ngram (vLLM's default lookup, 5)", lambda a: {"method": "ngram"}),
    "draft": ("draft_model (models/embedded-draft)", lambda a: {"method": "draft_model", "model": a.draft}),
    "eagle3": ("eagle3 (models/embedded-eagle3)", lambda a: {"method": "eagle3", "model": a.eagle3}),
}


def held_out_prompts(data_dir: Path, eot: int, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` validation documents at least twice that long."""
    val = np.fromfile(data_dir / "val.bin", dtype=np.uint16).astype(np.int64)
    docs = np.split(val, np.flatnonzero(val == eot) + 1)
    out = [d[:length].tolist() for d in docs if len(d) >= 2 * length]
    return out[:n]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=".corpus")
    ap.add_argument("--draft", default=str(ROOT / "models" / "embedded-draft"))
    ap.add_argument("--eagle3", default=str(ROOT / "models" / "embedded-eagle3"))
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--merge", action="store_true", help="keep the out file's rows of the methods not run")
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "embedded_draft_acceptance.json"))
    args = ap.parse_args(argv)
    import torch

    from server.config import EngineConfig, SpeculativeConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    torch.set_num_threads(2)
    k = args.num_speculative_tokens
    methods = {"none": None, **{METHODS[m][0]: METHODS[m][1](args) for m in args.methods}}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = None
    import triton

    result = {"date": datetime.date.today().isoformat(), "device": "cpu", "torch": torch.__version__.split("+")[0],
              "triton": triton.__version__,
              "command": "python tools/embedded/measure_acceptance.py " + " ".join(argv or sys.argv[1:]),
              "k": k, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rows": []}
    ref = None
    for name, spec in methods.items():
        cfg = None
        if spec is not None:
            cfg = SpeculativeConfig.parse(json.dumps({**spec, "num_speculative_tokens": k, "min_acceptance": 0,
                                                      "backoff": "per_sequence",
                                                      "disable_by_batch_size": 1024}))
        engine = LLMEngine(EngineConfig(device="cpu", speculative_config=cfg, num_blocks=1024, log_stats_interval=0))
        if prompts is None:
            prompts = held_out_prompts(Path(args.data_dir), engine.tokenizer.eos_token_id, args.documents,
                                       args.prompt_tokens)
            result["documents"] = len(prompts)
        t0 = time.perf_counter()
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        wall = time.perf_counter() - t0
        row = {"impl": "flashpage", "method": name, "wall_s": round(wall, 2)}
        if ref is None:
            ref = outs
        else:
            c = engine.speculator.counters
            row.update(identical_to_no_speculation=outs == ref, verifications=c.drafts, proposed=c.draft_tokens,
                       accepted=c.accepted_tokens, acceptance_rate=round(c.accepted_tokens / max(c.draft_tokens, 1), 4),
                       mean_accepted_length=round(1 + c.accepted_tokens / max(c.drafts, 1), 3),
                       accepted_by_position=[round(n / max(c.drafts, 1), 4) for n in c.accepted_per_pos])
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        engine.close()
    if args.merge and Path(args.out).exists():  # the file's rows, these in place of their method's (or added)
        old = json.loads(Path(args.out).read_text())
        none, *ran = result["rows"]  # (the file keeps its own run without speculation)
        new = {r["method"]: {**r, "date": result["date"], "command": result["command"],
                             "wall_s_without_speculation": none["wall_s"]} for r in ran}
        rows = [new.pop(r["method"], r) for r in old["rows"]]
        result = {**old, "rows": rows + list(new.values())}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
