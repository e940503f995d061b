"""The low-latency half of ``moelink.Buffer`` (DeepEP's ``low_latency_*`` API).

Kernels: ``ep-kernels/cuda/low_latency.cu``; design: ``docs/design-low-latency.md``.
Every argument is checked before a launch, by the native plans (``ep_core::calls``,
which also give the outputs' shapes). Without ``async_finish`` the kernels
run on the caller's current stream; with it, on the Buffer's communication stream
(which first waits for the current one) and an event is returned.
"""

from __future__ import annotations

import torch

from . import _buffer_common, _native
from ._buffer_common import OutputSet, _check_ids, _CudaMemory, output_specs, plain_torch
from ._streams import NO_STREAM_SWITCH, EventOverlap, current_raw_stream, finish_async
from .checks import (
    _NO_SIG,
    check_bool,
    check_int,
    check_tensor,
    check_topk_values,
    device_index,
    optional_meta,
    tensor_meta,
)
from .checks import tensor_ptr as _ptr
from .checks import tensor_sig as _sig

__all__ = ["LowLatencyMixin", "get_low_latency_rdma_size_hint"]

_SEND, _RECV, _BOTH = 1, 2, 3


#: The outputs of a low-latency dispatch plan (``_native.ll_dispatch_plan``), in order.
_DISPATCH_OUTPUTS = ("recv_x", "recv_x_scales", "recv_count", "src_info", "layout_range")


def _ll_geometry(num_ranks: int, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                 ranks_name: str):  # fmt: skip
    """``(T, H, E, E_local)``, checked (``_native.ll_geometry``; ``num_ranks`` is
    called ``ranks_name``)."""
    g = _native.ll_geometry(
        num_ranks, check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
        check_int("hidden", hidden), check_int("num_experts", num_experts), ranks_name,
    )  # fmt: skip
    return g["max_tokens"], g["hidden"], g["num_experts"], g["experts_per_rank"]


