"""EAGLE-3 draft heads (Li et al., "EAGLE-3", 2025) in their published checkpoint layout, over a
paged KV cache of their own (`--speculative-config '{"method": "eagle3", "model": DIR, ...}'`).

The layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's `LlamaForCausalLMEagle3`):

- `fc.weight` [hidden, 3 * target hidden]: fuses the target's hidden states taken at three layers;
- `midlayer.*`: one Llama decoder layer whose attention reads concat(input_layernorm(embedding of the
  token), hidden_norm(fused state)), 2 * hidden wide (q/k/v_proj [*, 2 * hidden]);
- `norm.weight`, then `lm_head.weight` over a reduced draft vocabulary of `draft_vocab_size` tokens,
  draft id i being target id i + `d2t[i]` (`t2d`, the target ids the draft knows, is not needed);
- `embed_tokens.weight` where the head has its own, else the target's token table (shared);
- config.json: a Llama config (`num_hidden_layers` 1) with `draft_vocab_size`, `target_hidden_size`
  where the target's width differs, `eagle_config.eagle_aux_hidden_state_layer_ids` (or the same key
  at the top level, as the speculators format puts it) and `norm_before_residual` where trained so.

Which target states: the residual stream entering layers `eagle_aux_hidden_state_layer_ids` (vLLM's
reading: id j is the output of layer j - 1, 0 the embedding; SGLang reads an explicit list one layer
later), by default (2, L // 2, L - 3) of an L-layer target (vLLM, SGLang and the EAGLE repository
agree on that default). The target hands them over with its `aux_layers`/`aux_sink` (every family:
models/llama.py, models/gpt2.py): `keep_features` fuses them through `fc` and stores each token's fused state at its
KV slot, in `features` (a row per cache slot, over the target's block ids), so that the head reads a
position's state whenever it catches up on it, steps later, after preemption or from a prefix hit.

A position p of the head pairs the target's state at p with token p + 1 (the token that state chose)
and predicts token p + 2. A round (server/worker/spec/eagle.py): catch up on the positions whose
target states are known, whose rows that reach a sequence's end give its first proposal; then each
further step feeds the head its own output state at the last position (before `norm`: `carry`)
with the token it chose. `lm_head` keeps the rows it is given in `carry` for that next step, and
returns logits over the target's vocabulary (-inf where the draft vocabulary has no token), so its
argmax is a target id. The plain-PyTorch reference of all this is models/eagle3_reference.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from models.attention import AttentionMetadata, Rope, make_backend
from models.base import CausalLM
from models.linear import Linear, head_matmul
from models.llama import LlamaAttention, LlamaMLP, RMSNorm, Rotary
from models.loader import _no_init, _read_tensors
from models.parallel.group import TensorParallel, built_as
from models.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, qkv_parts
from models.spec import ModelSpec

# The checkpoint's names (an optional "model." prefix and "layers.0." for "midlayer." read the same)
# -> ours: q/k/v and gate/up are merged into one projection each, as every family merges them.
_MERGED = {"midlayer.self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
           "midlayer.mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
_IGNORED = ("t2d",)  # the target ids the draft vocabulary holds: implied by d2t


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return 2, num_layers // 2, num_layers - 3


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over the token's embedding beside the fused state."""

    def __init__(self, config: LlamaConfig, spec: ModelSpec, backend) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, spec, backend)
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn.qkv_proj = ColumnParallelLinear(2 * h, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
                                                       qkv_parts(spec), bias=bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rope, kv_cache,
                meta: AttentionMetadata) -> torch.Tensor:
        """-> the layer's output before the head's final norm (what the next step is fed)."""
        h = self.hidden_norm(hidden)
        x = (h if self.norm_before_residual else hidden) + self.self_attn(
            torch.cat([self.input_layernorm(embeds), h], dim=-1), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head drafting for `target` (of any family), behind the model contract
    (models/base.py) that the draft runner's graphs and warm-up speak: `forward` reads each prompt-
    chunk row's fused state from `features` at its slot, each decode row r's from `carry[r]`."""

    def __init__(self, config: LlamaConfig, target: CausalLM, attention: str, own_embedding: bool,
                 target_hidden: int, draft_vocab: int, max_positions: int,
                 token_table: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        spec = ModelSpec.from_hf_config(config)
        # RoPE reaches the target's context (heads are trained on shorter texts; the rotation is defined anyway)
        self.spec = replace(spec, max_position_embeddings=max(spec.max_position_embeddings, max_positions))
        self.attention = make_backend(attention, spec.head_dim, spec.num_heads // spec.num_kv_heads, False)
        self.deterministic = False
        self.vocab_size = config.vocab_size  # the target's: lm_head's columns are target ids
        self.width = -(-self.vocab_size // 64) * 64
        self.fc = Linear(3 * target_hidden, spec.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config, spec, self.attention)
        self.norm = RMSNorm(spec.hidden_size, config.rms_norm_eps)
        self.lm_head_weight = nn.Parameter(torch.empty(draft_vocab, spec.hidden_size))
        self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, spec.hidden_size) if own_embedding else None
        # the target's token table (a tuple: not a submodule of the head); GPT-2's without its positions;
        # `token_table` where the target holds a rank's share of it (whole_token_table)
        self._target_embed = (token_table or _token_table(target),)
        self.rotary: Rotary | None = None
        self.features: torch.Tensor | None = None  # [cache slots + a scratch block, hidden] (allocate)
        self.carry: torch.Tensor | None = None  # [rows, hidden]
        self.scratch_slot = 0

    def allocate(self, num_blocks: int, block_size: int, max_rows: int) -> None:
        """The fused-state rows of `num_blocks` cache blocks (and the scratch block, where padding
        rows write) and the carried states of up to `max_rows` sequences a step."""
        p = self.lm_head_weight
        self.features = torch.zeros((num_blocks + 1) * block_size, self.spec.hidden_size, dtype=p.dtype, device=p.device)
        self.scratch_slot = num_blocks * block_size
        if self.carry is None or self.carry.shape[0] < max_rows:
            self.carry = torch.zeros(max_rows, self.spec.hidden_size, dtype=p.dtype, device=p.device)

    def feature_bytes(self, block_size: int) -> int:
        return block_size * self.spec.hidden_size * self.lm_head_weight.element_size()

    def keep_features(self, states: list[torch.Tensor], meta: AttentionMetadata) -> None:
        """The target's aux_sink: its states at the aux layers, fused, into each token's slot row."""
        slots = meta.slot_mapping.long()
        slots = torch.where(slots < 0, self.scratch_slot, slots)
        self.features.index_copy_(0, slots, self.fc(torch.cat(states, dim=-1)).to(self.features.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [n]: token p + 1 at each position p (placeholders resolved by the shared rule)
        -> the layer's outputs before the final norm [n, hidden]."""
        p = meta.num_prefill_tokens
        parts = []
        if p:
            parts.append(self.features[meta.slot_mapping[:p].long().clamp(min=0)])
        if p < input_ids.shape[0]:
            parts.append(self.carry[: input_ids.shape[0] - p])
        hidden = torch.cat(parts)  # (a copy: the carried rows are rewritten by lm_head)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target_embed[0]
        rope = Rope(positions.long(), self.rotary.cos, self.rotary.sin)
        return self.midlayer(embed(input_ids, sampled_ids), hidden, rope, kv_caches[0], meta)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (forward's rows that propose, in row order: kept as `carry`) -> logits
        [n, padded target vocabulary], -inf past the draft vocabulary's tokens."""
        n = hidden.shape[0]
        self.carry[:n].copy_(hidden)
        logits = head_matmul(self.norm(hidden), self.lm_head_weight, False)
        return logits.new_full((n, self.width), float("-inf")).index_copy_(1, self.draft_to_target, logits)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """The published names in (see the module); d2t read into `draft_to_target`."""
        names = {_name(k): k for k in tensors if _name(k) not in _IGNORED}
        own, loaded = dict(self.named_parameters()), set()
        for ours, parts in _MERGED.items():
            holder = ours.rsplit(".", 2)[0]
            keys = [f"{holder}.{part}.weight" for part in parts]
            if all(k in names for k in keys):
                loaded.add(self._copy(own, ours, torch.cat([tensors[names.pop(k)] for k in keys])))
        if "d2t" in names:
            d2t = tensors[names.pop("d2t")].long().to(self.draft_to_target.device)
            if d2t.shape != self.draft_to_target.shape:
                raise ValueError(f"d2t has {d2t.numel()} entries, the draft vocabulary {self.draft_to_target.numel()}")
            ids = self.draft_to_target + d2t
            if ids.min() < 0 or ids.max() >= self.vocab_size or ids.unique().numel() != ids.numel():
                raise ValueError(f"d2t maps draft ids outside the target's {self.vocab_size} tokens, or two onto one")
            self.draft_to_target.copy_(ids)
        elif self.draft_to_target.numel() != self.vocab_size:
            raise ValueError("the EAGLE-3 head has no d2t: its lm_head must then cover the target's whole vocabulary")
        for name, key in names.items():
            loaded.add(self._copy(own, "lm_head_weight" if name == "lm_head.weight" else name, tensors[key]))
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"the EAGLE-3 checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self.rotary = Rotary(_with_positions(self.config, self.spec.max_position_embeddings), self.spec.head_dim,
                             self.lm_head_weight.device)

    @staticmethod
    def _copy(own: dict, name: str, t: torch.Tensor) -> str:
        if name not in own:
            raise ValueError(f"unexpected tensor {name!r} in the EAGLE-3 checkpoint")
        p = own[name]
        with torch.no_grad():
            if name == "embed_tokens.weight" and t.shape[0] < p.shape[0]:  # the token table's padding rows
                t = torch.cat([t, t.new_zeros(p.shape[0] - t.shape[0], t.shape[1])])
            if p.shape != t.shape:
                raise ValueError(f"EAGLE-3 head {name}: checkpoint shape {tuple(t.shape)} != {tuple(p.shape)}")
            p.copy_(t)
        return name


def load_head(path: Path, target: CausalLM, dtype: torch.dtype, device: torch.device | str, attention: str,
              max_model_len: int, token_table: nn.Module | None = None) -> Eagle3Head:
    """The head at `path`, loaded for `target` (which then hands it its states: aux_layers,
    aux_sink), whole whatever the process's tensor-parallel group (it runs on one rank:
    server/worker/spec/parallel.py). ValueError says what does not fit: a head trained for another
    width or vocabulary, aux layers the target lacks, more than one layer. `token_table`: the
    target's whole (whole_token_table), for a head without its own where the target holds a rank's
    share."""
    if not hasattr(target, "aux_layers"):  # (the families' forwards hand their states over: models/llama.py, gpt2.py)
        raise ValueError(f"an EAGLE-3 head cannot draft for a {type(target).__name__}: it hands over no hidden states")
    config = LlamaConfig.from_pretrained(path)
    t = target.spec
    if config.num_hidden_layers != 1:
        raise ValueError(f"the EAGLE-3 head {path} has {config.num_hidden_layers} decoder layers; flashpage serves "
                         "heads of one (`midlayer`)")
    eagle = getattr(config, "eagle_config", None) or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError(f"the EAGLE-3 head {path} reads no auxiliary hidden states (use_aux_hidden_state false)")
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else default_aux_layers(t.num_layers)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(
            isinstance(i, int) and 0 <= i < t.num_layers for i in ids):
        raise ValueError(f"the EAGLE-3 head reads the target's layers {list(ids)}: three distinct layers of the "
                         f"target's {t.num_layers} are needed")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != t.hidden_size:
        raise ValueError(f"the EAGLE-3 head was trained on a target of hidden size {target_hidden}; this target's is "
                         f"{t.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"the EAGLE-3 head's vocabulary ({config.vocab_size}) is not the target's ({target.vocab_size})")
    with _read_tensors(path) as tensors:
        names = {_name(k): k for k in tensors}
        own_embedding = "embed_tokens.weight" in names
        if not own_embedding and config.hidden_size != t.hidden_size:
            raise ValueError(f"the EAGLE-3 head has no token table and its width ({config.hidden_size}) is not the "
                             f"target's ({t.hidden_size}), whose table it would share")
        fc = tensors[names["fc.weight"]].shape if "fc.weight" in names else None
        if fc is not None and tuple(fc) != (config.hidden_size, 3 * t.hidden_size):
            raise ValueError(f"the EAGLE-3 head's fc takes {fc[1]} features a token; this target's three layers give "
                             f"{3 * t.hidden_size}: a head trained for another target")
        if not own_embedding and token_table is None and _token_table(target).tp.size > 1:
            # (its lookups would wait in the target's all-reduce for ranks that never run the head)
            raise ValueError("the EAGLE-3 head shares the target's token table, of which this rank holds a share: "
                             "the whole table is needed (whole_token_table)")
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        with torch.device(device), _no_init(), built_as(TensorParallel(0, 1)):  # whole under tensor parallelism too
            head = Eagle3Head(config, target, attention, own_embedding, t.hidden_size, draft_vocab, max_model_len,
                              None if own_embedding else token_table)
        head = head.to(dtype)
        head.load_weights(tensors)
    head.eval().requires_grad_(False)
    head.aux_layers = target.aux_layers = tuple(sorted(ids))
    target.aux_sink = head.keep_features
    return head


def _token_table(target: CausalLM) -> VocabParallelEmbedding:
    """The target's token table (GPT-2's without its positions)."""
    return target.embed_tokens if hasattr(target, "embed_tokens") else target.wte


def shares_token_table(path: Path) -> bool:
    """Whether the head at `path` has no token table of its own (it then reads the target's)."""
    with _read_tensors(path) as tensors:
        return "embed_tokens.weight" not in {_name(k) for k in tensors}


def whole_token_table(target: CausalLM) -> VocabParallelEmbedding:
    """The target's token table whole in this process, where the target holds a rank's rows of it
    (tensor parallelism): every rank's rows gathered, so every rank of the group calls it. For a
    head that shares the table and runs whole on rank 0 (server/worker/spec/parallel.py)."""
    table = _token_table(target)
    w = table.weight
    with built_as(TensorParallel(0, 1)), torch.device(w.device), _no_init():
        whole = VocabParallelEmbedding(target.vocab_size, w.shape[1]).to(w.dtype)
    # gather_columns joins the ranks' columns in rank order: the rows, as the columns of the transpose
    rows = table.tp.gather_columns(w.detach().t())  # [hidden, ranks * rows a rank]
    with torch.no_grad():
        whole.weight.copy_(rows[:, : whole.rows].t())
    return whole.requires_grad_(False)


def _name(key: str) -> str:
    """A checkpoint name as the published layout spells it ("model." and "layers.0." forms read alike)."""
    key = key.removeprefix("model.")
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def _with_positions(config: LlamaConfig, positions: int) -> LlamaConfig:
    config = copy.copy(config)
    config.max_position_embeddings = positions
    return config
