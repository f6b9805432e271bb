"""server/api/fast_encoder.py: fastokens encodes prompts only where it gives the tokenizer's ids on
every probe text; otherwise the tokenizer's own encoder does (`auto`) or the server refuses to start
(`fastokens`). Checked on the embedded model's byte-level BPE and on two tokenizers of other
pipelines built here (Llama-3's split regex; SentencePiece-style Metaspace with byte fallback)."""

import asyncio
import logging
import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models import EMBEDDED_MODEL
from server.api import fast_encoder, tokenize

# Llama-3's pre-tokenizer pattern (tokenizer.json of the Llama-3 family)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    fast_encoder._verdicts.clear()
    tokenize._memos.clear()
    yield
    fast_encoder._verdicts.clear()


@pytest.fixture(scope="module")
def embedded():
    return AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL))


def corpus(seed: int, n: int = 400) -> list[str]:
    """Texts unlike the probe set's (another seed, longer), of the same kinds of pieces."""
    rng = random.Random(seed)
    return ["".join(rng.choice(fast_encoder._PIECES) for _ in range(rng.randint(1, 200))) for _ in range(n)]


def _trained(pre, normalizer=None, decoder=None, byte_fallback=False, bos=True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback, unk_token=None if not byte_fallback else "<unk>"))
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    if decoder is not None:
        tok.decoder = decoder
    special = ["<s>", "</s>", "<unk>", "<|eot_id|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else []
    tok.train_from_iterator(corpus(7, 300), trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                                  initial_alphabet=alphabet))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|eot_id|>"])


def llama3_style() -> PreTrainedTokenizerFast:
    return _trained(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                    decoder=decoders.ByteLevel())


def sentencepiece_style() -> PreTrainedTokenizerFast:
    return _trained(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                    normalizer=normalizers.Replace(" ", "▁"), decoder=decoders.Metaspace(), byte_fallback=True)


def _agrees(enc, tokenizer, texts) -> bool:
    return all(enc.encode([t], s)[0] == tokenizer.encode(t, add_special_tokens=s) for t in texts for s in (True, False))


def test_the_embedded_tokenizer_is_encoded_by_fastokens_with_its_ids(embedded):
    enc = fast_encoder.load(embedded, "auto")
    assert enc is not None
    texts = corpus(1) + ["<|endoftext|>" + t for t in corpus(2, 50)]
    assert _agrees(enc, embedded, texts)
    assert enc.encode(texts[:3], True) == [embedded.encode(t) for t in texts[:3]]  # a batch, in order


@pytest.mark.parametrize("make", [llama3_style, sentencepiece_style])
def test_other_pipelines_get_the_tokenizers_ids_whichever_encoder_is_chosen(make):
    tokenizer = make()
    texts = corpus(3) + [f"a{t}b {t}" for t in ("<s>", "</s>", "<|eot_id|>")]
    backend = tokenize.use_backend(tokenizer, "auto")
    if make is llama3_style:  # the Llama-3 family's pipeline: fastokens must take it
        assert backend == "fastokens"
    for special in (True, False):
        got = asyncio.run(tokenize.encode(tokenizer, texts, add_special_tokens=special))
        assert got == [tokenizer.encode(t, add_special_tokens=special) for t in texts]
    assert got[0][0] != tokenizer.bos_token_id and asyncio.run(tokenize.encode(tokenizer, ["hi"]))[0][0] == \
        tokenizer.bos_token_id


def test_a_truncation_length_in_tokenizer_json_does_not_cut_prompts():
    tokenizer = llama3_style()
    tokenizer.backend_tokenizer.enable_truncation(max_length=64)  # as a tokenizer.json may carry it
    enc = fast_encoder.load(tokenizer, "auto")
    assert enc is not None
    text = " ".join(corpus(4, 20))
    assert len(tokenizer.encode(text)) > 64 and enc.encode([text], True) == [tokenizer.encode(text)]


class _Wrong:
    """fastokens as it would be if it disagreed with the tokenizer on one text."""

    def __init__(self, real, bad: str) -> None:
        self.real, self.bad = real, bad
        self.no_truncation, self.no_padding = real.no_truncation, real.no_padding

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        out = self.real.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)
        if self.bad in text:
            return type("E", (), {"ids": list(out.ids)[::-1] + [0]})()
        return out


def test_a_disagreement_keeps_the_tokenizers_encoder_or_refuses_to_start(embedded, monkeypatch, caplog):
    import fastokens

    real = fastokens.Tokenizer.from_json_str
    monkeypatch.setattr(fastokens.Tokenizer, "from_json_str", lambda config: _Wrong(real(config), "東京"))
    with caplog.at_level(logging.INFO, logger="flashpage.api"):
        assert fast_encoder.load(embedded, "auto") is None
    assert "not fastokens: it encodes" in caplog.text and "differently" in caplog.text
    with pytest.raises(RuntimeError, match="--tokenizer-backend fastokens: cannot be used"):
        fast_encoder.load(embedded, "fastokens")


def test_without_fastokens_auto_uses_the_tokenizer_and_hf_never_tries(embedded, monkeypatch, caplog):
    monkeypatch.setitem(__import__("sys").modules, "fastokens", None)  # import fastokens raises ModuleNotFoundError
    with caplog.at_level(logging.INFO, logger="flashpage.api"):
        assert fast_encoder.load(embedded, "auto") is None
    assert "ModuleNotFoundError" in caplog.text
    with pytest.raises(RuntimeError, match="ModuleNotFoundError"):
        fast_encoder.load(embedded, "fastokens")
    fast_encoder._verdicts.clear()
    monkeypatch.setattr(fast_encoder, "_check", lambda *a: pytest.fail("hf must not probe"))
    assert fast_encoder.load(embedded, "hf") is None
