"""The trace summary of benches/gpu_trace.py (the internode stall's copy-engine question),
on synthetic Chrome traces, on the CPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))

import gpu_trace  # noqa: E402


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_the_longest_copy_names_the_kernels_that_ran_during_it():
    trace = {
        "traceEvents": [
            _x("kernel", "internode_dispatch", 100.0, 8000.0),
            _x("kernel", "dispatch_fused", 9000.0, 50.0),
            _x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 200.0, 10.0, bytes=1024, stream=7),
            _x(
                "gpu_memcpy",
                "Memcpy PtoP (Device -> Device)",
                300.0,
                7990.0,
                bytes=115000,
                stream=7,
            ),
            {"ph": "i", "cat": "gpu_memcpy", "name": "marker", "ts": 1.0},
            _x("cpu_op", "aten::empty", 0.0, 5.0),
        ]
    }
    lines = gpu_trace.trace_summary(trace, longest=1)
    text = "\n".join(lines)
    # Per name: copies (2, 8000 us in all, 7990 the longest) before kernels.
    copy_line = next(line for line in lines if line.strip().startswith("Memcpy PtoP"))
    assert copy_line.split()[-3:] == ["2", "8000.0", "7990.0"]
    assert text.index("Memcpy PtoP") < text.index("internode_dispatch")
    # The longest copy: from 200 us after the first GPU activity (the kernel at
    # 100), overlapping the first kernel only; CPU ops and instants are ignored.
    longest = lines[-1]
    assert "7990.0 us from 200.0 us, 115000 bytes, stream 7" in longest
    assert longest.endswith("kernels during it: internode_dispatch")
    assert "aten::empty" not in text


def test_an_empty_trace_says_so():
    assert gpu_trace.trace_summary({"traceEvents": []}) == ["trace: no GPU activity recorded"]
