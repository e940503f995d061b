"""What the low-latency calls hand the native launches, on a CPU Buffer (the native
part a stand-in that records them): the plan object the call's checks made
(``_native.LlDispatchPlan`` / ``LlCombinePlan``, which ``EpBuffer.ll_dispatch`` /
``ll_combine`` read every size and flag from), the call's device addresses in one
tuple, and the phases."""

from __future__ import annotations

import pytest
import torch
from moelink import _native

from tests.cpu_buffer import cpu_buffer

R, T, H, E, K = 4, 16, 256, 16, 4
EL, RT = E // R, R * T
SEND, RECV, BOTH = 1, 2, 3
BF16 = torch.bfloat16


@pytest.fixture
def buf(monkeypatch):
    return cpu_buffer(monkeypatch, R)


def inputs(n=T, hidden=H):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=g).to(BF16)
    idx = torch.rand(n, E, generator=g).topk(K, dim=1).indices
    return x, idx, torch.rand(n, K, generator=g)


def ptrs(*tensors):
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def launches(buf):
    return [(name, a) for name, a in buf._ll.calls if name in ("ll_dispatch", "ll_combine")]


@pytest.mark.parametrize(
    "hidden, kw",
    [(H, {}), (2048, {"round_scale": True, "use_ue8m0": True}), (H, {"use_fp8": False})],
)
def test_ll_dispatch_takes_its_plan_and_addresses(buf, hidden, kw):
    x, idx, _ = inputs(hidden=hidden)
    count = torch.zeros(EL, dtype=torch.int32)
    wait = torch.zeros(R, dtype=torch.int64)
    recv, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, T, E, count, wait, return_recv_hook=True, **kw
    )
    hook()
    use_fp8 = kw.get("use_fp8", True)
    recv_x, scales = recv if use_fp8 else (recv, None)
    src_info, layout_range, *_ = handle
    (name, send), (name2, rcv) = launches(buf)
    assert (name, name2) == ("ll_dispatch", "ll_dispatch")
    plan = send[1]
    assert isinstance(plan, _native.LlDispatchPlan) and rcv[1] is plan
    assert (plan.max_tokens, plan.hidden, plan.num_experts) == (T, hidden, E)
    assert (plan.num_tokens, plan.num_topk, plan.use_fp8) == (T, K, use_fp8)
    want = ptrs(x, idx, recv_x, scales, recv_count, src_info, layout_range, count, wait)
    assert send == (11, plan, want, SEND) and rcv == (11, plan, want, RECV)
    with pytest.raises(AttributeError):
        plan.num_tokens = 0  # frozen: the cached plan cannot change


def test_ll_combine_takes_its_plan_and_addresses(buf):
    x, idx, w = inputs()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    src_info, layout_range, *_ = handle
    y = torch.zeros(EL, RT, H, dtype=BF16)
    stats = torch.zeros(R, dtype=torch.int64)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle, combine_wait_recv_cost_stats=stats)
    given = torch.empty(T, H, dtype=BF16)
    assert buf.low_latency_combine(y, idx, w, handle, out=given)[0] is given
    (_, d), (n1, first), (n2, second) = launches(buf)
    assert d[3] == BOTH and (n1, n2) == ("ll_combine", "ll_combine")
    plan = first[1]
    assert isinstance(plan, _native.LlCombinePlan) and second[1] is not plan  # another key
    assert (plan.max_tokens, plan.hidden, plan.num_experts, plan.num_tokens) == (T, H, E, T)
    assert first == (11, plan, ptrs(y, layout_range, idx, w, out, stats), BOTH)
    assert second[2] == ptrs(y, layout_range, idx, w, given, None)


def test_ll_zero_copy_combine_reads_the_plans_geometry(buf, monkeypatch):
    x, idx, w = inputs()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    zc = torch.zeros(EL, RT, H, dtype=BF16)
    seen = []

    def combine_buffer(ll, t, hidden, e, spec):
        seen.append((t, hidden, e, spec[0]))
        return zc

    monkeypatch.setattr(buf, "_combine_buffer", combine_buffer)
    out, _, _ = buf.low_latency_combine(None, idx, w, handle, zero_copy=True)
    assert seen == [(T, H, E, [EL, RT, H])]
    _, a = launches(buf)[-1]
    assert isinstance(a[1], _native.LlCombinePlan)
    assert a[2] == ptrs(zc, handle[1], idx, w, out, None)


def test_ll_calls_without_tokens_pass_no_token_addresses(buf):
    x, idx, w = inputs(n=0)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    (_, d) = launches(buf)[-1]
    assert d[1].num_tokens == 0
    assert d[2] == (0, 0, *ptrs(recv_x, None, count, *handle[:2]), 0, 0)
    y = torch.zeros(EL, RT, H, dtype=BF16)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    (_, c) = launches(buf)[-1]
    assert c[1].num_tokens == 0 and out.shape == (0, H)
    assert c[2] == (y.data_ptr(), handle[1].data_ptr(), 0, 0, 0, 0)
