"""The attention-backend contract (models/attention/base.py), for every backend, through make_backend.

Each case builds one step as the worker packs it (StepRows, int32): sequences scattered over
shuffled, non-contiguous blocks of a cache laid out like kvcache/cache.py (layers x {K, V} in one
allocation, the scratch block last), every slot nobody owns holding NaN, and the cached tokens of
each sequence pre-written. The expected output is a dense causal attention over each sequence's
K/V kept unpaged, so a wrong page table in the test itself cannot agree with a wrong backend; the
expected cache is the initial one plus kernels.reference.kv_write_ref of this step's K/V.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kernels.reference import kv_write_ref, paged_decode_ref, prefill_attention_ref, rope_ref
from kvcache.fp8 import with_scale
from models.attention import BACKENDS, Rope, StepRows, make_backend

from tests.helpers import FP8_DTYPES, fp8_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the backends run; references stay on the CPU

BLOCK = 16
NUM_BLOCKS = 20  # real blocks; the scratch block comes after them
MAX_BLOCKS = 4  # page-table width: wider than any sequence here, the spare entries point at NaN blocks
# Kernel-test tolerances under the interpreter (tests/kernels/test_paged_decode.py); fp32 is the
# torch backends' own precision.
TOL = {torch.float16: 3e-3, torch.float32: 1e-5}
# (backend, dtype) pairs that run on CPU: triton needs fp16/bf16, the torch backends take both.
# "triton-deterministic": the triton backend in the deterministic mode (kernels/invariant_attention.py).
CASES = [("triton", torch.float16), ("triton-deterministic", torch.float16), ("eager", torch.float32),
         ("eager", torch.float16), ("sdpa", torch.float32), ("sdpa", torch.float16)]


def _backend(kind: str, head_dim: int, group: int = 1):
    if kind == "triton-deterministic":
        return make_backend("triton", head_dim, group, deterministic=True)
    return make_backend(kind, head_dim, group)
# Prefill chunks as (cached prefix, new tokens) and decodes as context lengths (this step's token included).
CHUNKS = [(0, 19), (21, 6)]
DECODES = [1, 17, 40]
# A speculative step's chunks (each at most TOKEN_ROWS_MAX tokens: triton attends them as decode
# rows): verifications of k + 1 = 5 tokens, one whose last block is full, a decode as a one-token
# chunk (verify.py's form), a short one, each over a cached prefix.
SHORT_CHUNKS = [(21, 5), (27, 5), (40, 1), (3, 3)]


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    storage: torch.Tensor  # [layers, 2, NUM_BLOCKS + 1, BLOCK, kv_heads, d]: the cache before the step
    want_storage: torch.Tensor  # ... after it
    rows: StepRows
    ref: torch.Tensor  # fp32 expected output of the real rows
    real: int  # rows [0, real) are real, the rest padding
    scale: float

    def run(self, kind: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's metadata and forward through layer 1's views of a fresh copy of the cache
        (on the GPU where there is one); (out, cache after the step), on the CPU."""
        group = self.q.shape[1] // self.k.shape[1]
        return _forward(_backend(kind, head_dim, group), self.q, self.k, self.v, self.storage, self.rows,
                        worker_metadata, self.scale)


def worker_metadata(backend, rows: StepRows):
    """What the worker does (server/worker/inputs.py prepare_step): the arrays the backend asks
    for with the step's prefill chunks uploaded alongside, then its metadata."""
    if rows.num_prefill_tokens:
        arrays = backend.prefill_arrays(rows.chunk_lens, rows.chunk_prefix, torch.device(DEVICE))
        rows.extra = {name: torch.from_numpy(np.asarray(a, dtype=np.int32)).to(DEVICE) for name, a in arrays.items()}
    return backend.metadata(rows)


