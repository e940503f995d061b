"""The one place the Python package reads its environment switches (``MOELINK_*``).

Every name must be registered in the library's registry (``comm::env::SWITCHES``,
``_native.env_switches()``; the table in docs/environment.md): :func:`get` and
:func:`name` raise ``KeyError`` naming an unregistered one. Each caller keeps its own
parsing. The native module is loaded on the first check, not at import, so modules
that import only the standard library (the launcher) may import this one."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping


@functools.cache
def registered() -> frozenset[str]:
    """The names of every registered switch."""
    from . import _native

    return frozenset(s[0] for s in _native.env_switches())


def name(var: str) -> str:
    """``var`` if it is a registered switch, else ``KeyError`` naming it (for the
    variables set for a child process, or a constant naming a switch)."""
    if var not in registered():
        raise KeyError(f"{var} is not a registered moelink environment switch (comm::env)")
    return var


def get(var: str, default: str | None = None, environ: Mapping[str, str] | None = None):
    """The value of switch ``var`` in ``environ`` (default ``os.environ``), else
    ``default``; ``KeyError`` where ``var`` is not registered."""
    name(var)
    return (os.environ if environ is None else environ).get(var, default)


def host_timeout_s() -> float:
    """``MOELINK_TIMEOUT_S``, the bound of host waits in seconds (default 60): a
    positive, finite number, as the Rust API requires; anything else raises
    ``ValueError`` naming the variable (a bound of inf or 0 would hang or fail
    every wait)."""
    raw = get("MOELINK_TIMEOUT_S")
    if raw is None or not raw.strip():
        return 60.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"MOELINK_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
    return value


def ranks_per_node() -> int | None:
    """``MOELINK_RANKS_PER_NODE`` (emulated nodes of that many consecutive ranks),
    or None where unset or empty; anything but a positive integer raises
    ``ValueError`` naming the variable, as the native side does."""
    raw = get("MOELINK_RANKS_PER_NODE")
    if raw is None or not raw.strip():
        return None
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ValueError(f"MOELINK_RANKS_PER_NODE must be a positive integer, got {raw!r}")
    return int(raw)
