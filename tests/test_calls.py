"""The Buffer's argument checks and output shapes (``ep_core::calls``, bound as
``moelink._native.*_plan``) through the Python layer, on a CPU Buffer: each
wrong argument raises the documented exception (``TypeError``, ``DtypeError``,
``ValueError``) naming it, and every output has the shape, dtype and strides the
plan gives. The Rust unit tests in ``ep-core/src/calls.rs`` cover every check;
these cover the binding, the error mapping and what Python checks itself."""

from __future__ import annotations

import pytest
import torch
from moelink import DtypeError, _native

from tests.cpu_buffer import cpu_buffer

R, N, H, E, K, T = 4, 32, 256, 16, 4, 16
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
ROWS = 5  # what the stand-in's wait_counts reports


@pytest.fixture
def buf(monkeypatch):
    return cpu_buffer(monkeypatch, R)


def inputs(n=N):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, H, generator=g).to(BF16)
    idx = torch.rand(n, E, generator=g).topk(K, dim=1).indices
    return x, idx, torch.rand(n, K, generator=g)


def col_major_scales(n, h):
    """float32 [n, h/128] with column-major strides, as DeepGEMM-style quantisers give."""
    return torch.randn(h // 128, n).t()


@pytest.fixture
def layout(buf):
    _, idx, w = inputs()
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return dict(
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w,
    )  # fmt: skip


def described(t):
    return (t.dtype, tuple(t.shape), t.stride())


def test_dtype_errors_are_type_and_value_errors():
    assert issubclass(DtypeError, TypeError) and issubclass(DtypeError, ValueError)


# ----- layout ----------------------------------------------------------------------------


def test_layout_outputs(layout):
    assert described(layout["num_tokens_per_rank"]) == (torch.int32, (R,), (1,))
    assert described(layout["num_tokens_per_expert"]) == (torch.int32, (E,), (1,))
    assert described(layout["is_token_in_rank"]) == (torch.bool, (N, R), (R, 1))


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda idx: (idx.int(), E), DtypeError, r"topk_idx must have dtype torch\.int64"),
        (lambda idx: ([idx], E), TypeError, "topk_idx must be a torch.Tensor, got list"),
        (lambda idx: (idx, float(E)), TypeError, "num_experts must be an int, got float"),
        (lambda idx: (idx, E + 1), ValueError, "num_experts must be a multiple of num_ranks"),
        (lambda idx: (idx, 2**70), ValueError, "num_experts must be <= 32768"),
        (lambda idx: (idx[:, :1].expand(N, 2), E), ValueError, "topk_idx must be contiguous"),
        (
            lambda idx: (idx.to("meta"), E),
            ValueError,
            "topk_idx must be on this Buffer's device cpu, got a device that is neither",
        ),
    ],
)
def test_layout_refuses(buf, change, exc, match):
    _, idx, _ = inputs()
    with pytest.raises(exc, match=match):
        buf.get_dispatch_layout(*change(idx))


# ----- dispatch --------------------------------------------------------------------------


def test_dispatch_outputs(buf, layout):
    x, _, _ = inputs()
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, **layout)
    assert described(recv_x) == (BF16, (ROWS, H), (H, 1))
    assert described(recv_idx) == (torch.int64, (ROWS, K), (K, 1))
    assert described(recv_w) == (torch.float32, (ROWS, K), (K, 1))
    assert counts == [1] * E  # the stand-in counts one per expert
    rpm, cpm, rcpm, src_idx, in_rank, send_head = handle
    assert described(rpm) == (torch.int32, (R, R), (R, 1))
    assert described(cpm) == described(rcpm) == (torch.int32, (R, 1), (1, 1))
    assert not cpm.any() and not rcpm.any()
    assert described(src_idx) == (torch.int32, (ROWS,), (1,))
    assert in_rank is layout["is_token_in_rank"]
    assert described(send_head) == (torch.int32, (N, R), (R, 1))
    # num_worst_tokens: that many rows, no wait; no weights, no top-k.
    kw = dict(layout, topk_weights=None)
    recv_x, recv_idx, recv_w, counts, _, _ = buf.dispatch(x, num_worst_tokens=64, **kw)
    assert (recv_x.shape, recv_idx.shape, recv_w, counts) == ((64, H), (64, K), None, [])
    kw = dict(layout, topk_idx=None, topk_weights=None)
    assert buf.dispatch(x, **kw)[1:3] == (None, None)
    # Cached: the handle's rows.
    recv_x, *_ = buf.dispatch(x, handle=handle)
    assert described(recv_x) == (BF16, (ROWS, H), (H, 1))


