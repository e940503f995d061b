"""Run under torchrun: ``moelink.AllReduce`` (allreduce, allgather) against a
float64 reference (torch, on the GPU), one process per GPU.

Rank 0 draws a fresh seed (``MOELINK_TEST_SEED`` overrides it, to replay a run) and
broadcasts it. Every rank generates EVERY rank's inputs itself from generators
seeded with ``(seed, case, rank)`` (fresh random values, never all zeros), runs the
collective with outputs poisoned first (NaN, or a sentinel for int32), checks its
own output against the reference from those inputs (exact for integers and
min/max; a tolerance derived from the dtype for float sums; fp8 sums with fp32
accumulation exactly the correctly rounded sum), and that every rank got the same
bytes (digests exchanged over gloo).

Scenarios run in the order of ``SCENARIO_NAMES`` (``MOELINK_AR_SCENARIOS``, a comma
list, selects some). ``MOELINK_AR_MAX_MIB`` (default 256) caps message sizes;
every dtype x op runs up to 16 MiB and a reduced set (bf16 sum, fp32 sum, int32
max, fp8 e4m3 sum) above, unless ``MOELINK_AR_FULL=1`` (every variant at every
size). Within a scenario checks only record mismatches, so every rank makes the
same collective calls; each rank prints ``FAIL <name> [rank r]: ...`` for its own
failures and rank 0 one ``PASS <name>`` / ``FAIL <name>`` line per scenario after
the ranks agreed over gloo. A watchdog ends the process (with a FAIL line) when a
scenario hangs. Exit code 1 when anything failed.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import moelink
import torch
import torch.distributed as dist
import worker_driver

#: Scenario names, in run order; the pytest wrapper reads this tuple.
SCENARIO_NAMES = (
    "oneshot_ll",
    "twoshot_ll",
    "rsag",
    "rsag_zc",
    "rsag_push",
    "allgather_ll",
    "allgather_mesh",
    "selector",
    "fp8_accuracy",
    "cuda_graph",
    "back_to_back",
    "reuse_race",
    "invalid_args",
    "timeout",
    "tuner",
    "create_destroy",
)
SCENARIOS_ENV = "MOELINK_AR_SCENARIOS"
SEED_ENV = "MOELINK_TEST_SEED"
MAX_MIB_ENV = "MOELINK_AR_MAX_MIB"
FULL_ENV = "MOELINK_AR_FULL"

MIB = 1 << 20
KIB = 1 << 10
#: Seconds a scenario may take before the watchdog ends the process.
SCENARIO_TIMEOUT_S = 1200
CONTROL_TIMEOUT_S = 600
#: Elements per chunk of the reference.
CHUNK = 1 << 22
#: Largest size at which every dtype x op runs (unless MOELINK_AR_FULL=1).
ALL_VARIANTS_MAX_BYTES = 16 * MIB
ODD_ELEMS = (1, 3, 17, 1023, 4097, 1_000_003)
DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OPS = ("sum", "min", "max")
#: Variants also run above ALL_VARIANTS_MAX_BYTES.
LARGE_VARIANTS = {
    (torch.bfloat16, "sum"),
    (torch.float32, "sum"),
    (torch.int32, "max"),
    (torch.float8_e4m3fn, "sum"),
}
INT_SENTINEL = 0x7F7F7F7F
#: (mantissa bits, smallest normal exponent, largest finite) of the fp8 formats.
FP8_FORMAT = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}
#: Unit roundoff of the float results (round to nearest: half an ulp, relative).
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


# ----------------------------------------------------------------------------
# Context, checks
# ----------------------------------------------------------------------------


class Checker:
    """Collects failed checks of one scenario; ``done()`` raises if there were any."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.checks = 0

    def expect(self, ok: bool, message: str) -> None:
        self.checks += 1
        if not ok:
            self.errors.append(message)

    def done(self) -> None:
        if self.errors:
            more = f" (+{len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
            raise AssertionError(
                f"{len(self.errors)} failed checks: " + " | ".join(self.errors[:5]) + more
            )


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    group: object
    gloo: object
    seed: int
    max_bytes: int
    full: bool
    comm: moelink.AllReduce | None = None
    case: int = 0
    digests: list = field(default_factory=list)

    def tag(self, *parts) -> int:
        text = "/".join(str(p) for p in (self.seed, *parts))
        return zlib.crc32(text.encode()) | (self.seed << 32)

    def new_comm(self, **kw) -> moelink.AllReduce:
        kw.setdefault("max_bytes", self.max_bytes)
        kw.setdefault("tune_file", False)
        return moelink.AllReduce(self.group, **kw)


def elem_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_input(ctx: Ctx, tag, p: int, n: int, dtype) -> torch.Tensor:
    """Rank ``p``'s input of case ``tag``: the same on every rank that builds it."""
    g = torch.Generator(device=ctx.device).manual_seed(ctx.tag(tag, p) & ((1 << 63) - 1))
    if dtype == torch.int32:
        return torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, device=ctx.device, dtype=dtype)
    u = torch.rand(n, generator=g, device=ctx.device)
    if dtype in FP8:
        return (u * 8 - 4).to(dtype)
    return (u * 2 - 1).to(dtype)


def every_input(ctx: Ctx, tag, n: int, dtype) -> list[torch.Tensor]:
    """Every rank's input of case ``tag`` (``make_input``), in rank order."""
    return [make_input(ctx, tag, p, n, dtype) for p in range(ctx.world)]


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32:
        return t.fill_(INT_SENTINEL)
    if t.dtype in FP8:
        return t.view(torch.uint8).fill_(0x7F).view(t.dtype) if t.numel() else t  # NaN
    return t.fill_(float("nan"))


def fp8_ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """Spacing of the fp8 format at |v| (float64)."""
    mant, emin, _ = FP8_FORMAT[dtype]
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**emin))).clamp_min(emin)
    return torch.pow(2.0, e - mant)


