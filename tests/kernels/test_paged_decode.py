"""paged_decode against paged_decode_ref (runs under TRITON_INTERPRET=1 on CPU; see tests/conftest.py).

Every case draws fresh random inputs (seed in the failure message), scatters each sequence's blocks
over a random permutation of the cache, fills every slot no sequence owns with NaN, poisons the
output with NaN before the call, and checks the split (flash-decoding) and unsplit paths agree.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.decode_config import (MAX_SPLITS, choose_fp8_config, choose_gpu_config, merge_heads,
                                   merge_split_cap)
from kernels.paged_decode import choose_config, paged_decode
from kernels.reference import kv_write_ref, paged_decode_ref

from tests.helpers import FP8_DTYPES, fp8_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _make(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int = 64,
    extra_table_cols: int = 0,
    q_gain: float = 1.0,
):
    """Random q and a scattered paged cache; unowned slots (and tails of last blocks) hold NaN.
    Built on the CPU from a seeded generator, then moved to DEVICE."""
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    n_blocks = [(n + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(max(n_blocks), 1) + extra_table_cols
    num_blocks = sum(n_blocks) + 3  # a few blocks nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)
    # Entries past a sequence's last block are garbage far out of range: they must never be read.
    block_tables = torch.full((len(context_lens), max_blocks), 1 << 30, dtype=torch.int32)
    used, slots = 0, []
    for s, (n, nb) in enumerate(zip(context_lens, n_blocks)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.int()
        tok = torch.arange(n)
        slots.append(ids[tok // block_size] * block_size + tok % block_size)
    slots = torch.cat(slots)  # write exactly the owned slots; everything else stays NaN
    flat = (-1, num_kv_heads, head_dim)
    k_cache.view(flat)[slots] = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache.view(flat)[slots] = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(dtype)
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=g) * q_gain).to(dtype)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    return seed, dev(q), dev(k_cache), dev(v_cache), dev(block_tables), dev(ctx)


def _run(q, k_cache, v_cache, block_tables, ctx, scale, num_splits):
    out = torch.full_like(q, float("nan"))  # poison: every element must be overwritten
    res = paged_decode(q, k_cache, v_cache, block_tables, ctx, scale, num_splits=num_splits, out=out)
    assert res is out
    assert not torch.isnan(out).any(), f"unwritten or NaN output (num_splits={num_splits})"
    return out


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, msg: str) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"{msg}\n{m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_mixed_lengths_split_and_unsplit(block_size: int, dtype: torch.dtype) -> None:
    # 403 tokens: off every block size and off the 32-token tile; 13 tiles, so 5 splits all get
    # tokens (3 tiles each, the last 1 partial tile) and 4 splits get 4/4/4/1 tiles. 5 splits: a
    # count that is not a power of two (merged as a masked tile of 8).
    # One head: what varies here is lengths, block size, dtype and splits; the grid's head axis (a
    # runtime offset, the same kernel specialisation) is covered by the multi-head cases below.
    lens = [1, block_size - 1, block_size, block_size + 1, 403]
    random.shuffle(lens)
    seed, q, kc, vc, bt, ctx = _make(lens, 1, 1, block_size, dtype, q_gain=2.0)
    scale = 64**-0.5
    ref = paged_decode_ref(q, kc, vc, bt, ctx, scale)
    outs = {}
    for ns in (None, 1, 4, 5):
        outs[ns] = _run(q, kc, vc, bt, ctx, scale, ns)
        _close(outs[ns], ref, dtype, f"seed={seed} lens={lens} num_splits={ns} vs reference")
    for ns in (4, 5):
        _close(outs[ns], outs[1], dtype, f"seed={seed} split {ns} vs unsplit")
    # the separate merge launch (the default merges inside the decode kernel)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, ctx, scale, num_splits=5, out=out, _config={"FUSED_MERGE": False})
    _close(out, outs[5], dtype, f"seed={seed} merge launch vs fused merge")


# Groups 2 and 8 (one kv head). (6, 3) was dropped: group 2 again, the same kernel specialisation
# as (4, 2) (GROUP, GROUP_PAD, MERGE_HEADS are equal; num_heads is a runtime argument).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
def test_gqa(heads: tuple[int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    lens = [1, 15, 16, 17, 300]
    seed, q, kc, vc, bt, ctx = _make(lens, num_heads, num_kv_heads, 16, dtype)
    scale = 64**-0.5
    ref = paged_decode_ref(q, kc, vc, bt, ctx, scale)
    unsplit = _run(q, kc, vc, bt, ctx, scale, 1)
    split = _run(q, kc, vc, bt, ctx, scale, 5)
    _close(unsplit, ref, dtype, f"seed={seed} heads={heads} unsplit")
    _close(split, ref, dtype, f"seed={seed} heads={heads} split")
    launched = paged_decode(q, kc, vc, bt, ctx, scale, num_splits=5, _config={"FUSED_MERGE": False})
    _close(launched, ref, dtype, f"seed={seed} heads={heads} split, merge launch")


def test_empty_splits_and_zero_context() -> None:
    """Block tables much wider than the contexts (as in a captured graph sized for the longest
    sequence): most splits get no tokens and must contribute nothing; a context of 0 gives zeros."""
    lens = [3, 40, 1]
    seed, q, kc, vc, bt, ctx = _make(lens, 2, 2, 8, torch.float16, extra_table_cols=60)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.125)
    for ns in (None, 33):
        _close(_run(q, kc, vc, bt, ctx, 0.125, ns), ref, torch.float16, f"seed={seed} num_splits={ns}")
    ctx0 = ctx.clone()
    ctx0[1] = 0  # a padding row
    for ns in (1, 16):
        out = _run(q, kc, vc, bt, ctx0, 0.125, ns)
        assert torch.equal(out[1], torch.zeros_like(out[1])), f"context 0 must give zeros (num_splits={ns})"
        _close(out[[0, 2]], ref[[0, 2]], torch.float16, f"seed={seed} ctx0 num_splits={ns}")


def test_strided_q_and_default_out() -> None:
    """q as a view into a fused projection (non-contiguous heads) and out allocated by the call."""
    lens = [20, 33]
    seed, q, kc, vc, bt, ctx = _make(lens, 2, 2, 16, torch.float16)
    big = torch.randn(2, 3, 2, 64).to(device=DEVICE, dtype=torch.float16)
    big[:, 1] = q
    qv = big[:, 1]
    assert not qv.is_contiguous()
    ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.125)
    for ns in (1, 3):
        out = paged_decode(qv, kc, vc, bt, ctx, 0.125, num_splits=ns)
        assert out.shape == q.shape and out.dtype == q.dtype
        _close(out, ref, torch.float16, f"seed={seed} strided q num_splits={ns}")


def test_split_count_from_shapes_only() -> None:
    """The split count depends on shapes (and SM count) alone, so graphs can be captured."""
    small = choose_config(1, 12, 1, 16384, 132)
    big = choose_config(256, 12, 1, 16384, 132)
    assert small["num_splits"] > 1, "one sequence over a long context must be split"
    assert big["num_splits"] == 1, "enough (sequence, head) pairs to fill the GPU: no split"
    assert choose_config(1, 12, 1, 16, 132)["num_splits"] == 1, "a one-tile context has nothing to split"


def _check_fused_kv_write(heads: tuple[int, int], dtype: torch.dtype, head_dim: int, lens: list[int],
                          splits: tuple, config: dict | None = None, fp8: str | None = None,
                          extra_cols: int = 3) -> None:
    """k_new/v_new/slot_mapping: this step's K/V (the last token of each sequence) are written by
    the kernel and attended to from registers. Their slots hold NaN before the call, so reading
    one from the cache would poison the output; the last row (slot -1) writes nothing. With `fp8`
    the cache is fp8 (NaN bytes in every unowned slot): the kernel stores the reference quantizer's
    bytes and attends to the quantized values, as the reference over the cache it wrote does."""
    num_heads, num_kv_heads = heads
    n = len(lens)
    seed, q, kc, vc, bt, ctx = _make(lens, num_heads, num_kv_heads, 16, dtype, head_dim=head_dim,
                                     extra_table_cols=extra_cols)
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(n, 3, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k_new, v_new = big[:, 1], big[:, 2]  # strided views, as from the fused qkv projection
    last = ctx.long() - 1
    slots = bt.long()[torch.arange(n, device=DEVICE), last // 16] * 16 + last % 16
    flat = (-1, num_kv_heads, head_dim)
    kc.view(flat)[slots[:-1]] = float("nan")  # not yet written: must not be read
    vc.view(flat)[slots[:-1]] = float("nan")
    sc = {}
    if fp8 is not None:
        (kc, ks), (vc, vs) = fp8_cache(kc, fp8, seed), fp8_cache(vc, fp8, seed + 1)
        sc = dict(k_scale=ks, v_scale=vs)
    pad_slot = int(slots[-1])
    slots[-1] = -1  # padding: attends to its new token (not the cache's), writes nothing
    ref_kc, ref_vc = kc.clone(), vc.clone()
    kv_write_ref(k_new, v_new, ref_kc, ref_vc, slots, **sc)
    # The reference attends over a cache that holds every new token, the padding row's included.
    att_kc, att_vc = ref_kc.clone(), ref_vc.clone()
    kv_write_ref(k_new[-1:], v_new[-1:], att_kc, att_vc, torch.tensor([pad_slot], device=DEVICE), **sc)
    ref = paged_decode_ref(q, att_kc, att_vc, bt, ctx, head_dim**-0.5, **sc)
    for ns in splits:
        kc_t, vc_t = kc.clone(), vc.clone()
        out = torch.full_like(q, float("nan"))
        paged_decode(q, kc_t, vc_t, bt, ctx, head_dim**-0.5, num_splits=ns, out=out, k_new=k_new, v_new=v_new,
                     slot_mapping=slots.to(torch.int32), _config=config, **sc)
        assert not torch.isnan(out).any(), f"seed={seed} num_splits={ns}: NaN output"
        _close(out, ref, dtype, f"seed={seed} heads={heads} d={head_dim} num_splits={ns} config={config} {fp8}")
        for cache, want in ((kc_t, ref_kc), (vc_t, ref_vc)):  # written where asked, nowhere else
            if fp8 is not None:
                assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), f"seed={seed}"
            else:
                assert torch.equal(cache.view(flat).nan_to_num(7.0), want.view(flat).nan_to_num(7.0)), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# (2, 2): the lane-wise path (group 1) over more than one kv head; (6, 2): group 3, whose fused
# merge at 16 splits takes two rounds under the interpreter (2 heads, then 1: merge_heads).
@pytest.mark.parametrize("heads", [(2, 2), (6, 2)])
def test_fused_kv_write(heads: tuple[int, int], dtype: torch.dtype) -> None:
    _check_fused_kv_write(heads, dtype, 64, [1, 16, 17, 300, 5], (1, 4, 16))


# NEW_KV_TAIL (the default): the loop over the cached tokens only, this step's token added after it
# by the last split; off, the token where()d into its tile. (2, 2): the lane-wise path; (6, 2) at head 80: group 3 with a padded head; fp8 GQA at head
# 128 (e4m3) and MQA at head 64 (e5m2). Lengths 1 (nothing in the loop), off and on the block (16)
# and tile (32; 33: the new token alone in its tile), 16 splits leave most splits empty.
@pytest.mark.parametrize("heads,head_dim,dtype,fp8", [((2, 2), 64, torch.float16, None),
                                                      ((6, 2), 80, torch.bfloat16, None),
                                                      ((8, 2), 128, torch.bfloat16, "float8_e4m3fn"),
                                                      ((4, 1), 64, torch.float16, "float8_e5m2")])
@pytest.mark.parametrize("tail", [True, False])
def test_new_kv_after_the_loop_or_inside_its_tile(heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
                                                  fp8: str | None, tail: bool) -> None:
    """NEW_KV_TAIL on and off against the reference (outputs; the cache bytes written equal the
    reference write's), split and unsplit, and a padding row of context 0 stays zero."""
    _check_fused_kv_write(heads, dtype, head_dim, [1, 16, 33, 17, 70], (1, 3, 16), {"NEW_KV_TAIL": tail}, fp8=fp8)
    num_heads, kvh = heads
    seed, q, kc, vc, bt, ctx = _make([5, 1], num_heads, kvh, 16, dtype, head_dim=head_dim)
    kv = torch.randn(2, kvh, head_dim).to(dtype).to(DEVICE)
    ctx[1] = 0
    for ns in (1, 4):
        out = paged_decode(q, kc, vc, bt, ctx, 0.125, num_splits=ns, k_new=kv, v_new=kv,
                           slot_mapping=torch.full((2,), -1, dtype=torch.int32, device=DEVICE),
                           _config={"NEW_KV_TAIL": tail})
        assert torch.equal(out[1], torch.zeros_like(out[1])), f"seed={seed} context 0 must give zeros (splits {ns})"


@pytest.mark.parametrize(
    "group,head_dim,dtype",
    [(2, 128, torch.bfloat16), (4, 128, torch.bfloat16), (8, 128, torch.bfloat16), (4, 64, torch.float16),
     (8, 64, torch.bfloat16)],
)
def test_gqa_llama_shapes(group: int, head_dim: int, dtype: torch.dtype) -> None:
    """Group sizes 2/4/8 at head 64 and 128 (the Llama family), with the tile config the GPU uses
    for that geometry as well as the interpreter's: contexts of 1 and off the block and tile
    sizes, unowned slots NaN, split (with a multi-head merge) vs unsplit, and the fused K/V write."""
    kvh = 2 if group < 8 else 1
    lens = [1, 15, 17, 70]
    random.shuffle(lens)
    seed, q, kc, vc, bt, ctx = _make(lens, group * kvh, kvh, 16, dtype, head_dim=head_dim, extra_table_cols=2)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, head_dim**-0.5)
    gpu = choose_gpu_config(len(lens), kvh, group, bt.shape[1] * 16, 132, head_dim)
    gpu_tile = {k: gpu[k] for k in ("BLOCK_N", "PREFETCH")}  # the interpreter ignores warps and stages
    outs = {}
    for cfg in (None, gpu_tile):
        for ns in (1, 3):
            out = torch.full_like(q, float("nan"))
            paged_decode(q, kc, vc, bt, ctx, head_dim**-0.5, num_splits=ns, out=out, _config=cfg)
            assert not torch.isnan(out).any(), f"seed={seed} splits={ns} config={cfg}: unwritten or NaN output"
            _close(out, ref, dtype, f"seed={seed} lens={lens} group={group} d={head_dim} splits={ns} config={cfg}")
            outs[ns, repr(cfg)] = out
    _close(outs[3, repr(gpu_tile)], outs[1, repr(gpu_tile)], dtype, f"seed={seed} split vs unsplit")
    _check_fused_kv_write((group * kvh, kvh), dtype, head_dim, [17, 1, 70], (1, 3), gpu_tile)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