@pytest.mark.parametrize(
    "scales, strides",
    [
        (torch.rand(N, 2), (2, 1)),  # row-major
        (col_major_scales(N, H), (1, ROWS)),  # column-major comes back column-major
        (torch.rand(N, 4)[:, ::2], (2, 1)),  # strided columns
        (torch.rand(1, 2).expand(N, 2), (2, 1)),  # broadcast rows
    ],
)
def test_fp8_dispatch_outputs(buf, layout, scales, strides):
    x8 = torch.zeros(N, H, dtype=FP8)
    (recv_x, recv_scales), *_, handle, _ = buf.dispatch((x8, scales), **layout)
    assert described(recv_x) == (FP8, (ROWS, H), (H, 1))
    assert described(recv_scales) == (torch.float32, (ROWS, 2), strides)
    send = [a for name, a in buf._native.calls if name == "dispatch_send"][-1]
    plan = send[1]
    assert isinstance(plan, _native.DispatchPlan)
    assert plan.scale_strides == scales.stride()  # the input's strides reach the kernels
    recv = [a for name, a in buf._native.calls if name == "dispatch_recv"][-1]
    assert recv[1] is plan
    assert recv[3] == (handle[0].data_ptr(), recv_x.data_ptr(), recv_scales.data_ptr())
    (_, cached_scales), *_ = buf.dispatch((x8, scales), handle=handle)
    assert described(cached_scales) == (torch.float32, (ROWS, 2), strides)


def ptrs(*tensors):
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def test_launches_take_the_plan_and_addresses_only(buf, layout):
    """Every size of a launch comes from its plan object (the one the call's checks
    made); the rest are the stream, num_sms and device addresses in tuples (0:
    absent). A cached dispatch passes no routing addresses, and no rows where the
    plan knows them."""
    x, _, _ = inputs()
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    rpm, _, _, src_idx, in_rank, send_head = handle
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    recv_x2 = buf.dispatch(x, handle=handle)[0]
    recv_x3 = buf.dispatch(x, num_worst_tokens=64, **layout)[0]
    calls = buf._native.calls
    assert [n for n, _ in calls] == ["layout", "dispatch_send", "dispatch_recv", "combine",
                                     "dispatch_send", "dispatch_recv", "dispatch_send",
                                     "dispatch_recv"]  # fmt: skip
    sms = buf.num_sms_used["dispatch"]
    lay, send, recv, comb, csend, crecv, wsend, wrecv = (a for _, a in calls)
    per_rank, per_expert = layout["num_tokens_per_rank"], layout["num_tokens_per_expert"]
    assert isinstance(lay[1], _native.LayoutPlan) and lay[1].num_experts == E
    assert lay[2] == layout["topk_idx"].data_ptr() and lay[4] == 0  # no tokens per node
    assert lay[3][:3] == ptrs(per_rank, per_expert, in_rank) and len(lay[3]) == 4
    plan = send[1]
    assert isinstance(plan, _native.DispatchPlan)
    assert (plan.num_tokens, plan.hidden_bytes, plan.num_scales, plan.scale_strides) == (
        N, 2 * H, 0, (0, 0))  # fmt: skip
    assert (plan.num_topk, plan.num_experts, plan.num_worst_tokens) == (K, E, 0)
    assert plan.num_recv_rows == _native.RECV_ROWS
    assert send == (
        22,
        plan,
        sms,
        ptrs(x, None, rpm, send_head),
        ptrs(layout["topk_idx"], layout["topk_weights"], in_rank, per_expert),
    )
    assert recv == (22, plan, sms, ptrs(rpm, recv_x, None), ptrs(recv_idx, recv_w, src_idx),
                    ROWS)  # the rows wait_counts gave  # fmt: skip
    assert isinstance(comb[1], _native.CombinePlan)
    assert comb[2] == buf.num_sms_used["combine"]
    assert comb[3] == ptrs(recv_x, recv_w, rpm, send_head, None, None, out, out_w)
    cplan = csend[1]
    assert isinstance(cplan, _native.DispatchPlan) and cplan is not plan
    assert (cplan.num_topk, cplan.num_experts, cplan.num_recv_rows) == (0, 0, ROWS)
    assert csend == (22, cplan, sms, ptrs(x, None, rpm, send_head))
    assert crecv == (22, cplan, sms, ptrs(rpm, recv_x2, None))
    wplan = wsend[1]
    assert (wplan.num_worst_tokens, wplan.num_recv_rows) == (64, 64)
    assert wrecv[1] is wplan and len(wrecv) == 6 and wrecv[5] is None  # the plan's rows
    assert wrecv[3][1] == recv_x3.data_ptr()


