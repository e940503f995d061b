"""A DeepEP user's script, written the way DeepEP's README shows (docs/legacy.md of
deepseek-ai/DeepEP, "Interfaces and Examples"): normal dispatch / combine for
training and prefill (forward and backward, one Buffer sized by the config hints),
and low-latency dispatch / combine with a receive hook for decoding. It imports
only ``deep_ep``, ``torch`` and ``torch.distributed``, checks every result against
what the all-gathered inputs of every rank say it must be, and exits non-zero on
any mismatch.

Run it unchanged on any number of ranks::

    python3 -m moelink.launch -n 4 tests/multi_gpu/deep_ep_script.py

(or torchrun). Ranks that share a GPU get a gloo group (NCCL refuses them).
``DEEP_EP_SCRIPT_SEED`` replays a run's data. Rank 0 prints ``PASS deep_ep_script``
or ``FAIL deep_ep_script: ...``; every rank prints its own mismatches.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import deep_ep
import torch
import torch.distributed as dist
from deep_ep import Buffer, EventOverlap

# ----------------------------------------------------------------------------
# The README's normal-mode functions
# ----------------------------------------------------------------------------

# Communication buffer (allocated at runtime)
_buffer: Buffer | None = None

# The number of SMs to use (a static setting)
Buffer.set_num_sms(24)


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (
        Buffer.get_dispatch_config(group.size()),
        Buffer.get_combine_config(group.size()),
    ):
        num_nvl_bytes = max(
            config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes
        )
        num_rdma_bytes = max(
            config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes
        )
    # A new buffer if there is none or it is too small.
    if (
        _buffer is None
        or _buffer.group != group
        or _buffer.num_nvl_bytes < num_nvl_bytes
        or _buffer.num_rdma_bytes < num_rdma_bytes
    ):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def get_hidden_bytes(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> int:
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x, topk_idx, topk_weights, num_experts, previous_event=None):
    # The layout first (asynchronously; allocated on the communication stream when
    # there is a previous event to wait for), then the dispatch, which waits on the
    # CPU for the received counts.
    (
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        num_tokens_per_expert,
        is_token_in_rank,
        previous_event,
    ) = _buffer.get_dispatch_layout(
        topk_idx,
        num_experts,
        previous_event=previous_event,
        async_finish=True,
        allocate_on_comm_stream=previous_event is not None,
    )
    (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event) = (
        _buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
    )
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle):
    # The backward of a dispatch is a combine.
    combined_grad_x, combined_grad_recv_topk_weights, event = _buffer.combine(
        grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True
    )
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x, handle, previous_event=None):
    combined_x, _, event = _buffer.combine(
        x,
        handle,
        async_finish=True,
        previous_event=previous_event,
        allocate_on_comm_stream=previous_event is not None,
    )
    return combined_x, event


def combine_backward(grad_combined_x, handle, previous_event=None):
    # The backward of a combine is a (cached) dispatch.
    grad_x, _, _, _, _, event = _buffer.dispatch(
        grad_combined_x,
        handle=handle,
        async_finish=True,
        previous_event=previous_event,
        allocate_on_comm_stream=previous_event is not None,
    )
    return grad_x, event


# ----------------------------------------------------------------------------
# The README's low-latency functions
# ----------------------------------------------------------------------------

_ll_buffer: Buffer | None = None


def get_ll_buffer(group, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
    global _ll_buffer
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank, hidden, group.size(), num_experts
    )
    if (
        _ll_buffer is None
        or _ll_buffer.group != group
        or not _ll_buffer.low_latency_mode
        or _ll_buffer.num_rdma_bytes < num_rdma_bytes
    ):
        # For the best performance, as many QPs as local experts.
        assert num_experts % group.size() == 0
        _ll_buffer = Buffer(
            group,
            0,
            num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=num_experts // group.size(),
        )
    return _ll_buffer


def low_latency_dispatch(
    hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True
):
    # Data arrives only once hook() is called: nothing occupies SMs meanwhile.
    recv_hidden_states, recv_expert_count, handle, event, hook = _ll_buffer.low_latency_dispatch(
        hidden_states,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        async_finish=False,
        return_recv_hook=True,
    )
    return recv_hidden_states, recv_expert_count, handle, event, hook


def low_latency_combine(hidden_states, topk_idx, topk_weights, handle):
    combined_hidden_states, event_overlap, hook = _ll_buffer.low_latency_combine(
        hidden_states, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=True
    )
    return combined_hidden_states, event_overlap, hook


# ----------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------

TOPK_IDX_T = getattr(deep_ep, "topk_idx_t", torch.int64)
EXPERTS_PER_RANK = 8
NUM_TOPK = 8


class Failures:
    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.items.append(msg)

    def same(self, label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Bit for bit (float32 by value)."""
        got, want = got.detach().cpu(), want.detach().cpu()
        if got.dtype != want.dtype or got.shape != want.shape:
            self.items.append(
                f"{label}: {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
            )
            return
        if got.dtype == torch.float32:
            bad = ~(got == want)
        else:
            bad = bits(got) != bits(want)
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            self.items.append(
                f"{label}: {int(bad.sum())} of {bad.numel()} elements differ, first "
                f"at {at}: {got[tuple(at)].float().item()} vs "
                f"{want[tuple(at)].float().item()}"
            )


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.bool):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [n, h] -> (e4m3 [n, h], float32 scales [n, h / 128]), amax / 448 per 128."""
    n, h = x.shape
    xv = x.float().view(n, h // 128, 128)
    scales = xv.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    data = (xv / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(n, h)
    return data, scales


def dequant(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return data.float() * scales.float().repeat_interleave(128, dim=-1)


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def make_tokens(g: torch.Generator, n: int, hidden: int, num_experts: int):
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(n, num_experts, generator=g).topk(NUM_TOPK, dim=1).indices
    topk_idx[torch.rand(n, NUM_TOPK, generator=g) < 0.1] = -1
    if n > 3:
        topk_idx[3] = -1  # a token for no expert at all
    topk_weights = torch.rand(n, NUM_TOPK, generator=g) + 0.05
    return x, topk_idx.to(TOPK_IDX_T), topk_weights


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Routing:
    """What rank ``rank`` must receive, from every rank's ``topk_idx``: the (source
    rank, token) pairs of its rows, the tokens of each local expert, per-expert
    counts, and each token's destination ranks."""

    def __init__(self, all_idx: list, rank: int, num_ranks: int, el: int) -> None:
        self.rank, self.el = rank, el
        self.pairs = []
        self.counts = [0] * el
        lo, hi = rank * el, (rank + 1) * el
        for s, idx in enumerate(all_idx):
            hit = ((idx >= lo) & (idx < hi)).any(dim=1)
            self.pairs += [(s, t) for t in hit.nonzero().flatten().tolist()]
            for j in range(el):
                self.counts[j] += int((idx == lo + j).any(dim=1).sum())
        idx = all_idx[rank]
        valid = idx >= 0
        dest = torch.where(valid, idx // el, torch.full_like(idx, -1))
        self.token_ranks = [sorted(set(d for d in row if d >= 0)) for row in dest.tolist()]
        self.num_tokens_per_rank = torch.tensor(
            [sum(d in tr for tr in self.token_ranks) for d in range(num_ranks)], dtype=torch.int32
        )
        self.num_tokens_per_expert = torch.tensor(
            [int((idx == e).any(dim=1).sum()) for e in range(num_ranks * el)], dtype=torch.int32
        )
        self.is_token_in_rank = torch.tensor(
            [[d in tr for d in range(num_ranks)] for tr in self.token_ranks], dtype=torch.bool
        ).view(len(self.token_ranks), num_ranks)


def received_pairs(handle, rank: int, rows: int) -> list:
    """(source rank, source token) of each received row, from the intranode handle:
    handle[0] is the rank prefix matrix (rows from ranks 0..s), handle[3] the
    source token index of each row."""
    prefix = handle[0][:, rank].cpu().tolist()
    src_idx = handle[3][:rows].cpu().tolist()
    out, s = [], 0
    for i in range(rows):
        while s < len(prefix) and i >= prefix[s]:
            s += 1
        out.append((s, src_idx[i]))
    return out


def rank_factor(d: int) -> float:
    """Destination rank d's expert multiplies its rows by this power of two."""
    return float(2 ** (d % 3))


def check_received(
    f, label, route, pairs, recv_x, recv_idx, recv_w, all_x, all_s, all_idx, all_w, num_list
):
    """Rows by their (source, token) pairs against the senders' tokens."""
    f.check(
        sorted(pairs) == sorted(route.pairs) and len(set(pairs)) == len(pairs),
        f"{label}: received {len(pairs)} rows from (source, token) pairs that differ from "
        f"the {len(route.pairs)} expected",
    )
    if sorted(pairs) != sorted(route.pairs):
        return
    n = len(pairs)
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    f.same(
        f"{label} recv_x",
        data[:n],
        torch.stack([all_x[s][t] for s, t in pairs]) if n else data[:0].cpu(),
    )
    if scales is not None and n:
        f.same(
            f"{label} recv_x scales",
            scales[:n].contiguous(),
            torch.stack([all_s[s][t] for s, t in pairs]),
        )
    if recv_idx is not None and n:
        lo = route.rank * route.el
        want_idx = torch.stack([all_idx[s][t] for s, t in pairs])
        local = (want_idx >= lo) & (want_idx < lo + route.el)
        f.same(
            f"{label} recv_topk_idx",
            recv_idx[:n],
            torch.where(local, want_idx - lo, torch.full_like(want_idx, -1)),
        )
        want_w = torch.stack([all_w[s][t] for s, t in pairs])
        f.same(
            f"{label} recv_topk_weights",
            recv_w[:n],
            torch.where(local, want_w, torch.zeros_like(want_w)),
        )
    if num_list is not None:
        f.check(
            list(num_list) == route.counts,
            f"{label}: num_recv_tokens_per_expert_list {list(num_list)}, expected {route.counts}",
        )


def expected_combined(route: Routing, x_values: torch.Tensor) -> torch.Tensor:
    """Each token's sum over the ranks it went to of rank_factor(d) * its row."""
    factor = torch.tensor([sum(rank_factor(d) for d in tr) for tr in route.token_ranks])
    return (x_values.float() * factor.view(-1, 1)).to(torch.bfloat16)


def test_normal(f: Failures, group, rank: int, num_ranks: int, seed: int) -> None:
    el = EXPERTS_PER_RANK
    num_experts = el * num_ranks
    dev = current_device()
    for it, (hidden, fp8, with_event) in enumerate(
        ((2048, False, False), (4096, True, True), (7168, False, True))
    ):
        label = f"normal #{it} hidden={hidden} fp8={fp8}"
        g = torch.Generator().manual_seed(seed * 1000 + it * 100 + rank)
        n = 96 + 8 * rank
        x, topk_idx, topk_weights = make_tokens(g, n, hidden, num_experts)
        scales = None
        if fp8:
            x, scales = per_token_cast_to_fp8(x)
        grad_combined = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
        # (fp8 tensors travel as bytes: torch's pickling of float8 storages fails)
        sent = x.view(torch.uint8) if fp8 else x
        all_x, all_s, all_idx, all_w, all_grad = map(
            list, zip(*gather((sent, scales, topk_idx, topk_weights, grad_combined)))
        )
        all_x = [t.view(x.dtype) for t in all_x]
        route = Routing(all_idx, rank, num_ranks, el)

        buffer = get_buffer(group, get_hidden_bytes(x))
        x_gpu = (x.to(dev), scales.to(dev)) if fp8 else x.to(dev)
        idx_gpu, w_gpu = topk_idx.to(dev), topk_weights.to(dev)

        # The layout alone.
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_gpu, num_experts)
        f.same(f"{label} num_tokens_per_rank", per_rank, route.num_tokens_per_rank)
        f.same(f"{label} num_tokens_per_expert", per_expert, route.num_tokens_per_expert)
        f.same(f"{label} is_token_in_rank", in_rank, route.is_token_in_rank)

        # Forward: dispatch, the experts, combine.
        previous_event = Buffer.capture() if with_event else None
        recv_x, recv_idx, recv_w, num_list, handle, event = dispatch_forward(
            x_gpu, idx_gpu, w_gpu, num_experts, previous_event
        )
        f.check(isinstance(event, EventOverlap), f"{label}: dispatch event {type(event)}")
        event.current_stream_wait()
        rows = len(route.pairs)
        data = recv_x[0] if fp8 else recv_x
        f.check(data.shape[0] == rows, f"{label}: {data.shape[0]} rows received, expected {rows}")
        pairs = received_pairs(handle, rank, min(rows, data.shape[0]))
        check_received(
            f, label, route, pairs, recv_x, recv_idx, recv_w, all_x, all_s, all_idx, all_w, num_list
        )
        rows_value = dequant(*recv_x) if fp8 else recv_x.float()
        expert_out = (rows_value.to(torch.bfloat16) * rank_factor(rank)).contiguous()
        combined_x, event = combine_forward(expert_out, handle, Buffer.capture())
        with event:
            pass  # the current stream waits for the combine when the block ends
        x_value = dequant(x, scales).to(torch.bfloat16) if fp8 else x
        want = expected_combined(route, x_value)
        # Zeros by value: a sum may give +0 where the row holds -0.
        f.same(f"{label} combine forward", combined_x.float(), want.float())

        # Backward: dispatch's is a combine (with the weights), combine's a cached dispatch.
        grad_x, grad_w, event = dispatch_backward(expert_out, recv_w * 2, handle)
        event.current_stream_wait()
        f.same(f"{label} dispatch backward x", grad_x.float(), want.float())
        f.same(
            f"{label} dispatch backward weights",
            grad_w,
            torch.where(topk_idx >= 0, topk_weights * 2, torch.zeros_like(topk_weights)),
        )
        grad_recv, event = combine_backward(grad_combined.to(dev), handle, Buffer.capture())
        event.current_stream_wait()
        if sorted(pairs) == sorted(route.pairs) and rows:
            f.same(
                f"{label} combine backward (cached dispatch)",
                grad_recv[:rows],
                torch.stack([all_grad[s][t] for s, t in pairs]),
            )

        # num_worst_tokens (intranode): no CPU wait, outputs padded to the worst case.
        worst = num_ranks * (96 + 8 * num_ranks)  # at least every token of every rank
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            idx_gpu, num_experts
        )
        recv_x, recv_idx, recv_w, num_list, handle, _ = buffer.dispatch(
            x_gpu,
            topk_idx=idx_gpu,
            topk_weights=w_gpu,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            num_worst_tokens=worst,
        )
        torch.cuda.synchronize()
        data = recv_x[0] if fp8 else recv_x
        f.check(
            data.shape[0] == worst and list(num_list) == [],
            f"{label} worst: {data.shape[0]} rows and counts {list(num_list)}, expected "
            f"{worst} and []",
        )
        pairs = received_pairs(handle, rank, rows)
        check_received(
            f,
            label + " worst",
            route,
            pairs,
            recv_x,
            recv_idx,
            recv_w,
            all_x,
            all_s,
            all_idx,
            all_w,
            None,
        )
        f.check(bool((recv_idx[rows:] == -1).all()), f"{label} worst: padding ids are not -1")
        rows_value = dequant(*recv_x) if fp8 else recv_x.float()
        expert_out = (rows_value.to(torch.bfloat16) * rank_factor(rank)).contiguous()
        combined_x, event = combine_forward(expert_out, handle)
        event.current_stream_wait()
        f.same(f"{label} worst combine", combined_x.float(), want.float())