def _ll_handle_arg(handle):
    """A low-latency handle as ``_native.ll_*_plan`` take it."""
    if not isinstance(handle, tuple) or len(handle) != 5:
        raise TypeError(
            "handle must be the 5-tuple (src_info, layout_range, "
            "num_max_dispatch_tokens_per_rank, hidden, num_experts) of low_latency_dispatch"
        )
    src_info, layout_range, t, hidden, num_experts = handle
    return (
        tensor_meta("handle[0] (src_info)", src_info),
        tensor_meta("handle[1] (layout_range)", layout_range),
        check_int("num_max_dispatch_tokens_per_rank", t),
        check_int("hidden", hidden),
        check_int("num_experts", num_experts),
    )


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Bytes of low-latency buffer (``num_rdma_bytes``) each rank needs for calls up to
    this shape, any top-k, either transport. ``ValueError`` for a shape beyond the
    limits (``moelink.checks.LIMITS``: ``ll_max_tokens_per_rank``, ``ll_max_hidden``,
    ``max_ranks``, ``max_experts_per_rank``) or whose kernel blocks would need more
    shared memory than they have."""
    r = check_int("num_ranks", num_ranks)
    t, h, e, _ = _ll_geometry(r, num_max_dispatch_tokens_per_rank, hidden, num_experts, "num_ranks")
    return _native.low_latency_size_hint(t, h, r, e)


class LowLatencyMixin:
    """Methods of ``Buffer`` for ``low_latency_mode=True`` (mixed into ``Buffer``)."""

    _ll = None
    #: The low-latency calls' bookkeeping and their one-call eager path
    #: (``_native.LlCalls``; None without a low-latency part).
    _ll_state = None

    @property
    def _ll_pending(self) -> tuple:
        """Receive hooks not yet called, oldest first (at most two: the rules are
        ``ep_core::ll_hooks``)."""
        return () if self._ll_state is None else self._ll_state.pending

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        return get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    def _ll_native(self):
        if self._ll is None:
            raise RuntimeError(
                "this Buffer has no low-latency buffer (destroyed, or created without "
                "low_latency_mode=True and num_rdma_bytes > 0)"
            )
        return self._ll

    def _ll_begin(self, async_finish: bool, return_recv_hook: bool):
        """Checks that a low-latency call may start now (``_native.LlCalls.begin``:
        at most two in flight, and a call without a hook cannot overlap
        a pending one)."""
        ll = self._ll_native()
        self._ll_state.begin(async_finish, return_recv_hook)
        # A timed-out wait leaves the ranks out of step: the launch call itself
        # raises before launching (ll_dispatch / ll_combine).
        return ll

    def _ll_stream(self, async_finish: bool):
        """(stream, raw handle, allocation context) of a call: the communication
        stream after it waited for the compute stream where ``async_finish``, else
        the compute stream's raw handle (no Stream object: one C call)."""
        if async_finish:
            self._enter_comm(current_raw_stream(self.device.index), None)
            s = self._comm_stream
            return s, self._comm_raw, torch.cuda.stream(s)
        return None, current_raw_stream(self.device.index), NO_STREAM_SWITCH

    def _ll_launch(self, kind: str, launch, raw, stream, async_finish, return_recv_hook, keep):
        """Runs ``launch(raw, phases)``, a low-latency ``kind`` call: its send half
        only with ``return_recv_hook`` (the returned hook launches the receive half),
        else both. Returns ``(event, hook)``: ``keep`` is kept by the hook and, with
        ``async_finish``, by the event recorded on ``stream``."""
        recorded = launch(raw, _SEND if return_recv_hook else _BOTH)
        receive = (lambda s: launch(s, _RECV)) if return_recv_hook else None
        hook = self._ll_state.record(kind, receive, keep)
        event = finish_async(stream, keep) if async_finish else EventOverlap(None)
        if recorded is not None:  # after the launch and the bookkeeping (see LlHook)
            raise recorded
        return event, hook

    def _check_ids_now(self) -> bool:
        return _check_ids()

    # ----- dispatch ----------------------------------------------------------------

    def _ll_dispatch_plan(
        self, ll, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats_count,
        stats_wait, use_fp8, round_scale, use_ue8m0,
    ):  # fmt: skip
        """Every check of a low-latency dispatch (``_native.ll_dispatch_plan``); returns
        ``(plan, T, N, H, E, use_fp8, outputs)``: the ``_native.LlDispatchPlan`` (which
        ``EpBuffer.ll_dispatch`` takes for every size and flag), the values of it the
        call reads, normalized, and its outputs as an ``OutputSet``."""
        p = _native.ll_dispatch_plan(
            self.group_size, device_index(self.device), tensor_meta("x", x),
            tensor_meta("topk_idx", topk_idx),
            check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            check_int("num_experts", num_experts),
            optional_meta("cumulative_local_expert_recv_stats", stats_count),
            optional_meta("dispatch_wait_recv_cost_stats", stats_wait),
            check_bool("use_fp8", use_fp8), check_bool("round_scale", round_scale),
            check_bool("use_ue8m0", use_ue8m0),
        )  # fmt: skip
        t, hidden, e = p.max_tokens, p.hidden, p.num_experts
        if self._check_ids_now():
            check_topk_values(topk_idx, e)
        # The buffer must hold this shape: refused before the outputs are
        # allocated (they can be larger than the GPU has free).
        ll.check_shape(t, hidden, e, p.num_topk)
        return (
            p, t, p.num_tokens, hidden, e, p.use_fp8,
            OutputSet(output_specs(p, _DISPATCH_OUTPUTS), self.device),
        )  # fmt: skip

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Sends every (token, selected expert) to the expert's rank, casting to fp8
        on the fly when ``use_fp8``. Returns ``(recv_x or (recv_x, scales), recv_count,
        handle, event, hook)``; see ``docs/api.md`` ("Low latency")."""
        if not async_finish and not _buffer_common._CHECK_IDS and self._ll_state is not None:
            done = self._ll_state.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                round_scale, use_ue8m0, return_recv_hook,
            )  # fmt: skip
            if done is not None:
                return done
        return self._ll_dispatch_checked(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip

    @plain_torch
    def _ll_dispatch_checked(
        self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
        round_scale, use_ue8m0, async_finish, return_recv_hook,
    ):  # fmt: skip
        """``low_latency_dispatch`` on the checked path: every check in Python's
        order, for every call the one native call declines (``async_finish``,
        ``MOELINK_CHECK_IDS``, a refused argument, a hook rule)."""
        ll = self._ll_begin(async_finish, return_recv_hook)
        key = (
            "dispatch", _sig(x), _sig(topk_idx), _sig(cumulative_local_expert_recv_stats),
            _sig(dispatch_wait_recv_cost_stats), num_max_dispatch_tokens_per_rank, num_experts,
            use_fp8, round_scale, use_ue8m0, type(num_max_dispatch_tokens_per_rank),
            type(num_experts), type(use_fp8), type(round_scale), type(use_ue8m0),
        )  # fmt: skip
        entry = self._plans.get(key)
        if entry is None:
            entry = self._ll_dispatch_plan(
                ll, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                round_scale, use_ue8m0,
            )  # fmt: skip
            self._plans.put(key, entry)
        elif self._check_ids_now():
            check_topk_values(topk_idx, entry[4])
        plan, t, n, hidden, num_experts, use_fp8, outputs = entry
        stream, raw, alloc = self._ll_stream(async_finish)
        with alloc:
            recv_x, scales, recv_count, src_info, layout_range = outputs.empty()
        # The plan fixes every size and flag (ll_dispatch reads them there): x and
        # topk_idx are empty exactly when n is 0, the outputs never are (T, E_local
        # >= 1), so no numel() per pointer.
        ptrs = (
            x.data_ptr() if n else 0, topk_idx.data_ptr() if n else 0,
            recv_x.data_ptr(), 0 if scales is None else scales.data_ptr(), recv_count.data_ptr(),
            src_info.data_ptr(), layout_range.data_ptr(),
            _ptr(cumulative_local_expert_recv_stats), _ptr(dispatch_wait_recv_cost_stats),
        )  # fmt: skip

        def launch(s, phases):
            return ll.ll_dispatch(s, plan, ptrs, phases)

        keep = (x, topk_idx, recv_x, scales, recv_count, src_info, layout_range,
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)  # fmt: skip
        event, hook = self._ll_launch(
            "dispatch", launch, raw, stream, async_finish, return_recv_hook, keep
        )
        handle = (src_info, layout_range, t, hidden, num_experts)
        out = (recv_x, scales) if use_fp8 else recv_x
        return out, recv_count, handle, event, hook

    # ----- combine -----------------------------------------------------------------

    def _ll_combine_plan(
        self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, stats_wait
    ):
        """Every check of a low-latency combine (``_native.ll_combine_plan``); returns
        ``(plan, T, H, N, E, combine_buffer spec, combined_x)``: the
        ``_native.LlCombinePlan`` (which ``EpBuffer.ll_combine`` takes for every size),
        the values of it the call reads, the zero-copy input's view (with
        ``zero_copy``) and the output as an ``OutputSet`` (its spec None where ``out``
        is given)."""
        p = _native.ll_combine_plan(
            self.group_size, device_index(self.device),
            None if zero_copy else tensor_meta("x", x), tensor_meta("topk_idx", topk_idx),
            tensor_meta("topk_weights", topk_weights), _ll_handle_arg(handle), bool(use_logfmt),
            bool(zero_copy), optional_meta("out", out),
            optional_meta("combine_wait_recv_cost_stats", stats_wait),
        )  # fmt: skip
        e = p.num_experts
        if self._check_ids_now():
            check_topk_values(topk_idx, e)
        zero_copy_spec, out_spec = output_specs(p, ("combine_buffer", "combined_x"))
        return (
            p, p.max_tokens, p.hidden, p.num_tokens, e, zero_copy_spec,
            OutputSet((out_spec,), self.device),
        )  # fmt: skip

    def _combine_buffer(self, ll, t: int, hidden: int, num_experts: int, spec) -> torch.Tensor:
        """The zero-copy combine input of this shape as ``spec`` (its view) says."""
        shape, _, dtype, _ = spec
        ptr, nbytes = ll.zero_copy_buffer(t, hidden, num_experts)
        raw = torch.as_tensor(_CudaMemory(ptr, nbytes, self), device=self.device)
        return raw.view(dtype).view(shape)

    @plain_torch
    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The bf16 ``[E_local, R*T, H]`` view of the buffer ``low_latency_combine(...,
        zero_copy=True)`` reads: write the expert outputs here, then combine. One region
        per buffer (not one per half): with two calls in flight, write it for a call
        only after the other call's zero-copy combine was issued (its send reads it, in
        stream order)."""
        ll = self._ll_native()
        p = _native.ll_handle_plan(self.group_size, device_index(self.device),
                                   _ll_handle_arg(handle))  # fmt: skip
        (spec,) = output_specs(p, ("combine_buffer",))
        return self._combine_buffer(ll, p["max_tokens"], p["hidden"], p["num_experts"], spec)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """Returns every expert output to its source token and reduces:
        ``out[t] = sum_k topk_weights[t, k] * y[expert_k, t]`` (float32, skipping -1).
        Returns ``(combined_x, event, hook)``."""
        if not async_finish and not _buffer_common._CHECK_IDS and self._ll_state is not None:
            done = self._ll_state.combine(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, return_recv_hook, out,
                combine_wait_recv_cost_stats,
            )  # fmt: skip
            if done is not None:
                return done
        return self._ll_combine_checked(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats,
        )  # fmt: skip

    @plain_torch
    def _ll_combine_checked(
        self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
        return_recv_hook, out, combine_wait_recv_cost_stats,
    ):  # fmt: skip
        """``low_latency_combine`` on the checked path (see ``_ll_dispatch_checked``)."""
        ll = self._ll_begin(async_finish, return_recv_hook)
        h = handle if type(handle) is tuple and len(handle) == 5 else (_NO_SIG,) * 5
        key = (
            "combine", None if zero_copy else _sig(x), _sig(topk_idx), _sig(topk_weights),
            _sig(h[0]), _sig(h[1]), h[2], h[3], h[4], type(h[2]), type(h[3]), type(h[4]),
            use_logfmt, zero_copy, _sig(out), _sig(combine_wait_recv_cost_stats),
        )  # fmt: skip
        entry = self._plans.get(key)
        if entry is None:
            entry = self._ll_combine_plan(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                combine_wait_recv_cost_stats,
            )  # fmt: skip
            self._plans.put(key, entry)
        elif self._check_ids_now():
            check_topk_values(topk_idx, entry[4])
        src_info, layout_range = h[0], h[1]
        plan, t, hidden, n, num_experts, zero_copy_spec, outputs = entry
        if zero_copy:
            x = self._combine_buffer(ll, t, hidden, num_experts, zero_copy_spec)
        stream, raw, alloc = self._ll_stream(async_finish)
        if out is None:
            with alloc:
                (out,) = outputs.empty()
        # Every size is the plan's (ll_combine reads them there).
        ptrs = (
            x.data_ptr(), layout_range.data_ptr(), topk_idx.data_ptr() if n else 0,
            topk_weights.data_ptr() if n else 0, out.data_ptr() if n else 0,
            _ptr(combine_wait_recv_cost_stats),
        )  # fmt: skip

        def launch(s, phases):
            return ll.ll_combine(s, plan, ptrs, phases)

        keep = (x, topk_idx, topk_weights, src_info, layout_range, out,
                combine_wait_recv_cost_stats)  # fmt: skip
        event, hook = self._ll_launch(
            "combine", launch, raw, stream, async_finish, return_recv_hook, keep
        )
        return out, event, hook

    # ----- maintenance -------------------------------------------------------------

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """*Collective.* Resets the low-latency flags and call counters on every rank
        (waits for this device first). Needed before low-latency use of a buffer whose
        low-latency calls were interrupted (a timeout). With ``enable_shrink`` the ranks
        masked here are not waited for, and a rank that does not call it within the
        low-latency device-wait bound (``MOELINK_LL_TIMEOUT_S``) is masked: the others
        complete it."""
        ll = self._ll_native()
        _ll_geometry(self.group_size, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                     "group size")  # fmt: skip
        if self._ll_pending:
            names = " and ".join(h.name for h in self._ll_pending)
            raise RuntimeError(f"the low-latency receive hook of {names} is pending: call it first")
        torch.cuda.synchronize(self.device)
        ll.clean()

    def _mask_view(self) -> torch.Tensor:
        ll = self._ll_native()
        if not self.enable_shrink:
            raise RuntimeError("the rank mask needs a Buffer created with enable_shrink=True")
        raw = torch.as_tensor(
            _CudaMemory(ll.mask_ptr(), 4 * self.group_size, self), device=self.device
        )
        return raw.view(torch.int32)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks rank ``rank_to_mask``: low-latency kernels
        skip masked ranks (on the current stream)."""
        rank_to_mask = check_int("rank_to_mask", rank_to_mask, minimum=0,
                                 maximum=self.group_size - 1)  # fmt: skip
        self._mask_view()[rank_to_mask].fill_(1 if mask else 0)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copies the rank mask (int32 ``[R]``, 1 = masked, by a call or by a timeout)
        into ``mask_status`` (on the current stream)."""
        check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,),
                     device=self.device)  # fmt: skip
        mask_status.copy_(self._mask_view())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (on the current stream)."""
        self._mask_view().zero_()
