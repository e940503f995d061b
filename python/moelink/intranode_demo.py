"""The intranode high-throughput workload of docs/performance.md, as a library.

DeepEP's standard workload: every rank routes ``num_tokens`` tokens of ``hidden``
bf16 channels to the top-``num_topk`` of ``num_experts`` experts (top-k of random
scores), experts spread evenly over the ranks. ``python -m moelink`` and
``benches/intranode_bench.py`` run it; the pieces:

- :func:`make_inputs`: one rank's inputs, rebuilt bit for bit by any process
  (``torch.Generator(seed * 1000 + rank)`` on the CPU).
- :func:`run_rank`: the GPU path, one call per rank: a ``moelink.Buffer``, layout,
  dispatch (bf16 and fp8), combine, each checked against ``moelink.reference``
  and then timed for every SM count, next to ``torch.distributed.all_to_all_single``
  moving the same rows in the same run (NCCL groups only: where ranks share a GPU
  the group is gloo, which cannot move CUDA tensors, and the baseline is skipped).
- :func:`run_on_local_gpus`: :func:`run_rank` on N spawned ranks placed
  round-robin on the local GPUs, several per GPU where N exceeds them (under MPS
  where ``moelink.launch`` can have it).
- :func:`run_cpu_simulation`: no GPU: the same workload through the CPU reference
  with all ranks simulated in one process, checked against an independent
  computation, timed by the wall clock.
- :func:`aggregate` (per-rank results -> one result) and :func:`format_report`
  (the correctness verdict and one table).

The metric (docs/performance.md): bytes received per rank over the kernel time;
``recv_x.numel() * 2`` for bf16 dispatch and for combine, times ``(1 + 4/128) / 2``
for fp8 dispatch with its scales. The rank's own tokens count too, as in DeepEP.
Timed dispatches are cached (the layout handle passed back), as DeepEP times
them; the ``dispatch bf16 uncached`` row is the full call (layout arguments,
CPU wait for the counts) and has no target.

Module-level imports are the standard library's, ``moelink.launch`` (itself
standard library only) and ``moelink._native`` (the limits); torch,
``moelink.Buffer`` and ``moelink.reference`` are imported where used, so this
module imports on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from dataclasses import dataclass

from . import _env, _native
from .launch import NO_MULTICAST_ENV

__all__ = [
    "DEFAULT_SMS",
    "NO_MULTICAST_ENV",
    "add_arguments",
    "aggregate",
    "cast_to_fp8",
    "check_options",
    "dequantize_fp8",
    "format_report",
    "make_inputs",
    "run_cpu_simulation",
    "run_on_local_gpus",
    "run_rank",
    "shared_gpu_note",
]

#: SM counts :func:`run_rank` times unless told otherwise.
DEFAULT_SMS = (24, 32, 48)
#: Channels per fp8 scale.
SCALE_BLOCK = 128
#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Bytes received per rank for fp8 dispatch relative to bf16 (1 byte per channel
#: plus one float32 scale per 128 channels, over 2 bytes per channel).
FP8_BYTES_FACTOR = (1 + 4 / SCALE_BLOCK) / 2
#: Bytes written to a scratch tensor before every timed iteration (flushes L2).
L2_FLUSH_BYTES = 256 << 20
#: Timed repeats of each reference call on the CPU path at most.
CPU_MAX_REPEATS = 3

# Bounds of the command-line options (:func:`check_options`). Ranks, experts per
# rank, top-k and SM counts are the kernels' limits (``moelink._native.limits()``);
# the others keep a run within memory and time (every rank builds every rank's
# inputs on the CPU).
_LIMITS = {name: value for name, value, _ in _native.limits()}
MAX_RANKS = _LIMITS["max_ranks"]
#: --nodes at most (the internode kernels' node limit).
MAX_NODES = 16
MAX_EXPERTS_PER_RANK = _LIMITS["max_experts_per_rank"]
MAX_TOPK = _LIMITS["max_topk"]
MIN_SMS = _LIMITS["min_num_sms"]
MAX_SMS = _LIMITS["max_num_sms"]
MAX_TOKENS = 1 << 16
MAX_HIDDEN = 1 << 16
MAX_ITERS = 100_000
MAX_SEED = 2**32 - 1

# Operation names (keys of the result rows) and how the table prints them.
LAYOUT = "layout"
LAYOUT_HOST_CHECK = "layout_host_check"
DISPATCH_BF16 = "dispatch_bf16"
DISPATCH_FP8 = "dispatch_fp8"
COMBINE_BF16 = "combine_bf16"
#: combine of a copy of recv_x (memory of torch's allocator): with the direct
#: dispatch (MOELINK_INTRANODE_RECV=direct) recv_x itself lies in the receive
#: pool and the peers read it where it is; a copy is sent as records.
COMBINE_BF16_X_COPY = "combine_bf16_x_copy"
DISPATCH_BF16_UNCACHED = "dispatch_bf16_uncached"
DISPATCH_BF16_UNCACHED_HOST_CHECK = "dispatch_bf16_uncached_host_check"
BASELINE = "all_to_all_single"
OP_LABELS = {
    LAYOUT: "layout",
    LAYOUT_HOST_CHECK: "layout, host id check",
    DISPATCH_BF16: "dispatch bf16",
    DISPATCH_FP8: "dispatch fp8",
    COMBINE_BF16: "combine bf16",
    COMBINE_BF16_X_COPY: "combine bf16, x a copy",
    DISPATCH_BF16_UNCACHED: "dispatch bf16 uncached",
    DISPATCH_BF16_UNCACHED_HOST_CHECK: "uncached+host id chk",
    BASELINE: "all_to_all_single",
}


@dataclass(frozen=True)
class Target:
    """docs/performance.md's targets for one operation (GB/s), and DeepEP's figure."""

    best_gbps: float  # the best configuration with at most TARGET_MAX_SMS SMs
    at_compare_sms_gbps: float  # with exactly COMPARE_SMS SMs
    deepep_gbps: float  # DeepEP V1, tuned, COMPARE_SMS SMs
    deepep_us: float


#: Targets hold with at most this many SMs.
TARGET_MAX_SMS = 48
#: The SM count compared with DeepEP at equal SMs.
COMPARE_SMS = 24
TARGETS = {
    DISPATCH_BF16: Target(400.0, 330.0, 261.0, 811.0),
    DISPATCH_FP8: Target(380.0, 320.0, 255.0, 428.0),
    COMBINE_BF16: Target(420.0, 370.0, 354.0, 599.0),
}
LAYOUT_TARGET_US = 20.0
LAYOUT_DEEPEP_US = 42.0


# ----------------------------------------------------------------------------
# Inputs


def cast_to_fp8(x):
    """``x`` [N, H] (H a multiple of 128) as ``(float8_e4m3fn [N, H], float32
    scales [N, H / 128])``: every block of 128 channels is divided by
    ``amax / 448`` (amax clamped to at least 1e-4), as DeepEP's tests do."""
    import torch

    n, h = x.shape
    if h % SCALE_BLOCK != 0:
        raise ValueError(f"hidden must be a multiple of {SCALE_BLOCK}, got {h}")
    blocks = x.float().view(n, h // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    fp8 = (blocks * (FP8_MAX / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, h)
    return fp8, (amax / FP8_MAX).contiguous()


def dequantize_fp8(x_fp8, scales):
    """float32 ``x_fp8 * scales`` with one scale per 128 channels."""
    n, h = x_fp8.shape
    blocks = x_fp8.float().view(n, h // SCALE_BLOCK, SCALE_BLOCK)
    return (blocks * scales.float().unsqueeze(2)).view(n, h)


def _check_workload(num_ranks, num_tokens, hidden, num_experts, num_topk) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if hidden < SCALE_BLOCK or hidden % SCALE_BLOCK != 0:
        raise ValueError(f"hidden must be a positive multiple of {SCALE_BLOCK}, got {hidden}")
    if num_experts < num_ranks or num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})"
        )
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in 1..{num_experts}, got {num_topk}")


