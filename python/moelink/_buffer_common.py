"""What ``buffer.py`` (the Buffer) and ``low_latency.py`` (its low-latency half)
both use besides stream handling (``_streams.py``): a device range as a tensor,
whether ids are also checked on the host, the plan cache, the outputs of a
native plan and ``plain_torch`` (the calls past torch's function modes). A module
of its own so the two do not import each other."""

from __future__ import annotations

import functools
import os

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


_MODE_ON = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_NO_MODES = getattr(torch._C, "DisableTorchFunction", None)


def plain_torch(method):
    """``method`` run past torch's function modes where one is on
    (``torch.set_default_device``, which DeepEP's tests call, or any
    ``TorchFunctionMode``): as a C++ extension's code runs. Under a mode, torch
    sends every tensor attribute and function a call reads or calls through the
    mode's Python ``__torch_function__``, about ten times their cost, and a
    call reads dozens. Every tensor a call makes names its device and dtype,
    so no mode changes its outputs."""
    if _MODE_ON is None or _NO_MODES is None:
        return method

    @functools.wraps(method)
    def call(*args, **kwargs):
        if _MODE_ON():
            with _NO_MODES():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return call


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


def output_specs(plan, names) -> tuple:
    """The outputs ``names`` of a native plan (``_native.*_plan``: a dict, or the
    ``LayoutPlan`` / ``DispatchPlan`` / ``CombinePlan`` / ``LlDispatchPlan`` /
    ``LlCombinePlan`` object of layout, dispatch and combine), each as ``(shape,
    strides, dtype, zeroed)``, None where the plan has no such output (an optional
    one the call does not make)."""
    outputs = plan["outputs"] if type(plan) is dict else plan.outputs
    specs = {
        name: (shape, strides, getattr(torch, dtype), zeroed)
        for name, dtype, shape, strides, zeroed in outputs
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


def _init_torch_alloc() -> bool:
    """Loads torch's C shim into the native module (``_native.torch_alloc_init``):
    outputs are then made natively, through torch's caching allocator, one call per
    call's outputs. False (outputs made with ``torch.empty_strided``) where this
    torch lacks the shim or the handle-to-tensor function."""
    try:
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        aoti = torch._C._aoti
        # The tensor-to-handle function reads the one-call paths' tensors
        # (``tensors::read_all``); without it they read attributes.
        borrow = getattr(aoti, "unsafe_alloc_void_ptrs_from_tensors", None)
        _native.torch_alloc_init(lib, aoti.alloc_tensors_by_stealing_from_void_ptrs, borrow)
    except (AttributeError, RuntimeError, OSError):
        return False
    return True


_TORCH_ALLOC = _init_torch_alloc()


def _native_spec(spec):
    """An ``output_specs`` entry as ``_native.TorchOutputs`` takes it."""
    if spec is None:
        return None
    shape, strides, dtype, zeroed = spec
    return list(shape), list(strides), str(dtype).removeprefix("torch."), zeroed


class OutputSet:
    """The outputs of a cached plan (``output_specs`` entries, None for an output the
    call does not make) on ``device``: :meth:`empty` makes all of them at once, on
    the current stream. With torch's C shim loaded that is one native call
    (``_native.TorchOutputs``; it costs what ``torch.empty_strided`` per output does,
    docs/architecture.md, "Outputs"); with one output, without the shim, or where
    the shim refuses (out of memory), one ``torch.empty_strided`` per output, which
    raises torch's own error."""

    __slots__ = ("specs", "index", "device", "native")

    def __init__(self, specs, device: torch.device) -> None:
        self.specs = tuple(specs)
        self.device = device
        self.index = device.index if device.type == "cuda" else -1
        self.native = None
        # One output costs ~0.8 us more through the shim than through
        # torch.empty_strided (3.0 against 2.2 us on an H100 host); five cost the
        # same (docs/architecture.md, "Outputs").
        made = sum(s is not None for s in self.specs)
        if _TORCH_ALLOC and device.type in ("cuda", "cpu") and made >= 2:
            self.native = _native.TorchOutputs([_native_spec(s) for s in self.specs])

    def empty(self) -> tuple:
        if self.native is not None:
            outs = self.native.empty(self.index)
            if outs is not None:
                return outs
        return tuple(empty(s, self.device) for s in self.specs)


def at_rows(spec, rows: int):
    """``spec`` with ``rows`` received rows, as ``ep_core::calls::OutputSpec::resolve``
    fills them in (a stride of ``rows`` is at least 1, as torch strides a new tensor)."""
    if spec is None:
        return None
    shape, strides, dtype, zeroed = spec
    shape = [rows if d == _RECV_ROWS else d for d in shape]
    strides = [max(rows, 1) if d == _RECV_ROWS else d for d in strides]
    return shape, strides, dtype, zeroed
