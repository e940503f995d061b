"""Helpers the benchmark scripts share: what was measured (commit, machine, how
the ranks sit on GPUs), the baseline where ranks share a GPU, and the timing of
CUDA events and CUDA-graph replays. The scripts run as ``python benches/<name>.py``
under ``python -m moelink.launch -n N`` (N may exceed the GPUs: ranks then share
them) or torchrun, and import this module by its bare name."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import traceback
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


#: The baseline where ranks share a GPU (NCCL refuses two ranks on one GPU), as
#: the JSON, the tables and the plots name it.
COPY_BASELINE = "same_gpu_copy"
COPY_LABEL = "same-GPU copy, not NCCL"
COPY_HOW = (
    "dst.copy_(src) of the same bytes on every rank, all ranks at once, timed the same "
    "way: the HBM ceiling of one GPU"
)


def init(timeout_s: float = 900.0):
    """``moelink.launch.init_distributed``: this rank's device (``local_rank %
    device_count``) and the process group (NCCL where every rank has its own GPU,
    gloo where ranks share one). Returns its ``DistInfo``."""
    from moelink.launch import init_distributed

    return init_distributed(timeout_s=timeout_s)


def uses_nccl(info) -> bool:
    """Whether the group is NCCL, so that NCCL collectives on CUDA tensors (the
    baselines) can run; else the baseline is the same-GPU copy."""
    return info.backend == "nccl"


def baseline_record(info, nccl_label: str) -> dict:
    """The baseline of this run, for the JSON: ``kind`` (``nccl`` or
    ``same_gpu_copy``), ``label`` (what tables and plots call it) and ``how``."""
    if uses_nccl(info):
        return {"kind": "nccl", "label": nccl_label, "how": f"{nccl_label} in the same run"}
    return {"kind": COPY_BASELINE, "label": COPY_LABEL, "how": COPY_HOW}


def mps_state() -> dict:
    """How this rank runs on its GPU: under MPS as ``moelink.launch`` says
    (``MOELINK_LAUNCH_MPS``; None where another launcher started it), its MPS
    thread percentage and whether an MPS pipe directory is set."""
    launch = os.environ.get("MOELINK_LAUNCH_MPS")
    return {
        "launch_mps": None if launch is None else launch == "1",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "CUDA_MPS_PIPE_DIRECTORY_set": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
    }


def shared_gpu_note(info) -> str | None:
    """Where ranks share a GPU, the line every table of the run prints once (how
    the ranks sit, and that bandwidths measure one GPU's memory, not NVLink);
    else None. The same words as the main job (``moelink.intranode_demo``)."""
    if not info.ranks_share_gpus:
        return None
    import torch
    from moelink.intranode_demo import shared_gpu_note as note

    gpus = min(info.local_world_size, torch.cuda.device_count())
    return note(info.world_size, gpus, os.environ.get("MOELINK_LAUNCH_MPS") == "1")


def machine_info(info=None) -> dict:
    """The machine and, with ``info`` (from :func:`init`), how the ranks sit on it:
    ``world_size``, ``ranks_per_gpu``, ``ranks_share_gpus``, ``backend``, the MPS
    state (:func:`mps_state`) and ``shared_gpu_note``."""
    import moelink
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    out = {
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
    if info is not None:
        out.update(
            {
                "world_size": info.world_size,
                "ranks_per_gpu": info.ranks_per_gpu,
                "ranks_share_gpus": info.ranks_share_gpus,
                "backend": info.backend,
                "mps": mps_state(),
                "shared_gpu_note": shared_gpu_note(info),
            }
        )
    return out


def run_command(world: int, argv) -> str:
    """The command line of this run: the launcher (``moelink.launch``, which sets
    ``MOELINK_LAUNCH_GPUS``, else torchrun), the script and ``argv``."""
    if "MOELINK_LAUNCH_GPUS" in os.environ:
        launcher = f"python -m moelink.launch -n {world}"
    else:
        launcher = f"python -m torch.distributed.run --nproc-per-node={world}"
    return " ".join([launcher, sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


def copy_call(torch, nbytes: int, device):
    """A call that copies ``nbytes`` within ``device`` (``dst.copy_(src)``): the
    baseline where ranks share a GPU."""
    src = torch.ones(max(1, int(nbytes)), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def event_times_us(torch, fn, iters: int, warmup: int = 0, before=None, ready=None) -> list:
    """``warmup`` untimed calls of ``fn``, then (after ``ready()``, e.g. a barrier,
    so that every rank starts at once) ``iters`` calls back to back, each between
    two CUDA events on the current stream, ``before()`` (e.g. an L2 flush) ahead
    of each outside the events; per call, microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if ready is not None:
        ready()
    pairs = []
    for _ in range(iters):
        if before is not None:
            before()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in pairs]


