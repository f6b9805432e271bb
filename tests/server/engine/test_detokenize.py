"""Incremental detokenization against the tokenizer's own decode, on the byte-level table path and
on the re-decoding fallback."""

import pytest
from transformers import AutoTokenizer

from server.engine.detokenize import Detokenizer, byte_table
from server.engine.sequence import Sequence
from server.engine.stop import find_stop, held_back
from server.sampling_params import SamplingParams

FFFD = "\ufffd"
TEXT = "naïve café – 東京 🙂"


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return AutoTokenizer.from_pretrained(tiny_ckpt)


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def detokenizer(tok, fallback):
    d = Detokenizer(tok)
    if fallback:
        d.table = d.text = None
    return d


def feed(detok, ids, final_last=False):
    s = Sequence("r", [1], SamplingParams())
    pieces = []
    for k, t in enumerate(ids):
        s.output_token_ids.append(t)
        pieces.append(detok.step(s, final=final_last and k == len(ids) - 1))
    assert s.text == "".join(pieces)
    return pieces


def partial_ids(tok, text):
    """The ids in text's encoding whose bytes are not whole UTF-8 characters."""
    table = byte_table(tok)
    out = []
    for t in tok.encode(text):
        try:
            table[t].decode("utf-8")
        except UnicodeDecodeError:
            out.append(t)
    return out


def byte_ids(tok, data):
    table = byte_table(tok)
    return [table.index(bytes([b])) for b in data]


def test_the_tokenizer_splits_characters_across_tokens(tok):
    # The premise of the tests below: without split characters they would prove little.
    assert byte_table(tok) is not None
    for text in ("🙂", "東京", "–"):
        assert partial_ids(tok, text), text
    assert partial_ids(tok, "🙂") == tok.encode("🙂")  # both halves partial


def streams(tok):
    return {
        "text": tok.encode(TEXT * 3),
        "split": tok.encode("🙂") + tok.encode(" x") + tok.encode("東京") + tok.encode("–") + tok.encode("🙂"),
        "bytes": byte_ids(tok, "a🙂é東".encode()),
        "special": tok.encode("🙂")[:1] + [tok.eos_token_id] + tok.encode("🙂")[1:] + tok.encode(" ok"),
    }


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
@pytest.mark.parametrize("name", ["text", "split", "bytes", "special"])
def test_pieces_concatenate_to_the_full_decode(tok, fallback, name):
    ids = streams(tok)[name]
    pieces = feed(detokenizer(tok, fallback), ids)
    assert "".join(pieces) == decode(tok, ids)
    assert FFFD not in "".join(pieces)


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
def test_a_split_character_comes_out_whole_on_its_last_token(tok, fallback):
    smile = tok.encode("🙂")
    assert len(smile) >= 2
    ids = tok.encode("a") + smile + tok.encode("b")
    pieces = feed(detokenizer(tok, fallback), ids)
    assert pieces == ["a"] + [""] * (len(smile) - 1) + ["🙂", "b"]

    ids = byte_ids(tok, "🙂".encode())
    assert feed(detokenizer(tok, fallback), ids) == ["", "", "", "🙂"]


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
def test_final_step_flushes_a_trailing_partial_character(tok, fallback):
    ids = tok.encode("x") + tok.encode("🙂")[:1]
    pieces = feed(detokenizer(tok, fallback), ids, final_last=True)
    assert pieces == ["x", FFFD]
    assert "".join(pieces) == decode(tok, ids)


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
def test_a_character_that_never_completes_is_replaced_as_decode_does(tok, fallback):
    ids = tok.encode("🙂")[:1] + tok.encode("x y")
    pieces = feed(detokenizer(tok, fallback), ids)
    assert "".join(pieces) == decode(tok, ids) == FFFD + "x y"


def test_table_path_starts_no_decoder_for_whole_tokens(tok):
    d = Detokenizer(tok)
    s = Sequence("r", [1], SamplingParams())
    for t in tok.encode("naïve café"):
        s.output_token_ids.append(t)
        d.step(s)
        assert s.utf8 is None
    s.output_token_ids.append(tok.encode("🙂")[0])
    d.step(s)
    assert s.utf8 is not None  # a partial character pending
    s.output_token_ids.append(tok.encode("🙂")[1])
    assert d.step(s) == "🙂" and s.utf8 is None


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
def test_ids_past_the_tokenizer_vocabulary_decode_to_nothing(tok, fallback):
    # The LM head may be wider than the tokenizer (here 512 rows, fewer tokens): such ids can be sampled.
    oov = len(tok)
    smile = tok.encode("🙂")
    ids = smile[:1] + [oov + 3] + smile[1:] + tok.encode("x") + [oov]
    pieces = feed(detokenizer(tok, fallback), ids)
    assert pieces == ["", "", "🙂", "x", ""] and "".join(pieces) == decode(tok, ids)
    assert feed(detokenizer(tok, fallback), tok.encode("x") + smile[:1] + [oov], final_last=True) == ["x", "", FFFD]


@pytest.mark.parametrize("fallback", [False, True], ids=["table", "window"])
def test_a_stop_string_split_across_tokens_is_cut_before_it_streams(tok, fallback):
    stops = ["京 🙂"]
    params = SamplingParams(stop=stops)
    ids = tok.encode("café ") + tok.encode("東京") + tok.encode(" ") + tok.encode("🙂") + tok.encode(" ok")
    detok, s = detokenizer(tok, fallback), Sequence("r", [1], params)
    streamed, stopped = "", False
    for t in ids:  # what LLMEngine._advance does with each piece
        s.output_token_ids.append(t)
        piece = detok.step(s)
        cut = find_stop(s.text, len(piece), stops) if piece else None
        if cut is not None:
            s.text, stopped = s.text[:cut], True
        end = max(s.emitted, len(s.text) - held_back(params, stopped))
        streamed, s.emitted = streamed + s.text[s.emitted : end], end
        assert "京" not in streamed
        if stopped:
            break
    assert stopped and s.text == streamed == "café 東"
    assert len(s.output_token_ids) < len(ids)
