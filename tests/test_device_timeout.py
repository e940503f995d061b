"""CPU tests of the device-wait bound: seconds for users, positive nanoseconds for
the kernels (``moelink._device_timeout``), and ``moelink.Buffer``'s
``MOELINK_DEVICE_TIMEOUT_S``, checked before anything needs a GPU."""

from __future__ import annotations

import moelink
import pytest
from moelink._device_timeout import (
    DEFAULT_DEVICE_TIMEOUT_S,
    device_timeout_ns,
    env_device_timeout_ns,
)

ENV = "MOELINK_DEVICE_TIMEOUT_S"


def test_seconds_become_nanoseconds():
    assert device_timeout_ns("t", 2) == 2_000_000_000
    assert device_timeout_ns("t", 0.5) == 500_000_000
    assert device_timeout_ns("t", 1e-9) == 1
    assert DEFAULT_DEVICE_TIMEOUT_S == 30.0


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -1e-3, 1e-12, float("nan"), float("inf"), 1e10, 10**400]
)
def test_non_positive_or_unbounded_is_refused(bad):
    with pytest.raises(ValueError, match="my_timeout must be a positive"):
        device_timeout_ns("my_timeout", bad)


@pytest.mark.parametrize("bad", ["30", None, True, [1]])
def test_non_numbers_are_refused(bad):
    with pytest.raises(TypeError, match="my_timeout"):
        device_timeout_ns("my_timeout", bad)


def test_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert env_device_timeout_ns(ENV) == 30_000_000_000
    monkeypatch.setenv(ENV, "2.5")
    assert env_device_timeout_ns(ENV) == 2_500_000_000
    for bad in ("0", "-3", "nan", "inf"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"{ENV} must be a positive"):
            env_device_timeout_ns(ENV)
    monkeypatch.setenv(ENV, "30s")
    with pytest.raises(ValueError, match=f"{ENV} must be a number of seconds"):
        env_device_timeout_ns(ENV)


@pytest.mark.parametrize("bad", ["0", "-1", "later"])
def test_buffer_refuses_a_bad_device_timeout(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ValueError, match=ENV):
        moelink.Buffer(None, num_nvl_bytes=0)
