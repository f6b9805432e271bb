"""Input packing: a scheduled step as the flat int32 arrays the model reads."""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvcache import SeqBlocks, slot_of
from models import placeholder_id
from server.sampling_params import SamplingParams
from server.worker.inputs import Packer, pack_prefills, prepare_step

BS = 4
PH = -1  # server.engine.sequence.PLACEHOLDER; the worker never imports the engine


@dataclass
class FakeSeq:
    request_id: str
    token_ids: list[int]
    block_table: list[int]
    pending_row: int = -1
    params: SamplingParams = field(default_factory=SamplingParams)
    plain: bool = True

    def __post_init__(self):
        self.blocks = SeqBlocks(block_table=self.block_table)

    @property
    def num_pending(self):
        return self.token_ids.count(PH)

    def input_token(self, pos):
        tok = self.token_ids[pos]
        return placeholder_id(self.pending_row) if tok == PH else tok


@dataclass
class Chunk:
    seq: FakeSeq
    start: int
    num_tokens: int

    @property
    def samples(self):
        return self.start + self.num_tokens == len(self.seq.token_ids)


def ids(base, n):
    return [base + i for i in range(n)]


def mixed_step():
    a = FakeSeq("a", ids(100, 6), [3, 7])  # whole prompt, no cached prefix: samples
    b = FakeSeq("b", ids(200, 10), [5, 2, 9])  # 4 tokens cached, a middle chunk: does not sample
    d = FakeSeq("d", ids(300, 4) + [PH], [8, 1], pending_row=2)  # decodes a token still on the device
    e = FakeSeq("e", ids(400, 9), [4, 6, 11])
    return [Chunk(a, 0, 6), Chunk(b, 4, 3)], [Chunk(d, 4, 1), Chunk(e, 8, 1)]


def offsets(packer, tensors):
    base = packer.staging.dev.data_ptr()
    return [t.data_ptr() - base for t in tensors]


def test_prepare_step_packs_prefill_chunks_then_decodes():
    packer = Packer(256, torch.device("cpu"))
    prefills, decodes = mixed_step()
    step = prepare_step(packer, prefills, decodes, BS)
    assert step.input_ids.tolist() == ids(100, 6) + ids(204, 3) + [placeholder_id(2), 408]
    assert step.input_ids.tolist()[-2] == -3
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 4, 8]
    tables_pos = [([3, 7], p) for p in range(6)] + [([5, 2, 9], p) for p in (4, 5, 6)] + [([8, 1], 4), ([4, 6, 11], 8)]
    assert step.rows.slot_mapping.tolist() == [slot_of(t, p, BS) for t, p in tables_pos]
    assert step.rows.slot_mapping.tolist()[:2] == [12, 13] and step.rows.slot_mapping.tolist()[-1] == 44
    r = step.rows
    assert r.num_prefill_tokens == 9
    assert r.cu_seqlens.tolist() == [0, 6, 9]
    assert r.prefix_lens.tolist() == [0, 4]
    assert r.chunk_lens == [6, 3] and r.chunk_prefix == [0, 4]
    assert r.prefill_block_tables.tolist() == [[3, 7, 0], [5, 2, 9]]
    assert r.context_lens.tolist() == [5, 9]
    assert r.decode_block_tables.tolist() == [[8, 1, 0], [4, 6, 11]]
    # Rows that sample: decodes first (in order), then the prefill chunks that reach their end.
    assert step.ends.tolist() == [9, 10, 5]


def test_every_packed_array_is_a_16_byte_aligned_view_of_one_buffer():
    packer = Packer(256, torch.device("cpu"))
    prefills, decodes = mixed_step()
    step = prepare_step(packer, prefills, decodes, BS)
    r = step.rows
    tensors = [step.input_ids, step.positions, step.ends, r.slot_mapping, r.cu_seqlens, r.prefix_lens,
               r.prefill_block_tables, r.context_lens, r.decode_block_tables]
    offs = offsets(packer, tensors)
    assert all(t.dtype == torch.int32 for t in tensors)
    assert all(o % 16 == 0 for o in offs)
    assert len(set(offs)) == len(offs) and all(0 <= o < 256 * 4 for o in offs)  # distinct, in the buffer