# (2, 2, 64, fp16): the lane-wise path; (8, 2, 128, bf16): GQA at head 128 with the fp8 tile the GPU
# picks for it; (4, 1, 64, bf16): MQA at head 64
@pytest.mark.parametrize("heads,head_dim,dtype", [((2, 2), 64, torch.float16), ((8, 2), 128, torch.bfloat16),
                                                  ((4, 1), 64, torch.bfloat16)])
def test_fp8_cache(heads: tuple[int, int], head_dim: int, dtype: torch.dtype, fp8: str) -> None:
    """An fp8 cache (per-head scales, NaN bytes in every unowned slot and block tail) against the
    reference over the dequantized cache: contexts of 1 and off the block and tile sizes, split and
    unsplit, the fp8 tile config the GPU would pick, and the fused K/V write."""
    num_heads, kvh = heads
    lens = [1, 15, 17, 140]
    random.shuffle(lens)
    seed, q, kc, vc, bt, ctx = _make(lens, num_heads, kvh, 16, dtype, head_dim=head_dim, extra_table_cols=2)
    (k8, ks), (v8, vs) = fp8_cache(kc, fp8, seed), fp8_cache(vc, fp8, seed + 1)
    assert k8.view(torch.uint8).eq(0x7F).any(), "the unowned slots must hold NaN bytes"
    ref = paged_decode_ref(q, k8, v8, bt, ctx, head_dim**-0.5, k_scale=ks, v_scale=vs)
    gpu = choose_fp8_config(len(lens), kvh, num_heads // kvh, bt.shape[1] * 16, 132, head_dim)
    gpu_tile = {k: gpu[k] for k in ("BLOCK_N", "PREFETCH", "DOT") if k in gpu}  # not warps and stages
    for cfg in (None, gpu_tile):
        for ns in (1, 3):
            out = torch.full_like(q, float("nan"))
            paged_decode(q, k8, v8, bt, ctx, head_dim**-0.5, num_splits=ns, out=out, k_scale=ks, v_scale=vs,
                         _config=cfg)
            assert not torch.isnan(out).any(), f"seed={seed} splits={ns}: unwritten or NaN output"
            _close(out, ref, dtype, f"seed={seed} {fp8} heads={heads} d={head_dim} splits={ns} config={cfg}")
    _check_fused_kv_write(heads, dtype, head_dim, [17, 1, 70], (1, 3), gpu_tile, fp8=fp8)


def test_fp8_gpu_config() -> None:
    """An fp8 cache's GPU configs (from shapes only): splits within the bounds the warm-up compiles,
    a long single sequence split, a large batch not."""
    for group, d in ((4, 128), (4, 64), (1, 64), (1, 128), (8, 80)):
        for batch, ctx in ((1, 65536), (64, 4096), (256, 1024), (3, 16)):
            f8 = choose_fp8_config(batch, 8, group, ctx, 132, d)
            assert 1 <= f8["num_splits"] <= MAX_SPLITS and f8["BLOCK_N"] in (32, 64, 128), f8
    assert choose_fp8_config(1, 8, 4, 65536, 132, 128)["num_splits"] > 1
    assert choose_fp8_config(256, 8, 4, 1024, 132, 128)["num_splits"] == 1


def test_merge_heads_per_round() -> None:
    """The fused merge combines as many query heads per round as fit its register budget."""
    assert merge_heads(4, 64, 128, 4) == 1  # [64 splits, 128] fp32 already fills 64 registers a thread
    assert merge_heads(4, 16, 128, 4) == 4  # one round for the whole group
    assert merge_heads(8, 8, 64, 4) == 8
    assert merge_heads(3, 4, 64, 1) == 4  # a group of 3 as a masked tile of 4
    assert merge_heads(1, 64, 64, 4) == 1


def test_half_merge_takes_half_the_splits_for_short_contexts() -> None:
    """Launch option HALF_MERGE at 32 splits of a group whose half-tile merge takes more heads a round
    (decode_config): a context of up to 2 tiles a split over half the splits (1, 33, 100 and 1024
    tokens of 32-token tiles: the half merge), a longer one over all (1025 and 1090: the whole
    tile's), in the engine's launch (this step's K/V written, added after the loop by the last split
    in use)."""
    assert merge_heads(4, 16, 64, 1) == 2 > merge_heads(4, 32, 64, 1)  # (the interpreter's 1 warp)
    _check_fused_kv_write((4, 1), torch.bfloat16, 64, [1, 33, 100, 1024, 1025, 1090], (32,), {"HALF_MERGE": True})


@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 128), (8, 128), (2, 64), (4, 64), (8, 64)])
def test_gqa_gpu_config(group: int, head_dim: int) -> None:
    """The GPU's GQA configs (from shapes only): splits within bounds and, where the cap allows,
    merged in one round; one long sequence double-buffered, a large batch not."""
    for batch in (1, 2, 4, 16, 64, 256):
        for ctx in (16, 1024, 65536):
            cfg = choose_gpu_config(batch, 8, group, ctx, 132, head_dim)
            ns = cfg["num_splits"]
            assert 1 <= ns <= MAX_SPLITS and cfg["num_stages"] in (3, 5), cfg
            if merge_split_cap(group, head_dim) >= 16:  # (HALF_MERGE: the half tile's merge, for short contexts)
                tile = 1 << (ns - 1).bit_length() >> bool(cfg.get("HALF_MERGE"))
                assert merge_heads(group, tile, head_dim, cfg["num_warps"]) >= group, cfg
    assert choose_gpu_config(1, 8, group, 65536, 132, head_dim)["num_stages"] == 5
    assert choose_gpu_config(256, 8, group, 1024, 132, head_dim) == dict(
        choose_gpu_config(256, 8, group, 1024, 132, head_dim), num_stages=3, num_splits=1)


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU tables' own config (the interpreter's is fixed)")
@pytest.mark.parametrize("context", [1, 33, 1000, 2100, 9000])
def test_gpu_tables_own_config_over_a_wide_block_table(context: int) -> None:
    """The engine's launch as the GPU tables configure it for few sequences over a block table as wide
    as a long --max-model-len: two sequences of a TP=2 Llama-3.1-8B rank's heads (16/4 x 128), where
    the tables pick 32 splits with HALF_MERGE (half of them for short contexts, all for long ones)."""
    from kernels.decode_config import _num_sms, choose_config

    cols = 9000 // 16 + 8
    if _num_sms(torch.device(DEVICE)) >= 128:
        assert choose_config(2, 4, 4, (cols + 1) * 16, _num_sms(torch.device(DEVICE)), 128).get("HALF_MERGE")
    _check_fused_kv_write((16, 4), torch.bfloat16, 128, [context, 17], (None,), None, extra_cols=cols)