def test_low_latency(f: Failures, group, rank: int, num_ranks: int, seed: int) -> None:
    el = EXPERTS_PER_RANK
    num_experts = el * num_ranks
    num_max_dispatch_tokens_per_rank = 128
    dev = current_device()
    for it, (hidden, use_fp8) in enumerate(((4096, False), (7168, True), (4096, True))):
        label = f"low latency #{it} hidden={hidden} fp8={use_fp8}"
        get_ll_buffer(group, num_max_dispatch_tokens_per_rank, 7168, num_experts)
        g = torch.Generator().manual_seed(seed * 1000 + 500 + it * 100 + rank)
        n = num_max_dispatch_tokens_per_rank - 5 * rank
        x, topk_idx, topk_weights = make_tokens(g, n, hidden, num_experts)
        all_x, all_idx = map(list, zip(*gather((x, topk_idx))))
        route = Routing(all_idx, rank, num_ranks, el)
        idx_gpu = topk_idx.to(dev)

        recv, recv_count, handle, _, hook = low_latency_dispatch(
            x.to(dev), idx_gpu, num_max_dispatch_tokens_per_rank, num_experts, use_fp8
        )
        hook()
        torch.cuda.synchronize()
        data, scales = recv if use_fp8 else (recv, None)
        counts = recv_count.cpu().tolist()
        f.check(counts == route.counts, f"{label}: recv_count {counts}, expected {route.counts}")
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        values = dequant(data, scales) if use_fp8 else data.float()
        for j in range(el):
            expert = rank * el + j
            covered = torch.zeros(max(counts[j], 1), dtype=torch.int32)
            for s in range(num_ranks):
                begin, cnt = int(layout_range[j, s]) >> 32, int(layout_range[j, s]) & 0xFFFFFFFF
                want_tokens = (all_idx[s] == expert).any(dim=1).nonzero().flatten().tolist()
                tokens = src_info[j, begin : begin + cnt].tolist()
                f.check(
                    sorted(tokens) == want_tokens,
                    f"{label}: expert {expert} got tokens {sorted(tokens)} from rank {s}, "
                    f"expected {want_tokens}",
                )
                if sorted(tokens) != want_tokens or begin + cnt > counts[j]:
                    continue
                covered[begin : begin + cnt] += 1
                got = values[j, begin : begin + cnt].cpu()
                want = all_x[s][tokens].float()
                if use_fp8:
                    scale = scales[j, begin : begin + cnt].float().cpu().repeat_interleave(128, 1)
                    err = (got - want).abs()
                    f.check(
                        bool((err <= want.abs() / 16 + scale / 256).all()),
                        f"{label}: expert {expert}, rows from rank {s}: fp8 error "
                        f"{float(err.max())} beyond e4m3's",
                    )
                else:
                    f.same(
                        f"{label} expert {expert} rows from rank {s}",
                        got.to(torch.bfloat16),
                        all_x[s][tokens],
                    )
            f.check(
                counts[j] == 0 or bool((covered[: counts[j]] == 1).all()),
                f"{label}: the source blocks of expert {expert} do not tile its rows",
            )

        # The experts: local expert j multiplies by 2 ** (j % 3); combine applies the weights.
        factors = torch.tensor([float(2 ** (j % 3)) for j in range(el)], device=dev)
        expert_out = values.to(torch.bfloat16) * factors.view(-1, 1, 1).to(torch.bfloat16)
        combined, _, hook = low_latency_combine(
            expert_out.contiguous(), idx_gpu, topk_weights.to(dev), handle
        )
        hook()
        torch.cuda.synchronize()
        valid = topk_idx >= 0
        fk = torch.where(valid, 2.0 ** ((topk_idx % el) % 3).float(), torch.zeros(1))
        want = x.float() * (topk_weights * fk).sum(dim=1, keepdim=True)
        got = combined.float().cpu()
        f.check(bool(torch.isfinite(got).all()), f"{label}: combine output not finite")
        diff = calc_diff(got, want)
        f.check(diff < (1e-3 if use_fp8 else 1e-5), f"{label}: combine calc_diff {diff:.3g}")
        if use_fp8:
            # Row by row too: one wrong token must not hide in the whole's average.
            g64, w64 = got.double(), want.double()
            denom = (g64 * g64 + w64 * w64).sum(dim=1)
            rows = 1 - 2 * (g64 * w64).sum(dim=1) / denom.clamp(min=1e-300)
            rows[denom == 0] = 0
            f.check(
                bool((rows < 5e-3).all()),
                f"{label}: combine row calc_diff {float(rows.max()):.3g} at row "
                f"{int(rows.argmax())}",
            )
        else:
            # Every term has the sign of x: one bf16 rounding of the sum, nothing cancels.
            err = (got - want).abs() / want.abs().clamp(min=1e-30)
            f.check(
                bool((err <= 2.0**-7).all()),
                f"{label}: combine relative error {float(err.max()):.3g} at "
                f"{(err == err.max()).nonzero()[0].tolist()}",
            )
        nowhere = ~valid.any(dim=1)
        f.check(bool((got[nowhere] == 0).all()), f"{label}: a token for no expert is not 0")


