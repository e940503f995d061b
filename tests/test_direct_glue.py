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


# ----- get_combine_buffer --------------------------------------------------------


class CombinePoolNative(FakeNative):
    """A stand-in whose receive pool serves ``recv_pool_tensor`` unless ``full``."""

    def __init__(self, full: bool = False):
        super().__init__()
        self.full = full
        self.leased = []

    def recv_pool_tensor(self, nbytes):
        self.calls.append(("recv_pool_tensor", (nbytes,)))
        if self.full:
            return None
        t = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
        self.leased.append(t)
        return torch.utils.dlpack.to_dlpack(t)


def handle_of_rows(rows: int) -> tuple:
    """An intranode handle whose recv_src_idx has ``rows`` entries (what the call reads)."""
    src = torch.arange(rows, dtype=torch.int32)
    z = torch.zeros(1, dtype=torch.int32)
    return (z, z, z, src, z, z)


def combine_buffer(monkeypatch, pool: bool, full: bool = False):
    b = cpu_buffer(monkeypatch, R)
    b.rank = 2
    b._native = CombinePoolNative(full)
    b._recv_pool = pool
    return b


def test_combine_buffer_is_a_pool_range_with_a_receive_pool(monkeypatch):
    buf = combine_buffer(monkeypatch, pool=True)
    x = buf.get_combine_buffer(handle_of_rows(ROWS), H)
    assert (x.shape, x.dtype, x.device) == ((ROWS, H), BF16, torch.device("cpu"))
    assert buf._native.calls == [("recv_pool_tensor", (ROWS * H * 2,))]
    assert x.data_ptr() == buf._native.leased[0].data_ptr()
    # Writable in place, as an expert kernel's output would be.
    x.fill_(1.5)
    assert torch.all(buf._native.leased[0].view(BF16) == 1.5)


@pytest.mark.parametrize(
    "pool, full, capturing, rows",
    [(False, False, False, ROWS), (True, True, False, ROWS), (True, False, True, ROWS),
     (True, False, False, 0)],
)  # fmt: skip
def test_combine_buffer_is_an_ordinary_tensor_otherwise(monkeypatch, pool, full, capturing, rows):
    """No pool, a full pool, a CUDA graph being captured (no pool call then), or no rows."""
    buf = combine_buffer(monkeypatch, pool=pool, full=full)
    monkeypatch.setattr(_buffer_common, "_capturing", lambda: capturing)
    x = buf.get_combine_buffer(handle_of_rows(rows), H)
    assert (x.shape, x.dtype) == ((rows, H), BF16)
    assert not any(x.data_ptr() == t.data_ptr() for t in buf._native.leased)
    asked = pool and not capturing and rows > 0
    assert [n for n, _ in buf._native.calls] == (["recv_pool_tensor"] if asked else [])


@pytest.mark.parametrize(
    "handle, hidden, error, words",
    [
        ([torch.zeros(1)] * 6, H, TypeError, "handle must be the tuple"),
        ((torch.zeros(1),) * 5, H, ValueError, "handle has 5 entries"),
        (handle_of_rows(ROWS), 7.0, TypeError, "hidden must be an int"),
        (handle_of_rows(ROWS), True, TypeError, "hidden must be an int"),
        (handle_of_rows(ROWS), 100, ValueError, "hidden must be a positive multiple of 64"),
        (handle_of_rows(ROWS), -64, ValueError, "hidden must be a positive multiple of 64"),
        ((1, 2, 3, 4, 5, 6), H, TypeError, "handle[3] (recv_src_idx)"),
    ],
)
def test_combine_buffer_refuses_bad_arguments(monkeypatch, handle, hidden, error, words):
    buf = combine_buffer(monkeypatch, pool=True)
    with pytest.raises(error) as e:
        buf.get_combine_buffer(handle, hidden)
    assert words in str(e.value) and "rank 2" in str(e.value)
    assert buf._native.calls == []
