"""The eager low-latency loop of DeepEP V1's test_low_latency.py (a dispatch and a
combine, both halves each, no hook, no graph), through moelink, with the host
time of each call beside the loop's GPU-event time:

    python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/probe/ll_eager_loop.py [--json F]

The workload is the test's: 128 tokens per rank, hidden 7168, top-8 of 288
experts, fp8 dispatch with ``cumulative_local_expert_recv_stats``, bf16 combine.
For each path (``one call``: the eager call whole in one native call; ``checked``:
the Python path, as ``async_finish=True`` takes it; ``checked, torch.empty``: that
path with its outputs made by ``torch.empty_strided`` instead of torch's C shim;
``this build``: a build before the one-call path) it reports:

- ``loop``: DeepEP's ``bench``: 50 warm-up loops, then 50 loops each between two
  CUDA events on the current stream, average and minimum (the figure the test
  prints as ``Dispatch + combine ... avg_t``);
- ``host``: the same loops timed on the CPU (median);
- ``dispatch host`` / ``combine host``: each call alone timed on the CPU (median),
  the GPU busy as in the loop;
- rank 0's top functions by own time over 50 profiled loops (``--profile``).

``--default-device`` runs the loops after ``torch.set_default_dtype(torch.bfloat16)``
and ``torch.set_default_device("cuda")``, as DeepEP's test process does (its
``init_dist``): the latter is a torch function mode, which every torch call made
from Python goes through.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

T, H, TOPK, E = 128, 7168, 8, 288


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--default-device", action="store_true")
    args = p.parse_args(argv)

    import moelink
    import torch
    import torch.distributed as dist
    from moelink.launch import init_distributed

    # NCCL, or gloo where ranks share GPUs; the device local_rank % GPUs
    init_distributed()
    rank, size = dist.get_rank(), dist.get_world_size()
    nbytes = moelink.Buffer.get_low_latency_rdma_size_hint(T, H, size, E)
    buf = moelink.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True,
                         num_qps_per_rank=E // size, explicitly_destroy=True)  # fmt: skip
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(T, E, generator=g).topk(TOPK, dim=1).indices.cuda()
    w = torch.rand(T, TOPK, generator=g).cuda()
    stats = torch.zeros(E // size, dtype=torch.int32, device="cuda")
    y = torch.randn(E // size, size * T, H, generator=g).to(torch.bfloat16).cuda()

    if args.default_device:  # as DeepEP's test process
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")

    def dispatch():
        return buf.low_latency_dispatch(x, idx, T, E, cumulative_local_expert_recv_stats=stats,
                                        use_fp8=True, async_finish=False,
                                        return_recv_hook=False)  # fmt: skip

    def combine(handle):
        return buf.low_latency_combine(y, idx, w, handle, return_recv_hook=False)

    def loop():
        handle = dispatch()[2]
        combine(handle)

    from moelink import _buffer_common

    one_call = getattr(buf, "_ll_state", None)
    if one_call is None:  # a build before the one-call path
        paths = {"this build": (None, True)}
    else:
        from moelink._testing import CheckedPath

        paths = {
            "one call": (one_call, True),
            "checked": (CheckedPath(one_call), True),
            "checked, torch.empty": (CheckedPath(one_call), False),
        }
    torch_alloc = getattr(_buffer_common, "_TORCH_ALLOC", False)
    out: dict = {}
    for name, (state, shim) in paths.items():
        if state is not None:
            buf._ll_state = state
        # outputs through torch's C shim, or torch.empty_strided from Python
        _buffer_common._TORCH_ALLOC = torch_alloc and shim
        if hasattr(_buffer_common, "PlanCache"):
            buf._plans = _buffer_common.PlanCache()
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(50):
            loop()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
        host = []
        for i in range(50):
            starts[i].record()
            t0 = time.perf_counter_ns()
            loop()
            host.append(time.perf_counter_ns() - t0)
            ends[i].record()
        torch.cuda.synchronize()
        ev = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)][1:]
        d_host, c_host = [], []
        handle = dispatch()[2]
        for _ in range(50):
            t0 = time.perf_counter_ns()
            handle = dispatch()[2]
            d_host.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            combine(handle)
            c_host.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        out[name] = {
            "loop_avg_us": statistics.mean(ev),
            "loop_min_us": min(ev),
            "host_median_us": statistics.median(host) / 1e3,
            "dispatch_host_median_us": statistics.median(d_host) / 1e3,
            "combine_host_median_us": statistics.median(c_host) / 1e3,
        }
        if args.profile and rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                loop()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            out[name]["profile"] = text.getvalue()
        elif args.profile:
            for _ in range(50):
                loop()
        torch.cuda.synchronize()
    if one_call is not None:
        buf._ll_state = one_call
    dist.barrier()
    if rank == 0:
        for name, r in out.items():
            print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "profile"))
            if "profile" in r:
                print(r["profile"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"default_device": args.default_device, **out}, f, indent=1)
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
