"""Run under ``python -m moelink.launch -n N``: what a CUDA profiler shows of moelink's
calls is what DeepEP's timing helper (``tests/utils.py::bench_kineto`` of DeepEP)
needs to time them, and the calls made under the profiler still return the right
results.

DeepEP's helper profiles CUDA activity with ``torch.profiler`` and then
- in ``key_averages().table(...)``, requires exactly one row to contain each word it
  is given ('dispatch', 'combine', 'notify') and reads that row's time;
- in hook mode (``num_kernels_per_period=2``), takes from the chrome trace the
  events whose name contains ``::dispatch`` / ``::combine``: two per call (the send
  launch and the receive launch of the same kernel).
This worker asserts exactly that, with its own code, for the calls DeepEP times:

- ``layout``: ``get_dispatch_layout`` shows no row with 'dispatch' or 'combine';
- ``dispatch_combine``: a normal dispatch (one row 'dispatch', one 'notify', none
  'combine'), then a combine (one row 'combine', none 'dispatch'; across nodes one
  'notify': the barrier before a combine that follows a combine is
  ``moelink::internode::cached_notify``);
- ``cached_dispatch``: a cached dispatch (one row 'dispatch', none 'combine'; across
  nodes one 'notify', as DeepEP's internode test reads it);
- ``low_latency`` / ``low_latency_hook``: dispatch + combine per round (DeepEP's
  ``test_low_latency`` timing), one row each; in the trace one ``::dispatch`` and one
  ``::combine`` event per round, two each with the receive hook.

In every profile, no notify, barrier, wait or layout kernel of moelink has
'dispatch' or 'combine' in its name. With ``MOELINK_RANKS_PER_NODE`` below the world
size the normal calls take the internode path (emulated nodes); else the
intranode one. Results are checked against ``moelink.reference`` (normal calls,
bit for bit; outputs poisoned first) and, for low latency, by the receive counts
of the reference and DeepEP's identity-expert check of the combine.

Without a CUDA GPU the worker prints ``SKIPPED: <reason>`` and exits 0. Scenarios
run in ``SCENARIO_NAMES`` order (``MOELINK_PROFILER_SCENARIOS`` selects some); rank 0
prints ``PASS <name>`` / ``FAIL <name>: ...``; exit code 1 if anything failed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib

import moelink
import torch
import torch.distributed as dist
import worker_driver
from moelink import reference

SCENARIO_NAMES = (
    "layout",
    "dispatch_combine",
    "cached_dispatch",
    "low_latency",
    "low_latency_hook",
)
SCENARIOS_ENV = "MOELINK_PROFILER_SCENARIOS"
SEED_ENV = "MOELINK_TEST_SEED"
SCENARIO_TIMEOUT_S = 300
CONTROL_TIMEOUT_S = 300
#: Calls per profile (DeepEP's helper profiles 30; a few show the same rows).
ITERS = 4
#: Normal calls: tokens per rank, hidden (bf16), experts per rank, top-k.
TOKENS, HIDDEN, EXPERTS_PER_RANK, TOPK = 128, 2048, 8, 4
#: Low-latency calls: tokens per rank (also num_max_dispatch_tokens_per_rank).
LL_TOKENS = 64
POISON_BYTE = 0x7F
#: Kernels that must name neither 'dispatch' nor 'combine' (by a word of their name).
NEUTRAL_WORDS = ("notify", "barrier", "wait_peers", "count_tokens", "layout")


class Ctx:
    """One rank's view: group, device, the run's seed and the checks' failures."""

    def __init__(self, wg: worker_driver.WorkerGroup, seed: int) -> None:
        self.wg, self.rank, self.num_ranks = wg, wg.rank, wg.world
        self.device, self.seed = wg.device, seed
        v = os.environ.get("MOELINK_RANKS_PER_NODE", "").strip()
        self.per_node = int(v) if v and int(v) < self.num_ranks else None
        self.errors: list[str] = []
        self.normal: moelink.Buffer | None = None

    @property
    def internode(self) -> bool:
        return self.per_node is not None

    def generator(self, tag: str, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{tag}/{rank}".encode()))

    def expect(self, cond: bool, message: str) -> None:
        if not cond and len(self.errors) < 30:
            self.errors.append(message)

    def equal(self, label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Bit-for-bit equality (float32 by value)."""
        g, w = got.detach().cpu(), want.detach().cpu()
        if g.dtype != w.dtype or g.shape != w.shape:
            self.expect(
                False, f"{label}: {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}"
            )
            return
        if g.dtype == torch.float32:
            same = torch.equal(g, w)
        else:
            same = torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        if not same:
            bad = (
                (g != w)
                if g.dtype == torch.float32
                else (g.view(torch.uint8) != w.view(torch.uint8))
            )
            self.expect(
                False,
                f"{label}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}",
            )

    def done(self) -> None:
        errors, self.errors = self.errors, []
        if errors:
            more = f" (+{len(errors) - 4} more)" if len(errors) > 4 else ""
            raise AssertionError(f"{len(errors)} check(s) failed: " + " | ".join(errors[:4]) + more)


# ----------------------------------------------------------------------------
# The profile and what DeepEP's helper reads from it.
# ----------------------------------------------------------------------------


class Profile:
    """The CUDA activity of some calls: the key_averages table's lines (as DeepEP's
    helper prints it) and the chrome trace's events."""

    def __init__(self, fn, iters: int = ITERS) -> None:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100)
        self.lines = table.split("\n")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                self.events = json.load(f).get("traceEvents", [])
        self.kernels = sorted({e["name"] for e in self.events if e.get("cat") == "kernel"})

    def rows_with(self, word: str) -> list[str]:
        return [line for line in self.lines if word in line]

    def events_with(self, text: str) -> int:
        return sum(1 for e in self.events if text in str(e.get("name", "")))

    def moelink_kernels(self) -> list[str]:
        return [k for k in self.kernels if "moelink::" in k]