X_ERRORS = [
    ([torch.zeros(2, 128, dtype=BF16)], TypeError, "x must be a torch.Tensor or a .* tuple"),
    (None, TypeError, "got NoneType"),
    (torch.zeros(N, H), DtypeError, r"x must have dtype torch\.bfloat16, got torch\.float32"),
    (torch.zeros(N, H, dtype=FP8), DtypeError, r"x must have dtype torch\.bfloat16, got .*float8"),
    (torch.zeros(2, N, H, dtype=BF16), ValueError, "x must be 2-D, got 3-D"),
    (torch.zeros(H, N, dtype=BF16).t(), ValueError, "x must be contiguous"),
    (
        torch.zeros(N, 100, dtype=BF16),
        ValueError,
        r"x rows must be a positive multiple of 128 bytes up to 1048576, got hidden=100 of "
        r"torch\.bfloat16 \(200 bytes\)",
    ),
    (torch.zeros(N, 0, dtype=BF16), ValueError, "x rows must be a positive multiple of 128"),
    ((torch.zeros(N, H, dtype=FP8),) * 3, ValueError, "x must be a tensor or a .*pair, got a 3"),
    ((torch.zeros(N, H, dtype=FP8),), ValueError, "x must be a tensor or a .*pair, got a 1-tuple"),
    (
        (torch.zeros(N, H, dtype=BF16), torch.rand(N, 2)),
        DtypeError,
        r"x\[0\] must have dtype torch\.float8_e4m3fn, got torch\.bfloat16",
    ),
    ((torch.zeros(H, N, dtype=FP8).t(), torch.rand(N, 2)), ValueError, r"x\[0\] must be contig"),
    (
        (torch.zeros(N, 192, dtype=FP8), torch.rand(N, 1)),
        ValueError,
        r"x\[0\] rows must be a positive multiple of 128 bytes",
    ),
    (
        (torch.zeros(N, H, dtype=FP8), None),
        TypeError,
        r"x\[1\] \(scales\) must be a torch.Tensor, got NoneType",
    ),
    (
        (torch.zeros(N, H, dtype=FP8), torch.zeros(N, 2, dtype=torch.int32)),
        DtypeError,
        r"x\[1\] \(scales\) must have dtype torch\.float32",
    ),
    (
        (torch.zeros(N, H, dtype=FP8), torch.rand(N, 3)),
        ValueError,
        r"x\[1\] \(scales\) must have shape \[32, 2\], got \[32, 3\]",
    ),
    (
        (torch.zeros(N, H, dtype=FP8), col_major_scales(N, H).t()),
        ValueError,
        r"x\[1\] \(scales\) must have shape \[32, 2\], got \[2, 32\]",
    ),
    ((torch.zeros(N, H, dtype=FP8), torch.rand(N)), ValueError, r"x\[1\] \(scales\) must be 2-D"),
]


