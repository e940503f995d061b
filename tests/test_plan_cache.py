"""The per-Buffer plan cache (``_buffer_common.PlanCache``) on the CPU: a Buffer
with a stand-in native object and CPU tensors. A repeated call skips its checks
and launches with the same arguments as a checked one; any argument that differs
from a cached call's (a dtype, a shape, a layout, a scalar's type, a tensor
subclass, an unhashable value) takes the checked path and raises there."""

from __future__ import annotations

import pytest
import torch
from moelink import _buffer_common, _native, checks

from tests.cpu_buffer import cpu_buffer

R, T, H, E, K = 4, 16, 256, 16, 4


@pytest.fixture
def buf(monkeypatch):
    return cpu_buffer(monkeypatch, R)


def ll_inputs(n=T):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, E, generator=g).topk(K, dim=1).indices
    return x, idx


def ll_dispatch(b, x, idx, **kw):
    return b.low_latency_dispatch(x, idx, T, E, **kw)


def test_a_repeated_low_latency_dispatch_launches_as_the_checked_one(buf, monkeypatch):
    x, idx = ll_inputs()
    ll_dispatch(buf, x, idx)
    checked = buf._ll.calls[-1][1]  # (stream, plan, addresses, phases)
    assert len(buf._plans.plans) == 1
    assert isinstance(checked[1], _native.LlDispatchPlan)
    # The second call skips the checks: make the native plan fail loudly.
    monkeypatch.setattr(_native, "ll_dispatch_plan", lambda *a, **k: pytest.fail("checked"))
    ll_dispatch(buf, x, idx)
    cached = buf._ll.calls[-1][1]
    # The same stream, plan object (every size and flag) and phases; the inputs'
    # addresses, the stats' (none) and new outputs.
    assert (cached[0], cached[3]) == (checked[0], checked[3])
    assert cached[1] is checked[1]
    assert cached[2][:2] == (x.data_ptr(), idx.data_ptr()) and cached[2][7:] == (0, 0)


def test_a_new_shape_takes_the_checked_path_and_launches_its_own_sizes(buf):
    x, idx = ll_inputs()
    ll_dispatch(buf, x, idx)
    x2, idx2 = ll_inputs(n=T // 2)
    ll_dispatch(buf, x2, idx2)
    assert buf._ll.calls[-1][1][1].num_tokens == T // 2
    assert len(buf._plans.plans) == 2


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda x, idx: (x.float(), idx, {}), checks.DtypeError, "x must have dtype"),
        (lambda x, idx: (x.t().contiguous().t(), idx, {}), ValueError, "contiguous"),
        (lambda x, idx: (x, idx.int(), {}), checks.DtypeError, "topk_idx"),
        (lambda x, idx: (x, idx, {"use_fp8": 1.0}), TypeError, "use_fp8"),
        (lambda x, idx: (x, idx, {"use_ue8m0": True}), ValueError, "use_ue8m0"),
        (lambda x, idx: (x, [idx], {}), TypeError, "topk_idx"),
        (lambda x, idx: (torch.nn.Parameter(x.float(), False), idx, {}), TypeError, "x must"),
    ],
)
def test_after_a_cached_call_wrong_arguments_still_raise(buf, change, exc, match):
    x, idx = ll_inputs()
    ll_dispatch(buf, x, idx)
    x2, idx2, kw = change(x, idx)
    with pytest.raises(exc, match=match):
        ll_dispatch(buf, x2, idx2, **kw)


def test_scalars_of_another_type_are_checked_not_matched(buf):
    x, idx = ll_inputs()
    ll_dispatch(buf, x, idx)
    # 16.0 == 16 and hash(16.0) == hash(16): only the key's types tell them apart.
    with pytest.raises(TypeError, match="num_max_dispatch_tokens_per_rank must be an int"):
        buf.low_latency_dispatch(x, idx, float(T), E)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        buf.low_latency_dispatch(x, idx, T, float(E))


