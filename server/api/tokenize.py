"""Tokenizing prompts on the HTTP side without stalling the event loop.

Who encodes: fastokens where it encodes exactly as the tokenizer does (`use_backend`, at app
creation; server/api/fast_encoder.py), else the tokenizer (the `tokenizers` library). Decoding is
always the tokenizer's.

Where: a 65,536-character prompt took ~36 ms to tokenize with `tokenizers` on a 2-core CPU (~1.6 ms
with fastokens), and a /v1/completions body may carry up to MAX_CHOICES prompts: on the event loop,
every other client (and /health) would wait for it (issue 23: /health took 3.6-5.7 s beside one such
body). So long text goes to a worker thread (both libraries release the GIL while they work), as a
batch. Text up to INLINE_CHARS (FAST_INLINE_CHARS with fastokens), a few milliseconds of work at
most, stays inline: the hand-off costs ~0.35 ms more and, on a loop busy streaming, the worker
thread then waits for the GIL before its result is seen (measured on a 2-core CPU beside 8 streams:
a 1,500-2,800-character render took 6.7-7.3 ms at p50 through the thread, 4.1 ms inline; API
processes now switch every 0.5 ms, server/api/servers.py). Decoding (POST /detokenize, and token
strings for POST /tokenize: server/api/tokens.py) follows the same rule by id count.

Each process remembers the ids of the prompts it encoded last (`IdsMemo`): a prefix-aware router
renders every request on every replica (server/api/render.py) and then sends it to one of them, so
the replica that runs it is asked to encode the same text a second time, most often on the
connection, and so in the process, that rendered it (68 of 80 requests through vllm-router on two
CPU replicas of two API processes each).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable

from server.api import fast_encoder
from server.logs import clip

log = logging.getLogger("flashpage.api")

INLINE_CHARS = 8192
# With fastokens (server/api/fast_encoder.py) 65,536 characters took ~1.6 ms on a 2-core CPU: every
# prompt within the default --max-prompt-chars stays inline.
FAST_INLINE_CHARS = 65536
# Ids decoded inline: 2,000 decode in ~0.3 ms on a 2-core CPU (token strings in ~0.55 ms), about
# what the hand-off to a thread costs; a 1 MiB body can carry some 200,000 of them.
INLINE_IDS = 2048
# What each process remembers (per tokenizer and kind of key): the last MEMO_PROMPTS prompts, within
# MEMO_UNITS ids and key characters in all (at most ~10 MB of Python objects), for MEMO_TTL_S each:
# a router's render and its request come milliseconds apart, and a chat template may write today's
# date (Llama 3.x's do), so a conversation's ids are not kept long.
MEMO_PROMPTS = 256
MEMO_UNITS = 1 << 18
MEMO_TTL_S = 5.0


class IdsMemo:
    """The token ids of the prompts prepared last (by any hashable key), newest last, within
    MEMO_PROMPTS and MEMO_UNITS, each for MEMO_TTL_S from when it was put."""

    def __init__(self) -> None:
        self.ids: OrderedDict[Hashable, tuple[list[int], int, float]] = OrderedDict()  # key -> ids, units, put at
        self.total = 0

    def get(self, key: Hashable) -> list[int] | None:
        entry = self.ids.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[2] > MEMO_TTL_S:
            self.total -= self.ids.pop(key)[1]
            return None
        self.ids.move_to_end(key)
        return list(entry[0])  # a copy: callers own what they are given

    def put(self, key: Hashable, ids: list[int], chars: int) -> None:
        """Remember `ids` under `key`, whose text is `chars` characters long."""
        units = len(ids) + chars
        if units > MEMO_UNITS or key in self.ids:
            return
        self.ids[key] = (list(ids), units, time.monotonic())
        self.total += units
        while len(self.ids) > MEMO_PROMPTS or self.total > MEMO_UNITS:
            self.total -= self.ids.popitem(last=False)[1][1]


_memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {kind: IdsMemo}
_fast: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> FastEncoder, where one is used
_warned: list[bool] = [False]  # fastokens' first failure in this process is a warning, later ones debug lines


def memo_of(tokenizer, kind: str) -> IdsMemo:
    """This process's memo of `kind` ("prompt": encoded text; "chat": rendered conversations)."""
    kinds = _memos.get(tokenizer)
    if kinds is None:
        kinds = _memos[tokenizer] = {}
    memo = kinds.get(kind)
    if memo is None:
        memo = kinds[kind] = IdsMemo()
    return memo


