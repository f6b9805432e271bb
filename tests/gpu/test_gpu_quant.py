"""Quantized checkpoints on a GPU (skipped without CUDA), every format of
benchmarks/quant/quant_checkpoint.py on a small Llama (bf16, Triton attention):

- the GPU paths (FP8 on FP8 tensor cores with the norm's and silu_mul's fused quantization, the
  GEMVs at one row (of the 16-bit row: gemms.ONE_ROW_W8A16), the split tiles up to 16 rows, torch._scaled_mm and the Triton FP8 GEMM past
  them; int4 dequantized in registers, or into memory for cuBLAS; FP8 weight-only, the A100's path,
  forced) give the logits of the model dequantized at load, within the error of FP8 activations
  (w8a8) or of bf16 (weight-only), at 1, 13 and 200 tokens;
- a quantized linear's rows depend on their own row only (a CUDA graph's padding rows, NaN
  included, change no bit of the others), and a decode step replayed from a CUDA graph gives the
  eager step's hidden states bit for bit, after its inputs changed too;
- the engine with CUDA graphs and asynchronous scheduling gives the greedy tokens it gives eagerly,
  and speculative decoding (a quantized draft) those of decoding without it, up to the
  dequantized reference's near-ties;
- the decode GEMVs at the Llama-3.1-8B linears' sizes (K splits) against a float32 reference;
- --deterministic serves a quantized checkpoint dequantized at load: the tokens of a 16-bit
  checkpoint holding the same weights;
- the weights keep their quantized bytes on the device."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = ("fp8-dynamic", "fp8-static", "fp8-block", "w4a16", "w4a16-asym", "awq", "gptq", "gptq-desc-act")
LLAMA = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2816,
             num_hidden_layers=3, vocab_size=2048, max_position_embeddings=1024, initializer_range=0.02)
I32 = dict(dtype=torch.int32, device="cuda")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from benchmarks.quant.quant_checkpoint import quantize_checkpoint
    from tests.helpers import make_llama_checkpoint

    root = tmp_path_factory.mktemp("gpu-quant")
    src = make_llama_checkpoint(root / "src", "llama", **LLAMA)
    return src, {fmt: (root / fmt, quantize_checkpoint(src, root / fmt, fmt, device="cuda")) for fmt in FORMATS}


def _cache(model, blocks: int):
    from kvcache import CacheSpec, allocate_kv_cache

    s = model.spec
    return allocate_kv_cache(CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, 16, torch.bfloat16), blocks, "cuda")


def _prefill(model, ids, caches=None, first_block: int = 0):
    """One prompt's prefill through the model (Triton attention): its K/V written to the blocks from
    first_block on, of `caches` or of a fresh cache (a chunk of up to 8 tokens attends through the
    cache: models/attention/triton_backend.py's token rows); fp32 logits."""
    from models import StepRows

    n, nb = len(ids), -(-len(ids) // 16) + 1
    table = torch.arange(first_block, first_block + nb, **I32)
    pos = torch.arange(n, device="cuda")
    slots = (table[pos // 16] * 16 + pos % 16).to(torch.int32)
    caches = caches if caches is not None else _cache(model, first_block + nb)
    rows = StepRows(slots, n, torch.tensor([0, n], **I32), torch.zeros(1, **I32), table[None], [n], [0])
    with torch.no_grad():
        hidden = model.forward(torch.tensor(ids, device="cuda"), pos, caches, model.attention.metadata(rows))
        return model.lm_head(hidden)[:, : model.vocab_size].float()


def _load(path, monkeypatch, mode=None):
    import models.quant as quant
    from models import load_model

    if mode:
        monkeypatch.setattr(quant, "compute_mode", lambda *a: mode)
    model = load_model(path, torch.bfloat16, "cuda", "triton")
    monkeypatch.undo()
    return model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("forced", [None, "weight_only"])
def test_gpu_paths_match_the_dequantized_model(checkpoints, monkeypatch, fmt, forced):
    from models import weights_info

    if forced and not fmt.startswith("fp8"):
        pytest.skip("int4 is weight-only already")
    path, _ = checkpoints[1][fmt]
    dense, ours = _load(path, monkeypatch, "dequant"), _load(path, monkeypatch, forced)
    linear = ours.layers[0].self_attn.qkv_proj
    assert linear.quant is not None and linear.quant.mode == (forced or ("w8a8" if fmt.startswith("fp8") else
                                                                          "weight_only"))
    if fmt == "fp8-dynamic" and not forced:
        assert linear.scaled_mm  # per-channel scales, bf16: torch._scaled_mm's rowwise mode
    assert weights_info(ours).bytes < 0.7 * weights_info(dense).bytes
    w8a8 = fmt.startswith("fp8") and not forced
    for n in (200, 13, 1):  # past the decode kernels, the split tiles, the GEMVs
        ids = torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        want, got = _prefill(dense, ids), _prefill(ours, ids)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < (0.1 if w8a8 else 0.02), (n, err)
        # (a random model with transformers' initializer range: its logits are close, near-ties many;
        # FP8 activations move them by their ~3% a linear, and at 13 tokens fp8-static and fp8-block
        # agreed at 8 on an H200: a flip within the error bounded above is a near-tie, by that bound)
        agree = (got.argmax(-1) == want.argmax(-1)).sum().item()
        assert agree >= (0.5 if w8a8 else 0.97) * n - 1, (n, agree)


def test_one_token_reaches_every_fp8_gemv_in_16_bits(checkpoints, monkeypatch):
    """gemms.ONE_ROW_W8A16 on CUDA, where the norms and silu_mul fuse the next linear's quantization:
    at one token they write 16-bit rows, and every FP8 GEMV reads its row unquantized (weight_only)."""
    import models.quant.gemms as gemms

    model = _load(checkpoints[1]["fp8-dynamic"][0], monkeypatch)
    picks, gemv = [], gemms.fp8_gemv
    monkeypatch.setattr(gemms, "fp8_gemv", lambda *a, **kw: picks.append(kw.get("weight_only", False))
                        or gemv(*a, **kw))
    _prefill(model, [5])
    assert picks == [True] * 4 * model.spec.num_layers, picks  # qkv, o, gate/up, down a layer


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-static", "fp8-block", "awq", "gptq-desc-act"])
def test_a_quantized_linears_rows_depend_on_their_row_only(checkpoints, monkeypatch, fmt):
    # 13 rows alone and padded to 16 as a decode graph pads them (here with NaN and huge rows):
    # the same kernels and tiles, and every row's bits the same; for FP8 activations quantized by
    # the linear (o_proj's input), and by the norm before it (QuantizedInput)
    from kernels.fp8_quant import quant_fp8
    from models.quant import QuantizedInput

    model = _load(checkpoints[1][fmt][0], monkeypatch)
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        x = torch.randn(16, linear.in_features, device="cuda", dtype=torch.bfloat16)
        x[13], x[14], x[15] = float("nan"), 3e4, 0.0
        with torch.no_grad():
            assert torch.equal(linear(x)[:13], linear(x[:13].contiguous())), (fmt, linear.out_features)
            fmt_in = linear.quant.activation_format(linear, 13)
            if fmt_in is not None:
                q, s = quant_fp8(x, fmt_in.group, fmt_in.static_scale)
                assert torch.equal(linear(QuantizedInput(q, s))[:13],
                                   linear(QuantizedInput(q[:13].contiguous(), s[:13].contiguous())))


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-static", "fp8-block", "awq", "gptq-desc-act"])
@pytest.mark.parametrize("rows,size", [(13, 16), (1, 1)])
def test_a_decode_graph_replays_the_eager_step_bit_for_bit(checkpoints, monkeypatch, fmt, rows, size):
    """A decode step captured as server/worker/cuda_graphs.py captures it (static buffers, padding
    rows that write nowhere and attend to one token of block 0), replayed, against the same step
    run eagerly over the same buffers; then again after the inputs changed (next step, other
    sequences' lengths): what a graph bakes in at capture (a scale, a buffer, a split plan read
    from values) would part them."""
    from models import StepRows

    model = _load(checkpoints[1][fmt][0], monkeypatch)
    caches = _cache(model, 16 * 20)
    gen = torch.Generator().manual_seed(rows)
    lens = [int(v) for v in torch.randint(5, 200, (rows,), generator=gen)]
    tables = []
    for i, n in enumerate(lens):  # sequence i's K/V in blocks 20i .. 20i + 19
        _prefill(model, torch.randint(0, 2048, (n,), generator=gen).tolist(), caches, 20 * i)
        tables.append(torch.arange(20 * i, 20 * i + 20, **I32))
    ids, pos = torch.zeros(size, dtype=torch.int64, device="cuda"), torch.zeros(size, dtype=torch.int64, device="cuda")
    slots, ctx, bt = torch.full((size,), -1, **I32), torch.ones(size, **I32), torch.zeros(size, 20, **I32)

    def fill(step):
        for i, n in enumerate(lens):
            p = n + step
            ids[i], pos[i], ctx[i] = (7 * i + 3 * step) % 2048, p, p + 1
            slots[i], bt[i] = tables[i][p // 16] * 16 + p % 16, tables[i]

    def forward():
        meta = model.attention.metadata(StepRows(slots, 0, context_lens=ctx, decode_block_tables=bt))
        return model.forward(ids, pos, caches, meta)

    with torch.no_grad():
        fill(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(), forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        for step in range(4):  # consecutive: each step attends to the K/V the steps before wrote
            fill(step)
            eager = forward().clone()
            graph.replay()
            assert torch.equal(out[:rows], eager[:rows]), (fmt, rows, step)


def _assert_equal_up_to_near_ties(checkpoints, fmt, prompts, want, got, min_exact):
    """Each pair of greedy sequences equal, or parted where the dequantized reference's two best
    tokens are within FP8 activations' error (w8a8) or bf16's (weight-only) of each other; at least
    `min_exact` of the pairs equal."""
    from tests.models.test_quant import reference

    src, formats = checkpoints
    ref = reference(src, formats[fmt][1]).cuda()
    tie = 0.1 if fmt.startswith("fp8") else 0.02
    exact = 0
    for prompt, a, b in zip(prompts, want, got):
        if a == b:
            exact += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + a[:i]], device="cuda")).logits[0, -1]
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < tie * logits.abs().max().item(), f"parted at token {i} where the logits differ by {gap:.3f}"
    assert exact >= int(min_exact * len(prompts)), f"{exact} of {len(prompts)} identical"


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "awq"])
def test_cuda_graphs_give_the_eager_tokens_up_to_near_ties(checkpoints, fmt):
    """The engine with CUDA graphs, asynchronous scheduling and chunked prefill against the same
    engine run eagerly, with the same token budget (the same steps). Graphs pad a step's rows, and
    cuBLAS and the attention kernel pick their kernels and splits by row count, so a padded step's
    sums can differ from the eager step's in their last bits; FP8 activations turn a last-bit
    difference into a different rounding of a whole row (its scale moves), so sequences may part
    at the dequantized reference's near-ties. Bugs in what a graph captures are pinned down bit for
    bit by the two tests above; this one checks the engine's assembly of them. How many pairs stay
    equal is asked of AWQ alone: with FP8 activations one moved scale reaches every later token,
    and on an H200 1 of the 13 pairs stayed equal (each parting at a near-tie)."""
    from tests.gpu.test_gpu_parity import _prompts, _run

    path = checkpoints[1][fmt][0]
    prompts = _prompts(12, 1, 200) + [[7]]
    kw = dict(attention="triton", dtype="bfloat16", max_num_batched_tokens=256)
    eager = _run(path, prompts, enforce_eager=True, async_scheduling=False, **kw)
    _assert_equal_up_to_near_ties(checkpoints, fmt, prompts, eager, _run(path, prompts, **kw),
                                  0.0 if fmt.startswith("fp8") else 0.5)


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "awq"])
def test_speculative_decoding_with_a_quantized_target(checkpoints, fmt):
    """A quantized target verifying a quantized draft's proposals (the same checkpoint: nearly all
    stand) in its verification graphs: the greedy tokens of decoding without speculation, up to
    near-ties (a verification scores k + 1 rows where a decode scores one: other GEMMs, whose last
    bits move an FP8 row's scale; as above, the count of equal pairs is asked of AWQ alone: 0 of 8
    with fp8-dynamic on an H200, each parting at a near-tie)."""
    from server.config import SpeculativeConfig
    from tests.gpu.test_gpu_parity import _prompts, _run

    path = checkpoints[1][fmt][0]
    prompts = _prompts(8, 1, 100, seed=3)
    kw = dict(attention="triton", dtype="bfloat16")
    spec = SpeculativeConfig.parse(f'{{"method": "draft_model", "model": "{path}", "num_speculative_tokens": 3}}')
    _assert_equal_up_to_near_ties(checkpoints, fmt, prompts, _run(path, prompts, **kw),
                                  _run(path, prompts, speculative_config=spec, **kw), 0.0 if fmt.startswith("fp8") else 0.5)


