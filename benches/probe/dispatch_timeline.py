"""Where the host time of an eager full ``dispatch`` goes, one rank on one GPU:
each call's CPU span beside its kernel launches (CPU) and its kernels' runs
(GPU), from a torch.profiler trace (CUPTI puts both on one clock).

    python -m moelink.launch -n 1 benches/probe/dispatch_timeline.py [--iters 200] [--json F]

The GPU is synchronized before each call (outside the call). For every call the
probe finds its launches (driver or runtime launch API calls inside the call's
span) and the kernels they started, and reports medians in us of:

- ``call``: the call's CPU span;
- ``to first launch``: the call's start to its first launch call (checks,
  outputs made before the send, stream order);
- ``launch N -> start``: launch N's API call to its kernel's start on the GPU;
- ``kernel N``: kernel N's run on the GPU (name in the JSON);
- ``kernel 0 end -> launch N``: the first kernel's end (a full dispatch's
  notify: the counts are in) to launch N's API call (for the launch after the
  host's wait: the wait noticing the counts, and the received outputs made);
- ``last launch -> return``: the last launch call to the call's return.

A cached dispatch is sampled the same way for comparison.
"""

from __future__ import annotations

import json
import statistics

from host_sampling import normal_setup, probe_args

LAUNCH_APIS = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")


def spans(trace: list, tag: str) -> list:
    """The (start, end) us of every CPU annotation named ``tag``."""
    mine = [e for e in trace if e.get("name") == tag and e.get("cat") == "user_annotation"]
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in mine)


def timeline(trace: list, tag: str) -> list:
    """Per annotated call: its span, its launch calls (ts, correlation) and the
    kernels they started (name, start, end), in launch order."""
    launches = sorted(
        (e["ts"], e["args"].get("correlation"))
        for e in trace
        if e.get("ph") == "X" and e.get("name") in LAUNCH_APIS and "args" in e
    )
    kernels = {
        e["args"].get("correlation"): (e["name"], e["ts"], e["ts"] + e["dur"])
        for e in trace
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "args" in e
    }
    calls = []
    for start, end in spans(trace, tag):
        mine = [(ts, corr) for ts, corr in launches if start <= ts <= end]
        calls.append(
            {"span": (start, end), "launches": [(ts, kernels.get(corr)) for ts, corr in mine]}
        )
    return calls


def summarize(calls: list) -> dict:
    """Medians of the parts (see the module's doc) over ``calls`` that have all
    their kernels."""
    rows: dict = {}

    def add(name, v):
        rows.setdefault(name, []).append(v)

    names = None
    for c in calls:
        (start, end), launches = c["span"], c["launches"]
        if not launches or any(k is None for _, k in launches):
            continue
        names = [k[0] for _, k in launches]
        add("call", end - start)
        add("to first launch", launches[0][0] - start)
        for i, (ts, (_name, ks, ke)) in enumerate(launches):
            add(f"launch {i} -> start", ks - ts)
            add(f"kernel {i}", ke - ks)
        for i, (ts, _) in enumerate(launches[1:], start=1):
            add(f"kernel 0 end -> launch {i}", ts - launches[0][1][2])
        add("last launch -> return", end - launches[-1][0])
    med = {name: statistics.median(v) for name, v in rows.items()}
    return {"median_us": med, "kernels": names, "n": len(rows.get("call", []))}


def main(argv=None) -> int:
    args = probe_args(__doc__, 200, argv)

    from torch.profiler import ProfilerActivity, profile, record_function

    s = normal_setup(5)
    torch, rank, buf, full = s.torch, s.rank, s.buf, s.dispatch
    handle = full()[4]

    def cached():
        return buf.dispatch(s.x, handle=handle)

    for _ in range(5):
        full()
        cached()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            torch.cuda.synchronize()
            with record_function("probe.full"):
                full()
            torch.cuda.synchronize()
            with record_function("probe.cached"):
                cached()
        torch.cuda.synchronize()
    path = f"/tmp/dispatch_timeline_{rank}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    trace = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = {tag: summarize(timeline(trace, f"probe.{tag}")) for tag in ("full", "cached")}
    if rank == 0:
        for tag, s in out.items():
            print(f"{tag} dispatch ({s['n']} calls; kernels {s['kernels']}):")
            for name, v in s["median_us"].items():
                print(f"  {name:34s} {v:8.2f} us")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    buf.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