def reference_chunk(xs: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return xs.sum(0)
    if op == "min":
        return xs.min(0).values
    return xs.max(0).values


def check_allreduce(
    ctx: Ctx, chk: Checker, name: str, got: torch.Tensor, inputs: list, op: str, accum=None
) -> None:
    """Compares ``got`` with the float64 reduction of ``inputs`` (every rank's input,
    in rank order) chunk by chunk, in float64 on this rank's GPU (torch's own
    kernels, independent of moelink; the CPU took minutes at 256 MiB); records the
    first mismatch. Also records a digest of ``got`` for the cross-rank comparison."""
    dtype = got.dtype
    n = got.numel()
    h = hashlib.sha256()
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        g_raw = got[lo:hi]
        h.update(g_raw.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        xs = torch.stack([x[lo:hi].to(torch.float64) for x in inputs])
        g = g_raw.to(torch.float64)
        ref = reference_chunk(xs, op)
        if dtype == torch.int32 or op != "sum":
            want = ref
            tol = torch.zeros_like(ref)
        elif dtype in FP8:
            limit = FP8_FORMAT[dtype][2]
            want = ref.clamp(-limit, limit).to(torch.float32).to(dtype).to(torch.float64)
            if accum in (torch.float16, "fp16"):
                # Every fp16 addition rounds (cancellation can make that many fp8
                # ulps of the result), then one more rounding to fp8.
                tol = fp8_ulp(ref, dtype) + 2 * ctx.world * 2.0**-11 * xs.abs().sum(0)
            else:
                tol = torch.zeros_like(ref)  # exact in fp32, then correctly rounded
        else:
            want = ref
            abs_sum = xs.abs().sum(0)
            tol = UNIT[dtype] * ref.abs() + 2 * ctx.world * 2.0**-24 * abs_sum + 2.0**-25
        bad = ~((g - want).abs() <= tol)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            chk.expect(
                False,
                f"{name}: {int(bad.sum())} of {hi - lo} elements in [{lo}, {hi}) wrong; "
                f"first at {lo + i}: got {g[i].item()!r}, want {want[i].item()!r} "
                f"(tol {tol[i].item():.3g}; inputs {xs[:, i].tolist()})",
            )
            break
    else:
        chk.expect(True, "")
    ctx.digests.append((name, h.hexdigest()))


def check_equal(ctx: Ctx, chk: Checker, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact comparison (allgather), plus the digest for the cross-rank check."""
    g = got.detach().contiguous().view(torch.uint8).cpu()
    w = want.detach().contiguous().view(torch.uint8).cpu()
    ctx.digests.append((name, hashlib.sha256(g.numpy().tobytes()).hexdigest()))
    bad = g != w
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        chk.expect(False, f"{name}: {int(bad.sum())} bytes differ; first at byte {i}")
    else:
        chk.expect(True, "")


def sum_and_check(
    ctx: Ctx, chk: Checker, comm, name: str, x, inputs: list, choice=None, **call
) -> None:
    """``comm.all_reduce(x, **call)`` of this rank's input in ``x``, checked against
    the sum of ``inputs`` (``check_allreduce``); ``choice``: the (algorithm, blocks,
    threads) the call must have run."""
    comm.all_reduce(x, **call)
    torch.cuda.synchronize()
    if choice is not None:
        chk.expect(comm.last_choice == choice, f"{name}: ran {comm.last_choice}")
    check_allreduce(ctx, chk, name, x, inputs, "sum")


def compare_digests(ctx: Ctx, chk: Checker) -> None:
    """Every rank's allreduce outputs must be identical; allgather outputs too."""
    mine = ctx.digests
    ctx.digests = []
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, mine, group=ctx.gloo)
    for i, (name, d) in enumerate(mine):
        others = {r: e[i][1] for r, e in enumerate(everyone) if len(e) > i and e[i][0] == name}
        differ = [r for r, v in others.items() if v != d]
        chk.expect(not differ, f"{name}: output bytes differ from ranks {differ}")


# ----------------------------------------------------------------------------
# Per-algorithm allreduce scenarios
# ----------------------------------------------------------------------------


def algorithm_capacity(ctx: Ctx, algorithm: str) -> int:
    lim = ctx.comm.limits()
    return {
        "oneshot_ll": lim["oneshot_max_bytes"],
        "twoshot_ll": lim["twoshot_max_bytes"],
        "rsag": lim["max_bytes"],
        "rsag_zc": lim["max_bytes"],
        "rsag_push": lim["max_bytes"],
    }[algorithm]


def sizes_for(ctx: Ctx, dtype, cap: int) -> list:
    """Element counts: the odd list and every power of two of bytes up to ``cap``."""
    es = elem_size(dtype)
    out = [n for n in ODD_ELEMS if n * es <= cap]
    k = max(es, 4)
    while k <= cap:
        out.append(k // es)
        k *= 2
    return sorted(set(out))


def variant_runs(ctx: Ctx, dtype, op: str, nbytes: int) -> bool:
    return ctx.full or nbytes <= ALL_VARIANTS_MAX_BYTES or (dtype, op) in LARGE_VARIANTS


def accums(dtype, op):
    if dtype in FP8 and op == "sum":
        return (torch.float32, torch.float16)
    return (None,)


def run_algorithm_scenario(ctx: Ctx, algorithm: str) -> None:
    chk = Checker()
    comm = ctx.comm
    cap = algorithm_capacity(ctx, algorithm)
    zc = algorithm == "rsag_zc"
    push = algorithm == "rsag_push"
    reg_in = reg_out = None
    if zc or push:
        reg_in = torch.empty(ctx.max_bytes + 16, dtype=torch.uint8, device=ctx.device)
        reg_out = torch.empty_like(reg_in)
        comm.register(reg_in)
        comm.register(reg_out)
    try:
        for dtype in DTYPES:
            es = elem_size(dtype)
            for op in OPS:
                for accum in accums(dtype, op):
                    for n in sizes_for(ctx, dtype, cap):
                        if not variant_runs(ctx, dtype, op, n * es):
                            continue
                        ctx.case += 1
                        # Rotate: in place / out of place (/ unregistered output for zc;
                        # / registered in place, registered output for push), and now
                        # and then a view at an element offset (unaligned).
                        mode = ctx.case % (3 if zc else 4 if push else 2)
                        shift = 1 if (ctx.case % 5 == 0 and (n + 1) * es <= cap) else 0
                        tag = (algorithm, dtype, op, accum, n, shift)
                        inputs = every_input(ctx, tag, n, dtype)
                        name = (
                            f"{algorithm} {dtype} {op} acc={accum} n={n} shift={shift} mode={mode}"
                        )
                        if zc:
                            x = reg_in.view(dtype)[shift : shift + n]
                            x.copy_(inputs[ctx.rank])
                            if mode == 0:
                                out = None
                            elif mode == 1:
                                out = poison(reg_out.view(dtype)[shift : shift + n])
                            else:
                                out = poison(
                                    torch.empty(n + shift, dtype=dtype, device=ctx.device)
                                )[shift:]
                        elif push and mode >= 2:
                            # 2: registered, in place; 3: unregistered input, registered
                            # output (the all-gather stores into the peers' outputs).
                            if mode == 2:
                                x = reg_in.view(dtype)[shift : shift + n]
                                x.copy_(inputs[ctx.rank])
                                out = None
                            else:
                                buf = torch.empty(n + shift, dtype=dtype, device=ctx.device)
                                x = buf[shift:]
                                x.copy_(inputs[ctx.rank])
                                out = poison(reg_out.view(dtype)[shift : shift + n])
                        else:
                            buf = torch.empty(n + shift, dtype=dtype, device=ctx.device)
                            x = buf[shift:]
                            x.copy_(inputs[ctx.rank])
                            out = (
                                None
                                if mode == 0
                                else poison(torch.empty(n + shift, dtype=dtype, device=ctx.device))[
                                    shift:
                                ]
                            )
                        res = comm.all_reduce(
                            x, op=op, algorithm=algorithm, out=out, accum_dtype=accum
                        )
                        used = comm.last_choice[0]
                        torch.cuda.synchronize()
                        chk.expect(used == algorithm, f"{name}: ran {used}")
                        comm.check()
                        check_allreduce(ctx, chk, name, res, inputs, op, accum)
                        del inputs, x, out, res
                    compare_digests(ctx, chk)
        # Explicit geometries: one block, few threads, the most blocks.
        dtype, n = torch.bfloat16, min(cap // 2, 300_001)
        max_blocks = comm.limits()["max_blocks"]
        for blocks, threads in ((1, 32), (3, 96), (max_blocks, 1024), (2, 1024)):
            ctx.case += 1
            tag = (algorithm, "geometry", blocks, threads)
            inputs = every_input(ctx, tag, n, dtype)
            x = reg_in.view(dtype)[:n] if zc else torch.empty(n, dtype=dtype, device=ctx.device)
            x.copy_(inputs[ctx.rank])
            name = f"{algorithm} geometry {blocks}x{threads}"
            geometry = dict(algorithm=algorithm, num_blocks=blocks, num_threads=threads)
            sum_and_check(ctx, chk, comm, name, x, inputs, (algorithm, blocks, threads), **geometry)
        compare_digests(ctx, chk)
    finally:
        if zc or push:
            comm.deregister(reg_in)
            comm.deregister(reg_out)
    chk.done()


def scenario_oneshot_ll(ctx):
    run_algorithm_scenario(ctx, "oneshot_ll")


def scenario_twoshot_ll(ctx):
    run_algorithm_scenario(ctx, "twoshot_ll")


def scenario_rsag(ctx):
    run_algorithm_scenario(ctx, "rsag")


def scenario_rsag_zc(ctx):
    run_algorithm_scenario(ctx, "rsag_zc")


def scenario_rsag_push(ctx):
    run_algorithm_scenario(ctx, "rsag_push")


# ----------------------------------------------------------------------------
# Allgather
# ----------------------------------------------------------------------------


def run_allgather(ctx: Ctx, chk: Checker, algorithm, n: int, dtype, mode: str, reg=None) -> None:
    """One allgather of ``n`` elements per rank; ``mode``: "out" (separate input),
    "in" (input = this rank's chunk of the output), "reg_in" / "reg_inplace"
    (zero copy through ``reg``, a registered uint8 buffer)."""
    ctx.case += 1
    tag = ("allgather", algorithm, n, dtype, mode)
    inputs = every_input(ctx, tag, n, dtype)
    want = torch.cat(inputs)
    total = n * ctx.world
    if mode == "reg_inplace":
        out = reg.view(dtype)[:total]
        poison(out)
        inp = out[ctx.rank * n : (ctx.rank + 1) * n]
        inp.copy_(inputs[ctx.rank])
    elif mode == "reg_in":
        inp = reg.view(dtype)[:n]
        inp.copy_(inputs[ctx.rank])
        out = poison(torch.empty(total, dtype=dtype, device=ctx.device))
    elif mode == "in":
        out = poison(torch.empty(total, dtype=dtype, device=ctx.device))
        inp = out[ctx.rank * n : (ctx.rank + 1) * n]
        inp.copy_(inputs[ctx.rank])
    else:
        inp = inputs[ctx.rank].clone()
        out = poison(torch.empty(total + 1, dtype=dtype, device=ctx.device))[1:]  # unaligned
    ctx.comm.all_gather(out, inp, algorithm=algorithm)
    used = ctx.comm.last_choice[0]
    torch.cuda.synchronize()
    ctx.comm.check()
    name = f"{algorithm or 'auto'} {dtype} n={n} {mode}"
    if algorithm is not None:
        chk.expect(used == algorithm, f"{name}: ran {used}")
    check_equal(ctx, chk, name, out, want)


def allgather_sizes(ctx: Ctx, dtype, cap_per_rank: int) -> list:
    es = elem_size(dtype)
    out = [n for n in ODD_ELEMS if n * es <= cap_per_rank]
    k = es
    while k <= cap_per_rank:
        out.append(k // es)
        k *= 4
    return sorted(set(out))


def scenario_allgather_ll(ctx: Ctx) -> None:
    chk = Checker()
    cap = ctx.comm.limits()["allgather_ll_max_bytes"]
    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.float8_e5m2, torch.float64):
        for n in allgather_sizes(ctx, dtype, cap):
            for mode in ("out", "in"):
                run_allgather(ctx, chk, "ag_ll", n, dtype, mode)
        compare_digests(ctx, chk)
    chk.done()


def scenario_allgather_mesh(ctx: Ctx) -> None:
    chk = Checker()
    cap = ctx.max_bytes // ctx.world
    reg = torch.empty(ctx.max_bytes, dtype=torch.uint8, device=ctx.device)
    ctx.comm.register(reg)
    try:
        for dtype in (
            torch.bfloat16,
            torch.float32,
            torch.int32,
            torch.float8_e4m3fn,
            torch.float64,
        ):
            for n in allgather_sizes(ctx, dtype, cap):
                for mode in ("out", "in", "reg_in", "reg_inplace"):
                    run_allgather(ctx, chk, "ag_mesh", n, dtype, mode, reg)
            compare_digests(ctx, chk)
    finally:
        ctx.comm.deregister(reg)
    chk.done()


# ----------------------------------------------------------------------------
# Selector, fp8 accuracy, graphs, back-to-back
# ----------------------------------------------------------------------------


def scenario_selector(ctx: Ctx) -> None:
    """algorithm=None: the call runs what ``select`` says, for sizes across every
    crossover, registered or not, and the results are right."""
    chk = Checker()
    comm = ctx.comm
    # The reference of every scenario regenerates every rank's input from the
    # shared seed; check once that this is what the ranks really hold (gathered
    # through NCCL).
    n = 100_003
    mine = make_input(ctx, ("gathered",), ctx.rank, n, torch.bfloat16)
    gathered = torch.cat(worker_driver.all_gather_tensor(mine, ctx.group))
    regenerated = torch.cat(every_input(ctx, ("gathered",), n, torch.bfloat16))
    chk.expect(
        torch.equal(gathered, regenerated), "regenerated inputs differ from the gathered ones"
    )
    reg = torch.empty(min(ctx.max_bytes, 64 * MIB), dtype=torch.uint8, device=ctx.device)
    comm.register(reg)
    seen = set()
    try:
        for registered in (False, True):
            for nbytes in (
                2,
                1000,
                64 * KIB,
                200 * KIB,
                600 * KIB,
                1 * MIB + 2,
                3 * MIB,
                reg.numel(),
            ):
                if nbytes > reg.numel():
                    continue
                n = nbytes // 2
                ctx.case += 1
                inputs = every_input(ctx, ("sel", nbytes, registered), n, torch.bfloat16)
                if registered:
                    x = reg.view(torch.bfloat16)[:n]
                else:
                    x = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
                x.copy_(inputs[ctx.rank])
                expected = comm.select(n * 2, registered=registered)
                comm.all_reduce(x)
                torch.cuda.synchronize()
                chk.expect(
                    comm.last_choice == expected,
                    f"{nbytes} B registered={registered}: ran {comm.last_choice}, "
                    f"select said {expected}",
                )
                seen.add(comm.last_choice[0])
                check_allreduce(ctx, chk, f"auto {nbytes} B reg={registered}", x, inputs, "sum")
            for nbytes in (64, 16 * KIB, 1 * MIB):
                n = nbytes // 4
                if n * ctx.world * 4 > reg.numel():
                    continue
                expected = comm.select(nbytes, collective="allgather", registered=registered)
                out = (
                    reg.view(torch.float32)[: n * ctx.world]
                    if registered
                    else torch.empty(n * ctx.world, device=ctx.device)
                )
                poison(out)
                inp = out[ctx.rank * n : (ctx.rank + 1) * n]
                inputs = every_input(ctx, ("selag", nbytes, registered), n, torch.float32)
                inp.copy_(inputs[ctx.rank])
                comm.all_gather(out, inp)
                torch.cuda.synchronize()
                chk.expect(
                    comm.last_choice == expected,
                    f"allgather {nbytes}: {comm.last_choice} vs {expected}",
                )
                seen.add(comm.last_choice[0])
                check_equal(
                    ctx, chk, f"auto allgather {nbytes} reg={registered}", out, torch.cat(inputs)
                )
        compare_digests(ctx, chk)
    finally:
        comm.deregister(reg)
    # rsag_zc and rsag run only when pinned or tuned.
    want = {"oneshot_ll", "twoshot_ll", "rsag_push", "ag_ll", "ag_mesh"}
    if reg.numel() > 2 * MIB:
        chk.expect(
            want <= seen, f"the selector used {sorted(seen)}, expected all of {sorted(want)}"
        )
    chk.done()


def scenario_fp8_accuracy(ctx: Ctx) -> None:
    """fp8 sums: fp32 accumulation is the correctly rounded sum and at least as
    accurate as fp16 accumulation; saturation to the largest finite value."""
    chk = Checker()
    comm = ctx.comm
    n = 100_003
    for dtype in FP8:
        for algorithm in ("oneshot_ll", "twoshot_ll", "rsag", "rsag_push"):
            if n > algorithm_capacity(ctx, algorithm):
                continue
            tag = ("fp8acc", dtype, algorithm)
            inputs = every_input(ctx, tag, n, dtype)
            xs = torch.stack([x.cpu().double() for x in inputs])
            ref, abs_sum = xs.sum(0), xs.abs().sum(0)
            errs = {}
            for accum in (torch.float32, torch.float16):
                out = poison(torch.empty(n, dtype=dtype, device=ctx.device))
                comm.all_reduce(inputs[ctx.rank], algorithm=algorithm, out=out, accum_dtype=accum)
                torch.cuda.synchronize()
                errs[accum] = (out.cpu().double() - ref).abs()
            half_ulp = fp8_ulp(ref, dtype) / 2
            e32, e16 = errs[torch.float32], errs[torch.float16]
            chk.expect(
                bool((e32 <= half_ulp).all()),
                f"{dtype} {algorithm}: fp32 accumulation not correctly rounded (max err "
                f"{float((e32 - half_ulp).max()):.3g} over half an ulp)",
            )
            chk.expect(
                float(e32.mean()) <= float(e16.mean()) + 1e-12,
                f"{dtype} {algorithm}: mean error fp32-acc {float(e32.mean()):.4g} > "
                f"fp16-acc {float(e16.mean()):.4g}",
            )
            bound16 = 2 * half_ulp + 2 * ctx.world * 2.0**-11 * abs_sum
            chk.expect(
                bool((e16 <= bound16).all()),
                f"{dtype} {algorithm}: fp16 accumulation error beyond its bound",
            )
        # Saturation: every rank contributes 0.75 x the largest finite value.
        limit = FP8_FORMAT[dtype][2]
        for algorithm in ("oneshot_ll", "rsag"):
            xf = torch.full((1001,), 0.75 * limit, device=ctx.device)
            xf[1::2] *= -1
            x = xf.to(dtype)
            comm.all_reduce(x, algorithm=algorithm)
            torch.cuda.synchronize()
            want = limit if ctx.world > 1 else float(torch.tensor(0.75 * limit).to(dtype).float())
            got = x.float().cpu()
            chk.expect(
                float(got[0]) == want and float(got[1]) == -want,
                f"{dtype} {algorithm} saturation: got {got[:2].tolist()}, want +-{want}",
            )
    chk.done()


def scenario_cuda_graph(ctx: Ctx) -> None:
    """Every algorithm captured into one CUDA graph (selector and pins), replayed
    with fresh inputs copied into the static buffers before each replay."""
    chk = Checker()
    comm = ctx.comm
    R = ctx.world
    dt = torch.bfloat16
    reg = torch.empty(8 * MIB, dtype=torch.uint8, device=ctx.device)
    comm.register(reg)
    cases = []  # (name, kind, algorithm, n, static input, static output)
    for algorithm, nbytes in (
        ("oneshot_ll", 2 * KIB + 6),
        ("twoshot_ll", 256 * KIB),
        ("rsag", 3 * MIB + 2),
        ("rsag_zc", 2 * MIB),
        ("rsag_push", 3 * MIB + 2),
        (None, 1 * KIB),
        (None, 4 * MIB),
    ):
        n = nbytes // 2
        if nbytes > ctx.max_bytes:
            continue
        if algorithm == "rsag_zc":
            x = reg.view(dt)[:n]
        else:
            x = torch.empty(n, dtype=dt, device=ctx.device)
        out = (
            None
            if algorithm in ("twoshot_ll", None)
            else torch.empty(n, dtype=dt, device=ctx.device)
        )
        cases.append((f"graph {algorithm or 'auto'} {nbytes} B", "ar", algorithm, n, x, out))
    for algorithm, n in (("ag_ll", 1001), ("ag_mesh", 300_000)):
        if n * R * 4 > ctx.max_bytes:
            continue
        inp = torch.empty(n, dtype=torch.float32, device=ctx.device)
        out = torch.empty(n * R, dtype=torch.float32, device=ctx.device)
        cases.append((f"graph {algorithm} n={n}", "ag", algorithm, n, inp, out))

    def body():
        for _, kind, algorithm, _, x, out in cases:
            if kind == "ar":
                comm.all_reduce(x, algorithm=algorithm, out=out)
            else:
                comm.all_gather(out, x, algorithm=algorithm)

    try:
        # Warm up outside the graph once (on a side stream, as torch asks).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for replay in range(25):
            ctx.case += 1
            inputs = {}
            for name, _kind, _, n, x, out in cases:
                dtype = x.dtype
                inputs[name] = every_input(ctx, ("graph", name, replay), n, dtype)
                x.copy_(inputs[name][ctx.rank])
                if out is not None:
                    poison(out)
            graph.replay()
            torch.cuda.synchronize()
            comm.check()
            if replay % 6 == 0 or replay == 24:
                for name, kind, _, _n, x, out in cases:
                    got = x if out is None else out
                    if kind == "ar":
                        check_allreduce(
                            ctx, chk, f"{name} replay {replay}", got, inputs[name], "sum"
                        )
                    else:
                        check_equal(
                            ctx, chk, f"{name} replay {replay}", out, torch.cat(inputs[name])
                        )
        del graph
        compare_digests(ctx, chk)
    finally:
        torch.cuda.synchronize()
        comm.deregister(reg)
    chk.done()


#: rsag blocks of rank 0 wait this long before copying out (reuse_race).
REUSE_DELAY_US = 3000


def scenario_reuse_race(ctx: Ctx) -> None:
    """Scratch reuse across back-to-back calls while a rank lags: rank 0's rsag
    blocks wait 3 ms before copying out, so its peers run into the next call
    meanwhile and store into data regions before their first barrier (rsag_push
    into the peers', rsag and ag_mesh copy-in into their own). Pairs, no sync
    between: rsag_zc or rsag then rsag_push; rsag_push (unregistered output) then
    ag_mesh and rsag; rsag_push twice (its owners store results into the peers'
    result regions while rank 0 still copies out the previous call's). Both
    outputs of every pair are checked: the results, which copy-out reads after
    the last barrier, live in the result region. Then the control: with the
    results in the data region (every rank; the layout before the result
    region), rsag_zc's results must come out wrong when rsag_push follows, else
    this test could not see the race. Only the first call of the control counts:
    rsag_push's own results are wrong there in any case (its owners' stores land
    on the slots its peers push into)."""
    chk = Checker()
    comm = ctx.comm
    native = comm._get()
    R = ctx.world
    if R < 2:
        chk.done()
        return
    dt = torch.bfloat16
    n1 = min(2 * MIB, ctx.max_bytes) // 2
    n2 = min(3 * MIB + 2, ctx.max_bytes) // 2
    reg = torch.empty(n1 * 2, dtype=torch.uint8, device=ctx.device)
    comm.register(reg)
    x_reg = reg.view(dt)
    pairs = (
        ("rsag_zc", "rsag_push"),
        ("rsag", "rsag_push"),
        ("rsag_push", "ag_mesh"),
        ("rsag_push", "rsag"),
        ("rsag_push", "rsag_push"),
    )

    def run_pair(
        first: str,
        second: str,
        label: str,
        iters: int,
        record: Checker,
        record_second: Checker | None = None,
    ) -> None:
        second_record = record if record_second is None else record_second
        for it in range(iters):
            ctx.case += 1
            in1 = every_input(ctx, ("reuse", label, 1, it), n1, dt)
            x1 = x_reg if first == "rsag_zc" else torch.empty(n1, dtype=dt, device=ctx.device)
            x1.copy_(in1[ctx.rank])
            out1 = poison(torch.empty(n1, dtype=dt, device=ctx.device))
            if second == "ag_mesh":
                m = n2 // R
                in2 = every_input(ctx, ("reuse", label, 2, it), m, dt)
                x2 = in2[ctx.rank].clone()
                out2 = poison(torch.empty(m * R, dtype=dt, device=ctx.device))
            else:
                in2 = every_input(ctx, ("reuse", label, 2, it), n2, dt)
                x2 = in2[ctx.rank].clone()
                out2 = poison(torch.empty(n2, dtype=dt, device=ctx.device))
            torch.cuda.synchronize()
            comm.all_reduce(x1, algorithm=first, out=out1)
            if second == "ag_mesh":
                comm.all_gather(out2, x2, algorithm="ag_mesh")
            else:
                comm.all_reduce(x2, algorithm=second, out=out2)
            torch.cuda.synchronize()
            comm.check()
            check_allreduce(ctx, record, f"{label} {first} it {it}", out1, in1, "sum")
            if second == "ag_mesh":
                check_equal(ctx, second_record, f"{label} ag_mesh it {it}", out2, torch.cat(in2))
            else:
                check_allreduce(ctx, second_record, f"{label} {second} it {it}", out2, in2, "sum")

    try:
        native._set_test_hooks(copy_out_delay_us=REUSE_DELAY_US if ctx.rank == 0 else 0)
        for first, second in pairs:
            run_pair(first, second, f"{first}+{second}", 6, chk)
        compare_digests(ctx, chk)
        # The control: every rank keeps its results in the data region.
        control = Checker()
        native._set_test_hooks(
            copy_out_delay_us=REUSE_DELAY_US if ctx.rank == 0 else 0,
            results_in_data_region=True,
        )
        run_pair("rsag_zc", "rsag_push", "control", 6, control, Checker())
        ctx.digests = []
        caught = torch.tensor([len(control.errors)], dtype=torch.int64)
        dist.all_reduce(caught, group=ctx.gloo)
        chk.expect(
            int(caught) > 0,
            "control: results in the data region gave right results under a 3 ms lag, "
            "so this scenario cannot see the race it guards against",
        )
    finally:
        native._set_test_hooks()
        torch.cuda.synchronize()
        comm.deregister(reg)
    chk.done()


def b2b_block(ctx: Ctx, block: int, p: int, rows: int, n: int) -> torch.Tensor:
    """Rank p's inputs of block ``block``: [rows, n] int32, distinct per row."""
    i = torch.arange(rows, device=ctx.device, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(n, device=ctx.device, dtype=torch.int64).unsqueeze(0)
    v = (j * 7 + (i + block * rows) * 31 + p * 1013 + ctx.seed % 9973) % 2003 - 1001
    return v.to(torch.int32)


def scenario_back_to_back(ctx: Ctx) -> None:
    """10,000 small allreduces back to back (LL algorithms mixed with rsag and
    rsag_push at the same size), every result checked; 400 rsag_push calls back to
    back into a registered output; then 100 replays of a graph of 100 one-shot
    allreduces. A stale LL flag, a reused half or a scratch slot overwritten while
    a peer still reads it would mix rows."""
    chk = Checker()
    comm = ctx.comm
    rows = 500
    sizes = (256, 1, 4097, 3, 256, 1023, 17, 256, 64, 2048) * 2
    algs = ("oneshot_ll", "rsag_push", "rsag_push", "twoshot_ll", "oneshot_ll", "rsag")
    for block, n in enumerate(sizes):
        x = b2b_block(ctx, block, ctx.rank, rows, n)
        out = torch.empty_like(x)
        poison(out)
        for r in range(rows):
            comm.all_reduce(x[r], out=out[r], algorithm=algs[r % len(algs)])
        torch.cuda.synchronize()
        comm.check()
        want = sum(
            b2b_block(ctx, block, p, rows, n).cpu().to(torch.int64) for p in range(ctx.world)
        )
        got = out.cpu().to(torch.int64)
        bad = (got != want).any(1)
        chk.expect(
            not bool(bad.any()),
            f"block {block} (n={n}): rows {bad.nonzero().flatten()[:8].tolist()} wrong "
            f"(of {int(bad.sum())}); last row ok: {bool((got[-1] == want[-1]).all())}",
        )
    # rsag_push with a registered output: the all-gather stores into the peers'
    # outputs, the next call's reduce-scatter into their scratch.
    rows, n = 400, 4099
    x = b2b_block(ctx, 500, ctx.rank, rows, n)
    out = torch.empty_like(x)
    comm.register(out)
    try:
        poison(out)
        for r in range(rows):
            comm.all_reduce(x[r], out=out[r], algorithm="rsag_push")
        torch.cuda.synchronize()
        comm.check()
        want = sum(b2b_block(ctx, 500, p, rows, n).cpu().to(torch.int64) for p in range(ctx.world))
        bad = (out.cpu().to(torch.int64) != want).any(1)
        chk.expect(
            not bool(bad.any()),
            f"rsag_push registered output: rows {bad.nonzero().flatten()[:8].tolist()} wrong "
            f"(of {int(bad.sum())})",
        )
    finally:
        comm.deregister(out)
    # Graph replays: the device counter advances per replay.
    rows, n = 100, 512
    x = b2b_block(ctx, 1000, ctx.rank, rows, n)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(x[0], out=out[0], algorithm="oneshot_ll")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(rows):
            comm.all_reduce(x[r], out=out[r], algorithm="oneshot_ll")
    for replay in range(100):
        x.copy_(b2b_block(ctx, 2000 + replay, ctx.rank, rows, n))
        poison(out)
        graph.replay()
        if replay % 10 == 9:
            torch.cuda.synchronize()
            want = sum(
                b2b_block(ctx, 2000 + replay, p, rows, n).cpu().to(torch.int64)
                for p in range(ctx.world)
            )
            bad = (out.cpu().to(torch.int64) != want).any(1)
            chk.expect(
                not bool(bad.any()),
                f"graph replay {replay}: rows {bad.nonzero().flatten()[:8].tolist()} wrong",
            )
    torch.cuda.synchronize()
    comm.check()
    del graph
    chk.done()


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------


def expect_raises(chk: Checker, what: str, exc, fn) -> None:
    try:
        fn()
    except exc:
        chk.expect(True, "")
        return
    except Exception as e:  # noqa: BLE001 - reported as the wrong exception
        chk.expect(False, f"{what}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        return
    chk.expect(False, f"{what}: did not raise {exc.__name__}")


def scenario_invalid_args(ctx: Ctx) -> None:
    """Bad arguments raise before anything is launched, and the communicator still
    works afterwards (an LL counter advanced by a launch on some ranks only would
    hang the next call)."""
    chk = Checker()
    dev = ctx.device
    small = ctx.new_comm(max_bytes=64 * KIB, oneshot_max_bytes=4 * KIB, twoshot_max_bytes=16 * KIB)
    try:
        t = torch.ones(1024, dtype=torch.bfloat16, device=dev)
        buf = torch.ones(2048, dtype=torch.bfloat16, device=dev)
        gat = torch.zeros(4 * ctx.world + 1, device=dev)
        cases = [
            (
                "float64",
                TypeError,
                lambda: small.all_reduce(torch.ones(4, dtype=torch.float64, device=dev)),
            ),
            (
                "int64",
                TypeError,
                lambda: small.all_reduce(torch.ones(4, dtype=torch.int64, device=dev)),
            ),
            ("not a tensor", TypeError, lambda: small.all_reduce([1.0])),
            ("op prod", ValueError, lambda: small.all_reduce(t, op="prod")),
            (
                "non-contiguous",
                ValueError,
                lambda: small.all_reduce(torch.ones(64, 2, device=dev).t()),
            ),
            ("cpu tensor", ValueError, lambda: small.all_reduce(torch.ones(4))),
            (
                "> max_bytes",
                ValueError,
                lambda: small.all_reduce(
                    torch.ones(32 * KIB + 1, dtype=torch.bfloat16, device=dev)
                ),
            ),
            ("unknown algorithm", ValueError, lambda: small.all_reduce(t, algorithm="ring")),
            ("allgather algorithm", ValueError, lambda: small.all_reduce(t, algorithm="ag_ll")),
            (
                "oneshot over its limit",
                ValueError,
                lambda: small.all_reduce(
                    torch.ones(4 * KIB, dtype=torch.bfloat16, device=dev), algorithm="oneshot_ll"
                ),
            ),
            ("rsag_zc unregistered", ValueError, lambda: small.all_reduce(t, algorithm="rsag_zc")),
            ("too many blocks", ValueError, lambda: small.all_reduce(t, num_blocks=100_000)),
            ("odd threads", ValueError, lambda: small.all_reduce(t, num_threads=100)),
            (
                "bf16 with fp16 accumulation",
                ValueError,
                lambda: small.all_reduce(t, accum_dtype=torch.float16),
            ),
            (
                "out dtype",
                TypeError,
                lambda: small.all_reduce(t, out=torch.empty(1024, device=dev)),
            ),
            (
                "out size",
                ValueError,
                lambda: small.all_reduce(
                    t, out=torch.empty(1023, dtype=torch.bfloat16, device=dev)
                ),
            ),
            ("out overlaps", ValueError, lambda: small.all_reduce(buf[:512], out=buf[1:513])),
            (
                "allgather sizes",
                ValueError,
                lambda: small.all_gather(torch.empty(10, device=dev), torch.empty(3, device=dev)),
            ),
            (
                "allgather overlap",
                ValueError,
                lambda: small.all_gather(gat[: 4 * ctx.world], gat[1:5]),
            ),
            (
                "allgather > max_bytes",
                ValueError,
                lambda: small.all_gather(
                    torch.empty(16 * KIB * ctx.world + ctx.world, device=dev),
                    torch.empty(16 * KIB + 1, device=dev),
                ),
            ),
            ("register cpu", ValueError, lambda: small.register(torch.ones(4))),
        ]
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", (ctx.device.index + 1) % torch.cuda.device_count())
            cases.append(
                ("other GPU", ValueError, lambda: small.all_reduce(torch.ones(4, device=other)))
            )
        for what, exc, fn in cases:
            expect_raises(chk, what, exc, fn)
        torch.cuda.synchronize()
        # The communicator still works, for every LL algorithm and rsag.
        for algorithm in ("oneshot_ll", "twoshot_ll", "rsag", None):
            inputs = every_input(ctx, ("after-invalid", algorithm), 1000, torch.float32)
            x = inputs[ctx.rank].clone()
            name = f"after invalid calls: {algorithm}"
            sum_and_check(ctx, chk, small, name, x, inputs, algorithm=algorithm)
            small.check()
        compare_digests(ctx, chk)
    finally:
        small.destroy()
    chk.done()


def scenario_timeout(ctx: Ctx) -> None:
    """Rank 1 skips a call: the others' kernels give up after device_timeout_s
    (2 s of GPU time, not before) and the next call / check() raises
    moelink.TimeoutError naming the rank and what it waited for (an LL packet, then a
    semaphore signal, from rank 1). A non-positive bound is refused."""
    chk = Checker()
    if ctx.world < 2:
        chk.done()
        return
    bound_s = 2.0
    for algorithm, what in (("oneshot_ll", "LL packet"), ("rsag", "semaphore")):
        comm = ctx.new_comm(max_bytes=4 * MIB, device_timeout_s=bound_s)
        try:
            chk.expect(
                comm.device_timeout_s == bound_s,
                f"device_timeout_s is {comm.device_timeout_s}, want {bound_s}",
            )
            expect_raises(
                chk,
                "device_timeout_s = 0",
                ValueError,
                lambda c=comm: setattr(c, "device_timeout_s", 0),
            )
            x = torch.ones(4096, dtype=torch.float32, device=ctx.device)
            comm.all_reduce(x, algorithm=algorithm)  # a good call first
            torch.cuda.synchronize()
            dist.barrier(group=ctx.gloo)
            start = time.monotonic()
            if ctx.rank != 1:
                comm.all_reduce(x, algorithm=algorithm)
            torch.cuda.synchronize()
            waited = time.monotonic() - start
            if ctx.rank != 1:
                # Time-slicing (ranks sharing a GPU) must not end the wait early.
                chk.expect(
                    waited >= bound_s,
                    f"{algorithm}: gave up after {waited:.3f} s, before the {bound_s} s bound",
                )
            if ctx.rank == 1:
                comm.check()
                chk.expect(True, "")
            else:
                try:
                    comm.check()
                    chk.expect(False, f"{algorithm}: no timeout reported")
                except moelink.TimeoutError as e:
                    msg = str(e)
                    chk.expect(
                        f"rank {ctx.rank}" in msg and what in msg and "from rank 1" in msg,
                        f"{algorithm}: timeout message {msg!r} lacks rank {ctx.rank} / {what} "
                        "/ rank 1",
                    )
                expect_raises(
                    chk,
                    f"{algorithm}: next call",
                    moelink.TimeoutError,
                    lambda c=comm, t=x: c.all_reduce(t),
                )
        finally:
            dist.barrier(group=ctx.gloo)
            comm.destroy()
    chk.done()


def scenario_tuner(ctx: Ctx) -> None:
    """tune() on a small range writes the file (rank 0), installs the same table
    on every rank, and a new communicator loads it and selects from it."""
    chk = Checker()
    tmp = [tempfile.mkdtemp(prefix="moelink-tune-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(tmp, src=0, group=ctx.gloo)
    path = Path(tmp[0]) / "tune.json"
    comm = ctx.new_comm(max_bytes=8 * MIB, tune_file=path)
    try:
        doc = comm.tune(min_bytes=1 * KIB, max_bytes=1 * MIB, iters=4, warmup=2, path=path)
        table = comm.tuned()
        everyone = [None] * ctx.world
        dist.all_gather_object(everyone, table, group=ctx.gloo)
        chk.expect(all(t == table for t in everyone), "ranks installed different tables")
        sizes = {e["log2_bytes"] for e in doc["entries"] if e["collective"] == "allreduce"}
        chk.expect(sizes == set(range(10, 21)), f"tuned allreduce sizes {sorted(sizes)}")
        if ctx.rank == 0:
            chk.expect(path.is_file(), f"{path} not written")
    finally:
        comm.destroy()
    dist.barrier(group=ctx.gloo)
    comm = ctx.new_comm(max_bytes=8 * MIB, tune_file=path)
    try:
        chk.expect(comm.tuned() == table, "the reloaded table differs")
        for entry in table:
            coll, graph, registered, log2, alg, blocks, threads = entry
            if coll != "allreduce" or graph or registered:
                continue
            nbytes = 1 << log2
            chk.expect(
                comm.select(nbytes, capturing=False) == (alg, blocks, threads), f"select({nbytes})"
            )
            n = nbytes // 2
            inputs = every_input(ctx, ("tuned", log2), n, torch.bfloat16)
            x = inputs[ctx.rank].clone()
            sum_and_check(ctx, chk, comm, f"tuned {nbytes} B", x, inputs, (alg, blocks, threads))
        compare_digests(ctx, chk)
    finally:
        comm.destroy()
    chk.done()


def scenario_create_destroy(ctx: Ctx) -> None:
    chk = Checker()
    free_before = worker_driver.quiesced_free_memory(ctx.device, ctx.gloo)
    for i in range(20):
        comm = ctx.new_comm(max_bytes=16 * MIB)
        x = torch.full((1000,), float(ctx.rank + i), device=ctx.device)
        comm.all_reduce(x, algorithm=("oneshot_ll", "rsag")[i % 2])
        torch.cuda.synchronize()
        want = sum(p + i for p in range(ctx.world))
        chk.expect(bool((x == want).all()), f"cycle {i}: got {x[0].item()}, want {want}")
        comm.destroy()
    # A rank's scratch is freed once every peer has unmapped it too: the quiesced
    # reading waits for the peers' destroy() before measuring.
    lost = free_before - worker_driver.quiesced_free_memory(ctx.device, ctx.gloo)
    chk.expect(
        abs(lost) <= 64 * MIB, f"free GPU memory changed by {lost / MIB:.1f} MiB over 20 cycles"
    )
    chk.done()


SCENARIOS = worker_driver.scenario_table(globals(), SCENARIO_NAMES)


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


def run_all(wg: worker_driver.WorkerGroup) -> int:
    """Runs the selected scenarios on this rank, each agreeing on its verdict
    with the other ranks; the shared communicator is replaced after a scenario
    that failed anywhere. Returns the exit status."""
    max_bytes = int(float(os.environ.get(MAX_MIB_ENV, "256")) * MIB)
    full = os.environ.get(FULL_ENV, "0") == "1"
    names, seed = worker_driver.start_scenarios(
        wg,
        SCENARIOS_ENV,
        SCENARIO_NAMES,
        SEED_ENV,
        note=f"; max {max_bytes / MIB:g} MiB; full={full}",
    )
    random.seed(seed)
    ctx = Ctx(wg.rank, wg.world, wg.device, wg.group, wg.gloo, seed, max_bytes, full)
    ctx.comm = ctx.new_comm()
    status = worker_driver.run_scenarios(
        wg,
        names,
        lambda name: run_one(ctx, name),
        timeout_s=SCENARIO_TIMEOUT_S,
        on_failure=lambda: replace_comm(ctx),
    )
    ctx.comm.destroy()
    return status


def run_one(ctx: Ctx, name: str) -> None:
    ctx.digests = []
    SCENARIOS[name](ctx)


def replace_comm(ctx: Ctx) -> None:
    worker_driver.destroy_after_failure(ctx.comm, "communicator", ctx.rank)
    ctx.comm = ctx.new_comm()


if __name__ == "__main__":
    sys.exit(worker_driver.worker_main(CONTROL_TIMEOUT_S, run_all))
