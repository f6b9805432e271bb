"""The runner's runs before serving (server/worker/setup.py calls them): the largest step the
scheduler can produce, to size the KV cache from its peak memory, and one eager step of each kind,
so that Triton compiles its kernel variants at start-up rather than in the middle of serving.
Neither writes to the cache (every slot is -1)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.prefill_config import config_bounds
from kvcache import allocate_kv_cache
from models import StepRows
from server.worker.runner import ModelRunner
from server.worker.sampler import sample


@torch.inference_mode()
def profile_peak_memory(runner: ModelRunner) -> int:
    """Run the largest step the scheduler can produce (a full token budget of prefill, logits for
    max_num_seqs rows) against a one-block cache and return the peak bytes it allocated, plus the
    largest prefix copy a step may make."""
    device, model = runner.device, runner.model
    torch.cuda.reset_peak_memory_stats(device)
    caches = allocate_kv_cache(runner.cache_spec, 1, device)
    n, seqs = runner.max_tokens, runner.max_num_seqs
    per = -(-n // seqs)
    lens = [min(per, n - i * per) for i in range(seqs) if n - i * per > 0]
    pos = np.concatenate([np.arange(k) for k in lens]) % model.spec.max_position_embeddings
    ids, pos, rows = prefill_rows(runner, pos, lens, [0] * len(lens), np.zeros((len(lens), 1)))
    hidden = runner.forward(caches, ids, pos, rows)
    sample(model.lm_head(hidden[:seqs])[:, : model.vocab_size].float(), [], [], [])
    torch.cuda.synchronize(device)
    del caches, hidden
    # Plus the largest copy of a layer's prefix blocks a step may make (runner.gather_blocks: the
    # attention backend's gather_plan), as if it lived at the step's peak: a bound, not a measure.
    copy = runner.gather_blocks * runner.cache_spec.bytes_per_block // runner.cache_spec.num_layers
    return torch.cuda.max_memory_allocated(device) + copy


def prefill_rows(runner: ModelRunner, positions: np.ndarray, lens: list[int], prefix: list[int],
                 tables: np.ndarray, ids: np.ndarray | None = None, slots: np.ndarray | None = None,
                 copy: bool = True) -> tuple[torch.Tensor, torch.Tensor, StepRows]:
    """A start-up prefill step of these chunks, packed as prepare_step packs a real one, the
    backend's own arrays included, so that it launches (and compiles) exactly the kernel variants
    serving will. Without `slots` it writes nothing (slots -1), without `ids` its tokens are 0;
    with `copy` False its prefixes are read through the page table whatever their length."""
    n = len(positions)
    cache = (runner.block_size, runner.gather_blocks) if runner.gather_blocks and copy else None
    extra = runner.model.attention.prefill_arrays(lens, prefix, runner.device, cache)
    ids = np.zeros(n) if ids is None else ids
    slots = np.full(n, -1) if slots is None else slots
    v = runner.packer.pack(ids=ids, pos=positions, slots=slots, cu=np.concatenate([[0], np.cumsum(lens)]),
                           prefix=prefix, bt=tables, **extra)
    rows = StepRows(v["slots"], n, v["cu"], v["prefix"], v["bt"], lens, prefix, extra={k: v[k] for k in extra})
    return v["ids"], v["pos"], rows


@torch.inference_mode()
def warmup(runner: ModelRunner) -> None:
    """Run each kind of eager step once (prefill with and without a cached prefix, decode over
    page tables of several widths), then the backend's own warm-up."""
    caches, bs = runner.kv_caches, runner.block_size
    blocks = caches[0][0].shape[0] - 1
    dtype = None
    # (prefix, new tokens) of one chunk; one of a full block's prefix under up to 1024 tokens, which
    # the Triton backend copies out of the cache where a step may (gather_plan: 512 queries a key)
    steps = [(0, 16), (0, 64), (0, 16 * bs), (bs + 3, 21), (bs, min(runner.max_tokens, 1024))]
    if runner.on_cuda:  # a chunk just past each length where the prefill kernel's config changes
        steps += [(plen, bound + 1) for bound in config_bounds() for plen in (0, bs + 3)]
    for plen, new in steps:
        nb = -(-(plen + new) // bs)
        if nb > min(blocks, runner.max_blocks) or new > runner.max_tokens:
            continue
        # a prefix both ways where the backend copies prefixes at all: through the page table, and
        # as the backend chooses (a copy, if long); once where it never copies
        for copy in (False, True) if plen and runner.gather_blocks else (False,):
            ids, pos, rows = prefill_rows(runner, np.arange(plen, plen + new), [new], [plen], np.arange(nb)[None],
                                          copy=copy)
            dtype = runner.forward(caches, ids, pos, rows).dtype
    for nb in sorted({1, 2, 4, 8, runner.max_blocks}):
        if nb > blocks:
            continue
        for n in (1, runner.max_num_seqs):
            v = runner.packer.pack(ids=np.zeros(n), pos=np.full(n, nb * bs - 1), slots=np.full(n, -1),
                                   ctx=np.full(n, nb * bs), bt=np.tile(np.arange(nb), (n, 1)))
            rows = StepRows(v["slots"], 0, context_lens=v["ctx"], decode_block_tables=v["bt"])
            dtype = runner.forward(caches, v["ids"], v["pos"], rows).dtype
    # the queries' dtype is the model's (hidden states'), not an fp8 cache's
    runner.model.attention.warmup(caches, runner.model.spec.num_heads, dtype)
    if runner.on_cuda:
        torch.cuda.synchronize(runner.device)
