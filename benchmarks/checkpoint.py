"""Random-initialised GPT-2 checkpoints in Hugging Face format for benchmarks (no network here).

The weights are random, the shapes are the real ones (GPT-2 small is 124M parameters), and the
tokenizer is the embedded model's byte-level BPE; its vocabulary is smaller than the checkpoint's
50257 rows, which only matters for reading the text, not for speed.
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
    for name in _TOKENIZER_FILES:
        if (EMBEDDED_MODEL / name).exists():
            shutil.copy(EMBEDDED_MODEL / name, path / name)
    return path
