"""EAGLE-3 heads (models/eagle3.py) in the published layout, loaded through the production loader:
the paged head's forward (prompt chunks over a cached prefix, a chained decode step fed its own
state) against the plain-PyTorch reference (models/eagle3_reference.py); the target's states as
transformers computes them (a Llama and a GPT-2 target), fused into each token's slot; the
layout's other spellings; and the refusals, each naming what does not fit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcache import CacheSpec, allocate_kv_cache
from models import StepRows, load_eagle3_head, load_model

BS = 16


def _load(target, head):
    model = load_model(target, torch.float32, "cpu", "sdpa")
    return model, load_eagle3_head(head, model, torch.float32, "cpu", "sdpa", 256)


def _reference(head):
    from transformers import LlamaConfig

    from models.eagle3_reference import Eagle3Reference

    ref = Eagle3Reference(LlamaConfig.from_pretrained(head)).float().eval()
    ref.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in load_file(head / "model.safetensors").items()})
    return ref


def _chunk(lo: int, hi: int, blocks: int) -> StepRows:
    """Positions lo..hi-1 of one sequence whose page table is blocks 0..blocks-1, as a prompt chunk."""
    m = hi - lo
    return StepRows(torch.arange(lo, hi, dtype=torch.int32), m, torch.tensor([0, m], dtype=torch.int32),
                    torch.tensor([lo], dtype=torch.int32), torch.arange(blocks, dtype=torch.int32)[None], [m], [lo])


def test_the_paged_head_matches_the_reference(eagle3_pair):
    target, path = eagle3_pair
    model, head = _load(target, path)
    ref = _reference(path)
    head.allocate(4, BS, 2)
    caches = allocate_kv_cache(CacheSpec(1, head.spec.num_kv_heads, head.spec.head_dim, BS, torch.float32), 4, "cpu")
    g = torch.Generator().manual_seed(0)
    n = 37  # positions 0..36 read tokens 1..37 (a chunk of 20, then one of 17 over its cached prefix)
    tokens = torch.randint(0, 512, (n + 2,), generator=g)
    aux = torch.randn(n, 3 * model.spec.hidden_size, generator=g)
    with torch.no_grad():
        head.features[:n] = head.fc(aux)
        out = torch.cat([head(tokens[lo + 1 : hi + 1], torch.arange(lo, hi), caches, head.attention.metadata(_chunk(lo, hi, 3)))
                         for lo, hi in ((0, 20), (20, n))])
        embed = model.embed_tokens
        want = ref.step(embed(tokens[1 : n + 1]), ref.fc(aux))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        logits = head.lm_head(out[-1:])  # keeps the row as the state the next step is fed
        draft = ref.logits(want[-1:])
        ids = torch.arange(draft.shape[1]) + ref.d2t
        torch.testing.assert_close(logits[:, ids], draft, rtol=1e-5, atol=1e-5)
        others = torch.ones(logits.shape[1], dtype=torch.bool)
        others[ids] = False
        assert torch.isneginf(logits[:, others]).all()  # only the draft vocabulary's ids can be chosen
        # a chained step at position n: its token with the state the head gave at n - 1
        rows = StepRows(torch.tensor([n], dtype=torch.int32), 0, context_lens=torch.tensor([n + 1], dtype=torch.int32),
                        decode_block_tables=torch.arange(3, dtype=torch.int32)[None])
        step = head(tokens[n + 1 :], torch.tensor([n]), caches, head.attention.metadata(rows))
        chained = ref.step(embed(tokens[1:]), torch.cat([ref.fc(aux), want[-1:]]))[-1:]
        torch.testing.assert_close(step, chained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_target_hands_over_the_states_transformers_computes(eagle3_pair, small_ckpt, tmp_path, family):
    """The residual stream entering the head's layers (transformers' hidden_states[j]: Llama's 0, 1
    and 3, GPT-2's 0, 1 and 2, its token and position embeddings at 0), fused by fc, lands in each
    token's slot row; padding rows (slot -1) in the scratch block's; a GPT-2 target's head embeds
    with its token table alone."""
    from transformers import AutoModelForCausalLM

    from benchmarks.shared.checkpoint import make_random_eagle3
    from tests.helpers import prefill_logits

    target, path = eagle3_pair
    layers = (0, 1, 3)
    if family == "gpt2":
        target, layers = small_ckpt, (0, 1, 2)
        path = make_random_eagle3(tmp_path / "head", target, draft_vocab_size=300, layer_ids=list(layers), std=0.2)
    model, head = _load(target, path)
    assert model.aux_layers == layers and model.aux_sink == head.keep_features
    assert head._target_embed[0] is (model.wte if family == "gpt2" else model.embed_tokens)
    head.allocate(4, BS, 2)
    ids = list(range(3, 40))
    prefill_logits(model, ids)  # one prompt chunk at slots 0..36
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = head.fc(torch.cat([states[j][0] for j in layers], dim=-1))
    torch.testing.assert_close(head.features[: len(ids)], want, rtol=1e-4, atol=1e-4)
    assert head.features[len(ids) :].abs().sum() == 0


def _variant(src, dst, rename=None, config=None, drop=()):
    """A copy of head `src` with tensors renamed (`rename(name)`) or dropped, config fields changed."""
    shutil.copytree(src, dst)
    tensors = {(rename or (lambda k: k))(k): v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**c, **(config or {})}))
    return dst


def test_the_layouts_spellings_load_alike(eagle3_pair, tmp_path):
    """"model."-prefixed names and "layers.0." for "midlayer." (how some trainers save the same head);
    the speculators format's top-level layer ids; a head with its own token table."""
    target, path = eagle3_pair
    model, head = _load(target, path)
    spelled = _variant(path, tmp_path / "spelled", lambda k: "model." + k.replace("midlayer.", "layers.0."),
                       {"eagle_config": None, "eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    other = load_eagle3_head(spelled, load_model(target, torch.float32, "cpu", "sdpa"), torch.float32, "cpu", "sdpa", 256)
    for (a, x), (b, y) in zip(head.state_dict().items(), other.state_dict().items()):
        assert a == b and torch.equal(x, y)
    table = torch.randn(512, model.spec.hidden_size)
    own = _variant(path, tmp_path / "own", config={})
    save_file({**load_file(own / "model.safetensors"), "embed_tokens.weight": table}, own / "model.safetensors")
    with_table = load_eagle3_head(own, model, torch.float32, "cpu", "sdpa", 256)
    assert torch.equal(with_table.embed_tokens.weight[:512], table)


def test_a_head_is_whole_beside_a_targets_shard(eagle3_pair, tmp_path):
    """Under tensor parallelism a head runs whole on rank 0 (server/worker/spec/parallel.py): loaded
    for a rank's shard of the target, its layers and its own token table are whole (their
    collectives no-ops); one that shares the target's table is given it whole (gathered from every
    rank: whole_token_table) and refused without it, naming why."""
    from models import TensorParallel, built_as

    target, path = eagle3_pair
    own = _variant(path, tmp_path / "own", config={})
    save_file({**load_file(own / "model.safetensors"), "embed_tokens.weight": torch.randn(512, 64)},
              own / "model.safetensors")
    with built_as(TensorParallel(1, 2)):  # (a rank's shard without a group: nothing communicated)
        shard = load_model(target, torch.float32, "cpu", "sdpa")
        head = load_eagle3_head(own, shard, torch.float32, "cpu", "sdpa", 256)
        with pytest.raises(ValueError, match="shares the target's token table, of which this rank holds a share"):
            load_eagle3_head(path, shard, torch.float32, "cpu", "sdpa", 256)
    assert shard.embed_tokens.tp.size == 2 and shard.spec.num_heads == 2
    layer = head.midlayer
    assert {m.tp.size for m in (head.embed_tokens, layer.self_attn.o_proj, layer.mlp.down_proj)} == {1}
    assert layer.self_attn.num_heads == 4 and head.embed_tokens.weight.shape[0] == 512
    # the gather (a collective, ~3x the table's bytes for a moment) happens for the sharing head only
    from models import eagle3_token_table

    assert eagle3_token_table(shard, own) is None


def test_heads_that_do_not_fit_the_target_are_refused(eagle3_pair, tmp_path):
    target, path = eagle3_pair
    model = load_model(target, torch.float32, "cpu", "sdpa")

    def refused(head, words, on=model):
        with pytest.raises(ValueError, match=words):
            load_eagle3_head(head, on, torch.float32, "cpu", "sdpa", 256)

    refused(path, "cannot draft for a Linear: it hands over no hidden states", torch.nn.Linear(2, 2))
    refused(_variant(path, tmp_path / "vocab", config={"vocab_size": 600}), r"vocabulary \(600\) is not the target's")
    refused(_variant(path, tmp_path / "wide", config={"target_hidden_size": 128}), "hidden size 128; this target's is 64")
    refused(_variant(path, tmp_path / "narrow", config={"hidden_size": 32, "target_hidden_size": 64}),
            "no token table and its width")
    fc = _variant(path, tmp_path / "fc", drop=("fc.weight",))
    save_file({**load_file(fc / "model.safetensors"), "fc.weight": torch.zeros(64, 96)}, fc / "model.safetensors")
    refused(fc, "fc takes 96 features a token; this target's three layers give 192")
    refused(_variant(path, tmp_path / "deep", config={"num_hidden_layers": 2}), "2 decoder layers")
    refused(_variant(path, tmp_path / "layers", config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}),
            r"layers \[1, 2, 4\]: three distinct layers of the target's 4")
    # no layer ids: vLLM's default (2, L // 2, L - 3) is (2, 2, 1) on a 4-layer target
    refused(_variant(path, tmp_path / "default", config={"eagle_config": None}), r"layers \[2, 2, 1\]")
    refused(_variant(path, tmp_path / "d2t", drop=("d2t",)), "no d2t")
