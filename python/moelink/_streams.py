"""Stream handling that the Buffer's normal, cached and low-latency paths share:
the event a call returns, the caller's raw stream, and the bookkeeping of an
asynchronous finish. (Moving work onto the communication stream is
``Buffer._enter_comm``, through ``_native.StreamOrder``.)"""

from __future__ import annotations

import contextlib

import torch

#: torch's one-call lookup of a device's current raw stream (what its own
#: compiled kernels use); the public API builds a Stream object first.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: A reusable no-op context (allocation on the current stream).
NO_STREAM_SWITCH = contextlib.nullcontext()


def current_raw_stream(device_index: int) -> int:
    """The ``cudaStream_t`` of device ``device_index``'s current stream."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class EventOverlap:
    """A CUDA event plus the tensors that must stay alive until it completes.

    ``current_stream_wait()`` makes the current stream wait for the event; used as a
    context manager (``with event:``) it does that on exit. ``event=None`` (what a
    call with ``async_finish=False`` returns) waits for nothing.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors=None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()


class EventHandle:
    """An event recorded when it is made, on ``stream`` or the current stream
    (``deep_ep.EventHandle``); ``current_stream_wait()`` makes the then current
    stream wait for it."""

    def __init__(self, stream=None) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    # A torch.cuda.Event's methods, so that an EventHandle goes wherever an event
    # does: Megatron passes ``EventOverlap(EventHandle())`` as ``previous_event``,
    # and ``Stream.wait_event(e)`` calls ``e.wait(stream)``.
    def wait(self, stream=None) -> None:
        self.event.wait(stream)

    def record(self, stream=None) -> None:
        self.event.record(stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def check_previous_event(previous_event) -> None:
    """``TypeError`` unless ``previous_event`` is None or an ``EventOverlap``."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(
            f"previous_event must be an EventOverlap, got {type(previous_event).__name__}"
        )


def finish_async(stream, tensors) -> EventOverlap:
    """The end of an ``async_finish=True`` call whose kernels run on ``stream``:
    every tensor (None skipped) is marked as used there, so the caching allocator
    does not hand its memory out before they finish, and the returned event,
    recorded on ``stream``, keeps them alive."""
    kept = tuple(t for t in tensors if t is not None)
    for t in kept:
        if t.numel() > 0:
            t.record_stream(stream)
    ev = torch.cuda.Event()
    ev.record(stream)
    return EventOverlap(ev, kept)
