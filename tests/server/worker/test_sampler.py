"""The batched sampler: greedy, top-k/top-p filtering, per-row seeds and positions, logprobs."""

import pytest
import torch

from server.sampling_params import SamplingParams
from server.worker.sampler import sample

GREEDY = SamplingParams(temperature=0.0)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_logits(n, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=gen(seed)) * 3


def draw(logits, params, seeds=None, positions=None, want_logprobs=False):
    """Rows draw independently: distinct seeds unless given."""
    n = logits.shape[0]
    params = params if isinstance(params, list) else [params] * n
    ids, lp = sample(logits, params, list(range(n)) if seeds is None else seeds,
                     [0] * n if positions is None else positions, want_logprobs)
    assert ids.dtype == torch.int64 and ids.shape == (logits.shape[0],)
    return ids, lp


def test_greedy_rows_are_the_argmax_and_ties_go_to_the_lowest_index():
    logits = random_logits(6)
    ids, lp = draw(logits, GREEDY)
    assert ids.tolist() == logits.argmax(-1).tolist() and lp is None
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    assert draw(ties, GREEDY)[0].tolist() == [1, 0, 2]


def test_greedy_rows_are_untouched_by_sampled_rows_in_the_same_batch():
    logits = random_logits(4)
    params = [GREEDY, SamplingParams(temperature=5.0), GREEDY, SamplingParams(temperature=5.0)]
    for pos in range(20):
        ids, _ = draw(logits, params, positions=[pos] * 4)
        assert ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(8)
    for t in (0.1, 1.0, 100.0):
        ids, _ = draw(logits, SamplingParams(temperature=t, top_k=1))
        assert ids.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    logits = random_logits(8)
    for t in (1.0, 50.0):
        ids, _ = draw(logits, SamplingParams(temperature=t, top_p=1e-6))
        assert ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_samples_only_among_the_k_largest():
    logits = random_logits(4, vocab=40).repeat(100, 1)
    k = 5
    allowed = logits.topk(k, dim=-1).indices
    # A high temperature flattens the distribution, so that masked tokens would be drawn if kept.
    ids, _ = draw(logits, SamplingParams(temperature=20.0, top_k=k))
    assert (allowed == ids[:, None]).any(-1).all()
    assert len(set(ids.tolist())) > 4  # it does sample, not just take the argmax


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    ids, _ = draw(logits, SamplingParams(top_p=0.7))
    assert set(ids.tolist()) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it


def test_same_seed_and_position_same_ids_wherever_the_row_sits_in_the_batch():
    vocab = 200
    row = torch.zeros(1, vocab)  # uniform: every draw depends on the noise alone
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(at, n=5):
        out = []
        for pos in range(10):
            logits = torch.randn(n, vocab)
            logits[at] = row
            params = [other] * n
            params[at] = seeded
            seeds = [7 * i + pos for i in range(n)]
            seeds[at] = 1234
            positions = [pos if i == at else 99 for i in range(n)]
            out.append(draw(logits, params, seeds, positions)[0][at].item())
        return out

    ref = run(0, n=1)
    assert len(set(ref)) > 5  # each position draws afresh
    assert run(0) == ref and run(2) == ref and run(4) == ref


def test_different_seeds_differ_and_equal_seeds_agree():
    n, vocab = 64, 1000
    logits = torch.zeros(n, vocab)
    p = SamplingParams(temperature=1.0)
    a, _ = draw(logits, p, [1000 + i for i in range(n)])
    b, _ = draw(logits, p, [2000 + i for i in range(n)])
    c, _ = draw(logits, p, [1000 + i for i in range(n)])
    d, _ = draw(logits, p, [1000 + i for i in range(n)], positions=[1] * n)
    assert (a != b).any() and (a != d).any()
    assert a.tolist() == c.tolist()


