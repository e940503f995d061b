"""``moelink.Buffer``: DeepEP's ``deep_ep.Buffer`` API on moelink's intranode kernels.

Every argument is checked before anything is launched (``ValueError`` /
``TypeError`` naming the argument): by the native plans (``ep_core::calls``, which
also give the outputs' shapes), once per new combination of argument shapes (the
Buffer's ``PlanCache``). Kernels run on the buffer's communication
stream, which first waits for the caller's current stream (or ``previous_event``);
see ``docs/design-intranode.md`` for the kernels and ``docs/architecture.md`` for
the layers. Differences from DeepEP are listed in ``docs/api-notes.md``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.utils.dlpack

from . import _buffer_common, _env, _native, _registry
from ._buffer_common import (
    OutputSet,
    PlanCache,
    _check_ids,
    _CudaMemory,
    at_rows,
    empty,
    output_specs,
    plain_torch,
)
from ._device_timeout import env_device_timeout_ns, env_host_timeout_s
from ._group import native_group as _native_group
from ._streams import (
    NO_STREAM_SWITCH,
    EventOverlap,
    check_previous_event,
    current_raw_stream,
    finish_async,
)
from .checks import (
    _NO_SIG,
    check_int,
    check_topk_values,
    device_index,
    optional_meta,
    tensor_meta,
)
from .checks import tensor_ptr as _ptr
from .checks import tensor_sig as _sig
from .config import Config, get_combine_config, get_dispatch_config
from .low_latency import LowLatencyMixin

__all__ = ["Buffer", "EventOverlap"]

#: (class, call, x in the receive pool, ranks, num_sms, set_num_sms called) -> SMs.
_DEFAULT_SMS: dict = {}

_ALIGN = 16  # kernels use 16-byte vector loads and stores on rows


def _check_aligned(name: str, t) -> None:
    if t is not None and t.numel() > 0 and t.data_ptr() % _ALIGN != 0:
        raise ValueError(
            f"{name} must start on a {_ALIGN}-byte boundary (it is a view at an odd offset)"
        )


def _x_sig(x):
    """``tensor_sig`` of dispatch's ``x``: a tensor, or a (data, scales) pair (with
    the scales' strides, which the kernels take)."""
    if type(x) is tuple and len(x) == 2:
        s = x[1]
        return (_sig(x[0]), _sig(s), s.stride() if type(s) is torch.Tensor else _NO_SIG)
    return _sig(x)


#: Where a handle keeps what the checks and kernels read, by its length: an
#: intranode 6-tuple in DeepEP's order ``(rank_prefix_matrix, channel_prefix_matrix,
#: recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``, or an
#: internode 10-tuple in DeepEP's order ``(is_token_in_rank,
#: rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
#: recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
#: recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
#: send_rdma_head, send_nvl_head)``. Entries whose meaning does not depend on
#: DeepEP's channels hold DeepEP's values (``is_token_in_rank``, the inclusive
#: prefix sums over source nodes and ranks, the source token indices); the
#: channel positions carry moelink's own state: the rank prefix matrix, the
#: per-node counts (``xcounts``), the forwarding records (``fwd_meta``), the node
#: heads and the send heads. Each entry: (position, DeepEP's name, what it holds).
_HANDLE_LAYOUT = {
    6: {
        "rank_prefix_matrix": (0, "rank_prefix_matrix"),
        "recv_src_idx": (3, "recv_src_idx"),
        "is_token_in_rank": (4, "is_token_in_rank"),
        "send_head": (5, "send_head"),
    },
    10: {
        "is_token_in_rank": (0, "is_token_in_rank"),
        "xcounts": (1, "rdma_channel_prefix_matrix: node counts"),
        "rank_prefix_matrix": (2, "gbl_channel_prefix_matrix: rank_prefix_matrix"),
        "fwd_meta": (3, "recv_rdma_channel_prefix_matrix: forwarding records"),
        "recv_src_idx": (7, "recv_src_meta: recv_src_idx"),
        "node_head": (8, "send_rdma_head: node heads"),
        "send_head": (9, "send_nvl_head: send_head"),
    },
}
#: The entries the checks read (``_native.dispatch_plan`` / ``combine_plan``), in their order.
_CHECKED = ("rank_prefix_matrix", "recv_src_idx", "is_token_in_rank", "send_head")
#: The internode entries the kernels read besides those.
_X_ENTRIES = ("node_head", "xcounts", "fwd_meta")


def _entry(handle, name: str):
    """Entry ``name`` of a handle of either kind (its length is already checked)."""
    return handle[_HANDLE_LAYOUT[len(handle)][name][0]]


def _handle_sig(handle):
    """``tensor_sig`` of the entries of a handle that the checks and kernels read
    (an intranode 6-tuple or an internode 10-tuple)."""
    if type(handle) is not tuple or len(handle) not in _HANDLE_LAYOUT:
        return _NO_SIG
    names = _CHECKED if len(handle) == 6 else _CHECKED + _X_ENTRIES
    return (len(handle), *(_sig(_entry(handle, n)) for n in names))


def _bias_sig(bias):
    if bias is None or type(bias) is torch.Tensor:
        return _sig(bias)
    if type(bias) is tuple and len(bias) == 2:
        return (_sig(bias[0]), _sig(bias[1]))
    return _NO_SIG


def _bias_pair(bias):
    """combine's ``bias`` (already checked) as a pair."""
    if bias is None:
        return None, None
    if type(bias) is torch.Tensor:
        return bias, None
    return bias


