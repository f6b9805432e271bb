#!/usr/bin/env python3
"""Train the embedded default model: a small GPT-2 (GPT2LMHeadModel) on the
tokenized Python-stdlib-docstring corpus.

Inputs (made by build_corpus.py, train_tokenizer.py and prepare_data.py):
    <data-dir>/train.bin, <data-dir>/val.bin   uint16 token streams
    <tokenizer-dir>/tokenizer.json ...          the byte-level BPE tokenizer

Outputs in --out-dir: config.json, model.safetensors, generation_config.json,
train_log.json.

Seeded and step-based (the learning-rate schedule depends only on the
arguments), bf16 autocast on CUDA, AdamW with linear warm-up and cosine decay,
evaluation on a held-out validation split.

    PYTHONUNBUFFERED=1 python tools/embedded/train.py --out-dir models/embedded
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
PROMPTS = ["The function returns", "Return a new", "This module provides"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=".corpus")
    ap.add_argument("--tokenizer-dir", default=str(HERE))
    ap.add_argument("--out-dir", default=str(HERE))
    # model
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-positions", type=int, default=1024)
    ap.add_argument("--dropout", type=float, default=0.2)
    # optimisation
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=float, default=60.0,
                    help="passes over the training tokens; sets the number of steps")
    ap.add_argument("--max-steps", type=int, default=None, help="override the number of steps (testing)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--train-eval-windows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save-dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="safety deadline: stop early (and say so in the log) after this much training time")
    ap.add_argument("--sample-tokens", type=int, default=40)
    return ap.parse_args(argv)


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


class Batches:
    """Epoch-wise random permutation of non-overlapping windows of block+1
    tokens, with a fresh random offset each epoch (seeded numpy Generator)."""

    def __init__(self, data: np.ndarray, block: int, batch: int, seed: int):
        self.data, self.block, self.batch = data, block, batch
        self.rng = np.random.default_rng(seed)
        self.queue: list[int] = []
        self.epoch = 0

    def _refill(self):
        offset = int(self.rng.integers(0, self.block))
        starts = np.arange(offset, len(self.data) - self.block - 1, self.block)
        self.queue = list(self.rng.permutation(starts))
        self.epoch += 1

    def next(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch):
            if not self.queue:
                self._refill()
            s = self.queue.pop()
            rows.append(self.data[s: s + self.block + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def windows(data: np.ndarray, block: int, limit: int | None = None) -> list[np.ndarray]:
    """Non-overlapping evaluation windows (deterministic), last one shorter."""
    out = []
    for s in range(0, len(data) - 1, block):
        w = data[s: s + block + 1]
        if len(w) >= 2:
            out.append(w)
    if limit is not None and len(out) > limit:
        idx = np.linspace(0, len(out) - 1, limit).round().astype(int)
        out = [out[i] for i in idx]
    return out


@torch.no_grad()
def evaluate(model, wins, device, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    for w in wins:
        t = torch.from_numpy(w.astype(np.int64)).to(device)[None]
        with autocast():
            logits = model(input_ids=t[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += t.size(1) - 1
    model.train()
    return total / count


def generate_samples(model, tok, device, n_tokens: int, seed: int):
    out = []
    model.eval()
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        g = model.generate(ids, max_new_tokens=n_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        torch.manual_seed(seed)
        s = model.generate(ids, max_new_tokens=n_tokens, do_sample=True, temperature=0.8, top_k=40,
                           pad_token_id=tok.eos_token_id)
        out.append({
            "prompt": prompt,
            "greedy": tok.decode(g[0], skip_special_tokens=False),
            "sampled(temperature=0.8,top_k=40,seed=%d)" % seed: tok.decode(s[0], skip_special_tokens=False),
        })
    return out


def main(argv=None):
    args = parse_args(argv)
    import transformers
    import tokenizers
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    data_dir = Path(args.data_dir)
    train_data = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    val_data = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    data_meta = json.loads((data_dir / "data.meta.json").read_text()) if (data_dir / "data.meta.json").exists() else {}
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")

    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        activation_function="gelu_new",
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config).to(device)
    try:
        model.set_attn_implementation("sdpa")
    except Exception:  # older transformers
        pass
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.block_size
    steps = args.max_steps or max(1, math.ceil(args.epochs * len(train_data) / tokens_per_step))
    print(f"device {device} | params {n_params:,} | train tokens {len(train_data):,} | val tokens {len(val_data):,} "
          f"| steps {steps} x {tokens_per_step} tokens ({steps * tokens_per_step / len(train_data):.1f} epochs)",
          flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2), fused=(device.type == "cuda"),
    )
    batches = Batches(train_data, args.block_size, args.batch_size, args.seed)
    val_wins = windows(val_data, args.block_size)
    train_wins = windows(train_data, args.block_size, limit=args.train_eval_windows)

    log = []
    run_loss, run_n = 0.0, 0
    t0 = time.time()
    stopped_early = False
    model.train()
    step = 0
    for step in range(steps):
        lr = lr_at(step, steps, args)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batches.next().to(device, non_blocking=True)
        with autocast():
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        run_loss += loss.item()
        run_n += 1
        last = step == steps - 1
        over = args.max_seconds is not None and time.time() - t0 > args.max_seconds
        if (step + 1) % args.eval_every == 0 or last or over or step == 0:
            val = evaluate(model, val_wins, device, autocast)
            tr = evaluate(model, train_wins, device, autocast)
            entry = {
                "step": step + 1,
                "tokens": (step + 1) * tokens_per_step,
                "epoch": round((step + 1) * tokens_per_step / len(train_data), 3),
                "lr": lr,
                "train_loss_running": run_loss / run_n,
                "train_loss": tr,
                "val_loss": val,
                "grad_norm": float(gnorm),
                "elapsed_s": round(time.time() - t0, 2),
            }
            log.append(entry)
            run_loss, run_n = 0.0, 0
            print(f"step {step + 1:5d}/{steps} | ep {entry['epoch']:6.2f} | lr {lr:.2e} | "
                  f"train(run) {entry['train_loss_running']:.4f} | train {tr:.4f} | val {val:.4f} | "
                  f"{entry['elapsed_s']:.0f}s", flush=True)
        if over and not last:
            stopped_early = True
            print(f"stopping early at step {step + 1}: --max-seconds {args.max_seconds} reached", flush=True)
            break
    train_time = time.time() - t0
    final = log[-1]

    samples = generate_samples(model, tok, device, args.sample_tokens, args.seed)
    for s in samples:
        for k, v in s.items():
            print(f"{k:>40}: {v!r}")

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_dtype = getattr(torch, args.save_dtype)
    model.generation_config.pad_token_id = eot
    model.generation_config.bos_token_id = eot
    model.generation_config.eos_token_id = eot
    model = model.to("cpu", dtype=save_dtype)
    model.config.dtype = args.save_dtype
    model.save_pretrained(str(out), safe_serialization=True)
    # Spell the dtype under both keys: transformers 5 reads "dtype", 4.x reads "torch_dtype".
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = args.save_dtype
    cfg["torch_dtype"] = args.save_dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    train_log = {
        "final": {
            "step": final["step"],
            "train_loss": final["train_loss"],
            "train_loss_running": final["train_loss_running"],
            "val_loss": final["val_loss"],
            "val_perplexity": math.exp(final["val_loss"]),
        },
        "best_val_loss": min(e["val_loss"] for e in log),
        "best_val_step": min(log, key=lambda e: e["val_loss"])["step"],
        "tokens_seen": final["step"] * tokens_per_step,
        "epochs_seen": final["step"] * tokens_per_step / len(train_data),
        "steps": final["step"],
        "planned_steps": steps,
        "stopped_early": stopped_early,
        "train_wall_time_s": round(train_time, 2),
        "parameters": n_params,
        "saved_dtype": args.save_dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "autocast": "bfloat16" if device.type == "cuda" else "none (float32)",
        "data": {"train_tokens": int(len(train_data)), "val_tokens": int(len(val_data)),
                 "train_eval_windows": len(train_wins), "val_windows": len(val_wins), **data_meta},
        "args": vars(args),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "samples": samples,
        "curve": log,
    }
    (out / "train_log.json").write_text(json.dumps(train_log, indent=2) + "\n")
    print(json.dumps({k: train_log[k] for k in ("final", "best_val_loss", "best_val_step", "tokens_seen",
                                                  "train_wall_time_s", "device")}, indent=2), flush=True)


if __name__ == "__main__":
    main()
