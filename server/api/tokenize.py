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
# What each process remembers (per tokenizer and kind of key): the last MEMO_PROMPTS prompts' ids,
# MEMO_IDS ids in all (a few MB of Python ints at most). A router's render and its request come
# milliseconds apart.
MEMO_PROMPTS = 256
MEMO_IDS = 1 << 19


class IdsMemo:
    """The token ids of the prompts prepared last (by any hashable key), newest last, within
    MEMO_PROMPTS and MEMO_IDS."""

    def __init__(self) -> None:
        self.ids: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.total = 0

    def get(self, key: Hashable) -> list[int] | None:
        ids = self.ids.get(key)
        if ids is None:
            return None
        self.ids.move_to_end(key)
        return list(ids)  # a copy: callers own what they are given

    def put(self, key: Hashable, ids: list[int]) -> None:
        if len(ids) > MEMO_IDS or key in self.ids:
            return
        self.ids[key] = list(ids)
        self.total += len(ids)
        while len(self.ids) > MEMO_PROMPTS or self.total > MEMO_IDS:
            self.total -= len(self.ids.popitem(last=False)[1])


_memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {kind: IdsMemo}
_fast: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> FastEncoder, where one is used


def memo_of(tokenizer, kind: str) -> IdsMemo:
    """This process's memo of `kind` ("prompt": encoded text; "chat": rendered conversations)."""
    kinds = _memos.get(tokenizer)
    if kinds is None:
        kinds = _memos[tokenizer] = {}
    return kinds.setdefault(kind, IdsMemo())


def use_backend(tokenizer, backend: str) -> str:
    """Choose how this process encodes `tokenizer`'s prompts (--tokenizer-backend: auto, fastokens,
    hf); the name of the encoder chosen. Until this is called, the tokenizer's own."""
    enc = fast_encoder.load(tokenizer, backend)
    if enc is None:
        _fast.pop(tokenizer, None)
        return "hf"
    _fast[tokenizer] = enc
    return "fastokens"


def encode_now(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """`encode` without the memo, blocking: fastokens where `use_backend` chose it (the tokenizer's
    own where it fails, e.g. on a regex resource limit hit by adversarial text), else the tokenizer's."""
    fast = _fast.get(tokenizer)
    if fast is not None:
        try:
            return fast.encode(texts, add_special_tokens)
        except Exception as e:
            log.warning("fastokens failed on a prompt (%s: %s); encoding it with the tokenizer", type(e).__name__,
                        clip(str(e)))
    # tokenizer(texts) encodes as tokenizer.encode(text) does, in one call.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


async def encode(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """The token ids of each text, as `tokenizer.encode(text, add_special_tokens=...)` gives them
    (with them by default, as every prompt route wants; POST /tokenize may ask for none)."""
    memo = memo_of(tokenizer, "prompt")
    out = [memo.get((t, add_special_tokens)) for t in texts]
    todo = [t for t, ids in zip(texts, out) if ids is None]
    if not todo:
        return out
    inline = FAST_INLINE_CHARS if tokenizer in _fast else INLINE_CHARS
    if sum(map(len, todo)) <= inline:
        fresh = encode_now(tokenizer, todo, add_special_tokens)
    else:
        fresh = await asyncio.to_thread(encode_now, tokenizer, todo, add_special_tokens)
    for t, ids in zip(todo, fresh):
        memo.put((t, add_special_tokens), ids)
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
