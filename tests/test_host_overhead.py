"""The host-overhead benchmark's timing helpers (benches/host_overhead.py), on
the CPU: what is timed, what runs untimed around it, and the statistics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import host_overhead  # noqa: E402


def test_only_the_call_is_timed_and_warmup_is_dropped():
    log = []
    clock = iter(range(0, 10_000, 10))

    def fake_ns():
        return next(clock)

    mp = pytest.MonkeyPatch()
    mp.setattr(host_overhead.time, "perf_counter_ns", fake_ns)
    try:
        samples = host_overhead.time_call(
            lambda: log.append("call"),
            iters=3,
            warmup=2,
            sync=lambda: log.append("sync"),
            before=lambda: log.append("before"),
            after=lambda: log.append("after"),
        )
    finally:
        mp.undo()
    # 5 rounds, each: before, sync, (timed call), after, sync; 3 samples kept.
    assert log == ["before", "sync", "call", "after", "sync"] * 5
    assert samples == [10, 10, 10]


def test_summary_is_in_microseconds_with_the_reference_ratio():
    s = host_overhead.summarize([1000, 2000, 3000, 4000, 100_000], reference_us=2.0)
    assert s["median_us"] == 3.0
    assert s["ratio"] == 1.5
    assert 1.0 <= s["p10_us"] <= s["median_us"] <= s["p90_us"] <= 100.0
    assert s["n"] == 5
    one = host_overhead.summarize([5000], None)
    assert one["median_us"] == one["p10_us"] == one["p90_us"] == 5.0
    assert "ratio" not in one


def test_profile_sees_only_the_call():
    """--profile: the partner calls and syncs run outside the profiler."""

    def profiled_work():
        return sum(range(100))

    def partner_work():
        return sorted(range(100))

    text = host_overhead.profile_call(
        profiled_work, 4, sync=lambda: None, before=partner_work, after=partner_work
    )
    (line,) = [ln for ln in text.splitlines() if "profiled_work" in ln]
    assert line.split()[0] == "4"  # ncalls: every profiled call, no more
    assert "partner_work" not in text


def test_breakdown_splits_native_alloc_and_the_rest():
    clock = iter(range(0, 100_000, 1))
    mp = pytest.MonkeyPatch()
    mp.setattr(host_overhead.time, "perf_counter_ns", lambda: next(clock) * 1000)
    try:
        attr = host_overhead.Attribution()

        class Native:
            def launch(self):
                return "launched"

            size = 3

        native = host_overhead.NativeProxy(Native(), attr)
        alloc = attr.timed("alloc", lambda: None)

        def call():
            assert native.launch() == "launched"
            assert native.size == 3  # attributes pass through untimed
            alloc()
            alloc()

        row = host_overhead.breakdown_call(call, iters=2, warmup=1, sync=lambda: None,
                                           attribution=attr)  # fmt: skip
    finally:
        mp.undo()
    # Each wrapped call reads the clock twice (1 us apart); the whole call spans
    # its own two reads around the three wrapped calls: 7 us in all.
    assert row["native_calls"] == 1 and row["allocs"] == 2
    assert row["native_us"] == 1.0 and row["alloc_us"] == 2.0
    assert row["total_us"] == 7.0 and row["python_us"] == 4.0


def test_rounds_interleave_the_calls_and_cancel_a_drift():
    """A host that slows down during the run: every sample costs `speed` times the
    call's work, `speed` rising each round. Timed one call after the other, the
    later call would look slower; interleaved, each round's ratio is exact."""
    state = {"now": 0, "speed": 1.0}
    work = {"ref": 10, "call": 30}
    order = []

    def fake_ns():
        return state["now"]

    def make(name):
        def fn():
            state["now"] += int(work[name] * state["speed"])

        return fn

    def barrier():
        state["speed"] += 0.5 if order and order[-1] == "call" else 0.0

    calls = {"ref": make("ref"), "call": make("call")}
    traced = {k: (lambda k=k, f=f: (order.append(k), f())) for k, f in calls.items()}
    mp = pytest.MonkeyPatch()
    mp.setattr(host_overhead.time, "perf_counter_ns", fake_ns)
    try:
        out = host_overhead.time_rounds(
            traced, iters=12, warmup=1, rounds=4, sync=lambda: None, barrier=barrier
        )
    finally:
        mp.undo()
    assert len(out["ref"]["samples"]) == len(out["call"]["samples"]) == 12
    assert out["ref"]["ratios"] == [1.0] * 4
    assert out["call"]["ratios"] == [3.0] * 4
    # Interleaved: ref's samples, then call's, in every round (after the warm-ups).
    assert order[:4] == ["ref"] * 4 and order[4:8] == ["call"] * 4 and order[8] == "ref"


def test_a_nested_timed_call_counts_once():
    a = host_overhead.Attribution()
    inner = a.timed("alloc", lambda: 1)
    outer = a.timed("alloc", lambda: inner() + 1)
    assert outer() == 2
    assert a.count["alloc"] == 1
