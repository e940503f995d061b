"""The Python side of the direct dispatch (``MOELINK_INTRANODE_RECV=direct``), on a
CPU Buffer whose stand-in native object has a receive pool: ``recv_x``'s range is
reserved before the send (the exact rows for a cached dispatch and
``num_worst_tokens``, else as many as can come), taken after it with the received
rows' bytes, and ``recv_x`` is that range; without a reservation (pool full, or a
CUDA graph being captured, which also drops a reservation left by a failed call)
``recv_x`` is an ordinary tensor. The GPU suites run the native side."""

from __future__ import annotations

import pytest
import torch
from moelink import _buffer_common

from tests.cpu_buffer import FakeNative, cpu_buffer

R, N, H, E, K = 4, 32, 256, 16, 4
BF16 = torch.bfloat16
ROWS = 5  # what the stand-in's wait_counts reports


class PoolNative(FakeNative):
    """A stand-in with a receive pool: every reservation succeeds unless ``full``;
    ``recv_pool_take`` hands out a fresh CPU byte tensor through DLPack."""

    def __init__(self, full: bool = False):
        super().__init__()
        self.full = full
        self.taken = []

    def recv_pool_reserve(self, hidden_bytes, num_scales, num_topk, rows=None):
        self.calls.append(("recv_pool_reserve", (hidden_bytes, num_scales, num_topk, rows)))
        return not self.full

    def recv_pool_take(self, nbytes):
        self.calls.append(("recv_pool_take", (nbytes,)))
        if nbytes == 0:
            return None
        t = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
        self.taken.append(t)
        return torch.utils.dlpack.to_dlpack(t)


def direct_buffer(monkeypatch, full=False):
    b = cpu_buffer(monkeypatch, R)
    b._native = PoolNative(full)
    b._recv_pool = True
    return b


def order(native):
    """The pool and send calls, in order."""
    keep = ("recv_pool_reserve", "recv_pool_take", "dispatch_send", "dispatch_recv")
    return [(n, a) for n, a in native.calls if n in keep]


def layout(buf):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, H, generator=g).to(BF16)
    idx = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
              num_tokens_per_expert=per_expert, topk_idx=idx)  # fmt: skip
    return x, kw


def names(calls):
    return [n for n, _ in calls]


def is_taken(native, t) -> bool:
    return any(t.data_ptr() == u.data_ptr() for u in native.taken)


def test_normal_dispatch_reserves_before_the_send_and_takes_the_rows(monkeypatch):
    buf = direct_buffer(monkeypatch)
    x, kw = layout(buf)
    recv_x, *_, handle, _ = buf.dispatch(x, **kw)
    calls = order(buf._native)
    assert names(calls) == ["recv_pool_reserve", "dispatch_send", "recv_pool_take",
                            "dispatch_recv"]  # fmt: skip
    assert calls[0][1] == (2 * H, 0, K, None), "as many rows as can come"
    assert calls[2][1] == (ROWS * H * 2,)
    assert (recv_x.dtype, tuple(recv_x.shape), recv_x.stride()) == (BF16, (ROWS, H), (H, 1))
    assert is_taken(buf._native, recv_x), "recv_x is the taken range"
    # num_worst_tokens: exactly that many rows.
    buf._native.calls.clear()
    recv_x = buf.dispatch(x, num_worst_tokens=64, **kw)[0]
    calls = order(buf._native)
    assert names(calls)[:3] == ["recv_pool_reserve", "dispatch_send", "recv_pool_take"]
    assert calls[0][1] == (2 * H, 0, K, 64) and calls[2][1] == (64 * H * 2,)
    assert tuple(recv_x.shape) == (64, H) and is_taken(buf._native, recv_x)
    # Cached: the handle's rows, no top-k in the records.
    buf._native.calls.clear()
    recv_x = buf.dispatch(x, handle=handle)[0]
    calls = order(buf._native)
    assert names(calls) == ["recv_pool_reserve", "dispatch_send", "recv_pool_take",
                            "dispatch_recv"]  # fmt: skip
    assert calls[0][1] == (2 * H, 0, 0, ROWS) and calls[2][1] == (ROWS * H * 2,)
    assert is_taken(buf._native, recv_x)


def test_a_full_pool_gives_an_ordinary_recv_x(monkeypatch):
    buf = direct_buffer(monkeypatch, full=True)
    x, kw = layout(buf)
    recv_x, *_, handle, _ = buf.dispatch(x, **kw)
    assert "recv_pool_take" not in names(order(buf._native))
    assert tuple(recv_x.shape) == (ROWS, H) and not buf._native.taken
    recv_x = buf.dispatch(x, handle=handle)[0]
    assert "recv_pool_take" not in names(order(buf._native))
    assert tuple(recv_x.shape) == (ROWS, H)


@pytest.mark.parametrize("cached", [False, True])
def test_graph_capture_reserves_nothing_and_drops_a_stale_reservation(monkeypatch, cached):
    buf = direct_buffer(monkeypatch)
    x, kw = layout(buf)
    handle = buf.dispatch(x, **kw)[4]
    buf._native.calls.clear()
    monkeypatch.setattr(_buffer_common, "_capturing", lambda: True)
    recv_x = (buf.dispatch(x, handle=handle) if cached else buf.dispatch(x, **kw))[0]
    calls = order(buf._native)
    assert "recv_pool_reserve" not in names(calls)
    # The drop comes before the send, so the send publishes no earlier range.
    assert calls[0] == ("recv_pool_take", (0,)) and calls[1][0] == "dispatch_send"
    assert not is_taken(buf._native, recv_x)


def test_without_a_pool_nothing_is_reserved(monkeypatch):
    buf = cpu_buffer(monkeypatch, R)
    x, kw = layout(buf)
    buf.dispatch(x, **kw)
    assert not [n for n, _ in buf._native.calls if n.startswith("recv_pool")]
