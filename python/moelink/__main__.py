"""``python -m moelink``: the main job.

On a machine with CUDA GPUs: the peer-write diagnostic across every local GPU
(one process per GPU, NVLink stores into every peer, checked against the CPU).
Without a GPU: says so and runs the same check's CPU side (pattern and checker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import moelink


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelink", description=__doc__)
    p.add_argument("--words", type=int, default=1 << 22, help="64-bit words per slot")
    p.add_argument("--json", help="write the reports to this file")
    args = p.parse_args(argv)

    print(f"moelink {moelink.__version__}; kernels compiled for sm_{moelink.compiled_archs()}")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