@pytest.mark.parametrize("linear", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
def test_decode_gemvs_at_the_8b_linears(linear):
    from benchmarks.quant.bench_quant import linear_shapes
    from kernels.fp8_quant import quant_fp8
    from kernels.quant_reference import dequant_int4, pack_int4, quant_fp8_ref
    from models.quant.gemms import QuantizedInput, fp8_linear, weight_only_linear

    n, k = linear_shapes("llama-3.1-8b")[linear]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    for group in (1 << 30, 128):
        w8, ws = quant_fp8_ref(w, group)
        q, s = quant_fp8(x, group)
        want = (q.float() * (s.repeat_interleave(128, 1)[:, :k] if group == 128 else s)) @ \
            (w8.float() * (ws.repeat_interleave(128, 1)[:, :k] if group == 128 else ws)).t()
        got = fp8_linear(QuantizedInput(q, s), w8, ws, group, group, None, torch.bfloat16, None, False)
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
        # a 16-bit row is read as it is (gemms.ONE_ROW_W8A16): times the dequantized weight
        want = x.float() @ (w8.float() * (ws.repeat_interleave(128, 1)[:, :k] if group == 128 else ws)).t()
        got = fp8_linear(x, w8, ws, group, group, None, torch.bfloat16, None, False)
        torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    q4 = pack_int4(torch.randint(0, 16, (n, k), device="cuda", generator=gen))
    s4 = torch.rand(n, k // 128, device="cuda", generator=gen) * 0.002
    z4 = torch.randint(0, 16, (n, k // 128), device="cuda", generator=gen).to(torch.uint8)
    want = x.float() @ dequant_int4(q4, s4, z4, 128, torch.float32).t()
    got = weight_only_linear(x, q4, s4, z4, 128, None)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def test_deterministic_mode_serves_the_dequantized_weights(checkpoints, tmp_path):
    from tests.gpu.test_gpu_parity import _prompts, _run
    from tests.models.test_quant import reference

    src, formats = checkpoints
    path, deq = formats["awq"]
    ref = reference(src, deq).to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (tmp_path / "dense" / name).write_bytes((src / name).read_bytes())
    prompts = _prompts(6, 1, 100)
    kw = dict(attention="triton", dtype="bfloat16", deterministic=True)
    assert _run(path, prompts, **kw) == _run(tmp_path / "dense", prompts, **kw)
