"""One comparison of peer_bench.py runs (moelink, DeepEP V1, UCCL-EP) and NCCL.

    python benches/peer_table.py DIR [DIR_OR_JSON ...] [--png PATH]

Reads every ``peer_<impl>.json`` in the folders given (or the files named). Where no
``peer_moelink.json`` is among them, moelink's figures come from its own benches'
``intranode.json`` / ``ll.json`` (``intranode_bench.py``, ``ll_bench.py``: the same
workloads, timing and byte formulas), found in the same folders or named. Prints:

- intranode: GB/s per op and SM count for each library and NCCL ``all_to_all_single``
  (the layout row: us), and the ratios moelink / DeepEP, moelink / UCCL, moelink /
  NCCL, DeepEP / NCCL, UCCL / NCCL (> 1: the first is faster; each library's NCCL
  figure is the one measured in its own run). ``*_tuned`` rows (peer_bench --tune)
  compare the peers' best chunk sizes with moelink's untuned op;
- low latency: us per call (CUDA graph, eager, kernel time) for dispatch, combine and
  both, NCCL ``all_to_all_single`` of the same bytes, and the speedups (peer us /
  moelink us, NCCL us / moelink us).

Writes a PNG (default ``peer_table.png`` in the first folder; needs matplotlib):
GB/s bars per op and SM count, and the low-latency CUDA-graph times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ORDER = ("moelink", "deep_ep", "uccl")
LABELS = {"moelink": "moelink", "deep_ep": "DeepEP", "uccl": "UCCL"}
NCCL_OP = "all_to_all_single"
INTRANODE_OPS = (
    "layout",
    "dispatch_bf16",
    "dispatch_fp8",
    "combine_bf16",
    "dispatch_bf16_uncached",
    "dispatch_bf16_tuned",
    "dispatch_fp8_tuned",
    "combine_bf16_tuned",
)
SHORT = {
    "dispatch_bf16": "bf16 disp",
    "dispatch_fp8": "fp8 disp",
    "combine_bf16": "combine",
    "dispatch_bf16_uncached": "bf16 full",
    "dispatch_bf16_tuned": "bf16 tuned*",
    "dispatch_fp8_tuned": "fp8 tuned*",
    "combine_bf16_tuned": "comb tuned*",
}
LL_OPS = ("dispatch", "combine", "both")
LL_KINDS = {"graph": "CUDA graph", "eager": "eager", "kernel": "kernel time"}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read {path}: {e}") from None


def collect(paths: list) -> tuple:
    """``(runs, notes)``: per impl ``{"source", "gpu", "intranode": {(op, sms): row},
    "ll": {key: us}}``, from peer_*.json files and, for moelink where it has no
    peer_moelink.json, intranode.json / ll.json."""
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(p.glob("peer_*.json"))
            files += [f for f in (p / "intranode.json", p / "ll.json") if f.is_file()]
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"no such file or folder: {p}")
    runs, notes = {}, []
    own = {}
    for f in files:
        data = _load(f)
        machine = data.get("machine") or {}
        gpu = machine.get("gpu", "?")
        if machine.get("ranks_share_gpus"):
            notes.append(f"{f}: ranks shared a GPU: not NVLink figures, not comparable")
        if f.name.startswith("peer_"):
            impl = (data.get("impl") or {}).get("name") or f.stem[len("peer_") :]
            if impl in runs:
                notes.append(f"{impl}: {f} replaces {runs[impl]['source']}")
            run = {"source": str(f), "gpu": gpu, "intranode": {}, "ll": {}}
            for r in (data.get("intranode") or {}).get("rows", []):
                run["intranode"][(r["op"], r["num_sms"])] = r
            run["ll"] = dict((data.get("ll") or {}).get("main", {}))
            for part in ("intranode", "ll"):
                sec = data.get(part) or {}
                if sec and not sec.get("correct", True):
                    notes.append(f"{impl}: {part} checks FAILED in {f}")
                if sec.get("timing_skipped"):
                    notes.append(f"{impl}: {part} not timed ({sec['timing_skipped']})")
            runs[impl] = run
        elif f.name == "intranode.json":
            rows = {(r["op"], r["num_sms"]): r for r in data["results"]["rows"]}
            own.setdefault("intranode", (f, gpu, rows))
        elif f.name == "ll.json":
            main = data["transports"]["nvlink"]["main"]
            ll = {k: v for k, v in main.items() if isinstance(v, (int, float))}
            for op in LL_OPS:  # ll_bench's plain keys are the profiler's kernel times
                if op in ll:
                    ll[f"kernel_{op}"] = ll.pop(op)
            own.setdefault("ll", (f, gpu, ll))
    if "moelink" not in runs and own:
        run = {"source": "", "gpu": None, "intranode": {}, "ll": {}}
        for part, (f, gpu, values) in own.items():
            run[part] = values
            run["gpu"] = run["gpu"] or gpu
            run["source"] += f"{f} "
        runs["moelink"] = run
        notes.append(f"moelink: from its own benches ({run['source'].strip()})")
    gpus = {r["gpu"] for r in runs.values() if r["gpu"]}
    if len(gpus) > 1:
        notes.append(f"runs come from different GPUs: {sorted(gpus)}: ratios are not comparable")
    return runs, notes


def _fmt(v, spec=".1f", width=9) -> str:
    return f"{v:>{width}{spec}}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def intranode_table(runs: dict) -> tuple:
    """(lines, plot points) of the intranode comparison."""
    impls = [i for i in ORDER if i in runs]
    keys = set()
    for r in runs.values():
        keys |= {k for k in r["intranode"] if k[0] in INTRANODE_OPS}
    if not keys:
        return [], []
    nccl = {i: (runs[i]["intranode"].get((NCCL_OP, None)) or {}).get("GBps") for i in impls}
    nccl_ref = next((nccl[i] for i in impls if nccl[i]), None)
    head = f"{'op':<26}{'SMs':>4}" + "".join(f"{LABELS[i]:>9}" for i in impls) + f"{'NCCL':>9}"
    ratios = [("moelink", p) for p in impls if p != "moelink"] + [(i, "nccl") for i in impls]
    head += "".join(f"{LABELS.get(a, a) + '/' + LABELS.get(b, 'NCCL'):>15}" for a, b in ratios)
    lines = [
        "intranode: GB/s (bytes received per rank / median time, median over ranks); "
        "layout: us; ratios > 1: the first is faster",
        head,
    ]
    points = []
    order = {op: n for n, op in enumerate(INTRANODE_OPS)}
    for op, sms in sorted(keys, key=lambda k: (order[k[0]], k[1] or 0)):
        base = op.removesuffix("_tuned")
        vals, is_time = {}, op == "layout"
        for i in impls:
            key = (base, sms) if i == "moelink" else (op, sms)
            row = runs[i]["intranode"].get(key)
            if row is not None:
                vals[i] = row["median_us"] if is_time else row["GBps"]
        cells = "".join(_fmt(vals.get(i)) for i in impls)
        cells += _fmt(None if is_time else nccl_ref)
        for a, b in ratios:
            if b == "nccl":
                r = None if is_time else _ratio(vals.get(a), nccl.get(a))
            elif is_time:
                r = _ratio(vals.get(b), vals.get(a))
            else:
                r = _ratio(vals.get(a), vals.get(b))
            cells += _fmt(r, ".2f", 15)
        label = op + ("*" if op.endswith("_tuned") else "")
        lines.append(f"{label:<26}{'-' if sms is None else sms:>4}" + cells)
        if not is_time:
            points.append((f"{SHORT[op]}\n{sms} SMs", vals))
    if len(runs) > 1:  # plot what at least two libraries measured
        points = [p for p in points if sum(v is not None for v in p[1].values()) > 1] or points
    if nccl_ref:
        lines.append(f"NCCL: {nccl_ref:.1f} GB/s all_to_all_single of the same rows")
    if any(op.endswith("_tuned") for op, _ in keys):
        lines.append("*: the peers' best NVLink chunk size (--tune) against moelink's untuned op")
    return lines, points


def ll_table(runs: dict) -> tuple:
    """(lines, plot points) of the low-latency comparison."""
    impls = [i for i in ORDER if i in runs and runs[i]["ll"]]
    if not impls:
        return [], []
    ref = runs[impls[0]]["ll"]
    head = f"{'us':<24}" + "".join(f"{LABELS[i]:>9}" for i in impls) + f"{'NCCL':>9}"
    peers = [p for p in impls if p != "moelink"]
    has_moelink = "moelink" in impls
    if has_moelink:
        head += "".join(f"{LABELS[p] + '/moelink':>16}" for p in peers) + f"{'NCCL/moelink':>14}"
    lines = [
        "low latency: us per call, max over ranks of per-rank medians; "
        "X/moelink: X us / moelink us (> 1: moelink faster)",
        head,
    ]
    points = []
    for kind, what in LL_KINDS.items():
        for op in LL_OPS:
            key = f"{kind}_{op}"
            vals = {i: runs[i]["ll"].get(key) for i in impls}
            a2a = runs["moelink"]["ll"].get(f"a2a_{op}") if has_moelink else ref.get(f"a2a_{op}")
            cells = "".join(_fmt(vals[i]) for i in impls) + _fmt(a2a)
            if has_moelink:
                m = vals["moelink"]
                cells += "".join(_fmt(_ratio(vals[p], m), ".2f", 16) for p in peers)
                cells += _fmt(_ratio(a2a, m), ".2f", 14)
            lines.append(f"{what + ' ' + op:<24}" + cells)
            if kind == "graph":
                points.append((op, vals, a2a))
    return lines, points


def plot(intra_points: list, ll_points: list, runs: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in (intra_points, ll_points) if p]
    fig = Figure(figsize=(7 * len(panels) + 4, 5.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    impls = [i for i in ORDER if i in runs]
    colors = {"moelink": "tab:blue", "deep_ep": "tab:red", "uccl": "tab:green"}
    width = 0.8 / max(1, len(impls))
    ax_i = 0
    if intra_points:
        ax = axes[ax_i]
        ax_i += 1
        for j, impl in enumerate(impls):
            xs = [n + (j - (len(impls) - 1) / 2) * width for n in range(len(intra_points))]
            ys = [vals.get(impl) or 0 for _, vals in intra_points]
            ax.bar(xs, ys, width=width, color=colors[impl], label=LABELS[impl])
        nccl = next(
            (
                r["intranode"][(NCCL_OP, None)]["GBps"]
                for r in runs.values()
                if (NCCL_OP, None) in r["intranode"]
            ),
            None,
        )
        if nccl:
            ax.axhline(nccl, color="gray", linestyle="dotted", label=f"NCCL a2a {nccl:.0f}")
        ax.set_xticks(range(len(intra_points)), [lbl for lbl, _ in intra_points], fontsize=7)
        ax.set_ylabel("GB/s received per rank / median time")
        ax.set_title("intranode (4096 tok/rank, H=7168, top-8 of 256)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if ll_points:
        ax = axes[ax_i]
        ll_impls = [i for i in impls if runs[i]["ll"]]
        w = 0.8 / (len(ll_impls) + 1)
        for j, impl in enumerate(ll_impls):
            xs = [n + (j - len(ll_impls) / 2) * w for n in range(len(ll_points))]
            ax.bar(
                xs,
                [vals.get(impl) or 0 for _, vals, _ in ll_points],
                width=w,
                color=colors[impl],
                label=LABELS[impl],
            )
        xs = [n + len(ll_impls) / 2 * w for n in range(len(ll_points))]
        ax.bar(
            xs,
            [a2a or 0 for _, _, a2a in ll_points],
            width=w,
            color="gray",
            label="NCCL a2a, same bytes",
        )
        ax.set_xticks(range(len(ll_points)), [op for op, _, _ in ll_points])
        ax.set_ylabel("us per call in a CUDA graph (max over ranks)")
        ax.set_title("low latency (128 tok/rank, H=7168, top-8 of 288)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    gpus = sorted({r["gpu"] for r in runs.values() if r["gpu"]})
    fig.suptitle(f"moelink vs peers on {', '.join(gpus) or '?'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("paths", nargs="+", help="folders with peer_*.json, or JSON files")
    p.add_argument("--png", type=Path, help="PNG to write (default: DIR/peer_table.png)")
    args = p.parse_args(argv)
    runs, notes = collect(args.paths)
    if not runs:
        print("no peer_*.json (or intranode.json / ll.json) found", file=sys.stderr)
        return 2
    intra, intra_points = intranode_table(runs)
    ll, ll_points = ll_table(runs)
    for impl in ORDER:
        if impl in runs:
            print(f"{LABELS[impl]}: {runs[impl]['source'].strip()} ({runs[impl]['gpu']})")
    for n in notes:
        print(f"note: {n}")
    print("\n".join(["", *intra, "", *ll]))
    first = Path(args.paths[0])
    png = args.png or (first if first.is_dir() else first.parent) / "peer_table.png"
    try:
        plot(intra_points, ll_points, runs, png)
    except ImportError as e:
        print(f"no PNG ({e})")
        return 0
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