def ll_calls(buf, x, idx, w, y, t: int, e: int, handle) -> dict:
    """The three low-latency calls a benchmark times, by name: ``dispatch`` of
    ``x`` / ``idx`` (``t`` tokens a rank at most, ``e`` experts), ``combine`` of
    ``y`` / ``idx`` / ``w`` along ``handle``, and ``both`` (a dispatch whose
    handle the combine takes)."""
    return {
        "dispatch": lambda: buf.low_latency_dispatch(x, idx, t, e),
        "combine": lambda: buf.low_latency_combine(y, idx, w, handle),
        "both": lambda: buf.low_latency_combine(
            y, idx, w, buf.low_latency_dispatch(x, idx, t, e)[2]
        ),
    }


def ll_round_trips(torch, buf, x, idx, w, y, t: int, e: int, iters: int) -> list:
    """``iters`` low-latency dispatch + combine pairs back to back (the arguments of
    ``ll_calls``, the combine along each dispatch's handle), three CUDA events
    around each pair's Python calls: before the dispatch, between, after the
    combine. Read them with ``ll_eager_us`` once the device has synchronised."""
    ev = []
    for _ in range(iters):
        q = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        q[0].record()
        hh = buf.low_latency_dispatch(x, idx, t, e)[2]
        q[1].record()
        buf.low_latency_combine(y, idx, w, hh)
        q[2].record()
        ev.append(q)
    return ev


def ll_eager_us(ev: list) -> dict:
    """Medians in us of ``ll_round_trips``' events: ``eager_dispatch``,
    ``eager_combine`` and ``eager_both`` (launch and Python overhead included)."""
    return {
        "eager_dispatch": statistics.median(a.elapsed_time(b) * 1e3 for a, b, _ in ev),
        "eager_combine": statistics.median(b.elapsed_time(c) * 1e3 for _, b, c in ev),
        "eager_both": statistics.median(a.elapsed_time(c) * 1e3 for a, _, c in ev),
    }


def capture_graph(torch, fn, ops: int, stream=None, ready=None):
    """``ops`` calls of ``fn`` captured in one CUDA graph (on ``stream``; default:
    torch's own capture stream), replayed once and the device synchronised; then
    ``ready()`` (a barrier) where given. Returns the graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(ops):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    if ready is not None:
        ready()
    return graph


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


def record_header(benchmark: str, info, world: int, argv) -> dict:
    """The fields a result JSON starts with: the benchmark, when (UTC, seconds),
    the machine (:func:`machine_info` with ``info``), the commit (:func:`git_commit`)
    and the command line (:func:`run_command`)."""
    git = git_commit()
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(info),
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "command": run_command(world, argv),
    }


def checks_record(results: dict) -> dict:
    """The verdict fields of a result JSON, from aggregated ``results`` (with
    ``correct`` and the ``checks`` of every rank)."""
    return {
        "correct": results["correct"],
        "checks_failed": [c for c in results["checks"] if not c["ok"]],
        "checks_run": len(results["checks"]),
    }


def gather_or_exit(rank: int, world: int, measure) -> list:
    """Every rank's ``measure()`` (this rank's checks and timings), in rank order.
    A rank whose ``measure`` raises prints why and exits at once (fail fast:
    torchrun then stops the other ranks, which would wait for this one in their
    next collective)."""
    import torch.distributed as dist

    try:
        result = measure()
    except Exception:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return gathered


def parse_or_replot(parser, argv, plot) -> tuple:
    """``(args, code)``: ``argv`` parsed by ``parser``, and the exit code where the
    run ends before measuring (:func:`replot_or_require_out`; None: measure)."""
    args = parser.parse_args(argv)
    return args, replot_or_require_out(args, plot)


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
