"""Run under ``python -m moelink.launch -n N`` (2 or 4 ranks; several may share a
GPU): the sequences of calls that vLLM, SGLang and Megatron-LM make into DeepEP,
replayed through ``import deep_ep`` (moelink's alias package,
python/deep_ep_alias) and checked against moelink's CPU reference
(``moelink.reference``) on fresh random data.

Each scenario reproduces one framework path as its source does it (argument
names, keywords, order, events, hooks, ``out=``, ``expert_alignment``,
``num_worst_tokens``), with small experts in place of the real ones, read from:

- vLLM (vllm-project/vllm): ``vllm/distributed/device_communicators/all2all.py``
  (``DeepEPHTAll2AllManager`` / ``DeepEPLLAll2AllManager``: Buffer keywords, handle
  cache, ``set_num_sms``, mask queries, ``clean_buffers``) and
  ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_{ht,ll}.py``
  (``DeepEPHTPrepareAndFinalize``, ``DeepEPLLPrepareAndFinalize``).
- SGLang (sgl-project/sglang): ``python/sglang/srt/layers/moe/token_dispatcher/
  deepep.py`` (``DeepEPBuffer``, ``DeepEPConfig``, ``_DeepEPDispatcherImplNormal``,
  ``_DeepEPDispatcherImplLowLatency``) and
  ``python/sglang/srt/batch_overlap/operations_strategy.py`` (two-batch overlap).
- Megatron-LM (NVIDIA/Megatron-LM): ``megatron/core/transformer/moe/fused_a2a.py``
  (``get_buffer``, ``FusedDispatch``, ``FusedCombine``) and ``token_dispatcher.py``
  (``_DeepepManager``, ``MoEFlexTokenDispatcher``); ``num_worst_tokens`` as the
  Megatron-derived flex path of AMD-AGI/Primus-Turbo passes it
  (``primus_turbo/pytorch/kernels/moe/moe_dispatch_combine_impl.py``).

Every rank builds every rank's inputs from generators seeded with (seed, tag,
rank) (``MOELINK_TEST_SEED`` replays a run), so each computes the reference
itself; what a rank's GPU computed from received rows (expert outputs, gradients)
is gathered over gloo where the reference needs every rank's. Checks: layout,
dispatch and cached dispatch bit for bit (rows by source index, top-k ids and
weights, per-expert counts, handle); combine bit for bit against the reference
on the gathered expert outputs; and end to end against the MoE formula
``sum_k w_k * s_e * x`` (``calc_diff``). Outputs are poisoned first, ``out=``
tensors filled with NaN. Where a framework uses something moelink does not
support, the scenario checks that moelink refuses it with a clear error on every
rank, before anything is launched, and that the Buffer works afterwards.

Scenarios run in ``SCENARIO_NAMES`` order (``MOELINK_FRAMEWORKS_SCENARIOS``, a
comma list, selects some); rank 0 prints ``PASS <name>`` / ``FAIL <name>: ...``
once the ranks agree, and ``NOTE <name>: ...`` where moelink refused a framework
pattern with a clear error. Exit code 1 if any scenario failed.
"""

from __future__ import annotations

import abc
import gc
import os
import sys
from dataclasses import dataclass

import deep_ep
import intranode_worker as iw
import ll_worker as llw
import torch
import torch.distributed as dist
import worker_driver
from deep_ep.utils import EventHandle, EventOverlap
from moelink import config as moelink_config
from moelink import reference

#: Scenario names, in run order; the pytest wrapper reads this tuple. The ones
#: that may leave the GPU in a bad state if moelink misbehaves come last.
SCENARIO_NAMES = (
    "vllm_ht",
    "vllm_ll",
    "sglang_normal",
    "sglang_ll",
    "sglang_mode_switch",
    "megatron_flex_sync",
    "megatron_worst_tokens",
    "megatron_realloc",
    "megatron_flex",
    "sglang_tbo",
    "vllm_ll_fault_tolerance",
)
SCENARIOS_ENV = "MOELINK_FRAMEWORKS_SCENARIOS"
SEED_ENV = llw.SEED_ENV  # MOELINK_TEST_SEED, as every worker
#: Seconds a scenario may take before the watchdog ends the process.
SCENARIO_TIMEOUT_S = float(os.environ.get("MOELINK_FRAMEWORKS_SCENARIO_TIMEOUT_S", "240"))
#: Seconds the gloo control collectives wait for the other ranks.
CONTROL_TIMEOUT_S = 300

#: Tokens per rank of a normal-mode batch (inclusive range).
TOKENS = (64, 128)
EXPERTS_PER_RANK = 8
BF16 = torch.bfloat16
NAN = float("nan")
#: vLLM's ``VLLM_DEEPEP_BUFFER_SIZE_MB`` (its default is 1024; smaller here, where
#: up to 4 ranks share one GPU).
VLLM_DEEPEP_BUFFER_SIZE_MB = 128
#: ``DeepEPHTPrepareAndFinalize.available_rank_configs``.
VLLM_AVAILABLE_RANK_CONFIGS = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
#: SGLang's ``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` default.
SGLANG_LL_MAX_TOKENS = 128
#: A ``--deepep-config`` JSON as SGLang loads it into ``Config(**...)``.
SGLANG_DEEPEP_CONFIG = {
    "normal_dispatch": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 16,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
    "normal_combine": {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 6,
        "num_max_nvl_chunked_recv_tokens": 256,
        "num_max_rdma_chunked_send_tokens": 6,
        "num_max_rdma_chunked_recv_tokens": 128,
    },
}
#: calc_diff bounds of the end-to-end checks: bf16 results of bf16 (or already
#: fp8) inputs, and low-latency fp8 (cast in the kernel) as ll_worker uses.
E2E_TOL = 1e-4
E2E_TOL_LL_FP8 = 9e-4


# ----------------------------------------------------------------------------
# Context and shared helpers
# ----------------------------------------------------------------------------


@dataclass
class Ctx:
    wg: worker_driver.WorkerGroup
    seed: int
    data: iw.Ctx  # normal-mode inputs (generators) of every rank
    ll: llw.Ctx  # low-latency inputs and checks (its errors join chk's)
    chk: iw.Checker
    name: str = ""

    @property
    def rank(self) -> int:
        return self.wg.rank

    @property
    def world(self) -> int:
        return self.wg.world

    @property
    def device(self) -> torch.device:
        return self.wg.device

    @property
    def group(self):
        return self.wg.group

    @property
    def gloo(self):
        return self.wg.gloo

    def barrier(self) -> None:
        """A host barrier before a low-latency send: what a rank checks on the
        CPU between calls must not count against the peers' device-side receive
        bound (ll_worker explains the drift). Not part of any framework's calls."""
        dist.barrier(group=self.gloo)

    def note(self, msg: str) -> None:
        """A pattern moelink refused with a clear error: said once, by rank 0."""
        if self.rank == 0:
            print(f"NOTE {self.name}: {msg}", flush=True)


def token_counts(ctx: Ctx, tag: str, *, zero_rank: bool = False) -> list:
    """Tokens per rank in ``TOKENS``; with ``zero_rank`` (and more than 2 ranks)
    one random rank has none, as an idle DP rank of a framework."""
    g = ctx.data.shared_generator(tag + "/counts")
    counts = torch.randint(TOKENS[0], TOKENS[1] + 1, (ctx.world,), generator=g).tolist()
    if zero_rank and ctx.world > 2:
        counts[int(torch.randint(0, ctx.world, (1,), generator=g))] = 0
    return counts


def expert_scales(num_experts: int) -> torch.Tensor:
    """The small experts: global expert ``e`` multiplies its input by ``s[e]``, a
    power of two (0.5, 1, 2), float32 [E]."""
    return 2.0 ** ((torch.arange(num_experts) % 3) - 1).float()


