"""Per-kernel GPU times of intranode dispatch/combine (torch.profiler / CUPTI).

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/intranode_profile.py [--sms 24 48] [--iters 10]
    python -m moelink.launch -n 4 benches/intranode_profile.py   # any GPU count

Runs the PERFORMANCE.md workload (moelink.intranode_demo.make_inputs) and prints,
on rank 0, the mean GPU time of every moelink kernel (dispatch_notify,
dispatch_send, dispatch_wait, dispatch_recv, combine_send, ...) per SM count:
where the time of a dispatch or a combine goes. No correctness check here: the
benchmark (intranode_bench.py) does that. Where ranks share a GPU the times are
one GPU's memory, not NVLink (said once above the table), and SM counts above a
rank's share of the GPU are left out, as in the benchmark.
"""

from __future__ import annotations

import argparse

import bench_common
import moelink
import torch
import torch.distributed as dist
from moelink import intranode_demo as demo

NAMES = ("layout", "dispatch", "combine")


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
        dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
