"""Incremental detokenization and stop-string handling.

Byte-level BPE tokens need not end on a character boundary, so new text is the difference between
decoding a short window of tokens with and without the newest ones, held back while it ends in a
partial character (U+FFFD). Re-decoding only the window keeps each step O(window), not O(length).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from server.sequence import Sequence

_WINDOW = 6  # tokens of left context; enough for any multi-token character


def detokenize_step(tokenizer: PreTrainedTokenizerBase, seq: Sequence, final: bool = False) -> str:
    """Append the text of newly generated tokens to seq.text and return the new piece. On the
    final step a trailing partial character is emitted as it is (as U+FFFD)."""
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    new = full[len(prefix) :]
    seq.read_offset = len(ids)
    seq.prefix_offset = max(0, seq.read_offset - _WINDOW)
    seq.text += new
    return new


def find_stop(text: str, new_len: int, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts, searching only where the newest piece could
    have completed one; None if there is none."""
    best = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