def make_inputs(
    rank: int,
    num_ranks: int,
    num_tokens: int = 4096,
    hidden: int = 7168,
    num_experts: int = 256,
    num_topk: int = 8,
    seed: int = 0,
) -> dict:
    """Rank ``rank``'s inputs of the workload, as CPU tensors.

    Returns a dict: ``x`` bf16 [N, H] (random normal, no zero element),
    ``x_fp8`` float8_e4m3fn [N, H] and ``x_scales`` float32 [N, H / 128]
    (:func:`cast_to_fp8` of ``x``), ``topk_idx`` int64 [N, K] (the top-k of random
    scores, every entry a valid expert) and ``topk_weights`` float32 [N, K] (softmax
    of the chosen scores). Everything comes from ``torch.Generator`` seeded with
    ``seed * 1000 + rank``, so any process rebuilds any rank's inputs exactly.
    """
    import torch

    _check_workload(num_ranks, num_tokens, hidden, num_experts, num_topk)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in 0..{num_ranks - 1}, got {rank}")
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.randn(num_tokens, num_experts, generator=g)
    top_scores, topk_idx = scores.topk(num_topk, dim=1)
    topk_weights = torch.softmax(top_scores, dim=1).to(torch.float32)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    x = x.masked_fill(x == 0, 1.0)  # never time or check on zeros
    x_fp8, x_scales = cast_to_fp8(x)
    return {
        "x": x,
        "x_fp8": x_fp8,
        "x_scales": x_scales,
        "topk_idx": topk_idx.to(torch.int64),
        "topk_weights": topk_weights,
    }


def _workload(args) -> dict:
    return {
        "num_tokens": int(args.num_tokens),
        "hidden": int(args.hidden),
        "num_experts": int(args.num_experts),
        "num_topk": int(args.num_topk),
        "seed": int(getattr(args, "seed", 0)),
    }


def _all_inputs(num_ranks: int, workload: dict) -> list:
    return [make_inputs(r, num_ranks, **workload) for r in range(num_ranks)]


def _reference_inputs(inputs: list, fp8: bool) -> list:
    """The per-rank dicts ``moelink.reference.dispatch`` takes."""
    return [
        {
            "x": i["x_fp8"] if fp8 else i["x"],
            "scales": i["x_scales"] if fp8 else None,
            "topk_idx": i["topk_idx"],
            "topk_weights": i["topk_weights"],
        }
        for i in inputs
    ]


# ----------------------------------------------------------------------------
# Checks


class Checks:
    """Named pass/fail results, with a short detail for each failure."""

    def __init__(self) -> None:
        self.items: list = []

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append({"name": name, "ok": bool(ok), "detail": "" if ok else detail})
        return bool(ok)

    def equal(self, name: str, got, want) -> bool:
        """Bit-exact tensor (or list) equality; the detail says where it differs."""
        import torch

        if not isinstance(want, torch.Tensor):
            return self.add(name, got == want, f"got {_short(got)}, expected {_short(want)}")
        if not isinstance(got, torch.Tensor):
            return self.add(name, False, f"got {_short(got)}, expected a tensor")
        got = got.detach()
        want = want.to(got.device)
        if got.shape != want.shape:
            return self.add(name, False, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype != want.dtype:
            return self.add(name, False, f"dtype {got.dtype}, expected {want.dtype}")
        a, b = _as_bits(got), _as_bits(want)
        if torch.equal(a, b):
            return self.add(name, True)
        bad = (a != b).reshape(a.shape[0], -1).any(dim=1) if a.dim() > 0 else a != b
        rows = bad.nonzero().flatten()
        first = int(rows[0]) if rows.numel() else -1
        return self.add(name, False, f"{rows.numel()} rows differ, first at row {first}")

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.items)

    def failures(self) -> list:
        return [c for c in self.items if not c["ok"]]


def _as_bits(t):
    """An integer view of ``t`` (so NaNs and -0.0 compare by bits)."""
    import torch

    t = t.contiguous()
    if t.dtype == torch.bool or not (t.is_floating_point()):
        return t
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


# ----------------------------------------------------------------------------
# Timing and result rows


def _row(op: str, num_sms, times_us: list, nbytes) -> dict:
    med = statistics.median(times_us)
    return {
        "op": op,
        "num_sms": num_sms,
        "median_us": med,
        "min_us": min(times_us),
        "max_us": max(times_us),
        "iters": len(times_us),
        "bytes": nbytes,
        "GBps": None if nbytes is None else nbytes / (med * 1e-6) / 1e9,
    }


def _cross_node_bf16_bytes(rank: int, tokens_per_node, per_node: int | None, hidden: int):
    """``(rdma, xnode)`` bf16 bytes of this rank's tokens by node, None on one
    node. ``rdma``: DeepEP's "RDMA send" formula (its test_internode.py): every
    (token, destination node) pair, this rank's own node included, times
    ``hidden * 2``; ``xnode``: the pairs of the other nodes only (what the
    proxy carries; the forwarder fans each out on that node's NVLink).
    ``tokens_per_node``: the rank's ``num_tokens_per_rdma_rank``; ``per_node``:
    ranks per node."""
    if per_node is None or tokens_per_node is None:
        return None
    own_node = rank // per_node
    counts = [int(c) for c in tokens_per_node]
    other = sum(c for n, c in enumerate(counts) if n != own_node)
    return sum(counts) * hidden * 2, other * hidden * 2


def _with_cross_node(row: dict, node_bf16_bytes, bf16_bytes: int) -> dict:
    """``row`` plus ``rdma_bytes`` / ``rdma_GBps`` and ``xnode_bytes`` /
    ``xnode_GBps`` (see :func:`_cross_node_bf16_bytes`; scaled like the row's
    bytes for fp8, over the same median time) where the group spans nodes."""
    if node_bf16_bytes is None or row["bytes"] is None or not bf16_bytes:
        return row
    out = dict(row)
    for key, b in zip(("rdma", "xnode"), node_bf16_bytes):
        nbytes = b * row["bytes"] / bf16_bytes
        out[f"{key}_bytes"] = nbytes
        out[f"{key}_GBps"] = nbytes / (row["median_us"] * 1e-6) / 1e9
    return out


