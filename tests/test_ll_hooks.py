"""Receive hooks of the low-latency calls on a CPU Buffer (the native part a stand-in
that records launches): two calls may be in flight (a send while the previous call's
hook is pending: SGLang's two-batch overlap), a third is refused naming the pending
hooks, a call without a hook cannot overlap one, hooks run in call order, and
``clean_low_latency_buffer`` waits for none. The GPU side (both micro-batches exact):
``tests/multi_gpu/ll_worker.py`` scenario ``overlap`` and
``tests/multi_gpu/frameworks_worker.py`` scenario ``sglang_tbo``."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_buffer import cpu_buffer

R, H, E, K, T = 4, 256, 16, 4, 16
SEND, RECV, BOTH = 1, 2, 3


@pytest.fixture
def buf(monkeypatch):
    return cpu_buffer(monkeypatch, R)


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return x, idx, torch.rand(T, K, generator=g)


def launches(buf):
    """(kernel, phases) of every low-latency launch so far."""
    return [(name, a[-1]) for name, a in buf._ll.calls if name in ("ll_dispatch", "ll_combine")]


def dispatch(buf, hook=True, **kw):
    x, idx, _ = inputs()
    return buf.low_latency_dispatch(x, idx, T, E, use_fp8=False, return_recv_hook=hook, **kw)


def combine(buf, handle, hook=True):
    _, idx, w = inputs()
    y = torch.zeros(E // R, R * T, H, dtype=torch.bfloat16)
    return buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)


def test_sglang_two_batch_overlap_runs_in_order(buf):
    # A: dispatch (send, hook), combine send; B's dispatch send with A's combine
    # hook pending; then A's hook, B's hook, B's combine.
    _, _, ha, _, hook = dispatch(buf)
    hook()
    _, _, comb_a = combine(buf, ha)
    _, _, hb, _, disp_b = dispatch(buf)
    assert len(buf._ll_pending) == 2
    comb_a()
    disp_b()
    _, _, comb_b = combine(buf, hb)
    comb_b()
    assert buf._ll_pending == ()
    assert launches(buf) == [
        ("ll_dispatch", SEND), ("ll_dispatch", RECV), ("ll_combine", SEND),
        ("ll_dispatch", SEND), ("ll_combine", RECV), ("ll_dispatch", RECV),
        ("ll_combine", SEND), ("ll_combine", RECV),
    ]  # fmt: skip


def test_a_third_call_in_flight_is_refused_naming_the_hooks(buf):
    _, _, _, _, a = dispatch(buf)
    _, _, _, _, b = dispatch(buf)
    n = len(launches(buf))
    for hook in (True, False):
        with pytest.raises(RuntimeError, match="at most 2 low-latency calls") as e:
            dispatch(buf, hook=hook)
        assert a.name in str(e.value) and b.name in str(e.value) and "hook" in str(e.value)
    with pytest.raises(RuntimeError, match=a.name):
        combine(buf, _handle(buf))
    assert len(launches(buf)) == n  # nothing launched
    a()
    _, _, _, _, c = dispatch(buf)  # one in flight again: allowed
    b()
    c()


def _handle(buf):
    """A valid handle without a call (for a combine that must be refused first)."""
    return (
        torch.zeros(E // R, R * T, dtype=torch.int32),
        torch.zeros(E // R, R, dtype=torch.int64),
        T, H, E,
    )  # fmt: skip


def test_a_call_without_hook_cannot_overlap_a_pending_one(buf):
    _, _, handle, _, a = dispatch(buf)
    with pytest.raises(RuntimeError, match="receive hook of low-latency dispatch call #1"):
        dispatch(buf, hook=False)
    with pytest.raises(RuntimeError, match="return_recv_hook=True"):
        combine(buf, handle, hook=False)
    a()
    combine(buf, handle, hook=False)  # nothing pending: a whole call


def test_hooks_out_of_order_are_refused(buf):
    _, _, _, _, a = dispatch(buf)
    _, _, _, _, b = dispatch(buf)
    n = len(launches(buf))
    with pytest.raises(RuntimeError, match="call order") as e:
        b()
    assert a.name in str(e.value)
    assert len(launches(buf)) == n and not b.called
    a()
    b()
    with pytest.raises(RuntimeError, match="already called"):
        a()
    assert launches(buf)[-2:] == [("ll_dispatch", RECV), ("ll_dispatch", RECV)]


def test_clean_refuses_while_a_hook_is_pending(buf):
    _, _, _, _, a = dispatch(buf)
    with pytest.raises(RuntimeError, match="pending: call it first"):
        buf.clean_low_latency_buffer(T, H, E)
    a()


def test_hook_and_async_finish_still_exclusive(buf):
    with pytest.raises(ValueError, match="cannot both be True"):
        dispatch(buf, async_finish=True)
    assert buf._ll_pending == ()


def _recording(buf, kernel: str, result):
    """Makes ``buf._ll.<kernel>`` record the launch and return ``result(phases)``
    (what the native call hands back: a recorded device error, or None)."""
    fake = buf._ll

    def launch(*a):
        fake.calls.append((kernel, a))
        return result(a[-1])

    setattr(fake, kernel, launch)


def test_a_recorded_error_is_raised_after_the_hook_bookkeeping(buf):
    # The native launch returns what a kernel recorded (an expert id out of range)
    # once the receive half is launched: the hook is then done, not pending.
    _recording(buf, "ll_dispatch", lambda p: ValueError("expert id 99") if p != SEND else None)
    _, _, _, _, a = dispatch(buf)
    with pytest.raises(ValueError, match="expert id 99"):
        a()
    assert a.called and buf._ll_pending == ()
    with pytest.raises(ValueError, match="expert id 99"):
        dispatch(buf, hook=False)  # both halves: raised after the launch
    assert launches(buf)[-1] == ("ll_dispatch", BOTH) and buf._ll_pending == ()
    _, _, _, _, b = dispatch(buf)  # the next call starts normally
    assert buf._ll_pending == (b,)


def test_a_refused_hook_launch_leaves_the_hook_pending(buf):
    # A device wait that ran out: the native call raises before launching, and
    # the hook stays pending (the Buffer must be cleaned or recreated).
    _, _, _, _, a = dispatch(buf)

    def refuse(*a):
        raise TimeoutError("rank 0 timed out waiting for rank 1")

    buf._ll.ll_dispatch = refuse
    with pytest.raises(TimeoutError):
        a()
    assert not a.called and buf._ll_pending == (a,)


def test_the_one_call_path_declines_a_stand_in_without_side_effects(buf):
    # `_native.LlCalls.dispatch` / `combine` run an eager call whole only on a real
    # native part; with anything else they return None, having launched, counted
    # and kept nothing, and the Python path runs the call (and names its hooks).
    x, idx, w = inputs()
    state = buf._ll_state
    assert state.dispatch(x, idx, T, E, None, None, False, False, False, True) is None
    y = torch.zeros(E // R, R * T, H, dtype=torch.bfloat16)
    handle = (torch.zeros(E // R, R * T, dtype=torch.int32),
              torch.zeros(E // R, R, dtype=torch.int64), T, H, E)  # fmt: skip
    assert state.combine(y, idx, w, handle, False, False, True, None, None) is None
    assert launches(buf) == [] and buf._ll_pending == ()
    _, _, _, _, a = dispatch(buf)
    assert a.name == "low-latency dispatch call #1" and repr(a).endswith("pending>")
    a()
    assert repr(a).endswith("called>")


def test_a_buffer_dropped_with_a_hook_pending_frees_what_the_hook_kept(monkeypatch):
    # A pending hook and the Buffer's LlCalls refer to each other; the cycle
    # collector must free both, and the tensors the hook kept for its kernels.
    import gc
    import weakref

    b = cpu_buffer(monkeypatch, R)
    x, idx, _ = inputs()
    _, _, _, _, hook = b.low_latency_dispatch(x, idx, T, E, use_fp8=False, return_recv_hook=True)
    kept = weakref.ref(x)
    del x, hook, b
    gc.collect()
    assert kept() is None


def test_the_flags_are_read_by_their_truth_value(buf):
    # As the Python path always read them: 1 asks for a hook, and async_finish
    # with a hook is refused whatever the values' types.
    x, idx, _ = inputs()
    _, _, _, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False, return_recv_hook=1)
    assert buf._ll_pending == (hook,)
    hook()
    with pytest.raises(ValueError, match="cannot both be True"):
        buf.low_latency_dispatch(x, idx, T, E, async_finish=1, return_recv_hook=1)
