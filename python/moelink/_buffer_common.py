"""What ``buffer.py`` (the Buffer) and ``low_latency.py`` (its low-latency half)
both use besides stream handling (``_streams.py``): a device range as a tensor,
whether ids are also checked on the host, the plan cache and the outputs of a
native plan. A module of its own so the two do not import each other."""

from __future__ import annotations

import torch

from . import _env, _native

#: A dimension or stride of an output spec that is the rows a dispatch receives
#: (``ep_core::calls::RECV_ROWS``), known once its counts arrive.
_RECV_ROWS = _native.RECV_ROWS


class _CudaMemory:
    """A device range exposed through ``__cuda_array_interface__`` (keeps ``owner`` alive)."""

    def __init__(self, ptr: int, nbytes: int, owner) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


#: ``MOELINK_CHECK_IDS=1`` as read when moelink was imported (``set_check_ids``
#: changes it at run time): a module flag, since reading the environment on every
#: call costs about a microsecond.
_CHECK_IDS = _env.get("MOELINK_CHECK_IDS", "0") == "1"


def set_check_ids(enabled: bool) -> bool:
    """Turns the host-side expert-id check on or off (see ``_check_ids``); returns
    the previous setting."""
    global _CHECK_IDS
    previous, _CHECK_IDS = _CHECK_IDS, bool(enabled)
    return previous


def _check_ids() -> bool:
    """Whether expert ids are also range-checked on the host before a launch: a
    debug switch (``MOELINK_CHECK_IDS=1`` in the environment when moelink is
    imported, or ``set_check_ids(True)``; it costs a device sync per call).

    The kernels check every id anyway (the layout, notify and low-latency
    dispatch kernels record an id outside ``[-1, num_experts)``): the call raises
    ``ValueError`` naming the rank, token and column at its end where it waits
    for the GPU (a dispatch without ``num_worst_tokens``), otherwise at the end of
    the next call, in ``check()`` or in ``destroy()``. Never done under CUDA-graph
    capture."""
    return _CHECK_IDS and not _capturing()


class PlanCache:
    """Per-Buffer memo of calls whose arguments passed every check: the key is
    built from what the checks read (each tensor's ``tensor_sig``, the scalar
    arguments and their types), the value is what the checks computed. A call
    whose key is cached skips its checks; any other call (a new shape, a wrong
    argument, an unhashable one, a tensor subclass) takes the checked path, which
    raises or adds its key. Bounded: cleared when it holds ``limit`` keys."""

    __slots__ = ("plans", "limit")

    def __init__(self, limit: int = 64) -> None:
        self.plans: dict = {}
        self.limit = limit

    def get(self, key):
        try:
            return self.plans.get(key)
        except TypeError:  # an unhashable argument, or a non-tensor (tensor_sig)
            return None

    def put(self, key, plan) -> None:
        try:
            if len(self.plans) >= self.limit:
                self.plans.clear()
            self.plans[key] = plan
        except TypeError:
            pass


def output_specs(plan: dict, names) -> tuple:
    """The outputs ``names`` of a native plan (``_native.*_plan``), each as
    ``(shape, strides, dtype, zeroed)``, None where the plan has no such output
    (an optional one the call does not make)."""
    specs = {
        name: (shape, strides, getattr(torch, dtype), zeroed)
        for name, dtype, shape, strides, zeroed in plan["outputs"]
    }
    return tuple(specs.get(name) for name in names)


def empty(spec, device):
    """A new tensor as ``spec`` (an ``output_specs`` entry) says, on ``device``;
    None for None."""
    if spec is None:
        return None
    shape, strides, dtype, zeroed = spec
    t = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    return t.zero_() if zeroed else t


def at_rows(spec, rows: int):
    """``spec`` with ``rows`` received rows, as ``ep_core::calls::OutputSpec::resolve``
    fills them in (a stride of ``rows`` is at least 1, as torch strides a new tensor)."""
    if spec is None:
        return None
    shape, strides, dtype, zeroed = spec
    shape = [rows if d == _RECV_ROWS else d for d in shape]
    strides = [max(rows, 1) if d == _RECV_ROWS else d for d in strides]
    return shape, strides, dtype, zeroed
