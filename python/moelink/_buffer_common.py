"""What ``buffer.py`` (the Buffer) and ``low_latency.py`` (its low-latency half)
both use besides stream handling (``_streams.py``): a device range as a tensor,
and whether ids are also checked on the host. A module of its own so the two do
not import each other."""

from __future__ import annotations

import os

import torch


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


def _check_ids() -> bool:
    """Whether expert ids are also range-checked on the host before a launch: a
    debug switch (``MOELINK_CHECK_IDS=1``; it costs a device sync per call).

    The kernels check every id anyway (the layout, notify and low-latency
    dispatch kernels record an id outside ``[-1, num_experts)``): the call raises
    ``ValueError`` naming the rank, token and column at its end where it waits
    for the GPU (a dispatch without ``num_worst_tokens``), otherwise at the end of
    the next call, in ``check()`` or in ``destroy()``. Never done under CUDA-graph
    capture."""
    return os.environ.get("MOELINK_CHECK_IDS", "0") == "1" and not _capturing()
