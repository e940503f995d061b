"""Low-latency dispatch/combine benchmark (docs/performance.md, "Low-latency dispatch / combine").

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/ll_bench.py --out DIR [--iters 200] [--no-sweep] [--no-proxy]
    python -m moelink.launch -n 4 benches/ll_bench.py --out DIR   # any GPU count

Workload: T tokens per rank (128), hidden 7168, top-8 of 288 experts, fp8 dispatch,
bf16 combine. For each transport (NVLink memory channels; the CPU proxy forced with
``allow_nvlink_for_low_latency_mode=False``) every configuration is first checked
(identity experts: ``calc_diff(combine(dequant(recv)), x * sum(w)) < 9e-4``, and
``sum(recv_count)`` equal to the messages addressed to this rank), then timed with
CUDA events, back-to-back, median over --iters:
- dispatch, combine, dispatch + combine (one call each, no hook);
- the send and receive halves in hook mode (a 50 us sleep kernel between them, so
  the receive half measures the receive, not the flight);
- the baseline, moving the same bytes (dispatch's fp8 messages, combine's bf16
  rows) in the same run: ``all_to_all_single`` (NCCL, the no-EP-library baseline,
  ``a2a_*``) where every rank has its own GPU; where ranks share a GPU (NCCL
  refuses that) the same-GPU copy (``copy_*``): ``dst.copy_(src)`` of those bytes
  on every rank, all ranks at once, timed the same way (one GPU's HBM ceiling).
The sweep repeats dispatch / combine / both for tokens 1..256 and hidden 2048..8192.
Rank 0 writes DIR/ll.json (machine with ranks per GPU, backend and MPS state,
commit, command, baseline, per-rank medians and the max over ranks) and DIR/ll.png,
and prints the summary table (max over ranks, us). Where ranks share a GPU the
times are one GPU's memory (and its time slices without MPS), not NVLink.

    python benches/ll_bench.py --replot DIR/ll.json   # redraw the PNG, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import bench_common

TARGETS = {
    "nvlink": {"dispatch": 22.0, "combine": 38.0, "both": 60.0},
    "proxy": {"dispatch": 80.0, "combine": 120.0},
}
DEEPEP = {"dispatch": 35.0, "combine": 56.0, "both": 94.0}
SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_HIDDEN = (2048, 4096, 7168, 8192)
NCCL_LABEL = "NCCL all_to_all_single"
#: Column prefix of the baseline: NCCL's all_to_all_single, or the same-GPU copy.
BASELINE_PREFIX = {"nccl": "a2a", bench_common.COPY_BASELINE: "copy"}


#: The low-latency kernels as the profiler names them (within the demangled name).
LL_KERNELS = ("moelink::ll::dispatch", "moelink::ll::combine")


def calc_diff(x, y) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if float(denom) == 0 else float(1 - 2 * (x * y).sum() / denom)


class Bench:
    def __init__(self, args, buf, rank: int, size: int, device, nccl: bool) -> None:
        import torch

        self.torch = torch
        self.args, self.buf, self.rank, self.size, self.device = args, buf, rank, size, device
        #: NCCL group: CUDA tensors go through torch.distributed; else (gloo:
        #: ranks share a GPU) CPU copies do, and the baseline is the same-GPU copy.
        self.nccl = nccl

    def inputs(self, t: int, h: int, e: int, k: int, seed: int):
        torch = self.torch
        g = torch.Generator().manual_seed(seed * 1000 + self.rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(self.device)
        idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(self.device)
        w = torch.rand(t, k, generator=g).to(self.device)
        return x, idx, w

    def dequant(self, recv, use_fp8: bool):
        torch = self.torch
        if not use_fp8:
            return recv
        rx, sc = recv
        el, rt, h = rx.shape
        return (
            (rx.float().view(el, rt, h // 128, 128) * sc.unsqueeze(-1))
            .view(el, rt, h)
            .to(torch.bfloat16)
        )

    def check(self, t: int, h: int, e: int, k: int) -> list:
        """Identity experts end to end; returns error strings (empty: good)."""
        torch = self.torch
        import torch.distributed as dist

        x, idx, w = self.inputs(t, h, e, k, seed=7)
        recv, count, handle, _, _ = self.buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
        y = self.dequant(recv, True)
        comb, _, _ = self.buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        errs = []
        d = calc_diff(comb.float(), x.float() * w.sum(1, keepdim=True))
        if not d < 9e-4:
            errs.append(f"calc_diff {d:.3g} at T={t} H={h}")
        mine = idx if self.nccl else idx.cpu()
        all_idx = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(all_idx, mine)
        el = e // self.size
        want = sum(int(((a >= self.rank * el) & (a < (self.rank + 1) * el)).sum())
                   for a in all_idx)  # fmt: skip
        if int(count.sum()) != want:
            errs.append(f"recv rows {int(count.sum())} != {want} at T={t} H={h}")
        return errs

    def time_ops(self, t: int, h: int, e: int, k: int, iters: int, hooks: bool) -> dict:
        """Medians in us. Kernel time: the duration of each ``ll_dispatch`` /
        ``ll_combine`` kernel in a torch.profiler trace (what DeepEP reports); in hook
        mode the send and receive launches alternate, with a 50 us sleep kernel
        between them. ``eager_*``: CUDA events around the Python calls (launch and
        Python overhead included)."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        buf = self.buf
        x, idx, w = self.inputs(t, h, e, k, seed=11)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e)
        y = self.dequant(recv, True).clone()
        for _ in range(self.args.warmup):
            hh = buf.low_latency_dispatch(x, idx, t, e)[2]
            buf.low_latency_combine(y, idx, w, hh)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ev = bench_common.ll_round_trips(torch, buf, x, idx, w, y, t, e, iters)
            if hooks:
                for _ in range(iters):
                    r = buf.low_latency_dispatch(x, idx, t, e, return_recv_hook=True)
                    torch.cuda._sleep(self.args.sleep_cycles)
                    r[4]()
                    c = buf.low_latency_combine(y, idx, w, r[2], return_recv_hook=True)
                    torch.cuda._sleep(self.args.sleep_cycles)
                    c[2]()
            torch.cuda.synchronize()
        # The kernels' profiler names: moelink::ll::dispatch(...) / ::combine(...).
        kern = sorted((ev_ for ev_ in prof.events() if any(k in ev_.name for k in LL_KERNELS)),
                      key=lambda ev_: ev_.time_range.start)  # fmt: skip
        kd = [ev_.time_range.elapsed_us() for ev_ in kern if LL_KERNELS[0] in ev_.name]
        kc = [ev_.time_range.elapsed_us() for ev_ in kern if LL_KERNELS[1] in ev_.name]
        res = {
            "dispatch": statistics.median(kd[:iters]),
            "combine": statistics.median(kc[:iters]),
            "both": statistics.median(a + b for a, b in zip(kd[:iters], kc[:iters])),
            **bench_common.ll_eager_us(ev),
        }
        if hooks:
            hd, hc = kd[iters:], kc[iters:]
            res["dispatch_send"] = statistics.median(hd[0::2])
            res["dispatch_recv"] = statistics.median(hd[1::2])
            res["combine_send"] = statistics.median(hc[0::2])
            res["combine_recv"] = statistics.median(hc[1::2])
        res["recv_rows"] = int(count.sum())
        return res

    def graph_times(self, t: int, h: int, e: int, k: int, reps: int = 20, n: int = 10) -> dict:
        """Per-call time with no CPU in the loop: one CUDA graph holds ``n`` calls
        (dispatch only, combine only, or dispatch + combine pairs); it is replayed
        ``reps`` times between events on every rank and the median replay / n is
        reported (``graph_*``)."""
        torch = self.torch
        buf = self.buf
        x, idx, w = self.inputs(t, h, e, k, seed=13)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        out = {}
        with torch.cuda.stream(s):
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e)
            y = self.dequant(recv, True).clone()
            buf.low_latency_combine(y, idx, w, handle)
            torch.cuda.synchronize(self.device)
            bodies = bench_common.ll_calls(buf, x, idx, w, y, t, e, handle)
            for op, body in bodies.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    for _ in range(n):
                        body()
                g.replay()
                torch.cuda.synchronize(self.device)
                times = bench_common.replay_times_us(torch, g, reps, n, s)
                out[f"graph_{op}"] = statistics.median(times)
                del g
        torch.cuda.current_stream(self.device).wait_stream(s)
        return out

    def phase_profile(self, t: int, h: int, e: int, k: int, iters: int) -> dict:
        """With MOELINK_LL_PROFILE=1: each half in hook mode, the device synchronised
        and the stamps read after every launch; per segment the median over
        iterations of (median over blocks, max over blocks), us."""
        torch = self.torch
        import torch.distributed as dist

        buf = self.buf
        ll = buf._ll_native()
        x, idx, w = self.inputs(t, h, e, k, seed=17)
        recv = buf.low_latency_dispatch(x, idx, t, e)[0]
        y = self.dequant(recv, True).clone()
        acc = {name: {} for name in PROF_SEGMENTS}

        def take(name, kernel):
            for seg, v in profile_segments(ll.profile(), kernel, PROF_SEGMENTS[name]).items():
                acc[name].setdefault(seg, []).append(v)

        for _ in range(iters):
            dist.barrier()
            r = buf.low_latency_dispatch(x, idx, t, e, return_recv_hook=True)
            take("dispatch_send", 0)
            dist.barrier()
            r[4]()
            take("dispatch_recv", 0)
            dist.barrier()
            c = buf.low_latency_combine(y, idx, w, r[2], return_recv_hook=True)
            take("combine_send", 1)
            dist.barrier()
            c[2]()
            take("combine_recv", 1)
        torch.cuda.synchronize()
        return {name: {seg: [statistics.median(a for a, _ in v), statistics.median(b for _, b in v)]
                       for seg, v in segs.items()}
                for name, segs in acc.items()}  # fmt: skip

    def baseline(self, t: int, h: int, k: int, iters: int) -> dict:
        """The same bytes as the EP calls: every rank sends its T*K messages (fp8
        row + scales + 16-byte header), split evenly; and the bf16 rows back. NCCL
        group: all_to_all_single (``a2a_*``); else ``dst.copy_(src)`` of those
        bytes on every rank, all ranks at once (``copy_*``)."""
        torch = self.torch
        import torch.distributed as dist

        prefix = BASELINE_PREFIX["nccl" if self.nccl else bench_common.COPY_BASELINE]
        out = {}
        for name, row in (("dispatch", 16 + h + h // 128 * 4), ("combine", 2 * h)):
            n = t * k * row // self.size * self.size
            if self.nccl:
                src = torch.empty(n, dtype=torch.uint8, device=self.device)
                dst = torch.empty_like(src)

                def call(dst=dst, src=src):
                    dist.all_to_all_single(dst, src)
            else:
                call = bench_common.copy_call(torch, n, self.device)
            ready = None if self.nccl else dist.barrier  # every rank copies at once
            times = bench_common.event_times_us(torch, call, iters, 5, ready=ready)
            out[f"{prefix}_{name}"] = statistics.median(times)
        return out


#: Phase segments of the kernels' stamps (ep-kernels/cuda/low_latency.cu, stamp()):
#: (kernel, name, from slot, to slot). Slot 1 = block start, 14 = block end (clock64).
PROF_SEGMENTS = {
    "dispatch_send": [
        ("count_routing", 1, 2), ("first token: token_routing", 2, 3),
        ("first token: fp8 cast", 3, 4), ("warp 0: store message", 11, 12),
        ("warp 0: fence + arrive", 12, 13), ("first token: all warps done", 4, 5),
        ("send half", 1, 6), ("block", 1, 14),
    ],
    "dispatch_recv": [
        ("wait flags", 1, 7), ("layout", 7, 8), ("copy messages out", 8, 9),
        ("finish", 9, 10), ("block", 1, 14),
    ],
    "combine_send": [
        ("layout", 1, 2), ("warp 0: load + store row", 11, 12),
        ("warp 0: fence + arrive", 12, 13), ("send half", 1, 3), ("block", 1, 14),
    ],
    "combine_recv": [
        ("wait flags + count_routing", 4, 5), ("weighted sums", 5, 6), ("finish", 6, 7),
        ("block", 1, 14),
    ],
}  # fmt: skip
PROF_BLOCKS, PROF_SLOTS = 256, 16


def profile_segments(stamps: list, kernel: int, segments: list) -> dict:
    """Per segment, (median, max) over the blocks that stamped both ends, in us;
    clock64 cycles are converted with each block's own globaltimer span. Also the
    kernel's span (first block start to last block end) and the start skew."""
    out, ratios, starts, ends = {}, [], [], []
    blocks = []
    for b in range(PROF_BLOCKS):
        o = (kernel * PROF_BLOCKS + b) * PROF_SLOTS
        v = stamps[o : o + PROF_SLOTS]
        if v[0] == 0 or v[15] < v[0] or v[14] <= v[1]:
            continue
        ratios.append((v[15] - v[0]) / (v[14] - v[1]))
        starts.append(v[0])
        ends.append(v[15])
        blocks.append(v)
    if not blocks:
        return out
    ns_per_cycle = statistics.median(ratios)
    for name, a, b in segments:
        d = [(v[b] - v[a]) * ns_per_cycle / 1e3 for v in blocks
             if v[1] <= v[a] <= v[b] <= v[14]]  # fmt: skip
        if d:
            out[name] = (statistics.median(d), max(d))
    out["kernel span"] = ((max(ends) - min(starts)) / 1e3,) * 2
    out["block start skew"] = ((max(starts) - min(starts)) / 1e3,) * 2
    out["ns_per_cycle"] = (ns_per_cycle, ns_per_cycle)
    return out


def gather_max(rank_results: list) -> dict:
    """Per key, the maximum over ranks of the per-rank medians (the slowest rank
    sets the step time)."""
    keys = rank_results[0].keys()
    return {k: max(r[k] for r in rank_results) for k in keys}


def run(args) -> int:
    import moelink
    import torch
    import torch.distributed as dist

    info = bench_common.init()
    rank, size, device = info.rank, info.world_size, info.device
    nccl = bench_common.uses_nccl(info)
    e, k = args.experts, args.topk
    t_max = max((args.tokens, *(SWEEP_TOKENS if args.sweep else ())))
    h_max = max((args.hidden, *(SWEEP_HIDDEN if args.sweep else ())))
    data = {"transports": {}}
    failed = []
    transports = ["nvlink"] + ([] if args.no_proxy else ["proxy"])
    for tr in transports:
        nbytes = moelink.Buffer.get_low_latency_rdma_size_hint(t_max, h_max, size, e)
        buf = moelink.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True,
                             allow_nvlink_for_low_latency_mode=(tr == "nvlink"),
                             explicitly_destroy=True)  # fmt: skip
        b = Bench(args, buf, rank, size, device, nccl)
        res = {}
        errs = b.check(args.tokens, args.hidden, e, k)
        main = b.time_ops(args.tokens, args.hidden, e, k, args.iters, hooks=True)
        main.update(b.baseline(args.tokens, args.hidden, k, args.iters))
        main.update(b.graph_times(args.tokens, args.hidden, e, k))
        res["main"] = main
        if os.environ.get("MOELINK_LL_PROFILE") == "1":
            res["profile"] = b.phase_profile(args.tokens, args.hidden, e, k, 20)
        sweep = []
        if args.sweep and tr == "nvlink":
            for h in SWEEP_HIDDEN:
                for t in SWEEP_TOKENS:
                    if t == args.tokens and h == args.hidden:
                        continue
                    errs += b.check(t, h, e, k)
                    r = b.time_ops(t, h, e, k, max(10, args.iters // 5), hooks=False)
                    sweep.append({"tokens": t, "hidden": h, **r})
        res["sweep"] = sweep
        # --sms: the main workload again on fewer SMs (blocks of every launch,
        # set on the native buffer; each count checked first).
        by_sms = []
        if args.sms and tr == "nvlink":
            default = buf._ll.num_blocks
            for n in args.sms:
                buf._ll.set_num_blocks(n)
                errs += [f"{n} SMs: {m}" for m in b.check(args.tokens, args.hidden, e, k)]
                r = b.time_ops(args.tokens, args.hidden, e, k, args.iters, hooks=False)
                r.update(b.graph_times(args.tokens, args.hidden, e, k))
                by_sms.append({"sms": buf._ll.num_blocks, **r})
            buf._ll.set_num_blocks(default)
        res["by_sms"] = by_sms
        allres = [None] * size
        dist.all_gather_object(allres, {"res": res, "errors": errs})
        torch.cuda.synchronize()
        buf.destroy()
        if rank == 0:
            entry = {
                "per_rank": [a["res"] for a in allres],
                "main": gather_max([a["res"]["main"] for a in allres]),
                "sweep": [
                    gather_max([a["res"]["sweep"][i] for a in allres]) for i in range(len(sweep))
                ],  # fmt: skip
                "by_sms": [
                    gather_max([a["res"]["by_sms"][i] for a in allres]) for i in range(len(by_sms))
                ],  # fmt: skip
            }
            if "profile" in res:
                entry["profile"] = {a.get("rank", q): a["res"].get("profile")
                                    for q, a in enumerate(allres)}  # fmt: skip
            data["transports"][tr] = entry
            for q, a in enumerate(allres):
                failed += [f"rank {q}: {m}" for m in a["errors"]]
    dist.barrier()
    if rank == 0:
        data.update(
            {
                "benchmark": "low_latency",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": bench_common.machine_info(info),
                "git_commit": bench_common.git_commit()["commit"],
                "command": bench_common.run_command(size, None),
                "baseline": bench_common.baseline_record(info, NCCL_LABEL),
                "workload": {
                    "tokens": args.tokens,
                    "hidden": args.hidden,
                    "experts": e,
                    "topk": k,
                    "ranks": size,
                    "dispatch": "fp8",
                    "combine": "bf16",
                    "iters": args.iters,
                },  # fmt: skip
                "targets_us": TARGETS,
                "deepep_v1_us": DEEPEP,
                "check_failures": failed,
            }
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ll.json").write_text(json.dumps(data, indent=2) + "\n")
        plot(data, args.out / "ll.png")
        summary(data)
        print_profile(data)
        for f in failed:
            print("CHECK FAILED", f)
    dist.destroy_process_group()
    return 1 if failed else 0


def print_profile(data: dict) -> None:
    for tr, entry in data["transports"].items():
        prof = entry.get("profile")
        if not prof:
            continue
        print(f"\nphase stamps, {tr} (us: median over blocks / max over blocks, median of "
              "20 hook-mode calls, each half alone with the device synchronised)")  # fmt: skip
        for half in PROF_SEGMENTS:
            print(f"  {half}")
            segs = list(next(iter(prof.values()))[half].keys())
            for seg in segs:
                cells = "".join(f"  r{r}: {p[half][seg][0]:7.2f} /{p[half][seg][1]:7.2f}"
                                for r, p in prof.items() if seg in p[half])  # fmt: skip
                print(f"    {seg:30s}{cells}")


def baseline_of(data: dict) -> tuple:
    """(column prefix, label) of the run's baseline; runs recorded before the
    same-GPU copy existed had NCCL's all_to_all_single."""
    base = data.get("baseline") or {"kind": "nccl", "label": NCCL_LABEL}
    return BASELINE_PREFIX[base["kind"]], base["label"]


def summary(data: dict) -> None:
    w = data["workload"]
    prefix, label = baseline_of(data)
    print(f"low-latency, {w['ranks']} ranks, T={w['tokens']} H={w['hidden']} "
          f"top-{w['topk']} of {w['experts']} (us, max over ranks of medians)")  # fmt: skip
    note = data["machine"].get("shared_gpu_note")
    if note:
        print(f"{note}; targets and DeepEP V1 are NVLink figures")
    cols = ["dispatch", "combine", "both", "dispatch_send", "dispatch_recv", "combine_send",
            "combine_recv", "graph_dispatch", "graph_combine", "graph_both", "eager_dispatch",
            "eager_combine", f"{prefix}_dispatch", f"{prefix}_combine"]  # fmt: skip
    print("(kernel time from the profiler; graph_*: per call inside CUDA graphs;")
    print(f" eager_*: events around the Python calls; {prefix}_*: {label}"
          + (f", {bench_common.COPY_HOW})" if prefix == "copy" else ")"))  # fmt: skip
    print(f"{'transport':10s}" + "".join(f"{c:>14s}" for c in cols))
    for tr, entry in data["transports"].items():
        m = entry["main"]
        print(f"{tr:10s}" + "".join(f"{m.get(c, float('nan')):14.1f}" for c in cols))
        tg = TARGETS.get(tr, {})
        print(f"{'  target':10s}" + "".join(
            f"{tg[c]:14.1f}" if c in tg else f"{'':14s}" for c in cols))  # fmt: skip
    print(f"{'DeepEP V1':10s}" + "".join(
        f"{DEEPEP[c]:14.1f}" if c in DEEPEP else f"{'':14s}" for c in cols))  # fmt: skip
    by_sms = data["transports"].get("nvlink", {}).get("by_sms", [])
    if by_sms:
        sc = ["dispatch", "combine", "both", "graph_dispatch", "graph_combine", "graph_both",
              "eager_dispatch", "eager_combine"]  # fmt: skip
        print("\nby SMs (blocks of every launch), nvlink:")
        print(f"{'SMs':10s}" + "".join(f"{c:>14s}" for c in sc))
        for r in by_sms:
            print(f"{r['sms']:<10d}" + "".join(f"{r.get(c, float('nan')):14.1f}" for c in sc))


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    names = ["dispatch", "combine", "both"]
    xs = range(len(names))
    for off, (tr, entry) in zip((-0.2, 0.2), data["transports"].items()):
        ax.bar([x + off for x in xs], [entry["main"][n] for n in names], width=0.4, label=tr)
    for i, n in enumerate(names):
        for tr, mk in (("nvlink", "k_"), ("proxy", "r_")):
            if n in TARGETS.get(tr, {}):
                ax.plot([i - 0.4, i + 0.4], [TARGETS[tr][n]] * 2, mk[0] + "--", lw=1)
        ax.plot(i, DEEPEP[n], "kx")
    prefix, label = baseline_of(data)
    base = [(i, next(iter(data["transports"].values()))["main"].get(f"{prefix}_{n}"))
            for i, n in enumerate(names)]  # fmt: skip
    base = [(i, v) for i, v in base if v is not None]
    if base:
        ax.plot(*zip(*base), "D", color="gray", linestyle="none", label=f"{label}, same bytes")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("us (max over ranks of medians)")
    ax.set_title("standard workload (dashes: targets, x: DeepEP V1)")
    ax.legend()
    sweep = data["transports"].get("nvlink", {}).get("sweep", [])
    w = data["workload"]
    pts = sweep + [{"tokens": w["tokens"], "hidden": w["hidden"],
                    **data["transports"]["nvlink"]["main"]}]  # fmt: skip
    note = data["machine"].get("shared_gpu_note")
    for ax, op in zip(axes[1:], ("dispatch", "combine")):
        for h in SWEEP_HIDDEN:
            row = sorted((p for p in pts if p["hidden"] == h), key=lambda p: p["tokens"])
            if row:
                ax.plot([p["tokens"] for p in row], [p[op] for p in row], "o-", label=f"H={h}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("us")
        ax.set_title(f"{op}, memory channels ({'one GPU' if note else 'NVLink'}), sweep")
        ax.legend()
    title = f"moelink low-latency, {w['ranks']} ranks, commit {str(data['git_commit'])[:12]}"
    if note:
        title += f"\n{note}; targets and DeepEP are NVLink figures"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("ll-bench"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sleep-cycles", type=int, default=100_000)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument(
        "--sms",
        type=int,
        nargs="*",
        default=[],
        help="also time the main workload on each of these SM counts (NVLink only)",
    )
    p.add_argument("--no-proxy", action="store_true")
    p.add_argument("--replot", type=Path)
    args = p.parse_args(argv)
    if args.replot:
        data = json.loads(args.replot.read_text())
        plot(data, args.replot.with_suffix(".png"))
        summary(data)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