@pytest.mark.parametrize("x, exc, match", X_ERRORS)
def test_dispatch_refuses_x(buf, layout, x, exc, match):
    with pytest.raises(exc, match=match):
        buf.dispatch(x, **layout)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        ({"topk_idx": inputs()[1].int()}, DtypeError, r"topk_idx must have dtype torch\.int64"),
        ({"topk_idx": inputs(N - 1)[1]}, ValueError, r"topk_idx must have shape \[32, \*\]"),
        (
            {"topk_weights": torch.rand(N, K - 1)},
            ValueError,
            r"topk_weights must have shape \[32, 4\], got \[32, 3\]",
        ),
        (
            {"topk_weights": torch.rand(N, K).double()},
            DtypeError,
            r"topk_weights must have dtype torch\.float32",
        ),
        ({"topk_idx": None}, ValueError, "topk_weights needs topk_idx"),
        ({"topk_weights": [1.0]}, TypeError, "topk_weights must be a torch.Tensor, got list"),
        ({"num_tokens_per_rdma_rank": 0}, ValueError, "num_tokens_per_rdma_rank must be None"),
        ({"num_tokens_per_expert": None}, ValueError, "dispatch without a handle needs"),
        (
            {"num_tokens_per_expert": torch.zeros(E + 1, dtype=torch.int32)},
            ValueError,
            "num_experts must be a multiple of num_ranks, got num_experts=17",
        ),
        (
            {"num_tokens_per_rank": torch.zeros(R + 1, dtype=torch.int32)},
            ValueError,
            r"num_tokens_per_rank must have shape \[4\], got \[5\]",
        ),
        (
            {"is_token_in_rank": torch.zeros(N, R, dtype=torch.int32)},
            DtypeError,
            r"is_token_in_rank must have dtype torch\.bool",
        ),
        ({"expert_alignment": 0}, ValueError, "expert_alignment must be positive, got 0"),
        ({"expert_alignment": 1.0}, TypeError, "expert_alignment must be an int, got float"),
        ({"num_worst_tokens": -1}, ValueError, "num_worst_tokens must be >= 0, got -1"),
    ],
)
def test_dispatch_refuses(buf, layout, over, exc, match):
    x, _, _ = inputs()
    with pytest.raises(exc, match=match):
        buf.dispatch(x, **dict(layout, **over))


def test_cached_dispatch_refuses(buf, layout):
    x, idx, w = inputs()
    handle = buf.dispatch(x, **layout)[4]
    with pytest.raises(ValueError, match="takes no topk_idx / topk_weights"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="takes no topk_idx / topk_weights"):
        buf.dispatch(x, handle=handle, topk_weights=w)
    with pytest.raises(ValueError, match="x has 8 tokens but the handle was made for 32"):
        buf.dispatch(x[:8], handle=handle)
    with pytest.raises(ValueError, match="handle must be the tuple a dispatch returned"):
        buf.dispatch(x, handle=handle[:5])
    bad = (handle[0].long(), *handle[1:])
    with pytest.raises(DtypeError, match=r"handle\[0\] \(rank_prefix_matrix\) must have dtype"):
        buf.dispatch(x, handle=bad)
    bad = (*handle[:3], None, *handle[4:])
    with pytest.raises(TypeError, match=r"handle\[3\] \(recv_src_idx\) must be a torch.Tensor"):
        buf.dispatch(x, handle=bad)
    bad = (*handle[:5], handle[5][:, :2].contiguous())
    with pytest.raises(ValueError, match=r"handle\[5\] \(send_head\) must have 4 columns"):
        buf.dispatch(x, handle=bad)


# ----- combine ---------------------------------------------------------------------------


@pytest.fixture
def dispatched(buf, layout):
    x, _, _ = inputs()
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    return recv_x, recv_w, handle


def test_combine_outputs(buf, dispatched):
    recv_x, recv_w, handle = dispatched
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert described(out) == (BF16, (N, H), (H, 1))
    assert described(out_w) == (torch.float32, (N, K), (K, 1))
    b = torch.zeros(N, H, dtype=BF16)
    for bias in (b, (b, None), (None, b), (b, b), (None, None)):
        out, out_w, _ = buf.combine(recv_x, handle, bias=bias)
        assert out.shape == (N, H) and out_w is None


def launched_sms(native, name):
    """The num_sms argument of the stand-in's last ``name`` (combine) launch:
    its third positional argument, after the stream and the plan."""
    return [a for n, a in native.calls if n == name][-1][2]