def _time_gpu(fn, iters: int, warmup: int, scratch) -> list:
    """Microseconds of ``fn()`` per iteration, by CUDA events on the current
    stream, with ``scratch`` overwritten (L2 flushed) before every iteration."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        scratch.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _time_cpu(fn, repeats: int) -> tuple:
    """(wall-clock microseconds of each call, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times, out


def _log(rank, msg: str) -> None:
    if rank in (0, None):
        print(f"[intranode] {msg}", flush=True)


# ----------------------------------------------------------------------------
# GPU path


def run_rank(rank: int, num_ranks: int, group, args) -> dict:
    """The workload on this rank's GPU (``torch.cuda.current_device()``).

    Every rank of ``group`` calls it at once with the same ``args`` (an
    ``argparse.Namespace`` from :func:`add_arguments`: ``num_tokens``,
    ``hidden``, ``num_experts``, ``num_topk``, ``sms``, ``iters``, ``warmup``,
    ``seed``). For every SM count the outputs of the layout, dispatch (bf16,
    then cached bf16 and fp8), and combine are compared with
    ``moelink.reference`` (bit-exact, order included) before they are timed.
    The ``all_to_all_single`` baseline runs where ``group`` is NCCL (every rank
    on its own GPU); on another backend (gloo: ranks that share a GPU) it is
    skipped and the result says why (``baseline_skipped``). Where ranks share a
    GPU, SM counts above a rank's share of it are left out (``sms_note``).
    Returns this rank's result (see :func:`format_report`); a failed check does
    not stop the timing, it sets ``correct`` to False.
    """
    import torch
    import torch.distributed as dist

    import moelink

    workload = _workload(args)
    iters, warmup = int(args.iters), int(args.warmup)
    n, hidden, num_experts = workload["num_tokens"], workload["hidden"], workload["num_experts"]
    device = torch.device("cuda", torch.cuda.current_device())
    gpus = _gpu_placement(group, device)
    sms, sms_note = _sms_within_share([int(s) for s in args.sms], gpus)
    if sms_note:
        _log(rank, sms_note)
    baseline_skipped = None
    if dist.get_backend(group) != "nccl":
        baseline_skipped = (
            f"all_to_all_single skipped: the group is {dist.get_backend(group)} "
            "(ranks share a GPU; NCCL refuses that, gloo cannot move CUDA tensors)"
        )

    # Inputs of every rank (the reference needs them all), this rank's on the GPU.
    # Each rank computes the whole reference and keeps its own part; ranks take
    # turns where the host cannot hold every rank's computation at once.
    at_once = _reference_builders(num_ranks, workload, gpus["mem_available"])
    turns = f" ({at_once} ranks at a time: host memory)" if at_once < num_ranks else ""
    _log(rank, f"building inputs and the CPU reference for {num_ranks} ranks{turns}")
    error = None
    for turn in range(0, num_ranks, at_once):
        if turn <= rank < turn + at_once:
            try:
                mine, own = _own_reference(
                    rank, num_ranks, workload, device, ranks_per_node(num_ranks, args)
                )
            except Exception as e:  # noqa: BLE001 - raised after the turns, which every rank takes
                error = e
        dist.barrier(group=group)
    if error is not None:
        raise error
    want, want_fp8 = own["want"], own["want_fp8"]
    ref_combined_w, ref_layout = own["combined_w"], own["layout"]
    want_combined_x = own["combined_x"].to(torch.bfloat16).to(device)
    recv_tokens, rank_prefix = own["recv_tokens"], own["rank_prefix"]
    bf16_bytes = recv_tokens[rank] * hidden * 2

    checks = Checks()
    rows: list = []
    scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    config = moelink.Config(num_sms=max(sms))
    num_nvl_bytes = config.get_nvl_buffer_size_hint(hidden * 2, num_ranks, max_tokens_per_rank=n)
    per_node = ranks_per_node(num_ranks, args)
    node_bytes = _cross_node_bf16_bytes(rank, own["per_node"], per_node, hidden)
    num_rdma_bytes = 0
    if per_node is not None:
        num_rdma_bytes = config.get_rdma_buffer_size_hint(
            hidden * 2, num_ranks, max_tokens_per_rank=n, ranks_per_node=per_node
        )
    _log(rank, f"Buffer of {(num_nvl_bytes + num_rdma_bytes) / 2**20:.1f} MiB per rank")
    buffer = moelink.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
    try:
        # Layout (no SM count: one kernel of its own).
        layout = buffer.get_dispatch_layout(mine["topk_idx"], num_experts)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert = layout[:3]
        is_token_in_rank = layout[3]
        checks.equal("layout.num_tokens_per_rank", num_tokens_per_rank, ref_layout[0])
        if own["per_node"] is None:
            checks.add(
                "layout.num_tokens_per_rdma_rank is None",
                num_tokens_per_rdma_rank is None,
                f"got {_short(num_tokens_per_rdma_rank)}",
            )
        else:
            checks.equal(
                "layout.num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, own["per_node"]
            )
        checks.equal("layout.num_tokens_per_expert", num_tokens_per_expert, ref_layout[1])
        checks.equal("layout.is_token_in_rank", is_token_in_rank, ref_layout[2])
        dist.barrier(group=group)

        def layout_call():
            return buffer.get_dispatch_layout(mine["topk_idx"], num_experts)

        times = _time_gpu(layout_call, iters, warmup, scratch)
        rows.append(_row(LAYOUT, None, times, None))
        # The same call with the host-side id range check as well (the debug
        # switch; a device sync per call), which the device-side check replaced.
        times = _time_with_host_id_check(layout_call, iters, warmup, scratch)
        rows.append(_row(LAYOUT_HOST_CHECK, None, times, None))

        layout_args = {
            "num_tokens_per_rank": num_tokens_per_rank,
            "is_token_in_rank": is_token_in_rank,
            "num_tokens_per_expert": num_tokens_per_expert,
            "topk_idx": mine["topk_idx"],
            "topk_weights": mine["topk_weights"],
        }
        x_fp8 = (mine["x_fp8"], mine["x_scales"])
        for s in sms:
            config = moelink.Config(num_sms=s)
            tag = f"[sms={s}]"
            _log(rank, f"checking and timing with {s} SMs")

            # Full dispatch: every output against the reference.
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
                mine["x"], config=config, **layout_args
            )
            checks.equal(f"dispatch_bf16{tag}.recv_x", recv_x, want.recv_x)
            checks.equal(f"dispatch_bf16{tag}.recv_topk_idx", recv_idx, want.recv_topk_idx)
            checks.equal(f"dispatch_bf16{tag}.recv_topk_weights", recv_w, want.recv_topk_weights)
            checks.equal(
                f"dispatch_bf16{tag}.num_recv_tokens_per_expert_list",
                list(per_expert),
                list(want.num_recv_tokens_per_expert),
            )
            checks.equal(
                f"dispatch_bf16{tag}.handle.rank_prefix_matrix",
                handle[0],
                rank_prefix.to(handle[0].dtype),
            )
            checks.equal(
                f"dispatch_bf16{tag}.handle.recv_src_idx",
                handle[3],
                want.recv_src_idx.to(handle[3].dtype),
            )

            # Cached dispatch (what is timed), bf16 then fp8 with the same handle.
            recv_cached = buffer.dispatch(mine["x"], handle=handle, config=config)[0]
            checks.equal(f"dispatch_bf16_cached{tag}.recv_x", recv_cached, want.recv_x)
            recv_fp8 = buffer.dispatch(x_fp8, handle=handle, config=config)[0]
            _check_fp8(checks, f"dispatch_fp8_cached{tag}", recv_fp8, want_fp8)
            recv_fp8_full = buffer.dispatch(x_fp8, config=config, **layout_args)[0]
            _check_fp8(checks, f"dispatch_fp8{tag}", recv_fp8_full, want_fp8)

            # Combine of the dispatched rows, weights included.
            combined_x, combined_w, _ = buffer.combine(
                recv_x, handle, topk_weights=recv_w, config=config
            )
            checks.equal(f"combine_bf16{tag}.combined_x", combined_x, want_combined_x)
            checks.equal(f"combine_bf16{tag}.combined_topk_weights", combined_w, ref_combined_w)
            del recv_cached, recv_fp8, recv_fp8_full, combined_x, combined_w

            timed = _timed_ops(
                buffer, mine["x"], x_fp8, recv_x, handle, config, layout_args, bf16_bytes
            )
            for op, fn, nbytes in timed:
                dist.barrier(group=group)
                row = _row(op, s, _time_gpu(fn, iters, warmup, scratch), nbytes)
                rows.append(_with_cross_node(row, node_bytes, bf16_bytes))
            # The uncached dispatch again with the host-side id check (before the
            # device-side check in the notify kernel, every call paid this sync).
            dist.barrier(group=group)
            times = _time_with_host_id_check(
                lambda c=config: buffer.dispatch(mine["x"], config=c, **layout_args),
                iters,
                warmup,
                scratch,
            )
            rows.append(_row(DISPATCH_BF16_UNCACHED_HOST_CHECK, s, times, bf16_bytes))
            del recv_x, recv_idx, recv_w, handle

        # Baseline: the same rows through NCCL, this rank's tokens grouped by
        # destination; the output is recv_x exactly.
        if baseline_skipped is None:
            _log(rank, "timing the all_to_all_single baseline")
            mask = ref_layout[2].to(device)
            send = torch.cat([mine["x"][mask[:, d]] for d in range(num_ranks)])
            in_splits = [int(c) for c in ref_layout[0]]
            column = rank_prefix[:, rank]
            out_splits = [int(column[0])] + [
                int(column[s] - column[s - 1]) for s in range(1, num_ranks)
            ]
            recv = torch.empty(sum(out_splits), hidden, dtype=torch.bfloat16, device=device)

            def all_to_all():
                dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

            all_to_all()
            torch.cuda.synchronize()
            checks.equal("all_to_all_single.recv", recv, want.recv_x)
            dist.barrier(group=group)
            times = _time_gpu(all_to_all, iters, warmup, scratch)
            rows.append(_row(BASELINE, None, times, bf16_bytes))
        else:
            _log(rank, baseline_skipped)
        torch.cuda.synchronize()
        dist.barrier(group=group)
    finally:
        buffer.destroy()

    return {
        "mode": "gpu",
        "rank": rank,
        "num_ranks": num_ranks,
        "nodes": getattr(args, "nodes", 1),
        "device": torch.cuda.get_device_name(device),
        "num_gpus": gpus["num_gpus"],
        "ranks_per_gpu": gpus["ranks_per_gpu"],
        "mps": gpus["mps"],
        "sms_note": sms_note,
        "baseline_skipped": baseline_skipped,
        "workload": workload,
        "timing": {
            "clock": "CUDA events",
            "iters": iters,
            "warmup": warmup,
            "l2_flush_bytes": L2_FLUSH_BYTES,
        },
        "recv_tokens": recv_tokens,
        "correct": checks.ok,
        "checks": checks.items,
        "rows": rows,
    }


