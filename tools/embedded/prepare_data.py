#!/usr/bin/env python3
"""Tokenize the corpus into compact train/validation token streams.

Documents are shuffled with a fixed seed, a fraction of them is held out for
validation, and each split is written as a flat stream of uint16 token ids in
which every document is followed by ``<|endoftext|>``:

    .corpus/train.bin, .corpus/val.bin, .corpus/data.meta.json

    python tools/embedded/prepare_data.py --corpus .corpus/corpus.txt --tokenizer models/embedded
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

EOT = "<|endoftext|>"
SEPARATOR = f"\n{EOT}\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=".corpus/corpus.txt")
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--out-dir", default=".corpus")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)

    text = Path(args.corpus).read_text(encoding="utf-8")
    docs = [d for d in text.rstrip("\n").split(SEPARATOR) if d]
    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    assert tok.get_vocab_size() <= 65535

    order = list(range(len(docs)))
    random.Random(args.seed).shuffle(order)
    n_val = max(1, round(len(docs) * args.val_fraction))
    # Keep the shuffled order inside each split so that related docstrings of
    # one module are not all adjacent in the training stream.
    splits = {"val": order[:n_val], "train": order[n_val:]}

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "corpus": str(args.corpus),
        "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokenizer_sha256": hashlib.sha256((Path(args.tokenizer) / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot,
        "seed": args.seed,
        "val_fraction": args.val_fraction,
        "dtype": "uint16",
    }
    for name, idx in splits.items():
        enc = tok.encode_batch([docs[i] for i in idx], add_special_tokens=False)
        ids: list[int] = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.uint16)
        arr.tofile(out / f"{name}.bin")
        meta[name] = {
            "documents": len(idx),
            "characters": sum(len(docs[i]) for i in idx),
            "tokens": int(arr.size),
        }
    (out / "data.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