def dequant_rows(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Normal-mode token rows as float32: bf16 as is, fp8 times its per-128 scale."""
    if scales is None:
        return data.float()
    return data.float() * scales.float().repeat_interleave(128, dim=1)


def routed_coef(idx: torch.Tensor, w: torch.Tensor, s: torch.Tensor, offset: int) -> torch.Tensor:
    """Per row, ``sum_k w_k * s[e_k]`` over the valid ids (``idx + offset`` global)."""
    valid = idx >= 0
    e = torch.where(valid, idx + offset, torch.zeros_like(idx))
    return torch.where(valid, w * s[e], torch.zeros_like(w)).sum(dim=1)


def moe_reference(x_f32: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, s: torch.Tensor):
    """What an MoE layer returns for this rank's tokens, float32 (CPU)."""
    return x_f32 * routed_coef(idx, w, s, 0)[:, None]


def check_close(ctx: Ctx, label: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """End-to-end check: finite, and ``calc_diff(got, want) < tol``."""
    g = got.detach().float().cpu()
    if g.shape != want.shape:
        ctx.chk.expect(False, f"{label}: shape {list(g.shape)}, expected {list(want.shape)}")
        return
    if g.numel() == 0:
        return
    ctx.chk.expect(bool(torch.isfinite(g).all()), f"{label}: not finite (an unwritten element?)")
    d = llw.calc_diff(g, want.float())
    ctx.chk.expect(d < tol, f"{label}: calc_diff {d:.3g} against the MoE formula, bound {tol}")


def gathered(ctx: Ctx, obj) -> list:
    """Every rank's ``obj`` (CPU tensors or None), over gloo."""
    out = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.gloo)
    return out


def rows_for_reference(ctx: Ctx, label: str, t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` on the CPU, or (when the GPU produced another number of rows, already
    a failure) zeros of the reference's shape, so every rank still gathers."""
    t = t.detach().cpu()
    if t.shape[0] == rows:
        return t
    ctx.chk.expect(False, f"{label}: {t.shape[0]} rows, the reference has {rows}")
    return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)


def expect_combine(ctx: Ctx, label: str, ref, y, got_x, *, w=None, got_w=None) -> None:
    """This rank's combine output ``got_x`` (and ``got_w``) against
    ``reference.combine`` of every rank's ``y`` (and weights ``w``), gathered."""
    rows = ref.ranks[ctx.rank].recv_src_idx.shape[0]
    ys = gathered(ctx, rows_for_reference(ctx, label + " y", y, rows))
    ws = None if w is None else gathered(ctx, rows_for_reference(ctx, label + " w", w, rows))
    try:
        # Across emulated nodes, the internode model (per-node bf16 partials).
        per_node = iw.ranks_per_node(ctx.world)
        want_x, want_w = reference.combine(ref, ys, topk_weights=ws, ranks_per_node=per_node)[
            ctx.rank
        ]
    except Exception as e:  # noqa: BLE001 - a failed check, not an abort
        ctx.chk.expect(False, f"{label}: the reference refused the gathered inputs: {e}")
        return
    ctx.chk.equal(f"{label} combined_x", got_x.detach(), reference.to_bf16(want_x))
    if w is not None:
        ctx.chk.equal(f"{label} combined_topk_weights", got_w, want_w)


def expect_refused(ctx: Ctx, label: str, excs, fn):
    """``fn()`` (a call every rank makes the same way) must raise one of ``excs``
    before launching anything. Returns the message, or None after recording a
    failure."""
    try:
        fn()
    except excs as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - recorded
        ctx.chk.expect(False, f"{label}: raised {type(e).__name__} ({e}), expected {excs}")
        return None
    ctx.chk.expect(False, f"{label}: no error")
    return None


def one_line(msg: str, limit: int = 240) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def size_hints(configs, hidden_bytes: int, group) -> tuple:
    """How DeepEP's README sizes a normal-mode Buffer (as fused_a2a.get_buffer and
    DeepEPBuffer do): the largest NVLink and RDMA size hints of ``configs``."""
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in configs:
        nvl = config.get_nvl_buffer_size_hint(hidden_bytes, group.size())
        rdma = config.get_rdma_buffer_size_hint(hidden_bytes, group.size())
        num_nvl_bytes, num_rdma_bytes = max(nvl, num_nvl_bytes), max(rdma, num_rdma_bytes)
    return num_nvl_bytes, num_rdma_bytes


def settle(ctx: Ctx) -> None:
    """Every rank's GPU work is done: after this a Buffer may be dropped."""
    torch.cuda.synchronize()
    dist.barrier(group=ctx.gloo)


# ----------------------------------------------------------------------------
# Low-latency round trips (vLLM and SGLang share the checks)
# ----------------------------------------------------------------------------


def ll_inputs(ctx: Ctx, tag: str, t: int, hidden: int, num_experts: int, k: int) -> list:
    """Every rank's (x bf16 [T_r, H], topk_idx int64 [T_r, K], weights f32 [T_r, K])."""
    return llw.make_inputs(ctx.ll, tag, t, hidden, num_experts, k)


def ll_reference(ctx: Ctx, inputs, t, num_experts, use_fp8, round_scale, ue8m0) -> dict:
    return reference.ll_dispatch(
        [i[0] for i in inputs],
        [i[1] for i in inputs],
        t,
        num_experts,
        use_fp8,
        round_scale,
        ue8m0,
        rank=ctx.rank,
    )[ctx.rank]


def ll_expert_output(ctx: Ctx, x, scales, use_fp8: bool, ue8m0: bool, num_experts: int):
    """The batched experts: local expert j's rows (dequantized) times s[rank*E_l + j],
    bf16 [E_local, R*T, H] (a power of two: exact in bf16)."""
    el = num_experts // ctx.world
    s = expert_scales(num_experts)[ctx.rank * el : (ctx.rank + 1) * el].to(ctx.device)
    deq = llw.dequant(x, scales, use_fp8, ue8m0)
    return (deq.float() * s[:, None, None]).to(BF16)


def check_ll_dispatch(ctx, label, want, x, scales, count, handle, use_fp8, ue8m0) -> None:
    torch.cuda.synchronize()
    llw.check_dispatch(ctx.ll, label, ((x, scales), count, handle), want, ctx.rank, use_fp8, ue8m0)


def check_ll_combine(ctx, label, inputs, t, num_experts, y, count, handle, combined, use_fp8):
    """``combined`` bit for bit against the reference on every rank's ``y``
    (collective), and end to end against ``sum_k w_k s_e x``."""
    torch.cuda.synchronize()
    want = llw.reference_combine(ctx.ll, y, count, handle, inputs, t, num_experts)
    ctx.chk.equal(f"{label} combined", combined.detach().cpu(), want)
    x, idx, w = inputs[ctx.rank]
    tol = E2E_TOL_LL_FP8 if use_fp8 else E2E_TOL
    check_close(
        ctx,
        f"{label} end to end",
        combined,
        moe_reference(x.float(), idx, w, expert_scales(num_experts)),
        tol,
    )


# ----------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------


def vllm_ht_buffer(ctx: Ctx):
    """``DeepEPHTAll2AllManager.get_handle``: its kwargs (one node: no RDMA, one QP)
    through the handle cache (``Cache.get_or_create(kwargs, deep_ep.Buffer)``)."""
    kwargs = dict(
        group=ctx.gloo,  # the manager's cpu_group
        num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024,
        num_rdma_bytes=0,
        low_latency_mode=False,
        num_qps_per_rank=1,
        explicitly_destroy=True,
    )
    return deep_ep.Buffer(**kwargs)


def scenario_vllm_ht(ctx: Ctx) -> None:
    """DeepEPHTPrepareAndFinalize: layout + dispatch (bf16, or fp8 block-quantized
    tokens with their scales), the receiver (event wait, ids back to global
    experts, counts), the experts' weight-and-reduce, combine without weights
    into a preallocated output; async and sync finalize; a DBO-style step with a
    captured previous_event after a late producer."""
    chk, R = ctx.chk, ctx.world
    buffer = vllm_ht_buffer(ctx)
    try:
        # DeepEPHTAll2AllManager.set_num_sms: never more than its 20.
        deep_ep.Buffer.set_num_sms(min(32, 20))
        ok = R in VLLM_AVAILABLE_RANK_CONFIGS
        dispatch_config = deep_ep.Buffer.get_dispatch_config(R) if ok else None
        combine_config = deep_ep.Buffer.get_combine_config(R) if ok else None
        for name, cfg in (("dispatch", dispatch_config), ("combine", combine_config)):
            chk.expect(
                not ok or (isinstance(cfg, deep_ep.Config) and cfg.num_sms == 20),
                f"get_{name}_config({R}) after set_num_sms(20): {cfg!r}",
            )
        steps = [
            # hidden, fp8 block-quantized tokens, finalize_async, DBO-style events
            (2048, False, True, False),
            (7168, True, False, False),
            (4096, False, True, True),
            (3072, True, True, False),
        ]
        for i, step in enumerate(steps):
            vllm_ht_step(ctx, buffer, i, step, (dispatch_config, combine_config))
    finally:
        torch.cuda.synchronize()
        buffer.destroy()  # DeepEPAll2AllManagerBase.destroy: every cached handle


def vllm_ht_step(ctx: Ctx, buffer, i: int, step: tuple, configs: tuple) -> None:
    """Step ``i`` of scenario_vllm_ht: ``step`` is (hidden, fp8, finalize_async,
    DBO-style events), ``configs`` the dispatch and combine configs."""
    chk, R, r, dev = ctx.chk, ctx.world, ctx.rank, ctx.device
    hidden, fp8, fin_async, dbo = step
    dispatch_config, combine_config = configs
    tag, label = f"vllm_ht/{i}", f"vllm ht #{i} H={hidden} fp8={fp8} async={fin_async} dbo={dbo}"
    E = EXPERTS_PER_RANK * R
    offset = r * EXPERTS_PER_RANK
    s = expert_scales(E).to(dev)
    counts = token_counts(ctx, tag, zero_rank=(hidden == 3072))
    case = iw.Case(hidden, E, 8, counts, fp8=fp8)
    inputs = case.inputs(ctx.data, tag)
    ref = reference.dispatch(inputs, E)
    mine = inputs[r]
    tokens = mine["x"].to(dev)
    token_scales = mine["scales"].to(dev) if fp8 else None
    topk_ids = mine["topk_idx"].to(dev)
    topk_weights = mine["topk_weights"].to(dev)

    # _do_dispatch. Under DBO: previous_event = dbo_get_previous_event(buffer.capture)
    # after this micro-batch's compute, async_finish off.
    previous_event = None
    if dbo:
        tokens, _ = iw.delayed_input(ctx.data, tokens, NAN, use_event=False)
        previous_event = buffer.capture()
    layout = buffer.get_dispatch_layout(
        topk_idx=topk_ids,
        num_experts=E,
        previous_event=previous_event,
        async_finish=False,
        allocate_on_comm_stream=False,
    )
    iw.check_layout(chk, f"{label} layout", layout, mine["topk_idx"], E, R)
    (
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        dispatch_expert_num_tokens,
        is_token_in_rank,
        event,
    ) = layout
    token_data = (tokens, token_scales) if fp8 else tokens
    iw.poison_allocator(dev)
    got = buffer.dispatch(
        x=token_data,
        handle=None,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=dispatch_expert_num_tokens,
        topk_idx=topk_ids,
        topk_weights=topk_weights,
        expert_alignment=1,
        config=dispatch_config,
        previous_event=previous_event,
        async_finish=not dbo,  # self.async_prepare and not dbo_enabled()
        allocate_on_comm_stream=False,
    )
    token_data, expert_topk_ids, expert_topk_weights, num_list, handle, event = got

    # _receiver
    if event.event is not None:
        event.current_stream_wait()
    iw.check_dispatch(chk, label, got, ref, r, layout=iw.scales_layout(False, counts[r]))
    fill = E - 1 if offset == 0 else 0
    global_ids = torch.where(expert_topk_ids == -1, fill, expert_topk_ids + offset)
    want_local = ref.ranks[r].recv_topk_idx
    chk.equal(
        f"{label} receiver's global topk ids",
        global_ids,
        torch.where(want_local == -1, fill, want_local + offset),
    )
    expert_num_tokens = torch.tensor(num_list, dtype=torch.int32, device=dev)  # make_from_list
    chk.expect(
        expert_num_tokens.shape == (EXPERTS_PER_RANK,),
        f"{label}: {len(num_list)} per-expert counts, expected {EXPERTS_PER_RANK}",
    )

    # The experts, then TopKWeightAndReduceContiguous: one bf16 row per received token.
    data, scales = token_data if fp8 else (token_data, None)
    coef = routed_coef(expert_topk_ids, expert_topk_weights, s, offset)
    fused_expert_output = (dequant_rows(data, scales) * coef[:, None]).to(BF16)

    # _finalize
    output = torch.full((counts[r], hidden), NAN, dtype=BF16, device=dev)
    previous_event = buffer.capture() if dbo else None
    iw.poison_allocator(dev)
    combined_x, combined_w, event = buffer.combine(
        x=fused_expert_output,
        handle=handle,
        topk_weights=None,
        config=combine_config,
        previous_event=previous_event,
        async_finish=fin_async and not dbo,
        allocate_on_comm_stream=False,
    )
    if fin_async:  # finalize_async's receiver, called later by the modular kernel
        torch.cuda._sleep(1_000_000)
        if event.event is not None:
            event.current_stream_wait()
    output.copy_(combined_x, non_blocking=True)
    torch.cuda.synchronize()
    chk.expect(combined_w is None, f"{label}: combined_topk_weights without topk_weights")
    expect_combine(ctx, label, ref, fused_expert_output, output)
    x_f32 = dequant_rows(mine["x"], mine["scales"])
    check_close(
        ctx,
        f"{label} end to end",
        output,
        moe_reference(x_f32, mine["topk_idx"], mine["topk_weights"], s.cpu()),
        E2E_TOL,
    )


class VllmLLManager:
    """``DeepEPLLAll2AllManager``: Buffers made from ``_make_all2all_kwargs`` through
    the handle cache (one Buffer per distinct kwargs), destroyed together."""

    def __init__(self, ctx: Ctx, enable_shrink: bool = False) -> None:
        self.ctx = ctx
        self.enable_shrink = enable_shrink
        self.cache: dict = {}

    def get_handle(
        self,
        max_num_tokens_per_dp_rank,
        token_hidden_size,
        num_ep_ranks,
        num_global_experts,
        num_local_experts,
    ):
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank,
            hidden=token_hidden_size,
            num_ranks=num_ep_ranks,
            num_experts=num_global_experts,
        )
        kwargs = dict(
            group=self.ctx.gloo,
            num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=num_local_experts,
            allow_nvlink_for_low_latency_mode=True,
            allow_mnnvl=False,  # VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL
            explicitly_destroy=True,
            enable_shrink=self.enable_shrink,  # parallel_config.enable_fault_tolerance
        )
        key = tuple(sorted((k, id(v) if k == "group" else v) for k, v in kwargs.items()))
        if key not in self.cache:
            self.cache[key] = deep_ep.Buffer(**kwargs)
        return self.cache[key]

    def destroy(self) -> None:
        torch.cuda.synchronize()
        for buf in self.cache.values():
            buf.destroy()
        self.cache.clear()


def vllm_ll_step(
    ctx: Ctx,
    buf,
    tag: str,
    label: str,
    *,
    t: int,
    hidden: int,
    k: int,
    use_fp8: bool,
    ue8m0: bool,
    block_quant: bool,
    finalize_async: bool,
) -> None:
    """One DeepEPLLPrepareAndFinalize prepare + experts + finalize round trip."""
    chk, r, dev = ctx.chk, ctx.rank, ctx.device
    E = EXPERTS_PER_RANK * ctx.world
    assert hidden in (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # SUPPORTED_HIDDEN_SIZES
    inputs = ll_inputs(ctx, tag, t, hidden, E, k)
    want = ll_reference(ctx, inputs, t, E, use_fp8, ue8m0, ue8m0)
    a1, topk_ids, topk_weights = (x.to(dev) for x in inputs[r])
    llw.poison(dev, ctx.wg.ranks_per_gpu)

    # prepare_async, then prepare() runs the hook and the receiver at once;
    # prepare_async's caller (finalize_async steps here) runs other work first.
    ctx.barrier()
    expert_x, expert_num_tokens, handle, _, hook = buf.low_latency_dispatch(
        a1,
        topk_ids,
        t,
        E,
        use_fp8=use_fp8,
        round_scale=ue8m0,
        use_ue8m0=ue8m0,
        async_finish=False,
        return_recv_hook=True,
    )
    chk.expect(callable(hook), f"{label}: return_recv_hook=True gave no hook")
    if finalize_async:
        torch.cuda._sleep(1_000_000)  # the shared experts, overlapped with the transfer
    hook()
    # _receiver / _do_quant
    if use_fp8:
        x, x_scales = expert_x
    else:
        x, x_scales = expert_x, None
    check_ll_dispatch(ctx, label, want, x, x_scales, expert_num_tokens, handle, use_fp8, ue8m0)
    if use_fp8 and not block_quant:
        # Not block-quantized: vLLM's dequant_fp8 gets the rows back in bf16.
        x_vllm = vllm_dequant_fp8(x, x_scales).to(BF16)
        x_ref = llw.dequant(x, x_scales, True, False)
        counts = expert_num_tokens.cpu().tolist()
        for j, n in enumerate(counts):
            chk.equal(f"{label} dequant_fp8 of expert {j}", x_vllm[j, :n], x_ref[j, :n])

    fused_expert_output = ll_expert_output(ctx, x, x_scales, use_fp8, ue8m0, E)
    # _finalize: weights applied in the combine kernel, into the caller's output.
    output = torch.full((a1.shape[0], hidden), NAN, dtype=BF16, device=dev)
    ctx.barrier()
    combined, _, recv_hook = buf.low_latency_combine(
        fused_expert_output,
        topk_ids,
        topk_weights,
        handle,
        async_finish=False,
        zero_copy=False,
        return_recv_hook=finalize_async,  # dbo_enabled() or do_async
        out=output,
    )
    chk.expect(
        (recv_hook is not None) == finalize_async,
        f"{label}: recv_hook {recv_hook!r} with return_recv_hook={finalize_async}",
    )
    if recv_hook is not None:
        recv_hook()
    chk.expect(
        combined.data_ptr() == output.data_ptr() or output.numel() == 0,
        f"{label}: low_latency_combine did not return out=",
    )
    check_ll_combine(
        ctx, label, inputs, t, E, fused_expert_output, expert_num_tokens, handle, output, use_fp8
    )


def vllm_dequant_fp8(expert_x_fp8: torch.Tensor, expert_x_scales: torch.Tensor) -> torch.Tensor:
    """vLLM deepep_ll.py ``dequant_fp8``: float32 rows from the fp8 rows and their
    scales made contiguous (so it relies on the scales' logical [E, R*T, H/128] shape)."""
    assert expert_x_fp8.is_contiguous()
    expert_x_scales = expert_x_scales.contiguous()
    num_experts = expert_x_fp8.size(0)
    expert_x_fp32 = expert_x_fp8.to(torch.float32).view(num_experts, -1, 128)
    expert_x_scales = expert_x_scales.view(num_experts, -1, 1)
    return (expert_x_fp32 * expert_x_scales).view(expert_x_fp8.size())


def scenario_vllm_ll(ctx: Ctx) -> None:
    """DeepEPLLPrepareAndFinalize with two models through one manager (two cached
    Buffers): DeepSeek-like hidden 7168 with fp8 block dispatch (and packed ue8m0
    scales, as post_init_setup enables for DeepGEMM), and hidden 2048 with bf16
    dispatch and with per-tensor fp8 (vLLM's dequant_fp8 path); prepare() and
    prepare_async() hooks; finalize (no hook) and finalize_async (hook), out=."""
    R = ctx.world
    E = EXPERTS_PER_RANK * R
    manager = VllmLLManager(ctx)
    try:
        t = 64  # max_num_tokens_per_dp_rank
        big = manager.get_handle(t, 7168, R, E, EXPERTS_PER_RANK)
        small = manager.get_handle(t, 2048, R, E, EXPERTS_PER_RANK)
        ctx.chk.expect(big is not small and len(manager.cache) == 2, "two models, two Buffers")
        ctx.chk.expect(
            big is manager.get_handle(t, 7168, R, E, EXPERTS_PER_RANK),
            "the handle cache gave a new Buffer for the same kwargs",
        )
        steps = [
            (big, 7168, 8, True, False, True, False),
            (big, 7168, 8, True, True, True, True),
            (small, 2048, 4, False, False, False, True),
            (small, 2048, 4, True, False, False, False),
            (big, 7168, 8, True, False, True, True),
        ]
        for i, (buf, hidden, k, fp8, ue8m0, block, fin_async) in enumerate(steps):
            label = (
                f"vllm ll #{i} H={hidden} fp8={fp8} ue8m0={ue8m0} block={block} async={fin_async}"
            )
            vllm_ll_step(
                ctx,
                buf,
                f"vllm_ll/{i}",
                label,
                t=t,
                hidden=hidden,
                k=k,
                use_fp8=fp8,
                ue8m0=ue8m0,
                block_quant=block,
                finalize_async=fin_async,
            )
    finally:
        manager.destroy()


def scenario_vllm_ll_fault_tolerance(ctx: Ctx) -> None:
    """vLLM with enable_fault_tolerance: the Buffer has enable_shrink; the mask is
    queried (query_active_mask / query_fault) and clean_buffers() zeroes this
    rank's whole low-latency buffer through get_local_buffer_tensor, then cleans
    the mask; the next round trips must be exact again."""
    chk, R = ctx.chk, ctx.world
    E = EXPERTS_PER_RANK * R
    manager = VllmLLManager(ctx, enable_shrink=True)
    try:
        t, hidden = 64, 2048
        buf = manager.get_handle(t, hidden, R, E, EXPERTS_PER_RANK)
        step = dict(t=t, hidden=hidden, k=4, use_fp8=True, ue8m0=False, block_quant=True)
        vllm_ll_step(ctx, buf, "vllm_ft/0", "ft before", finalize_async=False, **step)

        # query_active_mask / query_fault
        mask = torch.zeros(R, device=ctx.device, dtype=torch.int32)  # device="cuda"
        buf.low_latency_query_mask_buffer(mask)
        last = torch.zeros_like(mask)
        has_fault = (mask != last).any()
        chk.expect(not bool(has_fault), f"query_fault with every rank alive: mask {mask.tolist()}")

        # clean_buffers
        buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        torch.cuda.synchronize()
        buf.low_latency_clean_mask_buffer()
        torch.cuda.synchronize()
        # vLLM cleans during a reconfiguration that every rank takes part in: no
        # rank sends again before every rank has cleaned.
        dist.barrier(group=ctx.gloo)
        for i in range(3):  # both parities, and back
            vllm_ll_step(
                ctx,
                buf,
                f"vllm_ft/{i + 1}",
                f"ft after clean #{i}",
                finalize_async=(i == 1),
                **step,
            )
        buf.low_latency_query_mask_buffer(mask)
        chk.expect(mask.tolist() == [0] * R, f"mask after the clean: {mask.tolist()}")
    finally:
        manager.destroy()


# ----------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------


class SglDeepEPConfig:
    """``DeepEPConfig``: the configs of a ``--deepep-config`` JSON, else none and
    ``Buffer.num_sms``."""

    def __init__(self, config_parsed: dict | None) -> None:
        if config_parsed:
            config_dispatch = config_parsed["normal_dispatch"]
            config_combine = config_parsed["normal_combine"]
            self.normal_dispatch_config = deep_ep.Config(**config_dispatch)
            self.normal_combine_config = deep_ep.Config(**config_combine)
            assert config_dispatch["num_sms"] == config_combine["num_sms"]
            self.num_sms = config_dispatch["num_sms"]
        else:
            self.normal_dispatch_config = None
            self.normal_combine_config = None
            self.num_sms = deep_ep.Buffer.num_sms


class SglDeepEPBuffer:
    """``DeepEPBuffer``: one Buffer per process (class state), made at the first
    ``get_deepep_buffer``; ``clean_low_latency_buffer`` when the dispatch mode
    turns from normal to low latency. SGLang never destroys it (no
    ``explicitly_destroy``): ``reset`` drops it once every rank is done, as the
    end of the process would."""

    _buffer = None
    _dispatch_mode = None
    _hidden_size = None
    _num_max_dispatch_tokens_per_rank = None
    _num_experts = None
    cleans = 0

    @classmethod
    def get_deepep_buffer(
        cls,
        group,
        hidden_size,
        param_bytes,
        deepep_mode,
        config,
        num_max_dispatch_tokens_per_rank=-1,
        num_experts=-1,
    ):
        if cls._buffer is not None:
            return cls._buffer
        cls._hidden_size = hidden_size
        cls._num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        cls._num_experts = num_experts
        num_nvl_bytes, num_rdma_bytes = 0, 0
        if deepep_mode in ("normal", "auto"):
            configs = (
                config.normal_dispatch_config or deep_ep.Buffer.get_dispatch_config(group.size()),
                config.normal_combine_config or deep_ep.Buffer.get_combine_config(group.size()),
            )
            num_nvl_bytes, num_rdma_bytes = size_hints(configs, hidden_size * param_bytes, group)
        if deepep_mode in ("low_latency", "auto"):
            assert num_max_dispatch_tokens_per_rank != -1
            assert num_experts != -1 and num_experts % group.size() == 0
            num_rdma_bytes = max(
                deep_ep.Buffer.get_low_latency_rdma_size_hint(
                    num_max_dispatch_tokens_per_rank, hidden_size, group.size(), num_experts
                ),
                num_rdma_bytes,
            )
        if deepep_mode == "normal":
            num_qps_per_rank = config.num_sms
        elif deepep_mode == "low_latency":
            num_qps_per_rank = num_experts // group.size()
        else:
            num_qps_per_rank = max(config.num_sms, num_experts // group.size())
        cls._buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode=deepep_mode != "normal",
            num_qps_per_rank=num_qps_per_rank,
            allow_mnnvl=True,
        )
        return cls._buffer

    @classmethod
    def clean_buffer(cls):
        if not cls._buffer.low_latency_mode:
            return
        cls.cleans += 1
        cls._buffer.clean_low_latency_buffer(
            cls._num_max_dispatch_tokens_per_rank, cls._hidden_size, cls._num_experts
        )

    @classmethod
    def set_dispatch_mode_as_normal(cls):
        cls._dispatch_mode = "normal"

    @classmethod
    def set_dispatch_mode_as_low_latency(cls):
        if cls._dispatch_mode == "normal":
            cls.clean_buffer()
        cls._dispatch_mode = "low_latency"

    @classmethod
    def reset(cls, ctx: Ctx) -> None:
        if cls._buffer is not None:
            settle(ctx)
        cls._buffer = None
        cls._dispatch_mode = None
        cls.cleans = 0
        gc.collect()


class SglDispatcherBase(abc.ABC):
    """``_DeepEPDispatcherImplBase``: what both dispatchers keep, and
    ``_get_buffer`` (the dispatcher's ``set_dispatch_mode``, then the one Buffer)."""

    def __init__(
        self,
        ctx,
        *,
        mode,
        hidden,
        num_experts,
        fp8,
        config,
        num_max_dispatch_tokens_per_rank=SGLANG_LL_MAX_TOKENS,
    ):
        self.ctx = ctx
        self.deepep_mode = mode
        self.hidden_size = hidden
        self.num_experts = num_experts
        self.use_fp8 = fp8
        self.params_bytes = 1 if fp8 else 2
        self.config = config
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        assert self.num_max_dispatch_tokens_per_rank <= 1024
        self.handle = None

    @abc.abstractmethod
    def set_dispatch_mode(self) -> None:
        """SglDeepEPBuffer's mode for this dispatcher (normal or low latency)."""

    def _get_buffer(self):
        self.set_dispatch_mode()
        return SglDeepEPBuffer.get_deepep_buffer(
            self.ctx.group,
            self.hidden_size,
            self.params_bytes,
            self.deepep_mode,
            self.config,
            self.num_max_dispatch_tokens_per_rank,
            self.num_experts,
        )


class SglNormal(SglDispatcherBase):
    """``_DeepEPDispatcherImplNormal`` (dispatch_a/b, combine_a/b); ``common`` are
    SglDispatcherBase's keywords. ``deepgemm``: ``ENABLE_JIT_DEEPGEMM``
    (expert_alignment 128, fp8 tokens quantized by the caller as
    ``sglang_per_token_group_quant_fp8`` does, row-major float scales on Hopper)."""

    def __init__(self, ctx, *, deepgemm, async_finish, **common):
        super().__init__(ctx, **common)
        self.deepgemm = deepgemm
        self.async_finish = async_finish
        self.last = None  # the dispatch tuple, for the checks

    def set_dispatch_mode(self) -> None:
        SglDeepEPBuffer.set_dispatch_mode_as_normal()

    def dispatch_a(self, hidden_states, topk_ids, topk_weights):
        topk_ids = topk_ids.to(torch.int64)
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        return hidden_states, topk_ids, topk_weights, previous_event

    def dispatch_b(self, hidden_states, topk_ids, topk_weights, previous_event):
        hidden_states, topk_ids, topk_weights, num_recv_tokens_per_expert, event = (
            self._dispatch_core(hidden_states, topk_ids, topk_weights, previous_event)
        )
        event.current_stream_wait() if self.async_finish else ()
        if isinstance(hidden_states, tuple):
            hidden_states, hidden_states_scale = hidden_states
        else:
            hidden_states_scale = None
        return (
            hidden_states,
            hidden_states_scale,
            topk_ids,
            topk_weights,
            num_recv_tokens_per_expert,
        )

    def _dispatch_core(self, x, topk_ids, topk_weights, previous_event):
        buffer = self._get_buffer()
        (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            previous_event,
        ) = buffer.get_dispatch_layout(
            topk_ids,
            self.num_experts,
            previous_event=previous_event,
            async_finish=self.async_finish,
            allocate_on_comm_stream=previous_event is not None,
        )
        self.last = got = buffer.dispatch(
            x,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event,
            async_finish=self.async_finish,
            allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
            expert_alignment=128 if self.deepgemm else 1,
            config=self.config.normal_dispatch_config,
        )
        recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, self.handle, event = (
            got
        )
        return recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, event

    def combine_a(self, hidden_states):
        output = hidden_states  # the DeepGEMM path hands the reduced rows over as they are
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        return output, previous_event

    def combine_b(self, output, previous_event):
        hidden_states, event = self._combine_core(output, previous_event)
        event.current_stream_wait() if self.async_finish else ()
        self.handle = None
        return hidden_states

    def _combine_core(self, x, previous_event):
        buffer = self._get_buffer()
        combined_x, _, event = buffer.combine(
            x,
            self.handle,
            async_finish=self.async_finish,
            previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None,
            config=self.config.normal_combine_config,
        )
        return combined_x, event


class SglLowLatency(SglDispatcherBase):
    """``_DeepEPDispatcherImplLowLatency``; ``common`` are SglDispatcherBase's
    keywords. ``blackwell``: DeepGEMM on Blackwell (round_scale and use_ue8m0 with
    fp8)."""

    def __init__(self, ctx, *, return_recv_hook, blackwell=False, **common):
        super().__init__(ctx, **common)
        self.blackwell = blackwell
        self.return_recv_hook = return_recv_hook
        self.packed_recv_count = None

    def set_dispatch_mode(self) -> None:
        SglDeepEPBuffer.set_dispatch_mode_as_low_latency()

    def dispatch_a(self, hidden_states, topk_ids, topk_weights):
        buffer = self._get_buffer()
        topk_ids = topk_ids.to(torch.int64)
        expected_m = (
            hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + self.num_experts
        ) // self.num_experts
        hidden_states, masked_m, event, hook = self._dispatch_core(hidden_states, topk_ids)
        return hidden_states, topk_ids, topk_weights, masked_m, expected_m, event, hook

    def dispatch_b(self, hidden_states, topk_ids, topk_weights, masked_m, expected_m, event, hook):
        hook() if self.return_recv_hook else event.current_stream_wait()
        if isinstance(hidden_states, tuple):
            hidden_states, hidden_states_scale = hidden_states
        else:
            hidden_states_scale = None
        return hidden_states, hidden_states_scale, topk_ids, topk_weights, masked_m, expected_m

    def _dispatch_core(self, hidden_states, topk_ids):
        fp8_deepgemm_scale_opts = (
            dict(round_scale=self.blackwell, use_ue8m0=self.blackwell) if self.use_fp8 else dict()
        )
        buffer = self._get_buffer()
        self.ctx.barrier()
        packed_recv_hidden, self.packed_recv_count, self.handle, event, hook = (
            buffer.low_latency_dispatch(
                hidden_states,
                topk_ids,
                self.num_max_dispatch_tokens_per_rank,
                self.num_experts,
                use_fp8=self.use_fp8,
                async_finish=not self.return_recv_hook,
                return_recv_hook=self.return_recv_hook,
                **fp8_deepgemm_scale_opts,
            )
        )
        return packed_recv_hidden, self.packed_recv_count, event, hook

    def combine_a(self, hidden_states, topk_ids, topk_weights):
        return self._combine_core(hidden_states, topk_ids, topk_weights)

    def combine_b(self, hidden_states, event, hook):
        hook() if self.return_recv_hook else event.current_stream_wait()
        return hidden_states

    def _combine_core(self, hidden_states, topk_ids, topk_weights):
        buffer = self._get_buffer()
        self.ctx.barrier()
        combined_hidden_states, event, hook = buffer.low_latency_combine(
            x=hidden_states,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            handle=self.handle,
            async_finish=not self.return_recv_hook,
            return_recv_hook=self.return_recv_hook,
        )
        self.packed_recv_count = self.handle = None
        return combined_hidden_states, event, hook


def sgl_normal_round_trip(
    ctx: Ctx, disp: SglNormal, tag: str, label: str, *, k: int = 8, counts=None
) -> None:
    """An extend (prefill) pass through the normal dispatcher: dispatch_a, the
    dispatch hooks, dispatch_b, the experts, combine_a, combine_b; checked."""
    chk, r, dev = ctx.chk, ctx.rank, ctx.device
    E, hidden = disp.num_experts, disp.hidden_size
    fp8 = disp.params_bytes == 1
    offset = r * (E // ctx.world)
    s = expert_scales(E).to(dev)
    counts = counts or token_counts(ctx, tag, zero_rank=True)
    inputs = iw.Case(hidden, E, k, counts, fp8=fp8).inputs(ctx.data, tag)
    alignment = 128 if disp.deepgemm else 1
    ref = reference.dispatch(inputs, E, expert_alignment=alignment)
    mine = inputs[r]
    hidden_states = mine["x"].to(dev)
    if fp8:  # what sglang_per_token_group_quant_fp8 returns (float scales on Hopper)
        hidden_states = (hidden_states, mine["scales"].to(dev))
    topk_ids = mine["topk_idx"].to(dev)
    topk_weights = mine["topk_weights"].to(dev)

    state = disp.dispatch_a(hidden_states, topk_ids, topk_weights)
    torch.cuda._sleep(500_000)  # the dispatch hooks (expert distribution recorder etc.)
    iw.poison_allocator(dev)
    recv, recv_scale, recv_ids, recv_w, num_recv_tokens_per_expert = disp.dispatch_b(*state)
    iw.check_dispatch(chk, label, disp.last, ref, r, layout=iw.scales_layout(False, counts[r]))
    want_list = list(ref.ranks[r].num_recv_tokens_per_expert)
    chk.expect(
        num_recv_tokens_per_expert == want_list,
        f"{label}: num_recv_tokens_per_expert {num_recv_tokens_per_expert}, expected "
        f"{want_list} (expert_alignment={alignment})",
    )
    chk.expect(
        all(n % alignment == 0 for n in num_recv_tokens_per_expert),
        f"{label}: counts {num_recv_tokens_per_expert} not multiples of {alignment}",
    )

    # The experts (DeepGEMM grouped GEMM over the aligned per-expert blocks, then
    # the post-reorder that applies the top-k weights): one row per received token.
    y = (dequant_rows(recv, recv_scale) * routed_coef(recv_ids, recv_w, s, offset)[:, None]).to(
        BF16
    )
    output, previous_event = disp.combine_a(y)
    iw.poison_allocator(dev)
    combined = disp.combine_b(output, previous_event)
    torch.cuda.synchronize()
    expect_combine(ctx, label, ref, y, combined)
    check_close(
        ctx,
        f"{label} end to end",
        combined,
        moe_reference(
            dequant_rows(mine["x"], mine["scales"]), mine["topk_idx"], mine["topk_weights"], s.cpu()
        ),
        E2E_TOL,
    )


def sgl_ll_round_trip(
    ctx: Ctx, disp: SglLowLatency, tag: str, label: str, *, k: int = 8, inputs=None
) -> None:
    """A decode pass through the low-latency dispatcher; checked."""
    r, dev = ctx.rank, ctx.device
    E, hidden, t = disp.num_experts, disp.hidden_size, disp.num_max_dispatch_tokens_per_rank
    fp8, ue8m0 = disp.use_fp8, disp.use_fp8 and disp.blackwell
    inputs = inputs or ll_inputs(ctx, tag, t, hidden, E, k)
    want = ll_reference(ctx, inputs, t, E, fp8, ue8m0, ue8m0)
    x, topk_ids, topk_weights = (a.to(dev) for a in inputs[r])
    llw.poison(dev, ctx.wg.ranks_per_gpu)
    state = disp.dispatch_a(x, topk_ids, topk_weights)
    handle, count = disp.handle, disp.packed_recv_count
    torch.cuda._sleep(500_000)  # the shared experts, between dispatch_a and dispatch_b
    hidden_states, scale, ids, w, masked_m, expected_m = disp.dispatch_b(*state)
    check_ll_dispatch(ctx, label, want, hidden_states, scale, masked_m, handle, fp8, ue8m0)
    y = ll_expert_output(ctx, hidden_states, scale, fp8, ue8m0, E)
    combined, event, hook = disp.combine_a(y, ids, w)
    combined = disp.combine_b(combined, event, hook)
    check_ll_combine(ctx, label, inputs, t, E, y, count, handle, combined, fp8)


def scenario_sglang_normal(ctx: Ctx) -> None:
    """DeepEPMode.NORMAL: fp8 tokens with DeepGEMM (expert_alignment=128), async
    (captured previous events, allocate_on_comm_stream) and not, with and without
    a --deepep-config JSON; a bf16 server; what moelink does with Blackwell's
    packed UE8M0 scales and with a prefill batch larger than the fp8-sized buffer."""
    R = ctx.world
    E = EXPERTS_PER_RANK * R
    hidden = 2048
    try:
        cfg = SglDeepEPConfig(SGLANG_DEEPEP_CONFIG)
        common = dict(
            mode="normal", hidden=hidden, num_experts=E, fp8=True, deepgemm=True, config=cfg
        )
        disp_async = SglNormal(ctx, async_finish=True, **common)
        disp_sync = SglNormal(ctx, async_finish=False, **common)
        sgl_normal_round_trip(ctx, disp_async, "sgl_n/0", "sglang normal fp8 async json-config")
        sgl_unsupported_ue8m0_scales(ctx, disp_sync)
        sgl_normal_round_trip(ctx, disp_sync, "sgl_n/1", "sglang normal fp8 sync")
        sgl_large_prefill(ctx, disp_sync)
        sgl_normal_round_trip(ctx, disp_async, "sgl_n/2", "sglang normal fp8 async after")
        SglDeepEPBuffer.reset(ctx)
        # A bf16 server (DeepEPOutputDtype.BF16, no DeepGEMM), Buffer.num_sms config.
        cfg = SglDeepEPConfig(None)
        disp_bf16 = SglNormal(
            ctx,
            mode="normal",
            hidden=4096,
            num_experts=E,
            fp8=False,
            deepgemm=False,
            async_finish=True,
            config=cfg,
        )
        sgl_normal_round_trip(ctx, disp_bf16, "sgl_n/3", "sglang normal bf16 async")
        sgl_normal_round_trip(ctx, disp_bf16, "sgl_n/4", "sglang normal bf16 async #2", k=6)
    finally:
        SglDeepEPBuffer.reset(ctx)


def sgl_unsupported_ue8m0_scales(ctx: Ctx, disp: SglNormal) -> None:
    """On Blackwell, sglang_per_token_group_quant_fp8(scale_ue8m0=True,
    column_major_scales=True, scale_tma_aligned=True) hands normal dispatch int32
    words of four packed UE8M0 exponents [N, H/512] (column-major). moelink's
    normal dispatch takes float32 scales only: it must refuse before launching."""
    r, dev, H = ctx.rank, ctx.device, disp.hidden_size
    n = 32
    g = ctx.data.generator("sgl_n/ue8m0", r)
    x = iw.random_fp8(g, n, H).to(dev)
    words = torch.randint(0, 1 << 30, (H // 512, n), generator=g, dtype=torch.int32).to(dev).T
    idx = iw.random_topk_idx(g, n, disp.num_experts, 8).to(dev)
    w = torch.rand(n, 8, generator=g).to(dev)
    state = disp.dispatch_a((x, words), idx, w)
    msg = expect_refused(
        ctx,
        "normal dispatch with packed UE8M0 scales",
        (TypeError, ValueError),
        lambda: disp.dispatch_b(*state),
    )
    if msg:
        ctx.note(
            f"normal dispatch with int32 packed UE8M0 scales (SGLang on Blackwell) is "
            f"refused: {one_line(msg)}"
        )
    torch.cuda.synchronize()


def sgl_large_prefill(ctx: Ctx, disp: SglNormal) -> None:
    """SGLang sizes the normal buffer for hidden * params_bytes (1 with fp8), while
    combine moves bf16 rows, twice as wide. moelink's buffer holds a fixed number
    of slots, so a prefill batch can fit the fp8 dispatch and not the bf16
    combine. Whatever moelink does must be right or a clear error on every rank:
    a ValueError (nothing launched), or results that pass the end-to-end check."""
    R, r, dev = ctx.world, ctx.rank, ctx.device
    buf = SglDeepEPBuffer._buffer
    H, E, k = disp.hidden_size, disp.num_experts, 8
    region = (buf.num_nvl_bytes - moelink_config.COUNTER_BYTES) // 2 // 16 * 16
    cap_dispatch = region // (R * moelink_config.token_record_bytes(H, k, H // 128))
    cap_combine = region // (R * moelink_config.combine_record_bytes(2 * H, 0))
    if cap_combine + 2 >= cap_dispatch:
        ctx.note(
            f"large prefill skipped: combine holds {cap_combine} tokens, dispatch {cap_dispatch}"
        )
        return
    n = (cap_dispatch + cap_combine) // 2
    label = f"sglang large prefill N={n} (est. dispatch cap {cap_dispatch}, combine {cap_combine})"
    g = ctx.data.generator("sgl_n/large", r)
    x = iw.random_fp8(g, n, H)
    scales = iw.random_scales(g, n, H)
    idx = iw.random_topk_idx(g, n, E, k)
    w = torch.rand(n, k, generator=g) + 0.01
    s = expert_scales(E).to(dev)
    state = disp.dispatch_a((x.to(dev), scales.to(dev)), idx.to(dev), w.to(dev))
    try:
        recv, recv_scale, recv_ids, recv_w, _ = disp.dispatch_b(*state)
    except ValueError as e:
        ctx.note(f"{label}: dispatch refused: {one_line(str(e))}")
        return
    coef = routed_coef(recv_ids, recv_w, s, r * (E // R))
    y = (dequant_rows(recv, recv_scale) * coef[:, None]).to(BF16)
    output, previous_event = disp.combine_a(y)
    try:
        combined = disp.combine_b(output, previous_event)
    except ValueError as e:
        ctx.note(f"{label}: the bf16 combine is refused (clear error): {one_line(str(e))}")
        disp.handle = None
        return
    torch.cuda.synchronize()
    check_close(
        ctx,
        f"{label} end to end",
        combined,
        moe_reference(dequant_rows(x, scales), idx, w, s.cpu()),
        E2E_TOL,
    )


def scenario_sglang_ll(ctx: Ctx) -> None:
    """DeepEPMode.LOW_LATENCY: return_recv_hook (two-batch-overlap style) and
    async_finish events, fp8 (Hopper defaults; Blackwell round_scale + use_ue8m0)
    and bf16; newer SGLang keywords moelink lacks (nvfp4, combine overlap args)
    must be refused before anything is launched, and the Buffer works after."""
    R = ctx.world
    E = EXPERTS_PER_RANK * R
    hidden = 4096
    try:
        cfg = SglDeepEPConfig(None)
        common = dict(mode="low_latency", hidden=hidden, num_experts=E, config=cfg)
        hooked = SglLowLatency(ctx, fp8=True, return_recv_hook=True, **common)
        sgl_ll_round_trip(ctx, hooked, "sgl_ll/0", "sglang ll fp8 hook")
        blackwell = SglLowLatency(ctx, fp8=True, return_recv_hook=False, blackwell=True, **common)
        sgl_ll_round_trip(ctx, blackwell, "sgl_ll/1", "sglang ll fp8 ue8m0 async")
        bf16 = SglLowLatency(ctx, fp8=False, return_recv_hook=False, **common)
        sgl_ll_round_trip(ctx, bf16, "sgl_ll/2", "sglang ll bf16 async", k=6)
        sgl_ll_unsupported(ctx, hooked)
        sgl_ll_round_trip(ctx, hooked, "sgl_ll/3", "sglang ll fp8 hook after refusals")
        bf16_hooked = SglLowLatency(ctx, fp8=False, return_recv_hook=True, **common)
        sgl_ll_round_trip(ctx, bf16_hooked, "sgl_ll/4", "sglang ll bf16 hook")
    finally:
        SglDeepEPBuffer.reset(ctx)


def sgl_ll_unsupported(ctx: Ctx, disp: SglLowLatency) -> None:
    """``use_nvfp4=True`` / ``x_global_scale`` (SGLang's nvfp4 dispatch) and the
    single-batch-overlap combine arguments (``overlap``, ``packed_recv_count``,
    ``comp_signal``, ``block_m``, ``threshold``, ``num_sms``; on Blackwell
    ``src_signals``, ``src_signal_expect_value``) are not in moelink's API."""
    r, dev = ctx.rank, ctx.device
    buf = disp._get_buffer()
    E, H, t = disp.num_experts, disp.hidden_size, disp.num_max_dispatch_tokens_per_rank
    x, idx, w = (a.to(dev) for a in ll_inputs(ctx, "sgl_ll/refused", t, H, E, 8)[r])
    msg = expect_refused(
        ctx,
        "low_latency_dispatch(use_nvfp4=True, x_global_scale=...)",
        TypeError,
        lambda: buf.low_latency_dispatch(
            x,
            idx,
            t,
            E,
            use_fp8=False,
            use_nvfp4=True,
            x_global_scale=torch.ones(1, device=dev),
            async_finish=False,
            return_recv_hook=True,
        ),
    )
    if msg:
        ctx.note(f"nvfp4 low-latency dispatch is refused: {one_line(msg)}")
    # A valid dispatch, then the overlap combine arguments.
    ctx.barrier()
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, t, E, use_fp8=False, async_finish=False, return_recv_hook=True
    )
    hook()
    y = recv.clone()
    overlap = dict(
        overlap=True,
        packed_recv_count=count,
        comp_signal=torch.zeros(E // ctx.world, dtype=torch.int32, device=dev),
        block_m=64,
        threshold=1,
        num_sms=8,
    )
    msg = expect_refused(
        ctx,
        "low_latency_combine with single-batch-overlap arguments",
        TypeError,
        lambda: buf.low_latency_combine(
            x=y,
            topk_idx=idx,
            topk_weights=w,
            handle=handle,
            async_finish=False,
            return_recv_hook=True,
            **overlap,
        ),
    )
    if msg:
        ctx.note(f"single-batch-overlap combine arguments are refused: {one_line(msg)}")
    # The combine the dispatch above still owes every peer.
    ctx.barrier()
    _, _, hook = buf.low_latency_combine(
        x=y, topk_idx=idx, topk_weights=w, handle=handle, async_finish=False, return_recv_hook=True
    )
    hook()
    torch.cuda.synchronize()


def scenario_sglang_mode_switch(ctx: Ctx) -> None:
    """DeepEPMode.AUTO: one Buffer for normal (extend) and low-latency (decode)
    passes; clean_low_latency_buffer runs whenever the mode turns from normal to
    low latency: N, L, L, N, L."""
    chk, R = ctx.chk, ctx.world
    E = EXPERTS_PER_RANK * R
    hidden = 2048
    try:
        cfg = SglDeepEPConfig(None)
        common = dict(mode="auto", hidden=hidden, num_experts=E, fp8=True, config=cfg)
        normal = SglNormal(ctx, deepgemm=True, async_finish=False, **common)
        low = SglLowLatency(ctx, return_recv_hook=False, **common)
        for i, mode in enumerate("NLLNL"):
            if mode == "N":
                sgl_normal_round_trip(ctx, normal, f"sgl_auto/{i}", f"sglang auto #{i} normal")
            else:
                sgl_ll_round_trip(ctx, low, f"sgl_auto/{i}", f"sglang auto #{i} low latency")
        chk.expect(
            SglDeepEPBuffer.cleans == 2,
            f"clean_low_latency_buffer ran {SglDeepEPBuffer.cleans} times, expected 2",
        )
        buf = SglDeepEPBuffer._buffer
        chk.expect(
            buf.low_latency_mode and buf.num_nvl_bytes > 0 and buf.num_rdma_bytes > 0,
            "the AUTO Buffer has both parts",
        )
    finally:
        SglDeepEPBuffer.reset(ctx)


def scenario_sglang_tbo(ctx: Ctx) -> None:
    """Two-batch overlap in decode (operations_strategy, tbo_delta_stages=2): two
    dispatchers with return_recv_hook share the Buffer, and micro-batch B's
    dispatch send is issued while A's combine hook is still pending (DeepEP's two
    low-latency buffers allow it; moelink's two buffer halves, numbered by a send
    and a receive counter on the device, too). Both micro-batches must come out
    exact; a refusal of B's send fails the scenario (after A is completed, so that
    the ranks stay in step)."""
    R, r, dev = ctx.world, ctx.rank, ctx.device
    E = EXPERTS_PER_RANK * R
    hidden, t, k = 2048, SGLANG_LL_MAX_TOKENS, 8
    try:
        cfg = SglDeepEPConfig(None)
        common = dict(mode="low_latency", hidden=hidden, num_experts=E, fp8=True, config=cfg)
        a, b = (SglLowLatency(ctx, return_recv_hook=True, **common) for _ in range(2))
        inputs = {m: ll_inputs(ctx, f"sgl_tbo/{m}", t, hidden, E, k) for m in "AB"}
        want = {m: ll_reference(ctx, inputs[m], t, E, True, False, False) for m in "AB"}
        gpu = {m: tuple(x.to(dev) for x in inputs[m][r]) for m in "AB"}
        saved = {}

        def dispatch_a(m, disp):
            state = disp.dispatch_a(*gpu[m])
            saved[m] = (disp.handle, disp.packed_recv_count)
            return state

        def experts_and_combine_a(m, disp, state):
            hidden_states, scale, ids, w, masked_m, _ = disp.dispatch_b(*state)
            check_ll_dispatch(
                ctx, f"tbo {m}", want[m], hidden_states, scale, masked_m, saved[m][0], True, False
            )
            y = ll_expert_output(ctx, hidden_states, scale, True, False, E)
            saved[m] += (y,)
            return disp.combine_a(y, ids, w)

        def finish(m, disp, comb):
            out = disp.combine_b(*comb)
            handle, count, y = saved[m]
            check_ll_combine(ctx, f"tbo {m}", inputs[m], t, E, y, count, handle, out, True)

        llw.poison(dev, ctx.wg.ranks_per_gpu)
        state_a = dispatch_a("A", a)  # A, stage 2: dispatch_a
        comb_a = experts_and_combine_a("A", a, state_a)  # A, stage 3: ... combine_a
        refused = None
        try:
            state_b = dispatch_a("B", b)  # B, stage 2: dispatch_a with A's hook pending
        except RuntimeError as e:
            refused = str(e)
        said = gathered(ctx, refused)
        if any(x is not None for x in said):
            if refused is not None:
                finish("A", a, comb_a)  # the ranks that refused complete A
            raise RuntimeError(
                f"B's dispatch send with A's combine hook pending was refused (two "
                f"low-latency calls in flight must run): {[one_line(x) if x else x for x in said]}"
            )
        finish("A", a, comb_a)  # A, stage 4: combine_b
        comb_b = experts_and_combine_a("B", b, state_b)  # B, stage 3
        finish("B", b, comb_b)  # B, stage 4
    finally:
        SglDeepEPBuffer.reset(ctx)


# ----------------------------------------------------------------------------
# Megatron-LM
# ----------------------------------------------------------------------------

_mg_buffer = None


def mg_get_hidden_bytes(x: torch.Tensor) -> int:
    return x.size(1) * max(x.element_size(), 2)


def mg_get_buffer(group, hidden_bytes: int):
    """fused_a2a.get_buffer: sized by the dispatch and combine configs' hints; a
    new Buffer (the old one dropped) when the group changes or it is too small."""
    global _mg_buffer
    configs = (
        deep_ep.Buffer.get_dispatch_config(group.size()),
        deep_ep.Buffer.get_combine_config(group.size()),
    )
    nvl, rdma = size_hints(configs, hidden_bytes, group)
    buf = _mg_buffer
    if buf is None or buf.group != group or buf.num_nvl_bytes < nvl or buf.num_rdma_bytes < rdma:
        _mg_buffer = deep_ep.Buffer(group, nvl, rdma)
    return _mg_buffer


def mg_previous_event(async_finish: bool):
    """fused_a2a's ``previous_event``: the current stream's, under async_finish."""
    return EventOverlap(EventHandle()) if async_finish else None


def mg_wait(async_finish: bool, after_event) -> None:
    """fused_a2a after a dispatch or combine: the current stream waits under
    async_finish."""
    if async_finish:
        after_event.current_stream_wait()


def mg_save(fn_ctx, group, handle, async_finish, allocate_on_comm_stream, trace) -> None:
    """What a forward keeps for its backward."""
    fn_ctx.group, fn_ctx.handle, fn_ctx.trace = group, handle, trace
    fn_ctx.async_finish, fn_ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream


def mg_reset(ctx: Ctx) -> None:
    global _mg_buffer
    if _mg_buffer is not None:
        settle(ctx)
    _mg_buffer = None
    gc.collect()


class MgFusedDispatch(torch.autograd.Function):
    """fused_a2a.FusedDispatch (``num_worst_tokens`` as Primus-Turbo passes it;
    ``trace`` keeps what the checks need)."""

    @staticmethod
    def forward(
        ctx,
        x,
        token_indices,
        token_probs,
        num_experts,
        group,
        async_finish=False,
        allocate_on_comm_stream=False,
        num_worst_tokens=0,
        trace=None,
    ):
        previous_event = mg_previous_event(async_finish)
        buffer = mg_get_buffer(group, mg_get_hidden_bytes(x))
        (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            event,
        ) = buffer.get_dispatch_layout(
            token_indices,
            num_experts,
            previous_event=previous_event,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        worst = dict(num_worst_tokens=num_worst_tokens) if num_worst_tokens else {}
        got = buffer.dispatch(
            x,
            topk_idx=token_indices,
            topk_weights=token_probs,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            previous_event=event,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
            **worst,
        )
        (
            recv_x,
            recv_token_indices,
            recv_token_probs,
            num_recv_tokens_per_expert_list,
            handle,
            after_event_overlap,
        ) = got
        mg_wait(async_finish, after_event_overlap)
        mg_save(ctx, group, handle, async_finish, allocate_on_comm_stream, trace)
        if trace is not None:
            trace["dispatch"] = got
            trace["buffer"] = (id(buffer), buffer.num_nvl_bytes)
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(
        ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle
    ):
        buffer = mg_get_buffer(ctx.group, mg_get_hidden_bytes(grad_output))
        handle = ctx.handle
        previous_event = mg_previous_event(ctx.async_finish)
        grad_x, grad_token_probs_out, after_event = buffer.combine(
            grad_output.contiguous(),
            handle,
            topk_weights=grad_token_probs.float(),
            previous_event=previous_event,
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream,
        )
        mg_wait(ctx.async_finish, after_event)
        if ctx.trace is not None:
            ctx.trace["dispatch_bwd_in"] = (grad_output.detach(), grad_token_probs.detach())
            ctx.trace["dispatch_bwd_out"] = (grad_x, grad_token_probs_out)
        return grad_x, None, grad_token_probs_out, None, None, None, None, None, None


class MgFusedCombine(torch.autograd.Function):
    """fused_a2a.FusedCombine (``trace`` keeps what the checks need)."""

    @staticmethod
    def forward(
        ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False, trace=None
    ):
        previous_event = mg_previous_event(async_finish)
        buffer = mg_get_buffer(group, mg_get_hidden_bytes(x))
        combined_x, _, after_event = buffer.combine(
            x,
            handle=handle,
            async_finish=async_finish,
            previous_event=previous_event,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        mg_wait(async_finish, after_event)
        mg_save(ctx, group, handle, async_finish, allocate_on_comm_stream, trace)
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, grad_none=None):
        previous_event = mg_previous_event(ctx.async_finish)
        buffer = mg_get_buffer(ctx.group, mg_get_hidden_bytes(grad_output))
        grad_x, _, _, _, _, after_event = buffer.dispatch(
            grad_output.contiguous(),
            handle=ctx.handle,
            previous_event=previous_event,
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream,
        )
        mg_wait(ctx.async_finish, after_event)
        if ctx.trace is not None:
            ctx.trace["combine_bwd_in"] = grad_output.detach()
            ctx.trace["combine_bwd_out"] = grad_x
        return grad_x, None, None, None, None, None


@dataclass
class MgLayer:
    label: str
    hidden: int
    num_experts: int
    worst: int
    inputs: list
    ref: object
    grads: list  # every rank's upstream gradient of the layer output (bf16 [N_r, H])
    x: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor
    y: torch.Tensor
    trace: dict


def mg_router_probs(ctx: Ctx, tag: str, n: int, num_experts: int, k: int, r: int):
    """Rank ``r``'s router probabilities, float32 [n, E]: k distinct experts per
    token with distinct positive probabilities, about 10 % of them dropped to 0
    as a capacity factor does (setup_metadata then masks their ids to -1)."""
    g = ctx.data.generator(tag, r)
    chosen = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :k]
    p = torch.rand(n, k, generator=g) * 0.9 + 0.05
    p[torch.rand(n, k, generator=g) < 0.1] = 0.0
    return torch.zeros(n, num_experts).scatter(1, chosen, p)


def mg_forward(
    ctx: Ctx,
    tag: str,
    label: str,
    hidden: int,
    *,
    k: int = 8,
    async_finish: bool,
    allocate_on_comm_stream: bool,
    worst: int = 0,
) -> MgLayer:
    """One MoE layer's forward through MoEFlexTokenDispatcher's DeepEP path:
    setup_metadata (top-k of the router probabilities, dropped ones -1),
    FusedDispatch, the experts (probabilities applied per token), FusedCombine."""
    R, r, dev = ctx.world, ctx.rank, ctx.device
    E = EXPERTS_PER_RANK * R
    counts = token_counts(ctx, tag, zero_rank=True)
    inputs, grads, probs_all = [], [], []
    for q, n in enumerate(counts):
        probs = mg_router_probs(ctx, tag, n, E, k, q)
        g = ctx.data.generator(tag + "/x", q)
        x = iw.random_bf16(g, n, hidden)
        grads.append(iw.random_bf16(g, n, hidden))
        token_probs, token_indices = torch.topk(probs, k, dim=-1)
        token_indices = token_indices.masked_fill(token_probs == 0, -1)
        inputs.append(dict(x=x, scales=None, topk_idx=token_indices, topk_weights=token_probs))
        probs_all.append(probs)
    ref = reference.dispatch(inputs, E, num_worst_tokens=worst)

    x = inputs[r]["x"].to(dev, copy=True).requires_grad_()
    probs = probs_all[r].to(dev, copy=True).requires_grad_()
    # _DeepepManager.setup_metadata
    token_probs, token_indices = torch.topk(probs, k, dim=-1)
    token_indices = token_indices.masked_fill(token_probs == 0, -1)
    ctx.chk.equal(
        f"{label} setup_metadata topk ids (GPU vs CPU topk)", token_indices, inputs[r]["topk_idx"]
    )
    trace: dict = {}
    iw.poison_allocator(dev)
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = MgFusedDispatch.apply(
        x.contiguous(),
        token_indices,
        token_probs.float(),
        E,
        ctx.group,
        async_finish,
        allocate_on_comm_stream,
        worst,
        trace,
    )
    want_list = list(ref.ranks[r].num_recv_tokens_per_expert)
    ctx.chk.expect(
        tokens_per_expert.tolist() == want_list,
        f"{label}: tokens_per_expert {tokens_per_expert.tolist()}, expected {want_list}",
    )
    # The experts (permute, grouped MLP, unpermute with the probabilities).
    s = expert_scales(E).to(dev)
    coef = routed_coef(recv_idx, recv_probs, s, r * EXPERTS_PER_RANK)
    y = (recv_x.float() * coef[:, None]).to(BF16)
    iw.poison_allocator(dev)
    out, _ = MgFusedCombine.apply(
        y, ctx.group, handle, async_finish, allocate_on_comm_stream, trace
    )
    return MgLayer(label, hidden, E, worst, inputs, ref, grads, x, probs, out, y, trace)


def mg_backward(ctx: Ctx, layer: MgLayer) -> None:
    loss = (layer.out.float() * layer.grads[ctx.rank].to(ctx.device).float()).sum()
    iw.poison_allocator(ctx.device)
    loss.backward()


def mg_check(ctx: Ctx, layer: MgLayer) -> None:
    """Forward and backward of one layer, bit for bit and end to end."""
    chk, r, label, tr = ctx.chk, ctx.rank, layer.label, layer.trace
    torch.cuda.synchronize()
    ref, worst = layer.ref, layer.worst
    n_recv = ref.ranks[r].num_recv_tokens
    if "dispatch" not in tr or "combine_bwd_out" not in tr or "dispatch_bwd_out" not in tr:
        chk.expect(False, f"{label}: a dispatch / combine did not run: {sorted(tr)}")
        return
    iw.check_dispatch(chk, label, tr["dispatch"], ref, r, worst=worst)
    expect_combine(ctx, f"{label} forward", ref, layer.y, layer.out)
    # FusedCombine.backward: a cached dispatch of the upstream gradient.
    chk.equal(
        f"{label} combine backward input", tr["combine_bwd_in"], layer.grads[r].to(ctx.device)
    )
    want_grad_y = reference.dispatch_cached(ref, layer.grads)[r][0]
    rows = want_grad_y.shape[0]
    got = tr["combine_bwd_out"]
    chk.expect(
        tuple(got.shape) == (rows, layer.hidden),
        f"{label}: combine backward gave {list(got.shape)} rows, expected {rows}",
    )
    if got.shape[0] == rows:
        chk.equal(f"{label} combine backward (cached dispatch)", got[:n_recv], want_grad_y[:n_recv])
    # FusedDispatch.backward: a combine of the gradients and their probabilities.
    gx, gp = tr["dispatch_bwd_in"]
    grad_x, grad_probs = tr["dispatch_bwd_out"]
    expect_combine(ctx, f"{label} dispatch backward", ref, gx, grad_x, w=gp, got_w=grad_probs)
    chk.equal(f"{label} x.grad", layer.x.grad, grad_x)
    # End to end: the layer is out = x * sum_k p_k s_k.
    E = layer.num_experts
    s = expert_scales(E)
    inp = layer.inputs[r]
    g = layer.grads[r].float()
    coef = routed_coef(inp["topk_idx"], inp["topk_weights"], s, 0)
    check_close(
        ctx, f"{label} forward end to end", layer.out, inp["x"].float() * coef[:, None], E2E_TOL
    )
    check_close(ctx, f"{label} x.grad end to end", layer.x.grad, g * coef[:, None], E2E_TOL)
    dot = (g * inp["x"].float()).sum(dim=1, keepdim=True)
    idx = inp["topk_idx"]
    want_p = torch.zeros(idx.shape[0], E)
    valid = idx >= 0
    rows_i = torch.arange(idx.shape[0])[:, None].expand_as(idx)[valid]
    want_p[rows_i, idx[valid]] = (dot * s[idx.clamp(min=0)])[valid]
    check_close(ctx, f"{label} router probs grad end to end", layer.probs.grad, want_p, E2E_TOL)


def megatron_layers(
    ctx: Ctx, *, async_finish: bool, allocate_on_comm_stream: bool, worst: bool = False
) -> None:
    """MoEFlexTokenDispatcher with the deepep backend: _DeepepManager sets the SMs,
    then forward + backward of a few steps."""
    deep_ep.Buffer.set_num_sms(20)  # set_deepep_num_sms(moe_flex_dispatcher_num_sms or 20)
    R = ctx.world
    try:
        for i, hidden in enumerate((2048, 7168, 2048)):
            w = R * TOKENS[1] if worst else 0
            label = f"megatron #{i} H={hidden} async={async_finish} worst={w}"
            layer = mg_forward(
                ctx,
                f"mg/{int(async_finish)}{int(worst)}/{i}",
                label,
                hidden,
                async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream,
                worst=w,
            )
            mg_backward(ctx, layer)
            mg_check(ctx, layer)
    finally:
        mg_reset(ctx)


def scenario_megatron_flex_sync(ctx: Ctx) -> None:
    """Megatron's flex dispatcher with async_finish=False: FusedDispatch /
    FusedCombine forward, and backward (combine is dispatch's backward, a cached
    dispatch is combine's)."""
    megatron_layers(ctx, async_finish=False, allocate_on_comm_stream=False)


def scenario_megatron_worst_tokens(ctx: Ctx) -> None:
    """The same with num_worst_tokens (CUDA-graph-friendly, no CPU wait), as
    Primus-Turbo's Megatron flex path passes it: padded outputs, empty counts."""
    megatron_layers(ctx, async_finish=False, allocate_on_comm_stream=False, worst=True)


def scenario_megatron_flex(ctx: Ctx) -> None:
    """Megatron's defaults (token_dispatch / token_combine: async_finish=True,
    allocate_on_comm_stream=True): previous_event = EventOverlap(EventHandle()),
    after_event.current_stream_wait(), forward and backward."""
    megatron_layers(ctx, async_finish=True, allocate_on_comm_stream=True)


def scenario_megatron_realloc(ctx: Ctx) -> None:
    """get_buffer's reallocation: layer 1 (hidden 2048) forward, layer 2 (hidden
    4096) forward needs a bigger Buffer, so get_buffer makes one and drops the old
    (collected without explicitly_destroy); backward of layer 2, then of layer 1,
    whose handle came from the dropped Buffer, now on the new one."""
    deep_ep.Buffer.set_num_sms(20)
    try:
        mode = dict(async_finish=False, allocate_on_comm_stream=False)
        l1 = mg_forward(ctx, "mg_re/1", "megatron realloc L1 H=2048", 2048, **mode)
        first = l1.trace.get("buffer", (None, 0))
        l2 = mg_forward(ctx, "mg_re/2", "megatron realloc L2 H=4096", 4096, **mode)
        second = l2.trace.get("buffer", (None, 0))
        ctx.chk.expect(
            second[0] != first[0] and second[1] > first[1],
            f"layer 2 should have made a bigger Buffer: {first} then {second}",
        )
        mg_backward(ctx, l2)
        mg_backward(ctx, l1)
        mg_check(ctx, l2)
        mg_check(ctx, l1)
    finally:
        mg_reset(ctx)


SCENARIOS = worker_driver.scenario_table(globals(), SCENARIO_NAMES)


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


def run_one(ctx: Ctx, name: str) -> None:
    ctx.name = name
    ctx.chk = iw.Checker()
    ctx.ll.errors = []
    try:
        SCENARIOS[name](ctx)
        torch.cuda.synchronize()
    finally:
        ctx.chk.errors.extend(ctx.ll.errors)
        ctx.ll.errors = []
    ctx.chk.done()


def after_failure(ctx: Ctx) -> None:
    """Drops what a failed scenario may have left (its own Buffers are destroyed
    by its ``finally``)."""
    SglDeepEPBuffer.reset(ctx)
    mg_reset(ctx)


def run_all(wg: worker_driver.WorkerGroup) -> int:
    backend = getattr(deep_ep, "BACKEND", "a real DeepEP")
    names, seed = worker_driver.start_scenarios(
        wg,
        SCENARIOS_ENV,
        SCENARIO_NAMES,
        SEED_ENV,
        who=f"frameworks_worker: deep_ep from {deep_ep.__file__} (backend {backend}); ",
    )
    if backend != "moelink":
        raise RuntimeError(f"import deep_ep is {backend}, not moelink's alias: nothing to test")
    data = iw.Ctx(wg.rank, wg.world, wg.device, wg.group, wg.gloo, seed)
    ll = llw.Ctx(wg.rank, wg.world, seed, wg.device, wg.ranks_per_gpu, wg.gloo)
    ctx = Ctx(wg, seed, data, ll, iw.Checker())
    return worker_driver.run_scenarios(
        wg,
        names,
        lambda name: run_one(ctx, name),
        timeout_s=SCENARIO_TIMEOUT_S,
        on_failure=lambda: after_failure(ctx),
    )


if __name__ == "__main__":
    sys.exit(worker_driver.worker_main(CONTROL_TIMEOUT_S, run_all))