def test_half_merge_picked_for_small_grids_only(monkeypatch) -> None:
    """The tables take 32 splits with HALF_MERGE where the grid stays within 2 programs an SM, the half
    tile's merge takes the group in one round and the block table is wide enough (decode_config's
    measured cases), and never otherwise."""
    import kernels.decode_config as dc

    monkeypatch.setattr(dc, "_INTERPRET", False)
    wide = {"num_splits": 32, "HALF_MERGE": True}
    for kv, group, d in ((8, 4, 128), (4, 4, 128), (2, 7, 64)):  # Llama-3.1-8B, its TP=2 rank, Qwen2.5-0.5B
        assert choose_gpu_config(1, kv, group, 131072, 132, d).items() >= wide.items(), (kv, group, d)
        assert "HALF_MERGE" not in choose_gpu_config(1, kv, group, 2048, 132, d)  # too narrow a table
        assert "HALF_MERGE" not in choose_gpu_config(64, kv, group, 131072, 132, d)  # a full grid
    assert "HALF_MERGE" not in choose_gpu_config(4, 2, 7, 131072, 132, 64)  # head 64: one program an SM at most
    assert choose_gpu_config(1, 8, 4, 131072, 132, 128)["num_stages"] == 5
    assert "HALF_MERGE" not in choose_gpu_config(4, 8, 4, 131072, 132, 128)  # 1024 programs
    assert "HALF_MERGE" not in choose_gpu_config(1, 8, 4, 131072, 108, 128)  # 256 programs on 108 SMs
    assert "HALF_MERGE" not in choose_gpu_config(1, 2, 8, 131072, 132, 128)  # Llama-3.1-70B at TP=4: 2 rounds
    assert "HALF_MERGE" not in choose_gpu_config(1, 8, 1, 131072, 132, 128)  # the lane-wise path


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
def test_warmup_compiles_every_variant_the_gpu_config_picks(group: int, monkeypatch) -> None:
    """warmup_split_variants compiles every (num_stages, split padding, HALF_MERGE) the GPU tables
    can pick for a 16-bit cache of this group, at any batch, width and SM count."""
    import kernels.decode_config as dc
    import kernels.paged_decode as pd

    monkeypatch.setattr(dc, "_INTERPRET", False)
    compiled = set()

    def record(q, k, v, tables, ctx, scale, *, num_splits, _config, **kw):
        compiled.add((_config["num_stages"], num_splits, _config["HALF_MERGE"]))

    monkeypatch.setattr(pd, "paged_decode", record)
    for d in (64, 128):
        compiled.clear()
        k = torch.zeros(4, 16, 2, d, dtype=torch.bfloat16)
        pd.warmup_split_variants(k, k, 2 * group, torch.bfloat16)
        for batch in (1, 3, 16, 64, 256):
            for kv in (1, 2, 8):
                for ctx in (16, 512, 4096, 131072):
                    for sms in (108, 132):
                        cfg = choose_gpu_config(batch, kv, group, ctx, sms, d)
                        pad = max(2, 1 << (cfg["num_splits"] - 1).bit_length())
                        if cfg["num_splits"] > 1:
                            assert (cfg["num_stages"], pad, cfg.get("HALF_MERGE", False)) in compiled, (cfg, d)


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
def test_warmup_covers_every_stage_count_the_gpu_config_picks(group: int, monkeypatch) -> None:
    """warmup_split_variants compiles each num_stages in stage_variants(group): every config the
    GPU path can choose for any batch must use one of them, or a batch shape would compile a
    kernel variant mid-serving."""
    import kernels.decode_config as dc

    monkeypatch.setattr(dc, "_INTERPRET", False)
    warmed = set(dc.stage_variants(group))
    picked = {choose(batch, kv, group, ctx, sms, d)["num_stages"] for choose in (choose_gpu_config, choose_fp8_config)
              for batch in (1, 3, 16, 64, 256, 1024) for kv in (1, 2, 8) for ctx in (16, 512, 4096, 131072)
              for sms in (108, 132) for d in (64, 80, 128)}
    assert picked <= warmed, f"group {group}: configs pick stages {picked}, warm-up compiles {warmed}"
