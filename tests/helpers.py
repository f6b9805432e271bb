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


LLAMA_CONFIGS = {  # model_type -> transformers config class name
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def make_llama_checkpoint(path, model_type="llama", num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                          vocab_size=512, seed=0, initializer_range=0.2, **extra):
    """A random-initialised Llama-family checkpoint (config, weights, tokenizer) in Hugging Face
    format at `path`, through transformers' own model class of that family."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tok = _train_tokenizer(path, vocab_size=min(vocab_size, 400))
    config = getattr(transformers, LLAMA_CONFIGS[model_type])(
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, hidden_size=hidden_size, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, vocab_size=vocab_size, initializer_range=initializer_range,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen3":  # transformers initialises the Q/K norms to ones: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if getattr(config, "attention_bias", False) or model_type == "qwen2":
        with torch.no_grad():  # biases start at zero: make them matter too
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path
