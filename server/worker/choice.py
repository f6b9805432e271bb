"""A step's choice by the argmax kernel after the forward (kernels/argmax.py: temperature and noise,
penalties, a grammar's masks), where the decode graph could not make it: eagerly, part by part of
the step's logits (`argmax_choice`), or for a constrained decode step, replayed from a captured
graph (`ChoiceGraphs`).

Why a graph for the constrained step: its choice is queued after the engine hands the grammar job
its fill, on the engine's thread, which is what bounds a decoding step of a small model. Queued
from Python it was five launches and ~0.17-0.25 ms of host time a step (H100 host, 64 rows), as
much as the grammar cost the step in all; replayed, one launch. The graph reads what changes from
step to step where it lies: the wait's target in pinned memory (GrammarBuffers.target), the masks
in the parity's buffers (shared with the grammar process, page-locked), the rows' penalty slots,
temperatures, noise keys and positions in the decode graph's static inputs
(DecodeGraphs.choice_inputs).
"""

from __future__ import annotations

import torch

from kernels.argmax import argmax_rows
from kernels.grammar_mask import wait_for_flag
from kernels.reference import grammar_mask_ref, penalized_argmax_ref
from server.worker.cuda_graphs import DecodeGraphs
from server.worker.grammar_rows import GrammarBuffers, GrammarFill
from server.worker.logits import TokenCounts, to_device
from server.worker.steps import ArgmaxChoice


def argmax_choice(parts: list[torch.Tensor], choice: ArgmaxChoice, positions: list[int], skip: int,
                  last_ids: torch.Tensor, counts: TokenCounts, vocab: int,
                  mask: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """The choice `choice` describes for rows skip.. of a step, one launch pair per part of its
    logits (in row order), into last_ids; penalized rows counted. `positions`: every row's (the
    noise counter); `mask`: a constrained step's (bits, live, covered); skip: the rows the decode
    graph chose (its part; the rest is a prefill part beside it, or all of an eager step), or 0."""
    todo, row0 = [], 0
    for logits in parts:
        if row0 >= skip:
            todo.append((slice(row0, row0 + logits.shape[0]), logits))
        row0 += logits.shape[0]
    if not todo:  # the decode graph chose every row: nothing to upload or launch
        counts.updated()
        return
    device = last_ids.device
    if choice.device is None:
        choice.device = (to_device(choice.penalty_slots, torch.int32, device),
                         to_device(choice.inv_temperature, torch.float32, device),
                         to_device(choice.keys, torch.int64, device))
    slots, inv_t, keys = choice.device
    pos = to_device(positions, torch.int64, device) if choice.sampled else None
    for rows, logits in todo:
        noise = (inv_t[rows], keys[rows], pos[rows]) if pos is not None else None
        out = last_ids[rows]
        if logits.is_cuda:
            argmax_rows(logits, vocab, out=out, penalty=(slots[rows], counts.addresses), noise=noise,
                        mask=None if mask is None else (mask[0][rows], mask[1][rows], mask[2]))
        else:
            x = logits if mask is None else grammar_mask_ref(logits, vocab, mask[0][rows], mask[1][rows], mask[2])
            penalized_argmax_ref(x, vocab, slots[rows], counts.counts, counts.in_prompt, counts.penalties, out,
                                 noise=noise)
    counts.updated()


class ChoiceGraphs:
    """The choice of a constrained step of decodes only (whose decode graph ran with the plan's
    choice `deferred`), captured per (decode graph size, mask parity): wait for the fill's flag,
    copy the parity's masks to the device, the masked argmax of the graph's logits.

    All of them are captured when the first constrained step comes, after one eager launch of each
    kernel (Triton compiles outside a capture), without `torch.cuda.graph`: its entry waits for the
    device and empties the allocator's caches, the pinned-memory one included, and mid-serving
    every later pinned allocation would then wait for the device (captured one key at a time as
    batch sizes came, that cost the benchmark's next runs a quarter of their throughput)."""

    def __init__(self, decode: DecodeGraphs, buffers: GrammarBuffers, last_ids: torch.Tensor, counts: TokenCounts,
                 vocab: int) -> None:
        self.decode, self.buffers, self.last_ids, self.counts, self.vocab = decode, buffers, last_ids, counts, vocab
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._capture()

    def _choose(self, size: int, parity: int) -> None:
        logits, slots, inv_t, keys, pos = self.decode.choice_inputs(size)
        b = self.buffers
        wait_for_flag(b.flag.value, b.targets[parity : parity + 1])
        bits = b.device_bits[:size].copy_(b.bits[parity][:size], non_blocking=True)
        live = b.device_live[:size].copy_(b.live[parity][:size], non_blocking=True)
        argmax_rows(logits, self.vocab, out=self.last_ids[:size], penalty=(slots, self.counts.addresses),
                    noise=(inv_t, keys, pos), mask=(bits, live, b.covered))

    def _capture(self) -> None:
        size = self.decode.sizes[-1]
        logits, slots, inv_t, keys, pos = self.decode.choice_inputs(size)
        dev = logits.device
        # the kernels once, eagerly, on inputs that change nothing: no wait (target 0), no row
        # counted, greedy, no row live, the choice into a scratch buffer
        wait_for_flag(self.buffers.flag.value, torch.zeros(1, dtype=torch.int64, device=dev))
        argmax_rows(logits, self.vocab, out=torch.empty_like(self.last_ids[:size]),
                    penalty=(torch.full_like(slots, -1), self.counts.addresses),
                    noise=(torch.zeros_like(inv_t), torch.zeros_like(keys), torch.zeros_like(pos)),
                    mask=(torch.zeros_like(self.buffers.device_bits[:size]),
                          torch.zeros_like(self.buffers.device_live[:size]), self.buffers.covered))
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):  # nothing captured runs now: no ordering with the queue needed
            for size in self.decode.sizes:
                for parity in (0, 1):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        self._choose(size, parity)
                    finally:
                        graph.capture_end()
                    self.graphs[size, parity] = graph

    def run(self, size: int, fill: GrammarFill) -> None:
        """Queue the choice of the step whose masks `fill` holds (decode graph of `size`)."""
        self.buffers.target(fill)  # the step this replay waits for
        self.graphs[size, fill.step % 2].replay()
        self.counts.updated()
