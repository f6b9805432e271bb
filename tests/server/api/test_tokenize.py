"""server/api/tokenize.py: prompts up to INLINE_CHARS (a chat-sized system prompt) are tokenized on
the event loop, longer text in a worker thread, and both give what `tokenizer.encode` gives; a
prompt encoded lately is remembered, within the memo's bounds.
(tests/server/api/test_adversarial.py checks that long prompts never stall the loop.)"""

import asyncio

import pytest
from transformers import AutoTokenizer

from models import EMBEDDED_MODEL
from server.api import tokenize

WORDS = "the of and to in is was for on that with as by at from naïve café 東京 🙂 \n".split(" ")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL))


@pytest.fixture(autouse=True)
def _forget():
    tokenize._memos.clear()  # each test starts with nothing remembered
    tokenize._warned[0] = False
    yield


class Counting:
    """A tokenizer that counts the texts it is asked to encode (as a batch: how encode calls it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, []

    def __call__(self, texts, add_special_tokens=True):
        self.texts.extend(texts)
        return self.tokenizer(texts, add_special_tokens=add_special_tokens)


def _text(chars: int) -> str:
    out = []
    while sum(map(len, out)) + len(out) < chars:
        out.append(WORDS[len(out) % len(WORDS)])
    return " ".join(out)[:chars]


def _encode(tokenizer, texts, monkeypatch) -> tuple[list[list[int]], int]:
    """encode's ids, and how many times it handed work to a thread."""
    threads = []
    real = asyncio.to_thread

    async def counting(fn, *args):
        threads.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(tokenize.asyncio, "to_thread", counting)
    return asyncio.run(tokenize.encode(tokenizer, texts)), len(threads)


def test_a_system_prompt_sized_text_is_tokenized_inline(tokenizer, monkeypatch):
    # ~3,000 characters: a 512-1,024-token system prompt, what a prefix-aware router renders on
    # every replica before each request
    text = _text(3000)
    ids, threads = _encode(tokenizer, [text], monkeypatch)
    assert ids == [tokenizer.encode(text)] and threads == 0
    at_limit = _text(tokenize.INLINE_CHARS)
    assert _encode(tokenizer, [at_limit], monkeypatch) == ([tokenizer.encode(at_limit)], 0)


def test_longer_text_is_tokenized_in_a_thread(tokenizer, monkeypatch):
    texts = [_text(tokenize.INLINE_CHARS // 2 + 1), _text(tokenize.INLINE_CHARS // 2 + 7), ""]  # together past it
    ids, threads = _encode(tokenizer, texts, monkeypatch)
    assert ids == [tokenizer.encode(t) for t in texts] and threads == 1


def test_a_prompt_encoded_again_is_remembered(tokenizer, monkeypatch):
    tok = Counting(tokenizer)
    short, long = _text(3000), _text(tokenize.INLINE_CHARS + 100)
    first, threads = _encode(tok, [short, long], monkeypatch)
    assert first == [tokenizer.encode(short), tokenizer.encode(long)] and threads == 1
    assert tok.texts == [short, long]
    first[0].append(-1)  # what a caller does with its ids is its own
    again, threads = _encode(tok, [long, short], monkeypatch)
    assert again == [tokenizer.encode(long), tokenizer.encode(short)] and threads == 0
    assert tok.texts == [short, long]  # nothing encoded the second time
    other = _text(500)
    mixed, _ = _encode(tok, [short, other, long], monkeypatch)
    assert mixed == [tokenizer.encode(t) for t in (short, other, long)] and tok.texts[2:] == [other]
    # without special tokens is another prompt (POST /tokenize may ask for it)
    bare = asyncio.run(tokenize.encode(tok, [short], add_special_tokens=False))
    assert bare == [tokenizer.encode(short, add_special_tokens=False)] and tok.texts[3:] == [short]


def test_the_memo_keeps_the_latest_within_its_bounds(monkeypatch):
    monkeypatch.setattr(tokenize, "MEMO_PROMPTS", 3)
    monkeypatch.setattr(tokenize, "MEMO_UNITS", 20)  # ids and key characters
    memo = tokenize.IdsMemo()
    for key, n in (("a", 2), ("b", 2), ("c", 2)):
        memo.put(key, list(range(n)), 1)
    assert memo.get("a") == [0, 1]  # "a" is now the newest
    memo.put("d", [7], 1)  # four prompts: the oldest, "b", goes
    assert memo.get("b") is None and memo.get("a") == [0, 1] and memo.get("d") == [7]
    memo.put("e", list(range(6)), 6)  # c, a, d, e: 3 + 3 + 2 + 12 units > 20, so the oldest, "c", goes
    assert list(memo.ids) == ["a", "d", "e"] and memo.total == 17
    memo.put("f", list(range(11)), 10)  # more than the memo holds at all: not kept, nothing evicted
    assert memo.get("f") is None and list(memo.ids) == ["a", "d", "e"]
    memo.put("d", [8], 1)  # kept as first given
    assert memo.get("d") == [7]


def test_the_memo_forgets_after_its_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tokenize.time, "monotonic", lambda: now[0])
    memo = tokenize.IdsMemo()
    memo.put("chat", [1, 2, 3], 10)
    now[0] += tokenize.MEMO_TTL_S - 0.01
    assert memo.get("chat") == [1, 2, 3]  # asked often or not, an entry lives MEMO_TTL_S from its put
    now[0] += 0.02
    assert memo.get("chat") is None and memo.total == 0 and not memo.ids


@pytest.fixture()
def fast(tokenizer):
    assert tokenize.use_backend(tokenizer, "auto") == "fastokens"
    yield tokenizer
    tokenize._fast.clear()  # the module's other tests use the tokenizer's own encoder


def test_fastokens_encodes_inline_and_a_failure_falls_back_to_the_tokenizer(fast, monkeypatch, caplog):
    long = _text(tokenize.INLINE_CHARS * 4)  # past the tokenizer's inline bound, within fastokens'
    ids, threads = _encode(fast, [long], monkeypatch)
    assert ids == [fast.encode(long)] and threads == 0
    huge = [_text(tokenize.FAST_INLINE_CHARS // 2 + 1), _text(tokenize.FAST_INLINE_CHARS // 2 + 3)]
    ids, threads = _encode(fast, huge, monkeypatch)
    assert ids == [fast.encode(t) for t in huge] and threads == 1

    class Panicking:  # pyo3 turns a Rust panic into a BaseException
        def encode(self, texts, special):
            raise BaseException("fastokens panicked")

    monkeypatch.setitem(tokenize._fast, fast, Panicking())
    short, longer = _text(777), _text(tokenize.INLINE_CHARS + 5)
    ids, threads = _encode(fast, [short], monkeypatch)
    assert ids == [fast.encode(short)] and threads == 0 and "fastokens failed on a prompt" in caplog.text
    # the tokenizer's own encoder takes over by its own bound: off the loop past INLINE_CHARS
    ids, threads = _encode(fast, [longer], monkeypatch)
    assert ids == [fast.encode(longer)] and threads == 1  # fastokens' attempt inline, then the tokenizer's
    assert tokenize.encode_now(fast, [short]) == [fast.encode(short)]
