#!/usr/bin/env python3
"""Train an EAGLE-3 head for the embedded model (models/embedded/) on its tokenized docstring corpus,
saved in the published layout (models/eagle3.py) to models/embedded-eagle3/ (served with
--speculative-config '{"method": "eagle3", "model": "flashpage-embedded-eagle3", ...}').

The head (models/eagle3_reference.py, one Llama layer of the target's width, its token table the
target's) reads the target's residual stream entering blocks 1, 3 and 5 (of six: the default
2, L/2, L-3 collides at this depth) and predicts over the 4,096 tokens most frequent in the corpus
(94% of it; `d2t` maps them to the target's ids). Its LM head starts as the target's tied token
table at those rows. The loss is EAGLE-3's training-time test, unrolled `--depth` steps: step 0
pairs each position's target state with the next token, as the head's catch-up does; step s feeds
position p the head's own step s - 1 output at p - 1, and attends, as a chained proposal step
does, to the step-0 keys up to p - s and the keys the steps before gave its anchor (their diagonal).
Every step's prediction at p is scored against the target's next-token distribution at p + 1
(restricted to the draft vocabulary, renormalised), weighted 0.8^s. Seeded and step-based, like
train.py and train_draft.py; minutes on two CPU cores.

    python tools/embedded/prepare_data.py ...   # the corpus' train.bin / val.bin (see train.py)
    PYTHONUNBUFFERED=1 python tools/embedded/train_eagle3.py --data-dir .corpus
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools" / "embedded")]

from train_draft import load, optimize  # noqa: E402  (the draft's set-up and schedule)

LAYERS = [1, 3, 5]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=".corpus")
    ap.add_argument("--teacher", default=str(ROOT / "models" / "embedded"))
    ap.add_argument("--out-dir", default=str(ROOT / "models" / "embedded-eagle3"))
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--depth", type=int, default=3, help="training-time test steps")
    ap.add_argument("--block-size", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop early (said in the log) after this long")
    return ap.parse_args(argv)


def unrolled(head, embeds: torch.Tensor, fused: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's outputs before its norm [B, T, hidden] for steps 0..depth-1 (see the module):
    `embeds` [B, T, hidden] the tokens one ahead, `fused` [B, T, hidden] fc of the target's states."""
    from models.eagle3_reference import rotate

    m, a = head.midlayer, head.midlayer.self_attn
    assert a.kv == a.heads  # (no grouped K/V heads to repeat here)
    b, t, _ = embeds.shape
    pos = torch.arange(t)
    cos, sin = (c[:, None] for c in head.rotary(fused, pos[None].expand(b, t)))  # [B, 1, T, d]
    e = m.input_layernorm(embeds)
    keys, values, outs, states = [], [], [], fused
    for s in range(depth):
        h = m.hidden_norm(states)
        x = torch.cat([e, h], dim=-1)
        q, k, v = (proj(x).view(b, t, -1, a.d).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys.append(k)
        values.append(v)
        # step s at position p: the step-0 keys up to p - s, then each step r's key at p - s + r
        scores = [q @ keys[0].transpose(-1, -2) * a.d**-0.5]
        scores[0] = scores[0].masked_fill(pos[None, :] > pos[:, None] - s, float("-inf"))
        for r in range(1, s + 1):
            kr = keys[r].roll(s - r, dims=2)  # row p holds step r's key at p - (s - r)
            scores.append((q * kr).sum(-1, keepdim=True) * a.d**-0.5)
        w = torch.cat(scores, dim=-1).softmax(-1).nan_to_num(0.0)  # (rows p < s attend to nothing)
        o = w[..., :t] @ values[0]
        for r in range(1, s + 1):
            o = o + w[..., t + r - 1 : t + r] * values[r].roll(s - r, dims=2)
        x = states + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        out = x + m.mlp(m.post_attention_layernorm(x))
        outs.append(out)
        states = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # position p is fed the output at p - 1
    return outs


def batch(data: np.ndarray, starts, block: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([data[s : s + block + 2] for s in starts]).astype(np.int64))


def targets(teacher, x: torch.Tensor, draft_ids: torch.Tensor):
    """(the target's states at LAYERS for positions 0..T-1, its next-token log-distribution at
    positions 1..T over the draft vocabulary, renormalised) of tokens x [B, T + 2]."""
    out = teacher(input_ids=x[:, :-1], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[j][:, :-1] for j in LAYERS], dim=-1)
    return aux, out.logits[:, 1:, draft_ids].float().log_softmax(-1)


