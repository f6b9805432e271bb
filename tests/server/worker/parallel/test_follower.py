"""What the other ranks of a tensor-parallel group run, checked in one process (no group: size 1):
rank 0's messages (server/worker/parallel/messages.py), as its runner sends them, replayed by a
second runner through `follow` build the same inputs and write the same KV cache, bit for bit.

- Eager steps: an engine serves mixed traffic (chunked prompts, prefix hits, preemption, prompt
  log-probabilities, placeholders of asynchronous scheduling) while a recorder stands in for the
  other ranks; a second runner then follows the recording. Its KV cache must equal the engine's.
  (Between ranks, the placeholders' ids come in the embedding's broadcast; here the recorder keeps
  rank 0's sampled ids with each message, and the follower takes them first.)
- Graph replays (CUDA only: here with the replay stubbed): the exported inputs, loaded by another
  DecodeGraphs / PrefillGraphs, give its device buffer the same rows, with the choice made greedy.
"""

import random

import numpy as np
import pytest
import torch

from kvcache import BlockManager
from server.config import EngineConfig
from server.engine import LLMEngine
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.sampling_params import SamplingParams
from server.worker.cuda_graphs import DecodeGraphs, PrefillGraphs
from server.worker.logits import TokenCounts
from server.worker.parallel.follower import follow
from server.worker.parallel.messages import GraphStep, decode, encode
from server.worker.parallel.peers import Peers


class Recorder:
    """A connection that keeps what rank 0 sends, with rank 0's sampled ids at that moment."""

    def __init__(self, last_ids: torch.Tensor) -> None:
        self.last_ids, self.sent = last_ids, []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append((data, self.last_ids.clone()))


class Replay:
    """A follower's connection over a recording: each message after setting the sampled ids it came with."""

    def __init__(self, sent: list, last_ids: torch.Tensor) -> None:
        self.sent, self.last_ids = list(sent), last_ids

    def recv_bytes(self) -> bytes:
        if not self.sent:
            raise EOFError
        data, ids = self.sent.pop(0)
        self.last_ids.copy_(ids)
        return data


def _zero(caches) -> None:
    for k, v in caches:
        k.zero_()
        v.zero_()


