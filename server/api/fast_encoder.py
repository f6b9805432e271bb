"""fastokens as the API process's prompt encoder, trusted only after it agrees with the tokenizer.

Every prompt is tokenized on the HTTP side, and a prefix-aware router has each replica tokenize each
request once more before it routes it (server/api/render.py): with the `tokenizers` library a
2,000-character prompt took ~0.85 ms on a 2-core CPU, and on a loaded GPU host a router's render
was about a millisecond slower than it was without the tokenizing. fastokens (the BPE encoder
vLLM offers as a tokenizer mode, and which vllm-router links) reads the same tokenizer.json and took
~0.04 ms for it (~20x less at 2,000, 8,000 and 65,536 characters; benchmarks/scaleout/bench_scaleout.py
and docs/deploy.md measure what that is worth).

It implements most but not all of `tokenizers` (some normalizers and pre-tokenizers are missing), so
it is used only where it reproduces the tokenizer: `load` builds it from the tokenizer's fully
configured backend (`backend_tokenizer.to_str()`: added tokens, post-processor, BOS rules) and
encodes a probe set both ways, with and without special tokens: the set holds every special and added token
inside text, whitespace runs, digits, code, several scripts and emoji, and a few hundred random
strings of all of those. One difference and the tokenizer's own encoder is used (`--tokenizer-backend
auto`, the default, logs why; `fastokens` refuses to start). Decoding stays with the tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from dataclasses import dataclass

log = logging.getLogger("flashpage.api")

BACKENDS = ("auto", "fastokens", "hf")
PROBES = 300  # random probe strings, on top of the fixed ones
LONG_PROBES = 2  # random probe strings of 8,000 pieces (~30,000 characters)
MAX_TOKENS = 256  # added tokens probed at most (a random sample beyond, the special ones always)
_PIECES = ["the", " quick", " brown", "fox", "Hello", " world", "I'm", " don't", "we'll", "ABC", "xYz", "a",
           "0", "7", "42", "1234", "3.14159", "1,000,000", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ",
           ".", ",", "!", "?", "...", "--", "'", '"', "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\", "#", "@",
           "$", "%", "^", "&", "*", "_", "=", "+", "|", "~", "`", "def f(x):\n    return x", "if (a && b) {",
           "naïve", "café", "Straße", "ÆØÅ", "e\u0301", "東京", "日本語", "한국어", "Привет", "مرحبا", "नमस्ते",
           "🙂", "👍🏽", "👨\u200d👩\u200d👧", "\u200b", "\u00a0", "\ufeff", "ﬁ", "①", "ⅷ"]
_FIXED = ["", " ", "\n", "a", "Hello, world!", "   leading and trailing   ", "line one\nline two\n\n\nend",
          "tabs\tand\ttabs", "digits 0123456789 and 12345678901234567890", "MiXeD CaSe WoRdS",
          "emoji 🙂🙂🙂 and 東京 in one", "x" * 300, " " * 64, "ab" * 150, "<|endoftext|>", "</s><s>"]


@dataclass(frozen=True)
class FastEncoder:
    """fastokens' encoder for one tokenizer, checked against it."""
    fast: object  # fastokens.Tokenizer
    split_special_tokens: bool

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(self.fast.encode(t, add_special_tokens=add_special_tokens,
                                      split_special_tokens=self.split_special_tokens).ids) for t in texts]


def probe_texts(tokenizer, seed: int = 0) -> list[str]:
    """What `load` encodes both ways: the fixed strings, special and added tokens inside text (all
    of them, or MAX_TOKENS of them where a tokenizer has more: each costs three probes at start),
    PROBES random strings of pieces and tokens, and LONG_PROBES of tens of thousands of characters
    (a truncation length, a limit on a word's or a run's length)."""
    rng = random.Random(seed)
    tokens = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
                    | set(getattr(tokenizer, "all_special_tokens", [])))
    if len(tokens) > MAX_TOKENS:
        tokens = sorted(set(getattr(tokenizer, "all_special_tokens", [])) | set(rng.sample(tokens, MAX_TOKENS)))
    out = list(_FIXED)
    out += [f"{t}" for t in tokens] + [f"before {t} after" for t in tokens] + [f"{t}{t}\n{t}x" for t in tokens]
    pieces = _PIECES + tokens
    for _ in range(PROBES):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))))
    for _ in range(LONG_PROBES):
        out.append("".join(rng.choice(pieces) for _ in range(8000)))
    out += ["a" * 20000, "7" * 5000, " " * 5000 + "x", "\n" * 3000]
    return out


def load(tokenizer, backend: str) -> FastEncoder | None:
    """A FastEncoder for `tokenizer` where `backend` allows one and it agrees on every probe text;
    None for the tokenizer's own encoder. `backend` "fastokens" raises where it cannot be used."""
    if backend == "hf":
        return None
    try:
        config = tokenizer.backend_tokenizer.to_str()
        key = (type(tokenizer).__name__, hashlib.sha256(config.encode()).hexdigest(),
               bool(getattr(tokenizer, "split_special_tokens", False)))
        verdict = _verdicts.get(key)
        if verdict is None:
            verdict = _verdicts[key] = _check(tokenizer, config)
    except Exception as e:  # no backend_tokenizer: a tokenizer that is not the tokenizers library's
        verdict = f"{type(e).__name__}: {e}"
    if isinstance(verdict, FastEncoder):
        log.info("prompts are encoded by fastokens (it encoded every probe text as the tokenizer does)")
        return verdict
    if backend == "fastokens":
        raise RuntimeError(f"--tokenizer-backend fastokens: cannot be used for this tokenizer: {verdict}")
    log.info("prompts are encoded by the tokenizer's own encoder, not fastokens: %s", verdict)
    return None


# A verdict per tokenizer configuration (class, tokenizer.json's digest, split_special_tokens): a FastEncoder, or
# why not. Every app of a process (tests make many) would otherwise probe again (~0.2 s on a 2-core CPU).
_verdicts: dict[tuple[str, str, bool], FastEncoder | str] = {}


def _check(tokenizer, config: str) -> FastEncoder | str:
    """A FastEncoder built from `config` that encodes every probe text as `tokenizer` does, or why not."""
    try:
        import fastokens

        fast = fastokens.Tokenizer.from_json_str(config)
        # tokenizer.json may carry a truncation length and padding, which transformers switches off
        # on every encode call: fastokens would otherwise cut prompts longer than every probe.
        fast.no_truncation()
        fast.no_padding()
        enc = FastEncoder(fast, bool(getattr(tokenizer, "split_special_tokens", False)))
        with _quiet_transformers():  # the long probes would log "longer than the model's maximum"
            for text in probe_texts(tokenizer):
                for special in (True, False):
                    want = tokenizer.encode(text, add_special_tokens=special,
                                            split_special_tokens=enc.split_special_tokens)
                    if enc.encode([text], special)[0] != want:
                        return f"it encodes {text[:40]!r} (add_special_tokens={special}) differently"
    except BaseException as e:  # not installed, a tokenizer.json it cannot read, a Rust panic (pyo3's)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {e}"
    return enc


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
