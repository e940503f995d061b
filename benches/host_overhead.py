"""Host overhead per call: the CPU time from a Python call to its return, as a
ratio to a trivial torch launch (``x.add_(0)``) measured in the same run (the
table of docs/performance.md). Eager calls, one sample per call, the GPU drained between samples
(outside the timed region) so that no call waits for the launch queue.

    python -m moelink.launch -n 1 benches/host_overhead.py [--iters 300] [--out DIR]
        [--impl moelink|deep_ep]

Calls: ``x.add_(0)`` (the reference); low-latency dispatch (fp8) and combine, each
with its receive hook; ``get_dispatch_layout``; ``dispatch`` with a cached handle;
the full ``dispatch`` (the CPU waits for the counts); ``combine``;
``AllReduce.all_reduce`` of 16 KiB. Shapes: low-latency T=128, H=7168, top-8 of
``--ll-experts``; normal ``--tokens`` x 7168, top-8 of ``--experts``. The calls are
timed in ``--rounds`` interleaved rounds, the reference in each: a call's ratio is the
median of its per-round ratios, so a drift of the host's speed during the run cancels
(``time_rounds``). Writes
``host_overhead.json`` (medians, p10/p90, ratios, commit, machine) and a bar plot
of the ratios into ``--out`` on rank 0, and prints the table. ``--profile N``:
after timing, each call runs N more times under cProfile (same untimed partner
calls and syncs, not profiled) and rank 0 writes the heaviest functions per call
into ``profile.txt``. ``--breakdown``: each call timed again with every native method
call and every ``torch.empty``/``empty_strided``/``zeros`` timed inside it (the
wrappers add ~0.2 us per wrapped call), medians of the native, allocation and remaining
(Python: checks, streams, glue) parts and the count of each per call, into
``host_overhead.json`` under ``breakdown``. ``--impl deep_ep``: the same calls on the
``deep_ep`` module on the path (DeepEP itself; no allreduce row; 2 or more ranks),
ratios to its own ``x.add_(0)``, for the host cost of the two libraries side by side.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import bench_common

HIDDEN = 7168
TOPK = 8
LL_TOKENS = 128
ALLREDUCE_BYTES = 16 << 10


def summarize(samples_ns: list, reference_us: float | None) -> dict:
    """Median, p10 and p90 in us of ``samples_ns``; the median's ratio to
    ``reference_us`` where given."""
    us = sorted(s / 1e3 for s in samples_ns)
    q = statistics.quantiles(us, n=10, method="inclusive") if len(us) >= 2 else [us[0]] * 9
    out = {"median_us": statistics.median(us), "p10_us": q[0], "p90_us": q[-1], "n": len(us)}
    if reference_us:
        out["ratio"] = out["median_us"] / reference_us
    return out


def time_call(fn, iters: int, warmup: int, sync, before=None, after=None) -> list:
    """``iters`` CPU times (ns) of ``fn()``. Untimed around each: ``before()``,
    then after the sample ``after()`` and ``sync()`` (a low-latency dispatch and
    combine are timed as the pairs they are used in, one side at a time)."""
    samples = []
    for i in range(warmup + iters):
        if before is not None:
            before()
            sync()
        t0 = time.perf_counter_ns()
        fn()
        dt = time.perf_counter_ns() - t0
        if after is not None:
            after()
        sync()
        if i >= warmup:
            samples.append(dt)
    return samples


def time_rounds(calls: dict, iters: int, warmup: int, rounds: int, sync, barrier) -> dict:
    """Times every entry of ``calls`` (``name -> fn`` or ``(fn, before, after)``, the
    reference first) in ``rounds`` interleaved rounds of ``iters // rounds`` samples
    each (``warmup`` untimed calls before a call's first round, 2 before its later
    ones), so that a drift of the host's speed during the run (seen: the reference
    moving by a third between runs) falls on every call alike. Returns ``name ->
    {"samples": ns list, "ratios": per-round median / the reference's median in
    that round}``. ``barrier()`` runs before each call's samples (the calls are
    collective)."""
    per = max(1, iters // max(1, rounds))
    out = {name: {"samples": [], "ratios": []} for name in calls}
    for r in range(max(1, rounds)):
        medians = {}
        for name, call in calls.items():
            fn, before, after = call if isinstance(call, tuple) else (call, None, None)
            barrier()
            s = time_call(fn, per, warmup if r == 0 else 2, sync, before, after)
            out[name]["samples"] += s
            medians[name] = statistics.median(s)
        ref = medians[next(iter(calls))]
        for name in calls:
            out[name]["ratios"].append(medians[name] / ref)
    return out


def profile_call(fn, iters: int, sync, before=None, after=None, top: int = 25) -> str:
    """The ``top`` functions by own time over ``iters`` profiled calls of ``fn``
    (``before``/``after``/``sync`` run outside the profiler), as pstats text."""
    prof = cProfile.Profile()
    for _ in range(iters):
        if before is not None:
            before()
            sync()
        prof.enable()
        fn()
        prof.disable()
        if after is not None:
            after()
        sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


class Attribution:
    """Time spent inside native methods and tensor allocations during one sample."""

    CATEGORIES = ("native", "alloc")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ns = dict.fromkeys(self.CATEGORIES, 0)
        self.count = dict.fromkeys(self.CATEGORIES, 0)
        self.depth = 0

    def timed(self, category: str, fn):
        """``fn`` timed as ``category``; a timed call inside another (an OutputSet
        falling back to torch.empty_strided) counts once, in the outer one."""

        def wrapper(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                self.ns[category] += time.perf_counter_ns() - t0
                self.count[category] += 1

        return wrapper


class NativeProxy:
    """Stands in for a ``moelink._native`` object: its methods are timed as native."""

    def __init__(self, obj, attribution: Attribution) -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_attr", attribution)

    def __getattr__(self, name):
        v = getattr(self._obj, name)
        return self._attr.timed("native", v) if callable(v) else v


def breakdown_call(fn, iters: int, warmup: int, sync, attribution, before=None, after=None):
    """Medians (us) of the total, native, allocation and remaining time of ``fn()``
    and the median count of native calls and allocations per call."""
    rows = []
    for i in range(warmup + iters):
        if before is not None:
            before()
            sync()
        attribution.reset()
        t0 = time.perf_counter_ns()
        fn()
        total = time.perf_counter_ns() - t0
        native, alloc = attribution.ns["native"], attribution.ns["alloc"]
        counts = dict(attribution.count)
        if after is not None:
            after()
        sync()
        if i >= warmup:
            rows.append((total, native, alloc, total - native - alloc, counts))
    med = lambda k: statistics.median(r[k] for r in rows) / 1e3  # noqa: E731
    return {
        "total_us": med(0),
        "native_us": med(1),
        "alloc_us": med(2),
        "python_us": med(3),
        "native_calls": statistics.median(r[4]["native"] for r in rows),
        "allocs": statistics.median(r[4]["alloc"] for r in rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="interleaved rounds: each call's ratio is the median over rounds of its "
        "median / x.add_(0)'s median in the same round",
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ll-experts", type=int, default=288)
    p.add_argument("--out", default=None, help="folder for host_overhead.json and the plot")
    p.add_argument(
        "--profile", type=int, default=0, help="profiled calls per entry after timing (0: none)"
    )
    p.add_argument(
        "--breakdown", action="store_true", help="split each call into native/alloc/Python"
    )
    p.add_argument(
        "--impl",
        choices=("moelink", "deep_ep"),
        default="moelink",
        help="the library whose Buffer is timed: moelink, or the `deep_ep` module on the "
        "path (DeepEP itself, for its host cost beside moelink's; no allreduce row)",
    )
    p.add_argument(
        "--torch-empty",
        action="store_true",
        help="make outputs with torch.empty_strided from Python instead of natively through "
        "torch's C shim (the comparison for the native allocation)",
    )
    args = p.parse_args(argv)
    if args.impl != "moelink" and (args.breakdown or args.torch_empty):
        p.error("--breakdown and --torch-empty time moelink's own parts: --impl moelink only")

    import importlib

    import moelink
    from moelink import _buffer_common

    lib = moelink if args.impl == "moelink" else importlib.import_module("deep_ep")

    if args.torch_empty:
        _buffer_common._TORCH_ALLOC = False
    import torch
    import torch.distributed as dist

    info = bench_common.init()
    rank, size, dev = info.rank, info.world_size, info.device
    group = dist.group.WORLD
    sync = torch.cuda.synchronize
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)

    def routing(n: int, e: int) -> torch.Tensor:
        scores = torch.rand(n, e, generator=g)
        return scores.topk(TOPK, dim=1).indices.to(torch.int64).to(dev)

    calls: dict = {}
    x_ref = torch.randn(1024, device=dev)
    calls["x.add_(0)"] = lambda: x_ref.add_(0)

    # Low latency (NVLink path where the ranks are mapped).
    t, e_ll = LL_TOKENS, args.ll_experts
    ll_bytes = lib.Buffer.get_low_latency_rdma_size_hint(t, HIDDEN, size, e_ll)
    ll_buf = lib.Buffer(group, 0, ll_bytes, low_latency_mode=True, explicitly_destroy=True)
    x_ll = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
    idx_ll = routing(t, e_ll)
    w_ll = torch.rand(t, TOPK, generator=g).to(dev)
    state: dict = {}

    def ll_dispatch():
        recv, _, handle, _, hk = ll_buf.low_latency_dispatch(
            x_ll, idx_ll, t, e_ll, use_fp8=True, return_recv_hook=True
        )
        hk()
        state["handle"] = handle
        if "y" not in state:  # the expert outputs: any bf16 rows of the right shape
            state["y"] = recv[0].float().to(torch.bfloat16)

    def ll_combine():
        _, _, hk = ll_buf.low_latency_combine(
            state["y"], idx_ll, w_ll, state["handle"], return_recv_hook=True
        )
        hk()

    ll_dispatch()
    ll_combine()
    sync()
    # Each timed with its partner call run untimed, as the pair is used.
    pairs = {
        "low_latency_dispatch fp8 + hook": (ll_dispatch, None, ll_combine),
        "low_latency_combine + hook": (ll_combine, ll_dispatch, None),
    }
    calls.update(pairs)

    # Normal (intranode) path.
    n, e = args.tokens, args.experts
    if lib is moelink:
        nvl_bytes = moelink.Config(num_sms=24).get_nvl_buffer_size_hint(
            HIDDEN * 2, size, max_tokens_per_rank=n
        )
    else:  # DeepEP's hint (its buffer is a ring, not sized by tokens)
        if size < 2:
            raise SystemExit("--impl deep_ep needs 2 or more ranks (DeepEP's configs start at 2)")
        nvl_bytes = lib.Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(HIDDEN * 2, size)
    buf = lib.Buffer(group, nvl_bytes, explicitly_destroy=True)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
    idx = routing(n, e)
    w = torch.rand(n, TOPK, generator=g).to(dev)
    layout = buf.get_dispatch_layout(idx, e)
    per_rank, _, per_expert, in_rank, _ = layout

    def full_dispatch():
        return buf.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
        )

    recv_x, _, recv_w, _, handle, _ = full_dispatch()
    sync()
    calls["get_dispatch_layout"] = lambda: buf.get_dispatch_layout(idx, e)
    calls["dispatch, cached"] = lambda: buf.dispatch(x, handle=handle)
    calls["dispatch, full"] = full_dispatch
    calls["combine"] = lambda: buf.combine(recv_x, handle, topk_weights=recv_w)

    ar = moelink.AllReduce(group) if lib is moelink else None
    if ar is not None:
        t_ar = torch.randn(ALLREDUCE_BYTES // 4, device=dev)
        calls["AllReduce.all_reduce 16 KiB"] = lambda: ar.all_reduce(t_ar)

    # Every rank times the same calls in the same order (they are collective).
    timed = time_rounds(
        calls, args.iters, args.warmup, args.rounds, sync, lambda: dist.barrier(group=group)
    )
    results: dict = {}
    # (not `t`: the low-latency calls above read the token count `t` when called,
    # and the profile and breakdown below call them again)
    for name, timing in timed.items():
        results[name] = summarize(timing["samples"], None)
        results[name]["ratio"] = statistics.median(timing["ratios"])
        results[name]["ratio_range"] = [min(timing["ratios"]), max(timing["ratios"])]
    profiles: dict = {}
    if args.profile > 0:
        for name, call in calls.items():
            fn, before, after = call if isinstance(call, tuple) else (call, None, None)
            dist.barrier(group=group)
            profiles[name] = profile_call(fn, args.profile, sync, before, after)
    breakdown: dict = {}
    if args.breakdown:
        attribution = Attribution()
        natives = [(ll_buf, "_ll"), (ll_buf, "_ll_state"), (buf, "_native"), (ar, "_native")]
        saved_natives = [getattr(o, a) for o, a in natives]
        saved_torch = {k: getattr(torch, k) for k in ("empty", "empty_strided", "zeros")}
        # Native outputs are made in OutputSet.empty (its torch.empty_strided
        # fallback is timed through torch instead).
        saved_outputs = _buffer_common.OutputSet.empty
        if not args.torch_empty:
            _buffer_common.OutputSet.empty = attribution.timed("alloc", saved_outputs)
        try:
            for (o, a), v in zip(natives, saved_natives):
                setattr(o, a, NativeProxy(v, attribution))
            for k, f in saved_torch.items():
                setattr(torch, k, attribution.timed("alloc", f))
            for name, call in calls.items():
                fn, before, after = call if isinstance(call, tuple) else (call, None, None)
                dist.barrier(group=group)
                breakdown[name] = breakdown_call(
                    fn, args.iters, args.warmup, sync, attribution, before, after
                )
        finally:
            for (o, a), v in zip(natives, saved_natives):
                setattr(o, a, v)
            for k, f in saved_torch.items():
                setattr(torch, k, f)
            _buffer_common.OutputSet.empty = saved_outputs
    sync()
    ll_buf.destroy()
    buf.destroy()
    if ar is not None:
        ar.destroy()
    if rank == 0:
        rows = [f"{'call':38s} {'median us':>10s} {'p10':>8s} {'p90':>8s} {'ratio':>7s}"]
        for name, r in results.items():
            rows.append(
                f"{name:38s} {r['median_us']:10.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f} "
                f"{r['ratio']:6.1f}x"
            )
        if breakdown:
            rows.append(
                f"{'breakdown (us)':38s} {'total':>8s} {'native':>8s} {'alloc':>8s} "
                f"{'python':>8s} {'#nat':>5s} {'#alloc':>6s}"
            )
            for name, b in breakdown.items():
                rows.append(
                    f"{name:38s} {b['total_us']:8.1f} {b['native_us']:8.1f} "
                    f"{b['alloc_us']:8.1f} {b['python_us']:8.1f} {b['native_calls']:5.0f} "
                    f"{b['allocs']:6.0f}"
                )
        print("\n".join(rows), flush=True)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            doc = {
                "what": "CPU time from the Python call to its return, eager, GPU drained "
                "between samples (untimed), in interleaved rounds; ratio = median over "
                "rounds of (the call's median / x.add_(0)'s median in that round), "
                "ratio_range its spread",
                "impl": args.impl,
                "ranks": size,
                "iters": args.iters,
                "rounds": args.rounds,
                "outputs": "torch.empty_strided" if args.torch_empty else "native (C shim)",
                "shapes": {
                    "low_latency": [t, HIDDEN, e_ll, TOPK],
                    "normal": [n, HIDDEN, e, TOPK],
                    "allreduce_bytes": ALLREDUCE_BYTES,
                },
                "results": results,
                "breakdown": breakdown,
                "commit": bench_common.git_commit(),
                "command": " ".join(sys.argv),
            }
            (out / "host_overhead.json").write_text(json.dumps(doc, indent=2))
            if profiles:
                (out / "profile.txt").write_text(
                    "".join(f"==== {k} ({args.profile} calls)\n{v}\n" for k, v in profiles.items())
                )
            plot(results, out / "host_overhead.png")
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


def plot(results: dict, path: Path) -> None:
    """Bar plot of the ratios (skipped, with a line, where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("host_overhead: matplotlib missing, no plot", flush=True)
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, [results[k]["ratio"] for k in names])
    ax.invert_yaxis()
    ax.set_xlabel("CPU time per call / x.add_(0)")
    ax.set_title("moelink host overhead (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
