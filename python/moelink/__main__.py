"""``python -m moelink``: the main job.

With CUDA GPUs: the intranode dispatch/combine workload of PERFORMANCE.md (4096
tokens per rank, hidden 7168, top-8 of 256 experts) on every local GPU, one
process and rank per GPU (a single GPU runs one rank). Every output is checked
against the CPU reference, then the bandwidth table is printed, with NCCL's
all_to_all_single moving the same rows in the same run as the baseline.

Without a GPU: says so and runs the same workload through the CPU reference
(``moelink.reference``) with 4 ranks simulated in one process, by default at a
smaller size, printing the same report (times are the CPU oracle's).

``--peer-write`` runs the earlier peer-write diagnostic instead. The exit code is
1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import moelink
from moelink import intranode_demo

#: Tokens per rank on the CPU unless --num-tokens says otherwise: the full 4096
#: take ~50 s in the CPU reference on 2 cores (1024: ~7 s).
CPU_DEFAULT_TOKENS = 1024
#: Ranks simulated on the CPU unless --ranks says otherwise.
CPU_DEFAULT_RANKS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moelink",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    intranode_demo.add_arguments(
        p,
        num_tokens=None,
        num_tokens_help=f"tokens per rank (default: 4096 on GPUs, {CPU_DEFAULT_TOKENS} on the CPU)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        help=f"ranks: GPUs to use (default: all) or ranks simulated on the CPU "
        f"(default: {CPU_DEFAULT_RANKS})",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the ranks (default: 900)"
    )
    p.add_argument(
        "--peer-write", action="store_true", help="run the peer-write diagnostic instead"
    )
    p.add_argument("--words", type=int, default=1 << 22, help="--peer-write: 64-bit words per slot")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    print(f"moelink {moelink.__version__}; kernels compiled for sm_{moelink.compiled_archs()}")
    if args.peer_write:
        return peer_write(args)
    try:
        intranode_demo.normalize_args(args)
        if args.ranks is not None and args.ranks < 1:
            raise ValueError(f"--ranks must be positive, got {args.ranks}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    n = moelink.device_count()
    t0 = time.perf_counter()
    if n == 0:
        ranks = args.ranks or CPU_DEFAULT_RANKS
        if args.num_tokens is None:
            args.num_tokens = CPU_DEFAULT_TOKENS
        print(
            f"No CUDA device here: running the intranode workload through the CPU reference "
            f"(moelink.reference), {ranks} ranks simulated in one process, "
            f"{args.num_tokens} tokens per rank"
            + (" (4096 on GPUs; --num-tokens to change)" if args.num_tokens != 4096 else "")
            + "."
        )
        result = intranode_demo.run_cpu_simulation(ranks, args)
        per_rank: list = []
    else:
        ranks = min(args.ranks or n, n)
        if args.num_tokens is None:
            args.num_tokens = 4096
        print(
            f"{n} CUDA device(s): intranode dispatch/combine on {ranks} rank(s), one process "
            f"per GPU, SM counts {args.sms}."
        )
        per_rank = intranode_demo.run_on_local_gpus(ranks, args, timeout_s=args.timeout)
        errors = [r for r in per_rank if "error" in r]
        if errors:
            for r in errors:
                print(f"rank {r['rank']} FAILED: {r['error']}")
            _write_json(args.json, {"per_rank": per_rank})
            return 1
        result = intranode_demo.aggregate(per_rank)

    print(intranode_demo.format_report(result))
    print(f"(took {time.perf_counter() - t0:.1f} s)")
    _write_json(args.json, {"results": result, "per_rank": per_rank})
    return 0 if result["correct"] else 1


def _write_json(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")


def peer_write(args) -> int:
    """The peer-write diagnostic across every local GPU (one process per GPU,
    NVLink stores into every peer, checked against the CPU); without a GPU, the
    CPU side of the check (pattern words)."""
    n = moelink.device_count()
    if n == 0:
        print("No CUDA device here: running the CPU side of the peer-write check only.")
        from moelink import _native

        seed = int.from_bytes(os.urandom(8), "little") >> 1
        values = {_native.pattern_word(seed, s, d, 7) for s in range(4) for d in range(4)}
        ok = len(values) == 16
        print(f"pattern words distinct for 4x4 (src, dst) pairs: {ok}")
        return 0 if ok else 1

    from moelink.diagnostics import run_on_local_gpus

    reports = run_on_local_gpus(n, args.words)
    reports.sort(key=lambda r: r["rank"])
    failed = [r for r in reports if "error" in r]
    print(f"peer-write check on {n} GPUs, {args.words * 8 >> 20} MiB per peer slot:")
    print(f"{'rank':>4} {'status':>7} {'kernel ms':>10} {'GB/s out':>9}")
    for r in reports:
        if "error" in r:
            print(f"{r['rank']:>4} {'FAIL':>7}  {r['error']}")
        else:
            gbs = r["bytes_written"] / (r["kernel_ms"] * 1e-3) / 1e9
            print(f"{r['rank']:>4} {'ok':>7} {r['kernel_ms']:>10.3f} {gbs:>9.1f}")
    _write_json(args.json, reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
