"""Run under torchrun: low-latency dispatch/combine of ``moelink.Buffer`` against the
CPU reference (``moelink.reference.ll_dispatch`` / ``ll_combine``), one process per GPU.

Rank 0 draws a seed (``MOELINK_TEST_SEED`` replays one) and broadcasts it; every rank
builds EVERY rank's inputs on the CPU from generators seeded with (seed, tag, rank),
so each rank computes the full reference locally and checks its own results.

Checks:
- dispatch: ``recv_count`` and every (local expert, source) block's size exactly;
  blocks tile the valid rows; each block's rows (token index, payload bits, scale
  bits) equal the reference's as a multiset (arrival order is free);
- combine: bit for bit against the reference run on the GPU's own handle (the kernel
  uses the reference's fma order), and DeepEP's end-to-end check: with identity
  experts, ``calc_diff`` against ``sum_k w_k x_t`` < 1e-5 (bf16) / 9e-4 (fp8).
Outputs are poisoned first (freed allocator blocks are filled with 0x7F bytes).

Scenarios run in ``SCENARIO_NAMES`` order (``MOELINK_LL_SCENARIOS`` selects some).
Each prints ``PASS <name>`` or ``FAIL <name>: ...`` on rank 0 after the ranks agree;
exit code 1 if anything failed. A watchdog ends a scenario that runs past
``MOELINK_LL_SCENARIO_TIMEOUT_S`` (300 s) with a FAIL line and every thread's stack.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import zlib

import moelink
import torch
import torch.distributed as dist
import worker_driver
from moelink import reference

SCENARIO_NAMES = (
    "basic",
    "modes",
    "checked_path",
    "function_mode",
    "standard_shape",
    "out_and_stats",
    "proxy",
    "proxy_loose",
    "invalid_args",
    "cuda_graph",
    "overlap",
    "masked_rank",
    "timeout_mask",
    "timeout_poison",
    "shrink_destroy",
    "create_destroy",
)
SCENARIOS_ENV = "MOELINK_LL_SCENARIOS"
SEED_ENV = "MOELINK_TEST_SEED"
#: A scenario running longer fails with every thread's stack (env overrides).
SCENARIO_TIMEOUT_S = float(os.environ.get("MOELINK_LL_SCENARIO_TIMEOUT_S", "300"))
POISON_BYTE = 0x7F

T_MAX = 128
H_MAX = 7168


class Failure(Exception):
    pass


class Ctx:
    def __init__(self, rank: int, size: int, seed: int, device, ranks_per_gpu=1, gloo=None) -> None:
        self.rank, self.size, self.seed, self.device = rank, size, seed, device
        self.ranks_per_gpu, self.gloo = ranks_per_gpu, gloo
        self.errors: list[str] = []

    def gen(self, tag: str, rank: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(zlib.crc32(f"{self.seed}/{tag}/{rank}".encode()))
        return g

    def fail(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)


def poison(device, ranks_per_gpu: int = 1) -> None:
    """Fill the caching allocator's free memory with POISON_BYTE: fresh outputs then
    start poisoned rather than zero (ranks that share the GPU split what is free)."""
    free, _ = torch.cuda.mem_get_info(device)
    n = max(0, min(free // ranks_per_gpu - (2 << 30), (8 << 30) // ranks_per_gpu))
    if n > 0:
        t = torch.empty(n, dtype=torch.uint8, device=device)
        t.fill_(POISON_BYTE)
        del t
    torch.cuda.synchronize(device)


def ll_bytes(size: int, t: int, h: int, e: int) -> int:
    return moelink.Buffer.get_low_latency_rdma_size_hint(t, h, size, e)


def std_experts(size: int) -> int:
    return 288 if 288 % size == 0 else 72 * size


def new_ll_buffer(ctx: Ctx, t=T_MAX, h=H_MAX, e=None, **kw) -> moelink.Buffer:
    e = e or std_experts(ctx.size)
    return moelink.Buffer(
        dist.group.WORLD, 0, ll_bytes(ctx.size, t, h, e), low_latency_mode=True,
        explicitly_destroy=True, **kw,
    )  # fmt: skip


@contextlib.contextmanager
def own_buffer(ctx: Ctx, *, ll_timeout_s: int | None = None, **kw):
    """A Buffer of a scenario's own (``new_ll_buffer(ctx, **kw)``), destroyed once
    the GPU is done when the block ends, however it ends. ``ll_timeout_s``: its
    receive waits give up after that many seconds (``MOELINK_LL_TIMEOUT_S`` while
    it is made)."""
    if ll_timeout_s is not None:
        os.environ["MOELINK_LL_TIMEOUT_S"] = str(ll_timeout_s)
    try:
        buf = new_ll_buffer(ctx, **kw)
    finally:
        if ll_timeout_s is not None:
            del os.environ["MOELINK_LL_TIMEOUT_S"]
    try:
        yield buf
    finally:
        torch.cuda.synchronize()
        buf.destroy()


# ----- inputs --------------------------------------------------------------------------


def make_inputs(ctx: Ctx, tag: str, t: int, h: int, e: int, k: int, *, dup: bool = False,
                zero_rank: bool = True):  # fmt: skip
    """Every rank's (x bf16 [T_r, H], topk int64 [T_r, K], weights f32 [T_r, K])."""
    out = []
    for r in range(ctx.size):
        g = ctx.gen(tag, r)
        n = int(torch.randint(max(1, t // 2), t + 1, (1,), generator=g))
        if zero_rank and r == ctx.size - 1 and ctx.size > 2:
            n = 0
        x = (torch.randn(n, h, generator=g) * (torch.rand(n, 1, generator=g) * 4 + 0.1)).to(
            torch.bfloat16
        )
        # Distinct ids per token (as a router gives), about 10 % dropped to -1.
        scores = torch.rand(n, e, generator=g)
        idx = scores.topk(k, dim=1).indices.to(torch.int64)
        if dup and n > 0 and k > 1:
            idx[0, 1] = idx[0, 0]  # a duplicate id: both rows get identical outputs
        drop = torch.rand(n, k, generator=g) < 0.1
        idx[drop] = -1
        if n > 1:
            idx[1] = -1  # a token with no expert at all
        w = torch.rand(n, k, generator=g) + 0.05
        out.append((x, idx, w))
    return out


# ----- checks --------------------------------------------------------------------------


def check_dispatch(ctx: Ctx, label: str, got, want, r: int, use_fp8: bool, ue8m0: bool):
    (recv_x, scales), recv_count, handle = got
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    recv_count = recv_count.cpu()
    if not torch.equal(recv_count, want["recv_count"]):
        ctx.fail(f"{label}: recv_count {recv_count.tolist()} != {want['recv_count'].tolist()}")
        return
    counts = layout_range & 0xFFFFFFFF
    begins = layout_range >> 32
    if not torch.equal(counts, want["layout_range"] & 0xFFFFFFFF):
        ctx.fail(f"{label}: layout_range counts differ")
        return
    rx = recv_x.cpu()
    sc = None if scales is None else scales.cpu()
    wx, ws = want["recv_x"], want["scales"]
    el = counts.shape[0]
    for j in range(el):
        n = int(recv_count[j])
        cover = torch.zeros(max(n, 1), dtype=torch.int32)
        for s in range(ctx.size):
            c, b = int(counts[j, s]), int(begins[j, s])
            if c == 0:
                continue
            if b < 0 or b + c > n:
                ctx.fail(f"{label}: block ({j},{s}) [{b},{b + c}) outside [0,{n})")
                return
            cover[b : b + c] += 1
            wb = int(want["layout_range"][j, s] >> 32)
            g_src, w_src = src_info[j, b : b + c], want["src_info"][j, wb : wb + c]
            go, wo = torch.sort(g_src, stable=True).indices, torch.sort(w_src, stable=True).indices
            if not torch.equal(g_src[go], w_src[wo]):
                ctx.fail(f"{label}: block ({j},{s}) token indices differ")
                return
            gx = rx[j, b : b + c][go]
            wxx = wx[j, wb : wb + c][wo]
            if not torch.equal(gx.view(torch.uint8), wxx.view(torch.uint8)):
                bad = (gx.view(torch.uint8) != wxx.view(torch.uint8)).nonzero()[0].tolist()
                ctx.fail(f"{label}: block ({j},{s}) payload differs at {bad}")
                return
            if use_fp8:
                gs = sc[j, b : b + c][go]
                wss = ws[j, wb : wb + c][wo]
                if not torch.equal(gs.contiguous().view(torch.int32), wss.contiguous().view(
                        torch.int32)):  # fmt: skip
                    ctx.fail(f"{label}: block ({j},{s}) scales differ")
                    return
        if n > 0 and not torch.all(cover[:n] == 1):
            ctx.fail(f"{label}: blocks of expert {j} do not tile [0,{n})")
            return


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def dequant(recv_x, scales, use_fp8: bool, ue8m0: bool) -> torch.Tensor:
    """The expert 'computation' of the identity experts: the received rows as bf16."""
    if not use_fp8:
        return recv_x.clone()
    el, rt, h = recv_x.shape
    x = recv_x.float().view(el, rt, h // 128, 128)
    if ue8m0:
        words = scales.contiguous()  # [el, rt, W]
        b = words.view(torch.uint8).view(el, rt, -1)[:, :, : h // 128].to(torch.int32)
        s = torch.pow(2.0, (b - 127).float())
    else:
        s = scales.float()
    return (x * s.unsqueeze(-1)).view(el, rt, h).to(torch.bfloat16)


# ----- one round trip -------------------------------------------------------------------


def round_trip(ctx: Ctx, buf, label: str, inputs, t: int, e: int, *, use_fp8=True,
               round_scale=False, ue8m0=False, hook=False, zero_copy=False, out=False,
               stats=False, ref=None, together=True):  # fmt: skip
    """One dispatch + combine on this rank with every check; returns nothing.

    Every low-latency call goes through ``worker_driver.in_step``: a barrier
    first, and every rank raises if any rank's call raised. The CPU references
    and checks between the calls take seconds and differ per rank: without the
    barrier, 4 ranks on one GPU entered the standard combine 8-9 s apart
    (measured), and the first rank's receive spent that drift against its
    device time bound (MOELINK_LL_TIMEOUT_S), which is for the GPU's work.
    Scenarios that test a late rank do so on purpose. ``together=False``: the
    ranks leave each call on their own (``in_step``), as a framework would."""
    r, dev = ctx.rank, ctx.device
    h = inputs[0][0].shape[1]
    x, idx, w = (a.to(dev) for a in inputs[r])
    if ref is None:
        ref = reference.ll_dispatch([i[0] for i in inputs], [i[1] for i in inputs], t, e,
                                    use_fp8, round_scale, ue8m0, rank=r)  # fmt: skip
    poison(dev, ctx.ranks_per_gpu)
    el = e // ctx.size
    st_cnt = torch.zeros(el, dtype=torch.int32, device=dev) if stats else None
    st_wait = torch.zeros(ctx.size, dtype=torch.int64, device=dev) if stats else None
    recv, count, handle, ev, hk = worker_driver.in_step(lambda: buf.low_latency_dispatch(
        x, idx, t, e, cumulative_local_expert_recv_stats=st_cnt,
        dispatch_wait_recv_cost_stats=st_wait, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=ue8m0, return_recv_hook=hook,
    ), together=together)  # fmt: skip
    if hook:
        torch.cuda._sleep(2_000_000)
        hk()
    torch.cuda.synchronize(dev)
    recv_x, scales = recv if use_fp8 else (recv, None)
    check_dispatch(ctx, label, ((recv_x, scales), count, handle), ref[r], r, use_fp8, ue8m0)
    if stats:
        if not torch.equal(st_cnt.cpu(), count.cpu()):
            ctx.fail(f"{label}: recv stats {st_cnt.tolist()} != recv_count {count.tolist()}")
        if bool((st_wait.cpu() < 0).any()):
            ctx.fail(f"{label}: negative wait stats {st_wait.tolist()}")
    # Identity experts: y = the received rows (dequantized), plus random rows per
    # expert so the exact check exercises the row mapping.
    y = dequant(recv_x, scales, use_fp8, ue8m0)
    g = ctx.gen(label + "/y", r)
    noise = (torch.randn(y.shape, generator=g) * 0.01).to(torch.bfloat16).to(dev)
    y_exact = (y.float() + noise.float()).to(torch.bfloat16)
    yy = y_exact  # duplicate ids get distinct return slots: no constraint on y
    out_t = None
    if out:
        out_t = torch.full((x.shape[0], h), float("nan"), dtype=torch.bfloat16, device=dev)
    if zero_copy:
        zc = buf.get_next_low_latency_combine_buffer(handle)
        zc.copy_(yy)
        comb_x = zc
    else:
        comb_x = yy
    st_cw = torch.zeros(ctx.size, dtype=torch.int64, device=dev) if stats else None
    combined, ev, hk = worker_driver.in_step(lambda: buf.low_latency_combine(
        comb_x, idx, w, handle, zero_copy=zero_copy, return_recv_hook=hook, out=out_t,
        combine_wait_recv_cost_stats=st_cw,
    ), together=together)  # fmt: skip
    if hook:
        torch.cuda._sleep(2_000_000)
        hk()
    torch.cuda.synchronize(dev)
    if out and combined.data_ptr() != out_t.data_ptr():
        ctx.fail(f"{label}: combine did not write into out=")
    # The exact reference needs every rank's y and handle: rank 0 gathers them,
    # computes every rank's combine and hands each rank its own (one process
    # holds the [E_local, R*T, H] inputs: at 8 ranks and the standard shape,
    # every rank doing so ran the host out of memory).
    want = reference_combine(ctx, yy, count, handle, inputs, t, e)
    got = combined.cpu()
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
        at = tuple(bad[0].tolist())
        ctx.fail(f"{label}: combine differs from the reference at {list(at)} "
                 f"({len(bad)} elements): {got[at]} vs {want[at]}")  # fmt: skip
    # DeepEP's end-to-end check with the pure identity experts.
    # Every rank makes the same calls (a rank with no token too).
    comb_id, _, _ = worker_driver.in_step(
        lambda: buf.low_latency_combine(y, idx, w, handle), together=together
    )
    if x.shape[0] > 0:
        wsum = (w * (idx >= 0)).sum(1, keepdim=True).to(dev)
        d = calc_diff(comb_id.float(), x.float() * wsum)
        tol = 9e-4 if use_fp8 else 1e-5
        if not d < tol:  # NaN (a poisoned row) fails too
            ctx.fail(f"{label}: calc_diff {d:.3g} not below {tol}")


def reference_combine(ctx: Ctx, y, count, handle, inputs, t: int, e: int) -> torch.Tensor:
    """This rank's exact combine output (bf16 [T_r, H], CPU), computed on rank 0
    from every rank's valid rows of ``y`` and handle (collective over gloo)."""
    cnt = count.cpu().tolist()
    mine = ([y[j, : cnt[j]].cpu() for j in range(len(cnt))], handle[0].cpu(), handle[1].cpu())
    allr = [None] * ctx.size if ctx.rank == 0 else None
    dist.gather_object(mine, allr, dst=0)
    wants = None
    if ctx.rank == 0:
        ys = []
        for rows, _, _ in allr:
            full = torch.zeros(y.shape, dtype=y.dtype)
            for j, rj in enumerate(rows):
                full[j, : rj.shape[0]] = rj
            ys.append(full)
        handles = [(si, lr) for _, si, lr in allr]
        del allr
        res = reference.ll_combine(ys, [i[1] for i in inputs], [i[2] for i in inputs],
                                   handles, t, e)  # fmt: skip
        wants = [c for c, _ in res]
    got = [None]
    dist.scatter_object_list(got, wants, src=0)
    return got[0]


# ----- scenarios ------------------------------------------------------------------------


def scenario_basic(ctx: Ctx, buf) -> None:
    e = 8 * ctx.size
    inputs = make_inputs(ctx, "basic", 64, 2048, e, 4)
    round_trip(ctx, buf, "basic fp8", inputs, 64, e)
    round_trip(ctx, buf, "basic bf16", inputs, 64, e, use_fp8=False)


def scenario_modes(ctx: Ctx, buf) -> None:
    e = 9 * ctx.size
    n = 0
    for use_fp8, rs, ue in ((True, False, False), (True, True, False), (True, True, True),
                            (False, False, False)):  # fmt: skip
        for hook in (False, True):
            for zc in (False, True):
                n += 1
                k = (1, 3, 8)[n % 3]
                h = (1024, 2560, 4096)[n % 3]
                inputs = make_inputs(ctx, f"modes{n}", 40 + n, h, e, k, dup=(n % 4 == 0))
                label = f"modes fp8={use_fp8} round={rs} ue8m0={ue} hook={hook} zc={zc} k={k}"
                round_trip(ctx, buf, label, inputs, T_MAX, e, use_fp8=use_fp8, round_scale=rs,
                           ue8m0=ue, hook=hook, zero_copy=zc)  # fmt: skip


def scenario_checked_path(ctx: Ctx, buf) -> None:
    """``modes`` through the checked Python path (what ``async_finish=True`` and
    ``MOELINK_CHECK_IDS`` take: plan cache, ``OutputSet``, a native launch per
    phase, hooks launching from Python) instead of the one native call that eager
    calls make."""
    from moelink._testing import CheckedPath

    one_call = buf._ll_state
    buf._ll_state = CheckedPath(one_call)
    try:
        scenario_modes(ctx, buf)
    finally:
        buf._ll_state = one_call


class UnderMode:
    """``buf`` whose low-latency calls each run under torch function modes, as in
    DeepEP's test process (``torch.set_default_device``): the buffer's device as
    the default one, and a mode that records every torch call it is sent."""

    CALLS = ("low_latency_dispatch", "low_latency_combine", "get_next_low_latency_combine_buffer")

    def __init__(self, buf, device):
        self.buf, self.device, self.seen = buf, device, []

    def __getattr__(self, name):
        fn = getattr(self.buf, name)
        if name not in self.CALLS:
            return fn

        def call(*args, **kwargs):
            from torch.overrides import TorchFunctionMode

            seen = self.seen

            class Recording(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    seen.append((name, getattr(func, "__name__", repr(func))))
                    return func(*args, **(kwargs or {}))

            with torch.device(self.device), Recording():
                return fn(*args, **kwargs)

        return call


def scenario_function_mode(ctx: Ctx, buf) -> None:
    """Round trips whose calls run under torch function modes (``UnderMode``), on
    both paths: every result checked, and no torch call of a Buffer's reaches the
    modes (they cost about ten times as much through one)."""
    from moelink._testing import CheckedPath

    e = 8 * ctx.size
    one_call = buf._ll_state
    for path, state in (("one call", one_call), ("checked", CheckedPath(one_call))):
        buf._ll_state = state
        try:
            for n, (use_fp8, hook, zc) in enumerate(((True, False, False), (False, True, True))):
                under = UnderMode(buf, ctx.device)
                label = f"function mode, {path}, fp8={use_fp8} hook={hook} zc={zc}"
                inputs = make_inputs(ctx, f"fmode{n}", 48, 2048, e, 4)
                round_trip(ctx, under, label, inputs, T_MAX, e, use_fp8=use_fp8, hook=hook,
                           zero_copy=zc)  # fmt: skip
                if under.seen:
                    ctx.fail(f"{label}: the modes saw {len(under.seen)} torch calls of the "
                             f"Buffer's: {under.seen[:6]}")  # fmt: skip
        finally:
            buf._ll_state = one_call


def scenario_standard_shape(ctx: Ctx, buf) -> None:
    e = std_experts(ctx.size)
    inputs = make_inputs(ctx, "std", 128, 7168, e, 8, zero_rank=False)
    round_trip(ctx, buf, "standard fp8", inputs, 128, e)
    round_trip(ctx, buf, "standard bf16 hook", inputs, 128, e, use_fp8=False, hook=True)


def scenario_out_and_stats(ctx: Ctx, buf) -> None:
    e = 8 * ctx.size
    inputs = make_inputs(ctx, "stats", 100, 2048, e, 6)
    round_trip(ctx, buf, "out+stats", inputs, 100, e, out=True, stats=True)


def scenario_proxy(ctx: Ctx, buf) -> None:
    with own_buffer(ctx, allow_nvlink_for_low_latency_mode=False) as pbuf:
        # Any rank's exception is held until every rank has reported its proxy
        # state below (a collective that a rank raising early would leave
        # the others waiting in).
        error = None
        try:
            e = 8 * ctx.size
            for i, (fp8, hook) in enumerate(((True, False), (False, True), (True, True))):
                inputs = make_inputs(ctx, f"proxy{i}", 64, 2048, e, 5)
                round_trip(ctx, pbuf, f"proxy fp8={fp8} hook={hook}", inputs, 64, e,
                           use_fp8=fp8, hook=hook, zero_copy=(i == 2))  # fmt: skip
            e = std_experts(ctx.size)
            inputs = make_inputs(ctx, "proxy-std", 128, 7168, e, 8, zero_rank=False)
            round_trip(ctx, pbuf, "proxy standard", inputs, 128, e)
            torch.cuda.synchronize()
            pbuf.check()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            error = exc
            # Said at once: a rank that raised outside a call every rank makes
            # (in a check) leaves the others in another collective, and the
            # report below would then never print it.
            print(f"proxy [rank {ctx.rank}] raised:", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        # Every rank reports its flags and proxy when any rank failed.
        failed = [None] * ctx.size
        dist.all_gather_object(failed, bool(error or ctx.errors))
        if any(failed):
            report = proxy_state(ctx, pbuf)
            if ctx.rank == 0:
                print("proxy state after the failure:\n" + report, flush=True)
        if error is not None:
            raise error


def scenario_proxy_loose(ctx: Ctx, buf) -> None:
    """The forced-proxy round trips with ranks that leave each call on their own,
    as a framework's do. Run so (``MOELINK_TEST_LOOSE_STEPS=1``), the ``proxy``
    scenario's round trips timed out in every run at 8 ranks on one H200 with
    one proxy stream per peer (7 a rank), while lock-step calls passed; one
    stream for all of a rank's CUDA IPC connections fixed it
    (benches/results/2026-11-25_h200_ll-proxy-streams-8-ranks)."""
    with own_buffer(ctx, allow_nvlink_for_low_latency_mode=False) as pbuf:
        e = 8 * ctx.size
        for i, (fp8, hook) in enumerate(((True, False), (False, True), (True, True))):
            inputs = make_inputs(ctx, f"loose{i}", 64, 2048, e, 5)
            round_trip(ctx, pbuf, f"proxy loose fp8={fp8} hook={hook}", inputs, 64, e,
                       use_fp8=fp8, hook=hook, zero_copy=(i == 2), together=False)  # fmt: skip
        torch.cuda.synchronize()
        pbuf.check()


def proxy_state(ctx: Ctx, pbuf) -> str:
    """Every rank's flags (incoming, [parity][source]; outgoing values the proxy
    copies, [parity][destination]), release counts (incoming, [peer][parity]) and its
    proxy's progress, one line per rank (collective over gloo): tells a lost trigger
    from a copy that never ran."""
    r = ctx.size
    flags = pbuf.get_local_buffer_tensor(torch.int64, use_rdma_buffer=True)
    inc = flags[: 2 * 32].view(2, 32)[:, :r].cpu().tolist()
    rel = flags[128 : 128 + 2 * 32].view(32, 2)[:r].cpu().tolist()
    out = flags[256 : 256 + 2 * 32].view(2, 32)[:, :r].cpu().tolist()
    mine = (f"rank {ctx.rank}: in {inc} out {out} released {rel} "
            f"proxy {pbuf._ll.proxy_progress()}")  # fmt: skip
    lines = [None] * ctx.size
    dist.all_gather_object(lines, mine)
    return "\n".join(lines)


def expect_raise(ctx: Ctx, label: str, exc, fn) -> None:
    try:
        fn()
    except exc:
        return
    except Exception as other:  # noqa: BLE001
        ctx.fail(f"{label}: raised {type(other).__name__}: {other}, expected {exc.__name__}")
        return
    ctx.fail(f"{label}: did not raise {exc.__name__}")


def scenario_invalid_args(ctx: Ctx, buf) -> None:
    dev = ctx.device
    e = 8 * ctx.size
    x = torch.randn(16, 2048, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, e, (16, 4), device=dev)
    bad = [
        ("x float32", ValueError, lambda: buf.low_latency_dispatch(x.float(), idx, 64, e)),
        ("x cpu", ValueError, lambda: buf.low_latency_dispatch(x.cpu(), idx, 64, e)),
        ("x non-contiguous", ValueError,
         lambda: buf.low_latency_dispatch(x.t().contiguous().t(), idx, 64, e)),
        ("too many tokens", ValueError, lambda: buf.low_latency_dispatch(x, idx, 8, e)),
        ("experts not divisible", ValueError,
         lambda: buf.low_latency_dispatch(x, idx, 64, e + 1)),
        ("topk int32", ValueError, lambda: buf.low_latency_dispatch(x, idx.int(), 64, e)),
        ("topk rows", ValueError, lambda: buf.low_latency_dispatch(x, idx[:3], 64, e)),
        ("hidden 100", ValueError,
         lambda: buf.low_latency_dispatch(x[:, :100].contiguous(), idx, 64, e)),
        ("buffer too small", ValueError,
         lambda: buf.low_latency_dispatch(x, idx, 100000, e)),
        ("ue8m0 without round", ValueError,
         lambda: buf.low_latency_dispatch(x, idx, 64, e, use_ue8m0=True)),
        ("hook and async", ValueError,
         lambda: buf.low_latency_dispatch(x, idx, 64, e, async_finish=True,
                                          return_recv_hook=True)),
        ("mask without shrink", RuntimeError, lambda: buf.low_latency_update_mask_buffer(0)),
    ]  # fmt: skip
    for label, exc, fn in bad:
        expect_raise(ctx, label, exc, fn)
    # Twice the experts the Buffer was sized for (new_ll_buffer: T_MAX, H_MAX,
    # std_experts): refused by name, although NVLink's layout at top-4 would fit.
    e2 = 2 * std_experts(ctx.size)
    xh = torch.randn(16, H_MAX, device=dev).to(torch.bfloat16)
    idx2 = torch.randint(0, e2, (16, 4), device=dev)
    try:
        buf.low_latency_dispatch(xh, idx2, T_MAX, e2)
        ctx.fail(f"dispatch with {e2} experts on a Buffer sized for {e2 // 2}: no error")
    except ValueError as err:
        if "num_experts" not in str(err):
            ctx.fail(f"dispatch with {e2} experts: the error does not name num_experts: {err}")
    # Expert ids out of range: the dispatch kernel flags them (no host sync); the
    # call runs on every rank and ValueError names the token and column, at the end
    # of the call, of its hook, or from check().
    g = torch.Generator().manual_seed(ctx.seed)
    t_bad = int(torch.randint(0, 16, (1,), generator=g))
    c_bad = int(torch.randint(0, 4, (1,), generator=g))
    for value, hook in ((e, False), (-2, False), (1 << 40, True)):
        bad_idx = idx.clone()
        bad_idx[t_bad, c_bad] = value

        def launch(b=bad_idx, h=hook):
            out = buf.low_latency_dispatch(x, b, 64, e, return_recv_hook=h)
            if h:
                out[4]()

        why = worker_driver.bad_ids_failure(launch, buf.check, dev, t_bad, c_bad)
        if why is not None:
            ctx.fail(f"dispatch with expert id {value} at ({t_bad}, {c_bad}), hook={hook}: {why}")
    # A valid call afterwards, then combine-side mistakes.
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 64, e, use_fp8=False)
    y = torch.zeros_like(recv)
    w = torch.rand(16, 4, device=dev)
    bad = [
        ("combine x fp32", ValueError,
         lambda: buf.low_latency_combine(y.float(), idx, w, handle)),
        ("combine handle", TypeError, lambda: buf.low_latency_combine(y, idx, w, handle[:3])),
        ("combine weights shape", ValueError,
         lambda: buf.low_latency_combine(y, idx, w[:, :2], handle)),
        ("combine logfmt", ValueError,
         lambda: buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)),
        ("combine out dtype", ValueError,
         lambda: buf.low_latency_combine(y, idx, w, handle, out=torch.empty(16, 2048,
                                                                          device=dev))),
    ]  # fmt: skip
    for label, exc, fn in bad:
        expect_raise(ctx, label, exc, fn)
    # Pending hook: the next call must refuse.
    _, _, handle2, _, hk = buf.low_latency_dispatch(x, idx, 64, e, return_recv_hook=True)
    expect_raise(ctx, "call with a pending hook", RuntimeError,
                 lambda: buf.low_latency_dispatch(x, idx, 64, e))  # fmt: skip
    hk()
    expect_raise(ctx, "hook called twice", RuntimeError, hk)
    torch.cuda.synchronize()
    inputs = make_inputs(ctx, "after-invalid", 32, 2048, e, 4)
    round_trip(ctx, buf, "after invalid", inputs, 64, e)


def scenario_cuda_graph(ctx: Ctx, buf) -> None:
    """dispatch + combine captured once, replayed 1000 times (the two buffers alternate
    inside the graph); inputs change between replays; results checked at the end and
    at a few replays on the way."""
    dev, r = ctx.device, ctx.rank
    e, t, h, k = 8 * ctx.size, 64, 2048, 4
    inputs = make_inputs(ctx, "graph0", t, h, e, k, zero_rank=False)
    x = inputs[r][0].to(dev)
    idx = inputs[r][1].to(dev)
    w = inputs[r][2].to(dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        # Warm-up call outside the capture.
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        comb, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        torch.cuda.synchronize(dev)
        with torch.cuda.graph(graph, stream=s):
            recv, count, handle, _, hk = buf.low_latency_dispatch(
                x, idx, t, e, use_fp8=False, return_recv_hook=True
            )
            hk()
            comb, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize(dev)
    checks = {0, 1, 499, 999}
    for it in range(1000):
        if it in checks:
            # New token values, same routing (the graph fixed the shapes).
            inp = []
            for q in range(ctx.size):
                g = ctx.gen(f"graph{it}", q)
                xq = (torch.randn(inputs[q][0].shape, generator=g) * (it % 5 + 1)).to(
                    torch.bfloat16
                )
                inp.append((xq, inputs[q][1], inputs[q][2]))
            x.copy_(inp[r][0].to(dev))
            graph.replay()
            torch.cuda.synchronize(dev)
            ref = reference.ll_dispatch([i[0] for i in inp], [i[1] for i in inp], t, e, False,
                                        rank=r)  # fmt: skip
            check_dispatch(ctx, f"graph replay {it}", ((recv, None), count, handle), ref[r], r,
                           False, False)  # fmt: skip
            want = reference_combine(ctx, recv, count, handle, inp, t, e)
            if not torch.equal(comb.cpu().view(torch.int16), want.view(torch.int16)):
                ctx.fail(f"graph replay {it}: combine differs")
        else:
            graph.replay()
    torch.cuda.synchronize(dev)
    del graph


# ----- two calls in flight (SGLang's two-batch overlap) ---------------------------------

#: GPU cycles the late ranks of ``overlap`` sleep before A's combine hook (about
#: 25 ms): the others' B combine send then waits for their release of A's half.
OVERLAP_SKEW_CYCLES = 50_000_000


def spoil(t: torch.Tensor) -> None:
    """Overwrite ``t`` (any layout) with POISON_BYTE bytes, in place."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t.view(ints).fill_(int.from_bytes(bytes([POISON_BYTE]) * t.element_size(), "little",
                                      signed=True))  # fmt: skip


class _Overlap:
    """Micro-batches A (fp8) and B (bf16) in SGLang's two-batch-overlap order (decode,
    ``tbo_delta_stages=2``), every call with a receive hook:

        A dispatch send, A hook, A experts, A combine send,
        B dispatch send            <- A's combine hook still pending (two in flight)
        [late ranks sleep on the GPU]
        A combine hook, B dispatch hook, B experts, B combine send, B combine hook

    ``run`` issues the sequence with no host synchronisation (the steps meet on gloo
    only, so the ranks' GPUs stay skewed), capturable in a CUDA graph; ``check``
    compares both micro-batches with the reference."""

    FP8 = {"A": True, "B": False}

    def __init__(self, ctx: Ctx, b, tag: str, t: int, e: int, *, skew: bool, zc_b: bool,
                 out_a: bool) -> None:  # fmt: skip
        r, dev = ctx.rank, ctx.device
        self.ctx, self.b, self.tag, self.t, self.e = ctx, b, tag, t, e
        self.skew = skew and ctx.size > 1 and r % 2 == 1
        self.zc_b, self.out_a = zc_b, out_a
        h, k, el = 2048, 4, e // ctx.size
        self.inputs = {m: make_inputs(ctx, f"{tag}/{m}", t, h, e, k) for m in "AB"}
        self.dev_in = {m: tuple(a.to(dev) for a in self.inputs[m][r]) for m in "AB"}
        self.noise = {
            m: (torch.randn(el, ctx.size * t, h, generator=ctx.gen(f"{tag}/{m}/y", r)) * 0.01)
            .to(torch.bfloat16).to(dev)
            for m in "AB"
        }  # fmt: skip
        n_a = self.dev_in["A"][0].shape[0]
        self.out = torch.empty(n_a, h, dtype=torch.bfloat16, device=dev) if out_a else None
        self.res = {}

    def step(self, fn):
        # The ranks meet on gloo (no GPU synchronisation) and raise together.
        return worker_driver.in_step(fn, self.ctx.gloo)

    def dispatch_send(self, m: str):
        x, idx, _ = self.dev_in[m]
        return self.step(lambda: self.b.low_latency_dispatch(
            x, idx, self.t, self.e, use_fp8=self.FP8[m], return_recv_hook=True))  # fmt: skip

    def experts(self, m: str, recv) -> torch.Tensor:
        recv_x, scales = recv if self.FP8[m] else (recv, None)
        y = dequant(recv_x, scales, self.FP8[m], False)
        return (y.float() + self.noise[m].float()).to(torch.bfloat16)

    def combine_send(self, m: str, y, handle):
        _, idx, w = self.dev_in[m]
        zc = m == "B" and self.zc_b
        if zc:
            self.b.get_next_low_latency_combine_buffer(handle).copy_(y)
        out = self.out if m == "A" else None
        return self.step(lambda: self.b.low_latency_combine(
            y, idx, w, handle, zero_copy=zc, return_recv_hook=True, out=out))  # fmt: skip

    def run(self, refusals: bool = False) -> None:
        recv_a, cnt_a, h_a, _, hk = self.dispatch_send("A")
        hk()
        y_a = self.experts("A", recv_a)
        comb_a, _, hk_ca = self.combine_send("A", y_a, h_a)
        recv_b, cnt_b, h_b, _, hk_db = self.dispatch_send("B")
        if refusals:
            self.refusals(hk_ca, hk_db, h_b)
        if self.skew:
            torch.cuda._sleep(OVERLAP_SKEW_CYCLES)
        hk_ca()
        hk_db()
        y_b = self.experts("B", recv_b)
        comb_b, _, hk_cb = self.combine_send("B", y_b, h_b)
        hk_cb()
        self.res = {"A": (recv_a, cnt_a, h_a, y_a, comb_a), "B": (recv_b, cnt_b, h_b, y_b, comb_b)}

    def refusals(self, hk_ca, hk_db, h_b) -> None:
        """With two hooks pending: a third call (with a hook or without) raises
        RuntimeError naming the oldest pending hook, and so does B's hook called
        before A's; nothing is launched."""
        ctx, b = self.ctx, self.b
        x, idx, w = self.dev_in["B"]
        for label, fn in (
            ("third dispatch", lambda: b.low_latency_dispatch(x, idx, self.t, self.e,
                                                              return_recv_hook=True)),
            ("third call without hook", lambda: b.low_latency_dispatch(x, idx, self.t, self.e)),
            ("third combine", lambda: b.low_latency_combine(
                torch.zeros_like(self.noise["B"]), idx, w, h_b, return_recv_hook=True)),
            ("hook out of order", hk_db),
        ):  # fmt: skip
            try:
                fn()
            except RuntimeError as ex:
                if hk_ca.name not in str(ex) or "hook" not in str(ex):
                    ctx.fail(f"{self.tag}: {label}: the refusal does not name {hk_ca.name}: {ex}")
                continue
            except Exception as ex:  # noqa: BLE001
                ctx.fail(f"{self.tag}: {label}: raised {type(ex).__name__}: {ex}")
                continue
            ctx.fail(f"{self.tag}: {label} with two hooks pending did not raise RuntimeError")
        if hk_db.called or hk_ca.called:
            ctx.fail(f"{self.tag}: a refused hook ran")

    def spoil_outputs(self) -> None:
        for recv, cnt, handle, _, comb in self.res.values():
            for tensor in (*(recv if isinstance(recv, tuple) else (recv,)), cnt, handle[0],
                           handle[1], comb):  # fmt: skip
                spoil(tensor)

    def check(self, label: str, inputs=None) -> None:
        ctx, r = self.ctx, self.ctx.rank
        torch.cuda.synchronize(ctx.device)
        inputs = inputs or self.inputs
        for m in "AB":
            recv, cnt, handle, y, comb = self.res[m]
            inp = inputs[m]
            ref = reference.ll_dispatch([i[0] for i in inp], [i[1] for i in inp], self.t,
                                        self.e, self.FP8[m], rank=r)  # fmt: skip
            recv_x, scales = recv if self.FP8[m] else (recv, None)
            check_dispatch(ctx, f"{label} {m}", ((recv_x, scales), cnt, handle), ref[r], r,
                           self.FP8[m], False)  # fmt: skip
            if m == "A" and self.out is not None and comb.data_ptr() != self.out.data_ptr():
                ctx.fail(f"{label} A: combine did not write into out=")
            want = reference_combine(ctx, y, cnt, handle, inp, self.t, self.e)
            got = comb.cpu()
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
                ctx.fail(f"{label} {m}: combine differs from the reference at "
                         f"{bad[0].tolist()} ({len(bad)} elements)")  # fmt: skip


def scenario_overlap(ctx: Ctx, buf) -> None:
    """SGLang's two-batch overlap (``_Overlap``): micro-batch B's dispatch send while
    A's combine hook is pending, the odd ranks late on the GPU before A's combine hook;
    both micro-batches exact (dispatch and combine against the reference, outputs
    poisoned first). With two hooks pending, a third call and an out-of-order hook
    raise RuntimeError naming the pending hook. Over NVLink (B's combine zero-copy,
    A's into out=) and through the proxy, then the NVLink sequence captured in a CUDA
    graph, replayed with the late ranks and changing inputs (outputs spoiled before
    each checked replay)."""
    dev, r = ctx.device, ctx.rank
    e, t = 8 * ctx.size, 32
    poison(dev, ctx.ranks_per_gpu)
    ov = _Overlap(ctx, buf, "overlap", t, e, skew=True, zc_b=True, out_a=True)
    ov.run(refusals=True)
    ov.check("overlap nvlink")
    with own_buffer(ctx, t=t, h=2048, e=e, allow_nvlink_for_low_latency_mode=False) as pbuf:
        poison(dev, ctx.ranks_per_gpu)
        pov = _Overlap(ctx, pbuf, "overlap-proxy", t, e, skew=True, zc_b=False, out_a=False)
        pov.run()
        pov.check("overlap proxy")
        torch.cuda.synchronize(dev)
        pbuf.check()
    # The same sequence in a CUDA graph (warmed up by the eager run above).
    gov = _Overlap(ctx, buf, "overlap-graph", t, e, skew=True, zc_b=False, out_a=True)
    gov.run()
    gov.check("overlap graph warm-up")
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        torch.cuda.synchronize(dev)
        with torch.cuda.graph(graph, stream=s):
            gov.run()
    torch.cuda.synchronize(dev)
    if buf._ll_pending:
        ctx.fail(f"overlap graph: hooks pending after the capture: {buf._ll_pending}")
    for it in range(6):
        if it in (0, 3, 5):
            inputs = {}
            for m in "AB":
                inp = []
                for q in range(ctx.size):
                    x0, idx, w = gov.inputs[m][q]
                    g = ctx.gen(f"overlap-graph{it}/{m}", q)
                    xq = (torch.randn(x0.shape, generator=g) * (it + 1)).to(torch.bfloat16)
                    inp.append((xq, idx, w))
                inputs[m] = inp
                gov.dev_in[m][0].copy_(inp[r][0].to(dev))
            gov.spoil_outputs()
            torch.cuda.synchronize(dev)
            dist.barrier(group=ctx.gloo)
            graph.replay()
            gov.check(f"overlap graph replay {it}", inputs)
        else:
            dist.barrier(group=ctx.gloo)
            graph.replay()
    torch.cuda.synchronize(dev)
    del graph
    buf.check()


def scenario_masked_rank(ctx: Ctx, buf) -> None:
    """The last rank is masked on every rank and makes no call; the others complete
    and match the reference without it. Then everything is unmasked and reset."""
    masked = ctx.size - 1
    with own_buffer(ctx, enable_shrink=True) as sbuf:
        e = 8 * ctx.size
        el = e // ctx.size
        inputs = make_inputs(ctx, "masked", 48, 2048, e, 4, zero_rank=False)
        # Reference: the masked rank sends nothing, nobody sends to it.
        ref_in = without_rank(inputs, masked, experts_per_rank=el)
        group = dist.new_group([q for q in range(ctx.size) if q != masked])
        if ctx.rank != masked:
            sbuf.low_latency_update_mask_buffer(masked, True)
            mask = queried_mask(ctx, sbuf)
            if mask != only_rank_masked(ctx, masked):
                ctx.fail(f"mask query {mask}")
            _masked_round_trip(ctx, sbuf, "masked", inputs, ref_in, 48, e, masked, group)
        unmask_and_round_trip(ctx, sbuf, e, "unmasked", "after unmask")


def without_rank(inputs, masked: int, experts_per_rank: int | None = None) -> list:
    """The reference's inputs of a call that rank ``masked`` makes no part of: it
    sends nothing; with ``experts_per_rank``, the others' tokens routed to its
    experts are dropped too."""
    ref_in = []
    for q, (x, idx, w) in enumerate(inputs):
        if q == masked:
            ref_in.append((x[:0], idx[:0], w[:0]))
        else:
            idx = idx.clone()
            if experts_per_rank is not None:
                idx[idx // experts_per_rank == masked] = -1
            ref_in.append((x, idx, w))
    return ref_in


def queried_mask(ctx: Ctx, sbuf) -> list:
    """What ``low_latency_query_mask_buffer`` says of every rank (1: masked)."""
    st = torch.zeros(ctx.size, dtype=torch.int32, device=ctx.device)
    sbuf.low_latency_query_mask_buffer(st)
    return st.tolist()


def only_rank_masked(ctx: Ctx, masked: int) -> list:
    return [1 if q == masked else 0 for q in range(ctx.size)]


def unmask_and_round_trip(ctx: Ctx, sbuf, e: int, tag: str, label: str) -> None:
    """Every rank: the mask and the buffer cleaned, then one round trip of every
    rank (inputs ``tag``) must match the reference again."""
    dist.barrier()
    sbuf.low_latency_clean_mask_buffer()
    sbuf.clean_low_latency_buffer(48, 2048, e)
    inputs = make_inputs(ctx, tag, 48, 2048, e, 4)
    round_trip(ctx, sbuf, label, inputs, 48, e)


def _masked_round_trip(ctx, sbuf, label, inputs, ref_in, t, e, masked, group):
    r, dev = ctx.rank, ctx.device
    x, idx, w = (a.to(dev) for a in inputs[r])
    ref = reference.ll_dispatch([i[0] for i in ref_in], [i[1] for i in ref_in], t, e, False,
                                rank=r)  # fmt: skip
    recv, count, handle, _, _ = sbuf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    torch.cuda.synchronize(dev)
    check_dispatch(ctx, label, ((recv, None), count, handle), ref[r], r, False, False)
    comb, _, _ = sbuf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize(dev)
    # Everyone but the masked rank gathers (a subgroup).
    ys = [None] * (ctx.size - 1)
    dist.all_gather_object(ys, (recv.cpu(), handle[0].cpu(), handle[1].cpu()), group=group)
    el = e // ctx.size
    rt = ctx.size * t
    full_ys, hs = [], []
    it = iter(ys)
    for q in range(ctx.size):
        if q == masked:
            full_ys.append(torch.zeros(el, rt, x.shape[1], dtype=torch.bfloat16))
            hs.append((torch.zeros(el, rt, dtype=torch.int32),
                       torch.zeros(el, ctx.size, dtype=torch.int64)))  # fmt: skip
        else:
            y_, s_, l_ = next(it)
            full_ys.append(y_)
            hs.append((s_, l_))
    want = reference.ll_combine(full_ys, [i[1] for i in ref_in], [i[2] for i in ref_in], hs, t,
                                e)  # fmt: skip
    if not torch.equal(comb.cpu().view(torch.int16), want[r][0].view(torch.int16)):
        ctx.fail(f"{label}: combine differs from the reference without rank {masked}")


def scenario_timeout_mask(ctx: Ctx, buf) -> None:
    """With enable_shrink and a 2 s receive timeout, the last rank skips a call: the
    others' receive times out, masks it, completes, and reports it in the mask."""
    masked = ctx.size - 1
    with own_buffer(ctx, ll_timeout_s=2, enable_shrink=True) as sbuf:
        e = 8 * ctx.size
        inputs = make_inputs(ctx, "timeout", 48, 2048, e, 4, zero_rank=False)
        ref_in = without_rank(inputs, masked)
        if ctx.rank != masked:
            r, dev = ctx.rank, ctx.device
            x, idx, w = (a.to(dev) for a in inputs[r])
            t0 = time.time()
            recv, count, handle, _, _ = sbuf.low_latency_dispatch(x, idx, 48, e, use_fp8=False)
            torch.cuda.synchronize(dev)
            took = time.time() - t0
            mask = queried_mask(ctx, sbuf)
            if mask != only_rank_masked(ctx, masked):
                ctx.fail(f"timeout: mask {mask} after {took:.1f} s")
            ref = reference.ll_dispatch([i[0] for i in ref_in], [i[1] for i in ref_in], 48, e,
                                        False, rank=r)  # fmt: skip
            check_dispatch(ctx, "timeout dispatch", ((recv, None), count, handle), ref[r], r,
                           False, False)  # fmt: skip
            # The combine skips the masked rank's experts.
            comb, _, _ = sbuf.low_latency_combine(recv, idx, w, handle)
            torch.cuda.synchronize(dev)
            if not torch.isfinite(comb.float()).all():
                ctx.fail("timeout: combine output not finite")
        unmask_and_round_trip(ctx, sbuf, e, "after-timeout", "after timeout")


def scenario_timeout_poison(ctx: Ctx, buf) -> None:
    """Without shrink, with a 2 s device timeout, the last rank skips a call. The
    others' calls still return, but nothing passes as valid: a dispatch returns
    counts of -1, a combine returns NaN in every token that an expert of the late
    rank would have added to (the others are exact), and check() raises
    moelink.TimeoutError naming the late rank. clean_low_latency_buffer() recovers."""
    late = ctx.size - 1
    r, dev = ctx.rank, ctx.device
    e = 8 * ctx.size
    el = e // ctx.size
    with own_buffer(ctx, ll_timeout_s=2) as tbuf:

        def expect_timeout(label: str) -> None:
            try:
                tbuf.check()
            except moelink.TimeoutError as ex:
                if f"from rank {late}" not in str(ex):
                    ctx.fail(f"{label}: the TimeoutError does not name rank {late}: {ex}")
                return
            ctx.fail(f"{label}: check() raised no TimeoutError")

        def recover() -> None:
            torch.cuda.synchronize(dev)
            dist.barrier()
            tbuf.clean_low_latency_buffer(48, 2048, e)

        x, idx, w = (a.to(dev) for a in make_inputs(ctx, "poison", 48, 2048, e, 4,
                                                    zero_rank=False)[r])  # fmt: skip
        # 1. The late rank skips a dispatch.
        if r != late:
            _, count, _, _, _ = tbuf.low_latency_dispatch(x, idx, 48, e, use_fp8=False)
            torch.cuda.synchronize(dev)
            if count.tolist() != [-1] * el:
                ctx.fail(f"dispatch after a timeout: counts {count.tolist()}, expected -1s")
            expect_timeout("dispatch")
        recover()
        # 2. Every rank dispatches; the late rank skips the combine.
        recv, count, handle, _, _ = tbuf.low_latency_dispatch(x, idx, 48, e, use_fp8=False)
        torch.cuda.synchronize(dev)
        if r != late:
            comb, _, _ = tbuf.low_latency_combine(recv, idx, w, handle)
            torch.cuda.synchronize(dev)
            nan_rows = torch.isnan(comb.float()).any(dim=1).cpu()
            want = ((idx.cpu() >= late * el) & (idx.cpu() < (late + 1) * el)).any(dim=1)
            if not torch.equal(nan_rows, want):
                ctx.fail(
                    f"combine after a timeout: NaN rows {nan_rows.nonzero().flatten().tolist()}, "
                    f"expected those routed to rank {late}: {want.nonzero().flatten().tolist()}"
                )
            if not torch.isfinite(comb[~want.to(dev)].float()).all():
                ctx.fail("combine after a timeout: a token not routed to the late rank is NaN")
            expect_timeout("combine")
        recover()
        inputs = make_inputs(ctx, "after-poison", 48, 2048, e, 4)
        round_trip(ctx, tbuf, "after the timeouts", inputs, 48, e)


def shrink_failures(size: int) -> dict:
    """DeepEP's shrink test at ``size`` ranks: which rank fails (stays alive, stops
    calling moelink) at its first call of each API."""
    fail = {"dispatch": 1}
    if size > 2:
        fail["combine"] = size - 1
    if size >= 4:
        fail["clean"] = size // 2
    return fail


def scenario_shrink_destroy(ctx: Ctx, buf) -> None:
    """DeepEP's shrink flow (``enable_shrink=True``, a 2 s receive bound): rank 1 stops
    at its dispatch, rank R-1 at its combine, rank R/2 (R >= 4) at its clean; a failed
    rank stays alive and goes straight to ``destroy()``. The others' calls return,
    mask exactly the failed ranks (the mask query after each step) and match the
    reference without them; then they destroy too, long after the failed ranks. Every
    rank's destroy returns without error; then every rank meets in a torch barrier."""
    r, size, dev = ctx.rank, ctx.size, ctx.device
    t, h, e, k = 48, 2048, 8 * ctx.size, 4
    el = e // size
    fail = shrink_failures(size)
    dead_at_combine = {fail["dispatch"], fail.get("combine", fail["dispatch"])}
    # Control groups of the ranks still calling at each step (made by every rank now).
    order = ("dispatch", "combine", "clean")
    live = {}
    for i, api in enumerate(order):
        gone = {fail[a] for a in order[: i + 1] if a in fail}
        live[api] = [q for q in range(size) if q not in gone]
    # The default backend, not gloo: with one rank per GPU the default NCCL group
    # is bound to a device, so torch makes every subgroup by splitting its
    # communicator, and a rank outside a gloo subgroup would wait in that split
    # for members that never make it (torch splits only for the default backend's
    # subgroups on the members' side).
    groups = {api: dist.new_group(ranks) for api, ranks in live.items()}
    inputs = make_inputs(ctx, "shrink", t, h, e, k, zero_rank=False)
    os.environ["MOELINK_LL_TIMEOUT_S"] = "2"
    try:
        sbuf = new_ll_buffer(ctx, enable_shrink=True)
    finally:
        del os.environ["MOELINK_LL_TIMEOUT_S"]
    expected: set = set()

    def failed_at(api: str) -> bool:
        """This rank stops here (or stopped before); the expected mask grows."""
        if api in fail:
            expected.add(fail[api])
        return r in expected

    def check_mask(step: str) -> None:
        mask = queried_mask(ctx, sbuf)
        want = [1 if q in expected else 0 for q in range(size)]
        if mask != want:
            ctx.fail(f"shrink: mask after {step} {mask}, expected {want}")

    try:
        x, idx, w = (a.to(dev) for a in inputs[r])
        if not failed_at("dispatch"):
            dist.barrier(group=groups["dispatch"])
            t0 = time.time()
            recv, count, handle, _, _ = sbuf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
            torch.cuda.synchronize(dev)
            took = time.time() - t0
            check_mask(f"dispatch ({took:.1f} s)")
            ref_in = without_rank(inputs, fail["dispatch"], experts_per_rank=el)
            ref = reference.ll_dispatch([i[0] for i in ref_in], [i[1] for i in ref_in], t, e,
                                        False, rank=r)  # fmt: skip
            check_dispatch(ctx, "shrink dispatch", ((recv, None), count, handle), ref[r], r,
                           False, False)  # fmt: skip
            if not failed_at("combine"):
                dist.barrier(group=groups["combine"])
                comb, _, _ = sbuf.low_latency_combine(recv, idx, w, handle)
                torch.cuda.synchronize(dev)
                check_mask("combine")
                _check_live_combine(
                    ctx, comb, recv, handle, inputs, dead_at_combine, fail["dispatch"],
                    groups["combine"], live["combine"], t, e,
                )  # fmt: skip
                if not failed_at("clean"):
                    dist.barrier(group=groups["clean"])
                    t0 = time.time()
                    sbuf.clean_low_latency_buffer(t, h, e)
                    check_mask(f"clean ({time.time() - t0:.1f} s)")
        torch.cuda.synchronize(dev)
    finally:
        # Every rank, failed or not, whenever it gets here: no rank waits for
        # another (a failed rank's destroy returns while the others still work).
        t0 = time.time()
        try:
            sbuf.destroy()
        except Exception as ex:  # noqa: BLE001
            ctx.fail(f"shrink: destroy() raised {type(ex).__name__}: {ex}")
        if time.time() - t0 > 10:
            ctx.fail(f"shrink: destroy() took {time.time() - t0:.1f} s (waited for a rank?)")
        dist.barrier(group=ctx.gloo)


def _check_live_combine(ctx, comb, recv, handle, inputs, dead: set, no_dispatch: int, group,
                        live: list, t: int, e: int) -> None:  # fmt: skip
    """A survivor's combine against the reference of the live ranks: the experts of
    the ``dead`` ranks dropped, rank ``no_dispatch`` sent nothing (identity experts:
    each live rank's y is what it received; gathered over ``group``, ranks ``live``)."""
    el = e // ctx.size
    ys = [None] * len(live)
    dist.all_gather_object(ys, (recv.cpu(), handle[0].cpu(), handle[1].cpu()), group=group)
    got = dict(zip(live, ys))
    full_ys, hs, ref_in = [], [], []
    for q, (x, idx, w) in enumerate(inputs):
        if q in got:
            y_, s_, l_ = got[q]
            full_ys.append(y_)
            hs.append((s_, l_))
        else:
            full_ys.append(torch.zeros(el, ctx.size * t, x.shape[1], dtype=torch.bfloat16))
            hs.append((torch.zeros(el, ctx.size * t, dtype=torch.int32),
                       torch.zeros(el, ctx.size, dtype=torch.int64)))  # fmt: skip
        idx = idx.clone()
        for d in dead:
            idx[idx // el == d] = -1
        ref_in.append((x[:0], idx[:0], w[:0]) if q == no_dispatch else (x, idx, w))
    want = reference.ll_combine(full_ys, [i[1] for i in ref_in], [i[2] for i in ref_in], hs, t,
                                e)  # fmt: skip
    if not torch.equal(comb.cpu().view(torch.int16), want[ctx.rank][0].view(torch.int16)):
        ctx.fail(f"shrink combine differs from the reference without ranks {sorted(dead)}")


def scenario_create_destroy(ctx: Ctx, buf) -> None:
    def cycle(i: int, name: str) -> None:
        b = new_ll_buffer(ctx, t=64, h=2048, allow_nvlink_for_low_latency_mode=(i % 2 == 0))
        if i % 3 == 0:
            inputs = make_inputs(ctx, f"cd{i}", 16, 2048, 8 * ctx.size, 2)
            round_trip(ctx, b, f"{name} {i}", inputs, 64, 8 * ctx.size)
        torch.cuda.synchronize()
        b.destroy()

    # A round trip over NVLink and one through the proxy first: what a process
    # loads or reserves once (lazily loaded kernels, torch's and ours, the local
    # memory they reserve, the proxy's first mappings) is not counted as a loss.
    for i in (0, 3):
        cycle(i, "warm-up")
    free0 = worker_driver.quiesced_free_memory(ctx.device, ctx.gloo)
    for i in range(10):
        cycle(i, "create/destroy")
    free1 = worker_driver.quiesced_free_memory(ctx.device, ctx.gloo)
    if free0 - free1 > 64 << 20:
        ctx.fail(f"create/destroy leaked {(free0 - free1) >> 20} MiB of device memory")


# ----- driver --------------------------------------------------------------------------


def main() -> int:
    wg = worker_driver.init_worker(600)
    rank, size, device = wg.rank, wg.world, wg.device
    seed = [int(os.environ.get(SEED_ENV, time.time_ns() % (1 << 31)))]
    dist.broadcast_object_list(seed, src=0)
    ctx = Ctx(rank, size, seed[0], device, wg.ranks_per_gpu, wg.gloo)
    if rank == 0:
        print(
            f"ll_worker: {size} ranks, {wg.ranks_per_gpu} per GPU "
            f"({dist.get_backend(wg.group)}), seed {seed[0]}",
            flush=True,
        )
    names = worker_driver.selected_scenarios(SCENARIOS_ENV, SCENARIO_NAMES)
    buf = new_ll_buffer(ctx)
    ranks_on_gpu, sms, ctx_sms, share, group_share = buf._ll.device_share()
    if rank == 0:
        print(
            f"ll_worker: {ranks_on_gpu} ranks on this GPU of {sms} SMs, context SM limit "
            f"{ctx_sms}, {share} blocks per grid (group {group_share}); "
            f"MPS thread percentage {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')}",
            flush=True,
        )
    failed = False
    for name in names:
        fn = globals()[f"scenario_{name}"]
        ctx.errors = []
        t0 = time.time()
        with worker_driver.Watchdog(name, rank, SCENARIO_TIMEOUT_S):
            try:
                fn(ctx, buf)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                ctx.fail(f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
        for msg in ctx.errors[:3]:
            print(f"FAIL {name} [rank {rank}]: {msg}", flush=True)
        verdicts = [None] * size
        dist.all_gather_object(verdicts, ctx.errors)
        bad = [(q, v) for q, v in enumerate(verdicts) if v]
        if rank == 0:
            if bad:
                print(f"FAIL {name}: " + "; ".join(f"rank {q}: {v[:3]}" for q, v in bad),
                      flush=True)  # fmt: skip
            else:
                print(f"PASS {name} ({time.time() - t0:.1f} s)", flush=True)
        if bad:
            failed = True
            torch.cuda.synchronize()
            try:
                buf.destroy()
            except Exception:  # noqa: BLE001
                pass
            buf = new_ll_buffer(ctx)
    torch.cuda.synchronize()
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
