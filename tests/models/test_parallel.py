"""models/parallel: which part of each checkpoint tensor a rank holds, and sharded models on two
gloo ranks against the whole model: GPT-2, Llama with its K/V heads split, Mistral (one K/V head)
with it replicated, from checkpoint files and from --load-format dummy. The logits agree within
fp32 rounding (a row-parallel projection sums two halves of its dot products, which the whole
model sums in one), and so does every position's argmax.

The same ranks bring up an fp8 KV cache as the server does (server/worker/setup.py `bring_up`):
per-KV-head checkpoint scales sliced to each rank's head, or calibrated on both ranks together; a
prompt prefilled in two chunks (the second reads the first's K/V from the fp8 cache) gives the
one-rank fp8 cache's logits."""

import pytest
import torch

from models.parallel import TensorParallel, kv_heads, shard_spec
from models.parallel.layers import Shard, qkv_parts, split_parts, vocab_rows
from models.spec import ModelSpec
from tests.helpers import make_checkpoint, make_llama_checkpoint, prefill_logits, run_ranks, with_tensors

IDS = [5, 17, 99, 3, 250, 7, 42, 300, 11, 64, 128, 9, 77, 1, 2, 180, 33]  # 17 tokens: past a block


def test_shard_takes_pieces_pads_past_the_end_and_refuses_other_lengths():
    full = torch.arange(12.0).view(6, 2)
    assert Shard(((0, 2), (4, 1)), 0, 6).take(full).tolist() == [[0, 1], [2, 3], [8, 9]]
    assert Shard(((1, 1),), 1, 2).take(full).flatten().tolist() == [1, 3, 5, 7, 9, 11]
    padded = Shard(((4, 4),), 0, 6).take(full)  # vocabulary rows past the checkpoint's are zero
    assert padded.tolist() == [[8, 9], [10, 11], [0, 0], [0, 0]]
    assert Shard(((0, 6),), 0, 6, zero=True).take(full).abs().sum() == 0
    assert Shard(((0, 2),), 0, 7).take(full) is full  # another length: whole, for the shape check to refuse


