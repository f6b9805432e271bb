"""models/parallel/symm_all_reduce.py without a GPU: which messages the one-shot serves and which
keep NCCL's path (`TensorParallel.all_reduce`'s choice, deterministic mode's own path), what a call
hands the kernel (its ranks emulated in this process, as tests/kernels/test_one_shot_all_reduce.py
does), and the start-up's fallbacks: the reasons every rank shares return before any collective,
and a rank that lacks peer access or fails the set-up turns it off on every rank (the agreements
each rank makes, in the same order, so that the collectives meet).

Symmetric memory itself needs CUDA: tests/gpu/test_gpu_tp.py checks the one-shot against NCCL's
sum on two GPUs, eagerly and in a CUDA graph. The flag's parse and default: tests/server/test_cli.py."""

import logging
from types import SimpleNamespace

import pytest
import torch

from kernels.one_shot_all_reduce import SENTINEL, one_shot_all_reduce
from kernels.reference import all_reduce_ref
from models.parallel import group, symm_all_reduce
from models.parallel.group import TensorParallel
from models.parallel.symm_all_reduce import MIB, SymmAllReduce, max_bytes, start, unsupported


def _emulated(rank: int, slot_elems: int = MIB) -> SymmAllReduce:
    """Rank `rank` of two, its buffers on the CPU (the other rank's is a plain tensor here)."""
    buffers = [torch.full((2, 2, slot_elems), SENTINEL, dtype=torch.int16) for _ in range(2)]
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    return SymmAllReduce(buffers[rank], addresses, torch.zeros(2, dtype=torch.int32), rank, 4, handle=buffers)


@pytest.fixture
def comm():
    return _emulated(0)


def _other_rank_sent(c: SymmAllReduce, part: torch.Tensor) -> None:
    """Rank 1's part in rank 0's buffer, where rank 1's kernel would have sent it for this call."""
    parity = int(c.state[0]) % 2
    c.buffer[parity, 1, : part.numel()] = part.reshape(-1).view(torch.int16)


def test_sizes_by_world_size():
    assert [max_bytes(n) for n in (1, 2, 3, 4, 6, 8, 16)] == [0, 2 * MIB, MIB, MIB, MIB // 4, MIB // 4, 0]


def test_fits_small_16_bit_messages_up_to_a_slot(comm):
    c, bf16 = comm, torch.bfloat16
    assert c.slot_elems == MIB  # 2 MiB of 16-bit elements
    assert c.fits(torch.zeros(1, 4096, dtype=bf16)) and c.fits(torch.zeros(1, 4096, dtype=torch.float16))
    assert c.fits(torch.zeros(256, 4096, dtype=bf16))  # 2 MiB exactly
    assert c.fits(torch.zeros(1, 4097, dtype=bf16)) and c.fits(torch.zeros(1, 1, dtype=bf16))  # any length
    assert not c.fits(torch.zeros(257, 4096, dtype=bf16))  # past the slot: NCCL's
    assert not c.fits(torch.zeros(1, 4096))  # fp32: not the kernel's (its sentinel is 16 bits)
    assert not c.fits(torch.zeros(4096, 2, dtype=bf16).t())  # not contiguous
    assert not c.fits(torch.zeros(0, 4096, dtype=bf16))
    assert not c.fits(torch.zeros(1, 4096, dtype=bf16, device="meta"))  # another device than its buffer


@pytest.mark.parametrize("shape", [(1, 4096), (3, 4096), (1, 4097), (3, 5), (1, 1)])
def test_one_shot_sums_every_shape_into_a_new_tensor(comm, shape):
    c = comm
    x, other = torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)
    before = x.clone()
    _other_rank_sent(c, other)
    got = c(x)
    assert got.shape == x.shape and got.dtype == x.dtype and torch.equal(got, all_reduce_ref([before, other]))
    assert torch.equal(x, before)  # the input is left as it was
    assert c.state.tolist() == [1, 0] and bool((c.buffer == SENTINEL).all())  # its slots read and cleared
    sent = c.handle[1][0, 0, : x.numel()]  # what it sent rank 1
    assert torch.equal(sent, before.view(-1).view(torch.int16))


def _nccl(monkeypatch) -> list:
    calls = []

    def all_reduce(x):
        calls.append(tuple(x.shape))
        x.mul_(2)

    monkeypatch.setattr(group.dist, "all_reduce", all_reduce)
    return calls


