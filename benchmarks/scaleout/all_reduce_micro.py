"""The all-reduce alone, as a decode graph pays it: NCCL's against the one-shot over symmetric memory
(models/parallel/symm_all_reduce.py), per message size, at N ranks on cuda:0..N-1 (bench_tp's
`--all-reduce-bytes`; alone: `python -m benchmarks.scaleout.all_reduce_micro --tp 2 4 --out-dir $OUT`).

Each rank captures GRAPH_OPS all-reduces of one bf16 message back to back in a CUDA graph per
path (what a decode graph holds: no launch overhead), replays it REPLAYS times between CUDA events
(after WARMUP replays and a barrier, so the ranks start together; every replay's collectives meet
the other ranks'), and rank 0 reports the median replay over GRAPH_OPS, in microseconds. The
values summed grow without bound; only the time is read.
"""

from __future__ import annotations

import gc

GRAPH_OPS = 32
WARMUP = 5
REPLAYS = 50
TIMEOUT_S = 300  # for rank 0's report (a rank that fails ends the wait at once)


def _rank(rank: int, size: int, port: int, sizes: list[int], out) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from benchmarks.shared.common import replay_us
    from models import close_tensor_parallel, init_tensor_parallel
    from models.parallel.group import start_custom_all_reduce
    from server.config import NCCL_ENV

    os.environ.update(NCCL_ENV)
    device = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, size, TCPStore("127.0.0.1", port, size, is_master=rank == 0), device)
    custom = start_custom_all_reduce(tp, device, nbytes=max(sizes))  # a buffer for the largest size measured
    graphs = []

    def nccl(x):
        dist.all_reduce(x)
        return x

    def reduce_us(reduce, x) -> float:
        for _ in range(3):  # eager first: whatever either path sets up on first use
            reduce(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_OPS):
                reduce(x)
        graphs.append(graph)
        for _ in range(WARMUP):
            graph.replay()
        dist.barrier()
        torch.cuda.synchronize()
        return replay_us(graph, GRAPH_OPS, REPLAYS)

    try:
        rows = []
        for nbytes in sizes:
            x = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
            row = {"bytes": nbytes, "nccl_us": round(reduce_us(nccl, x), 2)}
            if custom is not None and custom.fits(x):
                row["custom_us"] = round(reduce_us(custom, x), 2)
                row["nccl_over_custom"] = round(row["nccl_us"] / row["custom_us"], 2)
            rows.append(row)
        if rank == 0:
            out.put(("rows", rows, custom is not None))
    finally:
        graphs.clear()  # before the group goes (pytorch#115388)
        gc.collect()
        close_tensor_parallel()


def measure(size: int, sizes: list[int]) -> dict:
    """{tp, graph_ops, replays, custom (whether it set up), rows: [{bytes, nccl_us, custom_us,
    nccl_over_custom}]} at `size` ranks, processes of their own on cuda:0..size-1."""
    import multiprocessing as mp

    from benchmarks.shared.common import free_port, wait_for_report

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_rank, args=(r, size, port, sizes, out)) for r in range(size)]
    for p in ranks:
        p.start()
    done = False
    try:
        _, rows, custom = wait_for_report(ranks, out, TIMEOUT_S)
        done = True
    finally:
        for p in ranks:
            p.join(60 if done else 0)  # a failed rank leaves the others waiting in a collective for good
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in ranks):
        raise RuntimeError(f"all-reduce microbenchmark: rank exit codes {[p.exitcode for p in ranks]}")
    return {"tp": size, "graph_ops": GRAPH_OPS, "replays": REPLAYS, "custom": custom, "rows": rows}


def describe(tp: int, row: dict) -> str:
    """One measured size as a line of a log: both paths' microseconds and NCCL's over the custom's."""
    custom = f"{row['custom_us']:.2f} us ({row['nccl_over_custom']:.2f}x)" if "custom_us" in row else "-"
    return f"all-reduce tp={tp} {row['bytes']:>8} B: NCCL {row['nccl_us']:.2f} us, custom {custom}"


def main(argv: list[str] | None = None) -> list[dict]:
    import argparse

    from benchmarks.shared.common import gpu_run_info, write_result

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--bytes", type=int, nargs="+", default=[8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20])
    p.add_argument("--out-dir", default=None, help="writes all_reduce_<gpu>.json there")
    args = p.parse_args(argv)
    runs = [measure(tp, args.bytes) for tp in args.tp]
    for run in runs:
        for r in run["rows"]:
            print(describe(run["tp"], r), flush=True)
    if args.out_dir:
        write_result({**gpu_run_info("benchmarks.scaleout.all_reduce_micro", argv), "all_reduce": runs},
                     args.out_dir, "all_reduce")
    return runs


if __name__ == "__main__":
    main()
