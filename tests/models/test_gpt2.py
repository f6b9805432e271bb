"""Our GPT-2 against transformers' GPT2LMHeadModel, through the production loader."""

import pytest
import torch
from tests.helpers import make_checkpoint, prefill_logits
from transformers import GPT2LMHeadModel as HFModel

from models import load_model, load_tokenizer


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "small_ckpt"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_logits_match_transformers(ckpt, attention, request):
    path = request.getfixturevalue(ckpt)
    hf = HFModel.from_pretrained(path).eval()
    ours = load_model(path, torch.float32, "cpu", attention)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, hf.config.vocab_size, (37,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = prefill_logits(ours, ids, torch.float32)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def test_pytorch_bin_checkpoint_and_extra_config(tmp_path):
    # pytorch_model.bin instead of safetensors, relu MLP, scaled-by-layer attention.
    path = make_checkpoint(tmp_path, safetensors=False, activation_function="relu",
                           scale_attn_by_inverse_layer_idx=True, seed=5)
    assert (path / "pytorch_model.bin").exists() or (path / "model.safetensors").exists()
    hf = HFModel.from_pretrained(path).eval()
    ours = load_model(path, torch.float32, "cpu", "eager")
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, ids, torch.float32), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loads_and_stays_close(tiny_ckpt, dtype):
    hf = HFModel.from_pretrained(tiny_ckpt).eval()
    ours = load_model(tiny_ckpt, dtype, "cpu", "eager")
    assert ours.wte.weight.dtype == dtype
    ids = list(range(10, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = prefill_logits(ours, ids, dtype)
    err = (got - ref).norm() / ref.norm()
    assert err < 3e-2, err


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        from models import resolve_model_path

        resolve_model_path(str(tmp_path / "missing") + "/")
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    from models import load_config

    with pytest.raises(ValueError, match=r"model_type 'mamba' is not supported; flashpage serves: gpt2, llama, mistral, qwen2, qwen3"):
        load_config(tmp_path)


def test_tokenizer_loads(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    assert tok.decode(tok.encode("naïve café")) == "naïve café"
