"""Where the host time of an eager normal-mode ``combine`` goes, one rank on one
GPU: the whole call (one native call through ep-core's engine, and the checked
Python path) beside each of its parts called alone with the call's own plan,
tensors and addresses, and ``x.add_(0)`` as the reference.

    python -m moelink.launch -n 1 benches/probe/combine_host_parts.py [--iters 2000] [--json F]

Medians in us of ``--iters`` samples per row, interleaved in 10 rounds (the GPU
synchronized between samples, outside the timed region). Rows:

- ``x.add_(0)``: the reference;
- ``combine``: ``Buffer.combine(x, handle, topk_weights=w)`` (one native call);
- ``combine, checked path``: the same through the Python path;
- ``read 8 tensors``: ``_native.tensor_args`` of the call's eight tensor objects
  (the one call reads them so, without building the tuples this returns);
- ``outputs``: the call's two outputs (its plan's ``OutputSet``);
- ``native combine``: ``EpBuffer.combine`` alone on the communication stream
  (the kernels: a barrier where an earlier combine ran, then the combine);
- ``stream order x2``: the communication stream waiting for the current one
  and back (``StreamOrder.after`` twice);
- ``raw stream``: the current stream's handle.
"""

from __future__ import annotations

import statistics

from host_sampling import normal_setup, probe_args, report, sample_rows


def main(argv=None) -> int:
    args = probe_args(__doc__, 2000, argv)

    from moelink import _native
    from moelink._streams import current_raw_stream

    s = normal_setup(3)
    torch, rank, dev, buf = s.torch, s.rank, s.dev, s.buf
    recv_x, _, recv_w, _, handle, _ = s.dispatch()
    ref = torch.randn(1024, device=dev)
    calls = buf._calls

    def whole():
        buf.combine(recv_x, handle, topk_weights=recv_w)

    def checked():
        buf._calls = None
        try:
            whole()
        finally:
            buf._calls = calls

    whole()
    checked()
    torch.cuda.synchronize()
    plan, outputs = buf._combine_plan(recv_x, handle, recv_w, None)
    out, out_w = outputs.empty()
    rpm, send_head = handle[0], handle[5]
    num_sms = buf._num_sms(None, type(buf).get_combine_config, "combine")
    comm, order, native = buf._comm_raw, buf._order, buf._native
    ptrs = (recv_x.data_ptr(), recv_w.data_ptr(), rpm.data_ptr(), send_head.data_ptr(), 0, 0,
            out.data_ptr(), out_w.data_ptr())  # fmt: skip
    objs = [recv_x, recv_w, handle[0], handle[3], handle[4], handle[5], None, None]

    def both_orders():
        compute = current_raw_stream(dev.index)
        order.after(comm, compute)
        order.after(compute, comm)

    rows = {
        "x.add_(0)": lambda: ref.add_(0),
        "combine": whole,
        "combine, checked path": checked,
        "read 8 tensors": lambda: _native.tensor_args(objs),
        "outputs": outputs.empty,
        "native combine": lambda: native.combine(comm, plan, num_sms, ptrs),
        "stream order x2": both_orders,
        "raw stream": lambda: current_raw_stream(dev.index),
    }
    samples = sample_rows(rows, args.iters, torch.cuda.synchronize)
    torch.cuda.synchronize()
    med = {name: statistics.median(s) / 1e3 for name, s in samples.items()}
    parts = med["outputs"] + med["native combine"] + med["stream order x2"]
    med["one native call less outputs, kernels, order"] = med["combine"] - parts
    med["checked path less outputs, kernels, order"] = med["combine, checked path"] - parts
    if rank == 0:
        report(med, args.json, iters=args.iters)
    del out, out_w
    buf.destroy()
    s.dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
