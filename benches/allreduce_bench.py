"""Allreduce benchmark (docs/performance.md, "Allreduce"): moelink.AllReduce next to NCCL.

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/allreduce_bench.py --out DIR [--min-bytes 1024] [--max-bytes 1073741824] \\
        [--iters 30] [--graph-ops 20] [--algorithms oneshot_ll,rsag] [--no-graph] [--tune]
    python -m moelink.launch -n 4 benches/allreduce_bench.py --out DIR   # any GPU count

4 ranks, bf16, in place, power-of-two sizes from --min-bytes to --max-bytes. For
every size, every applicable moelink algorithm (pinned), the selector ("auto", with
the tuned table when one is loaded or --tune made one) and NCCL through
``torch.distributed.all_reduce`` are first checked (small-integer inputs whose sums
bf16 holds exactly, compared bit for bit on every rank), then timed with CUDA
events after warm-up. Where ranks share a GPU (NCCL refuses that) the baseline is
the same-GPU copy instead: ``dst.copy_(src)`` of the same bytes on every rank, all
ranks at once, timed the same way (one GPU's HBM ceiling; row ``same_gpu_copy``),
and the targets (NVLink figures) are not judged:

- eager: each op launched on its own, back to back, events around every op; the
  median over --iters ops (CPU launch overhead included when it exceeds the GPU
  time, as a training step sees it);
- graph: --graph-ops ops captured into one CUDA graph; median over replays of
  replay time / ops.

Bus bandwidth = 2 (R - 1) / R x bytes / time. Numbers are medians over ranks of
the per-rank medians (per-rank values in the JSON). docs/performance.md targets: the
latency targets (<= 16 MiB) are compared with the graph times (where no CPU
overhead hides the kernels) and, from 64 MiB, the bus bandwidth must reach NCCL's
in the same mode of the same run.

Rank 0 writes DIR/allreduce.json (machine, commit, command, config, per-size
times per algorithm and mode, NCCL baseline, checks) and DIR/allreduce.png
(latency and bus bandwidth against size) and prints the summary table. The exit
code is 1 when a check failed.

    python benches/allreduce_bench.py --replot DIR/allreduce.json

redraws the PNG next to an existing JSON (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import bench_common

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
#: docs/performance.md latency targets (us) by size, for 4 ranks.
TARGET_US = {
    1 * KIB: 7.0,
    4 * KIB: 8.0,
    8 * KIB: 8.0,
    16 * KIB: 8.0,
    64 * KIB: 10.0,
    128 * KIB: 10.0,
    256 * KIB: 10.0,
    1 * MIB: 15.0,
    16 * MIB: 80.0,
}
#: From this size on the target is NCCL's bus bandwidth (same run, same mode).
BW_TARGET_FROM = 64 * MIB
#: NCCL 2.28 on the reference machine (docs/performance.md, measured 2026-11-21): us.
NCCL_REFERENCE_US = {
    1 * KIB: (32.6, 14.1),
    1 * MIB: (38.1, 22.5),
    16 * MIB: (97.0, None),
    64 * MIB: (324.0, None),
}
NCCL = "nccl"
#: The baseline where ranks share a GPU.
COPY = bench_common.COPY_BASELINE
BASELINES = (NCCL, COPY)
NCCL_LABEL = "NCCL all_reduce"
AUTO = "auto"
AUTO_REG = "auto_registered"
#: A pinned algorithm timed on the registered buffer (rsag_push: the all-gather
#: stores into the peers' registered outputs instead of loading from their scratch).
REG_SUFFIX = "+reg"
MODES = ("eager", "graph")


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def bus_gbps(nbytes: int, us: float | None, world: int) -> float | None:
    if not us:
        return None
    return 2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9


# ----------------------------------------------------------------------------
# Measurement (one rank)
# ----------------------------------------------------------------------------


#: Period of the check pattern (a prime, so no slice or block size is a multiple).
PERIOD = 8191


def _periodic(base, n: int):
    return base.repeat(n // PERIOD + 1)[:n]


def pattern(n: int, rank: int, device):
    """Small integers (-8..8), exact in bf16 and so are their sums over ranks;
    period 8191 elements (built from one period, so 1 GiB costs no int64 temporaries)."""
    import torch

    i = torch.arange(PERIOD, device=device, dtype=torch.int64)
    return _periodic(((i * 37 + rank * 11) % PERIOD % 17 - 8).to(torch.bfloat16), n)


def expected(n: int, world: int, device):
    import torch

    i = torch.arange(PERIOD, device=device, dtype=torch.int64)
    base = sum((i * 37 + r * 11) % PERIOD % 17 - 8 for r in range(world))
    return _periodic(base.to(torch.bfloat16), n)


def time_graph(fn, ops: int, replays: int, ready=None) -> list:
    """``ops`` calls of ``fn`` captured in one CUDA graph; per replay, us per call.
    ``ready()`` (a barrier) runs once before the timed replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = bench_common.capture_graph(torch, fn, ops, ready=ready)
    out = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / ops)
    del graph
    torch.cuda.synchronize()
    return out


