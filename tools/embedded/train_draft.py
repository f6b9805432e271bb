#!/usr/bin/env python3
"""Train the embedded model's speculative draft: a one-layer GPT-2 distilled from the embedded model
(models/embedded/) on the same tokenized docstring corpus, saved in Hugging Face format to
models/embedded-draft/ (served with --speculative-config '{"model": "models/embedded-draft", ...}').

The draft starts as the target cut to its first `--n-layer` layers (its embeddings, first block(s)
and final norm; the LM head is tied), which already agrees with it on many tokens, then distils: a
draft is judged by how often its greedy token is the target's, so the loss is the KL divergence from
the target's next-token distribution (the target runs in the same loop, no gradient) plus a little
cross-entropy on the data. One block of the target's six: a draft step costs a fraction of the
target's, and the fine-tune takes minutes on two CPU cores. Seeded and step-based, like train.py.

    python tools/embedded/prepare_data.py ...   # the corpus' train.bin / val.bin (see train.py)
    PYTHONUNBUFFERED=1 python tools/embedded/train_draft.py --data-dir .corpus --out-dir models/embedded-draft
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=".corpus")
    ap.add_argument("--teacher", default=str(ROOT / "models" / "embedded"))
    ap.add_argument("--out-dir", default=str(ROOT / "models" / "embedded-draft"))
    ap.add_argument("--n-layer", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--ce-weight", type=float, default=0.1, help="weight of the data's cross-entropy beside the KL")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop early (said in the log) after this long")
    return ap.parse_args(argv)


def lr_at(step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def load(args) -> tuple[np.ndarray, np.ndarray, torch.nn.Module]:
    """Seed and threads set, then (train tokens, held-out tokens, the frozen fp32 target) — what
    every draft trained here starts from (this script's, tools/embedded/train_eagle3.py's)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    data_dir = Path(args.data_dir)
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval().requires_grad_(False)
    return train, val, teacher


def optimize(opt: torch.optim.Optimizer, params, loss: torch.Tensor, step: int, args) -> None:
    """One optimizer step at the schedule's rate (lr_at), gradients clipped to norm 1."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, args)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def agreement(student, teacher, data: np.ndarray, block: int, windows: int = 16) -> dict:
    """Greedy agreement (the draft's argmax is the target's) and the KL on held-out windows."""
    student.eval()
    agree = total = 0
    kl = 0.0
    for s in np.linspace(0, len(data) - block - 2, windows).astype(int):
        x = torch.from_numpy(data[s: s + block].astype(np.int64))[None]
        t = teacher(input_ids=x).logits.float()
        q = student(input_ids=x).logits.float()
        agree += int((t.argmax(-1) == q.argmax(-1)).sum())
        total += x.numel()
        kl += float(F.kl_div(q.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="sum"))
    student.train()
    return {"greedy_agreement": agree / total, "kl_per_token": kl / total}


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    train, val, teacher = load(args)
    tc = teacher.config
    config = GPT2Config(vocab_size=tc.vocab_size, n_positions=tc.n_positions, n_embd=tc.n_embd,
                        n_layer=args.n_layer, n_head=tc.n_head, activation_function=tc.activation_function,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tc.bos_token_id,
                        eos_token_id=tc.eos_token_id, tie_word_embeddings=True)
    student = GPT2LMHeadModel(config)
    # the target's first n_layer blocks, embeddings and final norm (strict=False: the blocks past them)
    missing, _ = student.load_state_dict(teacher.state_dict(), strict=False)
    assert not [m for m in missing if "attn.bias" not in m and "masked_bias" not in m], missing
    n_params = sum(p.numel() for p in student.parameters())
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    log = {"args": vars(args), "params": n_params, "evals": []}
    print(f"draft: {n_params:,} parameters; teacher {sum(p.numel() for p in teacher.parameters()):,}; "
          f"{len(train):,} training tokens")
    t0 = time.monotonic()
    step = 0
    for step in range(args.steps):
        starts = rng.integers(0, len(train) - args.block_size - 1, args.batch_size)
        x = torch.from_numpy(np.stack([train[s: s + args.block_size + 1] for s in starts]).astype(np.int64))
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.no_grad():
            target = teacher(input_ids=inputs).logits.float().log_softmax(-1)
        logits = student(input_ids=inputs).logits.float()
        logq = logits.log_softmax(-1)
        kl = F.kl_div(logq, target, log_target=True, reduction="batchmean") / inputs.shape[1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimize(opt, student.parameters(), kl + args.ce_weight * ce, step, args)
        if step % 50 == 0 or step == args.steps - 1:
            ev = agreement(student, teacher, val, args.block_size)
            ev.update(step=step, kl=round(kl.item(), 4), ce=round(ce.item(), 4), seconds=round(time.monotonic() - t0, 1))
            log["evals"].append(ev)
            print(json.dumps(ev))
        if args.max_seconds is not None and time.monotonic() - t0 > args.max_seconds:
            log["stopped_early"] = f"after {step + 1} steps ({args.max_seconds} s deadline)"
            break
    log["steps_run"] = step + 1
    log["train_seconds"] = round(time.monotonic() - t0, 1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    student.to(torch.float16).save_pretrained(out, safe_serialization=True)  # (the target's tokenizer: no copy)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {out} ({log['train_seconds']} s)")


if __name__ == "__main__":
    main()