def init_dist() -> tuple[int, int, dist.ProcessGroup]:
    rank = int(os.environ["RANK"])
    num_ranks = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", num_ranks))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    backend = "nccl" if local_world <= gpus else "gloo"  # NCCL refuses ranks sharing a GPU
    dist.init_process_group(
        backend, rank=rank, world_size=num_ranks, timeout=timedelta(seconds=300)
    )
    return rank, num_ranks, dist.new_group(list(range(num_ranks)))


def main() -> int:
    rank, num_ranks, group = init_dist()
    seed = [int(os.environ.get("DEEP_EP_SCRIPT_SEED", "0")) or time.time_ns() % (1 << 31)]
    dist.broadcast_object_list(seed, src=0)
    backend = getattr(deep_ep, "BACKEND", "deep_ep")
    if rank == 0:
        print(
            f"deep_ep_script: {num_ranks} ranks, deep_ep backend {backend}, seed {seed[0]} "
            f"(DEEP_EP_SCRIPT_SEED={seed[0]} replays it)",
            flush=True,
        )
    f = Failures()
    t0 = time.time()
    for name, test in (("normal", test_normal), ("low latency", test_low_latency)):
        try:
            test(f, group, rank, num_ranks, seed[0])
        except Exception as e:  # noqa: BLE001 - a failure like any other
            f.items.append(f"{name}: raised {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    for msg in f.items[:10]:
        print(f"FAIL deep_ep_script [rank {rank}]: {msg}", flush=True)
    failed = [r for r, items in enumerate(gather(len(f.items))) if items]
    if rank == 0:
        if failed:
            print(f"FAIL deep_ep_script: mismatches on ranks {failed}", flush=True)
        else:
            print(f"PASS deep_ep_script ({num_ranks} ranks, {time.time() - t0:.1f} s)", flush=True)
    dist.barrier()
    global _buffer, _ll_buffer
    _buffer = _ll_buffer = None
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
