"""``Buffer.combine`` and ``Buffer.dispatch`` hand an eager call to its one native call
(``_native.NormalCalls``, ep-core's engine) and takes the checked Python path
where that declines or cannot apply, on a CPU Buffer with a stand-in for the
native call (the engine itself runs on a GPU: tests/multi_gpu's ``combine``
scenarios)."""

from __future__ import annotations

import pytest
import torch
from moelink import Config

from tests.cpu_buffer import cpu_buffer

R, N, H, E, K = 4, 32, 256, 16, 4


class FakeCalls:
    """Records each one-call combine and cached dispatch; returns ``answer``
    (None: declines)."""

    def __init__(self, answer=None):
        self.answer, self.seen = answer, []

    def combine(self, *args):
        self.seen.append(("combine", *args))
        return self.answer

    def layout(self, *args):
        self.seen.append(("layout", *args))
        return self.answer

    def dispatch(self, *args):
        # named as the engine call it makes: a handle (args[1]) makes it cached
        self.seen.append(("dispatch" if args[1] is None else "cached_dispatch", *args))
        return self.answer


@pytest.fixture
def buf(monkeypatch):
    return cpu_buffer(monkeypatch, R)


def dispatched(buf):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(N, K, generator=g)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)  # fmt: skip


def test_an_eager_combine_is_one_native_call(buf):
    recv_x, _, recv_w, _, handle, _ = dispatched(buf)
    answer = (object(), None, object())
    buf._calls = FakeCalls(answer)
    launches = len(buf._native.calls)
    bias = torch.zeros(N, H, dtype=torch.bfloat16)
    assert buf.combine(recv_x, handle, topk_weights=recv_w, bias=bias) is answer
    ((name, *args),) = buf._calls.seen
    assert name == "combine"
    assert args[0] is recv_x and args[1] is handle and args[2] is recv_w and args[3] is bias
    # The SMs the default combine config gives, recorded for num_sms_used.
    assert args[4] == buf.num_sms_used["combine"] == type(buf).get_combine_config(R).num_sms
    assert len(buf._native.calls) == launches  # nothing launched besides


def test_a_config_sets_the_one_calls_sms(buf):
    recv_x, _, _, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls((1, 2, 3))
    buf.combine(recv_x, handle, config=Config(6, 8, 256, 8, 128))
    assert buf._calls.seen[0][5] == 6


def test_a_declined_call_takes_the_checked_path(buf):
    recv_x, _, recv_w, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls(None)
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert len(buf._calls.seen) == 1
    assert buf._native.calls[-1][0] == "combine"
    assert out.shape == (N, H) and out_w.shape == (N, K)


@pytest.mark.parametrize(
    "kw",
    [{"async_finish": True}, {"allocate_on_comm_stream": True, "async_finish": True}],
    ids=["async_finish", "allocate_on_comm_stream"],
)
def test_calls_with_stream_arguments_take_the_checked_path(buf, kw, monkeypatch):
    from moelink import buffer as buffer_mod

    monkeypatch.setattr(buffer_mod, "finish_async", lambda stream, tensors: "event")
    recv_x, _, _, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls((1, 2, 3))
    monkeypatch.setattr(buf, "_comm_stream", None, raising=False)
    monkeypatch.setattr(buf, "_alloc_ctx", lambda on_comm: buffer_mod.NO_STREAM_SWITCH)
    monkeypatch.setattr(buf, "_epilogue", lambda *a: "event")
    prev = buffer_mod.EventOverlap(None) if kw.get("allocate_on_comm_stream") else None
    buf.combine(recv_x, handle, previous_event=prev, **kw)
    assert buf._calls.seen == []


def test_a_non_tensor_x_takes_the_checked_path_and_its_error(buf):
    _, _, _, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls((1, 2, 3))
    with pytest.raises(TypeError, match="x"):
        buf.combine([1, 2], handle)
    assert buf._calls.seen == []


def test_an_eager_cached_dispatch_is_one_native_call(buf):
    recv_x, _, _, _, handle, _ = dispatched(buf)
    x = torch.randn(N, H).to(torch.bfloat16)
    answer = (object(), None, None, None, None, object())
    buf._calls = FakeCalls(answer)
    launches = len(buf._native.calls)
    assert buf.dispatch(x, handle=handle) is answer
    ((name, *args),) = buf._calls.seen
    assert name == "cached_dispatch" and args[0] is x and args[1] is handle
    assert args[2:8] == [None] * 6 and args[8:10] == [1, 0]
    assert args[10] == buf.num_sms_used["dispatch"] == type(buf).get_dispatch_config(R).num_sms
    assert len(buf._native.calls) == launches


def test_a_declined_dispatch_takes_the_checked_path(buf):
    _, _, _, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls(None)
    x = torch.randn(N, H).to(torch.bfloat16)
    recv_x = buf.dispatch(x, handle=handle)[0]
    assert [n for n, *_ in buf._calls.seen] == ["cached_dispatch"]
    assert buf._native.calls[-1][0] == "dispatch_recv" and recv_x.shape[1] == H
    recv_x, recv_idx, _, counts, handle, _ = dispatched(buf)
    assert [n for n, *_ in buf._calls.seen] == ["cached_dispatch", "layout", "dispatch"]
    assert recv_x.shape == (5, H) and recv_idx.shape == (5, K) and len(handle) == 6


def test_an_eager_full_dispatch_is_one_native_call(buf):
    answer = (object(), None, None, [], (), object())
    g = torch.Generator().manual_seed(5)
    idx = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    buf._calls = FakeCalls(answer)
    x = torch.randn(N, H).to(torch.bfloat16)
    got = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, num_worst_tokens=64,
    )  # fmt: skip
    assert got is answer
    ((name, *args),) = buf._calls.seen
    assert name == "dispatch" and args[0] is x and args[1] is None and args[2] is per_rank
    assert args[3] is None and args[4] is in_rank and args[5] is per_expert
    assert args[6] is idx and args[7] is None and args[8:10] == [1, 64]
    assert args[10] == buf.num_sms_used["dispatch"]


def test_a_full_dispatch_with_host_id_checks_takes_the_checked_path(buf):
    from moelink import _buffer_common

    previous = _buffer_common.set_check_ids(True)
    try:
        buf._calls = FakeCalls((1, 2, 3, 4, 5, 6))
        dispatched(buf)
    finally:
        _buffer_common.set_check_ids(previous)
    assert buf._calls.seen == []


def test_a_cached_dispatch_with_the_receive_pool_takes_the_checked_path(buf, monkeypatch):
    _, _, _, _, handle, _ = dispatched(buf)
    buf._calls = FakeCalls((1, 2, 3, 4, 5, 6))
    monkeypatch.setattr(buf, "_recv_pool", True, raising=False)
    monkeypatch.setattr(buf, "_reserve_recv_x", lambda plan: False)
    buf.dispatch(torch.randn(N, H).to(torch.bfloat16), handle=handle)
    assert buf._calls.seen == []


def test_an_eager_layout_is_one_native_call(buf):
    idx = torch.randint(-1, E, (N, K))
    buf._calls = FakeCalls((1, None, 2, 3, 4))
    assert buf.get_dispatch_layout(idx, E) == (1, None, 2, 3, 4)
    assert buf._calls.seen == [("layout", idx, E)]
    buf._calls = FakeCalls(None)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert [n for n, *_ in buf._calls.seen] == ["layout"]
    assert per_rank.shape == (R,) and in_rank.shape == (N, R)
