"""The batched sampler (runs on the logits' device).

A sampled row's randomness is Gumbel noise keyed by its seed and counted by its position
(kernels/sampling_noise.py): a seeded request gives the same tokens whatever else shares its
batch, and the whole batch (greedy rows, seeded and unseeded sampled rows) chooses in one argmax
launch pair (kernels/argmax.py `noise`); on the CPU, its reference.
"""

from __future__ import annotations

import random

import torch

from kernels.argmax import argmax_rows
from kernels.log_softmax import log_softmax_rows
from kernels.reference import sampled_argmax_ref

from server.sampling_params import SamplingParams
from server.worker.logits import to_device


def log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Row-wise log-softmax of fp32 logits [n, V]; `invariant` (the deterministic mode): each row's
    bits independent of its place in the batch (kernels/log_softmax.py; torch's are not)."""
    return log_softmax_rows(x) if invariant else torch.log_softmax(x, dim=-1)


def softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Row-wise softmax, likewise."""
    return log_softmax_rows(x).exp() if invariant else torch.softmax(x, dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [n, k] of each row's k most likely tokens. `invariant`: equal values
    (-0.0 and +0.0 alike) in the lowest token id first. torch.topk leaves the order of ties to its
    algorithm, which follows the batch's shape; bf16 logits tie often (a random-weight
    Llama-3.2-1B's top alternative did, and a request's top_logprobs changed with the traffic around
    it). So the ranking key is one int64 per token, the value's order-preserving bits then the
    reversed id: no two are equal. (Built in place: one int64 [n, V] buffer.)"""
    if not invariant:
        return logprobs.topk(k, dim=-1)
    bits = (logprobs + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0; a fresh contiguous copy
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # monotone in the float
    vocab = logprobs.shape[-1]
    key.bitwise_left_shift_(32).bitwise_or_(vocab - 1 - torch.arange(vocab, device=logprobs.device))
    _, ids = key.topk(k, dim=-1)
    return logprobs.gather(-1, ids), ids


def inverse_temperatures(params: list[SamplingParams]) -> list[float]:
    """Each row's 1/temperature, 0 for a greedy row (temperature < GREEDY_BELOW: a sampled row's is
    at most 1/GREEDY_BELOW, so its scaled logits stay finite)."""
    return [0.0 if p.greedy else 1.0 / p.temperature for p in params]


def noise_keys(params: list[SamplingParams], rng: random.Random) -> list[int]:
    """Each row's noise key (kernels/sampling_noise.py): a seeded row's seed as an int64 (seed +
    choice may pass 2**63 - 1), else one drawn from `rng` now (a row's position makes each step's
    draw fresh, so a key may be kept while its rows run)."""
    base = rng.getrandbits(62)
    return [_int64(p.seed) if p.seed is not None else base + j for j, p in enumerate(params)]


def _int64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        invariant: bool = False) -> torch.Tensor:
    """logits [n, V] fp32; top_k [n] int (0 = off); top_p [n] float. Masks dropped tokens to -inf.
    `invariant`: the nucleus's probabilities from the batch-invariant log-softmax."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    probs = softmax(kept, invariant)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
    want_logprobs: bool = False, invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [n, V] fp32 -> (token ids [n] int64, log-probabilities [n, V] of the model's raw
    distribution, or None unless asked for). Row r's noise is keyed by seeds[r] and counted by
    positions[r], the position of the token whose logits it holds (greedy rows ignore both).
    Everything stays on the logits' device. `invariant` (the deterministic mode): top-p's nucleus
    from kernels/log_softmax.py, whose rows' bits do not depend on their place in the batch (torch's
    softmax's do); the choice itself is per row in any mode."""
    n = logits.shape[0]
    logprobs = log_softmax(logits, invariant) if want_logprobs else None
    inv_t = inverse_temperatures(params)
    dev = logits.device
    if not any(inv_t):
        out = logits.argmax(dim=-1)
        return out, logprobs
    filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    if filtered:
        # The filter sorts every row over the whole vocabulary (milliseconds a step at 256 rows of a
        # 152k vocabulary): only when some row asks for top-k or top-p. Its rows are scaled here.
        idx = to_device(filtered, torch.long, dev)
        scaled = logits[idx] * to_device([inv_t[i] for i in filtered], torch.float32, dev)[:, None]
        top_k = to_device([params[i].top_k for i in filtered], torch.long, dev)
        top_p = to_device([params[i].top_p for i in filtered], torch.float32, dev)
        logits = logits.index_put((idx,), _filter_top_k_top_p(scaled, top_k, top_p, invariant))
        for i in filtered:
            inv_t[i] = 1.0
    noise = (to_device(inv_t, torch.float32, dev), to_device(seeds, torch.int64, dev),
             to_device(positions, torch.int64, dev))
    if logits.is_cuda:
        out = argmax_rows(logits, logits.shape[1], noise=noise)
    else:
        out = sampled_argmax_ref(logits, logits.shape[1], *noise)
    assert out.shape[0] == n
    return out, logprobs