def test_draws_follow_the_distribution_for_every_kind_of_key():
    """Gumbel-max over the counter-based noise draws from softmax(logits / T): across seeds (one
    position), across positions (one seed), and with seeds past 2**32 or negative."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = (probs.log() * 0.7)[None].repeat(6000, 1)
    p = SamplingParams(temperature=0.7)
    keys = [list(range(6000)), [5] * 6000, [2**40 + 3 * i for i in range(6000)], [-(i + 1) for i in range(6000)]]
    positions = [[0] * 6000, list(range(6000)), [17] * 6000, [i % 7 for i in range(6000)]]
    for seeds, pos in zip(keys, positions):
        ids, _ = draw(logits, p, seeds, pos)
        freq = torch.bincount(ids, minlength=5).float() / 6000
        torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_logprobs_are_of_the_raw_logits_whatever_the_temperature():
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.3), GREEDY, SamplingParams(temperature=7.0, top_k=2)]
    _, lp = draw(logits, params, want_logprobs=True)
    torch.testing.assert_close(lp, torch.log_softmax(logits, dim=-1))
    _, lp = draw(logits, GREEDY, want_logprobs=True)
    torch.testing.assert_close(lp, torch.log_softmax(logits, dim=-1))


def test_plain_temperature_skips_the_filter_and_keeps_the_distribution(monkeypatch):
    """No row asks for top-k or top-p: the full-vocabulary sort is skipped (it costs milliseconds a
    step at large vocabularies), and draws still follow softmax(logits / T)."""
    import server.worker.sampler as sampler

    def no_sort(*_):
        raise AssertionError("the top-k/top-p filter ran for rows that asked for neither")

    monkeypatch.setattr(sampler, "_filter_top_k_top_p", no_sort)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    ids, _ = draw(logits * 0.5, SamplingParams(temperature=0.5))
    freq = torch.bincount(ids, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)
    with pytest.raises(AssertionError, match="filter ran"):
        draw(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=0.5, top_k=2)] * 2000)


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-20, 1e-6])
def test_sub_epsilon_temperatures_are_greedy_never_nan(temperature):
    """Issue 23, case 1: logits / 1e-40 overflowed fp32, the row became NaN and its "sample" token 0.
    Temperatures below GREEDY_BELOW are greedy; the smallest sampled one keeps every row finite."""
    from server.sampling_params import GREEDY_BELOW

    logits = random_logits(6) * 10
    logits[:, 0] = -50.0  # token 0 is never the argmax: a NaN row would show as 0
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    ids, _ = draw(logits, params, want_logprobs=True)
    assert ids.tolist() == logits.argmax(-1).tolist()
    ids, _ = draw(logits, [SamplingParams(temperature=GREEDY_BELOW)] * 6)  # the smallest that samples
    assert ids.tolist() == logits.argmax(-1).tolist()


def test_top_logprobs_ties_lowest_id_first():
    """Deterministic mode: tied values rank by token id (torch.topk's tie order follows the batch
    shape), values and ids otherwise as topk's; negatives, -inf and one row alike."""
    from server.worker.sampler import top_logprobs

    x = torch.tensor([[-1.5, -0.25, -0.25, -7.0, float("-inf"), -0.25],
                      [0.5, -0.0, 0.0, 2.0, 2.0, -3.0]])
    v, i = top_logprobs(x, 4, invariant=True)
    assert i.tolist() == [[1, 2, 5, 0], [3, 4, 0, 1]]  # -0.0 and +0.0 tie: id 1 first
    assert torch.equal(v, x.gather(1, i))
    assert top_logprobs(x[1:], 4, invariant=True)[1].tolist() == [[3, 4, 0, 1]]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 1000, generator=g).log_softmax(-1)  # no ties: the same as topk
    want_v, want_i = y.topk(7, dim=-1)
    got_v, got_i = top_logprobs(y, 7, invariant=True)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert torch.equal(top_logprobs(y, 7, invariant=False)[1], want_i)


def test_noise_keys_are_seeds_as_int64_and_fresh_draws_for_unseeded_rows():
    """A seeded row's key is its seed (seed + choice past 2**63 - 1 wraps to a negative int64,
    still distinct); unseeded rows get distinct keys, new ones each call."""
    import random

    from server.worker.sampler import noise_keys

    rng = random.Random(0)
    params = [SamplingParams(seed=5), SamplingParams(seed=2**63 - 1), SamplingParams(seed=2**63), SamplingParams(),
              SamplingParams()]
    keys = noise_keys(params, rng)
    assert keys[:3] == [5, 2**63 - 1, -(2**63)]
    assert keys[3] != keys[4] and all(-(2**63) <= k < 2**63 for k in keys)
    again = noise_keys(params, rng)
    assert again[:3] == keys[:3] and again[3:] != keys[3:]
