"""moelink._streams on the CPU, with stand-in streams and tensors: what waits
for what, which tensors are recorded on the communication stream, and the
argument check of previous_event."""

from __future__ import annotations

import pytest
from moelink import _streams


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.log = []

    def wait_event(self, ev):
        self.log.append(("wait_event", ev))

    def wait_stream(self, other):
        self.log.append(("wait_stream", other.name))


class FakeTensor:
    def __init__(self, n):
        self.n = n
        self.recorded = []

    def numel(self):
        return self.n

    def record_stream(self, s):
        self.recorded.append(s.name)


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, s):
        self.recorded_on = s.name


class FakeOrder:
    """Stands in for ``_native.StreamOrder``: records (waiter, signaler)."""

    def __init__(self, log):
        self.log = log

    def after(self, waiter, signaler):
        self.log.append(("after", waiter, signaler))


def test_enter_comm_waits_for_the_event_else_for_the_compute_stream():
    from moelink.buffer import Buffer

    comm = FakeStream("comm")
    b = Buffer.__new__(Buffer)
    b._comm_stream, b._comm_raw, b._order = comm, 22, FakeOrder(comm.log)
    compute = 11  # the caller's raw stream
    b._enter_comm(compute, None)
    ev = _streams.EventOverlap("ev")
    b._enter_comm(compute, ev)
    b._enter_comm(compute, _streams.EventOverlap(None))
    assert comm.log == [
        ("after", 22, 11),
        ("wait_event", "ev"),
        ("after", 22, 11),
    ]


def test_finish_async_records_every_nonempty_tensor_and_keeps_them(monkeypatch):
    monkeypatch.setattr(_streams.torch.cuda, "Event", FakeEvent)
    comm = FakeStream("comm")
    a, empty, b = FakeTensor(4), FakeTensor(0), FakeTensor(1)
    out = _streams.finish_async(comm, (a, None, empty, b))
    assert isinstance(out, _streams.EventOverlap)
    assert out.event.recorded_on == "comm"
    assert out.extra_tensors == (a, empty, b)
    assert (a.recorded, empty.recorded, b.recorded) == (["comm"], [], ["comm"])


def test_previous_event_must_be_an_event_overlap():
    _streams.check_previous_event(None)
    _streams.check_previous_event(_streams.EventOverlap(None))
    with pytest.raises(TypeError, match="previous_event must be an EventOverlap, got str"):
        _streams.check_previous_event("event")


def test_the_package_exports_the_same_event_overlap():
    import moelink

    assert moelink.EventOverlap is _streams.EventOverlap


def test_current_raw_stream_uses_the_one_call_lookup_else_the_public_api(monkeypatch):
    calls = []
    monkeypatch.setattr(_streams, "_RAW_STREAM", lambda i: calls.append(("raw", i)) or 1234)
    assert _streams.current_raw_stream(3) == 1234

    class S:
        cuda_stream = 5678

    monkeypatch.setattr(_streams, "_RAW_STREAM", None)
    monkeypatch.setattr(
        _streams.torch.cuda, "current_stream", lambda i: calls.append(("api", i)) or S()
    )
    assert _streams.current_raw_stream(2) == 5678
    assert calls == [("raw", 3), ("api", 2)]


def test_low_latency_calls_take_the_raw_stream_unless_async(monkeypatch):
    """Without async_finish a low-latency call neither builds a Stream object nor
    switches streams; with it, the communication stream waits for the compute
    stream and the outputs are allocated there."""
    from types import SimpleNamespace

    from moelink import low_latency
    from moelink.buffer import Buffer

    monkeypatch.setattr(low_latency, "current_raw_stream", lambda i: 1000 + i)
    owner = Buffer.__new__(Buffer)
    owner.device = SimpleNamespace(index=3)
    owner._comm_stream = FakeStream("comm")
    owner._comm_raw = 77
    owner._order = FakeOrder(owner._comm_stream.log)
    stream, raw, alloc = owner._ll_stream(False)
    assert (stream, raw, alloc) == (None, 1003, _streams.NO_STREAM_SWITCH)
    assert owner._comm_stream.log == []

    # No Stream object for the compute stream: its raw handle is ordered.
    monkeypatch.setattr(
        low_latency.torch.cuda, "current_stream", lambda device=None: pytest.fail("Stream")
    )
    monkeypatch.setattr(low_latency.torch.cuda, "stream", lambda s: ("switch to", s.name))
    stream, raw, alloc = owner._ll_stream(True)
    assert (stream, raw, alloc) == (owner._comm_stream, 77, ("switch to", "comm"))
    assert owner._comm_stream.log == [("after", 77, 1003)]


def test_event_handle_records_where_it_is_made_and_waits_later(monkeypatch):
    """deep_ep.EventHandle: recorded at construction (on the given or current
    stream); current_stream_wait() makes the stream current then wait for it."""
    monkeypatch.setattr(_streams.torch.cuda, "Event", FakeEvent)
    current = [FakeStream("compute")]
    monkeypatch.setattr(_streams.torch.cuda, "current_stream", lambda: current[0])
    h = _streams.EventHandle()
    assert h.event.recorded_on == "compute"
    side = FakeStream("side")
    assert _streams.EventHandle(side).event.recorded_on == "side"
    current[0] = FakeStream("later")
    h.current_stream_wait()
    assert current[0].log == [("wait_event", h.event)]


def test_event_handle_goes_where_an_event_goes(monkeypatch):
    """Megatron passes ``EventOverlap(EventHandle())`` as ``previous_event``, and
    the Buffer (and ``EventOverlap.current_stream_wait``) hand its ``.event`` to
    ``Stream.wait_event``, which calls ``event.wait(stream)``: an EventHandle
    must answer that (and the other Event methods) through its event."""
    import torch

    class Event(FakeEvent):
        def __init__(self):
            super().__init__()
            self.log = []

        def wait(self, stream=None):
            self.log.append(("wait", getattr(stream, "name", stream)))

        def query(self):
            return True

        def synchronize(self):
            self.log.append(("synchronize",))

    monkeypatch.setattr(_streams.torch.cuda, "Event", Event)
    monkeypatch.setattr(_streams.torch.cuda, "current_stream", lambda: FakeStream("compute"))
    h = _streams.EventHandle()
    comm = FakeStream("comm")
    torch.cuda.Stream.wait_event(comm, h)  # what Buffer._enter_comm does with it
    assert h.event.log == [("wait", "comm")]
    assert h.query() is True
    h.synchronize()
    h.record(FakeStream("side"))
    assert h.event.recorded_on == "side" and h.event.log[-1] == ("synchronize",)
