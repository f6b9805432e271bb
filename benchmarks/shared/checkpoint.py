"""Random-initialised checkpoints in Hugging Face format for benchmarks (no network here): GPT-2
sizes and Llama-family models at their published shapes.

The weights are random, the shapes are the real ones (GPT-2 small is 124M parameters), and the
tokenizer is the embedded model's byte-level BPE; its vocabulary is smaller than the checkpoint's
rows, which only matters for reading the text, not for speed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SIZES = {
    "small": dict(n_layer=12, n_head=12, n_embd=768),
    "medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "large": dict(n_layer=36, n_head=20, n_embd=1280),
    "xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(path: Path) -> None:
    """The embedded model's tokenizer files into `path`."""
    from models import EMBEDDED_MODEL

    for name in _TOKENIZER_FILES:
        if (EMBEDDED_MODEL / name).exists():
            shutil.copy(EMBEDDED_MODEL / name, path / name)


def make_random_gpt2(path: str | Path, size: str = "small", seed: int = 0, dtype=None) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from models import EMBEDDED_MODEL

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok_cfg = (EMBEDDED_MODEL / "config.json")
    eos = None
    if tok_cfg.exists():
        import json

        eos = json.loads(tok_cfg.read_text()).get("eos_token_id")
    config = GPT2Config(**SIZES[size], n_positions=1024, vocab_size=50257, bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(path)
    return path


_LLAMA_3_1 = dict(vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,  # 8B and 70B alike
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# The published shapes (config.json of each model on the hub), bf16 as they are distributed.
LLAMA_SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama-3.2-1b": dict(model_type="llama", num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "qwen3-0.6b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # the size served on one GPU today (Mistral-7B and Qwen2.5-7B are within 10% of it)
    "llama-3.1-8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, **_LLAMA_3_1),
    # larger than one GPU: tensor parallelism over four (--load-format dummy: no 140 GB of files)
    "llama-3.1-70b": dict(model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, intermediate_size=28672, **_LLAMA_3_1),
}


def make_random_llama(path: str | Path, shape: str | dict, seed: int = 0, device: str = "cpu") -> Path:
    """A random bf16 checkpoint of one of LLAMA_SHAPES (or of a dict of such config fields), built by
    transformers' own model class on `device` (an 8B model's random initialisation takes minutes on
    a CPU, seconds on a GPU; the weights differ between devices for one seed)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = _llama_config(shape)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model  # its memory back before a server loads the checkpoint on the same device
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    _copy_tokenizer(path)
    return path


def make_config_only_llama(path: str | Path, shape: str | dict) -> Path:
    """A checkpoint directory of one of LLAMA_SHAPES (or of a dict of such config fields) with
    config.json (bf16) and the tokenizer but no weight files: what `--load-format dummy` serves
    (random weights made on the device)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _llama_config(shape).save_pretrained(path)
    _copy_tokenizer(path)
    return path


def _llama_config(shape: str | dict):
    """transformers' config of one of LLAMA_SHAPES (or of a dict of such config fields), bf16."""
    import transformers

    fields = dict(LLAMA_SHAPES[shape] if isinstance(shape, str) else shape)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields, dtype="bfloat16")


def make_random_eagle3(path: str | Path, target: str | Path, draft_vocab_size: int | None = None,
                       layer_ids: list[int] | None = None, own_embedding: bool = False, std: float = 0.02,
                       seed: int = 0, device: str = "cpu", dtype=None, **fields) -> Path:
    """A random EAGLE-3 head for the checkpoint at `target`, in the published layout
    (models/eagle3.py; written by models/eagle3_reference.py `save_head`): one layer of the target's
    shape, `draft_vocab_size` (default the target's) a random subset of the target's ids in order,
    `eagle_config.eagle_aux_hidden_state_layer_ids` when `layer_ids` is given, a token table of its
    own with `own_embedding`; matrices normal(0, std), norm weights near one. `fields` override
    config fields (e.g. another `hidden_size`)."""
    import torch
    from transformers import AutoConfig, LlamaConfig

    from models.eagle3_reference import Eagle3Reference, head_config, save_head

    t = AutoConfig.from_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    vocab = t.vocab_size
    draft_vocab = draft_vocab_size or vocab
    d = head_config(t, draft_vocab, layer_ids, **fields)
    with torch.device(device):
        head = Eagle3Reference(LlamaConfig(**d), own_embedding=own_embedding)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        head.set_draft_vocabulary(torch.randperm(vocab, generator=g)[:draft_vocab])
    return save_head(head, d, path, dtype or torch.bfloat16)
