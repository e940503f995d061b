"""Plot the JSON written by comm_bench (benches/comm_bench.rs).

    python3 benches/plot_comm.py results.json out.png

Left panel: signal + wait and FIFO round trips (median bars, min..max whiskers,
target per bar). Right panel: put bandwidth vs message size for the memory and
port channel (median, min..max band), with the 360 GB/s target and the ~386 GB/s
measured pair-copy ceiling. Renders headless (Agg); needs only matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TARGET_GBPS = 360.0
CEILING_GBPS = 386.0

LATENCIES = [
    ("memchan_signal_wait_rtt_us", "memory channel\nsignal + wait RTT"),
    ("portchan_signal_wait_rtt_us", "port channel\nsignal + wait RTT"),
    ("fifo_push_pop_rtt_us", "FIFO push -> pop\nround trip"),
    # breakdown (grey: no target)
    ("memchan_relaxed_floor_rtt_us", "memory channel\nrelaxed floor"),
    ("fifo_proxy_service_us", "proxy service\nper trigger"),
    ("stream_write_value_us", "cuStreamWrite-\nValue64"),
]
BANDWIDTHS = [
    ("memchan_put_GBps", "memory channel put (SM stores)", "tab:blue"),
    ("portchan_put_GBps", "port channel put + flush (proxy, copy engine)", "tab:orange"),
]


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def by_metric(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in results if r.get("metric") == name]


def plot_latencies(ax: Any, results: list[dict[str, Any]]) -> None:
    rows = [(label, by_metric(results, name)) for name, label in LATENCIES]
    rows = [(label, found[0]) for label, found in rows if found]
    if not rows:
        ax.text(0.5, 0.5, "no latency results", ha="center", va="center")
        return
    xs = list(range(len(rows)))
    medians = [r["median"] for _, r in rows]
    lower = [r["median"] - r["min"] for _, r in rows]
    upper = [r["max"] - r["median"] for _, r in rows]
    colors = []
    for _, r in rows:
        passed = r.get("pass")
        colors.append("tab:gray" if passed is None else ("tab:green" if passed else "tab:red"))
    ax.bar(xs, medians, width=0.6, color=colors, alpha=0.75, yerr=[lower, upper], capsize=6)
    for x, (_, r) in zip(xs, rows):
        ax.annotate(
            f"{r['median']:.2f}",
            (x, r["max"]),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=9,
        )
        target = r.get("target")
        if target is not None:
            ax.hlines(target, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
            ax.annotate(
                f"target {target:g}",
                (x + 0.4, target),
                textcoords="offset points",
                xytext=(2, -10),
                ha="right",
                fontsize=8,
            )
    ax.set_xticks(xs)
    ax.set_xticklabels([label for label, _ in rows], fontsize=8)
    ax.set_ylabel("microseconds (median; whiskers: min..max)")
    ax.set_title("Round trips (green: meets target, red: misses; grey: breakdown)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)


def plot_bandwidth(ax: Any, results: list[dict[str, Any]]) -> None:
    sizes: set[int] = set()
    for name, label, color in BANDWIDTHS:
        rows = sorted(by_metric(results, name), key=lambda r: r["bytes"])
        if not rows:
            continue
        xs = [r["bytes"] for r in rows]
        sizes.update(xs)
        ax.plot(xs, [r["median"] for r in rows], marker="o", color=color, label=label)
        ax.fill_between(
            xs, [r["min"] for r in rows], [r["max"] for r in rows], color=color, alpha=0.2
        )
        for r in rows:
            if r.get("target") is not None:
                ax.annotate(
                    f"{r['median']:.0f}",
                    (r["bytes"], r["median"]),
                    textcoords="offset points",
                    xytext=(-6, -14 if color == "tab:orange" else 6),
                    ha="right",
                    fontsize=8,
                    color=color,
                )
    ax.axhline(
        TARGET_GBPS,
        color="black",
        linestyle="dashed",
        linewidth=1,
        label=f"target {TARGET_GBPS:g} GB/s (at 128 MiB)",
    )
    ax.axhline(
        CEILING_GBPS,
        color="gray",
        linestyle="dotted",
        linewidth=1,
        label=f"pair-copy ceiling ~{CEILING_GBPS:g} GB/s",
    )
    ax.set_xscale("log", base=2)
    if sizes:
        ticks = sorted(sizes)
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(s) for s in ticks], rotation=45, ha="right", fontsize=8)
        ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s (1e9 bytes/s; median, band: min..max)")
    ax.set_title("Put bandwidth, rank 0 -> rank 1")
    ax.set_ylim(bottom=0, top=max(CEILING_GBPS * 1.15, ax.get_ylim()[1]))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: python3 {argv[0]} results.json out.png", file=sys.stderr)
        return 2
    data = json.loads(Path(argv[1]).read_text())
    results = data.get("results", [])
    machine = data.get("machine", {})

    fig = Figure(figsize=(14, 5.5))
    FigureCanvasAgg(fig)
    ax_lat, ax_bw = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    plot_latencies(ax_lat, results)
    plot_bandwidth(ax_bw, results)
    commit = str(data.get("git_commit", "unknown"))[:12]
    fig.suptitle(
        f"comm_bench: {machine.get('gpu', '?')}, {data.get('world_size', '?')} ranks, "
        f"commit {commit}, {data.get('date', '?')}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
