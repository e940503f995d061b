"""``moelink.ops``: the handle registry of moelink's torch ops and a few helpers
around them (``docs/torch-integration.md``).

The ops themselves are ``torch.ops.moelink.{all_reduce, all_reduce_,
all_reduce_or_nccl_, all_gather, ll_dispatch, ll_combine}`` (schemas:
``moelink.ops.SCHEMAS``; defined in ``moelink._ops`` when moelink is imported).
They name their communicator or Buffer by an int handle:

    comm = moelink.AllReduce.from_process_group(tp_group)   # registered: comm.handle
    y = torch.ops.moelink.all_reduce(x, comm.handle)
    buf = moelink.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True)
    h = buf.handle                                          # registered too
    recv_x, scales, count, src_info, layout_range = torch.ops.moelink.ll_dispatch(
        x, topk_idx, h, buf.group_size, max_tokens, num_experts, None)  # None: no stats

``all_reduce_or_nccl(t, handle)`` is the drop-in for a model's
``torch.distributed.all_reduce(t, group=...)``: moelink where it serves the call,
NCCL otherwise.
"""

from __future__ import annotations

import torch

from ._ops import NAMESPACE, SCHEMAS, comm_serves
from ._registry import lookup, register, registered, unregister

__all__ = [
    "NAMESPACE",
    "SCHEMAS",
    "all_reduce_",
    "all_reduce_or_nccl",
    "lookup",
    "moelink_serves",
    "reduce_op_name",
    "register",
    "registered",
    "unregister",
]

_REDUCE_OP_NAMES = ("sum", "min", "max", "avg", "product")


def reduce_op_name(op) -> str:
    """``op`` as the name the ops take: a name (any case) or a
    ``torch.distributed.ReduceOp`` (SUM, MIN, MAX, AVG, PRODUCT)."""
    if isinstance(op, str):
        name = op.lower()
        if name in _REDUCE_OP_NAMES:
            return name
        raise ValueError(f"op must be one of {_REDUCE_OP_NAMES}, got {op!r}")
    import torch.distributed as dist

    for name in _REDUCE_OP_NAMES:
        if op == getattr(dist.ReduceOp, name.upper()):
            return name
    raise TypeError(f"op must be one of {_REDUCE_OP_NAMES} or a matching ReduceOp, got {op!r}")


def all_reduce_(tensor: torch.Tensor, handle: int, op="sum", algorithm=None, accum_dtype=None):
    """``torch.ops.moelink.all_reduce_`` (in place), returning ``tensor``."""
    torch.ops.moelink.all_reduce_(tensor, handle, reduce_op_name(op), algorithm, accum_dtype)
    return tensor


def all_reduce_or_nccl(tensor: torch.Tensor, handle: int, op="sum") -> torch.Tensor:
    """Reduces ``tensor`` in place over the group of the ``AllReduce`` under
    ``handle`` and returns it: through moelink where ``moelink_serves`` says so,
    else through ``torch.distributed.all_reduce`` on the same group. One op
    (``torch.ops.moelink.all_reduce_or_nccl_``), so ``torch.compile`` and CUDA
    graphs take it whichever way it goes. In compiled code pass ``op`` as a str."""
    torch.ops.moelink.all_reduce_or_nccl_(tensor, handle, reduce_op_name(op))
    return tensor


def moelink_serves(tensor: torch.Tensor, handle: int, op="sum") -> bool:
    """Whether ``all_reduce_or_nccl(tensor, handle, op)`` runs moelink's kernels
    (True) or ``torch.distributed.all_reduce`` (False)."""
    return comm_serves(lookup(handle), tensor, reduce_op_name(op))