def test_prefill_only_and_decode_only_steps():
    packer = Packer(256, torch.device("cpu"))
    prefills, decodes = mixed_step()
    step = prepare_step(packer, prefills, [], BS)
    assert step.ends.tolist() == [5] and step.rows.context_lens is None and step.rows.decode_block_tables is None
    assert step.input_ids.tolist() == ids(100, 6) + ids(204, 3)

    step = prepare_step(packer, [], decodes, BS)
    r = step.rows
    assert step.input_ids.tolist() == [-3, 408] and step.positions.tolist() == [4, 8]
    assert step.ends.tolist() == [0, 1] and r.num_prefill_tokens == 0
    assert r.cu_seqlens is None and r.prefix_lens is None and r.prefill_block_tables is None
    assert r.chunk_lens == [] and r.context_lens.tolist() == [5, 9]


def test_pack_prefills_lays_out_chunks_with_cached_prefixes():
    prefills, _ = mixed_step()
    pf = pack_prefills(prefills, BS)
    assert pf.ids.tolist() == ids(100, 6) + ids(204, 3)
    assert pf.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6]
    assert pf.slots.tolist() == [12, 13, 14, 15, 28, 29, 8, 9, 10]
    assert pf.lens == [6, 3] and pf.prefix == [0, 4] and pf.ends == [5]
    assert pf.tables == [[3, 7], [5, 2, 9]]
    empty = pack_prefills([], BS)
    assert empty.ids.size == 0 and empty.ends == []


def test_pack_prefills_refuses_a_chunk_reaching_a_pending_token():
    s = FakeSeq("p", ids(100, 5) + [PH], [1, 2], pending_row=0)
    pack_prefills([Chunk(s, 0, 5)], BS)  # up to the pending token: fine
    with pytest.raises(RuntimeError, match="not yet sampled"):
        pack_prefills([Chunk(s, 0, 6)], BS)
    with pytest.raises(RuntimeError, match="not yet sampled"):
        pack_prefills([Chunk(s, 5, 1)], BS)


def test_packer_rejects_a_batch_over_capacity():
    packer = Packer(8, torch.device("cpu"))
    v = packer.pack(a=[1, 2, 3, 4], b=np.array([[5, 6], [7, 8]]))  # exactly full
    assert v["a"].tolist() == [1, 2, 3, 4] and v["b"].tolist() == [[5, 6], [7, 8]]
    with pytest.raises(ValueError, match="int32 slots"):
        packer.pack(a=[1] * 5, b=[2] * 4)  # a's alignment padding leaves b no room
    with pytest.raises(ValueError, match="int32 slots"):
        packer.pack(a=[1] * 9)


class ArraysBackend:
    """An attention backend as prepare_step sees it: arrays of its own for the prefill chunks."""

    def __init__(self, name="tile_seq"):
        self.name, self.calls = name, []

    def prefill_arrays(self, chunk_lens, chunk_prefix, device, cache=None):
        self.calls.append((list(chunk_lens), list(chunk_prefix), device.type, cache))
        return {self.name: np.array([n * 10 + p for n, p in zip(chunk_lens, chunk_prefix)])}


def test_the_backends_arrays_ride_the_same_upload():
    packer = Packer(256, torch.device("cpu"))
    prefills, decodes = mixed_step()
    backend = ArraysBackend()
    step = prepare_step(packer, prefills, decodes, BS, backend)
    assert backend.calls == [([6, 3], [0, 4], "cpu", None)]
    got = step.rows.extra["tile_seq"]
    assert got.tolist() == [60, 34] and got.dtype == torch.int32
    assert offsets(packer, [got])[0] % 16 == 0 and got.data_ptr() >= packer.staging.dev.data_ptr()
    # a decode-only step asks for nothing
    step = prepare_step(packer, [], decodes, BS, backend)
    assert step.rows.extra == {} and len(backend.calls) == 1
    # with blocks a step may copy out of the cache, the backend hears of them (gather_plan)
    prepare_step(packer, prefills, decodes, BS, backend, gather_blocks=7)
    assert backend.calls[-1] == ([6, 3], [0, 4], "cpu", (BS, 7))


def test_backend_arrays_may_not_shadow_the_steps_own():
    packer = Packer(256, torch.device("cpu"))
    prefills, decodes = mixed_step()
    with pytest.raises(ValueError, match="context_lens"):
        prepare_step(packer, prefills, decodes, BS, ArraysBackend("context_lens"))
