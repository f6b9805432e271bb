"""Quantized checkpoints (models/quant) on the CPU, each format written in its own layout by
benchmarks/quant/quant_checkpoint.py from one random Llama checkpoint:

- the production loader's logits equal, to fp32 rounding, those of a transformers model built from
  the dequantized weights (the CPU dequantizes at load; the tolerance is the family tests' 2e-4);
- the format's own library reads the same weights from the file: compressed-tensors' decompression
  (and transformers' loading, where its integration runs here: FP8 and symmetric W4A16 through
  compressed-tensors, the 128x128-block format through its FineGrainedFP8 dequantization), AWQ
  through compressed-tensors' AutoAWQ converter, GPTQ through the format's dequantization formula
  written out element by element;
- the GPU's compute paths, forced on the CPU (Triton kernels under the interpreter, and
  torch._scaled_mm's CPU implementation): logits within the activation quantization's error;
- the storage a quantized linear keeps (its real bytes), --quantization fp8 at load, GPT-2's
  Conv1D weights, and what is refused by name.
The HTTP side is in test_quant_http.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import models.quant as quant
from benchmarks.quant.quant_checkpoint import FORMATS, quantize_checkpoint
from models import load_model, weights_info
from models.quant import compute_mode, detect
from tests.helpers import QUANT_LLAMA as LLAMA
from tests.helpers import make_checkpoint, make_llama_checkpoint, prefill_logits

IDS = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture
def src(quant_src):  # tests/models/conftest.py: shared with test_quant_http.py
    return quant_src


@pytest.fixture(scope="module")
def calm_src(tmp_path_factory):  # one layer: the interpreter runs every GEMM of the forced paths
    return make_llama_checkpoint(tmp_path_factory.mktemp("calm16"), "llama", initializer_range=0.02,
                                 num_hidden_layers=1, **LLAMA)


# what the start-up log and /v1/models call each format (weights_info(...).quantization)
NAMES = {"fp8-dynamic": "compressed-tensors FP8_DYNAMIC", "fp8-static": "compressed-tensors FP8 (static)",
         "w4a16": "compressed-tensors W4A16 (symmetric)", "w4a16-asym": "compressed-tensors W4A16 (asymmetric)",
         "fp8-block": "fp8 (128x128 blocks)", "awq": "AWQ", "gptq": "GPTQ", "gptq-desc-act": "GPTQ",
         "online-fp8": "fp8 (quantized at load"}


def reference(src, deq) -> torch.nn.Module:
    """transformers' model of the source checkpoint with the dequantized weights in place."""
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = ref.state_dict()
    assert set(deq) <= set(state)
    state.update(deq)
    ref.load_state_dict(state)
    return ref


def ref_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_equal_the_dequantized_reference(src, quantized, fmt):
    path, deq = quantized[fmt]
    ours = load_model(path, torch.float32, "cpu", "sdpa")
    assert weights_info(ours).quantization.startswith(NAMES[fmt])
    if fmt.startswith("gptq"):
        assert ("no desc_act" in weights_info(ours).quantization) == (fmt == "gptq")
    want = ref_logits(reference(src, deq))
    torch.testing.assert_close(prefill_logits(ours, IDS), want, atol=2e-4, rtol=2e-4)
    # and the quantization did something: the 16-bit model's logits are elsewhere
    assert not torch.allclose(prefill_logits(load_model(src, torch.float32, "cpu", "sdpa"), IDS), want, atol=1e-2)


