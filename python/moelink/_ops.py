"""moelink's collectives as torch ops: ``torch.ops.moelink.*``.

Registered with ``torch.library`` when moelink is imported, so that
``torch.compile(fullgraph=True)`` traces through them (each op is one opaque node
with a fake implementation that gives its outputs' exact shapes, dtypes and
strides) and CUDA graphs capture them. Schemas (``SCHEMAS``):

- ``all_reduce(Tensor tensor, int handle, str op="sum", str? algorithm=None,
  ScalarType? accum_dtype=None) -> Tensor``: out of place (a new contiguous
  tensor like ``tensor``); ``AllReduce.all_reduce(tensor, op, algorithm, out=...)``.
- ``all_reduce_(Tensor(a!) tensor, ...same...) -> ()``: in place (``tensor`` must
  be contiguous); the form that can use a registered tensor (zero copy).
- ``all_reduce_or_nccl_(Tensor(a!) tensor, int handle, str op="sum") -> ()``: in
  place through moelink where its ``AllReduce`` serves the call
  (``comm_serves``), else ``torch.distributed.all_reduce`` on the
  communicator's group (``op`` also "avg" / "product", which go to NCCL).
- ``all_gather(Tensor inp, int handle, int group_size, str? algorithm=None) ->
  Tensor``: every
  rank's ``inp`` concatenated along dim 0, ``[R * inp.shape[0], *inp.shape[1:]]``
  (``[R]`` for a 0-d ``inp``), as ``torch.distributed.all_gather_into_tensor``.
- ``ll_dispatch(Tensor x, Tensor topk_idx, int handle, int group_size, int
  num_max_dispatch_tokens_per_rank, int num_experts, Tensor(a!)?
  cumulative_local_expert_recv_stats, bool use_fp8=True, bool round_scale=False,
  bool use_ue8m0=False) -> (Tensor recv_x, Tensor scales, Tensor recv_count,
  Tensor src_info, Tensor layout_range)``: ``Buffer.low_latency_dispatch`` run to
  completion on the current stream (no hook, no event). The stats tensor (int32
  ``[E_local]``, accumulated into) has no default: pass None for none (torch's
  ``custom_op`` drops a defaulted trailing argument before its in-place
  bookkeeping, which then fails on a mutable argument left out). ``recv_x`` fp8
  e4m3 or bf16 ``[E_local, R*T, H]``; ``scales`` float32 ``[E_local, R*T, H/128]``
  (int32 ``[.., ceil(H/512)]`` with ue8m0; the last two dims column-major, as the
  Buffer returns them), and for bf16 dispatch an empty float32 ``[E_local, R*T,
  0]`` (a schema cannot return None);
  ``recv_count`` int32 ``[E_local]``; ``src_info`` int32 ``[E_local, R*T]``;
  ``layout_range`` int64 ``[E_local, R]`` (the first two entries of the Buffer's
  handle; the other three are the op's int arguments).
- ``ll_combine(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info,
  Tensor layout_range, int handle, int num_max_dispatch_tokens_per_rank, int
  num_experts) -> Tensor``: ``Buffer.low_latency_combine`` with the handle
  ``(src_info, layout_range, T, H, num_experts)``; bf16 ``[N, H]``.

``handle`` names the ``AllReduce`` / ``Buffer`` in the process-wide registry
(``moelink._registry``; ``AllReduce.handle``, ``Buffer.handle``):
a schema holds tensors and scalars only. It is an ``int`` (not ``SymInt``), so a
compiled graph specializes on it. The ops whose output shapes depend on the
number of ranks (``all_gather``, ``ll_dispatch``) take it as ``group_size``, as
torch's own functional collectives do, and check it against the registered
object (``ValueError`` when they differ): inductor's on-disk graph cache keys on
the graph, not on the registry, so a shape read only from the registered object
would let a 4-rank process reuse a graph compiled by a 2-rank one (seen on the
GPU: sizes 12000 == 6000 asserted). The other fakes read the registered object
only to check their arguments; the allreduce fakes need no registration. The
real implementations call only the public methods of the registered object, so
a stand-in with the same methods (tests: a CPU object) runs the ops anywhere.

Not covered: autograd (no backward formulas: wrap the ops in an
``autograd.Function`` as Megatron does), receive hooks and ``async_finish``
(an op runs to completion on the current stream), ``zero_copy`` / ``out=`` /
``use_logfmt`` combine and the wait-cost stats.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _registry
from .allreduce import DTYPES as _AR_DTYPES
from .allreduce import OPS as _AR_OPS
from .checks import LIMITS, check_experts_ranks, check_int, check_tensor, check_topk_idx

__all__ = ["NAMESPACE", "SCHEMAS", "comm_serves"]

NAMESPACE = "moelink"

#: Op name -> schema (the argument list and returns as ``torch.library`` takes them).
SCHEMAS = {
    "all_reduce": (
        '(Tensor tensor, int handle, str op="sum", str? algorithm=None, '
        "ScalarType? accum_dtype=None) -> Tensor"
    ),
    "all_reduce_": (
        '(Tensor(a!) tensor, int handle, str op="sum", str? algorithm=None, '
        "ScalarType? accum_dtype=None) -> ()"
    ),
    "all_reduce_or_nccl_": '(Tensor(a!) tensor, int handle, str op="sum") -> ()',
    "all_gather": "(Tensor inp, int handle, int group_size, str? algorithm=None) -> Tensor",
    "ll_dispatch": (
        "(Tensor x, Tensor topk_idx, int handle, int group_size, "
        "int num_max_dispatch_tokens_per_rank, "
        "int num_experts, Tensor(a!)? cumulative_local_expert_recv_stats, bool use_fp8=True, "
        "bool round_scale=False, bool use_ue8m0=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "ll_combine": (
        "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, "
        "Tensor layout_range, int handle, int num_max_dispatch_tokens_per_rank, "
        "int num_experts) -> Tensor"
    ),
}

#: ``op`` names of ``all_reduce_or_nccl_`` -> torch.distributed's ReduceOp name.
_NCCL_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "avg": "AVG", "product": "PRODUCT"}

_FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = LIMITS["fp8_group_size"]


def _define(name: str, fn, mutates_args=()):
    return torch.library.custom_op(
        f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args, schema=SCHEMAS[name]
    )


# ----- the registered object ----------------------------------------------------------


def _target(handle: int, op: str, method: str):
    """The object under ``handle``, which must have ``method``."""
    obj = _registry.lookup(handle)
    if not callable(getattr(obj, method, None)):
        raise TypeError(
            f"torch.ops.moelink.{op}: handle {handle} names a {type(obj).__name__}, which has "
            f"no {method}() (allreduce ops need a moelink.AllReduce, the low-latency ops a "
            "moelink.Buffer made with low_latency_mode=True)"
        )
    return obj


def _ranks(obj, attr: str, op: str, handle: int, group_size=None) -> int:
    """The group size of ``obj`` (its ``attr``); with ``group_size`` (an op's
    argument), checked against it."""
    n = getattr(obj, attr, None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TypeError(
            f"torch.ops.moelink.{op}: the {type(obj).__name__} under handle {handle} has no "
            f"integer {attr} (got {n!r})"
        )
    if group_size is not None and group_size != n:
        raise ValueError(
            f"torch.ops.moelink.{op}: group_size is {group_size}, but the "
            f"{type(obj).__name__} under handle {handle} has {n} ranks"
        )
    return n


# ----- allreduce ----------------------------------------------------------------------


def _check_reduction(op_name: str, tensor, op: str, accum_dtype=None) -> None:
    """What every allreduce op checks at trace time (the communicator checks
    again, with the device and size, when it runs)."""
    if tensor.dtype not in _AR_DTYPES:
        raise TypeError(
            f"torch.ops.moelink.{op_name}: tensor dtype {tensor.dtype} is not supported; "
            "supported: " + ", ".join(str(d) for d in _AR_DTYPES)
        )
    if op not in _AR_OPS:
        raise ValueError(f"torch.ops.moelink.{op_name}: op must be one of {_AR_OPS}, got {op!r}")
    if accum_dtype is not None and accum_dtype not in (torch.float16, torch.float32, torch.int32):
        raise ValueError(
            f"torch.ops.moelink.{op_name}: accum_dtype must be torch.float16, torch.float32 or "
            f"torch.int32, got {accum_dtype}"
        )


def _all_reduce(tensor, handle, op="sum", algorithm=None, accum_dtype=None):
    comm = _target(handle, "all_reduce", "all_reduce")
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    comm.all_reduce(
        tensor.contiguous(), op=op, algorithm=algorithm, out=out, accum_dtype=accum_dtype
    )
    return out


all_reduce = _define("all_reduce", _all_reduce)


@all_reduce.register_fake
def _all_reduce_fake(tensor, handle, op="sum", algorithm=None, accum_dtype=None):
    _check_reduction("all_reduce", tensor, op, accum_dtype)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _check_in_place(op_name: str, tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(
            f"torch.ops.moelink.{op_name}: tensor must be contiguous (the op reduces in "
            f"place), got shape {list(tensor.shape)} with strides {list(tensor.stride())}"
        )


def _all_reduce_(tensor, handle, op="sum", algorithm=None, accum_dtype=None):
    comm = _target(handle, "all_reduce_", "all_reduce")
    comm.all_reduce(tensor, op=op, algorithm=algorithm, accum_dtype=accum_dtype)


all_reduce_ = _define("all_reduce_", _all_reduce_, mutates_args=("tensor",))


@all_reduce_.register_fake
def _all_reduce__fake(tensor, handle, op="sum", algorithm=None, accum_dtype=None):
    _check_reduction("all_reduce_", tensor, op, accum_dtype)
    _check_in_place("all_reduce_", tensor)


def comm_serves(comm, tensor, op: str = "sum") -> bool:
    """Whether ``all_reduce_or_nccl_`` sends this call to ``comm`` (a moelink
    ``AllReduce``, or a stand-in with ``device`` and ``max_bytes``) rather than to
    ``torch.distributed.all_reduce``: a reduction moelink has (sum, min, max), a
    dtype it has (bf16, fp16, fp32, int32, fp8 e4m3/e5m2), on the communicator's
    device, at most ``max_bytes``. Everything else (float64, int64, avg, product,
    larger tensors, other devices) goes to ``torch.distributed``. The layout does
    not matter: the op reduces a strided view through a contiguous copy."""
    return (
        op in _AR_OPS
        and tensor.dtype in _AR_DTYPES
        and tensor.device == comm.device
        and tensor.numel() * tensor.element_size() <= comm.max_bytes
    )


def _check_nccl_op(op: str) -> None:
    if op not in _NCCL_OPS:
        raise ValueError(
            f"torch.ops.moelink.all_reduce_or_nccl_: op must be one of {tuple(_NCCL_OPS)}, "
            f"got {op!r}"
        )


def _all_reduce_or_nccl_(tensor, handle, op="sum"):
    _check_nccl_op(op)
    comm = _target(handle, "all_reduce_or_nccl_", "all_reduce")
    # Both paths need a contiguous tensor: a strided view is reduced as a copy.
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    if comm_serves(comm, work, op):
        comm.all_reduce(work, op=op)
    else:
        dist.all_reduce(work, op=getattr(dist.ReduceOp, _NCCL_OPS[op]), group=comm.group)
    if work is not tensor:
        tensor.copy_(work)


all_reduce_or_nccl_ = _define("all_reduce_or_nccl_", _all_reduce_or_nccl_, mutates_args=("tensor",))


@all_reduce_or_nccl_.register_fake
def _all_reduce_or_nccl__fake(tensor, handle, op="sum"):
    _check_nccl_op(op)


# ----- allgather ----------------------------------------------------------------------


def _gathered_shape(inp, world: int) -> list:
    if inp.dim() == 0:
        return [world]
    return [world * inp.shape[0], *inp.shape[1:]]


def _all_gather(inp, handle, group_size, algorithm=None):
    comm = _target(handle, "all_gather", "all_gather")
    world = _ranks(comm, "world_size", "all_gather", handle, group_size)
    out = inp.new_empty(_gathered_shape(inp, world))
    comm.all_gather(out, inp.contiguous(), algorithm=algorithm)
    return out


all_gather = _define("all_gather", _all_gather)


@all_gather.register_fake
def _all_gather_fake(inp, handle, group_size, algorithm=None):
    comm = _target(handle, "all_gather", "all_gather")
    world = _ranks(comm, "world_size", "all_gather", handle, group_size)
    return inp.new_empty(_gathered_shape(inp, world))


# ----- low latency --------------------------------------------------------------------


def _ll_geometry(
    op: str, handle: int, num_max_dispatch_tokens_per_rank, num_experts, group_size=None
):
    """``(Buffer, R, T, E_local)`` of a low-latency op, checked."""
    method = "low_latency_dispatch" if op == "ll_dispatch" else "low_latency_combine"
    buf = _target(handle, op, method)
    r = _ranks(buf, "group_size", op, handle, group_size)
    t = check_int(
        "num_max_dispatch_tokens_per_rank",
        num_max_dispatch_tokens_per_rank,
        minimum=1,
        maximum=LIMITS["ll_max_tokens_per_rank"],
    )
    el = check_experts_ranks(num_experts, r, "the Buffer's group size")
    return buf, r, t, el


def _check_hidden(op: str, name: str, hidden) -> None:
    limit = LIMITS["ll_max_hidden"]
    if hidden <= 0 or hidden % _SCALE_BLOCK != 0 or hidden > limit:
        raise ValueError(
            f"torch.ops.moelink.{op}: {name} (hidden) must be a positive multiple of "
            f"{_SCALE_BLOCK} up to {limit}, got {hidden}"
        )


def _check_tokens(op: str, name: str, n, t: int) -> None:
    if n > t:
        raise ValueError(
            f"torch.ops.moelink.{op}: {name} has {n} tokens, more than "
            f"num_max_dispatch_tokens_per_rank={t}"
        )


def _scales_like(x, el: int, rt: int, hidden, use_fp8: bool, use_ue8m0: bool):
    """An empty ``scales`` output as the Buffer allocates it (column-major in the
    last two dims), or the empty float32 ``[E_local, R*T, 0]`` of bf16 dispatch."""
    if not use_fp8:
        return x.new_empty((el, rt, 0), dtype=torch.float32)
    groups = hidden // _SCALE_BLOCK
    if use_ue8m0:
        return x.new_empty((el, (groups + 3) // 4, rt), dtype=torch.int32).transpose(1, 2)
    return x.new_empty((el, groups, rt), dtype=torch.float32).transpose(1, 2)


def _ll_dispatch_checked(
    x, topk_idx, handle, group_size, t_arg, num_experts, use_fp8, round_scale, use_ue8m0, stats
):
    """The checks of ``ll_dispatch`` (trace time); returns
    ``(Buffer, R, T, E_local, N, H)``."""
    buf, r, t, el = _ll_geometry("ll_dispatch", handle, t_arg, num_experts, group_size)
    check_tensor("x", x, dtype=torch.bfloat16, dims=2)
    n, hidden = x.shape
    _check_hidden("ll_dispatch", "x.shape[1]", hidden)
    _check_tokens("ll_dispatch", "x", n, t)
    check_topk_idx(topk_idx, num_experts, check_values=False)
    check_tensor("topk_idx", topk_idx, shape=(n, None))
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32, shape=(el,))
    if use_ue8m0 and not use_fp8:
        raise ValueError("ll_dispatch: use_ue8m0=True needs use_fp8=True")
    if use_fp8 and use_ue8m0 and not round_scale:
        raise ValueError("ll_dispatch: use_ue8m0=True needs round_scale=True")
    return buf, r, t, el, n, hidden


def _ll_dispatch(
    x, topk_idx, handle, group_size, num_max_dispatch_tokens_per_rank, num_experts,
    cumulative_local_expert_recv_stats, use_fp8=True, round_scale=False, use_ue8m0=False,
):  # fmt: skip
    # The Buffer checks every other argument (and memoizes the checks of a shape).
    buf = _target(handle, "ll_dispatch", "low_latency_dispatch")
    _ranks(buf, "group_size", "ll_dispatch", handle, group_size)
    t = num_max_dispatch_tokens_per_rank
    recv, recv_count, ll_handle, _event, _hook = buf.low_latency_dispatch(
        x.contiguous(), topk_idx.contiguous(), t, num_experts,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
        use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        async_finish=False, return_recv_hook=False,
    )  # fmt: skip
    if use_fp8:
        recv_x, scales = recv
    else:
        recv_x = recv
        scales = _scales_like(x, recv_x.shape[0], recv_x.shape[1], x.shape[1], False, False)
    return recv_x, scales, recv_count, ll_handle[0], ll_handle[1]


ll_dispatch = _define(
    "ll_dispatch", _ll_dispatch, mutates_args=("cumulative_local_expert_recv_stats",)
)


@ll_dispatch.register_fake
def _ll_dispatch_fake(
    x, topk_idx, handle, group_size, num_max_dispatch_tokens_per_rank, num_experts,
    cumulative_local_expert_recv_stats, use_fp8=True, round_scale=False, use_ue8m0=False,
):  # fmt: skip
    _, r, t, el, _, hidden = _ll_dispatch_checked(
        x, topk_idx, handle, group_size, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
        round_scale, use_ue8m0, cumulative_local_expert_recv_stats,
    )  # fmt: skip
    rt = r * t
    return (
        x.new_empty((el, rt, hidden), dtype=_FP8 if use_fp8 else torch.bfloat16),
        _scales_like(x, el, rt, hidden, use_fp8, use_ue8m0),
        x.new_empty((el,), dtype=torch.int32),
        x.new_empty((el, rt), dtype=torch.int32),
        x.new_empty((el, r), dtype=torch.int64),
    )


def _ll_combine_checked(
    x, topk_idx, topk_weights, src_info, layout_range, handle, t_arg, num_experts
):
    """The checks of ``ll_combine``; returns ``(Buffer, N, H)``."""
    buf, r, t, el = _ll_geometry("ll_combine", handle, t_arg, num_experts)
    check_tensor("x", x, dtype=torch.bfloat16, dims=3)
    hidden = x.shape[2]
    _check_hidden("ll_combine", "x.shape[2]", hidden)
    check_tensor("x", x, shape=(el, r * t, hidden))
    check_topk_idx(topk_idx, num_experts, check_values=False)
    n, k = topk_idx.shape
    _check_tokens("ll_combine", "topk_idx", n, t)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(n, k))
    check_tensor("src_info", src_info, dtype=torch.int32, shape=(el, r * t))
    check_tensor("layout_range", layout_range, dtype=torch.int64, shape=(el, r))
    return buf, n, hidden


def _ll_combine(
    x, topk_idx, topk_weights, src_info, layout_range, handle,
    num_max_dispatch_tokens_per_rank, num_experts,
):  # fmt: skip
    # The Buffer checks every argument (and memoizes the checks of a shape).
    buf = _target(handle, "ll_combine", "low_latency_combine")
    check_tensor("x", x, dims=3)  # [E_local, R*T, H]: the handle's hidden comes from it
    hidden = x.shape[2]
    ll_handle = (
        src_info.contiguous(), layout_range.contiguous(), num_max_dispatch_tokens_per_rank,
        hidden, num_experts,
    )  # fmt: skip
    out, _event, _hook = buf.low_latency_combine(
        x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous(), ll_handle,
        async_finish=False, return_recv_hook=False,
    )  # fmt: skip
    return out


ll_combine = _define("ll_combine", _ll_combine)


@ll_combine.register_fake
def _ll_combine_fake(
    x, topk_idx, topk_weights, src_info, layout_range, handle,
    num_max_dispatch_tokens_per_rank, num_experts,
):  # fmt: skip
    _, n, hidden = _ll_combine_checked(
        x, topk_idx, topk_weights, src_info, layout_range, handle,
        num_max_dispatch_tokens_per_rank, num_experts,
    )  # fmt: skip
    return x.new_empty((n, hidden), dtype=torch.bfloat16)