def test_sms_default_per_rank_count_and_x_placement(buf, dispatched, monkeypatch):
    """Without a config a call takes the native default for the rank count; a
    combine whose x lies in the receive pool takes that case's smaller default; an
    explicit config is honoured; ``num_sms_used`` reports each (the stand-in's
    ``launch_sms`` caps nothing)."""
    from moelink import Config, buffer

    monkeypatch.setattr(buffer, "_DEFAULT_SMS", {})
    recv_x, _, handle = dispatched
    assert buf.num_sms_used == {"dispatch": _native.default_num_sms("dispatch", R)}
    buf.combine(recv_x, handle)
    want = _native.default_num_sms("combine", R)
    assert launched_sms(buf._native, "combine") == want
    assert buf.num_sms_used["combine"] == want
    # The same x inside this rank's receive pool (direct dispatch).
    buf._recv_pool = True
    buf._pool_range = (recv_x.data_ptr(), recv_x.data_ptr() + recv_x.nbytes)
    buf.combine(recv_x, handle)
    want = _native.default_num_sms("combine_in_pool", R)
    assert launched_sms(buf._native, "combine") == want == buf.num_sms_used["combine"]
    assert want < _native.default_num_sms("combine", R)
    buf.combine(recv_x, handle, config=Config(num_sms=10))
    assert launched_sms(buf._native, "combine") == 10 == buf.num_sms_used["combine"]
    # x outside the pool: the records' default again.
    buf.combine(recv_x.clone(), handle)
    assert buf.num_sms_used["combine"] == _native.default_num_sms("combine", R)


@pytest.mark.parametrize(
    "bias, exc, match",
    [
        ([None, None], TypeError, "bias must be None, a torch.Tensor or a tuple of two"),
        ((None,) * 3, ValueError, "bias must be None, a tensor or a pair, got a 3-tuple"),
        (torch.zeros(N, H), DtypeError, r"bias must have dtype torch\.bfloat16"),
        (torch.zeros(N + 1, H, dtype=BF16), ValueError, r"bias must have shape \[32, 256\]"),
        (
            (torch.zeros(N, H, dtype=BF16), torch.zeros(N, 2 * H, dtype=BF16)),
            ValueError,
            r"bias\[1\] must have shape \[32, 256\], got \[32, 512\]",
        ),
        (
            (torch.zeros(N, H, dtype=torch.float16), None),
            DtypeError,
            r"bias\[0\] must have dtype torch\.bfloat16",
        ),
        ((torch.zeros(H, N, dtype=BF16).t(), None), ValueError, r"bias\[0\] must be contiguous"),
        ((None, 0), TypeError, r"bias\[1\] must be a torch.Tensor, got int"),
    ],
)
def test_combine_refuses_bias(buf, dispatched, bias, exc, match):
    recv_x, _, handle = dispatched
    with pytest.raises(exc, match=match):
        buf.combine(recv_x, handle, bias=bias)


def test_combine_refuses(buf, dispatched):
    recv_x, recv_w, handle = dispatched
    with pytest.raises(ValueError, match="x must have the 5 rows dispatch delivered, got 4"):
        buf.combine(recv_x[:4], handle)
    with pytest.raises(DtypeError, match=r"x must have dtype torch\.bfloat16"):
        buf.combine(recv_x.float(), handle)
    with pytest.raises(ValueError, match="x rows must be a positive multiple of 128 bytes"):
        buf.combine(recv_x[:, :100].contiguous(), handle)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        buf.combine(None, handle)
    with pytest.raises(ValueError, match=r"topk_weights must be \[5, K\] with 1 <= K <= 32"):
        buf.combine(recv_x, handle, topk_weights=torch.rand(ROWS, 33))
    with pytest.raises(ValueError, match="handle must be the tuple a dispatch returned"):
        buf.combine(recv_x, None)


# ----- low latency -----------------------------------------------------------------------


def ll_inputs(hidden=H):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(T, hidden, generator=g).to(BF16)
    return x, torch.rand(T, E, generator=g).topk(K, dim=1).indices