def profile_warm(ctx: Ctx, fn) -> tuple[Profile, object]:
    """Calls ``fn`` once (warm-up), poisons fresh allocator blocks and waits for
    every rank, then profiles ``ITERS`` calls of ``fn``: the profile and what
    the last call returned."""
    fn()  # warm-up
    torch.cuda.synchronize()
    poison(ctx.device)
    dist.barrier(group=ctx.wg.gloo)
    got = []
    p = Profile(lambda: got.append(fn()))
    return p, got[-1]


def check_profile(ctx: Ctx, label: str, p: Profile, rows: dict, events: dict | None = None) -> None:
    """``rows[word]``: how many table rows must contain ``word``; ``events[text]``:
    how many trace events must contain ``text`` in their name; and no neutral
    moelink kernel names 'dispatch' or 'combine'."""
    names = p.moelink_kernels()
    ctx.expect(bool(names), f"{label}: no moelink kernel in the profile; kernels: {p.kernels}")
    for word, n in rows.items():
        found = p.rows_with(word)
        ctx.expect(
            len(found) == n,
            f"{label}: {len(found)} profiler rows contain {word!r}, expected {n}: "
            f"{[r.strip().split('  ')[0] for r in found]}; moelink kernels: {names}",
        )
    for text, n in (events or {}).items():
        got = p.events_with(text)
        ctx.expect(got == n, f"{label}: {got} trace events contain {text!r}, expected {n}")
    for name in names:
        base = name.split("(")[0]
        if any(w in base for w in NEUTRAL_WORDS):
            ctx.expect(
                "dispatch" not in name and "combine" not in name,
                f"{label}: kernel {name!r} names dispatch or combine",
            )


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


