"""A speculative step's verification on the device: a sequence with proposals d_1..d_k is a chunk of
k + 1 tokens (its last token, then the proposals) at positions p..p+k over its paged cache, and
every one of those positions samples: row i holds the target's choice after d_1..d_i. That is a
prefill chunk with a cached prefix, whose tokens the Triton backend attends as decode rows over
the paged cache (models/attention/triton_backend.py `token_rows`: the chunk is short) and, on a
GPU, a captured graph of its own replays it
(`capture_verify_graphs`: server/worker/cuda_graphs.py's PrefillGraphs with a logit row per token).
Rows of a step: decodes, then each verification's k + 1, then the prompt chunks that sample. Each
row chooses as any row does (the argmax, Gumbel noise counted by its position, the general sampler,
a grammar's mask filled after the proposals before it), a penalized row over the counts after the
proposals before it (`verify_slots`: server/worker/spec/penalties.py); which proposals stand is the
host's to say (server/engine/spec/speculator.py)."""

from __future__ import annotations

import torch

from server.worker.inputs import ScheduledChunk, SeqState
from server.worker.spec.penalties import scratch_slots

# The largest verification a graph holds: chunks (sequences) and tokens; a step past either runs eagerly.
VERIFY_GRAPH_CHUNKS = 64
VERIFY_GRAPH_TOKENS = 512


def verify_rows(decodes: list[ScheduledChunk], verifies: list[ScheduledChunk], prefills: list[ScheduledChunk]
                ) -> tuple[list[SeqState], list[int], list[int]]:
    """The step's rows in order (a verification's sequence once per position), each row's position
    (the noise counter: its last input token's) and its offset in its sequence's run (what it has
    sampled before it this step: min_tokens counts it)."""
    rows = [item.seq for item in decodes]
    positions = [item.start for item in decodes]
    offsets = [0] * len(decodes)
    for item in verifies:
        n = item.num_tokens
        rows += [item.seq] * n
        positions += range(item.start, item.start + n)
        offsets += range(n)
    for item in prefills:
        if item.samples:
            rows.append(item.seq)
            positions.append(item.start + item.num_tokens - 1)
            offsets.append(0)
    return rows, positions, offsets


def verify_slots(runner, verifies: list[ScheduledChunk] | None, row0: int) -> dict[int, int] | None:
    """The scratch count slots of penalized verifications' rows from row0 on (server/worker/spec/penalties.py);
    None when no verification is penalized."""
    if not verifies or not any(item.seq.params.penalized for item in verifies):
        return None
    return scratch_slots(runner.counts, verifies, row0)


def verify_parts(runner, decodes: list[ScheduledChunk], verifies: list[ScheduledChunk],
                 prefills: list[ScheduledChunk]) -> list[torch.Tensor | None]:
    """The step's logits, in row order. With graphs: the decodes (as one-token chunks: none holds a
    placeholder in a speculative step) and the verifications in one forward, the verification graph
    where it fits, so that a step where some sequences verify and others decode reads the weights once
    (beside the decode graph it read them twice: a mixed step cost ~2x a decode step on the H100);
    then the prompt chunks, in the prefill graph or eagerly. Without: one eager forward of it all."""
    if runner.graphs is None:
        return [runner._eager([*verifies, *prefills], decodes, 0)]
    rows = len(decodes) + sum(item.num_tokens for item in verifies)
    parts = [runner._prefill([*decodes, *verifies], 0, runner.verify_graphs, rows)]
    if prefills:
        parts.append(runner._prefill(prefills, rows))
    return parts


def capture_spec_graphs(spec, runner, draft) -> None:
    """With speculation on (`spec`, the SpeculativeConfig): the runner's verification graphs, for up
    to as many sequences as may speculate at once, k + 1 tokens each (a graph per token count of the
    prefill ladder up to that), and the draft model's graphs (`draft`: None on the ranks of a
    tensor-parallel group but 0, which capture the same verification graphs)."""
    from server.worker.cuda_graphs import PrefillGraphs

    if spec is None or runner.graphs is None:
        return
    batch = min(spec.disable_by_batch_size, runner.max_num_seqs)
    if draft is not None:
        draft.capture_graphs(batch)
    if not runner.model.attention.prefill_graphs:
        return
    chunks = min(batch, VERIFY_GRAPH_CHUNKS)
    tokens = min(chunks * (spec.num_speculative_tokens + 1), VERIFY_GRAPH_TOKENS, runner.max_tokens)
    runner.verify_graphs = PrefillGraphs(runner.model, runner.kv_caches, tokens, runner.max_blocks, runner.device,
                                         max_chunks=chunks, max_rows=tokens,
                                         max_chunk_len=spec.num_speculative_tokens + 1)
    runner.verify_graphs.capture()
    if runner.peers is not None:  # tensor parallelism: every rank replays the verification rank 0 does
        runner.verify_graphs.on_replay = runner.peers.replayer(runner.verify_graphs, prefill=True, verify=True)
