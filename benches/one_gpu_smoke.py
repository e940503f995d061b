"""Every Python benchmark at several rank counts on this machine's GPUs, with small
sizes and few iterations: a smoke run that fits one GPU call of a few minutes.
Ranks share GPUs where they outnumber them (a one-GPU machine: all of them).

    python benches/one_gpu_smoke.py --out DIR [--ranks 2 4 8] [--only ll_bench ...]
                                     [--mps auto|on|off] [--timeout 150] [--ll-proxy]

Each run is ``python -m moelink.launch -n N --timeout T benches/<bench>.py <small
options>`` (the options: SMALL below; benchmarks with ``--out`` write into
DIR/<bench>-<N>/). Its output goes to DIR/<bench>-<N>.log and to stdout. At the
end a table of exit codes and wall seconds is printed and written to
DIR/smoke.json. The exit code is 1 when any run failed. moelink must be
importable (the wheel installed, e.g. ``PYTHONPATH=/tmp/moelink-site``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Small options per benchmark; "{out}" becomes the run's output folder.
SMALL = {
    "intranode_bench": [
        "--num-tokens", "512", "--sms", "8", "16", "24", "--iters", "5", "--warmup", "2",
        "--out", "{out}",
    ],
    "intranode_profile": ["--num-tokens", "512", "--sms", "8", "16", "--iters", "3"],
    "ll_bench": ["--iters", "20", "--warmup", "5", "--no-sweep", "--no-proxy", "--out", "{out}"],
    "allreduce_bench": [
        "--min-bytes", "4096", "--max-bytes", str(4 << 20), "--iters", "6", "--warmup", "2",
        "--graph-ops", "5", "--out", "{out}",
    ],
    "allreduce_geometry": [
        "--sizes-mib", "4,16", "--blocks", "8,16", "--threads", "512", "--ops", "3",
        "--reps", "3", "--out", "{out}",
    ],
}  # fmt: skip


def command(bench: str, ranks: int, out: Path, args) -> list:
    """The launcher's command line for one run."""
    options = [str(out) if o == "{out}" else o for o in SMALL[bench]]
    if bench == "ll_bench" and args.ll_proxy:
        options.remove("--no-proxy")
    launch = [sys.executable, "-m", "moelink.launch", "-n", str(ranks)]
    launch += ["--timeout", str(args.timeout)]
    if args.mps:
        launch += ["--mps", args.mps]
    return [*launch, str(HERE / f"{bench}.py"), *options]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="folder for outputs and logs")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts")
    p.add_argument("--only", nargs="+", choices=sorted(SMALL), help="these benchmarks only")
    p.add_argument("--mps", choices=("auto", "on", "off"), help="moelink.launch --mps")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    p.add_argument("--ll-proxy", action="store_true", help="ll_bench: the proxy transport too")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for ranks in args.ranks:
        for bench in args.only or SMALL:
            name = f"{bench}-{ranks}"
            cmd = command(bench, ranks, args.out / name, args)
            print(f"=== {name}: {' '.join(cmd)}", flush=True)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            seconds = time.monotonic() - t0
            (args.out / f"{name}.log").write_text(proc.stdout)
            print(proc.stdout, end="", flush=True)
            print(f"=== {name}: rc={proc.returncode} ({seconds:.0f} s)", flush=True)
            runs.append({"bench": bench, "ranks": ranks, "rc": proc.returncode,
                         "seconds": round(seconds, 1), "command": " ".join(cmd)})  # fmt: skip
    (args.out / "smoke.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"\n{'benchmark':<20} {'ranks':>5} {'rc':>4} {'seconds':>8}")
    for r in runs:
        print(f"{r['bench']:<20} {r['ranks']:>5} {r['rc']:>4} {r['seconds']:>8.0f}")
    print(f"total {sum(r['seconds'] for r in runs):.0f} s; wrote {args.out / 'smoke.json'}")
    return 1 if any(r["rc"] != 0 for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
