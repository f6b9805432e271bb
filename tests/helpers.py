"""Test helpers shared across the suite (importable as tests.helpers)."""

import json


def sse_events(resp) -> list:
    """The `data:` payloads of a streamed response: parsed JSON events, then "[DONE]"."""
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events

def _train_tokenizer(path, vocab_size: int) -> None:
    """A small byte-level BPE, so tests need no network; saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "Return a new list of the items.",
            "naïve café – 東京 🙂", "def f(x):\n    return x * 2\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def make_checkpoint(path, n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=512, seed=0,
                    safetensors=True, initializer_range=0.2, **extra):
    # initializer_range 0.2, not GPT-2's 0.02: at 0.02 random logits are near-uniform, greedy decoding
    # repeats one token, and a comparison of token sequences would prove little.
    """A random-initialised GPT-2 in Hugging Face format (config, weights, tokenizer) at `path`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    tok = _train_tokenizer(path, vocab_size=min(vocab_size, 400))
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                        vocab_size=vocab_size, initializer_range=initializer_range, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **extra)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(path, safe_serialization=safetensors)
    return path