#: Peak host bytes of one full CPU reference per (received row x hidden
#: element): dispatch bf16 + fp8, combine (measured: 5.4 GB at 8 ranks x 1024
#: tokens, 43.7k rows of 7168; 17.4 bytes), with headroom.
REFERENCE_BYTES_PER_ELEMENT = 20


def _reference_builders(num_ranks: int, workload: dict, mem_available: int | None) -> int:
    """How many ranks may compute the full CPU reference at once: all, unless
    their peaks together exceed 70 % of ``mem_available`` (the smallest
    MemAvailable of the ranks' hosts, None: unknown; 8 ranks x 4096 tokens on
    one host were OOM-killed computing it at once)."""
    if mem_available is None:
        return num_ranks
    rows = num_ranks * workload["num_tokens"] * min(num_ranks, workload["num_topk"])
    peak = REFERENCE_BYTES_PER_ELEMENT * rows * workload["hidden"]
    return max(1, min(num_ranks, int(0.7 * mem_available) // max(peak, 1)))


def _mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None: not Linux, or unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_reference(
    rank: int, num_ranks: int, workload: dict, device, per_node: int | None = None
) -> tuple:
    """Every rank's inputs and the whole CPU reference, of which this rank's
    part is kept (the rest is freed before returning): ``(mine, own)`` with
    ``mine`` this rank's inputs on ``device``; ``per_node``: ranks per emulated
    node (the combine is then the internode model, the layout has per-node
    counts)."""
    import torch

    from moelink import reference

    num_experts = workload["num_experts"]
    inputs = _all_inputs(num_ranks, workload)
    mine = {k: v.to(device) for k, v in inputs[rank].items()}
    # fp8 scales as a column-major view, as DeepEP's tests pass them.
    mine["x_scales"] = mine["x_scales"].T.contiguous().T
    ref = reference.dispatch(_reference_inputs(inputs, fp8=False), num_experts)
    ref_fp8 = reference.dispatch(_reference_inputs(inputs, fp8=True), num_experts)
    ys = [ref.ranks[d].recv_x for d in range(num_ranks)]
    weights = [ref.ranks[d].recv_topk_weights for d in range(num_ranks)]
    combined_x, combined_w = reference.combine(
        ref, ys, topk_weights=weights, ranks_per_node=per_node
    )[rank]
    layout = reference.layout(inputs[rank]["topk_idx"], num_experts, num_ranks, per_node)
    if per_node is not None:  # (per rank, per node, per expert, in rank) -> (rank, expert, in)
        per_node_counts = layout[1]
        layout = (layout[0], layout[2], layout[3])
    else:
        per_node_counts = None
    own = {
        "want": ref.ranks[rank],
        "want_fp8": ref_fp8.ranks[rank],
        "combined_x": combined_x,
        "combined_w": combined_w,
        "layout": layout,
        "per_node": per_node_counts,
        "recv_tokens": [int(ref.ranks[d].num_recv_tokens) for d in range(num_ranks)],
        "rank_prefix": ref.rank_prefix_matrix.to(torch.int64),
    }
    return mine, own


def _gpu_placement(group, device) -> dict:
    """How the ranks of ``group`` sit on GPUs (collective): ``num_gpus`` (distinct
    devices), ``ranks_per_gpu`` (the most on one), ``mps`` (whether the ranks run
    under MPS, as ``moelink.launch`` says), and ``share_sms``: the fewest SMs a
    rank may use beside the others on its GPU, by the library's own rule and SM
    limits (``_native.device_share_sms`` of ``_native.local_sm_counts``: MPS
    thread percentages and ``MOELINK_SMS_PER_RANK`` included); ``mem_available``:
    the smallest MemAvailable of the ranks' hosts in bytes (None: none known)."""
    import torch
    import torch.distributed as dist

    from moelink import _native

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    mps = _env.get("MOELINK_LAUNCH_MPS") == "1"
    device_sms, context_sms = _native.local_sm_counts(device.index)
    everyone: list = [None] * dist.get_world_size(group)
    mine = (uuid, mps, device_sms, context_sms, _mem_available_bytes())
    dist.all_gather_object(everyone, mine, group=group)
    per_gpu: dict = {}
    for u, *_ in everyone:
        per_gpu[u] = per_gpu.get(u, 0) + 1
    known = [mem for *_, mem in everyone if mem is not None]
    return {
        "num_gpus": len(per_gpu),
        "ranks_per_gpu": max(per_gpu.values()),
        "mps": all(on_mps for _, on_mps, *_ in everyone),
        "share_sms": min(
            _native.device_share_sms(sms, ctx, per_gpu[u]) for u, _, sms, ctx, _ in everyone
        ),
        "mem_available": min(known) if known else None,
    }


def _sms_within_share(sms: list, gpus: dict) -> tuple:
    """(the SM counts to time, a note or None): where ranks share GPUs, the
    counts above every rank's share (rounded down to even) are left out, or
    replaced by the share where none is left."""
    if gpus["ranks_per_gpu"] <= 1:
        return sms, None
    share = max(2, gpus["share_sms"] // 2 * 2)
    kept = [s for s in sms if s <= share] or [share]
    if kept == sms:
        return sms, None
    return kept, (
        f"SM counts {sms} reduced to {kept}: up to {gpus['ranks_per_gpu']} ranks share a GPU, "
        f"so each may use {share} SMs with every rank's blocks resident"
    )


def _time_with_host_id_check(fn, iters: int, warmup: int, scratch) -> list:
    """:func:`_time_gpu` of ``fn`` with ``MOELINK_CHECK_IDS=1``: the host-side
    expert-id check (a device sync per call) on top of the device-side one."""
    from ._buffer_common import set_check_ids

    previous = set_check_ids(True)
    try:
        return _time_gpu(fn, iters, warmup, scratch)
    finally:
        set_check_ids(previous)


def _timed_ops(buffer, x, x_fp8, recv_x, handle, config, layout_args, bf16_bytes) -> list:
    """(op, call, bytes received per rank) of every timed call at one SM count."""
    x_copy = recv_x.clone()
    return [
        (DISPATCH_BF16, lambda: buffer.dispatch(x, handle=handle, config=config), bf16_bytes),
        (
            DISPATCH_FP8,
            lambda: buffer.dispatch(x_fp8, handle=handle, config=config),
            bf16_bytes * FP8_BYTES_FACTOR,
        ),
        (COMBINE_BF16, lambda: buffer.combine(recv_x, handle, config=config), bf16_bytes),
        (
            COMBINE_BF16_X_COPY,
            lambda: buffer.combine(x_copy, handle, config=config),
            bf16_bytes,
        ),
        (
            DISPATCH_BF16_UNCACHED,
            lambda: buffer.dispatch(x, config=config, **layout_args),
            bf16_bytes,
        ),
    ]


def _check_fp8(checks: Checks, name: str, got, want) -> None:
    """fp8 dispatch output ``(recv_x, recv_scales)`` against the reference rank."""
    if not isinstance(got, tuple) or len(got) != 2:
        checks.add(f"{name}.recv_x", False, f"expected a (data, scales) tuple, got {type(got)}")
        return
    data, scales = got
    checks.equal(f"{name}.recv_x", data, want.recv_x)
    checks.equal(f"{name}.recv_scales", scales, want.recv_scales)
    if scales.shape[0] > 1 and scales.shape[1] > 1:
        checks.add(
            f"{name}.recv_scales column-major like the input",
            scales.stride(0) == 1,
            f"strides {tuple(scales.stride())}",
        )


# ----------------------------------------------------------------------------
# CPU path


def _expected_exchange(inputs: list, num_experts: int, num_ranks: int) -> dict:
    """What the ranks receive, computed directly from the routing (independently
    of ``moelink.reference``): per destination rank, the rows of every source rank
    whose top-k holds one of its experts, by source rank then token index."""
    import torch

    local = num_experts // num_ranks
    masks = []
    for i in inputs:
        idx = i["topk_idx"]
        dest = torch.where(idx >= 0, idx // local, num_ranks)
        m = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool)
        m.scatter_(1, dest, True)
        masks.append(m[:, :num_ranks])
    per_rank = []
    for d in range(num_ranks):
        sel = [m[:, d] for m in masks]
        idx = torch.cat([i["topk_idx"][s] for i, s in zip(inputs, sel)])
        mine = (idx >= d * local) & (idx < (d + 1) * local)
        w = torch.cat([i["topk_weights"][s] for i, s in zip(inputs, sel)])
        per_rank.append(
            {
                "recv_x": torch.cat([i["x"][s] for i, s in zip(inputs, sel)]),
                "recv_fp8": torch.cat([i["x_fp8"][s] for i, s in zip(inputs, sel)]),
                "recv_scales": torch.cat([i["x_scales"][s] for i, s in zip(inputs, sel)]),
                "recv_topk_idx": torch.where(mine, idx - d * local, -1),
                "recv_topk_weights": torch.where(mine, w, 0.0),
                "recv_src_idx": torch.cat([s.nonzero().flatten() for s in sel]).to(torch.int32),
                "per_expert": torch.bincount(idx[mine] - d * local, minlength=local).tolist(),
            }
        )
    counts = torch.stack([m.sum(dim=0) for m in masks])  # [src, dst]
    return {
        "masks": masks,
        "num_tokens_per_rank": [m.sum(dim=0).to(torch.int32) for m in masks],
        "num_tokens_per_expert": [
            torch.bincount(i["topk_idx"][i["topk_idx"] >= 0], minlength=num_experts).to(torch.int32)
            for i in inputs
        ],
        "rank_prefix_matrix": counts.cumsum(dim=0).to(torch.int32),
        "ranks": per_rank,
    }


def ranks_per_node(num_ranks: int, args) -> int | None:
    """Ranks per emulated node of ``--nodes`` (None: one node, the intranode path)."""
    nodes = getattr(args, "nodes", 1)
    return None if nodes <= 1 else num_ranks // nodes


def _node_partials_sum(x, copies_per_node: list):
    """The internode combine of ``x`` received ``copies_per_node[n]`` times on node
    ``n``: per node the f32 sum of its copies (exactly ``c * x`` for bf16 ``x`` and
    few copies) rounded to bf16, then those partials summed in node order, in f32."""
    import torch

    acc = torch.zeros_like(x, dtype=torch.float32)
    for c in copies_per_node:
        partial = (c * x.float()).to(torch.bfloat16).float()
        acc = torch.where(c > 0, acc + partial, acc)
    return acc


def run_cpu_simulation(num_ranks: int, args) -> dict:
    """The workload without a GPU: all ``num_ranks`` ranks simulated in one
    process through ``moelink.reference`` (the CPU oracle the GPU path checks
    against), with the same report shape as :func:`run_rank`.

    Checks, against a direct computation from the routing: the layout of every
    rank, every rank's received rows (bf16 and fp8 + scales, source-rank then
    token order), top-k ids/weights, source indices, per-expert counts, the
    rank prefix matrix, and that combine of the dispatched rows rebuilds every
    token as (number of destination ranks) * x with its original top-k weights.
    Times are wall clock of the reference calls: a dispatch or combine call does
    the work of all ranks at once, the layout row is one rank's call. GB/s uses
    the mean bytes received per rank; it measures the CPU oracle, not moelink.
    """
    import torch

    from moelink import reference

    workload = _workload(args)
    hidden, num_experts = workload["hidden"], workload["num_experts"]
    repeats = max(1, min(int(args.iters), CPU_MAX_REPEATS))
    inputs = _all_inputs(num_ranks, workload)
    expected = _expected_exchange(inputs, num_experts, num_ranks)
    checks = Checks()
    rows: list = []
    per_node = ranks_per_node(num_ranks, args)

    # Layout of every rank (with --nodes: its tokens per node too, once per node
    # holding any of a token's experts).
    times = []
    for r in range(num_ranks):
        t, got = _time_cpu(
            lambda r=r: reference.layout(inputs[r]["topk_idx"], num_experts, num_ranks, per_node),
            repeats,
        )
        times += t
        if per_node is not None:
            mask = expected["masks"][r]
            want = mask.view(mask.shape[0], -1, per_node).any(dim=2).sum(dim=0)
            checks.equal(f"layout[rank {r}].num_tokens_per_rdma_rank", got[1], want.to(torch.int32))
            got = (got[0], got[2], got[3])
        checks.equal(
            f"layout[rank {r}].num_tokens_per_rank", got[0], expected["num_tokens_per_rank"][r]
        )
        checks.equal(
            f"layout[rank {r}].num_tokens_per_expert", got[1], expected["num_tokens_per_expert"][r]
        )
        checks.equal(f"layout[rank {r}].is_token_in_rank", got[2], expected["masks"][r])
    rows.append(_row(LAYOUT, None, times, None))

    # Dispatch, bf16 and fp8.
    times, ref = _time_cpu(
        lambda: reference.dispatch(_reference_inputs(inputs, fp8=False), num_experts), repeats
    )
    recv_tokens = [int(ref.ranks[d].num_recv_tokens) for d in range(num_ranks)]
    bf16_bytes = statistics.mean(recv_tokens) * hidden * 2
    rows.append(_row(DISPATCH_BF16, None, times, bf16_bytes))
    checks.equal(
        "dispatch.rank_prefix_matrix", ref.rank_prefix_matrix, expected["rank_prefix_matrix"]
    )
    for d in range(num_ranks):
        got, want = ref.ranks[d], expected["ranks"][d]
        name = f"dispatch_bf16[rank {d}]"
        checks.equal(f"{name}.num_recv_tokens", recv_tokens[d], want["recv_x"].shape[0])
        checks.equal(f"{name}.recv_x", got.recv_x, want["recv_x"])
        checks.equal(
            f"{name}.received bytes",
            got.recv_x.numel() * got.recv_x.element_size(),
            recv_tokens[d] * hidden * 2,
        )
        checks.equal(f"{name}.recv_topk_idx", got.recv_topk_idx, want["recv_topk_idx"])
        checks.equal(f"{name}.recv_topk_weights", got.recv_topk_weights, want["recv_topk_weights"])
        checks.equal(f"{name}.recv_src_idx", got.recv_src_idx.to(torch.int32), want["recv_src_idx"])
        checks.equal(
            f"{name}.num_recv_tokens_per_expert",
            list(got.num_recv_tokens_per_expert),
            want["per_expert"],
        )

    times, ref_fp8 = _time_cpu(
        lambda: reference.dispatch(_reference_inputs(inputs, fp8=True), num_experts), repeats
    )
    rows.append(_row(DISPATCH_FP8, None, times, bf16_bytes * FP8_BYTES_FACTOR))
    for d in range(num_ranks):
        got, want = ref_fp8.ranks[d], expected["ranks"][d]
        checks.equal(f"dispatch_fp8[rank {d}].recv_x", got.recv_x, want["recv_fp8"])
        checks.equal(f"dispatch_fp8[rank {d}].recv_scales", got.recv_scales, want["recv_scales"])

    # Combine of the dispatched rows with their (zeroed non-local) weights.
    ys = [ref.ranks[d].recv_x for d in range(num_ranks)]
    weights = [ref.ranks[d].recv_topk_weights for d in range(num_ranks)]
    times, combined = _time_cpu(
        lambda: reference.combine(ref, ys, topk_weights=weights, ranks_per_node=per_node),
        repeats,
    )
    rows.append(_row(COMBINE_BF16, None, times, bf16_bytes))
    for r in range(num_ranks):
        combined_x, combined_w = combined[r]
        mask = expected["masks"][r]
        if per_node is None:
            copies = mask.sum(dim=1, dtype=torch.float32).unsqueeze(1)
            want_x = copies * inputs[r]["x"].float()
            what = "destinations * x"
        else:
            nodes = mask.view(mask.shape[0], -1, per_node).sum(dim=2, dtype=torch.float32)
            want_x = _node_partials_sum(
                inputs[r]["x"], [nodes[:, n : n + 1] for n in range(nodes.shape[1])]
            )
            what = "sum over nodes of bf16(destinations on the node * x)"
        checks.equal(f"combine[rank {r}].combined_x == {what}", combined_x, want_x)
        checks.equal(
            f"combine[rank {r}].combined_topk_weights", combined_w, inputs[r]["topk_weights"]
        )

    # Baseline: the same exchange as plain row copies (torch.cat of the blocks).
    def exchange():
        return [
            torch.cat([i["x"][m[:, d]] for i, m in zip(inputs, expected["masks"])])
            for d in range(num_ranks)
        ]

    times, out = _time_cpu(exchange, repeats)
    rows.append(_row(BASELINE, None, times, bf16_bytes))
    for d in range(num_ranks):
        checks.equal(
            f"row-copy exchange[rank {d}] == reference recv_x", out[d], ref.ranks[d].recv_x
        )

    return {
        "mode": "cpu-simulation",
        "rank": None,
        "num_ranks": num_ranks,
        "nodes": getattr(args, "nodes", 1),
        "device": "CPU (moelink.reference; all ranks in one process)",
        "workload": workload,
        "timing": {"clock": "wall clock", "iters": repeats, "warmup": 0, "l2_flush_bytes": 0},
        "recv_tokens": recv_tokens,
        "correct": checks.ok,
        "checks": checks.items,
        "rows": rows,
    }


# ----------------------------------------------------------------------------
# Several ranks -> one result


def aggregate(results: list) -> dict:
    """One result from every rank's :func:`run_rank` result.

    Per (op, num_sms) row: ``median_us`` and ``GBps`` are the medians over ranks
    of the per-rank medians and bandwidths (each rank divides its own received
    bytes by its own time), ``min_us`` / ``max_us`` the extremes over all ranks;
    ``GBps_per_rank`` keeps every rank's figure. ``correct`` holds only if every
    rank passed; failed checks are prefixed with their rank.
    """
    if not results:
        raise ValueError("aggregate needs at least one result")
    results = sorted(results, key=lambda r: r.get("rank") or 0)
    first = results[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        same = [r["rows"][i] for r in results]
        if any((s["op"], s["num_sms"]) != (row["op"], row["num_sms"]) for s in same):
            raise ValueError("ranks timed different operations")
        gbps = [s["GBps"] for s in same]
        rows.append(
            {
                "op": row["op"],
                "num_sms": row["num_sms"],
                "median_us": statistics.median(s["median_us"] for s in same),
                "min_us": min(s["min_us"] for s in same),
                "max_us": max(s["max_us"] for s in same),
                "iters": row["iters"],
                "bytes": row["bytes"],
                "GBps": None if row["GBps"] is None else statistics.median(gbps),
                "GBps_per_rank": gbps,
            }
        )
        for key in ("rdma_GBps", "xnode_GBps"):
            if key in row:
                per_rank = [s[key] for s in same]
                rows[-1].update({key: statistics.median(per_rank), f"{key}_per_rank": per_rank})
    checks = []
    for r in results:
        for c in r["checks"]:
            checks.append({**c, "name": f"rank {r['rank']}: {c['name']}"})
    out = {k: v for k, v in first.items() if k not in ("rows", "checks", "correct", "rank")}
    out.update(
        {
            "rank": None,
            "ranks_aggregated": len(results),
            "correct": all(r["correct"] for r in results),
            "checks": checks,
            "rows": rows,
        }
    )
    return out


# ----------------------------------------------------------------------------
# Report


def shared_gpu_note(num_ranks: int, num_gpus: int, mps: bool) -> str:
    """What the figures of ``num_ranks`` ranks sharing ``num_gpus`` GPUs mean, e.g.
    ``4 ranks on 1 GPU (MPS): bandwidth figures measure one GPU's memory, not
    NVLink``."""
    where = f"{num_ranks} ranks on {num_gpus} GPU{'s' if num_gpus != 1 else ''}"
    how = "MPS" if mps else "time-sliced, no MPS"
    if num_gpus == 1:
        what = "bandwidth figures measure one GPU's memory, not NVLink"
    else:
        what = "bandwidth figures mix one GPU's memory with NVLink; not NVLink figures"
    return f"{where} ({how}): {what}"


TABLE_HEADER = (
    f"{'op':<22} {'SMs':>4} {'median us':>10} {'min us':>9} {'max us':>9} {'GB/s':>7}  "
    f"{'target':<20} {'':<5} {'vs a2a':>6}"
)


def _target_cell(row: dict, judged: bool) -> tuple:
    """(target text, verdict) for one row; the verdict is ``n/a`` where the row
    is not judged (the CPU, ranks sharing a GPU)."""
    op, sms = row["op"], row["num_sms"]
    if op == LAYOUT:
        verdict = "ok" if row["median_us"] <= LAYOUT_TARGET_US else "miss"
        return f"<= {LAYOUT_TARGET_US:g} us", verdict if judged else "n/a"
    if op == BASELINE:
        return "(baseline)", ""
    target = TARGETS.get(op)
    if target is None:
        return "-", ""
    if sms is None:
        return f">= {target.best_gbps:g} (<= {TARGET_MAX_SMS} SMs)", "n/a"
    if sms == COMPARE_SMS:
        goal, text = target.at_compare_sms_gbps, f">= {target.at_compare_sms_gbps:g} at {sms} SMs"
    elif sms <= TARGET_MAX_SMS:
        goal, text = target.best_gbps, f">= {target.best_gbps:g} (<= {TARGET_MAX_SMS})"
    else:
        return f"- (> {TARGET_MAX_SMS} SMs)", ""
    verdict = "ok" if row["GBps"] >= goal else "below"
    return text, verdict if judged else "n/a"


def _met(ok: bool, why_not: str | None) -> str:
    if why_not is not None:
        return f"not judged ({why_not})"
    return "met" if ok else "MISSED"


def _summary_lines(rows: list, on_gpu: bool, why_not: str | None = None) -> list:
    lines = []
    for op, target in TARGETS.items():
        ops = [r for r in rows if r["op"] == op]
        if not ops:
            continue
        label = OP_LABELS[op]
        if not on_gpu:
            best = max(ops, key=lambda r: r["GBps"])
            lines.append(
                f"  {label}: {best['GBps']:.1f} GB/s on the CPU; target on GPU >= "
                f"{target.best_gbps:g} (<= {TARGET_MAX_SMS} SMs), >= "
                f"{target.at_compare_sms_gbps:g} at {COMPARE_SMS}; "
                f"DeepEP V1: {target.deepep_gbps:g}"
            )
            continue
        parts = []
        eligible = [r for r in ops if r["num_sms"] <= TARGET_MAX_SMS]
        if eligible:
            best = max(eligible, key=lambda r: r["GBps"])
            met = _met(best["GBps"] >= target.best_gbps, why_not)
            parts.append(
                f"best <= {TARGET_MAX_SMS} SMs {best['GBps']:.1f} GB/s ({best['num_sms']} SMs), "
                f"target {target.best_gbps:g} {met}"
            )
        at = [r for r in ops if r["num_sms"] == COMPARE_SMS]
        if at:
            met = _met(at[0]["GBps"] >= target.at_compare_sms_gbps, why_not)
            parts.append(
                f"{COMPARE_SMS} SMs {at[0]['GBps']:.1f} GB/s, target "
                f"{target.at_compare_sms_gbps:g} {met}, DeepEP V1 {target.deepep_gbps:g}"
            )
        lines.append(f"  {label}: " + "; ".join(parts))
    for op in (LAYOUT,):
        layout = [r for r in rows if r["op"] == op]
        if layout and on_gpu:
            us = layout[0]["median_us"]
            met = _met(us <= LAYOUT_TARGET_US, why_not)
            lines.append(
                f"  {OP_LABELS[op]}: {us:.1f} us, target <= {LAYOUT_TARGET_US:g} us {met}, "
                f"DeepEP V1 {LAYOUT_DEEPEP_US:g} us"
            )
    return lines


def format_report(results: dict) -> str:
    """The correctness verdict and one table of ``results`` (from
    :func:`run_rank`, :func:`aggregate` or :func:`run_cpu_simulation`).

    Columns: op, SMs (``-`` where the op takes none), median / min / max
    microseconds, GB/s (the metric above, at the median), the docs/performance.md
    target of that row with a verdict (``n/a`` on the CPU), and the ratio to the
    ``all_to_all_single`` baseline of the same run. A summary per op follows.
    """
    w = results["workload"]
    timing = results["timing"]
    on_gpu = results["mode"] == "gpu"
    # Targets are NVLink figures of one node: judged only where every rank has its
    # own GPU and the group is one node.
    if results.get("ranks_per_gpu", 1) > 1:
        why_not = "ranks share a GPU"
    elif results.get("nodes", 1) > 1:
        why_not = "emulated nodes: the targets are one node's NVLink figures"
    else:
        why_not = None
    judged = on_gpu and why_not is None
    ranks = results["num_ranks"]
    recv = results["recv_tokens"]
    nodes = results.get("nodes", 1)
    path = (
        "intranode"
        if nodes <= 1
        else f"internode ({nodes} emulated nodes of {ranks // nodes} ranks, cross-node bytes "
        "through the proxy)"
    )
    lines = []
    if nodes > 1:
        lines.append(
            "GB/s: bytes received per rank, recv_x.numel() * 2 (DeepEP's NVL side); "
            "rdma GB/s: DeepEP's RDMA side, (token, destination node) pairs of the rank "
            "(own node included) * hidden * 2; x-node GB/s: the same pairs of the other "
            "nodes only (what the proxy carries); fp8 rows times (1 + 4/128) / 2"
        )
    if on_gpu:
        who = (
            f"median over {results['ranks_aggregated']} ranks"
            if results.get("ranks_aggregated")
            else f"rank {results['rank']}"
        )
        lines.append(f"{path} dispatch/combine on {ranks} x {results.get('device', 'GPU')} ({who})")
        if results.get("ranks_per_gpu", 1) > 1:
            lines.append(
                shared_gpu_note(ranks, results.get("num_gpus", 1), bool(results.get("mps")))
            )
        for key in ("sms_note", "baseline_skipped"):
            if results.get(key):
                lines.append(results[key])
    else:
        lines.append(
            f"{path} dispatch/combine SIMULATED ON THE CPU: {ranks} ranks in one process "
            "through moelink.reference; times are the CPU oracle's, not moelink's kernels; "
            "baseline: the same exchange by torch.cat, in place of all_to_all_single"
        )
    lines.append(
        f"workload: {w['num_tokens']} tokens per rank, hidden {w['hidden']}, top-{w['num_topk']} "
        f"of {w['num_experts']} experts, seed {w['seed']}; {timing['clock']}, "
        f"{timing['iters']} iterations"
        + (f" after {timing['warmup']} warm-up, L2 flushed" if on_gpu else "")
    )
    mean_tokens = statistics.mean(recv)
    lines.append(
        f"received per rank: {min(recv)}..{max(recv)} tokens "
        f"({mean_tokens / w['num_tokens']:.2f} x the tokens per rank), "
        f"{mean_tokens * w['hidden'] * 2 / 1e6:.1f} MB bf16 on average"
    )
    checks = results["checks"]
    failures = [c for c in checks if not c["ok"]]
    if results["correct"] and not failures:
        lines.append(f"correctness: PASS ({len(checks)} checks)")
    else:
        lines.append(f"correctness: FAIL ({len(failures)} of {len(checks)} checks failed)")
        for c in failures[:20]:
            lines.append(f"  FAIL {c['name']}: {c['detail']}")
        if len(failures) > 20:
            lines.append(f"  ... and {len(failures) - 20} more")
    lines.append("")
    cross = nodes > 1 and any("xnode_GBps" in r for r in results["rows"])
    lines.append(TABLE_HEADER + (f" {'rdma GB/s':>9} {'x-node GB/s':>11}" if cross else ""))
    baseline = next((r for r in results["rows"] if r["op"] == BASELINE), None)
    base_gbps = baseline["GBps"] if baseline else None
    order = list(OP_LABELS)  # one block per op, SM counts ascending
    rows = sorted(
        results["rows"],
        key=lambda r: (order.index(r["op"]) if r["op"] in order else len(order), r["num_sms"] or 0),
    )
    for row in rows:
        target, verdict = _target_cell(row, judged)
        sms = "-" if row["num_sms"] is None else str(row["num_sms"])
        gbps = "-" if row["GBps"] is None else f"{row['GBps']:.1f}"
        ratio = "-"
        if row["GBps"] is not None and base_gbps:
            ratio = f"{row['GBps'] / base_gbps:.2f}x"
        label = OP_LABELS.get(row["op"], row["op"])
        if row["op"] == BASELINE and not on_gpu:
            label = "exchange by torch.cat"
        lines.append(
            f"{label:<22} {sms:>4} {row['median_us']:>10.1f} "
            f"{row['min_us']:>9.1f} {row['max_us']:>9.1f} {gbps:>7}  {target:<20} "
            f"{verdict:<5} {ratio:>6}"
            + (
                f" {row['rdma_GBps']:>9.1f} {row['xnode_GBps']:>11.1f}"
                if cross and "xnode_GBps" in row
                else ""
            )
        )
    summary = _summary_lines(results["rows"], on_gpu, why_not if on_gpu else None)
    if summary:
        lines.append("")
        lines.append("summary:")
        lines.extend(summary)
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Options and local launch


def _sms_list(text: str) -> list:
    values = []
    for part in text.replace(",", " ").split():
        try:
            s = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"SM counts are integers, got {part!r}") from None
        if not MIN_SMS <= s <= MAX_SMS or s % 2 != 0:
            raise argparse.ArgumentTypeError(
                f"SM counts must be even, {MIN_SMS}..{MAX_SMS}, got {s}"
            )
        values.append(s)
    if not values:
        raise argparse.ArgumentTypeError(f"expected SM counts, got {text!r}")
    return values


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_sms=DEFAULT_SMS,
    num_tokens=4096,
    num_tokens_help="tokens per rank (default: %(default)s)",
    json_option=True,
):
    """Adds the workload and timing options to ``parser``: --num-tokens, --hidden,
    --num-experts, --num-topk, --sms, --iters, --warmup, --seed and (with
    ``json_option``) --json. Pass the parsed namespace through
    :func:`normalize_args`."""
    parser.add_argument("--num-tokens", type=int, default=num_tokens, help=num_tokens_help)
    parser.add_argument("--hidden", type=int, default=7168, help="channels (default: 7168)")
    parser.add_argument("--num-experts", type=int, default=256, help="experts (default: 256)")
    parser.add_argument("--num-topk", type=int, default=8, help="experts per token (default: 8)")
    parser.add_argument(
        "--sms",
        type=_sms_list,
        nargs="+",
        default=[list(default_sms)],
        help="SM counts to time, even (e.g. --sms 24 32 48 or --sms 24,32,48; "
        f"default: {','.join(map(str, default_sms))})",
    )
    parser.add_argument(
        "--iters", type=int, default=30, help="timed iterations per op (default: 30)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="warm-up calls per op (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="emulated nodes of consecutive ranks (default: 1): above 1 the internode "
        "path runs (MOELINK_RANKS_PER_NODE), every cross-node byte through the proxy",
    )
    if json_option:
        parser.add_argument("--json", help="write the results (every rank and aggregated) here")
    return parser


def normalize_args(args, num_ranks: int | None = None) -> argparse.Namespace:
    """Flattens ``--sms`` and checks the options (:func:`check_options`, with
    ``num_ranks`` where it is known); returns ``args``."""
    args.sms = sorted({s for group in args.sms for s in group})
    check_options(args, num_ranks)
    return args


def _in_range(option: str, value: int, low: int, high: int, note: str = "") -> None:
    if not low <= value <= high:
        raise ValueError(f"{option} must be in {low}..{high}{note}, got {value}")


def check_options(args, num_ranks: int | None = None) -> None:
    """``ValueError`` naming the option for a value of :func:`add_arguments`'s
    options the workload cannot take (``num_ranks``: the ranks it will run on,
    where known; ``args.num_tokens`` None: not decided yet). Run before any work,
    so a bad option costs nothing."""
    _in_range("--iters", args.iters, 1, MAX_ITERS)
    _in_range("--warmup", args.warmup, 0, MAX_ITERS)
    _in_range("--seed", args.seed, 0, MAX_SEED)
    if args.num_tokens is not None:
        _in_range("--num-tokens", args.num_tokens, 1, MAX_TOKENS, " (tokens per rank)")
    if args.hidden % SCALE_BLOCK != 0:
        raise ValueError(f"--hidden must be a multiple of {SCALE_BLOCK}, got {args.hidden}")
    _in_range("--hidden", args.hidden, SCALE_BLOCK, MAX_HIDDEN)
    ranks = 1 if num_ranks is None else num_ranks
    if num_ranks is not None:
        _in_range("--ranks", num_ranks, 1, MAX_RANKS)
    nodes = getattr(args, "nodes", 1)
    _in_range("--nodes", nodes, 1, MAX_NODES)
    if num_ranks is not None and num_ranks % nodes != 0:
        raise ValueError(
            f"--nodes {nodes} does not divide the {num_ranks} ranks (--ranks): nodes hold "
            "equal runs of consecutive ranks"
        )
    experts = args.num_experts
    if experts < 1:
        raise ValueError(f"--num-experts must be positive, got {experts}")
    if experts % ranks != 0:
        raise ValueError(
            f"--num-experts {experts} is not a multiple of the {ranks} ranks (--ranks): "
            "experts are spread evenly over the ranks"
        )
    if experts // ranks > MAX_EXPERTS_PER_RANK:
        raise ValueError(
            f"--num-experts must give at most {MAX_EXPERTS_PER_RANK} experts per rank, got "
            f"{experts} on {ranks} rank(s)"
        )
    note = f" (experts per token: at most {MAX_TOPK} and at most --num-experts)"
    _in_range("--num-topk", args.num_topk, 1, min(MAX_TOPK, experts), note)


def _local_worker(rank: int, num_ranks: int, port: int, args, queue) -> None:
    try:
        import torch.distributed as dist

        from .launch import init_distributed

        # RANK, LOCAL_WORLD_SIZE, MASTER_PORT, MPS: set by run_on_local_gpus.
        per_node = ranks_per_node(num_ranks, args)
        if per_node is not None:
            os.environ[_env.name("MOELINK_RANKS_PER_NODE")] = str(per_node)
        init_distributed(timeout_s=float(getattr(args, "timeout", 900.0)))
        try:
            queue.put(run_rank(rank, num_ranks, dist.group.WORLD, args))
        finally:
            dist.destroy_process_group()
    except Exception as e:  # reported by the parent
        queue.put({"rank": rank, "error": f"{e!r}\n{traceback.format_exc()}"})


def run_on_local_gpus(num_ranks: int, args, timeout_s: float = 900.0, sharing=None) -> list:
    """:func:`run_rank` on ``num_ranks`` spawned processes, rank ``r`` on local
    GPU ``r % G``: an NCCL group where every rank has its own GPU, gloo where
    ranks share one (``moelink.launch.init_distributed``), over 127.0.0.1 with
    multicast off. ``sharing``: a ``moelink.launch.GpuSharing`` whose MPS daemon
    the caller holds; None: one is set up here for the run (``$MOELINK_MPS``).
    Returns the results by rank; a rank that failed, died or did not report
    within ``timeout_s`` appears as ``{"rank": r, "error": ...}``."""
    from ._launch import run_local_ranks

    return run_local_ranks(_local_worker, num_ranks, args, timeout_s, sharing)
