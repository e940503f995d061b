"""The bound of every device-side wait: seconds for users (an argument or an
environment variable), positive integer nanoseconds of GPU time for the kernels
(``%globaltimer``, so ranks that share a GPU and are time-sliced neither give up
early nor wait past it)."""

from __future__ import annotations

import math
import numbers

from . import _env

#: Seconds a device wait may take when nothing sets it: shorter than the host-side
#: bounds (``MOELINK_TIMEOUT_S``, 60 s), so that the device's error, which names the
#: rank, the peer and the counter, is the one the user sees.
DEFAULT_DEVICE_TIMEOUT_S = 30.0
#: Seconds a host wait may take when ``MOELINK_TIMEOUT_S`` does not set it.
DEFAULT_HOST_TIMEOUT_S = 60.0
_MAX_NS = (1 << 63) - 1


def device_timeout_ns(name: str, seconds) -> int:
    """``seconds`` (a positive, finite number: at least 1 ns) in nanoseconds.
    ``ValueError`` / ``TypeError`` naming ``name`` otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(seconds).__name__}")
    try:
        ns = round(float(seconds) * 1e9) if math.isfinite(seconds) else 0
    except OverflowError:  # an int beyond any float
        ns = 0
    if not 0 < ns <= _MAX_NS:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {seconds!r}")
    return ns


def env_seconds(env: str, default: float) -> float:
    """The bound environment variable ``env`` sets (seconds, positive and finite,
    as :func:`device_timeout_ns` checks), else ``default``; ``ValueError`` naming
    ``env`` for a value that is not one."""
    raw = _env.get(env)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}") from None
    device_timeout_ns(env, seconds)
    return seconds


def env_device_timeout_ns(env: str) -> int:
    """The device-wait bound ``env`` sets, else the default, in nanoseconds."""
    return device_timeout_ns(env, env_seconds(env, DEFAULT_DEVICE_TIMEOUT_S))


def env_host_timeout_s() -> float:
    """``MOELINK_TIMEOUT_S``, the bound of host waits in seconds (default 60),
    checked as the device bounds are and as the Rust API does: a bound of inf
    or 0 would hang or fail every wait."""
    return env_seconds("MOELINK_TIMEOUT_S", DEFAULT_HOST_TIMEOUT_S)
