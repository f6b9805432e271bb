"""Penalties in a verification: each of its rows sees the token counts as they would be after the
proposals before it, so that an accepted token is the one decoding without speculation chooses.

A penalized sequence's counts live in its `TokenCounts` slot (server/worker/logits.py). Row 0 of its
verification (the choice after its last token) reads that slot as a decode would. Row i (the choice
after proposals d_1..d_i) reads a scratch slot of its own for the step: a copy of the sequence's
counts, prompt set and penalties, with d_1..d_i counted. Every row's choice is counted into its
own slot, as any penalized choice is (kernels/argmax.py, or the general sampler). Row 0's is
always part of the accepted run, so the sequence's slot then holds it already; once the host knows
the run (`count_runs`, after the step's ids are in), the rest of it, d_1..d_j and row j's choice
after them, is counted there too, and the scratch slots go back to the free list.

Scratch slots cost k rows of the count tables per penalized sequence verifying in a step (at most
`disable_by_batch_size` of them), reused step after step; no host loop touches the vocabulary.
"""

from __future__ import annotations

import torch

from server.worker.inputs import ScheduledChunk
from server.worker.logits import TokenCounts, to_device


def scratch_slots(counts: TokenCounts, verifies: list[ScheduledChunk], row0: int) -> dict[int, int]:
    """{row: slot} for rows 1.. of each penalized verification (rows from row0 on, in order), their
    slots filled with the sequence's counts plus the proposals before the row (queued on the device
    before the step's choice)."""
    reclaim(counts)
    out, bases, copies, flat = {}, [], [], []
    r = row0
    for item in verifies:
        seq, n = item.seq, item.num_tokens
        p = seq.params
        if p.penalized and n > 1:
            base = counts.slot(seq.request_id, seq.prompt_token_ids, p)
            for i in range(1, n):
                s = counts.scratch()
                out[r + i] = s
                bases.append(base)
                copies.append(s)
                flat += [s * counts.vocab_size + t for t in item.draft[:i]]
        r += n
    if copies:
        dev = counts.device
        src, dst = to_device(bases, torch.long, dev), to_device(copies, torch.long, dev)
        counts.counts[dst] = counts.counts[src]
        counts.in_prompt[dst] = counts.in_prompt[src]
        counts.penalties[dst] = counts.penalties[src]
        counts.counts.view(-1).index_add_(0, to_device(flat, torch.long, dev), counts.ones_for(len(flat)))
    return out


def count_runs(counts: TokenCounts, runs: list[tuple[str, list[int]]]) -> None:
    """After a verification step: each penalized sequence's accepted run past its first token (which
    its row 0 counted) counted into its slot; the step's scratch slots free again."""
    reclaim(counts)
    slots, ids = [], []
    for request_id, tokens in runs:
        s = counts.slots.get(request_id)
        if s is not None and tokens:
            slots += [s] * len(tokens)
            ids += tokens
    if ids:
        with torch.inference_mode():  # (the tables are inference tensors)
            counts.add(to_device(slots, torch.long, counts.device), to_device(ids, torch.long, counts.device))


def reclaim(counts: TokenCounts) -> None:
    """The last verification's scratch slots, back to the free list once a later count update is
    queued (the rule of every released slot: a choice still queued may count into it)."""
    counts.released += counts.scratched
    counts.scratched = []
