"""A ``moelink.Buffer`` on the CPU for tests of its Python layer: made without a
process group or GPU, with a stand-in native object that records every launch
and checks nothing, so that what a call checks and allocates runs on CPU tensors
(the native plans, ``ep_core::calls``, take any device; this Buffer's is the CPU)."""

from __future__ import annotations

import torch
from moelink import _buffer_common, _native, buffer, low_latency
from moelink.buffer import Buffer


class FakeNative:
    """Records every launch as (method name, arguments); checks nothing. The
    arguments are the positional ones as passed (the plans of the normal-mode and
    low-latency calls are the real ``_native`` plan objects, which ``Buffer`` makes
    on any device, and their addresses come in tuples), then a dict of the keyword
    ones where there are any (``xnode`` ... across nodes)."""

    def __init__(self):
        self.calls = []

    def _record(self, name, a, kw):
        self.calls.append((name, a + (kw,) if kw else a))

    def __getattr__(self, name):
        if name in ("check_device", "check_device_timeout", "check_shape"):
            return lambda *a: None
        if name == "dispatch_send":
            return lambda *a, **kw: self._record(name, a, kw) or 7
        if name == "wait_counts":  # one received token per expert of the plan
            return lambda epoch, plan: (5, [1] * plan.num_experts)
        if name == "launch_sms":  # as a rank with a GPU of its own: no cap
            return lambda n: n
        return lambda *a, **kw: self._record(name, a, kw)


class FakeOrder:
    def __init__(self):
        self.log = []

    def after(self, waiter, signaler):
        self.log.append((waiter, signaler))


def cpu_buffer(monkeypatch, group_size: int) -> Buffer:
    """A Buffer of ``group_size`` ranks on the CPU (both parts stand-ins)."""
    monkeypatch.setattr(low_latency, "current_raw_stream", lambda i: 11)
    monkeypatch.setattr(buffer, "current_raw_stream", lambda i: 11)
    monkeypatch.setattr(_buffer_common, "_capturing", lambda: False)
    b = Buffer.__new__(Buffer)
    b._native, b._ll = FakeNative(), FakeNative()
    # The real bookkeeping; its one-call path declines a stand-in native part.
    b._ll_state = _native.LlCalls(b._ll, group_size, -1, lambda i: 11, buffer.EventOverlap)
    b._plans = _buffer_common.PlanCache()
    b.num_sms_used, b._launch_sms = {}, {}
    b._order = FakeOrder()
    b._comm_raw = 22
    b.device = torch.device("cpu")
    b.group_size = group_size
    b.enable_shrink = False
    return b
