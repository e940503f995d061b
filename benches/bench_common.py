"""Helpers the benchmark scripts share: what was measured (commit, machine) and
the timing of CUDA-graph replays. The scripts run as ``python benches/<name>.py``
(also under torchrun) and import this module by its bare name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def git_commit() -> dict:
    """The commit under test: $MOELINK_GIT_COMMIT, else ``git rev-parse HEAD`` of
    this checkout (with a dirty flag), else unknown."""
    commit = os.environ.get("MOELINK_GIT_COMMIT")
    if commit:
        return {"commit": commit, "dirty": None}
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return {"commit": commit, "dirty": bool(status.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}


def machine_info() -> dict:
    import moelink
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "hostname": socket.gethostname(),
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "sm_count": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "moelink": moelink.__version__,
    }


def replay_times_us(torch, graph, reps: int, ops: int, stream=None) -> list:
    """``reps`` back-to-back replays of ``graph`` (``ops`` calls each) between
    events on ``stream`` (default: the current stream); per replay, us per call."""
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(stream)
        graph.replay()
        b.record(stream)
        times.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 / ops for a, b in times]


def replot_or_require_out(args, plot) -> int | None:
    """``--replot JSON``: redraw the PNG beside that JSON and return 0; no ``--out``:
    say so and return 2; else None (the caller measures)."""
    if args.replot:
        data = json.loads(args.replot.read_text())
        png = args.replot.with_suffix(".png")
        plot(data, png)
        print(f"wrote {png}")
        return 0
    if args.out is None:
        print("--out DIR is required", file=sys.stderr)
        return 2
    return None