def use_backend(tokenizer, backend: str) -> str:
    """Choose how this process encodes `tokenizer`'s prompts (--tokenizer-backend: auto, fastokens,
    hf); the name of the encoder chosen. Until this is called, the tokenizer's own."""
    enc = fast_encoder.load(tokenizer, backend)
    if enc is None:
        _fast.pop(tokenizer, None)
        return "hf"
    _fast[tokenizer] = enc
    return "fastokens"


def _fast_ids(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]] | None:
    """fastokens' ids where `use_backend` chose it and it does not fail; else None."""
    fast = _fast.get(tokenizer)
    if fast is None:
        return None
    try:
        return fast.encode(texts, add_special_tokens)
    except BaseException as e:  # a Rust panic is pyo3's PanicException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        # e.g. a regex resource limit hit by adversarial text: the tokenizer's own encoder takes it
        (log.debug if _warned[0] else log.warning)(
            "fastokens failed on a prompt (%s: %s); it is encoded by the tokenizer", type(e).__name__, clip(str(e)))
        _warned[0] = True
        return None


def _tokenizer_ids(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    # tokenizer(texts) encodes as tokenizer.encode(text) does, in one call.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def encode_now(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """`encode` without the memo, blocking: fastokens where `use_backend` chose it (and it does not
    fail), else the tokenizer."""
    ids = _fast_ids(tokenizer, texts, add_special_tokens)
    return ids if ids is not None else _tokenizer_ids(tokenizer, texts, add_special_tokens)


async def encode(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """The token ids of each text, as `tokenizer.encode(text, add_special_tokens=...)` gives them
    (with them by default, as every prompt route wants; POST /tokenize may ask for none)."""
    memo = memo_of(tokenizer, "prompt")
    out = [memo.get((t, add_special_tokens)) for t in texts]
    todo = [t for t, ids in zip(texts, out) if ids is None]
    if not todo:
        return out
    chars, fresh = sum(map(len, todo)), None
    if tokenizer in _fast:
        fresh = (_fast_ids(tokenizer, todo, add_special_tokens) if chars <= FAST_INLINE_CHARS
                 else await asyncio.to_thread(_fast_ids, tokenizer, todo, add_special_tokens))
    if fresh is None:  # the tokenizer's own encoder, or fastokens failed: by the tokenizer's own bound
        fresh = (_tokenizer_ids(tokenizer, todo, add_special_tokens) if chars <= INLINE_CHARS
                 else await asyncio.to_thread(_tokenizer_ids, tokenizer, todo, add_special_tokens))
    for t, ids in zip(todo, fresh):
        memo.put((t, add_special_tokens), ids, len(t))
    made = iter(fresh)
    return [ids if ids is not None else next(made) for ids in out]


async def decode(tokenizer, ids: list[int]) -> str:
    """`tokenizer.decode(ids)`; every id must be in the tokenizer's vocabulary (the caller checks)."""
    if len(ids) <= INLINE_IDS:
        return tokenizer.decode(ids)
    return await asyncio.to_thread(tokenizer.decode, ids)


async def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each id's token as the vocabulary spells it (`convert_ids_to_tokens`: 'Ġfox', not ' fox')."""
    if len(ids) <= INLINE_IDS:
        return tokenizer.convert_ids_to_tokens(ids)
    return await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids)