@pytest.mark.parametrize(
    "hidden, kw, scales",
    [
        (H, {}, (torch.float32, (E // R, R * T, 2), (2 * R * T, 1, R * T))),
        (2048, {"round_scale": True, "use_ue8m0": True},
         (torch.int32, (E // R, R * T, 4), (4 * R * T, 1, R * T))),
        (H, {"use_fp8": False}, None),
    ],
)  # fmt: skip
def test_ll_dispatch_outputs(buf, hidden, kw, scales):
    x, idx = ll_inputs(hidden)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, **kw)
    recv_x, recv_scales = recv if scales is not None else (recv, None)
    el, rt = E // R, R * T
    dtype = BF16 if scales is None else FP8
    assert described(recv_x) == (dtype, (el, rt, hidden), (rt * hidden, hidden, 1))
    if scales is not None:
        assert described(recv_scales) == scales
    assert described(count) == (torch.int32, (el,), (1,))
    src_info, layout_range, t, h, e = handle
    assert described(src_info) == (torch.int32, (el, rt), (rt, 1))
    assert described(layout_range) == (torch.int64, (el, R), (R, 1))
    assert (t, h, e) == (T, hidden, E)
    out, _, _ = buf.low_latency_combine(torch.zeros(el, rt, hidden, dtype=BF16), idx,
                                        torch.rand(T, K), handle)  # fmt: skip
    assert described(out) == (BF16, (T, hidden), (hidden, 1))


@pytest.mark.parametrize(
    "args, kw, exc, match",
    [
        ((T, E), {"use_fp8": 1.0}, TypeError, "use_fp8 must be a bool"),
        ((T, E), {"use_ue8m0": True}, ValueError, "use_ue8m0=True needs round_scale=True"),
        ((T, E + 1), {}, ValueError, "num_experts must be a multiple of group size"),
        ((8, E), {}, ValueError, "x has 16 tokens, more than num_max_dispatch_tokens_per_rank=8"),
        ((0, E), {}, ValueError, "num_max_dispatch_tokens_per_rank must be positive, got 0"),
        (
            (T, E),
            {"cumulative_local_expert_recv_stats": torch.zeros(E, dtype=torch.int32)},
            ValueError,
            r"cumulative_local_expert_recv_stats must have shape \[4\], got \[16\]",
        ),
        (
            (T, E),
            {"dispatch_wait_recv_cost_stats": torch.zeros(R, dtype=torch.int32)},
            DtypeError,
            r"dispatch_wait_recv_cost_stats must have dtype torch\.int64",
        ),
    ],
)
def test_ll_dispatch_refuses(buf, args, kw, exc, match):
    x, idx = ll_inputs()
    with pytest.raises(exc, match=match):
        buf.low_latency_dispatch(x, idx, *args, **kw)


def test_ll_dispatch_refuses_x(buf):
    x, idx = ll_inputs(200)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128 up to 8192"):
        buf.low_latency_dispatch(x, idx, T, E)
    x, idx = ll_inputs()
    with pytest.raises(DtypeError, match=r"x must have dtype torch\.bfloat16, got torch\.float32"):
        buf.low_latency_dispatch(x.float(), idx, T, E)
    with pytest.raises(ValueError, match="x must be contiguous"):
        buf.low_latency_dispatch(x.t().contiguous().t(), idx, T, E)
    with pytest.raises(ValueError, match=r"topk_idx must have shape \[16, \*\], got \[3, 4\]"):
        buf.low_latency_dispatch(x, idx[:3], T, E)


def test_ll_combine_and_handle_refuse(buf):
    x, idx = ll_inputs()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y, w = torch.zeros(E // R, R * T, H, dtype=BF16), torch.rand(T, K)
    with pytest.raises(ValueError, match="use_logfmt=True is not supported"):
        buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
    with pytest.raises(ValueError, match=r"x must have shape \[4, 64, 256\], got \[4, 32, 256\]"):
        buf.low_latency_combine(y[:, :32].contiguous(), idx, w, handle)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        buf.low_latency_combine(None, idx, w, handle)
    with pytest.raises(ValueError, match="topk_idx has 17 tokens, more than"):
        buf.low_latency_combine(y, torch.zeros(T + 1, K, dtype=torch.int64), w, handle)
    with pytest.raises(DtypeError, match=r"out must have dtype torch\.bfloat16"):
        buf.low_latency_combine(y, idx, w, handle, out=torch.zeros(T, H))
    out = torch.zeros(T, H, dtype=BF16)
    assert buf.low_latency_combine(y, idx, w, handle, out=out)[0] is out
    with pytest.raises(TypeError, match="handle must be the 5-tuple"):
        buf.get_next_low_latency_combine_buffer(handle[:4])
    with pytest.raises(DtypeError, match=r"handle\[1\] \(layout_range\) must have dtype"):
        buf.get_next_low_latency_combine_buffer((handle[0], handle[0], *handle[2:]))
    with pytest.raises(TypeError, match="hidden must be an int, got float"):
        buf.get_next_low_latency_combine_buffer((*handle[:3], float(H), E))
    with pytest.raises(ValueError, match="num_experts must be a multiple of group size"):
        buf.clean_low_latency_buffer(T, H, E + 1)


def test_the_plans_encode_rows_and_devices_as_documented():
    assert (_native.RECV_ROWS, _native.CPU_DEVICE, _native.OTHER_DEVICE) == (-1, -1, -2)


# ----- the Buffer's constructor ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"num_nvl_bytes": -128}, ValueError, r"^num_nvl_bytes must be >= 0, got -128$"),
        ({"num_nvl_bytes": -(2**70)}, ValueError, r"^num_nvl_bytes must be >= 0, got -\d{22}$"),
        (
            {"num_rdma_bytes": 2**70, "low_latency_mode": True},
            ValueError,
            r"^num_rdma_bytes must be below 2\*\*63 bytes, got 1180591620717411303424$",
        ),
        ({"num_qps_per_rank": 0}, ValueError, r"^num_qps_per_rank must be positive, got 0$"),
        ({"num_qps_per_rank": 2.0}, TypeError, r"^num_qps_per_rank must be an int, got float$"),
        ({"num_nvl_bytes": 1.0}, TypeError, r"^num_nvl_bytes must be an int, got float$"),
        ({"num_nvl_bytes": 100}, ValueError, r"^num_nvl_bytes must be a multiple of 128, got 100$"),
        ({"enable_shrink": True}, ValueError, r"^enable_shrink=True needs low_latency_mode=True$"),
        (
            {"low_latency_mode": True},
            ValueError,
            r"^low_latency_mode=True needs num_rdma_bytes > 0",
        ),
        (
            {"num_rdma_bytes": 100},
            ValueError,
            r"^num_rdma_bytes must be a multiple of 128",
        ),
    ],
)
def test_buffer_arguments_are_refused_before_any_cuda_use(kwargs, exc, match):
    """The constructor's value checks are ``ep_core::calls::buffer_options`` (the Rust
    API's too); Python checks the types. Both run before CUDA is touched."""
    import moelink

    with pytest.raises(exc, match=match):
        moelink.Buffer(None, **kwargs)


def test_buffer_options_plan():
    # Low-latency mode with NVLink bytes: num_rdma_bytes sizes both the low-latency
    # part and the cross-node regions (one Buffer for both modes across nodes).
    plan = _native.buffer_options_plan(1 << 20, 1 << 30, True, 24, True)
    assert plan == {
        "num_nvl_bytes": 1 << 20,
        "num_ll_bytes": 1 << 30,
        "num_internode_bytes": 1 << 30,
    }
    plan = _native.buffer_options_plan(0, 1 << 30, True, 24, True)
    assert plan == {"num_nvl_bytes": 0, "num_ll_bytes": 1 << 30, "num_internode_bytes": 0}
    assert _native.buffer_options_plan(0, 0, False, 1, False) == {
        "num_nvl_bytes": 0,
        "num_ll_bytes": 0,
        "num_internode_bytes": 0,
    }
    # Outside low-latency mode num_rdma_bytes sizes the internode part.
    assert _native.buffer_options_plan(1 << 20, 1 << 24, False, 1, False) == {
        "num_nvl_bytes": 1 << 20,
        "num_ll_bytes": 0,
        "num_internode_bytes": 1 << 24,
    }
