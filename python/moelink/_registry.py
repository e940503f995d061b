"""The process-wide table of int handles that moelink's torch ops
(``torch.ops.moelink.*``, ``moelink._ops``) take in place of a communicator or
Buffer: a torch op's schema holds tensors and scalars, not Python objects, so an
op names its ``AllReduce`` / ``Buffer`` by a handle and looks it up when it runs
(and when it is traced: the fake implementations read the world size there).

- ``register(obj) -> int``: the object's handle, made at its first registration
  (an ``AllReduce`` and a ``Buffer`` register themselves when they are made).
  Registering again returns the same handle. Handles count up from 1 and are
  never reused, so a stale handle never names another object.
- The table holds weak references: an entry goes when its object is collected
  (and an ``AllReduce`` or ``Buffer`` unregisters itself in ``destroy()``), so registering never
  keeps a communicator or its GPU memory alive.
- ``unregister(obj_or_handle)``, ``lookup(handle)`` (``ValueError`` naming the
  handle when nothing is registered under it).

Any Python object that can be weakly referenced can be registered: tests register
stand-ins with the same methods as ``AllReduce`` / ``Buffer`` and run the ops on
the CPU through them.
"""

from __future__ import annotations

import itertools
import threading
import weakref

__all__ = ["lookup", "register", "registered", "unregister"]

_LOCK = threading.RLock()
_NEXT = itertools.count(1)
#: handle -> (weak reference to the object, id of the object).
_BY_HANDLE: dict = {}
#: id(object) -> handle (identity, not equality: any object can be registered).
_BY_ID: dict = {}


def _forget(handle: int) -> None:
    """Drops ``handle`` (the weak reference's callback: its object is gone)."""
    with _LOCK:
        entry = _BY_HANDLE.pop(handle, None)
        if entry is not None and _BY_ID.get(entry[1]) == handle:
            del _BY_ID[entry[1]]


def _live(handle):
    """The object under ``handle``, or None."""
    entry = _BY_HANDLE.get(handle)
    return entry[0]() if entry is not None else None


def register(obj) -> int:
    """The handle of ``obj`` in the op registry, registering it if it is not yet
    (``TypeError`` for None, a number, a string or tuple, or an object that cannot
    be weakly referenced)."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, tuple)):
        raise TypeError(
            f"only a communicator or Buffer object can be registered, got {type(obj).__name__}"
        )
    with _LOCK:
        handle = _BY_ID.get(id(obj))
        if handle is not None and _live(handle) is obj:
            return handle
        handle = next(_NEXT)
        try:
            ref = weakref.ref(obj, lambda _r, h=handle: _forget(h))
        except TypeError:
            raise TypeError(
                f"{type(obj).__name__} objects cannot be registered: the registry holds weak "
                "references (give the class a __weakref__ slot)"
            ) from None
        _BY_HANDLE[handle] = (ref, id(obj))
        _BY_ID[id(obj)] = handle
        return handle


def unregister(obj_or_handle) -> bool:
    """Removes an object (or the object under an int handle) from the registry;
    later ops on its handle raise. Returns whether it was registered."""
    with _LOCK:
        if isinstance(obj_or_handle, bool):
            raise TypeError("a handle is an int, got bool")
        if isinstance(obj_or_handle, int):
            handle = obj_or_handle
        else:
            handle = _BY_ID.get(id(obj_or_handle))
            if handle is None or _live(handle) is not obj_or_handle:
                return False
        if _live(handle) is None:
            _forget(handle)
            return False
        _forget(handle)
        return True


def lookup(handle: int):
    """The live object registered under ``handle``; ``TypeError`` for a non-int,
    ``ValueError`` when none is (never registered, unregistered, destroyed or
    collected)."""
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"handle must be an int, got {type(handle).__name__}")
    obj = _live(handle)
    if obj is None:
        raise ValueError(
            f"handle {handle} names no registered moelink object (never registered, "
            "unregistered, or its AllReduce / Buffer was destroyed or collected); "
            "handles come from AllReduce.handle, Buffer.handle or moelink.ops.register(obj)"
        )
    return obj


def registered() -> dict:
    """``{handle: object}`` of every live registration (a snapshot)."""
    with _LOCK:
        items = [(h, e[0]()) for h, e in _BY_HANDLE.items()]
    return {h: o for h, o in items if o is not None}