def test_all_reduce_chooses_the_one_shot_for_what_fits_and_nccl_for_the_rest(comm, monkeypatch):
    c = comm
    nccl = _nccl(monkeypatch)
    tp = TensorParallel(0, 2, custom=c)
    small = torch.randn(1, 4096).to(torch.bfloat16)
    _other_rank_sent(c, small)
    assert torch.equal(tp.all_reduce(small.clone()), 2 * small) and c.state[0] == 1 and not nccl
    big = torch.randn(300, 4096).to(torch.bfloat16)  # 2.3 MiB
    single = torch.randn(1, 4096)  # fp32
    for x in (big, single):
        y = x.clone()
        assert tp.all_reduce(y) is y and torch.equal(y, 2 * x)  # NCCL's: in place
    assert nccl == [(300, 4096), (1, 4096)] and c.state[0] == 1
    assert torch.equal(TensorParallel(0, 2).all_reduce(small.clone()), 2 * small) and len(nccl) == 3  # none set up
    assert TensorParallel(0, 2, custom=c) == TensorParallel(0, 2)  # the group's identity is its rank and size


def test_deterministic_mode_keeps_its_gather_and_ordered_sum(comm, monkeypatch):
    c = comm
    nccl = _nccl(monkeypatch)
    parts = torch.tensor([[1.0, 2.0]]), torch.tensor([[10.0, 20.0]])
    monkeypatch.setattr(group, "_all_gather", lambda x: torch.stack(parts).to(x.dtype))
    got = TensorParallel(0, 2, custom=c).all_reduce(parts[0].to(torch.bfloat16), invariant=True)
    assert got.tolist() == [[11.0, 22.0]] and c.state[0] == 0 and not nccl
    one = torch.ones(1, 8, dtype=torch.bfloat16)
    assert TensorParallel(0, 1, custom=c).all_reduce(one) is one and c.state[0] == 0  # one rank: nothing to sum


def _never(*args):
    raise AssertionError("a collective ran where every rank returns before them")


def test_start_returns_before_any_collective_where_every_rank_shares_the_reason(caplog):
    assert "not a CUDA device" in unsupported(2, torch.device("cpu"))
    assert "16 ranks" in unsupported(16, torch.device("cuda", 0))
    with caplog.at_level(logging.INFO, "flashpage.parallel"):
        assert start(0, 2, torch.device("cpu"), "0", _never, _never) is None
        assert start(1, 2, torch.device("cpu"), "0", _never, _never) is None
    assert [r.getMessage() for r in caplog.records] == [
        "custom all-reduce: off (cpu is not a CUDA device); the group's all-reduces are gloo's"]  # rank 0's only


@pytest.fixture
def cuda_here(monkeypatch):
    """start() past its shared checks, as on a GPU whose peers `access` says it reaches."""
    access = {"ok": True}
    monkeypatch.setattr(symm_all_reduce, "_SET_UP", set())  # (this process has set no group up)
    monkeypatch.setattr(symm_all_reduce, "unsupported", lambda size, device: None)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access["ok"])
    return access


def _agree(answers: list, others: bool = True):
    def agree(ok: bool) -> bool:
        answers.append(ok)
        return ok and others
    return agree


def test_start_agrees_on_peer_access_then_on_the_set_up(cuda_here, monkeypatch, caplog):
    dev = torch.device("cuda", 0)
    made = _emulated(0, slot_elems=8)
    monkeypatch.setattr(symm_all_reduce, "_register", lambda rank, size, device, name, nbytes: made)
    answers = []
    assert start(0, 2, dev, "0", _agree(answers), lambda: [0, 1]) is made and answers == [True, True]

    symm_all_reduce._SET_UP.clear()  # (each start below as a new process's)
    answers = []  # this rank reaches its peer, another does not: all off, before any set-up
    assert start(0, 2, dev, "0", _agree(answers, others=False), lambda: [0, 1]) is None and answers == [True]
    cuda_here["ok"] = False
    answers = []
    assert start(1, 2, dev, "0", _agree(answers), lambda: [0, 1]) is None and answers == [False]

    cuda_here["ok"] = True
    symm_all_reduce._SET_UP.clear()

    def fail(rank, size, device, name, nbytes):
        raise RuntimeError("CUDA IPC unavailable")

    monkeypatch.setattr(symm_all_reduce, "_register", fail)
    answers = []
    with caplog.at_level(logging.WARNING, "flashpage.parallel"):
        assert start(0, 2, dev, "0", _agree(answers), lambda: [0, 1]) is None
    assert answers == [True, False]  # the failing rank still joins the second agreement
    assert "set-up failed on rank 0" in caplog.text and "CUDA IPC unavailable" in caplog.text
    answers = []  # every rank reaches its peers, but the set-up failed elsewhere: this rank's own is dropped
    monkeypatch.setattr(symm_all_reduce, "_register", lambda rank, size, device, name, nbytes: made)
    others = iter([True, False])  # the other ranks' answers to the two agreements
    agree = _agree(answers)
    symm_all_reduce._SET_UP.clear()
    assert start(0, 2, dev, "0", lambda ok: agree(ok) and next(others), lambda: [0, 1]) is None
    assert answers == [True, True]


