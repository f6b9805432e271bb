"""Pure-PyTorch references for every kernel in this folder: the contracts the Triton kernels meet.

Shared layout (all kernels):
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], fp16/bf16/fp32.
  block_tables     : [num_seqs, max_blocks_per_seq] int32; entries past a sequence's last block
                     are arbitrary (never read).
  token i of sequence s lives at block_tables[s, i // block_size], offset i % block_size,
  i.e. flat slot block_tables[s, i // block_size] * block_size + i % block_size.
  num_kv_heads divides num_heads; query head h reads kv head h // (num_heads // num_kv_heads).
  Cache slots no sequence owns may hold anything, NaN included: they must never be read.

These run the math in fp32 and return the query dtype. They are slow and obviously right;
the eager attention backend in models/ is separate (it is the baseline we benchmark against).

An FP8 cache (torch.float8_e4m3fn / float8_e5m2, kernels/fp8.py) comes with its per-KV-head fp32
scales k_scale, v_scale [num_kv_heads]: the attention references then read every cached value as
fp8_dequantize_ref gives it, and kv_write_ref stores through fp8_quantize_ref.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] stored as fp8 `dtype` with per-head scales [num_kv_heads]:
    x * (1 / scale) in fp32, saturated to the format's largest finite value, rounded to nearest even
    (torch's cast). kernels/fp8.py `quantize` gives the same bits."""
    inv = (1.0 / scale.float())[:, None]
    top = FP8_MAX[dtype]
    return (x.float() * inv).clamp(-top, top).to(dtype)


