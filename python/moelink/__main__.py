"""``python -m moelink``: the main job.

With CUDA GPUs: the intranode dispatch/combine workload of docs/performance.md (4096
tokens per rank, hidden 7168, top-8 of 256 experts) on the local GPUs, one
process per rank, by default one rank per GPU. Every output is checked against
the CPU reference, then the bandwidth table is printed, with NCCL's
all_to_all_single moving the same rows in the same run as the baseline.

``--ranks N`` with more ranks than GPUs places rank ``r`` on GPU ``r % G``, several
ranks per GPU, under an MPS daemon where one can be had (``--mps``, as
``python -m moelink.launch``) and with a gloo process group (NCCL refuses two
ranks on one GPU). That checks correctness at any rank count on one GPU; its
bandwidth figures then measure one GPU's memory, not NVLink, and the NCCL
baseline is skipped.

Without a GPU: says so and runs the same workload through the CPU reference
(``moelink.reference``) with 4 ranks simulated in one process, by default at a
smaller size, printing the same report (times are the CPU oracle's).

``--nodes N`` splits the ranks into N emulated nodes of consecutive ranks
(``MOELINK_RANKS_PER_NODE``): the internode path runs, every cross-node byte
through the CPU proxy, and the checks use the internode reference (per-node
token counts; combine as per-node bf16 partials summed in node order). On the
CPU it runs through the reference like the intranode workload.

``--peer-write`` runs the earlier peer-write diagnostic instead. The exit code is
1 when any check fails, 2 for an invalid option (one ``error:`` line on stderr,
before any work).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import moelink
from moelink import intranode_demo, launch

#: Tokens per rank on the CPU unless --num-tokens says otherwise: the full 4096
#: take ~50 s in the CPU reference on 2 cores (1024: ~7 s).
CPU_DEFAULT_TOKENS = 1024
GPU_DEFAULT_TOKENS = 4096
#: Ranks simulated on the CPU unless --ranks says otherwise.
CPU_DEFAULT_RANKS = 4
#: --peer-write: 64-bit words per slot at most (2 GiB).
MAX_WORDS = 1 << 28


def build_parser() -> launch.CliParser:
    p = launch.CliParser(
        prog="python -m moelink",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    intranode_demo.add_arguments(
        p,
        num_tokens=None,
        num_tokens_help=f"tokens per rank (default: {GPU_DEFAULT_TOKENS} on GPUs, "
        f"{CPU_DEFAULT_TOKENS} on the CPU)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        help="ranks (default: one per GPU; more than the GPUs: several per GPU, "
        f"round-robin), or ranks simulated on the CPU (default: {CPU_DEFAULT_RANKS})",
    )
    p.add_argument(
        "--mps",
        choices=launch.MPS_MODES,
        help="MPS where ranks share a GPU, as python -m moelink.launch "
        f"(default: ${launch.MPS_MODE_ENV}, else auto)",
    )
    p.add_argument(
        "--timeout",
        type=launch.positive_seconds,
        default=900.0,
        help="seconds to wait for the ranks (default: 900)",
    )
    p.add_argument(
        "--peer-write", action="store_true", help="run the peer-write diagnostic instead"
    )
    p.add_argument("--words", type=int, default=1 << 22, help="--peer-write: 64-bit words per slot")
    return p


def check_output_path(path) -> None:
    """ValueError unless ``path`` (``--json``) can be written: its directory
    exists and is writable, and it is not a directory itself."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--json: {path} is a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"--json: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--json: directory {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--json: {path} is not writable")


def check_args(args, num_gpus: int) -> int:
    """Checks every option (ValueError or LaunchError naming it) and fills in the
    defaults that depend on the machine (``num_gpus``); returns the rank count."""
    check_output_path(args.json)
    if args.ranks is not None and args.ranks < 1:
        raise ValueError(f"--ranks must be positive, got {args.ranks}")
    ranks = args.ranks or (num_gpus if num_gpus else CPU_DEFAULT_RANKS)
    args.mps = launch.mps_mode(args.mps)
    if not 1 <= args.words <= MAX_WORDS:
        raise ValueError(f"--words must be in 1..{MAX_WORDS}, got {args.words}")
    if args.num_tokens is None:
        args.num_tokens = GPU_DEFAULT_TOKENS if num_gpus else CPU_DEFAULT_TOKENS
    intranode_demo.normalize_args(args, ranks)
    return ranks


def parse_args(argv, num_gpus: int) -> tuple:
    """(options, rank count) of ``argv`` on a machine with ``num_gpus`` GPUs; an
    invalid option exits 2 with one ``error:`` line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        ranks = check_args(args, num_gpus)
    except (ValueError, launch.LaunchError) as e:
        parser.error(str(e))
    return args, ranks


def main(argv=None) -> int:
    num_gpus = moelink.device_count()
    args, ranks = parse_args(argv, num_gpus)
    print(f"moelink {moelink.__version__}; kernels compiled for sm_{moelink.compiled_archs()}")
    t0 = time.perf_counter()
    try:
        with launch.signals_raise():
            if args.peer_write:
                return peer_write(args, ranks, num_gpus)
            if num_gpus == 0:
                return run_on_cpu(args, ranks, t0)
            return run_on_gpus(args, ranks, num_gpus, t0)
    except launch.LaunchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except launch.Interrupted as e:
        print(f"interrupted by signal {e.signum}: the ranks are stopped", file=sys.stderr)
        return 128 + e.signum


def _path(args) -> str:
    """ "intranode", or with --nodes the internode path on emulated nodes."""
    if args.nodes <= 1:
        return "intranode"
    return f"internode ({args.nodes} emulated nodes)"


def run_on_cpu(args, ranks: int, t0: float) -> int:
    print(
        f"No CUDA device here: running the {_path(args)} workload through the CPU reference "
        f"(moelink.reference), {ranks} ranks simulated in one process, "
        f"{args.num_tokens} tokens per rank"
        + (
            f" ({GPU_DEFAULT_TOKENS} on GPUs; --num-tokens to change)"
            if args.num_tokens != GPU_DEFAULT_TOKENS
            else ""
        )
        + "."
    )
    result = intranode_demo.run_cpu_simulation(ranks, args)
    return _report(args, result, [], t0)


def run_on_gpus(args, ranks: int, num_gpus: int, t0: float) -> int:
    with launch.gpu_sharing(ranks, num_gpus, args.mps, log=print) as sharing:
        placement = (
            "one process per rank, several ranks per GPU"
            if sharing.shared
            else "one process per GPU"
        )
        print(
            f"{num_gpus} CUDA device(s): {_path(args)} dispatch/combine on {ranks} rank(s), "
            f"{placement}, SM counts {args.sms}."
        )
        if sharing.shared:
            print(
                intranode_demo.shared_gpu_note(ranks, num_gpus, sharing.uses_mps)
                + "; the all_to_all_single baseline (NCCL) needs one GPU per rank and is skipped."
            )
        per_rank = intranode_demo.run_on_local_gpus(
            ranks, args, timeout_s=args.timeout, sharing=sharing
        )
    errors = [r for r in per_rank if "error" in r]
    if errors:
        for r in errors:
            print(f"rank {r['rank']} FAILED: {r['error']}")
        _write_json(args.json, {"per_rank": per_rank})
        return 1
    return _report(args, intranode_demo.aggregate(per_rank), per_rank, t0)


def _report(args, result: dict, per_rank: list, t0: float) -> int:
    print(intranode_demo.format_report(result))
    print(f"(took {time.perf_counter() - t0:.1f} s)")
    _write_json(args.json, {"results": result, "per_rank": per_rank})
    return 0 if result["correct"] else 1


def _write_json(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")


def peer_write(args, ranks: int, num_gpus: int) -> int:
    """The peer-write diagnostic on ``ranks`` ranks over the local GPUs (one
    process per rank, round-robin, stores into every peer's memory: over NVLink
    between GPUs, within one GPU's memory between ranks that share it, checked
    against the CPU); without a GPU, the CPU side of the check (pattern words)."""
    if num_gpus == 0:
        print("No CUDA device here: running the CPU side of the peer-write check only.")
        from moelink import _native

        seed = int.from_bytes(os.urandom(8), "little") >> 1
        values = {_native.pattern_word(seed, s, d, 7) for s in range(4) for d in range(4)}
        ok = len(values) == 16
        print(f"pattern words distinct for 4x4 (src, dst) pairs: {ok}")
        return 0 if ok else 1

    from moelink.diagnostics import run_on_local_gpus

    with launch.gpu_sharing(ranks, num_gpus, args.mps, log=print) as sharing:
        reports = run_on_local_gpus(ranks, args.words, timeout_s=args.timeout, sharing=sharing)
    reports.sort(key=lambda r: r["rank"])
    failed = [r for r in reports if "error" in r]
    print(f"peer-write check, {sharing.describe()}, {args.words * 8 >> 20} MiB per peer slot:")
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
