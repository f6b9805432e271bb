#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of the embedded model.

GPT-2 style: ByteLevel pre-tokenizer (no prefix space), ByteLevel decoder, and a
single special token ``<|endoftext|>`` that serves as bos, eos, unk (and pad).
Writes ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` so that ``AutoTokenizer.from_pretrained(dir)`` loads
it as a fast tokenizer.

    python tools/embedded/train_tokenizer.py --corpus .corpus/corpus.txt --out models/embedded
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
SEPARATOR = f"\n{EOT}\n"


def read_documents(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [d for d in text.rstrip("\n").split(SEPARATOR) if d]


def train(docs: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def save(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    # Write the two small config files explicitly so that their contents do not
    # depend on the installed transformers version.
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    eot_id = tok.token_to_id(EOT)
    config = {
        "tokenizer_class": "GPT2TokenizerFast",
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        **special,
        "added_tokens_decoder": {
            str(eot_id): {
                "content": EOT, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    # save_pretrained rewrites tokenizer.json through the wrapper; save the raw
    # trained tokenizer instead so the file is exactly what `tokenizers` produced.
    tok.save(str(out / "tokenizer.json"))


def check(out: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(out))
    assert t.is_fast, type(t)
    samples = [
        "Return a new list containing the items of the iterable.",
        "naïve café – 東京",
        "  leading spaces, tabs\tand\nnewlines \u00e9\u0301 \U0001F600",
        EOT + "Hello" + EOT,
    ]
    for s in samples:
        ids = t(s)["input_ids"]
        back = t.decode(ids)
        assert back == s, (s, back)
    eot = t.convert_tokens_to_ids(EOT)
    assert t.bos_token_id == t.eos_token_id == t.unk_token_id == eot, (t.bos_token_id, t.eos_token_id, t.unk_token_id)
    assert t(EOT)["input_ids"] == [eot]
    print(f"ok: {type(t).__name__}, vocab {len(t)}, eot id {eot}, "
          f"'naïve café – 東京' -> {t.tokenize('naïve café – 東京')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=".corpus/corpus.txt")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--model-max-length", type=int, default=1024)
    args = ap.parse_args(argv)

    docs = read_documents(Path(args.corpus))
    tok = train(docs, args.vocab_size, args.min_frequency)
    out = Path(args.out)
    save(tok, out, args.model_max_length)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    n_chars = sum(len(d) for d in docs)
    print(f"trained on {len(docs)} documents, {n_chars} chars -> {n_tokens} tokens "
          f"({n_chars / n_tokens:.2f} chars/token), vocab {tok.get_vocab_size()}")
    check(out)


if __name__ == "__main__":
    main()
