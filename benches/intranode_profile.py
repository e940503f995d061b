"""Per-kernel GPU times of intranode dispatch/combine (torch.profiler / CUPTI).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/intranode_profile.py [--sms 24 48] [--iters 10]
    python -m moelink.launch -n 4 benches/intranode_profile.py   # any GPU count

Runs the docs/performance.md workload (moelink.intranode_demo.make_inputs) and prints,
on rank 0, the mean GPU time of every moelink kernel (moelink::intranode::notify,
::dispatch, ::combine, ::barrier, ...) per SM count:
where the time of a dispatch or a combine goes. With MOELINK_INTRANODE_PROFILE=1
it also prints the fused kernels' phase stamps of one cached bf16 dispatch, one
cached fp8 dispatch, one full bf16 dispatch and one combine, each alone with the
device synchronised (per block, from its start: warp 0 past its first row, warp 0
out of its row loop, the block's end; median / max over blocks, and the spans and
skews of senders and receivers) on rank 0. No correctness check here: the
benchmark (intranode_bench.py) does that. Where ranks share a GPU the times are
one GPU's memory, not NVLink (said once above the table), and SM counts above a
rank's share of the GPU are left out, as in the benchmark.
"""

from __future__ import annotations

import argparse
import os

import bench_common
import moelink
import torch
import torch.distributed as dist
from moelink import intranode_demo as demo

#: Substrings of the kernels' profiler names (moelink::layout::count_tokens,
#: moelink::intranode::notify / barrier / dispatch / combine, ...).
NAMES = ("layout", "notify", "barrier", "dispatch", "combine")

#: ep_kernels::intranode::PROF_KINDS / PROF_BLOCKS / PROF_SLOTS.
PROF_KINDS = ("dispatch senders", "dispatch receivers", "combine senders", "combine receivers")
PROF_BLOCKS, PROF_SLOTS = 256, 4
PHASES = ("warp 0 past its first row", "warp 0 out of its row loop", "block end")


def stamp_lines(stamps: list, window_ns: int = 5_000_000) -> list:
    """Lines describing the phase stamps ``[kind][block][slot]`` (globaltimer
    ns) of the latest launch of each kind: the blocks whose start lies within
    ``window_ns`` of the kind's latest start (older launches leave stale
    blocks). Times are microseconds from each block's start (median / max over
    blocks), then each kind's span and start skew, and how a dispatch's
    receivers lie against its senders."""
    import statistics

    lines, spans = [], {}
    for kind, name in enumerate(PROF_KINDS):
        blocks = []
        for b in range(PROF_BLOCKS):
            base = (kind * PROF_BLOCKS + b) * PROF_SLOTS
            blocks.append(stamps[base : base + PROF_SLOTS])
        starts = [blk[0] for blk in blocks if blk[0] > 0]
        if not starts:
            continue
        latest = max(starts)
        blocks = [blk for blk in blocks if blk[0] > 0 and blk[0] >= latest - window_ns]
        lines.append(f"  {name}: {len(blocks)} blocks")
        for slot, phase in enumerate(PHASES, start=1):
            d = [(blk[slot] - blk[0]) / 1e3 for blk in blocks if blk[slot] >= blk[0]]
            if d:
                lines.append(
                    f"    {phase:<28} {statistics.median(d):9.1f} / {max(d):9.1f} us"
                    f"  ({len(d)} blocks)"
                )
        first = min(blk[0] for blk in blocks)
        last = max(blk[3] for blk in blocks)
        spans[kind] = (first, last)
        lines.append(f"    {'span (first start, last end)':<28} {(last - first) / 1e3:9.1f} us")
        lines.append(f"    {'start skew':<28} {(latest - first) / 1e3:9.1f} us")
    for op, send, recv in (("dispatch", 0, 1), ("combine", 2, 3)):
        if send in spans and recv in spans:
            (s0, e0), (s1, e1) = spans[send], spans[recv]
            lines.append(
                f"  {op} receivers: start {(s1 - s0) / 1e3:.1f} us after the senders, "
                f"end {(e1 - e0) / 1e3:.1f} us after them"
            )
    return lines


def print_stamps(buf, rank: int, sms: int, x, fp8, layout, recv, recv_w, handle, cfg) -> None:
    """One cached bf16 dispatch, one cached fp8 dispatch, one full (uncached)
    bf16 dispatch, then one combine, each alone with the device synchronised;
    rank 0 prints the phase stamps of each (the fused kernel's; the full call's
    notify is the profiler's ``moelink::intranode::notify`` above). Each read zeroes the
    stamps, so each call shows only its own launches."""
    calls = (
        ("cached bf16 dispatch", lambda: buf.dispatch(x, handle=handle, config=cfg)),
        ("cached fp8 dispatch", lambda: buf.dispatch(fp8, handle=handle, config=cfg)),
        ("full bf16 dispatch", lambda: buf.dispatch(x, config=cfg, **layout)),
        ("combine", lambda: buf.combine(recv, handle, topk_weights=recv_w, config=cfg)),
    )
    buf._buffer().intranode_profile()  # zeroes the stamps of the calls before
    for what, call in calls:
        torch.cuda.synchronize()
        dist.barrier()
        call()
        torch.cuda.synchronize()
        stamps = buf._buffer().intranode_profile()
        if rank == 0:
            print(f"phase stamps, {sms} SMs, one {what} (rank 0):", flush=True)
            print("\n".join(stamp_lines(stamps)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sms", type=int, nargs="+", default=[24, 48])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--num-tokens", type=int, default=4096)
    args = p.parse_args()
    info = bench_common.init()
    rank, size = info.rank, info.world_size
    # Where ranks share a GPU: only SM counts within a rank's share (as the bench).
    gpus = demo._gpu_placement(dist.group.WORLD, info.device)
    sms_list, sms_note = demo._sms_within_share(args.sms, gpus)
    note = bench_common.shared_gpu_note(info)
    if rank == 0:
        for line in (note, sms_note):
            if line:
                print(line, flush=True)
    inp = {k: v.cuda() for k, v in demo.make_inputs(rank, size, args.num_tokens).items()}
    hidden, e = inp["x"].shape[1], 256
    hint = moelink.Config(24).get_nvl_buffer_size_hint(
        hidden * 2, size, max_tokens_per_rank=args.num_tokens
    )
    buf = moelink.Buffer(dist.group.WORLD, hint, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp["topk_idx"], e)
    layout = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp["topk_idx"],
        topk_weights=inp["topk_weights"],
    )
    for sms in sms_list:
        cfg = moelink.Config(sms)
        recv, _, recv_w, _, handle, _ = buf.dispatch(inp["x"], config=cfg, **layout)
        fp8 = (inp["x_fp8"], inp["x_scales"])
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                buf.get_dispatch_layout(inp["topk_idx"], e)
                buf.dispatch(inp["x"], config=cfg, **layout)
                buf.dispatch(inp["x"], handle=handle, config=cfg)
                buf.dispatch(fp8, handle=handle, config=cfg)
                buf.combine(recv, handle, topk_weights=recv_w, config=cfg)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"== {sms} SMs, {args.iters} iterations (uncached + cached bf16 + cached fp8)")
            for ev in sorted(prof.key_averages(), key=lambda a: a.key):
                if any(n in ev.key for n in NAMES):
                    us = ev.device_time_total / max(ev.count, 1)
                    print(f"{ev.key:24s} count={ev.count:4d} mean={us:9.1f} us", flush=True)
        if os.environ.get("MOELINK_INTRANODE_PROFILE") == "1":
            print_stamps(buf, rank, sms, inp["x"], fp8, layout, recv, recv_w, handle, cfg)
        dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
