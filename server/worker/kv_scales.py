"""The scales of an fp8 KV cache, decided once at start-up (server/worker/setup.py), in this order:

1. the checkpoint's k_scale / v_scale (models/kv_scales.py reads every format vLLM reads);
2. otherwise, with --calculate-kv-scales (the default), a calibration pass: the model prefills
   CALIBRATION_TEXT into a small cache of its own dtype, and each layer's scale for a KV head is the
   largest |K| (|V|) that head wrote, divided by vLLM's constants (amax / 200 for K, / 100 for V:
   e4m3 reaches 448, so values up to 2.2x and 4.5x the calibration's largest stay unsaturated);
3. otherwise 1.0, with a warning (values past +-448 saturate, small ones lose precision).

fp8_e5m2 keeps scales of 1.0 (its range is fp16's; vLLM stores it unscaled). The log line says which
source gave the scales and their spread. vLLM's --calculate-kv-scales computes scales from the first
requests instead; a fixed text at start-up gives every run of a server the same scales.

Under tensor parallelism each rank decides its own KV heads' scales: the checkpoint's sliced to them,
or calibrated by a pass every rank runs together (its collectives meet as the profile run's do).
--load-format dummy never reads checkpoint scales (they belong to other weights): it calibrates.
The draft model of speculative decoding keeps its own cache in the model's dtype.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kvcache import KVScales, allocate_kv_cache, dtype_name
from kvcache.fp8 import scaled
from models import ModelSpec, checkpoint_kv_scales, load_config
from server.worker.runner import ModelRunner
from server.worker.warmup import prefill_rows

log = logging.getLogger("flashpage.worker")

K_DIVISOR, V_DIVISOR = 200.0, 100.0  # vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT
CALIBRATION_TOKENS = 512  # at most; fewer where the context or the step budget is shorter

# Prose, code, numbers and a docstring: the kinds of text a server sees, so that the activations the
# calibration measures are ordinary ones (a few hundred tokens of any tokenizer).
CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March, to review the quarterly figures. Revenue rose 7.3% to
$4.82 million, while operating costs fell slightly; the board asked why the northern region lagged
behind the others, and the answer, as usual, was the weather. "We lost nine days in February," the
regional manager said. "Next year we will plan for it."

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Return the union of closed intervals, sorted by start.

    Overlapping or touching intervals are combined: [(1, 3), (2, 6), (8, 10)] gives
    [(1, 6), (8, 10)]. The input is not modified.
    \"\"\"
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

Q: How far does light travel in one nanosecond?
A: About 30 centimetres, or roughly one foot: 299,792,458 m/s times 1e-9 s.

Les enfants jouaient dans le jardin pendant que leurs parents préparaient le dîner. Au loin, on
entendait la cloche de l'église sonner sept heures.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id)
WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

In the beginning the river was narrow and fast, cutting through granite; by the time it reached the
plain it had slowed, widened, and begun to wander, leaving oxbow lakes and wide meanders behind it.
"""


def decide_kv_scales(runner: ModelRunner, cache_dtype: torch.dtype, model_dtype: torch.dtype, path: Path,
                     calculate: bool, calibration_ids: list[int], max_model_len: int,
                     from_checkpoint: bool = True) -> KVScales:
    """The scales an fp8 cache of `cache_dtype` starts with (see the module docstring). Not
    `from_checkpoint` (--load-format dummy: random weights), the checkpoint's scales would not fit
    the weights, and are not read."""
    spec = runner.model.spec
    layers, heads, device = spec.num_layers, spec.num_kv_heads, runner.device
    if not scaled(cache_dtype):
        return KVScales.filled(layers, heads, device, f"1.0 ({dtype_name(cache_dtype)} is stored unscaled)")
    # read for the whole model's KV heads; this rank's come back (`heads` of them: its shard's)
    found = (checkpoint_kv_scales(path, layers, ModelSpec.from_hf_config(load_config(path)).num_kv_heads)
             if from_checkpoint else None)
    if found is not None:
        return KVScales.filled(layers, heads, device, "from the checkpoint", *found)
    if calculate:
        return calibrate(runner, model_dtype, calibration_ids[: min(CALIBRATION_TOKENS, max_model_len,
                                                                      runner.max_tokens)])
    log.warning("%s KV cache with scales of 1.0: the checkpoint has no k_scale/v_scale and "
                "--no-calculate-kv-scales was given; values past +-448 saturate", dtype_name(cache_dtype))
    return KVScales.filled(layers, heads, device, "1.0 (no checkpoint scales, calibration off)")


@torch.inference_mode()
def calibrate(runner: ModelRunner, model_dtype: torch.dtype, ids: list[int]) -> KVScales:
    """Prefill `ids` into a cache of the model's dtype; each layer's and KV head's largest |K| and |V|
    over them, divided by K_DIVISOR / V_DIVISOR (a head that wrote only zeros keeps 1.0)."""
    n, bs = len(ids), runner.block_size
    if n == 0:
        raise ValueError("no calibration tokens: the tokenizer encoded the calibration text to nothing")
    blocks = -(-n // bs)
    caches = allocate_kv_cache(replace(runner.cache_spec, dtype=model_dtype), blocks, runner.device)
    pos = np.arange(n)
    tokens, positions, rows = prefill_rows(runner, pos, [n], [0], np.arange(blocks)[None], ids=np.asarray(ids),
                                           slots=pos)
    runner.forward(caches, tokens, positions, rows)
    spec = runner.model.spec
    amax = torch.stack([torch.stack([c.reshape(-1, spec.num_kv_heads, spec.head_dim)[:n].float().abs().amax(dim=(0, 2))
                                     for c in layer]) for layer in caches])  # [layers, 2, kv_heads]
    if not bool(amax.isfinite().all()):
        raise ValueError("the calibration pass wrote non-finite K/V: the model's activations overflow")
    k = torch.where(amax[:, 0] > 0, amax[:, 0] / K_DIVISOR, 1.0)
    v = torch.where(amax[:, 1] > 0, amax[:, 1] / V_DIVISOR, 1.0)
    del caches
    return KVScales.filled(spec.num_layers, spec.num_kv_heads, runner.device,
                           f"calibrated at start-up on {n} tokens", k, v)
