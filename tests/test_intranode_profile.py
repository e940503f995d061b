"""The intranode profile's reading of the fused kernels' phase stamps
(benches/intranode_profile.py, stamp_lines), on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import intranode_profile as ip  # noqa: E402


def _stamps(blocks: dict) -> list:
    """A stamp buffer with `blocks[(kind, block)] = [start, first, loop, end]` (ns)."""
    v = [0] * (len(ip.PROF_KINDS) * ip.PROF_BLOCKS * ip.PROF_SLOTS)
    for (kind, b), slots in blocks.items():
        base = (kind * ip.PROF_BLOCKS + b) * ip.PROF_SLOTS
        v[base : base + ip.PROF_SLOTS] = slots
    return v


def test_phases_are_measured_from_each_blocks_start():
    t = 10_000_000_000
    stamps = _stamps(
        {
            (0, 0): [t, t + 2_000, t + 100_000, t + 101_000],
            (0, 1): [t + 1_000, t + 5_000, t + 201_000, t + 202_000],
            (1, 0): [t + 3_000, t + 13_000, t + 303_000, t + 304_000],
        }
    )
    text = " ".join(" ".join(ip.stamp_lines(stamps)).split())  # spacing aside
    assert "dispatch senders: 2 blocks" in text
    assert "dispatch receivers: 1 blocks" in text
    assert "combine" not in text  # no stamps of that kind
    # Sending launch: block end 101 / 201 us from the starts -> median 151, max 201.
    assert "warp 0 past its first row 3.0 / 4.0 us (2 blocks)" in text
    assert "block end 151.0 / 201.0 us" in text
    assert "span (first start, last end) 202.0 us" in text
    assert "start skew 1.0 us" in text
    assert "block end 301.0 / 301.0 us" in text  # the receiver
    assert "start 3.0 us after the senders, end 102.0 us after them" in text


def test_stale_blocks_of_older_launches_are_left_out():
    t = 10_000_000_000
    stamps = _stamps(
        {
            (3, 0): [t, t + 1_000, t + 2_000, t + 3_000],
            (3, 5): [t - 50_000_000, t - 49_000_000, t - 48_000_000, t - 47_000_000],
        }
    )
    text = "\n".join(ip.stamp_lines(stamps))
    assert "combine receivers: 1 blocks" in text