def _forward(backend, q, k, v, storage, rows: StepRows, metadata, scale, rope: Rope | None = None,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    dev = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    storage = storage.to(DEVICE, copy=True)
    rows = StepRows(*(dev(getattr(rows, f)) for f in StepRows.__slots__))
    if rope is not None:
        rope = Rope(dev(rope.positions), dev(rope.cos), dev(rope.sin))
    k_cache, v_cache = storage[1, 0], storage[1, 1]
    if kv_scales is not None:  # an fp8 cache's views carry their scales, as kvcache allocates them
        k_cache, v_cache = with_scale(k_cache, dev(kv_scales[0])), with_scale(v_cache, dev(kv_scales[1]))
    # Copies: a backend may rotate q and k in place, and an fp8 cache's write changes k and v.
    out = backend.forward(dev(q).clone(), dev(k).clone(), dev(v).clone(), k_cache, v_cache,
                          metadata(backend, rows), scale, rope)
    return out.cpu(), storage.cpu()


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _dense(q, k, v, scale):
    """q [n, h, d] at the last n positions of k, v [m, kvh, d]; causal; fp32."""
    n, h, _ = q.shape
    m, kvh, _ = k.shape
    k = k.float().repeat_interleave(h // kvh, dim=1)
    v = v.float().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    allowed = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", p, v)


def _build(heads, kv_heads, head_dim, dtype, chunks=CHUNKS, decodes=DECODES, pad=0, seed=0) -> Step:
    """One step: `chunks` prefill chunks, then `decodes`, then `pad` padding decode rows (slot -1,
    context 1, page table of block 0, as server/worker/cuda_graphs.py DecodeGraphs pads)."""
    g = _gen(heads, kv_heads, head_dim, dtype, tuple(chunks), tuple(decodes), pad, seed)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    # (cached, new) for every sequence; a decode has context - 1 cached tokens and one new one.
    seqs = list(chunks) + [(c - 1, 1) for c in decodes]
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for cached, new in seqs:
        nb = -(-(cached + new) // BLOCK)
        tables.append(perm[used : used + nb])
        used += nb
    spare = perm[used:]
    assert spare, "the page tables' padding entries need a block nobody owns"
    storage = torch.full((2, 2, NUM_BLOCKS + 1, BLOCK, kv_heads, head_dim), float("nan"), dtype=dtype)
    kc, vc = storage[1, 0], storage[1, 1]
    full_k, full_v, q, k, v, slots = [], [], [], [], [], []
    for (cached, new), table in zip(seqs, tables):
        ks, vs = randn(cached + new, kv_heads, head_dim), randn(cached + new, kv_heads, head_dim)
        full_k.append(ks)
        full_v.append(vs)
        pos = torch.arange(cached + new)
        seq_slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        kc.view(-1, kv_heads, head_dim)[seq_slots[:cached]] = ks[:cached]
        vc.view(-1, kv_heads, head_dim)[seq_slots[:cached]] = vs[:cached]
        q.append(randn(new, heads, head_dim))
        k.append(ks[cached:])
        v.append(vs[cached:])
        slots.append(seq_slots[cached:])
    if pad:
        q.append(randn(pad, heads, head_dim))
        k.append(randn(pad, kv_heads, head_dim))
        v.append(randn(pad, kv_heads, head_dim))
        slots.append(torch.full((pad,), -1))
    q, k, v, slots = torch.cat(q), torch.cat(k), torch.cat(v), torch.cat(slots).to(torch.int32)
    scale = head_dim**-0.5
    ref = torch.cat([_dense(qs, ks, vs, scale) for qs, ks, vs in
                     zip(q.split([n for _, n in seqs] + [pad]), full_k, full_v)])

    def table_rows(ts):
        return torch.tensor([t + [spare[0]] * (MAX_BLOCKS - len(t)) for t in ts], dtype=torch.int32)

    nc, p = len(chunks), sum(n for _, n in chunks)
    rows = StepRows(slots, p)
    if chunks:
        rows.cu_seqlens = torch.tensor([0, *np.cumsum([n for _, n in chunks])], dtype=torch.int32)
        rows.prefix_lens = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
        rows.prefill_block_tables = table_rows(tables[:nc])
        rows.chunk_lens = [n for _, n in chunks]
        rows.chunk_prefix = [c for c, _ in chunks]
    if decodes or pad:
        rows.context_lens = torch.tensor(list(decodes) + [1] * pad, dtype=torch.int32)
        rows.decode_block_tables = table_rows(tables[nc:] + [[0]] * pad)
    want = storage.clone()
    kv_write_ref(k, v, want[1, 0], want[1, 1], slots)
    return Step(q, k, v, storage, want, rows, ref, len(q) - pad, scale)


def _check_out(out: torch.Tensor, step: Step, dtype: torch.dtype, what: str) -> None:
    assert out.shape == step.q.shape and out.dtype == dtype, what
    _check_rows(out[: step.real], step.ref, dtype, what)


def _check_rows(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN in the output (an unowned cache slot was read)"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m: f"{what} vs dense attention\n{m}")


def _check_cache(storage: torch.Tensor, want: torch.Tensor, what: str, real_blocks_only: bool = False) -> None:
    # The whole allocation, both layers: a write may land only in layer 1's slots of slot_mapping.
    if real_blocks_only:
        storage, want = storage[:, :, :NUM_BLOCKS], want[:, :, :NUM_BLOCKS]
    torch.testing.assert_close(storage, want, atol=0, rtol=0, equal_nan=True,
                               msg=lambda m: f"{what}: the cache after the step\n{m}")


SHAPES = [pytest.param(4, 2, 64, id="gqa-d64"), pytest.param(4, 4, 64, id="mha-d64"),
          pytest.param(4, 2, 128, id="gqa-d128")]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_mixed_step(kind, dtype, heads, kv_heads, head_dim):
    step = _build(heads, kv_heads, head_dim, dtype)
    out, storage = step.run(kind, head_dim)
    _check_out(out, step, dtype, kind)
    _check_cache(storage, step.want_storage, kind)


@pytest.mark.parametrize("pad", [0, 2], ids=["unpadded", "padded"])
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_decodes_only_step(kind, dtype, pad):
    step = _build(4, 2, 64, dtype, chunks=[], pad=pad)
    out, storage = step.run(kind, 64)
    _check_out(out, step, dtype, kind)
    # eager/sdpa send padding writes to the scratch block: only the real blocks are specified.
    _check_cache(storage, step.want_storage, kind, real_blocks_only=bool(pad))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("chunks,decodes", [(CHUNKS, DECODES), ([], DECODES)], ids=["mixed", "decodes"])
def test_backends_agree(dtype, chunks, decodes):
    step = _build(4, 2, 64, dtype, chunks=chunks, decodes=decodes, seed=1)
    kinds = [k for k, d in CASES if d == dtype]
    outs = {kind: step.run(kind, 64) for kind in kinds}
    for a, b in itertools.combinations(kinds, 2):
        (oa, sa), (ob, sb) = outs[a], outs[b]
        tol = 2 * TOL[dtype]
        torch.testing.assert_close(oa[: step.real].float(), ob[: step.real].float(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{a} vs {b}\n{m}")
        torch.testing.assert_close(sa, sb, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{a} vs {b} cache\n{m}")


@pytest.mark.parametrize("kind", ["triton", "triton-deterministic"])
def test_triton_graph_metadata_matches_metadata(kind):
    """A captured prefill step's form (server/worker/cuda_graphs.py PrefillGraphs): T rows of which
    the real ones come first, the padding rows (slot -1) in no chunk, cu_seqlens and the per-chunk
    rows padded to max_chunks (the tail of cu_seqlens repeating the last offset), a tile map filled
    on the host. Real rows must match the ordinary metadata over the unpadded step, and padding
    rows must write nothing. In the deterministic mode the real rows are bitwise those of the
    ordinary metadata (the tile map's padding and idle tiles change no row)."""
    T, max_chunks, d, heads, kv_heads = 64, 16, 64, 4, 2
    # the step's GQA group: the tile map holds positions_per_tile(group) positions a tile, which the
    # kernel reads the map with (a backend of another group would leave positions uncomputed)
    backend = _backend(kind, d, heads // kv_heads)
    n = backend.graph_tiles(T, max_chunks, torch.device(DEVICE))
    assert n > 0
    step = _build(heads, kv_heads, d, torch.float16, decodes=[], pad=0)
    lens, prefix = step.rows.chunk_lens, step.rows.chunk_prefix
    real = sum(lens)
    tile_seq, tile_start = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    backend.fill_graph_tiles(T, lens, prefix, tile_seq, tile_start)

    g = _gen("graph-padding")
    pad = T - real
    q = torch.cat([step.q, torch.randn(pad, *step.q.shape[1:], generator=g).half()])
    k = torch.cat([step.k, torch.randn(pad, *step.k.shape[1:], generator=g).half()])
    v = torch.cat([step.v, torch.randn(pad, *step.v.shape[1:], generator=g).half()])
    k_chunks = len(lens)
    cu = torch.full((max_chunks + 1,), real, dtype=torch.int32)
    cu[: k_chunks + 1] = step.rows.cu_seqlens
    prefix_lens = torch.zeros(max_chunks, dtype=torch.int32)
    prefix_lens[:k_chunks] = step.rows.prefix_lens
    tables = torch.zeros(max_chunks, MAX_BLOCKS, dtype=torch.int32)
    tables[:k_chunks] = step.rows.prefill_block_tables
    slots = torch.cat([step.rows.slot_mapping, torch.full((pad,), -1, dtype=torch.int32)])
    rows = StepRows(slots, T, cu_seqlens=cu, prefix_lens=prefix_lens, prefill_block_tables=tables)
    tiles = (torch.from_numpy(tile_seq).to(DEVICE), torch.from_numpy(tile_start).to(DEVICE))
    out, storage = _forward(backend, q, k, v, step.storage, rows, lambda b, r: b.graph_metadata(r, T, tiles),
                            step.scale)
    want, want_storage = step.run(kind, d)
    assert out.shape == q.shape
    if kind == "triton-deterministic":
        assert torch.equal(out[:real], want[:real])
    torch.testing.assert_close(out[:real], want[:real], atol=TOL[torch.float16], rtol=TOL[torch.float16],
                               msg=lambda m: f"graph_metadata vs metadata\n{m}")
    _check_rows(out[:real], step.ref, torch.float16, "triton graph")
    _check_cache(storage, step.want_storage, "triton graph")
    _check_cache(want_storage, step.want_storage, "triton")


@pytest.mark.parametrize("chunks,decodes", [(CHUNKS, DECODES), ([], DECODES)], ids=["mixed", "decodes"])
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_rope_is_applied_before_the_kv_write_and_attention(kind, dtype, chunks, decodes):
    """With `Rope`, a backend computes exactly what it computes without it on q and k rotated
    beforehand by kernels.reference.rope_ref (transformers' arithmetic): the same output and the
    same cache, bit for bit (the Triton backend rotates inside its K/V-write launch)."""
    step = _build(4, 2, 64, dtype, chunks=chunks, decodes=decodes, seed=2)
    g = _gen("rope", kind, dtype)
    positions = torch.randint(0, 200, (len(step.q),), generator=g)
    angles = torch.arange(256)[:, None] * torch.rand(32, generator=g)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    rope = Rope(positions, emb.cos(), emb.sin())
    backend = _backend(kind, 64, 2)
    meta = worker_metadata
    got, got_cache = _forward(backend, step.q, step.k, step.v, step.storage, step.rows, meta, step.scale, rope)
    q, k = (rope_ref(x.to(DEVICE), positions.to(DEVICE), emb.cos().to(DEVICE), emb.sin().to(DEVICE)).cpu()
            for x in (step.q, step.k))
    want, want_cache = _forward(backend, q, k, step.v, step.storage, step.rows, meta, step.scale)
    assert torch.equal(got, want), f"{kind}: output with Rope differs from attention over pre-rotated q, k"
    _check_cache(got_cache, want_cache, kind)


@pytest.mark.parametrize("chunks", [CHUNKS, SHORT_CHUNKS], ids=["chunks", "short-chunks"])
@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_fp8_cache_step(kind, dtype, fp8, chunks):
    """Every backend over an fp8 cache (per-head scales, NaN bytes in every unowned slot): a mixed
    step with padding rows stores the reference quantizer's bytes, and attends as the kernels'
    references do over the cache after the step: every key and value as the cache holds it (the
    write leaves a prefill chunk's own K/V so, which kv_write_ref does to step.k and step.v here),
    the prefix and decodes' tokens dequantized. Short chunks: triton's decode rows (token_rows)."""
    step = _build(4, 2, 64, dtype, chunks=chunks, pad=2, seed=3)
    storage = torch.empty(step.storage.shape, dtype=getattr(torch, fp8))
    scales = {}
    for layer, kv in itertools.product(range(2), range(2)):
        storage[layer, kv], scales[layer, kv] = fp8_cache(step.storage[layer, kv], fp8, seed=2 * layer + kv)
    ks, vs = scales[1, 0], scales[1, 1]
    want = storage.clone()
    kv_write_ref(step.k, step.v, want[1, 0], want[1, 1], step.rows.slot_mapping, ks, vs)
    out, got = _forward(_backend(kind, 64, 2), step.q, step.k, step.v, storage, step.rows, worker_metadata,
                        step.scale, kv_scales=(ks, vs))
    r, p = step.rows, step.rows.num_prefill_tokens
    k, v = step.k[:p], step.v[:p]
    ref = torch.cat([
        prefill_attention_ref(step.q[:p], k, v, r.cu_seqlens, step.scale, want[1, 0], want[1, 1],
                              r.prefill_block_tables, r.prefix_lens, ks, vs),
        paged_decode_ref(step.q[p:], want[1, 0], want[1, 1], r.decode_block_tables, r.context_lens, step.scale,
                         ks, vs)])
    _check_rows(out[: step.real], ref[: step.real].float(), dtype, f"{kind} {fp8}")
    # padding writes of eager/sdpa land in the scratch block: only the real blocks are specified
    assert torch.equal(got[:, :, :NUM_BLOCKS].view(torch.uint8), want[:, :, :NUM_BLOCKS].view(torch.uint8)), \
        f"{kind} {fp8}: the cache after the step"


@pytest.mark.parametrize("pad", [0, 3], ids=["eager", "graph"])
@pytest.mark.parametrize("kind,dtype", CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_short_chunks_step(kind, dtype, pad):
    """A step of short chunks alone (at most TOKEN_ROWS_MAX tokens each: the triton backend attends
    them as decode rows, models/attention/triton_backend.py `token_rows`) against dense attention,
    eagerly and, for triton, through graph_metadata over a graph's padded rows (`pad` tokens in no
    chunk, cu_seqlens and the chunk rows padded as PrefillGraphs fills them)."""
    from models.attention.triton_backend import TOKEN_ROWS_MAX

    assert max(n for _, n in SHORT_CHUNKS) <= TOKEN_ROWS_MAX
    step = _build(4, 2, 64, dtype, chunks=SHORT_CHUNKS, decodes=[9], seed=5)
    backend = _backend(kind, 64, 2)
    if kind == "triton":  # the path under test, not the prefill kernel's (whose tile map is not built)
        assert backend.metadata(step.rows).token_rows is not None
        assert backend.prefill_arrays(step.rows.chunk_lens, step.rows.chunk_prefix, torch.device(DEVICE)) == {}
    if not pad or not kind.startswith("triton"):
        out, storage = step.run(kind, 64)
        _check_out(out, step, dtype, kind)
        _check_cache(storage, step.want_storage, kind)
        return
    # graph form: the chunks' tokens then `pad` padding tokens; no decode rows (a verification graph
    # takes decodes as one-token chunks)
    nc, p = len(SHORT_CHUNKS), step.rows.num_prefill_tokens
    T, max_chunks = p + pad, nc + 2
    r = step.rows
    cu = torch.full((max_chunks + 1,), p, dtype=torch.int32)
    cu[: nc + 1] = r.cu_seqlens
    prefix = torch.zeros(max_chunks, dtype=torch.int32)
    prefix[:nc] = r.prefix_lens
    tables = torch.zeros(max_chunks, MAX_BLOCKS, dtype=torch.int32)
    tables[:nc] = r.prefill_block_tables
    g = _gen("short-graph-padding")
    extra = lambda t: torch.randn(pad, *t.shape[1:], generator=g).to(dtype)  # noqa: E731
    q, k, v = (torch.cat([t[:p], extra(t)]) for t in (step.q, step.k, step.v))
    slots = torch.cat([r.slot_mapping[:p], torch.full((pad,), -1, dtype=torch.int32)])
    rows = StepRows(slots, T, cu_seqlens=cu, prefix_lens=prefix, prefill_block_tables=tables)
    n = backend.graph_tiles(T, max_chunks, torch.device(DEVICE), max_chunk_len=TOKEN_ROWS_MAX)
    assert (n == 0) == (kind == "triton")  # decode rows need no tile map; the deterministic mode's kernel does
    tiles = None
    if n:
        tile_seq, tile_start = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        backend.fill_graph_tiles(T, r.chunk_lens, r.chunk_prefix, tile_seq, tile_start)
        tiles = (torch.from_numpy(tile_seq).to(DEVICE), torch.from_numpy(tile_start).to(DEVICE))
    out, storage = _forward(backend, q, k, v, step.storage, rows,
                            lambda b, rr: b.graph_metadata(rr, T, tiles, max_chunk_len=TOKEN_ROWS_MAX), step.scale)
    _check_rows(out[:p], step.ref[:p], dtype, f"{kind} graph")
    want = step.storage.clone()
    kv_write_ref(step.k[:p], step.v[:p], want[1, 0], want[1, 1], r.slot_mapping[:p])
    _check_cache(storage, want, f"{kind} graph")


def test_token_rows_of_a_padded_graph_step():
    """Each token's page table row and context (its position + 1); padding tokens (past cu_seqlens'
    last entry) take context 1 and the last chunk row."""
    from models.attention.triton_backend import token_rows

    cu = torch.tensor([0, 5, 6, 9, 9, 9], dtype=torch.int32)  # 3 chunks, 2 padding chunk rows
    prefix = torch.tensor([21, 40, 3, 0, 0], dtype=torch.int32)
    tables = torch.arange(5, dtype=torch.int32)[:, None].repeat(1, 4) * 10
    bt, ctx = token_rows(cu, prefix, tables, 12)
    assert ctx.tolist() == [22, 23, 24, 25, 26, 41, 4, 5, 6, 1, 1, 1] and ctx.dtype == torch.int32
    assert bt[:, 0].tolist() == [0, 0, 0, 0, 0, 10, 20, 20, 20, 40, 40, 40]


@pytest.mark.parametrize("kind", ["eager", "sdpa"])
def test_torch_backends_have_no_prefill_graphs(kind):
    backend = make_backend(kind, 64)
    assert backend.name == kind
    assert backend.prefill_graphs is False
    assert backend.graph_tiles(64, 16, torch.device("cpu")) == 0
    step = _build(4, 2, 64, torch.float32, decodes=[])
    with pytest.raises(NotImplementedError):
        backend.graph_metadata(step.rows, 64, None)


def test_triton_eager_tile_map_lists_each_query_tile_once():
    """An eager step's tile map (prefill_arrays): every query tile of every chunk exactly once,
    none idle, the most work (cached prefix + first position) first, at the positions per tile
    the kernel will use for the longest chunk and the GQA group."""
    from kernels.flash_prefill import block_m

    backend = make_backend("triton", 128, 4)
    lens, prefix = [1, 70, 33, 200, 64], [0, 5, 0, 100, 900]
    arrays = backend.prefill_arrays(lens, prefix, torch.device("cpu"))
    seqs, starts = arrays["tile_seq"], arrays["tile_start"]
    bm = block_m(128, max(lens), torch.device("cpu"), 4)
    assert sorted(zip(seqs.tolist(), starts.tolist())) == sorted(
        (s, t) for s, n in enumerate(lens) for t in range(0, n, bm))
    work = [prefix[s] + t for s, t in zip(seqs, starts)]
    assert work == sorted(work, reverse=True)


def test_triton_backend_has_prefill_graphs():
    backend = make_backend("triton", 64)
    assert backend.name == "triton" and backend.prefill_graphs is True


def test_deterministic_needs_triton():
    with pytest.raises(ValueError, match="deterministic mode needs the triton attention backend"):
        make_backend("sdpa", 64, deterministic=True)


def test_unknown_backend():
    with pytest.raises(ValueError, match="'nope'") as err:
        make_backend("nope", 64)
    for kind in BACKENDS:
        assert kind in str(err.value)
    assert set(BACKENDS) == {"triton", "eager", "sdpa"}
