"""A CUDA activity trace around one bench run, and what its copies and kernels did.

``run_traced(fn, path)`` runs ``fn`` under ``torch.profiler`` (CPU and CUDA
activities: CUPTI records every kernel and copy of the process, the proxy
threads' ``cuMemcpyAsync`` included), writes the Chrome trace to ``path`` even
when ``fn`` raises, prints :func:`trace_summary` and returns ``fn``'s result.
The internode stall's question (docs/design-internode.md): whether the proxy's
copies run as copy-engine transfers or
as kernels, and when they start and end against the dispatch kernels.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

#: Chrome-trace categories of the GPU activities kineto exports.
COPY_CATS = ("gpu_memcpy", "gpu_memset")
KERNEL_CATS = ("kernel",)


def _gpu_events(trace: dict, cats: tuple[str, ...]) -> list[dict[str, Any]]:
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e
    ]


def trace_summary(trace: dict, longest: int = 5) -> list[str]:
    """Lines on a Chrome trace: per activity name (copy kinds first, then
    kernels) the count, total and longest duration; then the ``longest`` copies,
    each with its start (us after the first GPU activity), bytes, stream and the
    kernels that ran during it."""
    copies = _gpu_events(trace, COPY_CATS)
    kernels = _gpu_events(trace, KERNEL_CATS)
    if not copies and not kernels:
        return ["trace: no GPU activity recorded"]
    t0 = min(e["ts"] for e in copies + kernels)
    lines = ["trace: activity                                  count   total us     max us"]
    for group in (copies, kernels):
        by_name: dict[str, list[float]] = defaultdict(list)
        for e in group:
            by_name[e["name"]].append(float(e["dur"]))
        for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"  {name[:46]:<46} {len(durs):>6} {sum(durs):>10.1f} {max(durs):>10.1f}")
    if copies:
        lines.append(f"trace: the {min(longest, len(copies))} longest copies")
        for e in sorted(copies, key=lambda e: -float(e["dur"]))[:longest]:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            during = sorted(
                {k["name"][:40] for k in kernels if k["ts"] < end and k["ts"] + k["dur"] > start}
            )
            args = e.get("args", {})
            lines.append(
                f"  {e['name']}: {e['dur']:.1f} us from {start - t0:.1f} us, "
                f"{args.get('bytes', '?')} bytes, stream {args.get('stream', '?')}; "
                f"kernels during it: {', '.join(during) or 'none'}"
            )
    return lines


def run_traced(fn: Callable[[], Any], path: Path) -> Any:
    """``fn()`` under ``torch.profiler`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    try:
        return fn()
    finally:
        prof.stop()
        prof.export_chrome_trace(str(path))
        print(f"wrote {path}")
        print("\n".join(trace_summary(json.loads(path.read_text()))))
