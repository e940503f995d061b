"""CPU tests of the package: import without a GPU, build metadata, CPU twins."""

from __future__ import annotations

import moelink
import pytest
from moelink import _native

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_import_and_metadata():
    assert moelink.__version__
    assert "90a" in moelink.compiled_archs()
    assert moelink.device_count() >= 0
    assert issubclass(moelink.CudaError, RuntimeError)
    assert issubclass(moelink.TimeoutError, TimeoutError)


def test_pattern_matches_independent_python_version():
    for seed, src, dst, i in [(0, 0, 0, 0), (12345, 3, 1, 99), (MASK >> 1, 7, 6, 1 << 40)]:
        want = splitmix64(seed ^ (src << 48) ^ (dst << 32) ^ splitmix64(i))
        assert _native.pattern_word(seed, src, dst, i) == want


def test_main_job_runs_without_gpu(capsys):
    from moelink.__main__ import main

    if moelink.device_count() == 0:
        assert main([]) == 0
        assert "No CUDA device" in capsys.readouterr().out


def test_device_share_rule_is_the_librarys():
    # comm::DeviceShare: (SMs - ranks) / ranks where ranks share a GPU, capped by
    # the context's limit; the whole GPU for a rank alone.
    assert [_native.device_share_sms(132, None, n) for n in (1, 2, 4, 8)] == [132, 65, 32, 15]
    assert _native.device_share_sms(132, 20, 2) == 20
    assert _native.device_share_sms(132, 66, 4) == 32
    assert _native.device_share_sms(4, None, 8) == 0


def test_local_sm_counts():
    if moelink.device_count() == 0:
        with pytest.raises(moelink.CudaError, match="driver"):
            _native.local_sm_counts(0)
    else:
        sms, ctx = _native.local_sm_counts(0)
        assert sms > 0 and (ctx is None or 0 < ctx <= sms)
    with pytest.raises((ValueError, moelink.CudaError)):
        _native.local_sm_counts(-1)