def random_bf16(g: torch.Generator, n: int, h: int) -> torch.Tensor:
    """bf16 in +-[0.25, 4): no zero, NaN or infinity."""
    mag = torch.rand(n, h, generator=g) * 3.75 + 0.25
    sign = torch.where(torch.rand(n, h, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(torch.bfloat16)


def random_topk(g: torch.Generator, n: int, num_experts: int, k: int) -> torch.Tensor:
    """Distinct expert ids per row, some entries -1."""
    idx = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :k]
    idx[torch.rand(n, k, generator=g) < 0.1] = -1
    return idx.to(torch.int64).contiguous()


def normal_inputs(ctx: Ctx, tag: str) -> list[dict]:
    """Every rank's input of a normal dispatch (each rank builds all of them)."""
    e = EXPERTS_PER_RANK * ctx.num_ranks
    out = []
    for r in range(ctx.num_ranks):
        g = ctx.generator(tag, r)
        n = TOKENS - 8 * (r % 3)
        out.append(
            dict(
                x=random_bf16(g, n, HIDDEN),
                scales=None,
                topk_idx=random_topk(g, n, e, TOPK),
                topk_weights=torch.rand(n, TOPK, generator=g) + 0.01,
            )
        )
    return out


def poison(device) -> None:
    """Fill fresh caching-allocator blocks with POISON_BYTE and free them, so an
    output a kernel never writes most likely holds poison."""
    blocks = [torch.empty(32 << 20, dtype=torch.uint8, device=device) for _ in range(4)]
    blocks += [torch.empty(512 << 10, dtype=torch.uint8, device=device) for _ in range(16)]
    for b in blocks:
        b.fill_(POISON_BYTE)
    del blocks


def normal_buffer(ctx: Ctx) -> moelink.Buffer:
    if ctx.normal is None:
        cfg = moelink.Config(num_sms=24)
        nvl = cfg.get_nvl_buffer_size_hint(HIDDEN * 2, ctx.num_ranks, max_tokens_per_rank=TOKENS)
        rdma = 0
        if ctx.internode:
            rdma = cfg.get_rdma_buffer_size_hint(
                HIDDEN * 2, ctx.num_ranks, max_tokens_per_rank=TOKENS, ranks_per_node=ctx.per_node
            )
        ctx.normal = moelink.Buffer(ctx.wg.group, nvl, rdma, explicitly_destroy=True)
    return ctx.normal


def dispatch_inputs(ctx: Ctx, buf: moelink.Buffer, inp: dict) -> dict:
    """This rank's dispatch arguments on the GPU, with the layout."""
    idx = inp["topk_idx"].to(ctx.device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(
        idx, EXPERTS_PER_RANK * ctx.num_ranks
    )
    return dict(
        x=inp["x"].to(ctx.device),
        topk_idx=idx,
        topk_weights=inp["topk_weights"].to(ctx.device),
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )


def normal_dispatch(ctx: Ctx, tag: str) -> tuple:
    """A normal Buffer, the reference dispatch of every rank's ``tag`` inputs and
    this rank's dispatch arguments."""
    buf = normal_buffer(ctx)
    inputs = normal_inputs(ctx, tag)
    ref = reference.dispatch(inputs, EXPERTS_PER_RANK * ctx.num_ranks)
    return buf, ref, dispatch_inputs(ctx, buf, inputs[ctx.rank])


def check_dispatched(ctx: Ctx, label: str, got, ref) -> None:
    recv_x, recv_idx, recv_w, per_expert, _handle, _event = got
    want = ref.ranks[ctx.rank]
    n = want.num_recv_tokens
    ctx.expect(recv_x.shape[0] == n, f"{label}: {recv_x.shape[0]} rows received, expected {n}")
    if recv_x.shape[0] == n:
        ctx.equal(f"{label} recv_x", recv_x, want.recv_x[:n])
        ctx.equal(f"{label} recv_topk_idx", recv_idx, want.recv_topk_idx[:n])
        ctx.equal(f"{label} recv_topk_weights", recv_w, want.recv_topk_weights[:n])
    want_list = list(want.num_recv_tokens_per_expert)
    ctx.expect(
        per_expert == want_list, f"{label}: per-expert counts {per_expert}, expected {want_list}"
    )


def check_combined(ctx: Ctx, label: str, got, ref, ys: list, weights: list) -> None:
    combined_x, combined_w, _event = got
    want = reference.combine(ref, ys, topk_weights=weights, ranks_per_node=ctx.per_node)
    want_x, want_w = want[ctx.rank]
    ctx.equal(f"{label} combined_x", combined_x, reference.to_bf16(want_x))
    ctx.equal(f"{label} combined_topk_weights", combined_w, want_w)


def expert_outputs(ctx: Ctx, tag: str, ref) -> list[torch.Tensor]:
    """Every rank's combine input: bf16 rows for the rows it received."""
    return [
        random_bf16(ctx.generator(tag, r), ref.ranks[r].num_recv_tokens, HIDDEN)
        for r in range(ctx.num_ranks)
    ]


# ----------------------------------------------------------------------------
# Scenarios.
# ----------------------------------------------------------------------------


def scenario_layout(ctx: Ctx) -> None:
    buf = normal_buffer(ctx)
    inp = normal_inputs(ctx, "layout")[ctx.rank]
    idx = inp["topk_idx"].to(ctx.device)
    e = EXPERTS_PER_RANK * ctx.num_ranks
    got = []
    p = Profile(lambda: got.append(buf.get_dispatch_layout(idx, e)))
    check_profile(ctx, "get_dispatch_layout", p, {"dispatch": 0, "combine": 0, "count_tokens": 1})
    per_rank, _, per_expert, in_rank, _ = got[-1]
    want_rank, want_expert, want_in_rank = reference.layout(inp["topk_idx"], e, ctx.num_ranks)
    ctx.equal("layout num_tokens_per_rank", per_rank, want_rank)
    ctx.equal("layout num_tokens_per_expert", per_expert, want_expert)
    ctx.equal("layout is_token_in_rank", in_rank, want_in_rank)
    ctx.done()


def scenario_dispatch_combine(ctx: Ctx) -> None:
    """A normal dispatch, then combines: DeepEP times the combine with
    ('combine', 'notify') across nodes."""
    buf, ref, args = normal_dispatch(ctx, "normal")
    p, dispatched = profile_warm(ctx, lambda: buf.dispatch(**args))
    path = "internode" if ctx.internode else "intranode"
    check_profile(ctx, f"{path} dispatch", p, {"dispatch": 1, "combine": 0, "notify": 1})
    # The receive half and the send half (internode: two launches per call of
    # one kernel; intranode: the fused send-only and receive-only launches).
    ctx.expect(
        p.events_with("::dispatch") == 2 * ITERS,
        f"{path} dispatch: {p.events_with('::dispatch')} '::dispatch' trace events, "
        f"expected {2 * ITERS} (two launches per call)",
    )
    check_dispatched(ctx, f"{path} dispatch", dispatched, ref)
    handle, recv_w = dispatched[4], dispatched[2]
    ys = expert_outputs(ctx, "normal/y", ref)
    weights = [o.recv_topk_weights[: o.num_recv_tokens] for o in ref.ranks]
    y = ys[ctx.rank].to(ctx.device)
    # The warm-up combine: the profiled combines follow a combine.
    p, combined = profile_warm(ctx, lambda: buf.combine(y, handle, topk_weights=recv_w))
    notify = 1 if ctx.internode else 0  # intranode's barrier is moelink::intranode::barrier
    check_profile(ctx, f"{path} combine", p, {"combine": 1, "dispatch": 0, "notify": notify})
    check_combined(ctx, f"{path} combine", combined, ref, ys, weights)
    ctx.done()


def scenario_cached_dispatch(ctx: Ctx) -> None:
    """A cached dispatch (an earlier dispatch's handle): DeepEP times it with
    ('dispatch', 'notify') across nodes."""
    buf, ref, args = normal_dispatch(ctx, "cached")
    handle = buf.dispatch(**args)[4]
    xs = [
        random_bf16(ctx.generator("cached/x2", r), ref.num_tokens(r), HIDDEN)
        for r in range(ctx.num_ranks)
    ]
    want = reference.dispatch_cached(ref, xs)[ctx.rank][0]
    x2 = xs[ctx.rank].to(ctx.device)
    p, dispatched = profile_warm(ctx, lambda: buf.dispatch(x2, handle=handle))
    path = "internode" if ctx.internode else "intranode"
    notify = 1 if ctx.internode else 0  # moelink::internode::cached_notify
    check_profile(
        ctx, f"{path} cached dispatch", p, {"dispatch": 1, "combine": 0, "notify": notify}
    )
    n = ref.ranks[ctx.rank].num_recv_tokens
    recv_x = dispatched[0]
    ctx.expect(recv_x.shape[0] == n, f"cached dispatch: {recv_x.shape[0]} rows, expected {n}")
    if recv_x.shape[0] == n:
        ctx.equal("cached dispatch recv_x", recv_x, want[:n])
    ctx.done()


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of DeepEP's tests (0 when equal)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def low_latency(ctx: Ctx, hook: bool) -> None:
    """Rounds of low_latency_dispatch + low_latency_combine (bf16, identity
    experts), as DeepEP's test_low_latency times them."""
    e = EXPERTS_PER_RANK * ctx.num_ranks
    size = moelink.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, HIDDEN, ctx.num_ranks, e)
    buf = moelink.Buffer(ctx.wg.group, 0, size, low_latency_mode=True, explicitly_destroy=True)
    try:
        tag = "ll-hook" if hook else "ll"
        xs, idxs, ws = [], [], []
        for r in range(ctx.num_ranks):
            g = ctx.generator(tag, r)
            n = LL_TOKENS - 4 * (r % 2)
            xs.append(random_bf16(g, n, HIDDEN))
            idxs.append(random_topk(g, n, e, TOPK))
            ws.append(torch.rand(n, TOPK, generator=g) + 0.01)
        want = reference.ll_dispatch(xs, idxs, LL_TOKENS, e, use_fp8=False, rank=ctx.rank)[ctx.rank]
        x, idx, w = (t[ctx.rank].to(ctx.device) for t in (xs, idxs, ws))
        out = {}

        def round_trip():
            recv_x, count, handle, _, hk = buf.low_latency_dispatch(
                x, idx, LL_TOKENS, e, use_fp8=False, return_recv_hook=hook
            )
            if hook:
                hk()
            combined, _, hk = buf.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=hook)
            if hook:
                hk()
            out.update(count=count, combined=combined)

        p, _ = profile_warm(ctx, round_trip)
        label = "low-latency" + (" with the recv hook" if hook else "")
        per_call = 2 if hook else 1
        check_profile(
            ctx,
            label,
            p,
            {"dispatch": 1, "combine": 1},
            {"::dispatch": per_call * ITERS, "::combine": per_call * ITERS},
        )
        ctx.equal(f"{label} recv_count", out["count"], want["recv_count"])
        if x.shape[0] > 0:
            wsum = (w * (idx >= 0)).sum(1, keepdim=True)
            d = calc_diff(out["combined"].float(), x.float() * wsum)
            ctx.expect(d < 1e-5, f"{label}: combine calc_diff {d:.3g}, expected below 1e-5")
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    ctx.done()


