"""bench_structured's summary of its alternating runs (the GPU runs themselves are benchmarks, not tests)."""

from benchmarks.engine.bench_structured import paired_ratio, split_timeline, summary


def run(with_tok_s: float, without_tok_s: float) -> dict:
    return dict(tokens=100, with_tok_s=with_tok_s, without_tok_s=without_tok_s)


def test_the_paired_ratio_is_the_median_of_each_pairs_own():
    # Each pair costs 10%, on a fast host (100k) or a slow one (60k); one pair straddles a change of
    # speed. The medians of the two sides then come from different stretches; the pairs do not.
    runs = [run(90e3, 100e3), run(54e3, 60e3), run(90e3, 60e3)]
    s = summary(runs)
    assert s["paired_ratio"] == 0.9 and abs(paired_ratio(runs) - 0.9) < 1e-12
    assert (s["with_tok_s"], s["without_tok_s"], s["ratio"]) == (90e3, 60e3, 1.5)
    steady = [run(90e3, 100e3)] * 4 + [run(45e3, 100e3)]
    assert summary(steady)["paired_ratio"] == summary(steady)["ratio"] == 0.9


def test_a_timeline_splits_the_wall_time_at_the_launches():
    # start at 0; the prompts' step launched at 2 ms, 64-row steps 1 ms apart, then two steps as
    # rows end (the last has no next launch: post), the last launch 0.5 ms before the end at 10 ms
    marks = [(0.002, 0, 64), (0.004, 64, 0), (0.005, 64, 0), (0.006, 64, 0), (0.0075, 40, 0), (0.0095, 3, 0)]
    t = split_timeline(marks, 0.0, 0.010)
    assert round(t["pre_ms"], 6) == 2 and round(t["first_ms"], 6) == 2 and round(t["full_us"], 3) == 1000
    assert t["full_steps"] == 3 and round(t["tail_ms"], 6) == 2 and round(t["post_ms"], 6) == 0.5
    assert t["steps"] == 6 and round(t["wall_ms"], 6) == 10


def test_the_order_check_divides_each_pairs_first_throughput_by_its_second():
    from benchmarks.engine.bench_pair_order import order_ratios

    # times in seconds: the first run of every pair takes 10% longer (throughput 1/1.1 of the second's)
    r = order_ratios([1.1, 2.2, 3.3, 1.1], [1.0, 2.0, 3.0, 1.0])
    assert abs(r["median"] - 1 / 1.1) < 1e-12 and r["pairs"] == 4 and r["q1"] <= r["median"] <= r["q3"]