def test_a_follower_of_rank_0s_eager_steps_writes_the_same_kv_cache(small_ckpt):
    config = EngineConfig(model=str(small_ckpt), device="cpu", num_blocks=20, block_size=8, max_num_batched_tokens=24,
                          max_num_seqs=6)
    eng, other = LLMEngine(config), LLMEngine(config)
    _zero(eng.runner.kv_caches)
    _zero(other.runner.kv_caches)
    recorder = Recorder(eng.runner.last_ids)
    eng.runner.peers = Peers([], [recorder], None)
    rng = random.Random(0)
    shared = [rng.randrange(700) for _ in range(20)]
    prompts = [[rng.randrange(700) for _ in range(n)] for n in (3, 30, 45, 9)] + [shared + [1], shared + [2, 3]]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=2 if i == 1 else None)
              for i in range(len(prompts))]
    eng.generate(prompts, params)
    snap = eng.snapshot()
    assert snap.preemptions > 0 and snap.prefix_hits > 0  # the traffic this test means to follow
    kinds = [type(decode(data)).__name__ for data, _ in recorder.sent]
    assert set(kinds) == {"EagerStep"} and any(decode(d).head_slices for d, _ in recorder.sent)
    with torch.inference_mode():
        assert follow(other.runner, Replay(recorder.sent, other.runner.last_ids)) is False  # the recording ended
    for (k0, v0), (k1, v1) in zip(eng.runner.kv_caches, other.runner.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert k0.abs().sum() > 0


class _Replayed:
    def __init__(self) -> None:
        self.count = 0

    def replay(self) -> None:
        self.count += 1


class _Model:
    vocab_size = 10


def _own_device_buffer(staging) -> None:
    """A device buffer apart from the host one, which uploads copy into, as on CUDA."""
    staging.dev, staging.on_cuda = staging.hosts[0].clone(), True


def _decode_graphs() -> DecodeGraphs:
    dg = DecodeGraphs(_Model(), [], 16, 32, torch.device("cpu"), torch.zeros(16, dtype=torch.int32),
                      TokenCounts(10, torch.device("cpu")))
    _own_device_buffer(dg.staging)
    dg.graphs = {size: (_Replayed(), torch.zeros(size, 10)) for size in dg.sizes}
    return dg


def _record(rank0, prefill: bool) -> list:
    """rank0's on_replay as Peers.replayer sets it, into a list of encoded messages."""
    sent = []
    rank0.on_replay = lambda size, rows, width: sent.append(encode(GraphStep(prefill, size, rows, width,
                                                                           memoryview(rank0.exported(rows, width)))))
    return sent


def _scheduler(bs: int, rng: random.Random, n: int, longest: int, max_tokens: int) -> Scheduler:
    sched = Scheduler(BlockManager(60, bs, enable_prefix_caching=True),
                      EngineConfig(block_size=bs, max_num_seqs=16, max_num_batched_tokens=64, max_admit_delay=0))
    for i in range(n):
        sched.add(Sequence(f"r{i}", [rng.randrange(9) for _ in range(rng.randint(1, longest))],
                           SamplingParams(max_tokens=max_tokens)))
    return sched


def test_decode_graph_inputs_reach_another_rank_through_the_message():
    bs, rng = 4, random.Random(1)
    rank0, rank1 = _decode_graphs(), _decode_graphs()
    sent = _record(rank0, prefill=False)
    sched = _scheduler(bs, rng, 7, 30, 30)
    checked = 0
    for _ in range(40):
        out = sched.schedule()
        if out.decodes:
            rank0.run(out.decodes, bs)
            op = decode(sent[-1])
            rank1.replay_exported(op.size, op.rows, op.width, np.frombuffer(op.words, np.int32))
            assert rank1.graphs[op.size][0].count == rank0.graphs[op.size][0].count  # the same graph replayed
            ids0, pos0, slots0, ctx0, *_ , bt0, _, _ = rank0._views(rank0.staging.dev)
            ids1, pos1, slots1, ctx1, pslots1, inv_t1, _, bt1, _, _ = rank1._views(rank1.staging.dev)
            n = op.size
            for a, b in ((ids0, ids1), (pos0, pos1), (slots0, slots1), (ctx0, ctx1)):
                assert torch.equal(a[:n], b[:n])
            for i in range(n):  # every page-table entry the row's context reaches
                used = -(-int(ctx0[i]) // bs)
                assert torch.equal(bt0[i, :used], bt1[i, :used])
            assert torch.all(pslots1[:n] == -1) and torch.all(inv_t1[:n] == 0)  # greedy, no count tables read
            checked += 1
        sched.after_step(out)
        for r, item in enumerate(out.decodes + [p for p in out.prefills if p.samples]):
            item.seq.add_placeholder(r)
            item.seq.resolve(rng.randrange(9))
    assert checked > 10


def test_prefill_graph_inputs_reach_another_rank_through_the_message(small_ckpt):
    from models import load_model

    model = load_model(small_ckpt, torch.float32, "cpu", "sdpa")
    bs = 4
    graphs = []
    for _ in range(2):
        pg = PrefillGraphs(model, [], 64, 16, torch.device("cpu"))
        _own_device_buffer(pg.staging)
        pg.graphs = {t: (_Replayed(), torch.zeros(t, 10)) for t in pg.sizes}
        graphs.append(pg)
    rank0, rank1 = graphs
    sent = _record(rank0, prefill=True)
    out = _scheduler(bs, random.Random(2), 9, 40, 2).schedule()
    assert len(out.prefills) > 1
    rank0.run(out.prefills, bs)
    op = decode(sent[-1])
    rank1.replay_exported(op.size, op.rows, op.width, np.frombuffer(op.words, np.int32))
    v0, v1 = rank0._views(rank0.staging.dev), rank1._views(rank1.staging.dev)
    for a, b in zip(v0[:8], v1[:8]):  # ids .. tile map: every section before the page tables
        assert torch.equal(a, b)
    for i, item in enumerate(out.prefills):
        table = item.seq.blocks.block_table
        assert v1[8][i, : len(table)].tolist() == table
    assert rank1.graphs[op.size][0].count == 1




def test_each_graph_step_replays_its_own_graphs_on_the_follower():
    """Rank 0's decode, prefill and verification replayers (Peers.replayer; a speculative step's
    verification graphs are prefill graphs of their own: server/worker/spec/verify.py) each reach
    the follower's graphs of the same kind, in order."""

    class Graphs:
        def __init__(self) -> None:
            self.replayed = []

        def exported(self, rows: int, width: int) -> np.ndarray:
            return np.arange(rows * width, dtype=np.int32)

        def replay_exported(self, size: int, rows: int, width: int, words: np.ndarray) -> None:
            self.replayed.append((size, words.tolist()))

    class Conn:
        def __init__(self) -> None:
            self.sent = []

        def send_bytes(self, data: bytes) -> None:
            self.sent.append(data)

        def recv_bytes(self) -> bytes:
            if not self.sent:
                raise EOFError
            return self.sent.pop(0)

    rank0 = {kind: Graphs() for kind in ("decode", "prefill", "verify")}
    conn = Conn()
    peers = Peers([], [conn], None)
    replay = {"decode": peers.replayer(rank0["decode"], prefill=False),
              "prefill": peers.replayer(rank0["prefill"], prefill=True),
              "verify": peers.replayer(rank0["verify"], prefill=True, verify=True)}
    for kind, size in (("verify", 32), ("prefill", 16), ("decode", 8), ("verify", 64)):
        replay[kind](size, 1, 2)
    follower = {kind: Graphs() for kind in rank0}

    class Runner:
        graphs, prefill_graphs, verify_graphs = follower["decode"], follower["prefill"], follower["verify"]

    assert follow(Runner, conn) is False  # (the recording ended)
    assert follower["verify"].replayed == [(32, [0, 1]), (64, [0, 1])]
    assert follower["prefill"].replayed == [(16, [0, 1])] and follower["decode"].replayed == [(8, [0, 1])]