def fp8_dequantize_ref(c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache's [..., num_kv_heads, head_dim] values mean: fp32 c * scale[head]."""
    return c.float() * scale.float()[:, None]


def _read(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached values as the attention sees them: fp8 dequantized to fp32, others as stored."""
    return cache if scale is None else fp8_dequantize_ref(cache, scale)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens [0, length) of one sequence from a paged cache: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int) -> torch.Tensor:
    """q [n, h, d] at positions q_offset.., k/v [m, kvh, d] at positions 0..m-1, causal."""
    n, h, _ = q.shape
    m, kvh, _ = k.shape
    group = h // kvh
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    qpos = torch.arange(n, device=q.device)[:, None] + q_offset
    kpos = torch.arange(m, device=q.device)[None, :]
    s = s.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hnm,mhd->nhd", p, v)


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length causal attention with an optional paged prefix.

    q [total, heads, d]; k, v [total, kv_heads, d] hold the *new* tokens of every sequence, packed;
    cu_seqlens [num_seqs + 1] int32 delimits them. Sequence s's new tokens sit at positions
    prefix_lens[s] .. prefix_lens[s] + len_s - 1; positions [0, prefix_lens[s]) are read from the
    paged cache through block_tables[s]. Each query attends causally to the prefix and to the new
    tokens up to and including itself. Returns [total, heads, d] in q's dtype. With an fp8 cache
    (k_scale, v_scale given) the prefix is read dequantized, in fp32; the new tokens are used as
    given (the kernel takes them from k and v, not from the cache).
    """
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        ks, vs = k[lo:hi], v[lo:hi]
        plen = int(prefix_lens[s]) if prefix_lens is not None else 0
        if plen > 0 and k_scale is not None:
            ks = torch.cat([_read(gather_kv(k_cache, block_tables[s], plen), k_scale), ks.float()])
            vs = torch.cat([_read(gather_kv(v_cache, block_tables[s], plen), v_scale), vs.float()])
        elif plen > 0:
            ks = torch.cat([gather_kv(k_cache, block_tables[s], plen).to(k.dtype), ks])
            vs = torch.cat([gather_kv(v_cache, block_tables[s], plen).to(v.dtype), vs])
        out[lo:hi] = _attend(q[lo:hi], ks, vs, scale, plen).to(q.dtype)
    return out


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence. q [num_seqs, heads, d]; context_lens [num_seqs] int32 counts the
    cached tokens to attend to, this step's token included (it was written before the call).
    Returns [num_seqs, heads, d] in q's dtype. An fp8 cache is read dequantized (k_scale, v_scale)."""
    out = torch.empty_like(q)
    for s, n in enumerate(context_lens.tolist()):
        ks = _read(gather_kv(k_cache, block_tables[s], n), k_scale)
        vs = _read(gather_kv(v_cache, block_tables[s], n), v_scale)
        out[s : s + 1] = _attend(q[s : s + 1], ks, vs, scale, n - 1).to(q.dtype)
    return out


def kv_write_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter k, v [num_tokens, kv_heads, d] into the caches at flat slots slot_mapping [num_tokens]
    (block * block_size + offset). Slots of -1 are padding: those rows are skipped. An fp8 cache
    stores fp8_quantize_ref(k, k_scale) and (v, v_scale), and the written rows of k and v become
    what it holds (fp8_dequantize_ref, in their dtype)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype in FP8_MAX:  # written as bytes: torch's CPU index_put has no fp8 kernel
            stored = fp8_quantize_ref(x[keep], scale, cache.dtype)
            cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots] = stored.view(torch.uint8)
            x[keep] = fp8_dequantize_ref(stored, scale).to(x.dtype)
        else:
            cache.view(-1, *cache.shape[2:])[slots] = x[keep].to(cache.dtype)


def add_layernorm_ref(x, y, weight, bias, eps):
    """(x + y, LayerNorm(x + y)): the residual add and the next sub-layer's pre-norm."""
    s = x + y
    return s, torch.nn.functional.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def resolve_ids(input_ids, sampled_ids=None):
    """Placeholder ids (-1 - r) replaced by sampled_ids[r]."""
    ids = input_ids.long()
    if sampled_ids is None:
        return ids
    return torch.where(ids < 0, sampled_ids.long()[(-1 - ids).clamp(min=0)], ids)


def embed_ref(input_ids, positions, token_table, pos_table, sampled_ids=None):
    return token_table[resolve_ids(input_ids, sampled_ids)] + pos_table[positions.long()]


def argmax_ref(logits, num_cols):
    """Greedy choice per row over the first num_cols columns (NaN counts as +inf, as in the kernel)."""
    x = logits[:, :num_cols].float()
    return torch.where(x.isnan(), float("inf"), x).argmax(dim=-1)


_MASK32 = 0xFFFFFFFF


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of m * x for a constant m < 2**32 and int64 x in [0, 2**32). The
    product needs 64 unsigned bits: int64 multiplication wraps, which keeps the low 64 bits, and
    the arithmetic shift's sign bits are masked off (Random123's known answers test it)."""
    p = m * x
    return (p >> 32) & _MASK32, p & _MASK32


def philox4x32_ref(counter: tuple, key: tuple, rounds: int = 10) -> tuple:
    """Philox-4x32 (Random123): four counter words and two key words (int64 tensors or ints in
    [0, 2**32)) -> four output words (int64 tensors)."""
    from kernels.sampling_noise import M0, M1, W0, W1

    m0, m1, w0, w1 = M0.value, M1.value, W0.value, W1.value
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(m0, c0)
        hi1, lo1 = _mulhilo(m1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + w0) & _MASK32, (k1 + w1) & _MASK32
    return c0, c1, c2, c3


def philox_word_ref(seeds: torch.Tensor, positions: torch.Tensor, num_cols: int) -> torch.Tensor:
    """kernels/sampling_noise.py `philox_word` for each row: [rows, num_cols] int64 in [0, 2**32)."""
    from kernels.sampling_noise import ROUNDS

    seeds = seeds.to(torch.int64)[:, None]
    c0 = torch.arange(num_cols, device=seeds.device, dtype=torch.int64)[None, :].expand(len(seeds), -1)
    c1 = (positions.to(device=seeds.device, dtype=torch.int64)[:, None] & _MASK32).expand_as(c0)
    zero = torch.zeros_like(c0)
    return philox4x32_ref((c0, c1, zero, zero), (seeds & _MASK32, (seeds >> 32) & _MASK32), ROUNDS.value)[0]


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, num_cols: int) -> torch.Tensor:
    """kernels/sampling_noise.py's noise [rows, num_cols] float32."""
    u = ((philox_word_ref(seeds, positions, num_cols) >> 9).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))


def sampled_argmax_ref(logits: torch.Tensor, num_cols: int, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """kernels/argmax.py with `noise`: each row with inv_temperature > 0 takes
    argmax(logits * inv_temperature + Gumbel noise), the others the plain argmax (NaN as +inf
    before either). Also the CPU path of server/worker/sampler.py."""
    x = logits[:, :num_cols].float()
    x = torch.where(x.isnan(), float("inf"), x)
    inv_t = inv_temperature.to(device=x.device, dtype=torch.float32)
    hot = (inv_t > 0).nonzero().flatten()
    if len(hot):
        g = gumbel_noise_ref(seeds.to(x.device)[hot], positions.to(x.device)[hot], num_cols)
        x = x.clone()
        x[hot] = x[hot] * inv_t[hot, None] + g
    return x.argmax(dim=-1)


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                        in_prompt: torch.Tensor, penalties: torch.Tensor) -> None:
    """vLLM's repetition, frequency and presence penalties on logits[rows] (fp32, in place), from
    their sequences' slots (kernels/penalties.py has the layout). Also the CPU path of
    server/worker/logits.py."""
    rep, freq, pres = penalties[slots].unbind(dim=1)
    c = counts[slots]
    seen = in_prompt[slots] | (c > 0)
    lg = logits[rows]
    lg = torch.where(seen, torch.where(lg > 0, lg / rep[:, None], lg * rep[:, None]), lg)
    lg -= freq[:, None] * c + pres[:, None] * (c > 0)
    logits.index_copy_(0, rows, lg)


