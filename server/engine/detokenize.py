"""Incremental detokenization.

Detokenizing is on the engine's critical path (every running request, every step), so for
byte-level BPE tokenizers (GPT-2's family) each token id maps through a precomputed table to its
bytes, and a per-request incremental UTF-8 decoder turns bytes into text: O(1) per token, and a
character split across tokens comes out whole once its last byte arrives. Other tokenizers fall
back to re-decoding a short window of tokens with and without the newest one.
"""

from __future__ import annotations

import codecs

from transformers import PreTrainedTokenizerBase

from server.engine.sequence import Sequence

_WINDOW = 6  # tokens of left context for the fallback; enough for any multi-token character


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes] | None:
    """Bytes of every token id (special tokens: empty, as skip_special_tokens does), or None if the
    tokenizer is not byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    table = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or tok is None:
            table.append(b"")
        elif all(c in byte_of for c in tok):
            table.append(bytes(byte_of[c] for c in tok))
        else:  # an added token stored as plain text
            table.append(tok.encode())
    return table


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.table = byte_table(tokenizer)
        # The text of each token whose bytes are whole UTF-8 characters (nearly all of them): with
        # no partial character pending, such a token needs no decoder call.
        self.text = [_whole_text(b) for b in self.table] if self.table is not None else None

    def step(self, seq: Sequence, final: bool = False) -> str:
        """Append the text of the newest token to seq.text and return the new piece. On the final
        step a trailing partial character is emitted as it is (as U+FFFD)."""
        new = self._fast(seq, final) if self.table is not None else self._window(seq, final)
        seq.text += new
        return new

    def _fast(self, seq: Sequence, final: bool) -> str:
        tok = seq.output_token_ids[-1]
        if tok >= len(self.table):
            return seq.utf8.decode(b"", final=final) if seq.utf8 is not None else ""
        if seq.utf8 is None:  # no partial character pending
            text = self.text[tok]
            if text is not None:
                return text
            seq.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        out = seq.utf8.decode(self.table[tok], final=final)
        if not seq.utf8.getstate()[0]:  # the pending character completed (or was replaced)
            seq.utf8 = None
        return out

    def _window(self, seq: Sequence, final: bool) -> str:
        ids = seq.output_token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        seq.read_offset = len(ids)
        seq.prefix_offset = max(0, seq.read_offset - _WINDOW)
        return full[len(prefix) :]