def scenario_low_latency(ctx: Ctx) -> None:
    low_latency(ctx, hook=False)


def scenario_low_latency_hook(ctx: Ctx) -> None:
    low_latency(ctx, hook=True)


def run_all(wg: worker_driver.WorkerGroup) -> int:
    names = worker_driver.selected_scenarios(SCENARIOS_ENV, SCENARIO_NAMES)
    ctx = Ctx(wg, worker_driver.shared_seed(SEED_ENV, wg.rank, wg.gloo))
    if wg.rank == 0:
        split = (
            f"{ctx.num_ranks // ctx.per_node} nodes of {ctx.per_node}"
            if ctx.internode
            else "one node"
        )
        print(f"profiler names: {ctx.num_ranks} ranks, {split}", flush=True)
    table = worker_driver.scenario_table(globals(), SCENARIO_NAMES)

    def on_failure() -> None:
        if ctx.normal is not None:
            worker_driver.destroy_after_failure(ctx.normal, "Buffer", ctx.rank)
            ctx.normal = None

    try:
        return worker_driver.run_scenarios(
            wg,
            names,
            lambda name: table[name](ctx),
            timeout_s=SCENARIO_TIMEOUT_S,
            on_failure=on_failure,
        )
    finally:
        if ctx.normal is not None:
            torch.cuda.synchronize()
            ctx.normal.destroy()


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("SKIPPED: profiler names need a CUDA GPU; none found", flush=True)
        return 0
    return worker_driver.worker_main(CONTROL_TIMEOUT_S, run_all)


if __name__ == "__main__":
    sys.exit(main())