def test_a_repeated_low_latency_combine_skips_checks_but_not_a_bad_handle(buf, monkeypatch):
    x, idx = ll_inputs()
    _, _, handle, _, _ = ll_dispatch(buf, x, idx)
    y = torch.randn(E // R, R * T, H).to(torch.bfloat16)
    w = torch.rand(T, K)
    buf.low_latency_combine(y, idx, w, handle)
    first = buf._ll.calls[-1][1]  # (stream, plan, addresses, phases)
    assert isinstance(first[1], _native.LlCombinePlan)
    buf.low_latency_combine(y, idx, w, handle)
    again = buf._ll.calls[-1][1]
    assert again[:2] == first[:2] and again[1] is first[1]  # the stream, the cached plan
    assert again[2][:4] == first[2][:4]  # x, layout_range, topk_idx, topk_weights
    with pytest.raises(TypeError, match="handle must be the 5-tuple"):
        buf.low_latency_combine(y, idx, w, handle[:4])
    bad = (handle[0].long(), *handle[1:])
    with pytest.raises(checks.DtypeError, match="src_info"):
        buf.low_latency_combine(y, idx, w, bad)
    with pytest.raises(checks.DtypeError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w.double(), handle)


def test_the_host_id_check_runs_on_cached_calls_when_on(buf):
    x, idx = ll_inputs()
    ll_dispatch(buf, x, idx)
    bad = idx.clone()
    bad[3, 1] = E  # out of range: only a value check sees it
    previous = _buffer_common.set_check_ids(True)
    try:
        with pytest.raises(ValueError, match="values must be in"):
            ll_dispatch(buf, x, bad)
    finally:
        _buffer_common.set_check_ids(previous)
    ll_dispatch(buf, x, bad)  # off again: the kernels report it


def intranode_inputs(n=32):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, E, generator=g).topk(K, dim=1).indices
    return x, idx


def full_dispatch_kwargs(buf, idx, **extra) -> dict:
    """A full dispatch's keyword arguments: ``buf``'s layout of ``idx``, and ``extra``."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return dict(
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, **extra,
    )  # fmt: skip


def test_layout_dispatch_and_combine_repeat_with_the_checked_arguments(buf, monkeypatch):
    x, idx = intranode_inputs()
    kw = full_dispatch_kwargs(buf, idx, topk_weights=torch.rand(x.shape[0], K))
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kw)
    buf.combine(recv_x, handle, topk_weights=recv_w)
    buf.dispatch(x, handle=handle)
    checked = [(name, a) for name, a in buf._native.calls]
    buf._native.calls.clear()
    for plan in ("layout_plan", "dispatch_plan", "combine_plan"):
        monkeypatch.setattr(_native, plan, lambda *a, **k: pytest.fail("checked"))
    buf.get_dispatch_layout(idx, E)
    recv_x2, _, recv_w2, _, handle2, _ = buf.dispatch(x, **kw)
    buf.combine(recv_x2, handle2, topk_weights=recv_w2)
    buf.dispatch(x, handle=handle2)
    cached = buf._native.calls

    def values(a):  # the plans, sizes and flags, not device addresses
        for v in a:
            if isinstance(v, tuple):  # a group of addresses
                yield from values(v)
            elif not (isinstance(v, int) and v > 1 << 20):
                yield v

    def launched(calls):
        return [(nm, tuple(values(a))) for nm, a in calls]

    assert [c[0] for c in cached] == [c[0] for c in checked]
    # The same plan objects (compared by identity): the checked calls made them.
    assert launched(cached) == launched(checked)
    plans = [a[1] for _, a in checked]
    assert len({id(p) for p in plans}) == 4  # layout, dispatch, combine, cached dispatch
    # Compute -> communication stream and back, once per call (4 calls).
    assert buf._order.log == [(22, 11), (11, 22)] * 8


def test_intranode_wrong_arguments_after_cached_calls_still_raise(buf):
    x, idx = intranode_inputs()
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **full_dispatch_kwargs(buf, idx))
    with pytest.raises(checks.DtypeError, match="topk_idx"):
        buf.get_dispatch_layout(idx.int(), E)
    with pytest.raises(TypeError, match="num_experts"):
        buf.get_dispatch_layout(idx, float(E))
    with pytest.raises(ValueError, match="tokens but the handle"):
        buf.dispatch(x[:8], handle=handle)
    with pytest.raises(ValueError, match="rows dispatch delivered"):
        buf.combine(recv_x[:1], handle)
    with pytest.raises(ValueError, match="handle must be the tuple a dispatch returned"):
        buf.combine(recv_x, handle[:5])
    with pytest.raises(ValueError, match="bias"):
        buf.combine(recv_x, handle, bias=(x, x, x))
    # A view at an odd offset: the pointer check runs on every call.
    buf.dispatch(x, handle=handle)
    odd = torch.empty(x.numel() + 8, dtype=torch.bfloat16)[1:].view(-1)[: x.numel()].view(x.shape)
    with pytest.raises(ValueError, match="byte boundary"):
        buf.dispatch(odd, handle=handle)


def test_the_cache_is_bounded_and_survives_unhashable_keys():
    c = _buffer_common.PlanCache(limit=2)
    c.put((1,), "a")
    c.put((2,), "b")
    c.put((3,), "c")  # full: cleared first
    assert c.plans == {(3,): "c"}
    assert c.get(([],)) is None
    c.put(([],), "x")
    assert c.plans == {(3,): "c"}
    assert checks.tensor_sig(None) is None
    assert checks.tensor_sig(torch.nn.Parameter(torch.zeros(1))) is checks._NO_SIG