def _ct_decompressed(path) -> dict[str, torch.Tensor]:
    """Every linear's weight as compressed-tensors' own compressors decompress it."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    import json

    qcfg = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    compressor = PackedQuantizationCompressor if qcfg.format == "pack-quantized" else NaiveQuantizationCompressor
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("weight_packed", "weight") and f"{prefix}.weight_scale" in tensors:
            local = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == prefix}
            out[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return out


def _gptq_formula(path) -> dict[str, torch.Tensor]:
    """GPTQ's dequantization written element by element from the format's definition: input row k of
    column n is nibble k % 8 of qweight[k // 8, n]; its group g = g_idx[k]; the zero is nibble n % 8
    of qzeros[g, n // 8] plus one (v1); w[n, k] = (q - zero) * scales[g, n]."""
    from safetensors.torch import load_file

    t = load_file(path / "model.safetensors")
    out = {}
    for name in t:
        if name.endswith(".qweight"):
            p = name.removesuffix(".qweight")
            qw, qz, sc, gi = (t[f"{p}.{leaf}"].long() if leaf != "scales" else t[f"{p}.{leaf}"].float()
                              for leaf in ("qweight", "qzeros", "scales", "g_idx"))
            k, n = qw.shape[0] * 8, qw.shape[1]
            kk, nn = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
            q = (qw[kk // 8, nn] >> (4 * (kk % 8))) & 15
            g = gi[kk]
            zero = (((qz[g, nn // 8] >> (4 * (nn % 8))) & 15) + 1) & 15
            out[f"{p}.weight"] = ((q - zero).float() * sc[g, nn]).t()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_formats_own_library_reads_the_same_weights(quantized, fmt, tmp_path):
    path, deq = quantized[fmt]
    if fmt.startswith(("fp8-dynamic", "fp8-static", "w4a16")):
        got = _ct_decompressed(path)
    elif fmt == "awq":  # compressed-tensors' converter of AutoAWQ checkpoints, then its decompression
        from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from safetensors.torch import load_file

        converted = AutoAWQConverter().process(load_file(path / "model.safetensors"))
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=128))
        got = {}
        for name in converted:
            if name.endswith(".weight_packed"):
                p = name.removesuffix(".weight_packed")
                local = {k.rpartition(".")[2]: v for k, v in converted.items() if k.rpartition(".")[0] == p}
                got[f"{p}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    elif fmt.startswith("gptq"):
        got = _gptq_formula(path)
    else:  # fp8-block: transformers' FineGrainedFP8, which dequantizes on a machine without a GPU (to bf16)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        got = {k: v.float() for k, v in hf.state_dict().items() if k in deq}
        deq = {k: v.to(torch.bfloat16).float() for k, v in deq.items()}
    assert set(got) == set(deq)
    for name, w in deq.items():
        torch.testing.assert_close(got[name], w, atol=1e-6, rtol=1e-2, msg=name)


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-static", "w4a16"])
def test_transformers_loads_the_compressed_tensors_files(src, quantized, fmt):
    """transformers' compressed-tensors integration (on the CPU it decompresses at the first forward):
    the same weights, and for weight-only W4A16 the same logits (for FP8 it also fake-quantizes each
    linear's input, which flashpage's CPU path does not). Its asymmetric W4A16 is not checked here:
    transformers 5.24 with compressed-tensors 0.20 expects the zero point unpacked, [N, groups],
    where compressed-tensors writes it packed, [N / 8, groups] (test above)."""
    path, deq = quantized[fmt]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = ref_logits(hf)
    for name, w in deq.items():
        torch.testing.assert_close(hf.get_submodule(name.removesuffix(".weight")).weight.float(), w,
                                   atol=1e-6, rtol=1e-2, msg=name)
    if fmt == "w4a16":
        torch.testing.assert_close(got, prefill_logits(load_model(path, torch.float32, "cpu", "sdpa"), IDS),
                                   atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fmt,mode,dtype", [("fp8-dynamic", "w8a8", torch.bfloat16),  # torch._scaled_mm (CPU)
                                            ("fp8-block", "w8a8", torch.float32),  # kernels/fp8_matmul.py
                                            ("fp8-static", "w8a8", torch.float32),
                                            ("fp8-dynamic", "weight_only", torch.bfloat16),  # kernels/dequant.py
                                            # int4 (g_idx: the gather AWQ's plain groups skip; both in
                                            # test_quant_gemms.py at every row count)
                                            ("gptq-desc-act", "weight_only", torch.float16)])
def test_gpu_compute_paths_forced_on_the_cpu(calm_src, monkeypatch, tmp_path, fmt, mode, dtype):
    """The linear methods' GPU paths (Triton kernels under the interpreter): the quantized storage is
    kept (its real bytes) and the logits stay within the error of 16-bit activations (weight-only)
    or FP8 activations (w8a8, ~3% per linear) of the dequantized model's. (A model with transformers'
    own initializer range: at 0.2 a random model amplifies any rounding, bf16's included, tenfold.)"""
    path = tmp_path / fmt
    quantize_checkpoint(calm_src, path, fmt)
    monkeypatch.setattr(quant, "compute_mode", lambda *a: mode)
    ours = load_model(path, dtype, "cpu", "sdpa")
    monkeypatch.undo()
    dense = load_model(path, dtype, "cpu", "sdpa")  # dequantized at load
    assert weights_info(ours).bytes < 0.75 * weights_info(dense).bytes
    want = prefill_logits(dense, IDS[:24])
    got = prefill_logits(ours, IDS[:24])
    err = (got - want).abs().max() / want.abs().max()
    assert err < (0.1 if mode == "w8a8" else 0.03), err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > (0.8 if mode == "w8a8" else 0.95)


def test_int4_gemvs_after_a_norm_take_the_half2_loop(calm_src, monkeypatch, tmp_path):
    """The linears that read an RMSNorm's output (qkv_proj, gate_up_proj) carry the norm's bound on
    their input, sqrt(K) * max|w|, and their one-row int4 GEMVs take the plain half2 loop; o_proj and
    down_proj (no such bound) take it with its per-step scaling (gemms.HALF2_PRESCALE, the default),
    or the fp32 loop without. A one-token prefill through each (the interpreter runs the loops) stays
    within weight-only error of the dequantized model."""
    import math

    import models.quant.gemms as gemms

    path = tmp_path / "awq"
    quantize_checkpoint(calm_src, path, "awq")
    monkeypatch.setattr(quant, "compute_mode", lambda *a: "weight_only")
    ours = load_model(path, torch.bfloat16, "cpu", "sdpa")
    monkeypatch.undo()
    layer = ours.layers[0]
    for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                         (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
        assert linear.input_bound == math.sqrt(linear.in_features) * norm.weight.abs().max().item()
    assert not hasattr(layer.self_attn.o_proj, "input_bound") and not hasattr(layer.mlp.down_proj, "input_bound")
    picks, gemv = [], gemms.wo_gemv
    monkeypatch.setattr(gemms, "wo_gemv", lambda *a, **kw: picks.append((a[1].shape[0], kw["half2"], kw["prescale"]))
                        or gemv(*a, **kw))
    want = prefill_logits(load_model(path, torch.bfloat16, "cpu", "sdpa"), IDS[:1])  # dequantized at load
    assert gemms.HALF2_PRESCALE
    rows = layer.self_attn.qkv_proj.out_features, 2 * LLAMA["intermediate_size"]  # (o_proj's, down_proj's: hidden)
    for prescale in (True, False):
        monkeypatch.setattr(gemms, "HALF2_PRESCALE", prescale)
        picks.clear()
        got = prefill_logits(ours, IDS[:1])
        bounded = sorted(p for p in picks if p[0] in rows)
        assert bounded == sorted((n, True, False) for n in rows), picks  # qkv_proj, gate_up_proj
        others = [p[1:] for p in picks if p[0] not in rows]  # o_proj, down_proj: the fp32 loop unless prescaled
        assert others == [(prescale, True)] * 2, picks
        assert ((got - want).abs().max() / want.abs().max()).item() < 0.03


@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-block"])
def test_one_row_reaches_fp8_linears_in_16_bits(calm_src, monkeypatch, tmp_path, fmt):
    """gemms.ONE_ROW_W8A16: at one row a w8a8 linear reads its input unquantized (the norms and
    silu_mul before it then write 16-bit rows: takes_16_bit, add_rmsnorm_for and silu_mul_for,
    FP8 from two rows on), every linear's GEMV weight-only; a
    one-token prefill stays within weight-only error of the dequantized model. Off, each GEMV
    quantizes its row."""
    import models.quant.gemms as gemms

    path = tmp_path / fmt
    quantize_checkpoint(calm_src, path, fmt)
    monkeypatch.setattr(quant, "compute_mode", lambda *a: "w8a8")
    ours = load_model(path, torch.bfloat16, "cpu", "sdpa")
    monkeypatch.undo()
    want = prefill_logits(load_model(path, torch.bfloat16, "cpu", "sdpa"), IDS[:1])  # dequantized at load
    layer = ours.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert quant.takes_16_bit(qkv, 1) and not quant.takes_16_bit(qkv, 2) and quant.takes_16_bit(None, 2)
    # the fused launches before the linears (CUDA's; the interpreter runs them here): 16 bits at one row
    norm, hidden = layer.input_layernorm, qkv.in_features
    for rows in (1, 3):
        x, y = (torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(2))
        _, h = quant.add_rmsnorm_for(qkv, x, y, norm.weight.data, norm.eps)
        act = quant.silu_mul_for(layer.mlp.down_proj, torch.randn(rows, 2 * layer.mlp.down_proj.in_features
                                                                  ).to(torch.bfloat16))
        assert isinstance(h, quant.QuantizedInput) == isinstance(act, quant.QuantizedInput) == (rows > 1), rows
    picks, gemv = [], gemms.fp8_gemv
    monkeypatch.setattr(gemms, "fp8_gemv", lambda *a, **kw: picks.append(kw.get("weight_only", False))
                        or gemv(*a, **kw))
    for on in (True, False):
        monkeypatch.setattr(gemms, "ONE_ROW_W8A16", on)
        picks.clear()
        got = prefill_logits(ours, IDS[:1])
        assert picks == [on] * 4, picks  # (one layer: qkv, o, gate/up, down)
        assert ((got - want).abs().max() / want.abs().max()).item() < (0.03 if on else 0.1)
    assert not quant.takes_16_bit(qkv, 1)  # (the switch off)


def test_online_fp8_quantizes_a_16_bit_checkpoint_per_channel(src, quantized):
    ours = load_model(src, torch.float32, "cpu", "sdpa", quantization="fp8")
    assert weights_info(ours).quantization.startswith(NAMES["online-fp8"])
    _, deq = quantized["fp8-dynamic"]  # the writer's per-channel FP8: what --quantization fp8 computes
    torch.testing.assert_close(prefill_logits(ours, IDS), ref_logits(reference(src, deq)), atol=2e-4, rtol=2e-4)
    assert detect(src, "fp8").online and detect(src) is None


def test_dummy_weights_quantized_at_load_and_quantized_checkpoints_refused(src, quantized):
    """--load-format dummy with --quantization fp8 (a benchmark's FP8 model from config.json alone):
    the dummy 16-bit weights quantized per channel (the CPU then serves them dequantized); a
    quantized checkpoint's own tensors cannot be made up, so dummy refuses it by name."""
    from kernels.quant_reference import dequant_fp8
    from models.quant.fp8 import quantize_per_channel

    plain = load_model(src, torch.float32, "cpu", "sdpa", load_format="dummy")
    ours = load_model(src, torch.float32, "cpu", "sdpa", quantization="fp8", load_format="dummy")
    assert weights_info(ours).quantization.startswith(NAMES["online-fp8"])
    w = plain.layers[1].mlp.down_proj.weight
    assert torch.equal(ours.layers[1].mlp.down_proj.weight, dequant_fp8(*quantize_per_channel(w), 1 << 30, w.dtype))
    with pytest.raises(ValueError, match="--load-format dummy makes a 16-bit checkpoint's tensors"):
        load_model(quantized["awq"][0], torch.float32, "cpu", "sdpa", load_format="dummy")


def test_gpt2_conv1d_weights_quantized(tmp_path):
    """GPT-2 stores its projections as Conv1D [in, out]; quantized formats store [out, in]."""
    src = make_checkpoint(tmp_path / "gpt2", n_embd=128, n_head=2)
    refs = {}
    for fmt in ("fp8-dynamic", "gptq-desc-act"):
        refs[fmt] = ref_logits(reference(src, quantize_checkpoint(src, tmp_path / fmt, fmt)), IDS[:40])
        ours = load_model(tmp_path / fmt, torch.float32, "cpu", "sdpa")
        torch.testing.assert_close(prefill_logits(ours, IDS[:40]), refs[fmt], atol=2e-4, rtol=2e-4)
    online = load_model(src, torch.float32, "cpu", "sdpa", quantization="fp8")
    torch.testing.assert_close(prefill_logits(online, IDS[:40]), refs["fp8-dynamic"], atol=2e-4, rtol=2e-4)


def test_compute_mode_follows_the_device():
    assert compute_mode("cpu", None, False, "fp8") == "dequant"
    assert compute_mode("cuda", (9, 0), True, "fp8") == "dequant"  # --deterministic: the invariant 16-bit GEMM
    assert compute_mode("cuda", (9, 0), False, "fp8") == "w8a8"  # H100
    assert compute_mode("cuda", (8, 9), False, "fp8") == "w8a8"  # L4, RTX 4090
    assert compute_mode("cuda", (8, 0), False, "fp8") == "weight_only"  # A100: no FP8 tensor cores
    assert compute_mode("cuda", (8, 6), False, "fp8") == "weight_only"
    assert compute_mode("cuda", (9, 0), False, "int4") == "weight_only"


REFUSED = {
    "unknown method": ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    "awq 8-bit": ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "8-bit"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    "awq group 64": ({"quant_method": "awq", "bits": 4, "group_size": 64}, "group size 64"),
    "gptq 3-bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    "gptq marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
                    "'marlin'"),
    "fp8 per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    "fp8 blocks 64": ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "[64, 64]"),
    "fp8 skips a layer": ({"quant_method": "fp8", "weight_block_size": [128, 128],
                           "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_variants_are_refused_by_name(tmp_path, src, case):
    import json
    import shutil

    qcfg, words = REFUSED[case]
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    with pytest.raises(ValueError, match="not supported") as e:
        load_model(tmp_path / "m", torch.float32, "cpu", "sdpa")
    assert words in str(e.value)


def test_compressed_tensors_variants_are_refused_by_name(quantized, tmp_path):
    import json
    import shutil

    path, _ = quantized["w4a16"]
    for edit, words in [(lambda g: g["weights"].update(group_size=32), "group size 32"),
                        (lambda g: g["weights"].update(num_bits=8), "int8"),
                        (lambda g: g["weights"].update(strategy="channel", group_size=None), "strategy 'channel'"),
                        (lambda g: g["weights"].update(actorder="group"), "cannot read")]:
        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        shutil.copytree(path, tmp_path / "m")
        config = json.loads((tmp_path / "m" / "config.json").read_text())
        edit(config["quantization_config"]["config_groups"]["group_0"])
        (tmp_path / "m" / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="not supported") as e:
            load_model(tmp_path / "m", torch.float32, "cpu", "sdpa")
        assert words in str(e.value), str(e.value)


def test_quantization_flag_must_agree_with_the_checkpoint(src, quantized):
    with pytest.raises(ValueError, match="does not match --quantization fp8"):
        detect(quantized["awq"][0], "fp8")
    with pytest.raises(ValueError, match="this one is 16-bit"):
        detect(src, "gptq")
    assert detect(quantized["awq"][0], "awq").method == "awq"


def _speculating(path, spec_json: str, lengths: tuple[int, ...], seed: int):
    """Greedy tokens of `path` over random prompts of `lengths` with the speculative config and
    without it (each run leaving no block behind), and the speculating engine."""
    from server.config import EngineConfig, SpeculativeConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(spec=None):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=64, speculative_config=spec))
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.block_manager.check_all_free()
        return outs, engine

    got, engine = run(SpeculativeConfig.parse(spec_json))
    return got, run()[0], engine


def test_speculative_decoding_with_a_quantized_target(quantized):
    """An AWQ target verifying the proposals of a draft model that is itself quantized (the same AWQ
    checkpoint, so nearly every proposal stands): the greedy tokens of decoding without
    speculation, no block lost. (The n-gram method verifies through the same target step.)"""
    path, _ = quantized["awq"]
    got, want, engine = _speculating(path, f'{{"method": "draft_model", "model": "{path}", "num_speculative_tokens": 3}}',
                                     (3, 17, 40), seed=5)
    assert got == want
    assert engine.speculator.proposer.runner.model.quant_scheme.method == "awq"
    c = engine.speculator.counters
    assert c.drafts > 0 and c.accepted_tokens >= 0.9 * c.draft_tokens  # the draft is the target


def test_a_16_bit_draft_quantized_at_load_by_the_speculative_configs_key(quant_src):
    """{"quantization": "fp8"} in a draft_model config (vLLM's key): the 16-bit draft is quantized at
    load as --quantization fp8 quantizes a target (its linears FP8 per channel), and verification
    keeps the 16-bit target's greedy tokens, no block lost. The draft is the target's own checkpoint,
    its weights rounded to FP8: a random model's near-ties make FP8 change the best token often (39%
    of its proposals stood here, where an unrelated draft's would stand by chance, 1 in 512)."""
    got, want, engine = _speculating(
        quant_src, f'{{"model": "{quant_src}", "num_speculative_tokens": 3, "quantization": "fp8"}}', (4, 23), seed=6)
    assert got == want
    draft = engine.speculator.proposer.runner.model
    assert draft.quant_scheme.method == "fp8" and getattr(engine.runner.model, "quant_scheme", None) is None
    c = engine.speculator.counters
    assert c.drafts > 0 and c.accepted_tokens >= 0.2 * c.draft_tokens
