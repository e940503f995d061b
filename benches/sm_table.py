"""Bandwidth by SM count, one table: moelink next to DeepEP V1, UCCL-EP, NCCL and the
NVLink ceiling, from one run of ``peer_bench.py --only intranode --sms ...`` per
library on one host.

    python benches/sm_table.py DIR --out PREFIX

DIR holds one folder per row, each with the ``peer_<impl>.json`` of one run:

- ``fused``:  moelink's default intranode kernels;
- ``direct``: moelink with ``MOELINK_INTRANODE_RECV=direct`` (the receive pool);
- ``deepep``: DeepEP V1; ``uccl``: UCCL-EP (either may be missing);

and optionally ``probe.log``: the output of the NVLink ceiling probe (every GPU streams
to each of its peers at once; rows ``plain ...``, ``tma ...``, ``copy engines``; the
figure is out-GB/s per GPU over NVLink by block count).

Byte formulas (every library's figures are measured by the same code):

- dispatch bf16, combine: bytes received per rank, ``recv_x.numel() * 2``, over the
  median time (CUDA events, L2 flushed), median over ranks (DeepEP's metric: a rank's
  own rows count);
- dispatch fp8: the same rows times ``(1 + 4/128) / 2`` (fp8 bytes and scales);
- NCCL ``all_to_all_single`` of the same rows (no SM count);
- the probe: bytes each GPU writes into its peers over NVLink per second; its row
  "in DeepEP's metric" multiplies by ``R / (R - 1)`` (with the benchmark's uniform
  routing, a rank's own rows are 1/R of what it receives and cross no link).

Prints the table (markdown) and, per library and op, the smallest SM count that reaches
95 % of that row's best; writes ``PREFIX.json`` and ``PREFIX.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROWS = (
    ("fused", "moelink (fused, default)"),
    ("direct", "moelink (direct)"),
    ("deepep", "DeepEP V1"),
    ("uccl", "UCCL-EP"),
)
OPS = (
    ("dispatch_bf16", "dispatch bf16 (cached)"),
    ("dispatch_fp8", "dispatch fp8 (cached)"),
    ("combine_bf16", "combine bf16"),
    ("dispatch_bf16_uncached", "dispatch bf16 (full call)"),
    ("combine_bf16_x_copy", "combine bf16, x a copy"),
)
NCCL_OP = "all_to_all_single"
PROBE_ROW = "tma K4 x 48K"


def load_runs(root: Path, key: str) -> list[dict]:
    """The runs of row ``key``: ``root/key`` and any ``root/key-*`` (more SM
    counts of the same library, merged into one row)."""
    folders = [root / key, *sorted(root.glob(key + "-*"))]
    return [json.loads(f.read_text()) for d in folders for f in sorted(d.glob("peer_*.json"))]


def by_sms(runs: list[dict], op: str) -> dict[int, float]:
    out = {}
    for run in runs:
        for r in run.get("intranode", {}).get("rows", []):
            if r["op"] == op and r.get("GBps"):
                out[r["num_sms"]] = r["GBps"]
    return dict(sorted(out.items()))


def cells(row: dict, sms: list[int], scale: float = 1.0) -> str:
    return " | ".join(f"{row[s] * scale:.1f}" if s in row else "" for s in sms)


def nccl(run: dict) -> float | None:
    base = run.get("baseline") or {}
    for key in ("intranode", NCCL_OP):
        v = base.get(key)
        if isinstance(v, dict) and v.get("GBps"):
            return v["GBps"]
    for r in run.get("intranode", {}).get("rows", []):
        if r["op"] == NCCL_OP and r.get("GBps"):
            return r["GBps"]
    return None


def parse_probe(text: str) -> tuple[list[int], dict[str, list[float]], int]:
    """Block counts, {row name: out-GB/s per block count} and the GPU count."""
    gpus = re.search(r"^(\d+) GPUs", text, re.M)
    head = re.search(r"^blocks\s+([\d\s]+)$", text, re.M)
    if not (gpus and head):
        return [], {}, 0
    blocks = [int(b) for b in head.group(1).split()]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(plain .*?|tma .*?)\s{2,}([\d.\s]+)$", line)
        if m:
            rows[m.group(1).strip()] = [float(v) for v in m.group(2).split()]
    return blocks, rows, int(gpus.group(1))


def smallest_at(row: dict[int, float], share: float = 0.95) -> int | None:
    if not row:
        return None
    best = max(row.values())
    return min(s for s, v in row.items() if v >= share * best)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, required=True, help="PREFIX of PREFIX.json / PREFIX.png")
    a = p.parse_args()
    runs = {key: load_runs(a.dir, key) for key, _ in ROWS}
    runs = {k: v for k, v in runs.items() if v}
    if "fused" not in runs:
        print(f"no moelink run under {a.dir / 'fused'}", file=sys.stderr)
        return 1
    sms = sorted({s for rs in runs.values() for s in by_sms(rs, "dispatch_bf16")})
    world = runs["fused"][0].get("machine", {}).get("world_size") or 4
    probe_blocks, probe_rows, probe_gpus = [], {}, 0
    probe_file = a.dir / "probe.log"
    if probe_file.is_file():
        probe_blocks, probe_rows, probe_gpus = parse_probe(probe_file.read_text())
    R = probe_gpus or world
    line = dict(zip(probe_blocks, probe_rows.get(PROBE_ROW, [])))
    plain = dict(zip(probe_blocks, probe_rows.get("plain 32K items", [])))

    out = {"sms": sms, "ranks": R, "runs": {}, "tables": {}, "smallest_95": {}, "probe": {}}
    for key, rs in runs.items():
        out["runs"][key] = [
            {
                "impl": run.get("impl"),
                "date": run.get("date"),
                "machine": run.get("machine"),
                "git_commit": run.get("git_commit"),
                "command": run.get("command"),
                "env": run.get("env"),
                "correct": run.get("intranode", {}).get("correct"),
                "checks_run": run.get("intranode", {}).get("checks_run"),
                "nccl_all_to_all_GBps": nccl(run),
            }
            for run in rs
        ]
    out["probe"] = {
        "blocks": probe_blocks,
        "rows": probe_rows,
        "formula": "out-bytes per GPU over NVLink / time; x R/(R-1) for DeepEP's metric",
        "deepep_metric_factor": R / (R - 1) if R > 1 else None,
    }
    for op, op_label in OPS:
        table = {}
        for key, label in ROWS:
            if key in runs:
                row = by_sms(runs[key], op)
                if row:
                    table[label] = row
                    out["smallest_95"].setdefault(label, {})[op] = smallest_at(row)
        if not table:
            continue
        fused_nccl = nccl(runs["fused"][0])
        out["tables"][op] = {
            "rows": {k: {str(s): v for s, v in r.items()} for k, r in table.items()},
            "nccl_all_to_all_GBps": fused_nccl,
        }
        formula = "fp8 rows x (1 + 4/128) / 2" if "fp8" in op else "recv_x.numel() * 2"
        print(f"\n### {op_label} (GB/s: {formula} / median time)\n")
        print("| row | " + " | ".join(str(s) for s in sms) + " |")
        print("|---|" + "---|" * len(sms))
        for label, row in table.items():
            print(f"| {label} | {cells(row, sms)} |")
        if fused_nccl:
            print(
                f"| NCCL all_to_all_single (no SM count) | {fused_nccl:.1f} |"
                + " |" * (len(sms) - 1)
            )
        if line and op != "dispatch_fp8":
            f = R / (R - 1)
            print(f"| ceiling: bulk copies ({PROBE_ROW}) x {f:.3f} | {cells(line, sms, f)} |")
            print(f"| ceiling: 16-B loads + stores x {f:.3f} | {cells(plain, sms, f)} |")
    print("\n### smallest SM count reaching 95 % of the row's best\n")
    for label, ops in out["smallest_95"].items():
        print(f"- {label}: " + ", ".join(f"{op} {n}" for op, n in ops.items()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return 0
    shown = [op for op, _ in OPS[:3] if op in out["tables"]]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.5), squeeze=False)
    for ax, op in zip(axes[0], shown):
        t = out["tables"][op]
        for label, row in t["rows"].items():
            xs = sorted(int(s) for s in row)
            ax.plot(xs, [row[str(s)] for s in xs], marker="o", label=label)
        if t["nccl_all_to_all_GBps"]:
            ax.axhline(t["nccl_all_to_all_GBps"], color="gray", ls="--", label="NCCL all_to_all")
        if line and op != "dispatch_fp8":
            f = R / (R - 1)
            xs = [s for s in sorted(line) if s <= max(sms)]
            ax.plot(xs, [line[s] * f for s in xs], color="k", ls=":", label="bulk-copy ceiling")
        ax.set_title(dict(OPS)[op])
        ax.set_xlabel("SMs")
        ax.set_ylabel("GB/s (DeepEP's metric)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
