"""Launch-geometry sweep of one allreduce (or allgather: ``ag_*``) algorithm at
large sizes, next to NCCL (what the tuner's candidates and the default geometry
are chosen from; with ag_mesh, the pull-only NVLink ceiling).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/allreduce_geometry.py --out DIR [--algorithm rsag_zc] \\
        [--sizes-mib 64,256] [--blocks 32,64,128] [--threads 256,512,1024]
    python -m moelink.launch -n 4 benches/allreduce_geometry.py --out DIR   # any GPU count

bf16 sum in place on a registered buffer (small integers, so the result is
exact and checked bit for bit after the timing). Per (size, blocks, threads):
--ops calls captured in one CUDA graph, median over --reps replays of replay
time / ops; NCCL's all_reduce (all_gather_into_tensor) in the same kind of graph
is the baseline. Where ranks share a GPU (NCCL refuses that) the baseline is the
same-GPU copy instead: ``dst.copy_(src)`` of the same bytes (the allgather: of
its output) on every rank, all ranks at once, in the same kind of graph (one
GPU's HBM ceiling; row ``copy``), and block counts above a rank's share of the
GPU are left out (``limits()["max_blocks"]``). Rank 0 prints the table (time us,
bus GB/s, medians over ranks) and writes DIR/allreduce_geometry.json (with the
machine: ranks per GPU, backend, MPS state; and the baseline).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import bench_common

MIB = 1 << 20
#: Row names of the baselines (the ``blocks`` column).
NCCL = "nccl"
COPY = "copy"


def graph_time(torch, fn, ops: int, reps: int, ready=None) -> float:
    """``ops`` calls of ``fn`` in one CUDA graph: median over ``reps`` replays of
    replay time / ops, us. ``ready()`` (a barrier) runs before the replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = bench_common.capture_graph(torch, fn, ops, s, ready)
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

    info = bench_common.init()
    rank, world = info.rank, info.world_size
    baseline = NCCL if bench_common.uses_nccl(info) else COPY
    note = bench_common.shared_gpu_note(info)
    if rank == 0 and note:
        print(
            f"{note}\nbaseline (row copy): {bench_common.COPY_LABEL} ({bench_common.COPY_HOW}); "
            "its bus GB/s: that of a collective as fast as the copy"
        )
    sizes = [int(x) * MIB for x in args.sizes_mib.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    comm = moelink.AllReduce(dist.group.WORLD, max_bytes=max(sizes), tune_file=False)
    max_blocks = comm.limits()["max_blocks"]
    # Ranks that share a GPU get a share of its SMs: more blocks would be capped.
    usable = [b for b in blocks if b <= max_blocks] or [max_blocks]
    if rank == 0 and usable != blocks:
        print(f"blocks {blocks} -> {usable}: at most {max_blocks} per rank here", flush=True)
    buf = torch.empty(max(sizes) // 2, dtype=torch.bfloat16, device="cuda")
    gather = args.algorithm.startswith("ag_")
    if register:
        comm.register(buf)
    # The copy baseline's destination (allreduce: of x; allgather: of its output).
    copy_dst = torch.empty_like(buf) if baseline == COPY and not gather else None
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
        cands = [(b, t) for b in usable for t in threads]
        for b, t in [*cands, (baseline, 0)]:
            ready = None
            if b == COPY:
                # The same bytes within the GPU: allreduce x -> copy_dst; allgather
                # buf (as large as the output) -> out. Every rank at once.
                src, dst = (buf[: out.numel()], out) if gather else (x, copy_dst[:n])
                fn = lambda src=src, dst=dst: dst.copy_(src)  # noqa: E731
                ready = dist.barrier
            elif gather and b == NCCL:
                fn = lambda x=x, out=out: dist.all_gather_into_tensor(out, x)  # noqa: E731
            elif gather:
                fn = lambda x=x, out=out, b=b, t=t: comm.all_gather(  # noqa: E731
                    out, x, algorithm=args.algorithm, num_blocks=b, num_threads=t
                )
            elif b == NCCL:
                fn = lambda x=x: dist.all_reduce(x)  # noqa: E731
            else:
                fn = lambda x=x, b=b, t=t: comm.all_reduce(  # noqa: E731
                    x, algorithm=args.algorithm, num_blocks=b, num_threads=t
                )
            x.copy_(ref)
            us = graph_time(torch, fn, args.ops, args.reps, ready)
            # Correctness after the timing: one more call on fresh small integers.
            x.copy_(ref)
            out.fill_(float("nan"))
            x.copy_(ref)
            fn()
            if b != COPY and not torch.equal(out.float(), want):
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
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "machine": bench_common.machine_info(info),
                    "git_commit": bench_common.git_commit()["commit"],
                    "command": bench_common.run_command(world, argv),
                    "baseline": {
                        "row": baseline,
                        **bench_common.baseline_record(
                            info, "NCCL all_gather_into_tensor" if gather else "NCCL all_reduce"
                        ),
                    },
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