@torch.no_grad()
def agreement(head, teacher, data: np.ndarray, draft_ids: torch.Tensor, args, windows: int = 16) -> list[float]:
    """Per unrolled step: how often the head's choice is the target's greedy token, on held-out windows."""
    starts = np.linspace(0, len(data) - args.block_size - 3, windows).astype(int)
    x = batch(data, starts, args.block_size)
    aux, logp = targets(teacher, x, draft_ids)
    outs = unrolled(head, teacher.get_input_embeddings()(x[:, 1:-1]), head.fc(aux), args.depth)
    want = logp.argmax(-1)
    return [round(float((head.logits(o).argmax(-1) == want)[:, s:].float().mean()), 4) for s, o in enumerate(outs)]


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import LlamaConfig

    from models.eagle3_reference import Eagle3Reference, head_config, save_head

    train, val, teacher = load(args)
    draft_ids = torch.from_numpy(np.argsort(-np.bincount(train, minlength=teacher.config.vocab_size), kind="stable")
                                 [: args.draft_vocab].astype(np.int64)).sort().values
    config = head_config(teacher.config, args.draft_vocab, LAYERS, intermediate_size=args.intermediate_size)
    head = Eagle3Reference(LlamaConfig(**config))
    head.set_draft_vocabulary(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher.get_input_embeddings().weight[draft_ids])  # the target's tied head's rows
        for name, p in head.named_parameters():
            if p.dim() == 2 and name != "lm_head.weight":
                p.normal_(0, 0.02)
    embed = teacher.get_input_embeddings()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    weights = [0.8**s for s in range(args.depth)]
    log = {"args": vars(args), "params": sum(p.numel() for p in params), "layers": LAYERS, "evals": []}
    print(f"head: {log['params']:,} parameters; {len(train):,} training tokens; draft vocabulary {args.draft_vocab}")
    t0 = time.monotonic()
    step = 0
    for step in range(args.steps):
        x = batch(train, rng.integers(0, len(train) - args.block_size - 3, args.batch_size), args.block_size)
        with torch.no_grad():
            aux, logp = targets(teacher, x, draft_ids)
            e = embed(x[:, 1:-1])
        outs = unrolled(head, e, head.fc(aux), args.depth)
        losses = [-(logp[:, s:].exp() * head.logits(o)[:, s:].log_softmax(-1)).sum(-1).mean() for s, o in enumerate(outs)]
        optimize(opt, params, sum(w * x for w, x in zip(weights, losses)) / sum(weights), step, args)
        if step % 50 == 0 or step == args.steps - 1:
            ev = {"step": step, "loss": [round(v.item(), 4) for v in losses],
                  "greedy_agreement_by_step": agreement(head, teacher, val, draft_ids, args),
                  "seconds": round(time.monotonic() - t0, 1)}
            log["evals"].append(ev)
            print(json.dumps(ev), flush=True)
        if args.max_seconds is not None and time.monotonic() - t0 > args.max_seconds:
            log["stopped_early"] = f"after {step + 1} steps ({args.max_seconds} s deadline)"
            break
    log["steps_run"] = step + 1
    log["train_seconds"] = round(time.monotonic() - t0, 1)
    out = save_head(head, config, args.out_dir, torch.float16)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {out} ({log['train_seconds']} s)")


if __name__ == "__main__":
    main()
