"""Bit-for-bit comparison of moelink's Rust API on tch tensors (crate
``moelink-tch``) with its Python API, on the same inputs, at N ranks.

Driver (one command, on the GPU machine)::

    python3 examples/tch_parity.py --bin PATH/tch_parity -n 2

runs the Rust half (``examples/tch_parity.rs``: inputs and the tch API's outputs
written to a directory) under ``python3 -m moelink.launch -n N --no-python``, then
this file as the Python half (``--worker DIR``) under ``python3 -m moelink.launch
-n N``: each rank reads its inputs, makes the same calls with ``moelink.Buffer``
and ``moelink.AllReduce``, and compares every output with the Rust one bit for
bit (low-latency receive slabs after putting each expert's source blocks in
source-rank order: their order on the GPU is arrival order). Prints ``PASS
name`` / ``FAIL name: why`` per output and a closing ``N passed, M failed`` line
per rank; exits non-zero on any failure. ``LD_LIBRARY_PATH`` gets torch's
``lib/`` for the Rust binary (it links libtorch dynamically).

With ``MOELINK_RANKS_PER_NODE`` splitting the ranks into emulated nodes both
halves take the internode path (the Buffers sized by the larger of the
low-latency and internode hints, as ``BufferOptions::sized_for`` sizes the Rust
one), and the handle's entries are read from DeepEP's internode 10-tuple.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Tokens per rank, hidden, experts per rank, top-k, allreduce elements
#: (``examples/tch_parity.rs``'s constants).
N, H, EL, K, AR = 96, 512, 4, 4, 12_345


def _load(d: Path) -> dict:
    import torch

    out = {}
    for line in (d / "manifest.txt").read_text().splitlines():
        name, dtype, *shape = line.split()
        raw = bytearray((d / f"{name}.bin").read_bytes())
        dt = getattr(torch, dtype)
        shape = [int(s) for s in shape]
        if len(raw) == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)
    return out


def _bits(t):
    """``t`` (CPU, contiguous) as raw bytes, to compare bit for bit."""
    return t.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8)


def _canonical_ll(recv_x, scales, src_info, layout_range, count):
    """The valid rows of a low-latency receive, each expert's source blocks in
    source-rank order: (rows, scales rows or None, src_info entries)."""
    import torch

    xs, ss, idx = [], [], []
    el, r = layout_range.shape
    for j in range(el):
        for s in range(r):
            v = int(layout_range[j, s])
            begin, n = v >> 32, v & 0xFFFFFFFF
            rows = slice(begin, begin + n)
            xs.append(recv_x[j, rows])
            idx.append(src_info[j, rows])
            if scales is not None:
                ss.append(scales[j, rows])
        assert sum(int(layout_range[j, s]) & 0xFFFFFFFF for s in range(r)) == int(count[j])
    cat = torch.cat
    return cat(xs), (cat(ss) if scales is not None else None), cat(idx)


def worker(root: Path) -> int:
    import moelink
    import torch
    from moelink.config import Config
    from moelink.launch import init_distributed

    info = init_distributed()
    rank, size, dev = info.rank, info.world_size, info.device
    inp = {k: v.to(dev) for k, v in _load(root / f"rank{rank}" / "inputs").items()}
    rust = _load(root / f"rank{rank}" / "rust")
    group = torch.distributed.group.WORLD
    r, e = size, EL * size
    nvl = Config().get_nvl_buffer_size_hint(2 * H, r, max_tokens_per_rank=N)
    # Both modes on one Buffer: the larger hint (0 for the internode one within a node).
    rdma = max(
        moelink.Buffer.get_low_latency_rdma_size_hint(N, H, r, e),
        Config().get_rdma_buffer_size_hint(2 * H, r, max_tokens_per_rank=N),
    )
    b = moelink.Buffer(group, nvl, rdma, low_latency_mode=True, explicitly_destroy=True)
    ar = moelink.AllReduce(group, tune_file=False)
    py = {}

    per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(inp["topk_idx"], e)
    py.update(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert)
    py["is_token_in_rank"] = in_rank
    recv_x, recv_idx, recv_w, counts, handle, _ = b.dispatch(
        inp["x"],
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp["topk_idx"],
        topk_weights=inp["topk_weights"],
    )
    py.update(recv_x=recv_x, recv_topk_idx=recv_idx, recv_topk_weights=recv_w)
    py["num_recv_tokens_per_expert"] = torch.tensor(counts, dtype=torch.int64)
    # (rank_prefix_matrix, recv_src_idx, send_head) of the 6-tuple or of the internode 10-tuple.
    rpm, src, head = (0, 3, 5) if len(handle) == 6 else (2, 7, 9)
    py.update(rank_prefix_matrix=handle[rpm], recv_src_idx=handle[src], send_head=handle[head])
    (cx, cs), *_ = b.dispatch((inp["x_fp8"], inp["scales"]), handle=handle)
    py.update(cached_recv_x=cx, cached_recv_scales=cs)
    combined, combined_w, _ = b.combine(recv_x, handle, topk_weights=recv_w, bias=inp["bias"])
    py.update(combined_x=combined, combined_topk_weights=combined_w)

    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]
    ll_x, ll_count, ll_handle, _, _ = b.low_latency_dispatch(x, idx, N, e, use_fp8=False)
    ll_out, _, _ = b.low_latency_combine(ll_x, idx, w, ll_handle)
    py["ll_combined_x"] = ll_out
    ll_canon = _canonical_ll(ll_x, None, ll_handle[0], ll_handle[1], ll_count)
    py["ll_recv_count"] = ll_count
    (x8, s8), c8, h8, _, _ = b.low_latency_dispatch(x, idx, N, e)
    ll8_canon = _canonical_ll(x8, s8, h8[0], h8[1], c8)
    py["ll8_recv_count"] = c8

    py["ar_sum_bf16"] = ar.all_reduce(inp["ar_bf16"], out=torch.empty_like(inp["ar_bf16"]))
    py["ar_max_f32"] = ar.all_reduce(inp["ar_f32"].clone(), op="max")
    gathered = torch.empty(r * AR, dtype=torch.float32, device=dev)
    py["ag_f32"] = ar.all_gather(gathered, inp["ar_f32"])
    torch.cuda.synchronize()
    b.check()

    passed, failed = 0, 0

    def compare(name, got, want):
        nonlocal passed, failed
        got = got.detach().cpu()
        if got.dtype != want.dtype or list(got.shape) != list(want.shape):
            why = f"Python {got.dtype} {list(got.shape)}, Rust {want.dtype} {list(want.shape)}"
        elif not torch.equal(_bits(got), _bits(want)):
            diff = (_bits(got) != _bits(want)).sum().item()
            why = f"{diff} of {_bits(got).numel()} bytes differ"
        else:
            print(f"PASS {name} (rank {rank}/{size})", flush=True)
            passed += 1
            return
        print(f"FAIL {name} (rank {rank}/{size}): {why}", flush=True)
        failed += 1

    for name, t in py.items():
        compare(name, t, rust[name])
    rust_ll = _canonical_ll(
        rust["ll_recv_x"], None, rust["ll_src_info"], rust["ll_layout_range"],
        rust["ll_recv_count"],
    )  # fmt: skip
    compare("ll_recv_x (canonical order)", ll_canon[0], rust_ll[0])
    compare("ll_src_info (canonical order)", ll_canon[2], rust_ll[2])
    rust_ll8 = _canonical_ll(
        rust["ll8_recv_x"], rust["ll8_recv_scales"], rust["ll8_src_info"],
        rust["ll8_layout_range"], rust["ll8_recv_count"],
    )  # fmt: skip
    compare("ll8_recv_x (canonical order)", ll8_canon[0], rust_ll8[0])
    compare("ll8_recv_scales (canonical order)", ll8_canon[1], rust_ll8[1])
    compare("ll8_src_info (canonical order)", ll8_canon[2], rust_ll8[2])
    ar.destroy()
    b.destroy()
    print(f"rank {rank}: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def driver(args) -> int:
    import torch

    lib = str(Path(torch.__file__).parent / "lib")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    launch = [sys.executable, "-m", "moelink.launch", "-n", str(args.n)]
    if args.timeout:
        launch += ["--timeout", str(args.timeout)]
    with tempfile.TemporaryDirectory(prefix="tch-parity-") as tmp:
        root = Path(args.dir or tmp)
        print(f"=== tch API ({args.bin}), {args.n} ranks -> {root}", flush=True)
        rc = subprocess.call([*launch, "--no-python", args.bin, "--out", str(root)], env=env)
        if rc != 0:
            print(f"FAIL: the Rust half exited {rc}", flush=True)
            return rc
        print(f"=== Python API, {args.n} ranks, compared bit for bit", flush=True)
        return subprocess.call([*launch, __file__, "--worker", str(root)], env=env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", help="the tch_parity binary (driver)")
    p.add_argument("-n", type=int, default=2, help="ranks (driver)")
    p.add_argument("--dir", help="keep the outputs here (driver; default: a temporary one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per half (driver)")
    p.add_argument("--worker", help="(internal) compare against the Rust outputs in this dir")
    a = p.parse_args()
    if a.worker:
        return worker(Path(a.worker))
    if not a.bin:
        p.error("--bin is required")
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
