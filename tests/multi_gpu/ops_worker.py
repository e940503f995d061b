"""Run under ``python -m moelink.launch`` (or torchrun): moelink's torch ops
(``torch.ops.moelink.*``, python/moelink/_ops.py) on the GPUs, eager, under
``torch.compile(fullgraph=True)`` (aot_eager and inductor) and captured in CUDA
graphs, against references on fresh random data.

Rank 0 draws a seed (``MOELINK_TEST_SEED`` replays a run) and every rank builds
every rank's inputs from it, as the allreduce and low-latency workers do (their
helpers are reused: ``allreduce_worker`` for the allreduce inputs, float64
reference, tolerances and cross-rank digests; ``ll_worker`` for the low-latency
inputs, the CPU reference ``moelink.reference.ll_dispatch`` / ``ll_combine``
and its checks). Outputs the ops allocate are poisoned first (the allocator's
free memory is filled with 0x7F bytes before each call); in-place outputs hold
the input.

Scenarios (``SCENARIO_NAMES``; ``MOELINK_OPS_SCENARIOS``, a comma list, selects
some) print ``PASS <name>`` / ``FAIL <name>: ...`` on rank 0 once the ranks agree;
exit code 1 if any failed. The communicators' device waits are bounded at
``DEVICE_TIMEOUT_S`` (300 s) here: a rank still compiling (inductor) while its
peers wait in the first compiled collective must not look like a dead peer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import allreduce_worker as arw
import ll_worker as llw
import moelink
import moelink.ops as mops
import torch
import torch.distributed as dist
import worker_driver
from moelink import reference

SCENARIO_NAMES = (
    "registry",
    "all_reduce_eager",
    "all_gather_eager",
    "all_reduce_or_nccl",
    "ll_eager",
    "compiled",
    "cuda_graph",
)
SCENARIOS_ENV = "MOELINK_OPS_SCENARIOS"
SEED_ENV = "MOELINK_TEST_SEED"
SCENARIO_TIMEOUT_S = 900
CONTROL_TIMEOUT_S = 600
DEVICE_TIMEOUT_S = 300
MIB = 1 << 20
#: max_bytes of the worker's AllReduce: the LL algorithms and rsag_push.
MAX_BYTES = 16 * MIB
#: Low-latency shape: tokens per rank, hidden, top-k (experts: 8 per rank).
LL_T, LL_H, LL_K = 64, 2048, 4
OPS = torch.ops.moelink


@dataclass
class Ctx:
    ar: arw.Ctx  # allreduce inputs, checks, digests (ar.comm: the communicator)
    ll: llw.Ctx  # low-latency inputs and checks
    buf: moelink.Buffer | None = None
    buf_handle: int = 0

    @property
    def comm(self) -> moelink.AllReduce:
        return self.ar.comm

    @property
    def device(self) -> torch.device:
        return self.ar.device


def new_comm(ctx: Ctx, **kw) -> moelink.AllReduce:
    return moelink.AllReduce(
        ctx.ar.group, max_bytes=kw.pop("max_bytes", MAX_BYTES), tune_file=False,
        device_timeout_s=DEVICE_TIMEOUT_S, **kw,
    )  # fmt: skip


def new_buffer(ctx: Ctx) -> moelink.Buffer:
    os.environ["MOELINK_LL_TIMEOUT_S"] = str(DEVICE_TIMEOUT_S)
    try:
        buf = llw.new_ll_buffer(ctx.ll)
    finally:
        del os.environ["MOELINK_LL_TIMEOUT_S"]
    ctx.buf_handle = buf.handle  # a Buffer registers itself
    return buf


def poison_free(ctx: Ctx) -> None:
    """The allocator's free memory filled with 0x7F bytes: what an op allocates
    next starts as garbage, not zeros (large blocks through ll_worker's poison,
    the small pool's blocks of at most 1 MiB with 32 of them)."""
    llw.poison(ctx.device, ctx.ll.ranks_per_gpu)
    small = [
        torch.empty(1 << 20, dtype=torch.uint8, device=ctx.device).fill_(llw.POISON_BYTE)
        for _ in range(32)
    ]
    del small
    torch.cuda.synchronize(ctx.device)


def flat_inputs(ctx: Ctx, tag, n: int, dtype) -> list:
    return arw.every_input(ctx.ar, tag, n, dtype)


# ----- registry ---------------------------------------------------------------------------


def destroy_and_expect_unregistered(chk, obj, what: str) -> None:
    """``obj.destroy()``; its handle must then name nothing."""
    h = obj.handle
    obj.destroy()
    try:
        mops.lookup(h)
        chk.expect(False, f"a destroyed {what} is still registered")
    except ValueError:
        chk.expect(True, "")


def scenario_registry(ctx: Ctx) -> None:
    chk = arw.Checker()
    comm = ctx.comm
    chk.expect(mops.lookup(comm.handle) is comm, "the AllReduce is not under its handle")
    chk.expect(mops.register(ctx.buf) == ctx.buf_handle, "a Buffer registered twice changed handle")
    chk.expect(mops.lookup(ctx.buf_handle) is ctx.buf, "the Buffer is not under its handle")
    extra = llw.new_ll_buffer(ctx.ll, t=16, h=1024)
    hb = extra.handle
    chk.expect(hb != ctx.buf_handle and mops.lookup(hb) is extra, "a second Buffer's handle")
    destroy_and_expect_unregistered(chk, extra, "Buffer")
    del extra
    a = moelink.AllReduce.from_process_group(ctx.ar.group, max_bytes=MIB, tune_file=False)
    b = moelink.AllReduce.from_process_group(ctx.ar.group, tune_file=False, max_bytes=MIB)
    chk.expect(a is b, "from_process_group made two communicators for the same settings")
    chk.expect(a is not comm and mops.lookup(a.handle) is a, "from_process_group's handle")
    inputs = flat_inputs(ctx, "registry", 1000, torch.float32)
    y = OPS.all_reduce(inputs[ctx.ar.rank].clone(), a.handle)
    torch.cuda.synchronize()
    arw.check_allreduce(ctx.ar, chk, "registry all_reduce", y, inputs, "sum")
    h = a.handle
    destroy_and_expect_unregistered(chk, a, "AllReduce")
    c = moelink.AllReduce.from_process_group(ctx.ar.group, max_bytes=MIB, tune_file=False)
    chk.expect(c is not a and c.handle != h, "from_process_group handed out a destroyed one")
    c.destroy()
    arw.compare_digests(ctx.ar, chk)
    chk.done()


# ----- allreduce / allgather, eager --------------------------------------------------------


def scenario_all_reduce_eager(ctx: Ctx) -> None:
    """Every dtype x op x accumulation, out of place (also a 2-D and a transposed
    input) and in place, against the float64 reference."""
    chk = arw.Checker()
    h, r = ctx.comm.handle, ctx.ar.rank
    for dtype in arw.DTYPES:
        for op in arw.OPS:
            for accum in arw.accums(dtype, op):
                for n in (1, 1000, 4097 * 3, 3 * MIB // 4 + 1):
                    if n * arw.elem_size(dtype) > MAX_BYTES:
                        continue
                    name = f"{dtype} {op} accum={accum} n={n}"
                    inputs = flat_inputs(ctx, ("ar", name), n, dtype)
                    x = inputs[r].clone()
                    poison_free(ctx)
                    y = OPS.all_reduce(x, h, op, None, accum)
                    torch.cuda.synchronize()
                    chk.expect(
                        torch.equal(x.view(torch.uint8), inputs[r].view(torch.uint8)),
                        f"{name}: the out-of-place op changed its input",
                    )
                    chk.expect(y.shape == x.shape and y.dtype == dtype, f"{name}: {y.shape}")
                    arw.check_allreduce(ctx.ar, chk, f"{name} out", y, inputs, op, accum)
                    mops.all_reduce_(x, h, op, None, accum)
                    torch.cuda.synchronize()
                    arw.check_allreduce(ctx.ar, chk, f"{name} in place", x, inputs, op, accum)
        # 2-D and strided inputs (the op reduces a contiguous copy of a view).
        rows = 96
        inputs = flat_inputs(ctx, ("ar2d", dtype), rows * 40, dtype)
        x2 = inputs[r].view(rows, 40)
        poison_free(ctx)
        y2 = OPS.all_reduce(x2, h, "max")
        yt = OPS.all_reduce(x2.t(), h, "max")
        torch.cuda.synchronize()
        chk.expect(y2.shape == (rows, 40) and yt.shape == (40, rows), f"{dtype}: 2-D shapes")
        arw.check_allreduce(ctx.ar, chk, f"{dtype} 2-D", y2.reshape(-1), inputs, "max")
        arw.check_allreduce(ctx.ar, chk, f"{dtype} transposed", yt.t().reshape(-1), inputs, "max")
        arw.compare_digests(ctx.ar, chk)
    ctx.comm.check()
    chk.done()


def scenario_all_gather_eager(ctx: Ctx) -> None:
    chk = arw.Checker()
    h, r, world = ctx.comm.handle, ctx.ar.rank, ctx.ar.world
    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn, torch.float64):
        for shape in ((), (1,), (1001,), (64, 33), (MAX_BYTES // (world * 16), 2)):
            n = 1
            for s in shape:
                n *= s
            if n * world * arw.elem_size(dtype) > MAX_BYTES:
                continue
            name = f"all_gather {dtype} {shape}"
            inputs = flat_inputs(ctx, ("ag", name), n, dtype)
            x = inputs[r].view(shape)
            poison_free(ctx)
            y = OPS.all_gather(x, h, ctx.ar.world)
            torch.cuda.synchronize()
            want_shape = (world,) if shape == () else (world * shape[0], *shape[1:])
            chk.expect(tuple(y.shape) == want_shape, f"{name}: shape {tuple(y.shape)}")
            arw.check_equal(ctx.ar, chk, name, y.reshape(-1), torch.cat(inputs))
        arw.compare_digests(ctx.ar, chk)
    ctx.comm.check()
    chk.done()


def scenario_all_reduce_or_nccl(ctx: Ctx) -> None:
    """The route: moelink for what its AllReduce serves (``last_choice`` set),
    torch.distributed otherwise (float64, too large, product/avg); both right."""
    chk = arw.Checker()
    comm, r, world = ctx.comm, ctx.ar.rank, ctx.ar.world
    h = comm.handle
    gloo = dist.get_backend(ctx.ar.group) == "gloo"
    cases = [
        ("bf16 sum", torch.bfloat16, 4096, "sum", True),
        ("int32 max", torch.int32, 1001, "max", True),
        ("fp32 near max_bytes", torch.float32, MAX_BYTES // 4, "sum", True),
        ("fp32 above max_bytes", torch.float32, MAX_BYTES // 4 + 1, "sum", False),
        ("float64 sum", torch.float64, 1000, "sum", False),
        ("fp32 product", torch.float32, 1000, "product", False),
    ]
    if not gloo:  # gloo has no AVG
        cases.append(("fp32 avg", torch.float32, 1000, "avg", False))
    for name, dtype, n, op, moelink_path in cases:
        inputs = flat_inputs(ctx, ("route", name), n, dtype)
        x = inputs[r].clone()
        chk.expect(mops.moelink_serves(x, h, op) == moelink_path, f"{name}: route")
        comm.last_choice = None
        mops.all_reduce_or_nccl(x, h, op)
        torch.cuda.synchronize()
        ran = comm.last_choice
        chk.expect((ran is not None) == moelink_path, f"{name}: moelink ran {ran}")
        if op in arw.OPS and dtype in arw.DTYPES:
            arw.check_allreduce(ctx.ar, chk, name, x, inputs, op)
        else:  # float64 (NCCL sums it in its own order), product, avg
            xs = torch.stack([i.double() for i in inputs])
            want = {"sum": xs.sum(0), "product": xs.prod(0), "avg": xs.sum(0) / world}[op]
            want = want if dtype == torch.float64 else want.to(dtype).double()
            ok = torch.allclose(x.double(), want, rtol=1e-5, atol=1e-6)
            chk.expect(ok, f"{name}: max error {(x.double() - want).abs().max().item():.3g}")
    # A strided view: reduced through a contiguous copy, written back.
    inputs = flat_inputs(ctx, "route strided", 64 * 48, torch.float32)
    m = inputs[r].clone().view(64, 48)
    mops.all_reduce_or_nccl(m.t(), h)
    torch.cuda.synchronize()
    arw.check_allreduce(ctx.ar, chk, "strided", m.reshape(-1), inputs, "sum")
    arw.compare_digests(ctx.ar, chk)
    comm.check()
    chk.done()


# ----- low latency, eager ----------------------------------------------------------------


def ll_round_trip(ctx: Ctx, label: str, dispatch, combine, *, use_fp8: bool, ue8m0: bool,
                  tag: str) -> None:  # fmt: skip
    """One dispatch + combine through ``dispatch(x, idx, stats)`` and
    ``combine(y, idx, w, src_info, layout_range)``, checked as ll_worker checks
    the Buffer: the received blocks against the reference (arrival order free),
    the stats, and combine bit for bit against the reference on the GPU's layout."""
    lc, dev, r = ctx.ll, ctx.device, ctx.ll.rank
    e = 8 * lc.size
    inputs = llw.make_inputs(lc, tag, LL_T, LL_H, e, LL_K)
    x, idx, w = (a.to(dev) for a in inputs[r])
    ref = reference.ll_dispatch([i[0] for i in inputs], [i[1] for i in inputs], LL_T, e,
                                use_fp8, ue8m0, ue8m0, rank=r)  # fmt: skip
    stats = torch.zeros(8, dtype=torch.int32, device=dev)
    poison_free(ctx)
    recv_x, scales, count, src_info, layout_range = worker_driver.in_step(
        lambda: dispatch(x, idx, stats, e)
    )
    torch.cuda.synchronize(dev)
    if not use_fp8 and tuple(scales.shape) != (8, lc.size * LL_T, 0):
        lc.fail(f"{label}: bf16 dispatch returned scales of shape {tuple(scales.shape)}")
    got_scales = scales if use_fp8 else None
    llw.check_dispatch(lc, label, ((recv_x, got_scales), count, (src_info, layout_range)),
                       ref[r], r, use_fp8, ue8m0)  # fmt: skip
    if not torch.equal(stats.cpu(), count.cpu()):
        lc.fail(f"{label}: stats {stats.tolist()} != recv_count {count.tolist()}")
    y = llw.dequant(recv_x, got_scales, use_fp8, ue8m0)
    g = lc.gen(label + "/y", r)
    noise = (torch.randn(y.shape, generator=g) * 0.01).to(torch.bfloat16).to(dev)
    y = (y.float() + noise.float()).to(torch.bfloat16)
    poison_free(ctx)
    out = worker_driver.in_step(lambda: combine(y, idx, w, src_info, layout_range, e))
    torch.cuda.synchronize(dev)
    want = llw.reference_combine(lc, y, count, (src_info, layout_range), inputs, LL_T, e)
    got = out.cpu()
    if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        lc.fail(f"{label}: combine differs from the reference")


def eager_dispatch(ctx: Ctx, use_fp8: bool, ue8m0: bool):
    h, world = ctx.buf_handle, ctx.ar.world
    return lambda x, idx, stats, e: OPS.ll_dispatch(x, idx, h, world, LL_T, e, stats, use_fp8,
                                                    ue8m0, ue8m0)  # fmt: skip


def eager_combine(ctx: Ctx):
    h = ctx.buf_handle
    return lambda y, idx, w, si, lr, e: OPS.ll_combine(y, idx, w, si, lr, h, LL_T, e)


def ll_errors(ctx: Ctx, name: str) -> None:
    if ctx.ll.errors:
        errors, ctx.ll.errors = ctx.ll.errors, []
        raise AssertionError(f"{name}: " + " | ".join(errors[:3]))


def scenario_ll_eager(ctx: Ctx) -> None:
    for use_fp8, ue8m0 in ((True, False), (True, True), (False, False)):
        label = f"ll ops fp8={use_fp8} ue8m0={ue8m0}"
        ll_round_trip(ctx, label, eager_dispatch(ctx, use_fp8, ue8m0), eager_combine(ctx),
                      use_fp8=use_fp8, ue8m0=ue8m0, tag=label)  # fmt: skip
    ctx.buf.check()
    ll_errors(ctx, "ll_eager")


# ----- torch.compile ---------------------------------------------------------------------


def scenario_compiled(ctx: Ctx) -> None:
    """The ops inside ``torch.compile(fullgraph=True)`` functions, with the
    aot_eager and inductor backends, against the references (and the low-latency
    round trip with the same checks as eager)."""
    chk = arw.Checker()
    h, r = ctx.comm.handle, ctx.ar.rank

    def f_ar(x):
        y = OPS.all_reduce(x * 2, h, "sum")
        z = x + 0
        OPS.all_reduce_(z, h, "max")
        return y, z, OPS.all_gather(x, h, ctx.ar.world)

    def f_route(x, x64):
        mops.all_reduce_or_nccl(x, h)
        mops.all_reduce_or_nccl(x64, h)
        return x, x64

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        g_ar = torch.compile(f_ar, fullgraph=True, backend=backend)
        g_route = torch.compile(f_route, fullgraph=True, backend=backend)
        for it in range(3):
            name = f"{backend} call {it}"
            n = 3000 + it  # a new size each call: a recompile (dynamic) on the second
            inputs = flat_inputs(ctx, ("compiled", name), n, torch.bfloat16)
            doubled = [i * 2 for i in inputs]  # exact in bf16
            poison_free(ctx)
            y, z, g = worker_driver.in_step(lambda f=g_ar, i=inputs: f(i[r].clone()))
            torch.cuda.synchronize()
            arw.check_allreduce(ctx.ar, chk, f"{name} all_reduce", y, doubled, "sum")
            arw.check_allreduce(ctx.ar, chk, f"{name} all_reduce_", z, inputs, "max")
            arw.check_equal(ctx.ar, chk, f"{name} all_gather", g, torch.cat(inputs))
            i32 = flat_inputs(ctx, ("compiled route", name), n, torch.float32)
            i64 = [i.double() for i in i32]
            a, b = worker_driver.in_step(
                lambda f=g_route, a=i32[r], b=i64[r]: f(a.clone(), b.clone())
            )
            torch.cuda.synchronize()
            arw.check_allreduce(ctx.ar, chk, f"{name} route fp32", a, i32, "sum")
            want64 = torch.stack(i64).sum(0)
            chk.expect(torch.allclose(b, want64, rtol=1e-12, atol=1e-12), f"{name} route f64")
        arw.compare_digests(ctx.ar, chk)

        hb = ctx.buf_handle

        def f_dispatch(x, idx, stats, e, hb=hb):
            return OPS.ll_dispatch(x, idx, hb, ctx.ar.world, LL_T, e, stats, True, False, False)

        def f_combine(y, idx, w, si, lr, e, hb=hb):
            return OPS.ll_combine(y * 1, idx, w, si, lr, hb, LL_T, e)

        ll_round_trip(
            ctx, f"{backend} ll", torch.compile(f_dispatch, fullgraph=True, backend=backend),
            torch.compile(f_combine, fullgraph=True, backend=backend), use_fp8=True,
            ue8m0=False, tag=f"compiled {backend}",
        )  # fmt: skip
        ll_errors(ctx, f"compiled {backend}")
    ctx.comm.check()
    ctx.buf.check()
    chk.done()


# ----- CUDA graphs -----------------------------------------------------------------------


def scenario_cuda_graph(ctx: Ctx) -> None:
    """The ops captured in one CUDA graph (allreduce out of place and in place,
    allgather, the moelink route, low-latency dispatch + combine), replayed with
    fresh inputs copied into the static ones; then a compiled function under
    ``mode="reduce-overhead"`` (torch's CUDA-graph trees)."""
    chk = arw.Checker()
    lc, dev = ctx.ll, ctx.device
    h, hb, r = ctx.comm.handle, ctx.buf_handle, ctx.ar.rank
    n, e = 5000, 8 * lc.size
    x = torch.empty(n, dtype=torch.bfloat16, device=dev)
    z = torch.empty(n, dtype=torch.float32, device=dev)
    q = torch.empty(n, dtype=torch.bfloat16, device=dev)
    ll_in = llw.make_inputs(lc, "graph shape", LL_T, LL_H, e, LL_K, zero_rank=False)
    lx, lidx, lw = (a.to(dev) for a in ll_in[r])
    outs = {}

    def body():
        outs["ar"] = OPS.all_reduce(x, h, "sum")
        OPS.all_reduce_(z, h, "max")
        outs["ag"] = OPS.all_gather(x, h, ctx.ar.world)
        mops.all_reduce_or_nccl(q, h)
        recv_x, _, count, si, lr = OPS.ll_dispatch(lx, lidx, hb, ctx.ar.world, LL_T, e, None, False)
        outs["ll"] = (recv_x, count, si, lr)
        outs["comb"] = OPS.ll_combine(recv_x, lidx, lw, si, lr, hb, LL_T, e)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        worker_driver.in_step(body)  # warm-up outside the capture
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    dist.barrier(group=ctx.ar.gloo)
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize(dev)
    for replay in range(6):
        name = f"graph replay {replay}"
        ib = flat_inputs(ctx, ("graph bf16", replay), n, torch.bfloat16)
        i32 = flat_inputs(ctx, ("graph fp32", replay), n, torch.float32)
        iq = flat_inputs(ctx, ("graph route", replay), n, torch.bfloat16)
        x.copy_(ib[r])
        z.copy_(i32[r])
        q.copy_(iq[r])
        # New token values, same routing (the graph fixed the shapes).
        inp = []
        for p in range(lc.size):
            gp = lc.gen(f"graph{replay}", p)
            xp = (torch.randn(ll_in[p][0].shape, generator=gp) * (replay + 1)).to(torch.bfloat16)
            inp.append((xp, ll_in[p][1], ll_in[p][2]))
        lx.copy_(inp[r][0].to(dev))
        for t in (outs["ar"], outs["ag"], outs["comb"], outs["ll"][0]):
            t.view(torch.uint8).fill_(0x7F)
        torch.cuda.synchronize(dev)
        worker_driver.in_step(graph.replay)
        torch.cuda.synchronize(dev)
        arw.check_allreduce(ctx.ar, chk, f"{name} all_reduce", outs["ar"], ib, "sum")
        arw.check_allreduce(ctx.ar, chk, f"{name} all_reduce_", z, i32, "max")
        arw.check_equal(ctx.ar, chk, f"{name} all_gather", outs["ag"], torch.cat(ib))
        arw.check_allreduce(ctx.ar, chk, f"{name} route", q, iq, "sum")
        recv_x, count, si, lr = outs["ll"]
        ref = reference.ll_dispatch([i[0] for i in inp], [i[1] for i in inp], LL_T, e, False,
                                    rank=r)  # fmt: skip
        llw.check_dispatch(lc, name, ((recv_x, None), count, (si, lr)), ref[r], r, False, False)
        want = llw.reference_combine(lc, recv_x, count, (si, lr), inp, LL_T, e)
        if not torch.equal(outs["comb"].cpu().view(torch.int16), want.view(torch.int16)):
            lc.fail(f"{name}: combine differs from the reference")
    del graph
    torch.cuda.synchronize(dev)

    # torch.compile's CUDA-graph trees ("reduce-overhead") over the allreduce ops.
    torch._dynamo.reset()

    def f(x):
        return OPS.all_reduce(x * 2, h, "sum") + 0

    g = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    static = torch.empty(n, dtype=torch.bfloat16, device=dev)
    for it in range(5):
        ib = flat_inputs(ctx, ("reduce-overhead", it), n, torch.bfloat16)
        static.copy_(ib[r])
        y = worker_driver.in_step(lambda s=static: g(s).clone())
        torch.cuda.synchronize(dev)
        arw.check_allreduce(ctx.ar, chk, f"reduce-overhead call {it}", y, [i * 2 for i in ib],
                            "sum")  # fmt: skip
    arw.compare_digests(ctx.ar, chk)
    ctx.comm.check()
    ctx.buf.check()
    ll_errors(ctx, "cuda_graph")
    chk.done()


SCENARIOS = worker_driver.scenario_table(globals(), SCENARIO_NAMES)


# ----- driver ----------------------------------------------------------------------------


def run_all(wg: worker_driver.WorkerGroup) -> int:
    names, seed = worker_driver.start_scenarios(
        wg,
        SCENARIOS_ENV,
        SCENARIO_NAMES,
        SEED_ENV,
        who="ops_worker: ",
        note=f"; torch {torch.__version__}",
    )
    # Inductor compiles in this process: no pool of compile workers per rank
    # (8 ranks on one host would start 8 of them).
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    ar_ctx = arw.Ctx(wg.rank, wg.world, wg.device, wg.group, wg.gloo, seed, MAX_BYTES, False)
    ll_ctx = llw.Ctx(wg.rank, wg.world, seed, wg.device, wg.ranks_per_gpu, wg.gloo)
    ctx = Ctx(ar_ctx, ll_ctx)
    ctx.ar.comm = new_comm(ctx)
    ctx.buf = new_buffer(ctx)
    status = worker_driver.run_scenarios(
        wg,
        names,
        lambda name: run_one(ctx, name),
        timeout_s=SCENARIO_TIMEOUT_S,
        on_failure=lambda: replace_objects(ctx),
    )
    torch.cuda.synchronize()
    ctx.comm.destroy()
    ctx.buf.destroy()
    return status


def run_one(ctx: Ctx, name: str) -> None:
    ctx.ar.digests = []
    ctx.ll.errors = []
    SCENARIOS[name](ctx)


def replace_objects(ctx: Ctx) -> None:
    worker_driver.destroy_after_failure(ctx.comm, "communicator", ctx.ar.rank)
    worker_driver.destroy_after_failure(ctx.buf, "Buffer", ctx.ar.rank)
    ctx.ar.comm = new_comm(ctx)
    ctx.buf = new_buffer(ctx)


if __name__ == "__main__":
    sys.exit(worker_driver.worker_main(CONTROL_TIMEOUT_S, run_all))