def run_rank(rank: int, world: int, group, args, nccl: bool = True) -> dict:
    """This rank's checks and timings. ``nccl``: the group is NCCL, so NCCL's
    all_reduce is the baseline; else (ranks share a GPU) the same-GPU copy of
    the same bytes (``dst.copy_(src)`` into the registered buffer's other end,
    all ranks at once after a barrier; not checked: it is no allreduce)."""
    import moelink
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 2
    comm = moelink.AllReduce(
        group,
        max_bytes=args.max_bytes,
        tune_file=args.tune_file if args.tune_file else None,
    )
    tuned_loaded = bool(comm.tuned())
    if args.tune:
        comm.tune(min_bytes=args.min_bytes, max_bytes=args.max_bytes, verbose=rank == 0)
        tuned_loaded = True
    n_max = args.max_bytes // 2
    x = torch.empty(n_max, dtype=torch.bfloat16, device=device)
    xr = torch.empty(n_max, dtype=torch.bfloat16, device=device)
    comm.register(xr)
    algorithms = [a for a in comm.algorithms("allreduce") if a in args.algorithms]
    reg_pinned = [a + REG_SUFFIX for a in algorithms if a == "rsag_push"]
    baseline = NCCL if nccl else COPY
    names = [*algorithms, *reg_pinned, AUTO, AUTO_REG, *([baseline] if args.baseline else [])]
    checks, rows = [], []
    modes = MODES if args.graph else ("eager",)
    for nbytes in sizes:
        n = nbytes // 2
        for name in names:
            buf = xr if name in ("rsag_zc", AUTO_REG) or name.endswith(REG_SUFFIX) else x
            t = buf[:n]
            ready = None
            if name == NCCL:

                def op(t=t):
                    dist.all_reduce(t, group=group)

                choice = None
            elif name == COPY:
                # The same bytes, from x into the registered buffer (idle here).
                def op(t=t, dst=xr[:n]):
                    dst.copy_(t)

                def ready():  # every rank copies at once
                    dist.barrier(group=group)

                choice = None
            else:
                pin = None if name in (AUTO, AUTO_REG) else name.removesuffix(REG_SUFFIX)
                try:  # ValueError: the pinned algorithm cannot serve this size
                    comm.select(nbytes, registered=buf is xr, capturing=False, algorithm=pin)
                except ValueError:
                    continue

                def op(t=t, pin=pin):
                    comm.all_reduce(t, algorithm=pin)

                choice = None
            # Check first: exact sums of small integers, every rank.
            if name != COPY:
                t.copy_(pattern(n, rank, device))
                op()
                if name != NCCL:
                    choice = list(comm.last_choice)
                torch.cuda.synchronize()
                ok = bool(torch.equal(t, expected(n, world, device)))
                checks.append({"size": nbytes, "name": name, "ok": ok})
            row = {"size": nbytes, "name": name, "choice": choice}
            for mode in modes:
                t.copy_(pattern(n, rank, device))
                if mode == "eager":
                    times = bench_common.event_times_us(
                        torch, op, args.iters, args.warmup, ready=ready
                    )
                else:
                    times = time_graph(op, args.graph_ops, max(3, args.iters // 3), ready)
                    if name not in BASELINES:
                        row["graph_choice"] = list(comm.last_choice)
                row[f"{mode}_us"] = statistics.median(times)
                row[f"{mode}_p10_us"] = sorted(times)[len(times) // 10]
                row[f"{mode}_p90_us"] = sorted(times)[(len(times) * 9) // 10]
            rows.append(row)
            comm.check()
        if rank == 0 and args.verbose:
            print(f"[bench] {fmt_size(nbytes)} done", flush=True)
    comm.deregister(xr)
    comm.destroy()
    return {"rank": rank, "rows": rows, "checks": checks, "tuned": tuned_loaded}


def aggregate(per_rank: list, world: int) -> dict:
    """Median over ranks of every timing; checks must pass on every rank."""
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        out = {"size": row["size"], "name": row["name"], "choice": row["choice"]}
        if "graph_choice" in row:
            out["graph_choice"] = row["graph_choice"]
        for mode in MODES:
            key = f"{mode}_us"
            if key not in row:
                continue
            vals = [r["rows"][i][key] for r in per_rank]
            out[key] = statistics.median(vals)
            out[f"{mode}_us_per_rank"] = vals
            out[f"{mode}_busbw_gbps"] = bus_gbps(row["size"], out[key], world)
        rows.append(out)
    checks = [
        {**c, "ok": all(r["checks"][i]["ok"] for r in per_rank)}
        for i, c in enumerate(per_rank[0]["checks"])
    ]
    return {"rows": rows, "checks": checks, "correct": all(c["ok"] for c in checks)}


def summarize(results: dict, world: int, judged: bool = True) -> list:
    """One line per size: the baseline (NCCL, or the same-GPU copy), auto, the best
    pinned algorithm, target verdict (``judged`` False: ranks share a GPU, the
    targets are NVLink figures and are not judged)."""
    by = {}
    for r in results["rows"]:
        by.setdefault(r["size"], {})[r["name"]] = r
    lines = []
    for size in sorted(by):
        d = by[size]
        nccl, auto, auto_reg = d.get(NCCL, {}), d.get(AUTO, {}), d.get(AUTO_REG, {})
        base = nccl or d.get(COPY, {})
        pinned = [r for n, r in d.items() if n not in (*BASELINES, AUTO, AUTO_REG)]
        best_g = min(pinned, key=lambda r: r.get("graph_us") or 1e30, default={})
        best_e = min(pinned, key=lambda r: r.get("eager_us") or 1e30, default={})
        verdict = ""
        if not judged:
            judged_size = size in TARGET_US or size >= BW_TARGET_FROM
            verdict = "not judged (ranks share a GPU)" if judged_size else ""
        elif size in TARGET_US and auto.get("graph_us") is not None:
            target = TARGET_US[size]
            verdict = f"<= {target:g} us: {'met' if auto['graph_us'] <= target else 'MISSED'}"
        elif size >= BW_TARGET_FROM and nccl.get("eager_us") and auto.get("eager_us"):
            ok = auto["eager_us"] <= nccl["eager_us"]
            verdict = f">= NCCL bus BW: {'met' if ok else 'MISSED'}"
            if auto_reg.get("eager_us"):
                ok = auto_reg["eager_us"] <= nccl["eager_us"]
                verdict += f" (registered: {'met' if ok else 'MISSED'})"
        lines.append(
            {
                "size": size,
                "baseline": base.get("name"),
                "baseline_eager_us": base.get("eager_us"),
                "baseline_graph_us": base.get("graph_us"),
                "auto_eager_us": auto.get("eager_us"),
                "auto_graph_us": auto.get("graph_us"),
                "auto_algorithm": (auto.get("choice") or [None])[0],
                "auto_registered_eager_us": auto_reg.get("eager_us"),
                "auto_registered_graph_us": auto_reg.get("graph_us"),
                "best_eager": (best_e.get("name"), best_e.get("eager_us")),
                "best_graph": (best_g.get("name"), best_g.get("graph_us")),
                "auto_busbw_gbps": bus_gbps(size, auto.get("eager_us"), world),
                "baseline_busbw_gbps": bus_gbps(size, base.get("eager_us"), world),
                "target": verdict,
            }
        )
    return lines


def format_table(summary: list, note: str | None = None) -> str:
    """The summary as a table; ``note`` (ranks share a GPU) heads it once. The
    baseline column is NCCL, or the same-GPU copy where the rows say so."""

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    copy = any(s.get("baseline") == COPY for s in summary)
    short = "copy" if copy else "NCCL"
    head = (
        f"{'size':>9} | {short + ' eager':>10} {'graph':>7} | {'moelink eager':>13} {'graph':>7} "
        f"{'(auto)':<11}| {'registered':>10} {'graph':>7} | {'best graph':<22}| "
        f"{'busBW GB/s':>16} | target"
    )
    out = ([note] if note else []) + [head, "-" * len(head)]
    for s in summary:
        bg = s["best_graph"]
        best = f"{bg[0]} {f(bg[1])}" if bg[0] else "-"
        bw = f"{f(s['auto_busbw_gbps'], '.0f')}/{f(s['baseline_busbw_gbps'], '.0f')}"
        base_e, base_g = f(s["baseline_eager_us"]), f(s["baseline_graph_us"])
        out.append(
            f"{fmt_size(s['size']):>9} | {base_e:>10} {base_g:>7} | "
            f"{f(s['auto_eager_us']):>13} {f(s['auto_graph_us']):>7} "
            f"{(s['auto_algorithm'] or '-'):<11}| {f(s.get('auto_registered_eager_us')):>10} "
            f"{f(s.get('auto_registered_graph_us')):>7} | {best:<22}| {bw:>16} | {s['target']}"
        )
    out.append(
        "times in us (medians over ranks); registered: the selector on a registered tensor; "
        f"busBW: moelink auto (unregistered) / {short}, eager"
    )
    if copy:
        out.append(
            f"copy: {bench_common.COPY_LABEL} ({bench_common.COPY_HOW}); its busBW is that "
            "of an allreduce as fast as the copy"
        )
    return "\n".join(out)


def plot(data: dict, path: Path) -> None:
    """Latency and bus bandwidth against size: every algorithm (graph mode, solid;
    eager dashed for auto and the baseline: NCCL, or the same-GPU copy where
    ranks share a GPU), the targets as black markers."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = data["results"]["rows"]
    world = data["config"]["num_ranks"]
    names = []
    for r in rows:
        if r["name"] not in names:
            names.append(r["name"])
    colors = {
        "oneshot_ll": "tab:blue",
        "twoshot_ll": "tab:orange",
        "rsag": "tab:green",
        "rsag_zc": "tab:purple",
        "rsag_push": "tab:olive",
        "rsag_push" + REG_SUFFIX: "tab:cyan",
        AUTO: "black",
        AUTO_REG: "tab:brown",
        NCCL: "tab:red",
        COPY: "tab:gray",
    }
    labels = {COPY: bench_common.COPY_LABEL}
    fig = Figure(figsize=(15, 6))
    FigureCanvasAgg(fig)
    ax_lat, ax_bw = fig.subplots(1, 2)
    for name in names:
        pts = sorted((r for r in rows if r["name"] == name), key=lambda r: r["size"])
        for mode, style in (("graph", "-"), ("eager", "--")):
            key = f"{mode}_us"
            if mode == "eager" and name not in (AUTO, *BASELINES):
                continue
            xs = [r["size"] for r in pts if r.get(key)]
            ys = [r[key] for r in pts if r.get(key)]
            if not xs:
                continue
            label = f"{labels.get(name, name)} ({mode})"
            c = colors.get(name, None)
            ax_lat.plot(xs, ys, style, marker="o", markersize=3, color=c, label=label)
            ax_bw.plot(
                xs,
                [bus_gbps(x, y, world) for x, y in zip(xs, ys)],
                style,
                marker="o",
                markersize=3,
                color=c,
                label=label,
            )
    machine = data["machine"]
    note = machine.get("shared_gpu_note")
    tx = sorted(TARGET_US)
    ax_lat.plot(
        tx,
        [TARGET_US[s] for s in tx],
        "k*",
        markersize=10,
        linestyle="none",
        label="target (docs/performance.md)" + (" (NVLink, not judged)" if note else ""),
    )
    for ax in (ax_lat, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank (bf16, in place)")
        ax.grid(alpha=0.3, which="both")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("us per allreduce (median over ranks)")
    ax_bw.set_ylabel("bus bandwidth GB/s = 2(R-1)/R x bytes / time")
    ax_lat.legend(fontsize=7, ncol=2)
    ax_bw.legend(fontsize=7, ncol=2, loc="upper left")
    fig.suptitle(
        f"allreduce: {world} ranks, {machine.get('gpu', '?')}, bf16; commit "
        f"{str(data.get('git_commit'))[:12]}, {data.get('date', '?')[:10]}; checks "
        f"{'PASS' if data['correct'] else 'FAIL'}" + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="folder for allreduce.json and allreduce.png")
    p.add_argument("--replot", type=Path, help="only redraw the PNG of this allreduce.json")
    p.add_argument("--min-bytes", type=int, default=1 * KIB)
    p.add_argument("--max-bytes", type=int, default=1 * GIB)
    p.add_argument("--iters", type=int, default=30, help="timed eager ops per size")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--graph-ops", type=int, default=20, help="ops per captured graph")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="eager only")
    p.add_argument(
        "--no-baseline",
        "--no-nccl",
        dest="baseline",
        action="store_false",
        help="skip the baseline (NCCL, or the same-GPU copy where ranks share a GPU)",
    )
    p.add_argument(
        "--algorithms",
        default="oneshot_ll,twoshot_ll,rsag,rsag_zc,rsag_push",
        help="comma list of pinned algorithms to time (the selector is always timed)",
    )
    p.add_argument("--tune", action="store_true", help="run AllReduce.tune() first")
    p.add_argument("--tune-file", default=None, help="tuning file to load (default: the cache)")
    p.add_argument("--verbose", action="store_true")
    return p


def check_args(args) -> str | None:
    for name in ("min_bytes", "max_bytes"):
        v = getattr(args, name)
        if v < 2 or v & (v - 1):
            return f"--{name.replace('_', '-')} must be a power of two >= 2, got {v}"
    if args.min_bytes > args.max_bytes:
        return "--min-bytes exceeds --max-bytes"
    if args.iters < 3:
        return "--iters must be >= 3"
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    return None


def main(argv=None) -> int:
    args, code = bench_common.parse_or_replot(build_parser(), argv, plot)
    if code is not None:
        return code
    err = check_args(args)
    if err:
        print(err, file=sys.stderr)
        return 2

    import torch.distributed as dist
    from moelink.launch import NO_MULTICAST_ENV

    info = bench_common.init()
    rank, world = info.rank, info.world_size
    nccl = bench_common.uses_nccl(info)
    gathered = bench_common.gather_or_exit(
        rank, world, lambda: run_rank(rank, world, dist.group.WORLD, args, nccl)
    )
    results = aggregate(gathered, world)
    if rank == 0:
        summary = summarize(results, world, judged=not info.ranks_share_gpus)
        data = {
            **bench_common.record_header("allreduce", info, world, argv),
            "baseline": bench_common.baseline_record(info, NCCL_LABEL) if args.baseline else None,
            "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
            "config": {
                "num_ranks": world,
                "dtype": "bf16",
                "in_place": True,
                "min_bytes": args.min_bytes,
                "max_bytes": args.max_bytes,
                "iters": args.iters,
                "warmup": args.warmup,
                "graph_ops": args.graph_ops if args.graph else None,
                "algorithms": args.algorithms,
                "tuned_table": any(r["tuned"] for r in gathered),
            },
            "metric": "eager: median of per-op CUDA-event times, ops back to back; graph: "
            "median over replays of replay time / ops; bus bandwidth 2(R-1)/R x bytes / time",
            "targets": {
                "latency_us": {str(k): v for k, v in TARGET_US.items()},
                "bus_bandwidth_from_bytes": BW_TARGET_FROM,
                "nccl_reference_us_eager_graph": {str(k): v for k, v in NCCL_REFERENCE_US.items()},
            },
            **bench_common.checks_record(results),
            "results": {"rows": results["rows"]},
            "summary": summary,
            "per_rank": gathered,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "allreduce.json").write_text(json.dumps(data, indent=1) + "\n")
        plot(data, args.out / "allreduce.png")
        print(format_table(summary, data["machine"]["shared_gpu_note"]))
        if not results["correct"]:
            print(f"CHECKS FAILED: {data['checks_failed'][:10]}")
        print(f"wrote {args.out / 'allreduce.json'} and {args.out / 'allreduce.png'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if results["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
