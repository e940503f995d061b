"""moelink: expert-parallel communication for Mixture-of-Experts models.

Dispatch (tokens to the GPUs holding their experts) and combine (expert outputs
back) over NVLink, behind a DeepEP-compatible ``Buffer``, plus fast allreduce.
The core is Rust and CUDA (``moelink._native``); this package is the torch API.
Importing it registers the torch ops ``torch.ops.moelink.*`` (``moelink.ops``).
"""

import torch

from . import _native, ops
from ._native import CudaError, TimeoutError, __version__
from ._streams import EventHandle
from .allreduce import AllReduce as AllReduce
from .buffer import Buffer, EventOverlap
from .checks import DtypeError
from .config import Config
from .diagnostics import peer_write_check

#: dtype of top-k expert ids (``topk_idx``), as ``deep_ep.topk_idx_t``.
topk_idx_t = torch.int64

__all__ = [
    "Buffer",
    "Config",
    "CudaError",
    "DtypeError",
    "EventHandle",
    "EventOverlap",
    "TimeoutError",
    "__version__",
    "compiled_archs",
    "device_count",
    "ops",
    "peer_write_check",
    "topk_idx_t",
]


def compiled_archs() -> list:
    """CUDA targets the embedded kernels hold machine code for (e.g. ``["90a"]``)."""
    return list(_native.compiled_archs())


def device_count() -> int:
    """Visible CUDA devices as the driver reports them (0 without a driver)."""
    return int(_native.device_count())
