"""The Buffer's calls run past torch's function modes (``plain_torch``), on a CPU
Buffer: under a mode (``torch.set_default_device``, which DeepEP's tests call, or
any ``TorchFunctionMode``) torch sends every tensor attribute a call reads through
the mode's Python code, about ten times their cost. A call must make no torch
call the mode sees, give the outputs it gives without the mode (on the Buffer's
device, whatever the default device), and leave the mode on for the caller."""

from __future__ import annotations

import pytest
import torch
from moelink._buffer_common import plain_torch
from torch.overrides import TorchFunctionMode

from tests.cpu_buffer import cpu_buffer

R, N, H, E, K, T = 4, 32, 256, 16, 4, 16


class Counting(TorchFunctionMode):
    """Counts what torch sends through it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def inputs(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, E, generator=g).topk(K, dim=1).indices
    return x, idx, torch.rand(n, K, generator=g)


def every_call(buf):
    """Each of the Buffer's calls once (normal mode, then low latency); returns
    every tensor they gave, in order."""
    x, idx, w = inputs(N)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)  # fmt: skip
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **kw)
    cached = buf.dispatch(x, handle=handle)[0]
    out, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    staged = buf.get_combine_buffer(handle, H)
    lx, lidx, lw = inputs(T)
    ll_x, count, ll_handle, _, _ = buf.low_latency_dispatch(lx, lidx, T, E, use_fp8=False)
    y = torch.randn(*ll_x.shape).to(torch.bfloat16)
    ll_out, _, _ = buf.low_latency_combine(y, lidx, lw, ll_handle)
    return [per_rank, per_expert, in_rank, recv_x, recv_idx, recv_w, *handle, cached, out,
            staged, ll_x, count, *ll_handle[:2], ll_out]  # fmt: skip


def described(tensors):
    return [(t.dtype, tuple(t.shape), t.stride(), t.device) for t in tensors]


def test_calls_make_no_torch_call_a_mode_sees(monkeypatch):
    plain = described(every_call(cpu_buffer(monkeypatch, R)))
    buf = cpu_buffer(monkeypatch, R)
    mode = Counting()
    with mode:
        x, idx, w = inputs(N)
        mode.seen.clear()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        assert mode.seen == [], "get_dispatch_layout"
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
        )  # fmt: skip
        assert mode.seen == [], "dispatch"
        buf.combine(recv_x, handle, topk_weights=recv_w)
        assert mode.seen == [], "combine"
        # And the mode is on again for the caller.
        torch.zeros(1)
        assert mode.seen == ["zeros"]
    assert described(every_call(cpu_buffer(monkeypatch, R))) == plain


def test_every_call_under_a_mode_as_without(monkeypatch):
    plain = described(every_call(cpu_buffer(monkeypatch, R)))
    buf = cpu_buffer(monkeypatch, R)
    mode = Counting()
    with mode:
        mode.seen.clear()
        under = every_call(buf)
        ours = [n for n in mode.seen if n not in ("randn", "rand", "topk", "to", "__get__")]
    # Only the test's own inputs went through the mode.
    assert ours == [], ours
    assert described(under) == plain


def test_outputs_stay_on_the_buffers_device_whatever_the_default():
    """``torch.device("meta")`` as a context is the mode ``set_default_device``
    installs: the CPU Buffer's outputs stay on the CPU."""
    mp = pytest.MonkeyPatch()
    try:
        buf = cpu_buffer(mp, R)
        x, idx, w = inputs(N)
        with torch.device("meta"):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv_x, *_, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
            )  # fmt: skip
            assert torch.empty(1).device.type == "meta"
        for t in (per_rank, per_expert, in_rank, recv_x, *handle):
            assert t.device.type == "cpu"
    finally:
        mp.undo()


def test_plain_torch_passes_results_and_errors_through():
    @plain_torch
    def f(a, b=1):
        if a < 0:
            raise ValueError("a")
        return torch.zeros(a + b).device

    with torch.device("meta"):
        assert f(1, b=2).type == "cpu"
        with pytest.raises(ValueError, match="a"):
            f(-1)
        assert torch.zeros(1).device.type == "meta"
    assert f.__name__ == "f"