def test_start_refuses_a_second_set_up_of_a_group_name_in_one_process(cuda_here, monkeypatch, caplog):
    """A second engine in one process (its rank 0) after the first closed: every rank agrees to stay
    on NCCL before any rendezvous (which never completed on the GPUs); another name still sets up."""
    dev = torch.device("cuda", 0)
    made = _emulated(0, slot_elems=8)
    monkeypatch.setattr(symm_all_reduce, "_register", lambda rank, size, device, name, nbytes: made)
    assert start(0, 2, dev, "0", _agree([]), lambda: [0, 1]) is made
    answers = []
    with caplog.at_level(logging.WARNING, "flashpage.parallel"):
        assert start(0, 2, dev, "0", _agree(answers), lambda: [0, 1]) is None
    assert answers == [False]  # (the other ranks, new processes, learn it from this agreement)
    assert "set symmetric memory up for a group named '0' before" in caplog.text
    assert start(0, 2, dev, "1", _agree([]), lambda: [0, 1]) is made


def test_init_sets_it_up_with_the_flag_at_two_ranks_or_more(monkeypatch):
    monkeypatch.setattr(group, "start_custom_all_reduce", _never)
    monkeypatch.setattr(group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(group.dist, "init_process_group", lambda *a, **k: None)
    store, cpu = SimpleNamespace(), torch.device("cpu")
    try:
        assert group.init_tensor_parallel(0, 2, store, cpu).custom is None
        assert group.init_tensor_parallel(0, 1, store, cpu, custom_all_reduce=True).custom is None
        made = _emulated(0, slot_elems=8)
        monkeypatch.setattr(group, "start_custom_all_reduce", lambda tp, device: made)
        tp = group.init_tensor_parallel(1, 2, store, cpu, custom_all_reduce=True)
        assert tp.custom is made and group.tensor_parallel() is tp  # what models built from now on hold
    finally:
        group._current = TensorParallel()


def test_a_decoder_layers_add_norm_fuses_the_sum_where_the_next_linear_reads_16_bits(monkeypatch):
    """models/llama.py's _add_norm over a row-parallel projection's part: with the custom all-reduce,
    the sum, the residual add and the norm are one_shot_add_rmsnorm's one launch (the bits of the
    all-reduce then add_rmsnorm); where the next linear reads FP8 (its norm quantized in the add's
    launch), the plain all-reduce, then that."""
    from kernels.rms_norm import add_rmsnorm
    from models import llama
    from models.parallel.layers import FUSED_ADD_RMSNORM_ENV, RowParallelLinear

    c = _emulated(0)
    with group.built_as(TensorParallel(0, 2, custom=c)):
        assert not RowParallelLinear(8, 16, bias=False).fuse_add_rmsnorm  # off until it has run on GPUs
        monkeypatch.setenv(FUSED_ADD_RMSNORM_ENV, "1")
        proj = RowParallelLinear(8, 16, bias=False)
    norm = llama.RMSNorm(16, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    part, other, x = (torch.randn(3, 16).to(torch.bfloat16) for _ in range(3))
    want_x, want_h = add_rmsnorm(x.clone(), all_reduce_ref([part, other]), norm.weight, 1e-5)
    monkeypatch.setattr(symm_all_reduce, "one_shot_all_reduce", _never)
    _other_rank_sent(c, other)
    got_x, got_h = llama._add_norm(x, part, proj, norm, None)  # before the LM head: 16 bits
    assert got_x is x and torch.equal(x, want_x) and torch.equal(got_h, want_h) and c.state[0] == 1

    monkeypatch.setattr(symm_all_reduce, "one_shot_all_reduce", one_shot_all_reduce)
    monkeypatch.setattr(symm_all_reduce, "one_shot_add_rmsnorm", _never)
    fp8_reader = SimpleNamespace(quant=SimpleNamespace(activation_format=lambda linear, rows: "fp8 per token"))
    _other_rank_sent(c, other)
    x = want_x.clone()
    got_x, _ = llama._add_norm(x, part, proj, norm, fp8_reader)
    assert torch.equal(got_x, (want_x.float() + all_reduce_ref([part, other]).float()).to(torch.bfloat16))
    assert c.state[0] == 2 and bool((c.buffer == SENTINEL).all())
