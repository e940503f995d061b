"""``moelink.Buffer``: DeepEP's ``deep_ep.Buffer`` API on moelink's intranode kernels.

Every argument is checked before anything is launched (``ValueError`` /
``TypeError`` naming the argument). Kernels run on the buffer's communication
stream, which first waits for the caller's current stream (or ``previous_event``);
see ``docs/design-intranode.md`` for the kernels and ``docs/architecture.md`` for
the layers. Differences from DeepEP are listed in ``docs/api-notes.md``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from . import _native, _registry
from ._buffer_common import PlanCache, _check_ids, _CudaMemory
from ._device_timeout import env_device_timeout_ns
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
    LIMITS,
    check_bias,
    check_dispatch_x,
    check_experts_ranks,
    check_hidden_bytes,
    check_int,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
)
from .checks import tensor_ptr as _ptr
from .checks import tensor_sig as _sig
from .config import Config, get_combine_config, get_dispatch_config
from .low_latency import LowLatencyMixin

__all__ = ["Buffer", "EventOverlap"]

#: (class, default config's kind, ranks, num_sms, set_num_sms called) -> SMs.
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


def _handle_sig(handle):
    """``tensor_sig`` of the parts of an intranode handle that the checks read."""
    if type(handle) is not tuple or len(handle) != 6:
        return _NO_SIG
    return (_sig(handle[0]), _sig(handle[3]), _sig(handle[4]), _sig(handle[5]))


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


class Buffer(LowLatencyMixin):
    """Communication buffer for MoE dispatch and combine among the ranks of ``group``
    (one GPU per rank, all on one host). Call-compatible with ``deep_ep.Buffer``.

    ``num_nvl_bytes`` is the NVLink buffer each rank allocates and every peer maps;
    size it with ``Config.get_nvl_buffer_size_hint`` (moelink keeps a fixed slot per
    token, so it depends on the largest batch). ``num_rdma_bytes`` is accepted for
    compatibility and must be 0 without an internode path. ``low_latency_mode=True``
    allocates ``num_rdma_bytes`` of low-latency buffer (size it with
    ``get_low_latency_rdma_size_hint``); see ``moelink.low_latency``.

    Every intranode device wait is bounded by ``MOELINK_DEVICE_TIMEOUT_S`` seconds of
    GPU time (default 30, read at creation; positive, else ``ValueError``); a wait
    that runs out raises ``moelink.TimeoutError`` naming the rank and the peer.
    """

    #: SMs of dispatch/combine when no config is given (``set_num_sms``).
    num_sms: int = 20
    _num_sms_set = False

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
        self.explicitly_destroy = bool(explicitly_destroy)
        num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if v % 128 != 0:
                raise ValueError(f"{name} must be a multiple of 128, got {v}")
        if enable_shrink and not low_latency_mode:
            raise ValueError("enable_shrink=True needs low_latency_mode=True")
        if low_latency_mode and num_rdma_bytes == 0:
            raise ValueError(
                "low_latency_mode=True needs num_rdma_bytes > 0 (the low-latency buffer); "
                "size it with Buffer.get_low_latency_rdma_size_hint"
            )
        if num_rdma_bytes > 0 and not low_latency_mode:
            raise ValueError(
                "num_rdma_bytes must be 0 without low_latency_mode: moelink has no internode "
                "(RDMA) path for normal kernels; Config.get_rdma_buffer_size_hint returns 0"
            )
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
        timeout = float(os.environ.get("MOELINK_TIMEOUT_S", "60"))
        # Bound of every low-latency receive: MOELINK_LL_TIMEOUT_S, else the
        # intranode one (30 s unless set), under the host bound so that the
        # device's error (naming the peer and counter) is the one raised.
        ll_timeout_ns = (
            env_device_timeout_ns("MOELINK_LL_TIMEOUT_S")
            if low_latency_mode and "MOELINK_LL_TIMEOUT_S" in os.environ
            else device_timeout_ns
        )
        if num_nvl_bytes > 0 or low_latency_mode:
            # One native object, both parts (intranode: num_nvl_bytes > 0;
            # low-latency: num_rdma_bytes, > 0 exactly in low_latency_mode).
            ep = _native.EpBuffer(
                native_group, self.device.index, num_nvl_bytes, num_rdma_bytes, timeout,
                device_timeout_ns, ll_timeout_ns, self.allow_nvlink_for_low_latency_mode,
                self.enable_shrink,
            )  # fmt: skip
            self._native = ep if num_nvl_bytes > 0 else None
            if low_latency_mode:
                self._ll = ep
        #: This Buffer's handle in the op registry (``torch.ops.moelink.ll_dispatch`` /
        #: ``ll_combine`` take it); it is dropped by ``destroy()`` and when the Buffer
        #: is collected.
        self.handle = _registry.register(self)

    # ----- static helpers -------------------------------------------------------

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """SMs used by dispatch/combine when no ``config`` is passed (even)."""
        n = check_int("new_num_sms", new_num_sms, minimum=2, maximum=LIMITS["max_num_sms"])
        if n % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {n}")
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
        """Frees the buffer (collective: every rank calls it). Needs ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer created with explicitly_destroy=True")
        _registry.unregister(self)
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

    def _check_device(self, **tensors) -> None:
        for name, t in tensors.items():
            if t is not None and t.device != self.device:
                raise ValueError(
                    f"{name} must be on this Buffer's device {self.device}, got {t.device}"
                )

    def _num_sms(self, config, default) -> int:
        """SMs of a call: ``config``'s, else the default config's, whose only
        input is the rank count and ``set_num_sms`` (``default``: the class's
        ``get_dispatch_config`` or ``get_combine_config``), so it is made once
        per such state instead of at every call."""
        if config is None:
            cls = type(self)
            key = (cls, default.__name__, self.group_size, cls.num_sms, cls._num_sms_set)
            sms = _DEFAULT_SMS.get(key)
            if sms is None:
                sms = _DEFAULT_SMS[key] = default(self.group_size).num_sms
            return sms
        if not isinstance(config, Config):
            raise TypeError(f"config must be a moelink.Config, got {type(config).__name__}")
        return config.num_sms

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
        native = self._buffer()
        R = self.group_size
        key = ("layout", _sig(topk_idx), num_experts, type(num_experts))
        plan = self._plans.get(key)
        if plan is None:
            check_experts_ranks(num_experts, R)
            check_topk_idx(topk_idx, num_experts, check_values=_check_ids())
            check_tensor("topk_idx", topk_idx, contiguous=True)
            self._check_device(topk_idx=topk_idx)
            n, k = topk_idx.shape
            num_experts = int(num_experts)
            plan = (n, k, num_experts, native.layout_scratch_elems(n, num_experts))
            self._plans.put(key, plan)
        elif _check_ids():
            check_topk_idx(topk_idx, num_experts, check_values=True)
        n, k, num_experts, scratch_elems = plan
        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
            in_rank = torch.empty((n, R), dtype=torch.bool, device=self.device)
            scratch = torch.empty(scratch_elems, dtype=torch.int32, device=self.device)
        self._enter_comm(compute, previous_event)
        native.layout(
            self._comm_raw,
            _ptr(topk_idx),
            n,
            k,
            num_experts,
            _ptr(per_rank),
            _ptr(per_expert),
            _ptr(in_rank),
            _ptr(scratch),
        )
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (topk_idx, scratch),
            (per_rank, per_expert, in_rank),
        )
        return per_rank, None, per_expert, in_rank, event

    # ----- dispatch ---------------------------------------------------------------

    def _check_handle(self, handle, num_tokens: int | None = None):
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise ValueError("handle must be the 6-tuple an intranode dispatch returned")
        R = self.group_size
        rpm, cpm, rcpm, recv_src_idx, in_rank, send_head = handle
        check_tensor(
            "handle[0] (rank_prefix_matrix)", rpm, dtype=torch.int32, shape=(R, R), contiguous=True
        )
        check_tensor(
            "handle[3] (recv_src_idx)", recv_src_idx, dtype=torch.int32, dims=1, contiguous=True
        )
        check_tensor("handle[4] (is_token_in_rank)", in_rank, dtype=torch.bool, dims=2)
        check_tensor("handle[5] (send_head)", send_head, dtype=torch.int32, dims=2, contiguous=True)
        if send_head.shape[1] != R:
            raise ValueError(
                f"handle[5] (send_head) must have {R} columns, got {list(send_head.shape)}"
            )
        if num_tokens is not None and send_head.shape[0] != num_tokens:
            raise ValueError(
                f"x has {num_tokens} tokens but the handle was made for {send_head.shape[0]}"
            )
        self._check_device(rank_prefix_matrix=rpm, recv_src_idx=recv_src_idx, send_head=send_head)
        return rpm, recv_src_idx, send_head

    def _dispatch_plan(
        self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
    ):  # fmt: skip
        """Every check of a dispatch; returns ``(N, hidden bytes, scale columns, scale
        strides, expert_alignment, num_worst_tokens, E, K, rows of a cached dispatch)``."""
        R = self.group_size
        data, scales = check_dispatch_x(x)
        self._check_device(x=data, scales=scales)
        n, hidden = data.shape
        hidden_bytes = hidden * data.element_size()
        num_scales = 0 if scales is None else scales.shape[1]
        s_strides = (0, 0) if scales is None else tuple(scales.stride())
        expert_alignment = check_int(
            "expert_alignment", expert_alignment, minimum=1, maximum=LIMITS["max_expert_alignment"]
        )
        num_worst_tokens = check_int(
            "num_worst_tokens", num_worst_tokens, minimum=0, maximum=LIMITS["max_recv_tokens"]
        )
        if num_tokens_per_rdma_rank is not None:
            raise ValueError("num_tokens_per_rdma_rank must be None within one node")
        head = (n, hidden_bytes, num_scales, s_strides, expert_alignment, num_worst_tokens)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx / topk_weights")
            _, recv_src_idx, _ = self._check_handle(handle, n)
            return (*head, 0, 0, recv_src_idx.shape[0])
        if is_token_in_rank is None or num_tokens_per_expert is None or num_tokens_per_rank is None:
            raise ValueError(
                "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                "num_tokens_per_expert (from get_dispatch_layout)"
            )
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(R,))
        check_tensor(
            "is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(n, R), contiguous=True
        )
        check_tensor(
            "num_tokens_per_expert",
            num_tokens_per_expert,
            dtype=torch.int32,
            dims=1,
            contiguous=True,
        )
        num_experts = num_tokens_per_expert.shape[0]
        check_experts_ranks(num_experts, R)
        num_topk = 0
        if topk_idx is not None:
            sync_ok = num_worst_tokens == 0 and _check_ids()
            check_topk_idx(topk_idx, num_experts, check_values=sync_ok)
            check_tensor("topk_idx", topk_idx, shape=(n, None), contiguous=True)
            num_topk = topk_idx.shape[1]
            if topk_weights is not None:
                check_topk_weights(topk_weights, topk_idx)
                check_tensor("topk_weights", topk_weights, contiguous=True)
        elif topk_weights is not None:
            raise ValueError("topk_weights needs topk_idx")
        self._check_device(
            num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        return (*head, num_experts, num_topk, 0)

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
        native = self._buffer()
        R = self.group_size
        num_sms = self._num_sms(config, type(self).get_dispatch_config)
        key = (
            "dispatch", _x_sig(x), None if handle is None else _handle_sig(handle),
            _sig(num_tokens_per_rank), num_tokens_per_rdma_rank is None, _sig(is_token_in_rank),
            _sig(num_tokens_per_expert), _sig(topk_idx), _sig(topk_weights), expert_alignment,
            num_worst_tokens, type(expert_alignment), type(num_worst_tokens),
        )  # fmt: skip
        plan = self._plans.get(key)
        if plan is None:
            plan = self._dispatch_plan(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            )  # fmt: skip
            self._plans.put(key, plan)
        elif topk_idx is not None and plan[5] == 0 and _check_ids():
            check_topk_idx(topk_idx, plan[6], check_values=True)
        (n, hidden_bytes, num_scales, s_strides, expert_alignment, num_worst_tokens, num_experts,
         num_topk, rows) = plan  # fmt: skip
        data, scales = x if type(x) is tuple else (x, None)
        _check_aligned("x", data)

        if handle is not None:
            rpm, send_head = handle[0], handle[5]
            compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
            self._enter_comm(compute, previous_event)
            stream = self._comm_raw
            native.dispatch_send(
                stream,
                True,
                n,
                hidden_bytes,
                num_scales,
                0,
                R,
                _ptr(data),
                _ptr(scales),
                s_strides,
                0,
                0,
                0,
                0,
                _ptr(rpm),
                _ptr(send_head),
                1,
                num_sms,
            )
            with self._alloc_ctx(allocate_on_comm_stream):
                recv_x, recv_scales = self._alloc_recv_x(data, scales, rows)
            native.dispatch_recv(
                stream,
                n,
                hidden_bytes,
                num_scales,
                0,
                R,
                _ptr(rpm),
                rows,
                _ptr(recv_x),
                _ptr(recv_scales),
                self._strides(recv_scales),
                0,
                0,
                0,
                num_sms,
            )
            event = self._epilogue(
                compute,
                async_finish,
                allocate_on_comm_stream,
                (data, scales, rpm, send_head),
                (recv_x, recv_scales),
            )
            out_x = recv_x if scales is None else (recv_x, recv_scales)
            return out_x, None, None, None, None, event

        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            rpm = torch.empty((R, R), dtype=torch.int32, device=self.device)
            send_head = torch.empty((n, R), dtype=torch.int32, device=self.device)
        self._enter_comm(compute, previous_event)
        stream = self._comm_raw
        epoch = native.dispatch_send(
            stream,
            False,
            n,
            hidden_bytes,
            num_scales,
            num_topk,
            num_experts,
            _ptr(data),
            _ptr(scales),
            s_strides,
            _ptr(topk_idx),
            _ptr(topk_weights),
            _ptr(is_token_in_rank),
            _ptr(num_tokens_per_expert),
            _ptr(rpm),
            _ptr(send_head),
            expert_alignment,
            num_sms,
        )
        if num_worst_tokens > 0:
            rows, per_expert = num_worst_tokens, []
        else:
            rows, per_expert = native.wait_counts(epoch, num_experts)
            per_expert = list(per_expert)
        with self._alloc_ctx(allocate_on_comm_stream):
            recv_x, recv_scales = self._alloc_recv_x(data, scales, rows)
            recv_idx = recv_w = None
            if topk_idx is not None:
                recv_idx = torch.empty((rows, num_topk), dtype=torch.int64, device=self.device)
                if topk_weights is not None:
                    recv_w = torch.empty((rows, num_topk), dtype=torch.float32, device=self.device)
            recv_src_idx = torch.empty(rows, dtype=torch.int32, device=self.device)
            cpm = torch.zeros((R, 1), dtype=torch.int32, device=self.device)
            rcpm = torch.zeros((R, 1), dtype=torch.int32, device=self.device)
        native.dispatch_recv(
            stream,
            n,
            hidden_bytes,
            num_scales,
            num_topk,
            num_experts,
            _ptr(rpm),
            rows,
            _ptr(recv_x),
            _ptr(recv_scales),
            self._strides(recv_scales),
            _ptr(recv_idx),
            _ptr(recv_w),
            _ptr(recv_src_idx),
            num_sms,
        )
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert),
            (recv_x, recv_scales, recv_idx, recv_w, recv_src_idx, rpm, send_head),
        )
        handle = (rpm, cpm, rcpm, recv_src_idx, is_token_in_rank, send_head)
        out_x = recv_x if scales is None else (recv_x, recv_scales)
        return out_x, recv_idx, recv_w, per_expert, handle, event

    def _alloc_recv_x(self, data, scales, rows: int):
        recv_x = torch.empty((rows, data.shape[1]), dtype=data.dtype, device=self.device)
        if scales is None:
            return recv_x, None
        s = scales.shape[1]
        column_major = scales.dim() == 2 and scales.stride(0) == 1 and scales.stride(1) != 1
        if column_major:
            recv_scales = torch.empty((s, rows), dtype=torch.float32, device=self.device).T
        else:
            recv_scales = torch.empty((rows, s), dtype=torch.float32, device=self.device)
        return recv_x, recv_scales

    @staticmethod
    def _strides(t) -> tuple:
        return (0, 0) if t is None else tuple(t.stride())

    # ----- combine ---------------------------------------------------------------

    def _combine_plan(self, x, handle, topk_weights, bias):
        """Every check of a combine; returns ``(rows, H, N, K)``."""
        rpm, recv_src_idx, send_head = self._check_handle(handle)
        rows = recv_src_idx.shape[0]
        check_tensor("x", x, dtype=torch.bfloat16, dims=2, contiguous=True)
        if x.shape[0] != rows:
            raise ValueError(f"x must have the {rows} rows dispatch delivered, got {x.shape[0]}")
        hidden = x.shape[1]
        check_hidden_bytes(hidden, 2)
        n = send_head.shape[0]
        num_topk = 0
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, dims=2, contiguous=True)
            if topk_weights.shape[0] != rows or not 1 <= topk_weights.shape[1] <= 32:
                raise ValueError(
                    f"topk_weights must be [{rows}, K] with 1 <= K <= 32, "
                    f"got {list(topk_weights.shape)}"
                )
            num_topk = topk_weights.shape[1]
        b0, b1 = check_bias(bias, n, hidden)
        self._check_device(x=x, topk_weights=topk_weights, bias0=b0, bias1=b1)
        return rows, hidden, n, num_topk

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
        native = self._buffer()
        key = ("combine", _handle_sig(handle), _sig(x), _sig(topk_weights), _bias_sig(bias))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._combine_plan(x, handle, topk_weights, bias)
            self._plans.put(key, plan)
        rows, hidden, n, num_topk = plan
        rpm, send_head = handle[0], handle[5]
        b0, b1 = _bias_pair(bias)
        for name, t in (("x", x), ("bias[0]", b0), ("bias[1]", b1)):
            _check_aligned(name, t)
        num_sms = self._num_sms(config, type(self).get_combine_config)
        compute = self._prologue(previous_event, async_finish, allocate_on_comm_stream)
        with self._alloc_ctx(allocate_on_comm_stream):
            out = torch.empty((n, hidden), dtype=torch.bfloat16, device=self.device)
            out_w = None
            if topk_weights is not None:
                out_w = torch.empty((n, num_topk), dtype=torch.float32, device=self.device)
        self._enter_comm(compute, previous_event)
        native.combine(
            self._comm_raw,
            _ptr(x),
            rows,
            hidden,
            _ptr(topk_weights),
            num_topk,
            _ptr(rpm),
            _ptr(send_head),
            n,
            _ptr(b0),
            _ptr(b1),
            _ptr(out),
            _ptr(out_w),
            num_sms,
        )
        event = self._epilogue(
            compute,
            async_finish,
            allocate_on_comm_stream,
            (x, topk_weights, b0, b1, rpm, send_head),
            (out, out_w),
        )
        return out, out_w, event