def penalized_argmax_ref(logits: torch.Tensor, num_cols: int, slots: torch.Tensor, counts: torch.Tensor,
                         in_prompt: torch.Tensor, penalties: torch.Tensor, out: torch.Tensor,
                         noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """The choice with penalties (kernels/argmax.py argmax_rows with `penalty`, which takes the
    tables by address): out[r] = argmax_ref of row r after apply_penalties_ref where slots[r] >= 0
    (then counts[slots[r], out[r]] += 1), of the raw row elsewhere; with `noise` (inv_temperature,
    seeds, positions), sampled_argmax_ref's choice of those rows instead."""
    x = logits[:, :num_cols].to(torch.float32, copy=True)
    rows = (slots >= 0).nonzero().flatten()
    apply_penalties_ref(x, rows, slots[rows].long(), counts, in_prompt, penalties)
    ids = argmax_ref(x, num_cols) if noise is None else sampled_argmax_ref(x, num_cols, *noise)
    out.copy_(ids.to(out.dtype))
    counts[slots[rows].long(), ids[rows]] += 1



def grammar_mask_ref(logits: torch.Tensor, num_cols: int, bits: torch.Tensor, live: torch.Tensor,
                     covered: int) -> torch.Tensor:
    """kernels/grammar_mask.py without `out`, on a copy: logits[r, t] = -inf for each live row r
    (live[r] != 0) and each t < num_cols that bits[r] (XGrammar's int32 words) does not allow or
    that is >= covered. Also the CPU path of server/worker/logits.py."""
    x = logits.clone()
    rows = live[: x.shape[0]].nonzero().flatten()
    if not len(rows):
        return x
    cols = torch.arange(num_cols, device=x.device)
    words = bits[rows.to(bits.device)].to(x.device)[:, (cols // 32).clamp(max=bits.shape[1] - 1)]
    allowed = ((words >> (cols % 32)) & 1).bool() & (cols < covered)
    x[rows, :num_cols] = torch.where(allowed, x[rows, :num_cols], float("-inf")).to(x.dtype)
    return x

# -- Model-dtype references (rope.py, rms_norm.py, silu_mul.py) --------------------------------------
# Unlike the attention references above, these follow torch's own op-by-op rounding in the model
# dtype: they are the exact math a Hugging Face-style model runs in eager PyTorch, which the kernels
# reproduce bit-for-bit where the contract says so.


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] rotated by RoPE at positions [n], non-interleaved ("rotate_half"), as
    transformers applies it: cos/sin [max_positions, d] fp32 looked up and rounded to x's dtype
    first, then x * cos + rotate_half(x) * sin in x's dtype (each op rounded by torch)."""
    c = cos[positions.long()][:, None, :].to(x.dtype)
    s = sin[positions.long()][:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def rope_kv_write_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, write_cache=True,
                      k_scale=None, v_scale=None):
    """q and k rotated in place (rope_ref); then, with write_cache, rotated k and v scattered into the
    caches at slot_mapping (kv_write_ref: slot -1 skipped; fp8 caches quantized, and the written rows
    of k and v replaced by what they hold). Returns (q, k)."""
    q.copy_(rope_ref(q, positions, cos, sin))
    k.copy_(rope_ref(k, positions, cos, sin))
    if write_cache:
        kv_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it: mean square and normalisation in fp32,
    rounded to x's dtype, THEN multiplied by weight (x's dtype; the product rounded by torch)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + y, RMSNorm(x + y)): the residual add (rounded to x's dtype) and the next pre-norm."""
    s = x + y
    return s, rmsnorm_ref(s, weight, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] merged gate/up projection -> silu(gate) * up, [n, inter], in gate_up's dtype:
    F.silu (computed in fp32 by torch, rounded to the dtype), then the product (rounded)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               gelu: bool = False) -> torch.Tensor:
    """act(x @ weight.T + bias) in fp32, rounded once to x's dtype; gelu is the tanh approximation
    (kernels/invariant_matmul.py)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y.to(x.dtype)


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' parts summed elementwise in fp32 in rank order, rounded once to their dtype."""
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)