def test_kv_heads_split_while_enough_then_shared_by_the_ranks_of_their_query_heads():
    assert [kv_heads(8, TensorParallel(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_heads(2, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="key/value heads"):
        kv_heads(3, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="key/value heads"):
        kv_heads(2, TensorParallel(0, 3))


def test_rank_parts_of_merged_projections_and_the_vocabulary():
    spec = ModelSpec("llama", 2, num_heads=8, num_kv_heads=2, head_dim=4, hidden_size=32, vocab_size=500,
                     max_position_embeddings=64)
    # q rows 0..31, k 32..39, v 40..47: rank 3 of 4 has q heads 6-7 and K/V head 1 (replicated)
    assert qkv_parts(spec, TensorParallel(3, 4)) == ((24, 8), (36, 4), (44, 4))
    assert qkv_parts(spec, TensorParallel(0, 1)) == ((0, 48),)  # whole: one piece
    local = shard_spec(spec, TensorParallel(1, 4))
    assert (local.num_heads, local.num_kv_heads, local.hidden_size) == (2, 1, 32)
    assert split_parts([10, 10], "MLP width", TensorParallel(1, 2)) == ((5, 5), (15, 5))
    assert vocab_rows(500, 1) == 512 and vocab_rows(500, 4) == 512 and vocab_rows(600, 4) == 768
    with pytest.raises(ValueError, match="attention heads"):
        shard_spec(spec, TensorParallel(0, 3))


def _fp8_worker(path, size: int):
    """bring_up's worker with an fp8 KV cache (as a server of `size` ranks brings up this rank's),
    and the logits of IDS prefilled in two chunks into its cache."""
    from server.config import EngineConfig
    from server.worker.setup import bring_up

    config = EngineConfig(model=str(path), device="cpu", kv_cache_dtype="fp8", num_blocks=4, tensor_parallel_size=size)
    worker = bring_up(config, path, torch.device("cpu"))
    logits = prefill_logits(worker.runner.model, IDS, caches=worker.runner.kv_caches, split=9)
    return worker.kv_scales, logits


def _rank(rank: int, size: int, port: int, cases: list, fp8_cases: list, out) -> None:
    """One rank of the group: each case's prefill logits (rank 0 reports them), each fp8 case's
    scales (every rank) and logits, then the collectives."""
    from torch.distributed import TCPStore

    from models import close_tensor_parallel, init_tensor_parallel, load_model

    whole = load_model(cases[0][1], torch.float32, "cpu", "sdpa")  # built before the group: stays whole
    store = TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    # the custom all-reduce asked for, on the CPU: gloo's all-reduces (models/parallel/symm_all_reduce.py)
    tp = init_tensor_parallel(rank, size, store, torch.device("cpu"), custom_all_reduce=True)
    assert tp.custom is None
    try:
        for name, path, load_format in cases:
            model = load_model(path, torch.float32, "cpu", "sdpa", load_format=load_format)
            logits = prefill_logits(model, IDS)
            if rank == 0:
                # numpy, not tensors (tests/helpers.py run_ranks)
                out.put((name, logits.numpy(), (model.spec.num_heads, model.spec.num_kv_heads)))
        for name, path in fp8_cases:
            scales, logits = _fp8_worker(path, size)
            out.put((f"{name}:{rank}", scales.k.cpu().numpy(), scales.v.cpu().numpy(), logits.numpy()))
        x = torch.tensor([[1.0 + rank, 1e-8 * rank]])
        summed = tp.all_reduce(x.clone(), invariant=True), tp.all_reduce(x.clone())
        gathered = tp.gather_columns(torch.full((2, 3), float(rank)))
        ids = torch.full((4,), rank, dtype=torch.int32)
        tp.broadcast(ids)
        if rank == 1:
            head = whole.lm_head(torch.zeros(2, whole.spec.hidden_size))  # its own head: no gather
            out.put(("collectives", tuple(t.numpy() for t in summed), gathered.numpy(), ids.numpy(), head.shape[1]))
    finally:
        close_tensor_parallel()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp
    return [("gpt2", make_checkpoint(d("gpt2")), "auto"),
            ("llama-kv-split", make_llama_checkpoint(d("llama"), "llama", num_attention_heads=8, num_key_value_heads=2,
                                                     hidden_size=128), "auto"),
            ("mistral-kv-replicated", make_llama_checkpoint(d("mistral"), "mistral", num_attention_heads=4,
                                                            num_key_value_heads=1, sliding_window=None), "auto"),
            ("qwen2-dummy", make_llama_checkpoint(d("qwen2"), "qwen2", num_attention_heads=4, num_key_value_heads=2),
             "dummy")]


@pytest.fixture(scope="module")
def fp8_cases(cases, tmp_path_factory):
    """The K/V-split Llama with its scales calibrated, and with per-KV-head k_scale and per-tensor
    v_scale tensors (llm-compressor's names) whose heads differ."""
    llama = cases[1][1]
    k = torch.tensor([[0.03, 0.06], [0.05, 0.02]])
    scales = {f"model.layers.{i}.self_attn.{n}_scale": t for i in range(2)
              for n, t in (("k", k[i]), ("v", torch.tensor([0.04 + 0.01 * i])))}
    return [("fp8-calibrated", llama), ("fp8-checkpoint", with_tensors(llama, tmp_path_factory.mktemp("s") / "m", scales))]


def test_two_ranks_give_the_whole_models_logits(cases, fp8_cases):
    from models import load_model

    got = run_ranks(_rank, 2, (cases, fp8_cases), len(cases) + 2 * len(fp8_cases) + 1)
    for name, path, load_format in cases:
        whole = load_model(path, torch.float32, "cpu", "sdpa", load_format=load_format)
        ref = prefill_logits(whole, IDS)
        logits, heads = torch.from_numpy(got[name][0]), got[name][1]
        assert heads == (whole.spec.num_heads // 2, max(1, whole.spec.num_kv_heads // 2)), name
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4, msg=name)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1)), name
    for name, path in fp8_cases:
        scales, ref = _fp8_worker(path, 1)
        for rank in range(2):  # one K/V head each: head `rank`'s scales
            k, v = (torch.from_numpy(s) for s in got[f"{name}:{rank}"][:2])
            assert k.shape == v.shape == (2, 1), name
            torch.testing.assert_close(k, scales.k[:, rank : rank + 1], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(v, scales.v[:, rank : rank + 1], rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(torch.from_numpy(got[f"{name}:0"][2]), ref, rtol=0, atol=1e-3, msg=name)
    assert scales.k[0].tolist() == pytest.approx([0.03, 0.06]) and scales.source == "from the checkpoint"
    (plain_sum, ordered_sum), gathered, ids, whole_columns = got["collectives"]
    plain_sum, ordered_sum = torch.from_numpy(plain_sum), torch.from_numpy(ordered_sum)
    assert whole_columns == vocab_rows(load_model(cases[0][1], torch.float32, "cpu", "sdpa").vocab_size, 1)
    assert torch.equal(plain_sum, ordered_sum) and torch.equal(plain_sum, torch.tensor([[3.0, 1e-8]]))
    assert gathered.tolist() == [[0, 0, 0, 1, 1, 1]] * 2  # rank r's columns at r * cols
    assert ids.tolist() == [0] * 4  # rank 0's


def test_dummy_weights_need_no_weight_files_and_repeat(tmp_path):
    """--load-format dummy: config.json alone (the weight files deleted), every tensor set (the loader
    refuses a checkpoint that lacks one), the same weights twice (seeded by name), matrices random
    at initializer_range, norms one, biases zero; a checkpoint's files are not read."""
    from models import load_model

    path = make_llama_checkpoint(tmp_path, "qwen2", num_attention_heads=4, num_key_value_heads=2)
    for f in path.glob("*.safetensors"):
        f.unlink()
    a = load_model(path, torch.float32, "cpu", "sdpa", load_format="dummy")
    b = load_model(path, torch.float32, "cpu", "sdpa", load_format="dummy")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    layer = a.layers[0]
    assert abs(layer.self_attn.qkv_proj.weight.std().item() - 0.2) < 0.02  # make_llama_checkpoint's range
    assert torch.all(layer.self_attn.qkv_proj.bias == 0) and torch.all(layer.input_layernorm.weight == 1)
    assert torch.all(a.embed_tokens.weight[a.vocab_size:] == 0)  # the padding rows
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(path, torch.float32, "cpu", "sdpa")


def test_leaving_the_group_collects_cycles_that_gc_freeze_froze():
    # The server and benchmarks freeze start-up's heap; a CUDA graph in a reference cycle (a graph
    # holder and its replay hook) must still be gone before NCCL's destroy, which hangs while it lives.
    import gc
    import weakref

    from torch.distributed import TCPStore

    from models import close_tensor_parallel, init_tensor_parallel

    class Graphs:
        pass

    store = TCPStore("127.0.0.1", 0, 1, is_master=True)
    init_tensor_parallel(0, 1, store, torch.device("cpu"))
    graphs = Graphs()
    graphs.on_replay = [graphs]  # the cycle (a list: a lambda would hold the local name, not the object)
    ref = weakref.ref(graphs)
    gc.collect()
    gc.freeze()
    try:
        del graphs
        gc.collect()
        assert ref() is not None  # frozen: the collector does not see it
        close_tensor_parallel()
        assert ref() is None
    finally:
        gc.unfreeze()
        close_tensor_parallel()

