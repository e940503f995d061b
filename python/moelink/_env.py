"""The one place the Python package reads its environment switches (``MOELINK_*``).

Every name must be registered in the library's registry (``comm::env::SWITCHES``,
``_native.env_switches()``; the table in docs/environment.md): :func:`get` and
:func:`name` raise ``KeyError`` naming an unregistered one. Each caller keeps its own
parsing. The native module is loaded on the first check, not at import, so modules
that import only the standard library (the launcher) may import this one."""

from __future__ import annotations

import functools
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
