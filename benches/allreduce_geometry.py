"""Launch-geometry sweep of one allreduce (or allgather: ``ag_*``) algorithm at
large sizes, next to NCCL (what the tuner's candidates and the default geometry
are chosen from; with ag_mesh, the pull-only NVLink ceiling).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/allreduce_geometry.py --out DIR [--algorithm rsag_zc] \\
        [--sizes-mib 64,256] [--blocks 32,64,128] [--threads 256,512,1024]

bf16 sum in place on a registered buffer (small integers, so the result is
exact and checked bit for bit after the timing). Per (size, blocks, threads):
--ops calls captured in one CUDA graph, median over --reps replays of replay
time / ops; NCCL's all_reduce in the same kind of graph is the baseline. Rank 0
prints the table (time us, bus GB/s, medians over ranks) and writes
DIR/allreduce_geometry.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import bench_common

MIB = 1 << 20


def graph_time(torch, fn, ops: int, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(ops):
                fn()
        g.replay()
        torch.cuda.synchronize()
        times = bench_common.replay_times_us(torch, g, reps, ops, s)
    torch.cuda.current_stream().wait_stream(s)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("ar-geometry"))
    p.add_argument("--algorithm", default="rsag_zc")
    p.add_argument("--sizes-mib", default="64,256")
    p.add_argument("--blocks", default="32,64,128")
    p.add_argument("--threads", default="256,512,1024")
    p.add_argument("--ops", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--no-register",
        dest="register",
        action="store_false",
        help="leave the buffer unregistered (rsag_push: the all-gather pulls)",
    )
    args = p.parse_args(argv)
    register = args.register and args.algorithm in ("rsag_zc", "rsag_push", "ag_mesh")

    import moelink
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    sizes = [int(x) * MIB for x in args.sizes_mib.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    comm = moelink.AllReduce(dist.group.WORLD, max_bytes=max(sizes), tune_file=False)
    max_blocks = comm.limits()["max_blocks"]
    buf = torch.empty(max(sizes) // 2, dtype=torch.bfloat16, device="cuda")
    gather = args.algorithm.startswith("ag_")
    if register:
        comm.register(buf)
    rows, failures = [], []
    for size in sizes:
        n = size // 2
        if gather:
            # size = the gathered output; each rank contributes n / world elements
            # from its registered buffer (the peers read it: zero copy).
            m = n // world
            x = buf[:m]
            base = torch.arange(m, device="cuda") % 13 - 6
            ref = (base + rank).to(torch.bfloat16)
            want = torch.cat([(base + r).float() for r in range(world)])
            out = torch.empty(m * world, dtype=torch.bfloat16, device="cuda")
        else:
            x = buf[:n]
            # Small integers, different per rank: every partial sum is exact in bf16.
            base = torch.arange(n, device="cuda") % 13 - 6
            ref = (base + rank).to(torch.bfloat16)
            want = (base * world + world * (world - 1) // 2).float()
            out = x
        cands = [(b, t) for b in blocks for t in threads if b <= max_blocks]
        for b, t in [*cands, ("nccl", 0)]:
            if gather and b == "nccl":
                fn = lambda x=x, out=out: dist.all_gather_into_tensor(out, x)  # noqa: E731
            elif gather:
                fn = lambda x=x, out=out, b=b, t=t: comm.all_gather(  # noqa: E731
                    out, x, algorithm=args.algorithm, num_blocks=b, num_threads=t
                )
            elif b == "nccl":
                fn = lambda x=x: dist.all_reduce(x)  # noqa: E731
            else:
                fn = lambda x=x, b=b, t=t: comm.all_reduce(  # noqa: E731
                    x, algorithm=args.algorithm, num_blocks=b, num_threads=t
                )
            x.copy_(ref)
            us = graph_time(torch, fn, args.ops, args.reps)
            # Correctness after the timing: one more call on fresh small integers.
            x.copy_(ref)
            out.fill_(float("nan"))
            x.copy_(ref)
            fn()
            if not torch.equal(out.float(), want):
                failures.append(f"rank {rank}: {size} B {b}x{t} wrong")
            everyone = [None] * world
            dist.all_gather_object(everyone, us)
            med = statistics.median(everyone)
            # Bus bandwidth: 2 (R-1)/R x bytes (allreduce), (R-1)/R x output (allgather).
            factor = (world - 1) / world * (1 if gather else 2)
            bus = factor * size / (med * 1e-6) / 1e9
            rows.append({"bytes": size, "blocks": b, "threads": t, "us": med, "bus_gbps": bus,
                         "per_rank_us": everyone})  # fmt: skip
            if rank == 0:
                print(f"{size // MIB:5d} MiB {b!s:>5} x {t:4d}: {med:9.1f} us {bus:6.1f} GB/s",
                      flush=True)  # fmt: skip
    if register:
        comm.deregister(buf)
    comm.destroy()
    everyone = [None] * world
    dist.all_gather_object(everyone, failures)
    failures = [f for r in everyone for f in r]
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "allreduce_geometry.json").write_text(
            json.dumps(
                {
                    "algorithm": args.algorithm,
                    "registered": register,
                    "world": world,
                    "command": " ".join(sys.argv),
                    "rows": rows,
                    "failures": failures,
                },
                indent=2,
            )
            + "\n"  # fmt: skip
        )
        for f in failures:
            print("CHECK FAILED", f)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