#: The outputs of a dispatch plan (``_native.dispatch_plan``), in this order.
_DISPATCH_OUTPUTS = (
    "rank_prefix_matrix", "send_head", "recv_x", "recv_x_scales", "recv_topk_idx",
    "recv_topk_weights", "recv_src_idx", "channel_prefix_matrix", "recv_channel_prefix_matrix",
)  # fmt: skip


def _x_metas(x):
    """dispatch's ``x``, a tensor or a ``(data, scales)`` pair, as ``(data meta,
    scales meta or None)``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x must be a tensor or a (data, scales) pair, got a {len(x)}-tuple")
        return tensor_meta("x[0]", x[0]), tensor_meta("x[1] (scales)", x[1])
    if isinstance(x, torch.Tensor):
        return tensor_meta("x", x), None
    raise TypeError(f"x must be a torch.Tensor or a (data, scales) tuple, got {type(x).__name__}")


def _handle_metas(handle):
    """The metas of the entries of a handle that the checks read (those of an
    intranode handle, wherever the handle's kind keeps them)."""
    if not isinstance(handle, tuple) or len(handle) not in _HANDLE_LAYOUT:
        raise ValueError(
            "handle must be the tuple a dispatch returned (6 entries within one node, 10 "
            "across nodes)"
        )
    layout = _HANDLE_LAYOUT[len(handle)]
    metas = []
    for name in _CHECKED:
        i, label = layout[name]
        metas.append(tensor_meta(f"handle[{i}] ({label})", handle[i]))
    return tuple(metas)


def _bias_metas(bias):
    """combine's ``bias`` (None, a tensor, or a pair of tensors or None) as metas."""
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        return tensor_meta("bias", bias)
    if isinstance(bias, tuple):
        if len(bias) != 2:
            raise ValueError(f"bias must be None, a tensor or a pair, got a {len(bias)}-tuple")
        return optional_meta("bias[0]", bias[0]), optional_meta("bias[1]", bias[1])
    raise TypeError(
        f"bias must be None, a torch.Tensor or a tuple of two, got {type(bias).__name__}"
    )


class Buffer(LowLatencyMixin):
    """Communication buffer for MoE dispatch and combine among the ranks of ``group``
    (one GPU per rank, all on one host). Call-compatible with ``deep_ep.Buffer``.

    ``num_nvl_bytes`` is the NVLink buffer each rank allocates and every peer of its
    node maps; size it with ``Config.get_nvl_buffer_size_hint`` (moelink keeps a
    fixed slot per token, so it depends on the largest batch). Where the group spans
    nodes (``MOELINK_RANKS_PER_NODE``'s emulated ones) dispatch and combine
    take the internode path, with DeepEP's internode 10-tuple handles, and
    ``num_rdma_bytes`` sizes its cross-node regions
    (``Config.get_rdma_buffer_size_hint``). ``low_latency_mode=True`` allocates
    ``num_rdma_bytes`` of low-latency buffer (``get_low_latency_rdma_size_hint``; see
    ``moelink.low_latency``); with ``num_nvl_bytes > 0`` too, the same Buffer also
    serves normal dispatch and combine, across nodes as well (SGLang's auto mode:
    give it the larger of both hints; the two modes get ``num_rdma_bytes`` each, in
    separate allocations, so one mode's calls never disturb the other's buffer).

    Every intranode device wait is bounded by ``MOELINK_DEVICE_TIMEOUT_S`` seconds of
    GPU time (default 30, read at creation; positive, else ``ValueError``); a wait
    that runs out raises ``moelink.TimeoutError`` naming the rank and the peer.
    """

    #: SMs of dispatch/combine when no config is given, once ``set_num_sms`` set
    #: it (DeepEP's attribute and initial value). Until then a call without a
    #: config takes the default for its rank count (``get_dispatch_config`` /
    #: ``get_combine_config``); ``num_sms_used`` reports what each call took.
    num_sms: int = 20
    _num_sms_set = False
    #: ``[start, end)`` device addresses of the receive pool, where there is one.
    _pool_range = (0, 0)
    #: ``(nodes, ranks per node)`` where the group spans nodes (hosts, or
    #: MOELINK_RANKS_PER_NODE's emulated ones): dispatch and combine then take the
    #: internode path; None within one node.
    nodes: tuple[int, int] | None = None
    #: Whether ``recv_x`` comes from the receive pool (``MOELINK_INTRANODE_RECV=direct``).
    _recv_pool = False
    #: The eager normal-mode calls whole in one native call each
    #: (``_native.NormalCalls``, ep-core's engine); None without an intranode part
    #: or across nodes, where every call takes the checked path.
    _calls = None

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ) -> None:
        self._native = None
        # Calls whose arguments passed every check (their checks are skipped).
        self._plans = PlanCache()
        #: The SMs the last intranode or internode dispatch / combine of this
        #: Buffer launched with (``"dispatch"``, ``"combine"``): its config's, or
        #: the default for the rank count (and for a combine, ``x``'s placement),
        #: capped to this rank's share of its GPU where ranks share one.
        self.num_sms_used: dict[str, int] = {}
        self._launch_sms: dict[int, int] = {}  # requested SMs -> launched
        self.explicitly_destroy = bool(explicitly_destroy)
        num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes)
        num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes)
        num_qps_per_rank = check_int("num_qps_per_rank", num_qps_per_rank)
        # The values (ep_core::calls::buffer_options, the Rust API's checks too): byte
        # counts >= 0 and multiples of 128, num_qps_per_rank positive, enable_shrink
        # only and num_rdma_bytes > 0 exactly in low_latency_mode.
        parts = _native.buffer_options_plan(
            num_nvl_bytes, num_rdma_bytes, bool(low_latency_mode), num_qps_per_rank,
            bool(enable_shrink),
        )  # fmt: skip
        # Bound of every intranode device wait (seconds of GPU time, default 30).
        device_timeout_ns = env_device_timeout_ns("MOELINK_DEVICE_TIMEOUT_S")
        if not torch.cuda.is_available():
            raise RuntimeError("moelink.Buffer needs a CUDA device")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before creating a Buffer")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.enable_shrink = bool(enable_shrink)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.device = torch.device("cuda", torch.cuda.current_device())

        # The group's shared bootstrap (made and checked at its first object:
        # every rank on this host, no NCCL group whose ranks share a GPU).
        native_group = _native_group(group, "Buffer")
        self._comm_stream = torch.cuda.Stream(device=self.device)
        self._comm_raw = self._comm_stream.cuda_stream
        # Orders the communication stream after the caller's and back (one event).
        self._order = _native.StreamOrder(self.device.index)
        timeout = env_host_timeout_s()
        # Bound of every low-latency receive: MOELINK_LL_TIMEOUT_S, else the
        # intranode one (30 s unless set), under the host bound so that the
        # device's error (naming the peer and counter) is the one raised.
        ll_timeout_ns = (
            env_device_timeout_ns("MOELINK_LL_TIMEOUT_S")
            if low_latency_mode and _env.get("MOELINK_LL_TIMEOUT_S") is not None
            else device_timeout_ns
        )
        self.nodes = None
        if num_nvl_bytes > 0 or low_latency_mode:
            # One native object, both parts (intranode: num_nvl_bytes > 0, with
            # num_rdma_bytes of cross-node regions outside low-latency mode, used
            # where the group spans nodes; low-latency: num_rdma_bytes in
            # low_latency_mode).
            ep = _native.EpBuffer(
                native_group, self.device.index, num_nvl_bytes, parts["num_ll_bytes"],
                timeout, device_timeout_ns, ll_timeout_ns,
                self.allow_nvlink_for_low_latency_mode, self.enable_shrink,
                parts["num_internode_bytes"],
            )  # fmt: skip
            self._native = ep if num_nvl_bytes > 0 else None
            if low_latency_mode:
                self._ll = ep
                self._ll_state = _native.LlCalls(
                    ep, self.group_size, self.device.index, current_raw_stream, EventOverlap
                )
            if self._native is not None:
                self.nodes = ep.nodes()
                # Direct dispatch (MOELINK_INTRANODE_RECV=direct): recv_x comes
                # from the receive pool that the peers write into.
                stats = ep.recv_pool_stats()
                self._recv_pool = stats is not None
                if stats is not None:
                    self._pool_range = (stats[0], stats[0] + stats[1])
                if self.nodes is None:
                    self._calls = _native.NormalCalls(
                        ep, self.group_size, self.device.index, self._comm_raw, self._order,
                        current_raw_stream, EventOverlap,
                    )  # fmt: skip
        #: This Buffer's handle in the op registry (``torch.ops.moelink.ll_dispatch`` /
        #: ``ll_combine`` take it); it is dropped by ``destroy()`` and when the Buffer
        #: is collected.
        self.handle = _registry.register(self)

    # ----- static helpers -------------------------------------------------------

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """SMs used by dispatch/combine when no ``config`` is passed: even, 2 to
        ``LIMITS["max_num_sms"]``, as ``Config.num_sms``."""
        n = _native.check_num_sms("new_num_sms", check_int("new_num_sms", new_num_sms))
        cls.num_sms = n
        cls._num_sms_set = True

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (pass it as ``previous_event``)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return EventOverlap(ev)

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """Tuned dispatch config for ``num_ranks`` (``set_num_sms`` overrides its SMs)."""
        return get_dispatch_config(num_ranks, num_sms=cls.num_sms if cls._num_sms_set else None)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """Tuned combine config for ``num_ranks`` (``set_num_sms`` overrides its SMs)."""
        return get_combine_config(num_ranks, num_sms=cls.num_sms if cls._num_sms_set else None)

    @staticmethod
    def is_sm90_compiled() -> bool:
        return any(a.startswith("90") for a in _native.compiled_archs())

    # ----- resources -----------------------------------------------------------

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._comm_stream

    def _buffer(self):
        if self._native is None:
            raise RuntimeError(
                "this Buffer has no NVLink buffer (destroyed, or created with num_nvl_bytes=0)"
            )
        # A timed-out wait leaves the ranks out of step: raise before launching.
        self._native.check_device_timeout("intranode")
        return self._native

    def check(self) -> None:
        """Raises what a kernel of this Buffer recorded, if anything: an expert id
        outside ``[-1, num_experts)`` (``ValueError`` naming the rank, token and
        column; reported once) or a device wait that timed out
        (``moelink.TimeoutError`` naming the rank and what it waited for)."""
        ep = self._native if self._native is not None else self._ll
        if ep is not None:
            ep.check_device()  # every part, intranode first

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """This rank's NVLink buffer from byte ``offset`` as a ``dtype`` tensor (1-D, or
        the first ``size.numel()`` elements viewed as ``size``). Peers write into it
        during dispatch/combine; it lives as long as the Buffer."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if use_rdma_buffer:
            if not (self.low_latency_mode and self.num_rdma_bytes > 0):
                raise ValueError(
                    "use_rdma_buffer=True needs a Buffer created with low_latency_mode=True "
                    "and num_rdma_bytes > 0"
                )
            ptr, allocated = self._ll_native().local_buffer("low_latency")
            nbytes = min(allocated, self.num_rdma_bytes)
        else:
            ptr, allocated = self._buffer().local_buffer("intranode")
            nbytes = min(allocated, self.num_nvl_bytes)  # the allocation is rounded up
        offset = check_int("offset", offset, minimum=0, maximum=nbytes)
        elem = torch.empty((), dtype=dtype).element_size()
        if offset % elem != 0:
            raise ValueError(f"offset {offset} is not a multiple of the {dtype} size {elem}")
        raw = torch.as_tensor(_CudaMemory(ptr + offset, nbytes - offset, self), device=self.device)
        t = raw[: (nbytes - offset) // elem * elem].view(dtype)
        if size is None:
            return t
        size = torch.Size(size)
        if size.numel() > t.numel():
            raise ValueError(
                f"size {list(size)} needs {size.numel()} elements, the buffer holds {t.numel()}"
            )
        return t[: size.numel()].view(size)

    def destroy(self) -> None:
        """Frees the buffer (every rank calls it). Needs ``explicitly_destroy=True``.

        Without ``enable_shrink`` it is collective: per part a barrier of the ranks,
        then the free. With ``enable_shrink`` no rank waits for another: a rank that
        stopped communicating (masked by the others) may destroy long before them, and
        each rank frees its buffers when it gets here (peers that mapped them keep the
        memory until they free theirs; see ``docs/api-notes.md``, "Shrink")."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer created with explicitly_destroy=True")
        _registry.unregister(self)
        self._calls = None
        ep = self._native if self._native is not None else self._ll
        if ep is None:
            return
        torch.cuda.synchronize(self.device)
        # Per part, intranode first: its device error, a barrier, the free. A
        # device error (a timeout of an earlier call) is raised after the
        # barriers and the frees, so that the other ranks' destroy() is not left
        # waiting and nothing stays allocated.
        try:
            ep.destroy(collective=True)
        finally:
            self._native = ep if ep.has_part("intranode") else None
            self._ll = ep if ep.has_part("low_latency") else None

    def __del__(self) -> None:
        ep = getattr(self, "_native", None)
        if ep is None:
            ep = getattr(self, "_ll", None)
        if ep is None:
            return
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.device)
        with contextlib.suppress(Exception):
            ep.destroy()
        self._native = None
        self._ll = None

    # ----- streams ---------------------------------------------------------------

    def _prologue(self, previous_event, async_finish, allocate_on_comm_stream):
        """The caller's (compute) stream as a raw handle, after the stream arguments
        are checked."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError(
                "allocate_on_comm_stream=True needs previous_event and async_finish=True"
            )
        if previous_event is not None:
            check_previous_event(previous_event)
        return current_raw_stream(self.device.index)

    def _enter_comm(self, compute, previous_event):
        """The communication stream waits for ``previous_event`` where it holds an
        event, else for everything queued on the compute stream so far."""
        if previous_event is not None and previous_event.event is not None:
            self._comm_stream.wait_event(previous_event.event)
        else:
            self._order.after(self._comm_raw, compute)

    def _reserve_recv_x(self, plan) -> bool:
        """Direct dispatch (``MOELINK_INTRANODE_RECV=direct``): reserves the receive
        pool range of the ``recv_x`` of a dispatch of ``plan`` (a
        ``_native.DispatchPlan``) before its send publishes it: the plan's rows (a
        cached dispatch's, or ``num_worst_tokens``), else as many as the buffer can
        receive (the count cuts it later). False without a pool, while a CUDA graph
        is captured, or when the pool is full: the rows then come by a copy into a
        ``recv_x`` allocated as every output."""
        if not self._recv_pool:
            return False
        if _buffer_common._capturing():
            # A range reserved by a call that failed before taking it must not
            # be published by this one: the graph would write into it on every
            # replay, long after the range went back to the pool.
            self._native.recv_pool_take(0)
            return False
        rows = plan.num_recv_rows
        return self._native.recv_pool_reserve(
            plan.hidden_bytes, plan.num_scales, plan.num_topk, None if rows < 0 else rows
        )

    def _take_recv_x(self, spec):
        """A dispatch's ``recv_x`` from its reserved pool range (after the send, whose
        senders write the rows straight into it; ``recv_x`` is never a zeroed
        output), or a new tensor when there are no rows."""
        shape, strides, dtype, _ = spec
        capsule = self._native.recv_pool_take(math.prod(shape) * dtype.itemsize)
        if capsule is None:  # no rows
            return empty(spec, self.device)
        return torch.utils.dlpack.from_dlpack(capsule).view(dtype).as_strided(shape, strides)

    def _alloc_ctx(self, allocate_on_comm_stream):
        if allocate_on_comm_stream:
            return torch.cuda.stream(self._comm_stream)
        return NO_STREAM_SWITCH

    def _epilogue(self, compute, async_finish, allocate_on_comm_stream, inputs, outputs):
        if allocate_on_comm_stream:
            # Made on the communication stream, used next on the compute one
            # (still the current stream: only the allocations switched).
            compute_stream = torch.cuda.current_stream(self.device)
            for t in outputs:
                if t is not None:
                    t.record_stream(compute_stream)
        if async_finish:
            event = finish_async(self._comm_stream, (*inputs, *outputs))
        else:
            self._order.after(compute, self._comm_raw)
            event = EventOverlap(None)
        # What a kernel recorded (an expert id out of range, in this call or an
        # earlier one): raised after the launches and the stream bookkeeping, so
        # the ranks stay in step and no tensor is freed under a running kernel.
        self._native.check_device("intranode")
        return event

    def _num_sms(self, config, default, call: str, in_pool: bool = False) -> int:
        """SMs of a call (``call``: "dispatch" or "combine"), recorded in
        ``num_sms_used``: ``config``'s, else the default config's, whose only
        input is the rank count and ``set_num_sms`` (``default``: the class's
        ``get_dispatch_config`` or ``get_combine_config``), so it is made once
        per such state instead of at every call. A combine whose ``x`` lies in
        the receive pool (``in_pool``), with neither a config nor
        ``set_num_sms`` nor a subclass's own ``get_combine_config``, takes the
        native default for that case, which needs fewer SMs."""
        if config is None:
            cls = type(self)
            key = (cls, call, in_pool, self.group_size, cls.num_sms, cls._num_sms_set)
            sms = _DEFAULT_SMS.get(key)
            if sms is None:
                own = getattr(default, "__func__", None) is Buffer.get_combine_config.__func__
                if in_pool and own and not cls._num_sms_set:
                    sms = _native.default_num_sms("combine_in_pool", self.group_size)
                else:
                    sms = default(self.group_size).num_sms
                _DEFAULT_SMS[key] = sms
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a moelink.Config, got {type(config).__name__}")
        else:
            sms = config.num_sms
        # What the kernels launch with: capped to this rank's share of its GPU.
        used = self._launch_sms.get(sms)
        if used is None:
            used = self._launch_sms[sms] = self._native.launch_sms(sms) or sms
        self.num_sms_used[call] = used
        return sms

    def _eager(self, previous_event, async_finish, allocate_on_comm_stream):
        """The Buffer's ``_native.NormalCalls`` where a normal-mode call with these
        stream arguments is eager (no event, no asynchronous finish, outputs on
        the caller's stream), so that it may run whole in one native call; else
        None."""
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            return self._calls
        return None

    def _in_pool(self, x) -> bool:
        """Whether ``x``'s rows start in this rank's receive pool (the direct
        combine then reads them where they lie)."""
        start, end = self._pool_range
        return start <= x.data_ptr() < end and x.numel() > 0

    # ----- layout ----------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Per-rank and per-expert token counts and ``is_token_in_rank`` of ``topk_idx``.

        Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool, event)``.
        """
        calls = self._eager(previous_event, async_finish, allocate_on_comm_stream)
        if calls is not None and not _buffer_common._CHECK_IDS:
            # The eager call whole in one native call (ep-core's engine); None
            # where it declines, having done nothing.
            done = calls.layout(topk_idx, num_experts)
            if done is not None:
                return done
        return self._layout_checked(
            topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream
        )

    @plain_torch
    def _layout_checked(
        self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream
    ):
        """``get_dispatch_layout`` on the checked path (plan cache, ``OutputSet``,
        the native launch), for every call the one native call does not take."""
        native = self._buffer()
        R = self.group_size
        key = ("layout", _sig(topk_idx), num_experts, type(num_experts))
        entry = self._plans.get(key)
        if entry is None:
            e = check_int("num_experts", num_experts)
            plan = _native.layout_plan(
                R, device_index(self.device), tensor_meta("topk_idx", topk_idx), e
            )
            if _check_ids():
                check_topk_values(topk_idx, e)
            outputs = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank",
                       "layout_scratch")  # fmt: skip
            entry = (plan, OutputSet(output_specs(plan, outputs), self.device))
            self._plans.put(key, entry)
        elif _check_ids():
            check_topk_values(topk_idx, entry[0].num_experts)
        plan, outputs = entry
        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            dev = self.device
            per_rank, per_expert, in_rank, scratch = outputs.empty()
            per_node = None
            if self.nodes is not None:
                per_node = torch.empty(self.nodes[0], dtype=torch.int32, device=dev)
        self._enter_comm(compute, previous_event)
        native.layout(
            self._comm_raw,
            plan,
            _ptr(topk_idx),
            (_ptr(per_rank), _ptr(per_expert), _ptr(in_rank), _ptr(scratch)),
            _ptr(per_node),
        )
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (topk_idx, scratch),
            (per_rank, per_expert, in_rank, per_node),
        )
        return per_rank, per_node, per_expert, in_rank, event

    # ----- dispatch ---------------------------------------------------------------

    def _dispatch_plan(
        self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
    ):  # fmt: skip
        """Every check of a dispatch (``_native.dispatch_plan``); returns ``(plan,
        output specs, cached outputs)``: the ``_native.DispatchPlan`` (which the native
        calls take for every size; its ``num_recv_rows``, of a cached dispatch or
        ``num_worst_tokens``, is -1 where only the counts tell them), the specs of
        ``_DISPATCH_OUTPUTS`` and, with a handle, the cached dispatch's ``recv_x`` and
        scales as an ``OutputSet`` (else None)."""
        data, scales = _x_metas(x)
        p = _native.dispatch_plan(
            self.group_size, device_index(self.device), data, scales,
            None if handle is None else _handle_metas(handle),
            optional_meta("num_tokens_per_rank", num_tokens_per_rank),
            # Across nodes it is get_dispatch_layout's count per node (the kernels
            # count again in notify); within one node it must be None.
            num_tokens_per_rdma_rank is not None and self.nodes is None,
            optional_meta("is_token_in_rank", is_token_in_rank),
            optional_meta("num_tokens_per_expert", num_tokens_per_expert),
            optional_meta("topk_idx", topk_idx), optional_meta("topk_weights", topk_weights),
            check_int("expert_alignment", expert_alignment),
            check_int("num_worst_tokens", num_worst_tokens),
        )  # fmt: skip
        if topk_idx is not None and p.num_worst_tokens == 0 and _check_ids():
            check_topk_values(topk_idx, p.num_experts)
        specs = output_specs(p, _DISPATCH_OUTPUTS)
        # A cached dispatch's recv_x and scales have fixed shapes: made in one call.
        cached = None if handle is None else OutputSet(specs[2:4], self.device)
        return p, specs, cached

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sends each token to every rank hosting one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)`` as ``deep_ep.Buffer.dispatch``.
        """
        calls = self._eager(previous_event, async_finish, allocate_on_comm_stream)
        if (
            calls is not None
            and not self._recv_pool
            and (handle is not None or not _buffer_common._CHECK_IDS)
        ):
            # An eager dispatch whole in one native call (ep-core's engine);
            # None where it declines, having done nothing.
            num_sms = self._num_sms(config, type(self).get_dispatch_config, "dispatch")
            done = calls.dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                num_sms,
            )  # fmt: skip
            if done is not None:
                return done
        return self._dispatch_checked(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            config, previous_event, async_finish, allocate_on_comm_stream,
        )  # fmt: skip

    @plain_torch
    def _dispatch_checked(
        self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
        config, previous_event, async_finish, allocate_on_comm_stream,
    ):  # fmt: skip
        """``dispatch`` on the checked path: every check in Python's order (plan
        cache, ``OutputSet``, the native launches), for every call the one native
        call does not take (stream arguments, the receive pool, across nodes,
        ``MOELINK_CHECK_IDS`` on a full dispatch, a refused argument)."""
        native = self._buffer()
        num_sms = self._num_sms(config, type(self).get_dispatch_config, "dispatch")
        key = (
            "dispatch", _x_sig(x), None if handle is None else _handle_sig(handle),
            _sig(num_tokens_per_rank), num_tokens_per_rdma_rank is None, _sig(is_token_in_rank),
            _sig(num_tokens_per_expert), _sig(topk_idx), _sig(topk_weights), expert_alignment,
            num_worst_tokens, type(expert_alignment), type(num_worst_tokens),
        )  # fmt: skip
        entry = self._plans.get(key)
        if entry is None:
            entry = self._dispatch_plan(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            )  # fmt: skip
            self._plans.put(key, entry)
        elif topk_idx is not None and _check_ids() and entry[0].num_worst_tokens == 0:
            check_topk_values(topk_idx, entry[0].num_experts)
        plan, specs, cached_outputs = entry
        data, scales = x if type(x) is tuple else (x, None)
        _check_aligned("x", data)
        dev = self.device

        if handle is not None:
            rpm, send_head = _entry(handle, "rank_prefix_matrix"), _entry(handle, "send_head")
            compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
            reserved = self._reserve_recv_x(plan)
            # Allocated before any kernel of the dispatch runs (see below).
            with self._alloc_ctx(allocate_on_comm_stream):
                if reserved:
                    recv_x, recv_scales = None, empty(specs[3], dev)
                else:
                    recv_x, recv_scales = cached_outputs.empty()
            self._enter_comm(compute, previous_event)
            stream = self._comm_raw
            # A cached dispatch (the plan has the handle) sends no routing: the
            # handle's rank_prefix_matrix and send_head are its inputs.
            native.dispatch_send(
                stream,
                plan,
                num_sms,
                (_ptr(data), _ptr(scales), _ptr(rpm), _ptr(send_head)),
                **self._x_handle(handle, send_head),
            )
            if reserved:  # wraps the published range: no allocation, no kernel
                recv_x = self._take_recv_x(specs[2])
            # The rows are the handle's, in the plan.
            native.dispatch_recv(
                stream, plan, num_sms, (_ptr(rpm), _ptr(recv_x), _ptr(recv_scales))
            )
            event = self._epilogue(
                compute,
                async_finish,
                allocate_on_comm_stream,
                (data, scales, *handle),
                (recv_x, recv_scales),
            )
            out_x = recv_x if scales is None else (recv_x, recv_scales)
            return out_x, None, None, None, None, event

        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        # Every output is allocated while no kernel of the dispatch runs: a
        # cudaMalloc beside a running kernel holds back the CUDA work issued
        # after it (the proxy's copies too) until that kernel ends, which a
        # kernel waiting for that work never does (docs/design-internode.md). With
        # num_worst_tokens the rows are known now (the plan's); else after notify.
        reserved = self.nodes is None and self._reserve_recv_x(plan)
        with self._alloc_ctx(allocate_on_comm_stream):
            rpm, send_head = empty(specs[0], dev), empty(specs[1], dev)
            xt = self._x_tensors(plan)
            outs = rows = None
            if plan.num_worst_tokens > 0:
                recv_x = None if reserved else empty(specs[2], dev)
                outs = [recv_x, *(empty(spec, dev) for spec in specs[3:])]
        self._enter_comm(compute, previous_event)
        stream = self._comm_raw
        epoch = native.dispatch_send(
            stream,
            plan,
            num_sms,
            (_ptr(data), _ptr(scales), _ptr(rpm), _ptr(send_head)),
            (_ptr(topk_idx), _ptr(topk_weights), _ptr(is_token_in_rank),
             _ptr(num_tokens_per_expert)),
            **({} if xt is None else {"xnode": self._xnode(*xt)}),
        )  # fmt: skip
        if outs is None:
            # notify has ended (its counts are in), so no kernel of this
            # dispatch that waits on other work runs while the outputs are
            # allocated (see above; within one node the send half, launched
            # right after notify, may still run, but it waits on nothing).
            rows, per_expert = native.wait_counts(epoch, plan)
            per_expert = list(per_expert)
            specs = [at_rows(spec, rows) for spec in specs[2:]]
            with self._alloc_ctx(allocate_on_comm_stream):
                recv_x = None if reserved else empty(specs[0], dev)
                outs = [recv_x, *(empty(spec, dev) for spec in specs[1:])]
        else:
            per_expert = []  # rows: num_worst_tokens, in the plan and its specs
            specs = specs[2:]
        if reserved:  # the published range, cut to the rows
            outs[0] = self._take_recv_x(specs[0])
        recv_x, recv_scales, recv_idx, recv_w, recv_src_idx, cpm, rcpm = outs
        native.dispatch_recv(
            stream,
            plan,
            num_sms,
            (_ptr(rpm), _ptr(recv_x), _ptr(recv_scales)),
            (_ptr(recv_idx), _ptr(recv_w), _ptr(recv_src_idx)),
            rows,
        )
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert),
            (recv_x, recv_scales, recv_idx, recv_w, recv_src_idx, rpm, send_head, *(xt or ())),
        )
        if xt is None:
            handle = (rpm, cpm, rcpm, recv_src_idx, is_token_in_rank, send_head)
        else:
            node_head, xcounts, fwd_meta, rdma_prefix = xt
            # DeepEP's recv_gbl_rank_prefix_sum: the tokens received from ranks
            # 0..s (inclusive), the rank prefix matrix's column of this rank.
            gbl_prefix = rpm[:, self.rank]
            handle = (is_token_in_rank, xcounts, rpm, fwd_meta, rdma_prefix, cpm, gbl_prefix,
                      recv_src_idx, node_head, send_head)  # fmt: skip
        out_x = recv_x if scales is None else (recv_x, recv_scales)
        return out_x, recv_idx, recv_w, per_expert, handle, event

    def _x_tensors(self, plan):
        """The handle tensors of an internode dispatch of ``plan`` (None within one
        node): node heads ``[n, nodes]``, counts ``[2 * nodes]``, forwarding records
        ``[nodes, T, 1 + ranks per node]`` (T the tokens per rank the buffer fits for
        these records) and DeepEP's ``recv_rdma_rank_prefix_sum`` ``[nodes]``, int32."""
        if self.nodes is None:
            return None
        nodes, per_node = self.nodes
        n = plan.num_tokens
        key = (plan.hidden_bytes, plan.num_scales, plan.num_topk)
        caps = self.__dict__.setdefault("_x_capacity", {})
        cap = caps.get(key)
        if cap is None:
            cap = caps[key] = self._native.internode_capacity(*key)
        i32 = dict(dtype=torch.int32, device=self.device)
        return (
            torch.empty((n, nodes), **i32),
            torch.empty(2 * nodes, **i32),
            torch.empty((nodes, max(cap, n, 1), 1 + per_node), **i32),
            torch.empty(nodes, **i32),
        )

    @staticmethod
    def _xnode(node_head, xcounts, fwd_meta, rdma_prefix=None):
        """The native calls' ``xnode`` argument: the addresses of the node heads,
        counts, forwarding records (and their tokens per node), and of
        ``recv_rdma_rank_prefix_sum`` (0: not written; a normal dispatch writes it)."""
        return (_ptr(node_head), _ptr(xcounts), _ptr(fwd_meta), fwd_meta.shape[1],
                _ptr(rdma_prefix))  # fmt: skip

    def _x_handle(self, handle, send_head, recv_src_idx=False):
        """The native calls' internode keywords from a handle: ``xnode`` and, for a
        combine (``recv_src_idx``), the received rows' source tokens; none within one
        node. A handle of the other kind, or entries of the wrong dtype, device or
        shape, get ``ValueError`` / ``TypeError`` naming the entry."""
        if self.nodes is None:
            if len(handle) != 6:
                raise ValueError(
                    f"rank {self.rank}: handle has {len(handle)} entries; a Buffer within one "
                    "node takes the 6-tuple of an intranode dispatch"
                )
            return {}
        if len(handle) != 10:
            raise ValueError(
                f"rank {self.rank}: handle has {len(handle)} entries; a Buffer whose group "
                f"spans {self.nodes[0]} nodes takes the 10-tuple of an internode dispatch"
            )
        nodes, per_node = self.nodes
        n = send_head.shape[0]
        want = {"node_head": (n, nodes), "xcounts": (2 * nodes,)}
        layout = _HANDLE_LAYOUT[10]
        for name in _X_ENTRIES:
            i, label = layout[name]
            t = handle[i]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"handle[{i}] ({label}) must be a torch.Tensor")
            if t.dtype != torch.int32 or t.device != self.device or not t.is_contiguous():
                raise ValueError(
                    f"rank {self.rank}: handle[{i}] ({label}) must be a contiguous int32 tensor "
                    f"on {self.device}, got {t.dtype} on {t.device}"
                )
            shape = tuple(t.shape)
            ok = (
                shape == want[name]
                if name in want
                else (len(shape) == 3 and shape[0] == nodes and shape[2] == 1 + per_node)
            )
            if not ok:
                raise ValueError(
                    f"rank {self.rank}: handle[{i}] ({label}) has shape {list(shape)}: not the "
                    f"one this Buffer's dispatch made ({nodes} nodes of {per_node} ranks, {n} "
                    "tokens)"
                )
        kw = {"xnode": self._xnode(*(_entry(handle, name) for name in _X_ENTRIES))}
        if recv_src_idx:
            kw["recv_src_idx"] = _ptr(_entry(handle, "recv_src_idx"))
        return kw

    # ----- combine ---------------------------------------------------------------

    @plain_torch
    def get_combine_buffer(self, handle, hidden: int) -> torch.Tensor:
        """An uninitialized bf16 ``[rows, hidden]`` tensor for the expert outputs that
        ``combine(x, handle)`` then takes as ``x`` (``rows``: those the dispatch of
        ``handle`` delivered). With ``MOELINK_INTRANODE_RECV=direct`` it is a range of
        the receive pool, so that combine reads it where it lies, with no copy of the
        rows; like such a ``recv_x`` it ignores ``record_stream`` and its range returns
        to the pool when it is freed. Otherwise (no pool, across nodes, the pool full,
        or while a CUDA graph is captured: the graph's memory pool must hold what its
        kernels write) an ordinary tensor."""
        self._buffer()
        if type(handle) is not tuple:
            raise TypeError(
                f"rank {self.rank}: handle must be the tuple a dispatch returned, got "
                f"{type(handle).__name__}"
            )
        if len(handle) not in _HANDLE_LAYOUT:
            raise ValueError(
                f"rank {self.rank}: handle has {len(handle)} entries; a dispatch returns 6 "
                "(one node) or 10 (several)"
            )
        if type(hidden) is not int:
            raise TypeError(f"rank {self.rank}: hidden must be an int, got {type(hidden).__name__}")
        if hidden <= 0 or hidden % 64 != 0:
            raise ValueError(
                f"rank {self.rank}: hidden must be a positive multiple of 64, got {hidden}"
            )
        i, label = _HANDLE_LAYOUT[len(handle)]["recv_src_idx"]
        src = handle[i]
        if not isinstance(src, torch.Tensor) or src.dim() != 1:
            raise TypeError(f"rank {self.rank}: handle[{i}] ({label}) must be a 1-D torch.Tensor")
        rows = src.shape[0]
        if rows > 0 and self._recv_pool and not _buffer_common._capturing():
            capsule = self._native.recv_pool_tensor(rows * hidden * 2)
            if capsule is not None:
                t = torch.utils.dlpack.from_dlpack(capsule)
                return t.view(torch.bfloat16).view(rows, hidden)
        return torch.empty((rows, hidden), dtype=torch.bfloat16, device=self.device)

    def _combine_plan(self, x, handle, topk_weights, bias):
        """Every check of a combine (``_native.combine_plan``); returns ``(plan,
        outputs)``: the ``_native.CombinePlan`` (which ``EpBuffer.combine`` takes for
        every size) and its outputs as an ``OutputSet``."""
        h = _handle_metas(handle)
        p = _native.combine_plan(
            self.group_size, device_index(self.device), tensor_meta("x", x), h,
            optional_meta("topk_weights", topk_weights), _bias_metas(bias),
        )  # fmt: skip
        outputs = OutputSet(output_specs(p, ("combined_x", "combined_topk_weights")), self.device)
        return p, outputs

    def combine(
        self,
        x: torch.Tensor,
        handle,
        topk_weights=None,
        bias=None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns every token's float32 sum of the copies sent back by the ranks it
        was dispatched to (plus ``bias``), as bf16: ``(combined_x, combined_topk_weights,
        event)`` as ``deep_ep.Buffer.combine``."""
        calls = self._eager(previous_event, async_finish, allocate_on_comm_stream)
        if calls is not None and type(x) is torch.Tensor:
            # The eager call whole in one native call (ep-core's engine); None
            # where it declines, having done nothing.
            in_pool = self._recv_pool and self._in_pool(x)
            num_sms = self._num_sms(config, type(self).get_combine_config, "combine", in_pool)
            done = calls.combine(x, handle, topk_weights, bias, num_sms)
            if done is not None:
                return done
        return self._combine_checked(
            x, handle, topk_weights, bias, config, previous_event, async_finish,
            allocate_on_comm_stream,
        )  # fmt: skip

    @plain_torch
    def _combine_checked(
        self, x, handle, topk_weights, bias, config, previous_event, async_finish,
        allocate_on_comm_stream,
    ):  # fmt: skip
        """``combine`` on the checked path: every check in Python's order (plan
        cache, ``OutputSet``, the native launch), for every call the one native
        call declines (``previous_event``, ``async_finish``, across nodes, a refused
        argument)."""
        native = self._buffer()
        key = ("combine", _handle_sig(handle), _sig(x), _sig(topk_weights), _bias_sig(bias))
        entry = self._plans.get(key)
        if entry is None:
            entry = self._combine_plan(x, handle, topk_weights, bias)
            self._plans.put(key, entry)
        plan, outputs = entry
        rpm, send_head = _entry(handle, "rank_prefix_matrix"), _entry(handle, "send_head")
        b0, b1 = _bias_pair(bias)
        for name, t in (("x", x), ("bias[0]", b0), ("bias[1]", b1)):
            _check_aligned(name, t)
        in_pool = self._recv_pool and self.nodes is None and self._in_pool(x)
        num_sms = self._num_sms(config, type(self).get_combine_config, "combine", in_pool)
        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            out, out_w = outputs.empty()
        self._enter_comm(compute, previous_event)
        native.combine(
            self._comm_raw,
            plan,
            num_sms,
            (_ptr(x), _ptr(topk_weights), _ptr(rpm), _ptr(send_head), _ptr(b0), _ptr(b1),
             _ptr(out), _ptr(out_w)),
            **self._x_handle(handle, send_head, recv_src_idx=True),
        )  # fmt: skip
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (x, topk_weights, b0, b1, *handle),
            (out, out_w),
        )
        return out, out_w, event
