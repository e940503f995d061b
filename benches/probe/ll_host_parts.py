"""Where the host time of a low-latency dispatch with its hook goes, one rank on
one GPU: the whole call beside each of its parts called alone, with the same
plan, outputs and addresses the call uses, and ``x.add_(0)`` as the reference.

    python -m moelink.launch -n 1 benches/probe/ll_host_parts.py [--iters 3000] [--json F]

Medians in us of ``--iters`` samples per row, interleaved in 10 rounds (each row
timed from the Python call to its return; the GPU is synchronized between
samples, outside the timed region). Rows:

- ``x.add_(0)``: the reference;
- ``dispatch + hook``: ``low_latency_dispatch(..., return_recv_hook=True)`` then the hook
  (an eager call runs whole in one native call, ``_native.LlCalls``);
- ``dispatch + hook, checked path``: the same through the Python path (plan cache,
  ``OutputSet``, a launch per phase), which ``async_finish=True`` takes;
- ``outputs``: the five outputs of the call's cached plan (``OutputSet.empty``);
- ``native send`` / ``native recv``: ``EpBuffer.ll_dispatch`` of the send and of the
  receive phase, with the call's plan and addresses;
- ``raw stream``: the current stream's handle;
- ``plan lookup``: the call's plan-cache key and lookup.

The checked path's Python glue is that call less the parts; what the one native
call adds to the same parts is its own line.

``--default-device`` times every row after ``torch.set_default_device`` (the
current GPU), as DeepEP's test process does: a torch function mode, which every
torch call made from Python goes through, ``x.add_(0)`` included.
"""

from __future__ import annotations

import argparse
import statistics

from host_sampling import report, sample_rows, timed

T, H, TOPK, E_PER_RANK = 128, 7168, 8, 36


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--json", default=None)
    p.add_argument("--default-device", action="store_true")
    args = p.parse_args(argv)

    import moelink
    import torch
    import torch.distributed as dist
    from moelink import low_latency
    from moelink._streams import current_raw_stream
    from moelink._testing import CheckedPath

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    e = E_PER_RANK * size
    nbytes = moelink.Buffer.get_low_latency_rdma_size_hint(T, H, size, e)
    buf = moelink.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True,
                         explicitly_destroy=True)  # fmt: skip
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(T, e, generator=g).topk(TOPK, dim=1).indices.to(dev)
    ref = torch.randn(1024, device=dev)

    def whole():
        hook = buf.low_latency_dispatch(x, idx, T, e, use_fp8=True, return_recv_hook=True)[4]
        hook()

    one_call, checked = buf._ll_state, CheckedPath(buf._ll_state)

    def whole_checked():
        buf._ll_state = checked
        try:
            whole()
        finally:
            buf._ll_state = one_call

    if args.default_device:  # as DeepEP's test process
        torch.set_default_device(dev)
    whole()
    whole_checked()
    torch.cuda.synchronize()
    ll = buf._ll
    entry = buf._ll_dispatch_plan(ll, x, idx, T, e, None, None, True, False, False)
    plan, outputs = entry[0], entry[6]
    outs = outputs.empty()
    recv_x, scales, count, src_info, layout_range = outs
    ptrs = (x.data_ptr(), idx.data_ptr(), recv_x.data_ptr(), scales.data_ptr(),
            count.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(), 0, 0)  # fmt: skip
    raw = current_raw_stream(dev.index)
    sig = low_latency._sig

    def key():
        k = ("dispatch", sig(x), sig(idx), sig(None), sig(None), T, e, True, False, False,
             int, int, bool, bool, bool)  # fmt: skip
        buf._plans.get(k)

    def native_both():
        ll.ll_dispatch(raw, plan, ptrs, 1)
        ll.ll_dispatch(raw, plan, ptrs, 2)

    rows = {
        "x.add_(0)": lambda: ref.add_(0),
        "dispatch + hook": whole,
        "dispatch + hook, checked path": whole_checked,
        "outputs": outputs.empty,
        "native send": lambda: ll.ll_dispatch(raw, plan, ptrs, 1),
        "native recv": lambda: ll.ll_dispatch(raw, plan, ptrs, 2),
        "native send + recv": native_both,
        "raw stream": lambda: current_raw_stream(dev.index),
        "plan lookup": key,
    }
    paired = ("native send", "native recv")

    def send_then_recv(per, samples):
        # The send and receive launches must pair up (the kernels count
        # calls): send then recv, each timed alone.
        for i in range(per + 3):
            for name in ("native send", "native recv"):
                dt = timed(rows[name], 1, torch.cuda.synchronize, warm=0)[0]
                if i >= 3:
                    samples[name].append(dt)

    samples = sample_rows(rows, args.iters, torch.cuda.synchronize, skip=paired,
                          each_round=send_then_recv)  # fmt: skip
    torch.cuda.synchronize()
    med = {name: statistics.median(s) / 1e3 for name, s in samples.items()}
    parts = med["outputs"] + med["native send"] + med["native recv"] + med["raw stream"]
    med["checked path less its parts (Python glue)"] = med["dispatch + hook, checked path"] - parts
    med["one native call less those parts"] = med["dispatch + hook"] - parts
    if rank == 0:
        report(med, args.json, iters=args.iters, default_device=args.default_device)
    del outs, recv_x, scales, count, src_info, layout_range
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
