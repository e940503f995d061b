"""Intranode dispatch/combine benchmark (docs/performance.md, "Intranode high-throughput").

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/intranode_bench.py --out DIR [--sms 8 16 24 ...] [--iters 30]
    python -m moelink.launch -n 4 benches/intranode_bench.py --out DIR   # any GPU count

Every rank runs ``moelink.intranode_demo.run_rank``: the outputs of layout,
dispatch (bf16, fp8) and combine are checked against the CPU reference at every
SM count, then timed (CUDA events, L2 flushed, median of --iters), next to a
baseline in the same run: ``torch.distributed.all_to_all_single`` (NCCL) moving
the same rows where every rank has its own GPU; where ranks share a GPU (NCCL
refuses that) the same-GPU copy: ``dst.copy_(src)`` of the bytes each rank
receives, all ranks at once, timed the same way (one GPU's HBM ceiling; SM
counts above a rank's share of the GPU are left out, the targets are not judged).
Rank 0 writes DIR/intranode.json (machine with ranks per GPU, backend and MPS
state, commit, command, config, baseline, results per rank and aggregated:
medians over ranks), DIR/intranode.png (GB/s against SMs per op, with the
targets, DeepEP's figure and the baseline) and prints the summary table. The
exit code is 1 when any check failed on any rank.

    python benches/intranode_bench.py --replot DIR/intranode.json

redraws the PNG next to an existing JSON (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import bench_common
from moelink import intranode_demo as demo

#: SM counts the benchmark sweeps by default (132 = every SM of an H100/H200).
BENCH_SMS = (8, 16, 24, 32, 48, 64, 96, 132)
#: The baseline row where ranks share a GPU.
COPY = bench_common.COPY_BASELINE
NCCL_LABEL = "NCCL all_to_all_single"
PLOTTED = [
    (demo.DISPATCH_BF16, "tab:blue"),
    (demo.DISPATCH_FP8, "tab:orange"),
    (demo.COMBINE_BF16, "tab:green"),
]


def plot(data: dict, path: Path) -> None:
    """GB/s against SMs, one panel per op: median over ranks (band: min..max over
    ranks), the targets (dashed up to 48 SMs, star at 24), DeepEP V1 at 24 SMs
    and the baseline (dotted: NCCL all_to_all_single, or the same-GPU copy where
    ranks share a GPU)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows: list[dict[str, Any]] = data["results"]["rows"]
    baseline = data.get("baseline")
    layout = next((r for r in rows if r["op"] == demo.LAYOUT), None)
    fig = Figure(figsize=(16, 5.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PLOTTED), sharey=True)
    top = 0.0
    for ax, (op, color) in zip(axes, PLOTTED):
        series = [(op, color, "moelink (cached dispatch)" if "dispatch" in op else "moelink")]
        if op == demo.DISPATCH_BF16:
            series.append((demo.DISPATCH_BF16_UNCACHED, "tab:purple", "moelink, uncached"))
        if op == demo.COMBINE_BF16:
            series.append((demo.COMBINE_BF16_X_COPY, "tab:olive", "moelink, x a copy"))
        for name, c, label in series:
            pts = sorted((r for r in rows if r["op"] == name), key=lambda r: r["num_sms"])
            if not pts:
                continue
            xs = [r["num_sms"] for r in pts]
            ys = [r["GBps"] for r in pts]
            lo = [min(r.get("GBps_per_rank") or [r["GBps"]]) for r in pts]
            hi = [max(r.get("GBps_per_rank") or [r["GBps"]]) for r in pts]
            ax.plot(xs, ys, marker="o", color=c, label=label)
            ax.fill_between(xs, lo, hi, color=c, alpha=0.2)
            top = max(top, *hi)
            if name == op:
                for x, y in zip(xs, ys):
                    ax.annotate(
                        f"{y:.0f}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(0, 6),
                        ha="center",
                        fontsize=8,
                        color=c,
                    )
            ax.set_xticks(xs)
        target = demo.TARGETS[op]
        ax.hlines(
            target.best_gbps,
            0,
            demo.TARGET_MAX_SMS,
            colors="black",
            linestyles="dashed",
            label=f"target >= {target.best_gbps:g} (<= {demo.TARGET_MAX_SMS} SMs)",
        )
        # The points at COMPARE_SMS: the target there, and DeepEP V1's figure.
        at, deepep = target.at_compare_sms_gbps, target.deepep_gbps
        sms = f"{demo.COMPARE_SMS} SMs"
        for y, marker, size, c, label in (
            (at, "*", 12, "black", f"target >= {at:g} at {sms}"),
            (deepep, "x", 9, "tab:red", f"DeepEP V1, {sms}: {deepep:g}"),
        ):
            ax.plot(
                [demo.COMPARE_SMS],
                [y],
                marker=marker,
                markersize=size,
                color=c,
                linestyle="none",
                label=label,
            )
        if baseline:
            ax.axhline(
                baseline["GBps"],
                color="gray",
                linestyle="dotted",
                label=f"{baseline.get('label', NCCL_LABEL)}: {baseline['GBps']:.0f}",
            )
        top = max(top, target.best_gbps, baseline["GBps"] if baseline else 0.0)
        ax.set_title(demo.OP_LABELS[op])
        ax.set_xlabel("SMs (num_sms)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("GB/s received per rank / time (median over ranks; band: min..max)")
    axes[0].set_ylim(0, top * 1.15)
    w = data["config"]
    machine = data["machine"]
    layout_text = f"layout {layout['median_us']:.1f} us (target <= 20)" if layout else ""
    note = machine.get("shared_gpu_note")
    fig.suptitle(
        f"intranode dispatch/combine: {w['num_ranks']} ranks, {machine.get('gpu', '?')}, "
        f"{w['num_tokens']} tokens/rank, hidden {w['hidden']}, top-{w['num_topk']} of "
        f"{w['num_experts']}; {layout_text}; commit {str(data.get('git_commit'))[:12]}, "
        f"{data.get('date', '?')[:10]}; checks {'PASS' if data['correct'] else 'FAIL'}"
        + (f"\n{note}; targets are NVLink figures, not judged" if note else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def copy_row(torch, dist, result: dict, args) -> dict:
    """The same-GPU copy baseline of one rank (collective: every rank copies at
    once): the bytes this rank receives in a bf16 dispatch, timed as
    ``run_rank`` times the ops (CUDA events, L2 flushed, --warmup, --iters)."""
    nbytes = result["recv_tokens"][result["rank"]] * result["workload"]["hidden"] * 2
    device = torch.device("cuda", torch.cuda.current_device())
    scratch = torch.empty(demo.L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    copy = bench_common.copy_call(torch, nbytes, device)
    times = bench_common.event_times_us(
        torch, copy, int(args.iters), int(args.warmup), before=scratch.zero_, ready=dist.barrier
    )
    return demo._row(COPY, None, times, nbytes)  # a row like run_rank's


def copy_lines(copy: dict, rows: list) -> list:
    """The lines below the table where ranks share a GPU: the copy baseline and
    each op's best GB/s as a fraction of it."""
    lines = [
        "",
        f"baseline: {bench_common.COPY_LABEL} ({bench_common.COPY_HOW}):",
        f"  {copy['median_us']:.1f} us, {copy['GBps']:.1f} GB/s per rank (median over ranks; "
        f"rank 0 copies {copy['bytes'] / 1e6:.1f} MB)",
    ]
    for op, _ in PLOTTED:
        timed = [r for r in rows if r["op"] == op]
        if timed:
            best = max(timed, key=lambda r: r["GBps"])
            lines.append(
                f"  {demo.OP_LABELS[op]}: best {best['GBps']:.1f} GB/s ({best['num_sms']} SMs) "
                f"= {best['GBps'] / copy['GBps']:.2f} x the copy"
            )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    demo.add_arguments(p, default_sms=BENCH_SMS, json_option=False)
    p.add_argument("--out", type=Path, help="folder for intranode.json and intranode.png")
    p.add_argument("--replot", type=Path, help="only redraw the PNG of this intranode.json")
    p.add_argument(
        "--stream",
        choices=("current", "side"),
        default="current",
        help="where the calls run: torch's current stream (default; the legacy default "
        "stream unless the caller set one) or a new side stream (an A/B for the internode stall)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="record a CUDA activity trace (torch.profiler) per rank into --out and "
        "print what its copies and kernels did (gpu_trace.py); use few --iters",
    )
    return p


def main(argv=None) -> int:
    args, code = bench_common.parse_or_replot(build_parser(), argv, plot)
    if code is not None:
        return code
    demo.normalize_args(args)

    import torch
    import torch.distributed as dist

    info = bench_common.init()
    rank, world = info.rank, info.world_size
    per_node = demo.ranks_per_node(world, args)
    if per_node is not None:  # emulated nodes: the Buffer takes the internode path
        if world % args.nodes != 0:
            raise SystemExit(f"--nodes {args.nodes} does not divide the {world} ranks")
        os.environ["MOELINK_RANKS_PER_NODE"] = str(per_node)

    def run() -> dict:
        result = demo.run_rank(rank, world, dist.group.WORLD, args)
        if not bench_common.uses_nccl(info):
            result["rows"].append(copy_row(torch, dist, result, args))
        return result

    def on_stream() -> dict:
        if args.stream == "current":
            return run()
        with torch.cuda.stream(torch.cuda.Stream()):
            return run()

    def measure() -> dict:
        if not args.trace:
            return on_stream()
        import gpu_trace

        return gpu_trace.run_traced(on_stream, args.out / f"trace-rank{rank}.json")

    gathered = bench_common.gather_or_exit(rank, world, measure)
    results = demo.aggregate(gathered)
    rows = results["rows"]
    baseline = next((r for r in rows if r["op"] in (demo.BASELINE, COPY)), None)
    baseline_record = bench_common.baseline_record(info, NCCL_LABEL)
    if rank == 0:
        data = {
            **bench_common.record_header("intranode dispatch/combine", info, world, argv),
            "env": {k: os.environ.get(k) for k in demo.NO_MULTICAST_ENV},
            "config": {
                **results["workload"],
                "num_ranks": world,
                "sms": args.sms,
                **results["timing"],
            },
            "metric": "bytes received per rank / median time; bf16 and combine: "
            "recv_x.numel() * 2, fp8: times (1 + 4/128) / 2"
            + (
                "; with --nodes, rdma_GBps: DeepEP's RDMA side, (token, destination node) "
                "pairs of the rank, own node included, * hidden * 2 / median time; "
                "xnode_GBps: the pairs of the other nodes only"
                if per_node is not None
                else ""
            ),
            "targets": {
                op: {
                    "best_gbps_at_most_48_sms": t.best_gbps,
                    "gbps_at_24_sms": t.at_compare_sms_gbps,
                    "deepep_v1_gbps_24_sms": t.deepep_gbps,
                    "deepep_v1_us_24_sms": t.deepep_us,
                }
                for op, t in demo.TARGETS.items()
            },
            **bench_common.checks_record(results),
            "results": {"rows": rows, "recv_tokens": results["recv_tokens"]},
            "baseline": baseline and {**baseline_record, **baseline},
            "per_rank": gathered,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "intranode.json").write_text(json.dumps(data, indent=2) + "\n")
        plot(data, args.out / "intranode.png")
        print(demo.format_report({**results, "rows": [r for r in rows if r["op"] != COPY]}))
        if baseline and baseline["op"] == COPY:
            print("\n".join(copy_lines(baseline, rows)))
        print(f"wrote {args.out / 'intranode.json'} and {args.out / 'intranode.png'}")
    dist.destroy_process_group()
    return 0 if results["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
