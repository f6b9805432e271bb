"""The model contract: what every model family implements, and all the engine knows of a model.

A family is one file in `models/` whose model class satisfies `CausalLM`, plus a line in
`models/registry.py`. The worker calls `forward` over a step's flat batch and the paged cache,
`lm_head` on the hidden states of the rows that sample, and reads `spec` and `attention` (the
model's attention backend: metadata per step, warm-up, CUDA-graph hooks). The loader builds the
model on its device with uninitialised parameters (torch.nn.init off) and calls `load_weights` with
a checkpoint's tensors, which must set every parameter.

Placeholder ids: with asynchronous scheduling a step's input may name a token that the previous
step sampled and whose id is only on the device: input id `-1 - r` stands for `sampled_ids[r]`
(`placeholder_id`). Models resolve them in their embedding, through `resolve_placeholders` or a
fused kernel that implements the same rule (kernels/fused_norm.py), never with a rule of their own.
"""

from __future__ import annotations

from typing import Protocol

import torch

from models.attention import AttentionBackend, AttentionMetadata
from models.spec import ModelSpec

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (k_cache, v_cache) per layer


class CausalLM(Protocol):
    spec: ModelSpec
    attention: AttentionBackend
    vocab_size: int  # real columns of lm_head's output (the rest is padding)
    # batch-invariant GEMMs and attention (the constructor's `deterministic`): a row's outputs do
    # not depend on the other rows of its step; the worker then uses invariant sampling reductions
    deterministic: bool

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata, sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] int32 -> final hidden states [num_tokens, hidden]."""

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw logits in the model dtype, [n, padded vocab]; columns past vocab_size are padding."""

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face checkpoint's tensors in (names as the checkpoint has them)."""


def placeholder_id(row: int) -> int:
    """The input id that stands for row `row` of the previous step's sampled ids."""
    return -1 - row


def resolve_placeholders(input_ids: torch.Tensor, sampled_ids: torch.Tensor | None) -> torch.Tensor:
    """input_ids with every placeholder replaced by its sampled id (int64)."""
    ids = input_ids.long()
    if sampled_ids is None:
        return ids
    return torch.where(ids < 0, sampled_ids.long()[(-1 - ids).clamp(min=0)], ids)
