"""Quick intranode smoke check under torchrun: one bf16 dispatch + combine and one
fp8 dispatch per rank count, compared with ``moelink.reference``; prints
``PASS``/``FAIL`` lines. The full suite is ``intranode_worker.py``; this one exists
to try kernels quickly (``scripts/gpu_run.sh`` with GPU_RUN_EXTRA)."""

from __future__ import annotations

import os
import sys
import traceback

import moelink
import torch
import torch.distributed as dist
from moelink import reference


def inputs(seed: int, r: int, n: int, hidden: int, e: int, k: int):
    g = torch.Generator().manual_seed(seed * 100 + r)
    idx = torch.randn(n, e, generator=g).topk(k).indices
    drop = torch.rand(n, k, generator=g) < 0.1
    idx[drop] = -1
    w = torch.rand(n, k, generator=g)
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    return idx, w, x


def main() -> int:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    seed = torch.randint(0, 1 << 30, (1,), device="cuda")
    dist.broadcast(seed, 0)
    seed = int(seed.item())
    hidden, e, k = 2048, 8 * size, 4
    ns = [
        int(torch.randint(0, 200, (1,), generator=torch.Generator().manual_seed(seed + r)))
        for r in range(size)
    ]
    ns[size - 1] = 0 if seed % 2 else ns[size - 1]
    hint = moelink.Config(24).get_nvl_buffer_size_hint(hidden * 2, size, max_tokens_per_rank=256)
    buf = moelink.Buffer(dist.group.WORLD, hint, explicitly_destroy=True)
    data = [inputs(seed, r, ns[r], hidden, e, k) for r in range(size)]
    ok = True

    def check(name, fn):
        nonlocal ok
        try:
            fn()
            print(f"PASS {name} rank={rank}", flush=True)
        except Exception:
            ok = False
            print(f"FAIL {name} rank={rank}: {traceback.format_exc()}", flush=True)

    idx, w, x = data[rank]
    idx_d, w_d, x_d = idx.cuda(), w.cuda(), x.cuda()
    ref = reference.dispatch(
        [dict(x=d[2], scales=None, topk_idx=d[0], topk_weights=d[1]) for d in data], e
    )
    mine = ref.ranks[rank]
    state = {}

    def t_layout():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_d, e)
        want = reference.layout(idx, e, size)
        assert torch.equal(per_rank.cpu(), want[0]), (per_rank, want[0])
        assert torch.equal(per_expert.cpu(), want[1])
        assert torch.equal(in_rank.cpu(), want[2])
        state["layout"] = (per_rank, per_expert, in_rank)

    def t_dispatch():
        per_rank, per_expert, in_rank = state["layout"]
        rx, ri, rw, counts, handle, _ = buf.dispatch(
            x_d, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx_d, topk_weights=w_d,
        )  # fmt: skip
        assert rx.shape[0] == mine.num_recv_tokens, (rx.shape, mine.num_recv_tokens)
        assert torch.equal(rx.cpu().view(torch.int16), mine.recv_x.view(torch.int16))
        assert torch.equal(ri.cpu(), mine.recv_topk_idx)
        assert torch.equal(rw.cpu(), mine.recv_topk_weights)
        assert torch.equal(handle[3].cpu(), mine.recv_src_idx)
        assert torch.equal(handle[0].cpu(), ref.rank_prefix_matrix)
        assert counts == list(mine.num_recv_tokens_per_expert), (counts, mine)
        state["handle"] = handle
        state["rw"] = rw

    def t_combine():
        handle = state["handle"]
        ys = [
            torch.randn(ref.ranks[d].num_recv_tokens, hidden,
                        generator=torch.Generator().manual_seed(seed + 7 * d)).to(torch.bfloat16)
            for d in range(size)
        ]  # fmt: skip
        bias = torch.randn(ns[rank], hidden).to(torch.bfloat16)
        biases = [(None, None)] * size
        biases[rank] = (bias, None)
        want = reference.combine(
            ref, ys, [ref.ranks[d].recv_topk_weights for d in range(size)], biases
        )[rank]
        out, out_w, _ = buf.combine(
            ys[rank].cuda(), handle, topk_weights=state["rw"], bias=bias.cuda()
        )
        assert torch.equal(
            out.cpu().view(torch.int16), want[0].to(torch.bfloat16).view(torch.int16)
        )
        assert torch.equal(out_w.cpu(), want[1])

    def t_fp8():
        per_rank, per_expert, in_rank = state["layout"]
        g = torch.Generator().manual_seed(seed + 99)
        xs = [torch.randint(0, 126, (ns[r], hidden), generator=g, dtype=torch.uint8)
              .view(torch.float8_e4m3fn) for r in range(size)]  # fmt: skip
        ss = [torch.rand(hidden // 128, ns[r], generator=g).T for r in range(size)]
        rref = reference.dispatch(
            [dict(x=xs[r], scales=ss[r], topk_idx=data[r][0], topk_weights=None)
             for r in range(size)], e)  # fmt: skip
        (rx, rs), ri, rw, counts, handle, _ = buf.dispatch(
            (xs[rank].cuda(), ss[rank].cuda()), num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx_d,
        )  # fmt: skip
        m = rref.ranks[rank]
        assert torch.equal(rx.cpu().view(torch.uint8), m.recv_x.view(torch.uint8))
        assert torch.equal(rs.cpu(), m.recv_scales)
        assert rw is None and torch.equal(ri.cpu(), m.recv_topk_idx)

    for name, fn in (("layout", t_layout), ("dispatch", t_dispatch), ("combine", t_combine),
                     ("fp8", t_fp8)):  # fmt: skip
        check(name, fn)
        if not ok:
            break
    torch.cuda.synchronize()
    buf.destroy()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
