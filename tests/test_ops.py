"""moelink's torch ops (``torch.ops.moelink.*``, python/moelink/_ops.py), their
handle registry (``moelink.ops`` / ``moelink._registry``) and
``AllReduce.from_process_group`` on the CPU.

The real implementations call the registered object's public methods, so CPU
stand-ins with the same methods run them: ``StandInAllReduce`` simulates ``world``
ranks whose rank p holds this rank's tensor + p; ``StandInLowLatency`` runs the
CPU reference (``moelink.reference.ll_dispatch`` / ``ll_combine``) with simulated
peers whose experts return what they received (identity experts). The GPU runs
of the same ops are in tests/multi_gpu/ops_worker.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from pathlib import Path

import moelink
import moelink.allreduce as ar
import moelink.ops as mops
import pytest
import torch
import torch.distributed as dist
from moelink import reference
from moelink._streams import EventOverlap
from torch._subclasses.fake_tensor import FakeTensorMode

OPS = torch.ops.moelink
OP_NAMES = (
    "all_reduce", "all_reduce_", "all_reduce_or_nccl_", "all_gather", "ll_dispatch",
    "ll_combine",
)  # fmt: skip
AR_DTYPES = (
    torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn,
    torch.float8_e5m2,
)  # fmt: skip


# ----- stand-ins -----------------------------------------------------------------------


class StandInAllReduce:
    """``moelink.AllReduce``'s methods on the CPU: ``world`` simulated ranks, rank
    p's input being this rank's + p (reduced in float64, stored in the dtype).
    Refuses what the real one refuses that the ops must handle (non-contiguous
    tensors, a wrong out size), and records every call."""

    def __init__(self, world: int = 3, max_bytes: int = 1 << 20, group=None) -> None:
        self.world_size = world
        self.rank = 0
        self.device = torch.device("cpu")
        self.max_bytes = max_bytes
        self.group = group
        self.calls: list = []

    @staticmethod
    def _contiguous(name, t):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    def all_reduce(self, tensor, op="sum", algorithm=None, out=None, accum_dtype=None,
                   num_blocks=None, num_threads=None):  # fmt: skip
        self._contiguous("tensor", tensor)
        dst = tensor if out is None else out
        self._contiguous("out", dst)
        if dst.numel() != tensor.numel() or dst.dtype != tensor.dtype:
            raise ValueError("out does not match tensor")
        self.calls.append(
            ("all_reduce", op, algorithm, accum_dtype, out is None, tuple(tensor.shape))
        )
        xs = torch.stack([tensor.double() + p for p in range(self.world_size)])
        red = {"sum": xs.sum(0), "min": xs.min(0).values, "max": xs.max(0).values}[op]
        dst.copy_(red.to(dst.dtype))
        return dst

    def all_gather(self, out, inp, algorithm=None, num_blocks=None, num_threads=None):
        self._contiguous("out", out)
        self._contiguous("inp", inp)
        if out.numel() != self.world_size * inp.numel():
            raise ValueError("out must hold world_size * inp.numel() elements")
        self.calls.append(("all_gather", algorithm, tuple(inp.shape)))
        flat = inp.reshape(-1).double()
        out.view(self.world_size, -1).copy_(  # rank 0's bits as they are (-0.0 too)
            torch.stack([flat + p if p else flat for p in range(self.world_size)]).to(out.dtype)
        )
        return out


def ar_expected(x: torch.Tensor, world: int, op: str) -> torch.Tensor:
    xs = torch.stack([x.double() + p for p in range(world)])
    red = {"sum": xs.sum(0), "min": xs.min(0).values, "max": xs.max(0).values}[op]
    return red.to(x.dtype)


class StandInLowLatency:
    """``Buffer``'s low-latency methods on the CPU: rank 0 of ``group_size``
    simulated ranks, through the CPU reference. The peers' tokens are drawn once
    per shape; their experts return the rows they received (bf16 identity)."""

    def __init__(self, group_size: int = 2, seed: int = 7) -> None:
        self.group_size = group_size
        self.rank = 0
        self.seed = seed
        self.calls: list = []
        self._last = None

    def _peers(self, t: int, hidden: int, k: int, e: int):
        g = torch.Generator().manual_seed(self.seed * 1000 + t * 7 + hidden + k + e)
        peers = []
        for _ in range(self.group_size - 1):
            n = max(1, t // 2)
            x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
            idx = torch.rand(n, e, generator=g).topk(k, dim=1).indices.to(torch.int64)
            w = torch.rand(n, k, generator=g)
            peers.append((x, idx, w))
        return peers

    def low_latency_dispatch(
        self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
        cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
        use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
        return_recv_hook=False,
    ):  # fmt: skip
        assert x.is_contiguous() and topk_idx.is_contiguous()
        assert not async_finish and not return_recv_hook
        t, e = num_max_dispatch_tokens_per_rank, num_experts
        self.calls.append(("dispatch", t, e, use_fp8, round_scale, use_ue8m0))
        peers = self._peers(t, x.shape[1], topk_idx.shape[1], e)
        xs = [x] + [p[0] for p in peers]
        idxs = [topk_idx] + [p[1] for p in peers]
        ref = reference.ll_dispatch(xs, idxs, t, e, use_fp8, round_scale, use_ue8m0, rank=0)[0]
        self._last = (xs, idxs, [p[2] for p in peers], t, e)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += ref["recv_count"]
        recv = (ref["recv_x"], ref["scales"]) if use_fp8 else ref["recv_x"]
        handle = (ref["src_info"], ref["layout_range"], t, x.shape[1], e)
        return recv, ref["recv_count"], handle, EventOverlap(None), None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):  # fmt: skip
        assert x.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous()
        assert not async_finish and not return_recv_hook and not zero_copy
        src_info, layout_range, t, hidden, e = handle
        assert x.shape[2] == hidden
        self.calls.append(("combine", t, hidden, e))
        xs, idxs, peer_ws, t0, e0 = self._last
        assert (t0, e0) == (t, e), "combine after a dispatch of another shape"
        # The peers' identity experts: what each peer received (bf16).
        full = reference.ll_dispatch(xs, idxs, t, e, False)
        ys = [x] + [full[p]["recv_x"] for p in range(1, self.group_size)]
        handles = [(src_info, layout_range)] + [
            (full[p]["src_info"], full[p]["layout_range"]) for p in range(1, self.group_size)
        ]
        res = reference.ll_combine(
            ys, [topk_idx] + idxs[1:], [topk_weights] + peer_ws, handles, t, e
        )
        return res[0][0], EventOverlap(None), None


class NoWeakRef:
    __slots__ = ("x",)


def registered(obj):
    """``(obj, its handle)`` for a fixture to yield; unregistered afterwards."""
    h = mops.register(obj)
    yield obj, h
    mops.unregister(obj)


@pytest.fixture
def comm():
    yield from registered(StandInAllReduce(world=3))


@pytest.fixture
def ll():
    yield from registered(StandInLowLatency(group_size=2))


def ll_inputs(n=6, hidden=256, e=8, k=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, e, generator=g).topk(k, dim=1).indices.to(torch.int64)
    idx[1, 0] = -1  # a dropped slot
    w = torch.rand(n, k, generator=g) + 0.1
    return x, idx, w


# ----- the ops exist, with their schemas -------------------------------------------------


def test_import_moelink_registers_the_ops():
    """In a fresh interpreter: nothing under torch.ops.moelink before the import,
    every op after it."""
    code = (
        "import torch\n"
        "names = " + repr(OP_NAMES) + "\n"
        "def has(n):\n"
        "    try:\n"
        "        getattr(torch.ops.moelink, n)\n"
        "        return True\n"
        "    except (AttributeError, RuntimeError):\n"
        "        return False\n"
        "before = [n for n in names if has(n)]\n"
        "import moelink\n"
        "after = [n for n in names if has(n)]\n"
        "print(before, after)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.strip()
    assert out == f"[] {list(OP_NAMES)}", out


def test_schemas():
    assert set(mops.SCHEMAS) == set(OP_NAMES)
    for name in OP_NAMES:
        schema = getattr(OPS, name).default._schema
        assert str(schema) == f"moelink::{name}{mops.SCHEMAS[name]}", name
        args = {a.name: a for a in schema.arguments}
        # The handle is an int: a compiled graph specializes on it (not a SymInt).
        assert str(args["handle"].type) == "int", name
        written = sorted(a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write)
        want = {
            "all_reduce_": ["tensor"],
            "all_reduce_or_nccl_": ["tensor"],
            "ll_dispatch": ["cumulative_local_expert_recv_stats"],
        }.get(name, [])
        assert written == want, (name, written)
    assert len(OPS.ll_dispatch.default._schema.returns) == 5
    assert len(OPS.all_reduce_.default._schema.returns) == 0


# ----- the registry ----------------------------------------------------------------------


def test_registry_handles():
    a, b = StandInAllReduce(), StandInAllReduce()
    ha, hb = mops.register(a), mops.register(b)
    try:
        assert isinstance(ha, int) and not isinstance(ha, bool) and ha >= 1
        assert hb != ha and mops.register(a) == ha  # registering again: the same handle
        assert mops.lookup(ha) is a and mops.lookup(hb) is b
        assert mops.registered()[ha] is a
        assert mops.unregister(a) is True
        assert mops.unregister(a) is False
        with pytest.raises(ValueError, match=f"handle {ha} names no registered"):
            mops.lookup(ha)
        # A new registration never reuses a handle.
        hc = mops.register(a)
        assert hc not in (ha, hb) and hc > max(ha, hb)
        assert mops.unregister(hb) is True  # by handle
        with pytest.raises(ValueError, match=str(hb)):
            mops.lookup(hb)
    finally:
        mops.unregister(a)
        mops.unregister(b)


def test_registry_holds_weak_references():
    c = StandInAllReduce()
    h = mops.register(c)
    del c
    gc.collect()
    assert h not in mops.registered()
    with pytest.raises(ValueError, match=f"handle {h}"):
        mops.lookup(h)
    with pytest.raises(ValueError, match=f"handle {h}"):
        OPS.all_reduce(torch.ones(2), h)


def test_registry_refuses():
    for bad in (None, 3, "comm", (1, 2)):
        with pytest.raises(TypeError):
            mops.register(bad)
    with pytest.raises(TypeError, match="weak"):
        mops.register(NoWeakRef())
    for bad in ("1", 1.0, True, None):
        with pytest.raises(TypeError, match="handle must be an int"):
            mops.lookup(bad)
    assert mops.unregister(StandInAllReduce()) is False


def test_the_handle_picks_the_object(comm, ll):
    """Two communicators of different world sizes: each op goes to its own."""
    c3, h3 = comm
    c5 = StandInAllReduce(world=5)
    h5 = mops.register(c5)
    try:
        x = torch.arange(4, dtype=torch.float32)
        assert torch.equal(OPS.all_reduce(x, h3), ar_expected(x, 3, "sum"))
        assert torch.equal(OPS.all_reduce(x, h5), ar_expected(x, 5, "sum"))
        assert len(c3.calls) == 1 and len(c5.calls) == 1
        assert OPS.all_gather(x, h5, 5).shape == (20,)
    finally:
        mops.unregister(c5)
    # A low-latency Buffer under the handle of an allreduce op: a TypeError that says so.
    with pytest.raises(TypeError, match="StandInLowLatency, which has no all_reduce"):
        OPS.all_reduce(torch.ones(2), ll[1])
    with pytest.raises(TypeError, match="no low_latency_dispatch"):
        x, idx, _ = ll_inputs()
        OPS.ll_dispatch(x, idx, h3, 3, 8, 8, None)


# ----- fake implementations ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", AR_DTYPES)
def test_fake_all_reduce(dtype):
    with FakeTensorMode():
        x = torch.empty(4, 6, dtype=dtype)
        y = OPS.all_reduce(x, 12345)  # the allreduce fakes need no registration
        assert (y.shape, y.dtype, y.stride()) == ((4, 6), dtype, (6, 1))
        y = OPS.all_reduce(x.t(), 12345, "max")  # a strided input: a contiguous output
        assert (y.shape, y.stride()) == ((6, 4), (4, 1))
        assert OPS.all_reduce_(x, 12345, "min") is None
        assert OPS.all_reduce_or_nccl_(x.t(), 12345, "avg") is None


def test_fake_all_reduce_errors():
    with FakeTensorMode():
        with pytest.raises(TypeError, match="float64 is not supported"):
            OPS.all_reduce(torch.empty(4, dtype=torch.float64), 1)
        with pytest.raises(ValueError, match="op must be one of"):
            OPS.all_reduce(torch.empty(4), 1, "avg")
        with pytest.raises(ValueError, match="accum_dtype"):
            OPS.all_reduce(torch.empty(4, dtype=torch.float8_e4m3fn), 1, "sum", None,
                           torch.bfloat16)  # fmt: skip
        with pytest.raises(ValueError, match="contiguous"):
            OPS.all_reduce_(torch.empty(4, 6).t(), 1)
        with pytest.raises(ValueError, match="op must be one of"):
            OPS.all_reduce_or_nccl_(torch.empty(4), 1, "bxor")


def test_fake_all_gather(comm):
    _, h = comm  # world 3
    with FakeTensorMode():
        for shape, want in (((), (3,)), ((5,), (15,)), ((2, 7), (6, 7)), ((0, 4), (0, 4))):
            for dtype in (torch.bfloat16, torch.int64, torch.uint8):
                y = OPS.all_gather(torch.empty(shape, dtype=dtype), h, 3)
                assert (tuple(y.shape), y.dtype, y.is_contiguous()) == (want, dtype, True)
        with pytest.raises(ValueError, match="names no registered"):
            OPS.all_gather(torch.empty(3), 10**9, 3)


def test_group_size_must_match_the_registered_object(comm, ll):
    """The ops whose output shape depends on the rank count take it as an argument,
    and refuse one that is not the registered object's, traced or run."""
    _, hc = comm  # world 3
    _, hl = ll  # group size 2
    x, idx, _ = ll_inputs()
    for mode in (contextlib.nullcontext(), FakeTensorMode()):
        with mode:
            a = torch.empty(4) if isinstance(mode, FakeTensorMode) else torch.ones(4)
            with pytest.raises(ValueError, match="group_size is 4, but the StandInAllReduce"):
                OPS.all_gather(a, hc, 4)
    with pytest.raises(ValueError, match="group_size is 3, but the StandInLowLatency"):
        OPS.ll_dispatch(x, idx, hl, 3, 8, 8, None)
    with FakeTensorMode():
        fx, fidx = torch.empty(x.shape, dtype=x.dtype), torch.empty(idx.shape, dtype=idx.dtype)
        with pytest.raises(ValueError, match="group_size is 1, but"):
            OPS.ll_dispatch(fx, fidx, hl, 1, 8, 8, None)


ROOT = Path(__file__).resolve().parents[1]

_CACHED_COMPILE = """
import sys, torch, moelink.ops as mops
from tests.test_ops import StandInAllReduce
world = int(sys.argv[1])
comm = StandInAllReduce(world=world)  # the registry holds it weakly
h = mops.register(comm)
f = torch.compile(lambda x: torch.ops.moelink.all_gather(x * 2, h, world) + 1,
                  fullgraph=True, backend="inductor")
x = torch.arange(6, dtype=torch.float32)
got = f(x)
want = torch.cat([x * 2 + p for p in range(world)]) + 1
assert torch.equal(got, want), (world, h, got.shape)
print("ok", world, h)
"""


def test_inductor_cache_is_not_shared_across_group_sizes(tmp_path):
    """Two processes with the same handle number and different group sizes, one
    inductor cache directory: the second must not reuse the first's graph (its
    output shape would be the first one's group size)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": path}
    for world in (2, 4):
        p = subprocess.run(
            [sys.executable, "-c", _CACHED_COMPILE, str(world)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.split() == ["ok", str(world), "1"], p.stdout


@pytest.mark.parametrize("use_fp8,ue8m0", [(True, False), (True, True), (False, False)])
def test_fake_ll_dispatch_shapes(use_fp8, ue8m0):
    b = StandInLowLatency(group_size=4)
    h = mops.register(b)
    try:
        t, hidden, e = 16, 7168, 32  # E_local 8, R*T 64, 56 scale groups (14 ue8m0 words)
        with FakeTensorMode():
            x = torch.empty(10, hidden, dtype=torch.bfloat16)
            idx = torch.empty(10, 8, dtype=torch.int64)
            stats = torch.empty(8, dtype=torch.int32)
            recv_x, scales, count, src_info, layout_range = OPS.ll_dispatch(
                x, idx, h, 4, t, e, stats, use_fp8, ue8m0, ue8m0
            )
        assert b.calls == []  # the fake ran, not the object
        assert (recv_x.shape, recv_x.dtype) == (
            (8, 64, hidden), torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
        )  # fmt: skip
        if not use_fp8:
            assert (scales.shape, scales.dtype) == ((8, 64, 0), torch.float32)
        elif ue8m0:
            assert (scales.shape, scales.dtype, scales.stride()) == (
                (8, 64, 14), torch.int32, (14 * 64, 1, 64),
            )  # fmt: skip
        else:
            assert (scales.shape, scales.dtype, scales.stride()) == (
                (8, 64, 56), torch.float32, (56 * 64, 1, 64),
            )  # fmt: skip
        assert (count.shape, count.dtype) == ((8,), torch.int32)
        assert (src_info.shape, src_info.dtype) == ((8, 64), torch.int32)
        assert (layout_range.shape, layout_range.dtype) == ((8, 4), torch.int64)
    finally:
        mops.unregister(b)


def test_fake_ll_combine_shape():
    b = StandInLowLatency(group_size=4)
    h = mops.register(b)
    try:
        with FakeTensorMode():
            y = torch.empty(8, 64, 2048, dtype=torch.bfloat16)
            idx = torch.empty(10, 8, dtype=torch.int64)
            w = torch.empty(10, 8, dtype=torch.float32)
            si = torch.empty(8, 64, dtype=torch.int32)
            lr = torch.empty(8, 4, dtype=torch.int64)
            out = OPS.ll_combine(y, idx, w, si, lr, h, 16, 32)
        assert (out.shape, out.dtype, out.is_contiguous()) == ((10, 2048), torch.bfloat16, True)
        assert b.calls == []
    finally:
        mops.unregister(b)


def test_fake_ll_errors():
    b = StandInLowLatency(group_size=4)
    h = mops.register(b)
    bf, i64, i32, f32 = torch.bfloat16, torch.int64, torch.int32, torch.float32
    try:
        with FakeTensorMode():
            x = torch.empty(10, 2048, dtype=bf)
            idx = torch.empty(10, 4, dtype=i64)

            def dispatch(**kw):
                a = {"x": x, "topk_idx": idx, "t": 16, "e": 32, "fp8": True, "rs": False,
                     "ue": False, "stats": None, **kw}  # fmt: skip
                return OPS.ll_dispatch(a["x"], a["topk_idx"], h, 4, a["t"], a["e"], a["stats"],
                                       a["fp8"], a["rs"], a["ue"])  # fmt: skip

            cases = [
                (ValueError, "hidden", {"x": torch.empty(10, 2000, dtype=bf)}),
                (ValueError, "more than num_max_dispatch_tokens_per_rank=8", {"t": 8}),
                (ValueError, "multiple of the Buffer's group size", {"e": 30}),
                (ValueError, "topk_idx must have shape",
                 {"topk_idx": torch.empty(9, 4, dtype=i64)}),
                (TypeError, "topk_idx must have dtype",
                 {"topk_idx": torch.empty(10, 4, dtype=i32)}),
                (TypeError, "x must have dtype", {"x": torch.empty(10, 2048, dtype=f32)}),
                (ValueError, "cumulative_local_expert_recv_stats must have shape",
                 {"stats": torch.empty(4, dtype=i32)}),
                (ValueError, "use_ue8m0=True needs round_scale", {"ue": True}),
                (ValueError, "use_ue8m0=True needs use_fp8", {"ue": True, "fp8": False}),
            ]  # fmt: skip
            for exc, msg, kw in cases:
                with pytest.raises(exc, match=msg):
                    dispatch(**kw)
            y = torch.empty(8, 64, 2048, dtype=bf)
            w = torch.empty(10, 4, dtype=f32)
            si = torch.empty(8, 64, dtype=i32)
            lr = torch.empty(8, 4, dtype=i64)
            with pytest.raises(ValueError, match=r"x must have shape \[8, 64, 2048\]"):
                OPS.ll_combine(torch.empty(8, 32, 2048, dtype=bf), idx, w, si, lr, h, 16, 32)
            with pytest.raises(ValueError, match="topk_weights must have shape"):
                OPS.ll_combine(y, idx, torch.empty(10, 3, dtype=f32), si, lr, h, 16, 32)
            with pytest.raises(TypeError, match="layout_range must have dtype"):
                OPS.ll_combine(y, idx, w, si, lr.to(i32), h, 16, 32)
            with pytest.raises(ValueError, match="src_info must have shape"):
                OPS.ll_combine(y, idx, w, si[:, :32], lr, h, 16, 32)
        assert b.calls == []
    finally:
        mops.unregister(b)


# ----- real implementations through the stand-ins -------------------------------------------


@pytest.mark.parametrize("dtype", AR_DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max"])
def test_all_reduce_through_a_stand_in(comm, dtype, op):
    c, h = comm
    x = (torch.arange(12, dtype=torch.float32).view(3, 4) - 5).to(dtype)
    keep = x.clone()
    y = OPS.all_reduce(x, h, op)
    assert torch.equal(x.view(torch.uint8), keep.view(torch.uint8))  # out of place
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(torch.uint8), ar_expected(keep, 3, op).view(torch.uint8))
    assert mops.all_reduce_(x, h, op) is x
    assert torch.equal(x.view(torch.uint8), ar_expected(keep, 3, op).view(torch.uint8))
    assert [call[4] for call in c.calls] == [False, True]  # out given, then in place


def test_all_reduce_forwards_its_arguments(comm):
    c, h = comm
    x8 = torch.ones(8, dtype=torch.float8_e4m3fn)
    OPS.all_reduce(x8, h, "sum", "oneshot_ll", torch.float16)
    OPS.all_reduce_(x8, h, "max", "twoshot_ll", None)
    assert c.calls == [
        ("all_reduce", "sum", "oneshot_ll", torch.float16, False, (8,)),
        ("all_reduce", "max", "twoshot_ll", None, True, (8,)),
    ]
    # A strided input reaches the communicator as a contiguous tensor.
    x = torch.arange(12.0).view(3, 4).t()
    assert torch.equal(OPS.all_reduce(x, h), ar_expected(x, 3, "sum"))


def test_all_gather_through_a_stand_in(comm):
    c, h = comm
    x = torch.arange(6, dtype=torch.int32).view(2, 3)
    y = OPS.all_gather(x, h, 3, "ag_ll")
    assert torch.equal(y, torch.cat([x + p for p in range(3)]))
    assert torch.equal(OPS.all_gather(torch.tensor(5.0), h, 3), torch.tensor([5.0, 6.0, 7.0]))
    assert torch.equal(OPS.all_gather(x.t(), h, 3), torch.cat([x.t() + p for p in range(3)]))
    assert c.calls[0] == ("all_gather", "ag_ll", (2, 3))


@pytest.mark.parametrize("use_fp8,ue8m0", [(True, False), (True, True), (False, False)])
def test_ll_dispatch_through_a_stand_in(ll, use_fp8, ue8m0):
    b, h = ll
    x, idx, _ = ll_inputs()
    stats = torch.zeros(4, dtype=torch.int32)
    got = OPS.ll_dispatch(x, idx, h, 2, 8, 8, stats, use_fp8, ue8m0, ue8m0)
    assert b.calls == [("dispatch", 8, 8, use_fp8, ue8m0, ue8m0)]
    want, count, handle, _, _ = b.low_latency_dispatch(
        x, idx, 8, 8, use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0
    )
    want_x, want_s = want if use_fp8 else (want, None)
    assert torch.equal(got[0].view(torch.uint8), want_x.view(torch.uint8))
    if use_fp8:
        assert got[1].stride() == want_s.stride()
        assert got[1].dtype == want_s.dtype and torch.equal(got[1], want_s)
    else:
        assert got[1].shape == (4, 16, 0)
    assert torch.equal(got[2], count) and int(count.sum()) > 0
    assert torch.equal(got[3], handle[0]) and torch.equal(got[4], handle[1])
    assert torch.equal(stats, count)  # the mutated argument


def test_ll_round_trip_through_a_stand_in(ll):
    """Identity experts: combine(dispatch(x)) = sum of the valid weights times x,
    and bit for bit what the stand-in's own methods give."""
    b, h = ll
    x, idx, w = ll_inputs()
    recv_x, _, count, src_info, layout_range = OPS.ll_dispatch(x, idx, h, 2, 8, 8, None, False)
    out = OPS.ll_combine(recv_x, idx, w, src_info, layout_range, h, 8, 8)
    want = (x.float() * (w * (idx >= 0)).sum(1, keepdim=True)).to(torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    direct, _, _ = b.low_latency_combine(recv_x, idx, w, (src_info, layout_range, 8, 256, 8))
    assert torch.equal(out.view(torch.int16), direct.view(torch.int16))
    assert [c[0] for c in b.calls] == ["dispatch", "combine", "combine"]


def test_opcheck(comm, ll):
    """torch.library.opcheck: schema, fake-vs-real (shapes, dtypes, strides),
    aliasing and mutation declarations, AOT dispatch, on every op."""
    _, hc = comm
    _, hl = ll
    x, idx, w = ll_inputs()
    recv_x, _, _, src_info, layout_range = OPS.ll_dispatch(x, idx, hl, 2, 8, 8, None, False)
    cases = [
        (OPS.all_reduce.default, (torch.randn(3, 5), hc, "max")),
        (OPS.all_reduce.default, (torch.randn(5, 3).t(), hc)),
        (OPS.all_reduce_.default, (torch.randn(3, 5), hc, "sum")),
        (OPS.all_gather.default, (torch.randn(2, 5), hc, 3)),
        (OPS.ll_dispatch.default, (x, idx, hl, 2, 8, 8, torch.zeros(4, dtype=torch.int32))),
        (OPS.ll_dispatch.default, (x, idx, hl, 2, 8, 8, None, True, True, True)),
        (OPS.ll_dispatch.default, (x, idx, hl, 2, 8, 8, None, False)),
        (OPS.ll_combine.default, (recv_x, idx, w, src_info, layout_range, hl, 8, 8)),
    ]  # fmt: skip
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))  # fmt: skip


# ----- torch.compile ---------------------------------------------------------------------------


def recording_backend(graphs: list):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def graph_ops(graphs: list) -> list:
    return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


def test_compile_allreduce_ops(comm):
    c, h = comm
    graphs: list = []

    @torch.compile(fullgraph=True, backend=recording_backend(graphs))
    def f(x):
        y = OPS.all_reduce(x * 2, h, "sum")
        z = x + 1
        mops.all_reduce_(z, h, "max")
        return y + 1, z, OPS.all_gather(x, h, 3)

    x = torch.randn(4, 3)
    y, z, g = f(x)
    assert torch.equal(y, ar_expected(x * 2, 3, "sum") + 1)
    assert torch.equal(z, ar_expected(x + 1, 3, "max"))
    assert torch.equal(g, torch.cat([x + p for p in range(3)]))
    names = graph_ops(graphs)
    assert len(graphs) == 1, "one graph (no break)"
    for op in ("moelink.all_reduce", "moelink.all_reduce_", "moelink.all_gather"):
        assert op in names, names  # one node each: dynamo did not trace into the op
    assert len(c.calls) == 3


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_the_in_place_op(comm, backend):
    """aot_eager functionalizes the mutation: the caller still sees it."""
    _, h = comm

    @torch.compile(fullgraph=True, backend=backend)
    def f(x):
        OPS.all_reduce_(x, h, "sum")
        return x * 2

    x = torch.randn(5)
    want = ar_expected(x, 3, "sum")
    out = f(x)
    assert torch.equal(x, want) and torch.equal(out, want * 2)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_ll_round_trip(ll, backend):
    b, h = ll
    x, idx, w = ll_inputs()

    def f(x, idx, w):
        recv_x, _, count, src_info, layout_range = OPS.ll_dispatch(x, idx, h, 2, 8, 8, None, False)
        y = recv_x * 1  # the "experts"
        return OPS.ll_combine(y, idx, w, src_info, layout_range, h, 8, 8), count

    want, want_count = f(x, idx, w)
    got, got_count = torch.compile(f, fullgraph=True, backend=backend)(x, idx, w)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_count, want_count)
    assert [c[0] for c in b.calls] == ["dispatch", "combine"] * 2


# ----- all_reduce_or_nccl ----------------------------------------------------------------------


def test_moelink_serves(comm):
    c, h = comm  # max_bytes 1 MiB, CPU
    assert mops.moelink_serves(torch.ones(8, dtype=torch.bfloat16), h)
    assert mops.moelink_serves(torch.ones(8, 4).t(), h, "max")  # strided: as a copy
    assert mops.moelink_serves(torch.ones(1 << 18), h)  # exactly max_bytes
    assert not mops.moelink_serves(torch.ones((1 << 18) + 1), h)
    assert not mops.moelink_serves(torch.ones(8, dtype=torch.float64), h)
    assert not mops.moelink_serves(torch.ones(8, dtype=torch.int64), h)
    assert not mops.moelink_serves(torch.ones(8), h, "avg")
    assert not mops.moelink_serves(torch.ones(8), h, dist.ReduceOp.PRODUCT)
    assert mops.moelink_serves(torch.ones(8), h, dist.ReduceOp.MAX)
    assert not mops.moelink_serves(torch.ones(8, device="meta"), h)


def test_all_reduce_or_nccl_routes(gloo_world):
    """moelink (the stand-in: world 3) where it serves the call; the one-rank gloo
    group (an identity) otherwise."""
    c = StandInAllReduce(world=3, max_bytes=1024, group=gloo_world)
    h = mops.register(c)
    try:
        x = torch.randn(16)
        y = x.clone()
        assert mops.all_reduce_or_nccl(y, h) is y
        assert torch.equal(y, ar_expected(x, 3, "sum")) and len(c.calls) == 1
        # float64, too large, product: torch.distributed (world 1: unchanged).
        for t, op in ((x.double(), "sum"), (torch.randn(257), "sum"), (x.clone(), "product")):
            before = t.clone()
            mops.all_reduce_or_nccl(t, h, op)
            assert torch.equal(t, before)
        assert len(c.calls) == 1
        # A strided view: reduced through a copy, written back, either way.
        m = torch.randn(4, 3)
        v = m.t()
        want = ar_expected(v, 3, "max")
        mops.all_reduce_or_nccl(v, h, dist.ReduceOp.MAX)
        assert torch.equal(m.t(), want) and len(c.calls) == 2
        big = torch.randn(20, 20)
        before = big.clone()
        mops.all_reduce_or_nccl(big.t(), h)
        assert torch.equal(big, before) and len(c.calls) == 2

        @torch.compile(fullgraph=True, backend="eager")
        def f(a, b):
            mops.all_reduce_or_nccl(a, h)
            mops.all_reduce_or_nccl(b, h)
            return a + b

        a, b = torch.randn(8), torch.randn(8, dtype=torch.float64)
        wa, wb = ar_expected(a, 3, "sum"), b.clone()
        assert torch.equal(f(a, b), wa + wb) and torch.equal(a, wa) and torch.equal(b, wb)
        with pytest.raises(ValueError, match="op must be one of"):
            mops.all_reduce_or_nccl(x, h, "bxor")
    finally:
        mops.unregister(c)


# ----- AllReduce: registration and from_process_group --------------------------------------------


class _FakeNative:
    """What AllReduce.__init__ and destroy() call on ``_native.AllReduceComm``."""

    destroyed = 0

    def __init__(self, *args) -> None:
        self.args = args

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        _FakeNative.destroyed += 1


class _Stream:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def cpu_allreduce(monkeypatch, gloo_world):
    """``moelink.AllReduce`` made on the CPU: the CUDA queries and the native
    communicator replaced, the rest of the constructor and destroy() real."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(ar, "native_group", lambda group, what: ("group", group))
    monkeypatch.setattr(ar._native, "AllReduceComm", _FakeNative)
    return gloo_world


def test_an_allreduce_registers_itself(cpu_allreduce):
    comm = moelink.AllReduce(cpu_allreduce, max_bytes=4096, tune_file=False)
    h = comm.handle
    assert isinstance(h, int) and mops.lookup(h) is comm
    comm.destroy()
    with pytest.raises(ValueError, match=f"handle {h}"):
        mops.lookup(h)
    comm2 = moelink.AllReduce(cpu_allreduce, max_bytes=4096, tune_file=False)
    assert comm2.handle != h
    del comm2
    gc.collect()
    assert all(not isinstance(o, moelink.AllReduce) for o in mops.registered().values())


def test_from_process_group_shares_one_communicator(cpu_allreduce):
    pg = cpu_allreduce
    a = moelink.AllReduce.from_process_group(pg, max_bytes=4096, tune_file=False)
    b = moelink.AllReduce.from_process_group(pg, tune_file=False, max_bytes=4096)
    assert a is b and isinstance(a, moelink.AllReduce) and a.group is pg
    assert a.max_bytes == 4096 and mops.lookup(a.handle) is a
    c = moelink.AllReduce.from_process_group(pg, max_bytes=8192, tune_file=False)
    assert c is not a and c.max_bytes == 8192
    a.destroy()
    d = moelink.AllReduce.from_process_group(pg, max_bytes=4096, tune_file=False)
    assert d is not a and d.handle != a.handle  # a destroyed one is not handed out
    # A subclass gets its own; unhashable keyword values: a new one every call.
    e = Tagged.from_process_group(pg, max_bytes=4096, tune_file=False)
    assert type(e) is Tagged and e is not d
    assert e is Tagged.from_process_group(pg, max_bytes=4096, tune_file=False)
    f = Tagged.from_process_group(pg, max_bytes=4096, tune_file=False, tags=["x"])
    g = Tagged.from_process_group(pg, max_bytes=4096, tune_file=False, tags=["x"])
    assert f is not g and f.tags == ["x"]
    for x in (c, d, e, f, g):
        x.destroy()


class Tagged(moelink.AllReduce):
    def __init__(self, group, tags=None, **kw) -> None:
        super().__init__(group, **kw)
        self.tags = tags


def test_from_process_group_needs_a_process_group(gloo_world):
    for bad in (None, "tp", 0):
        with pytest.raises(TypeError, match="ProcessGroup"):
            moelink.AllReduce.from_process_group(bad)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            moelink.AllReduce.from_process_group(gloo_world, max_bytes=4096)
        with pytest.raises(ValueError, match="max_bytes"):
            moelink.AllReduce.from_process_group(gloo_world, max_bytes=0)


# ----- the GPU worker -----------------------------------------------------------------------------

WORKER = Path(__file__).resolve().parent / "multi_gpu" / "ops_worker.py"


def import_worker(monkeypatch):
    """``ops_worker`` imported as the launcher runs it: by its bare name, from its
    folder (with its sibling modules)."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    for name in ("ops_worker", "worker_driver", "ll_worker", "allreduce_worker"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import ops_worker

    return ops_worker


def test_gpu_worker_imports_and_declares_its_scenarios(monkeypatch):
    """The worker imports on the CPU and has a function per scenario; gpu_run.sh
    runs it."""
    from tests.multi_gpu.torchrun_suite import scenario_names

    ops_worker = import_worker(monkeypatch)

    names = scenario_names(WORKER)
    assert names == ops_worker.SCENARIO_NAMES and len(set(names)) == len(names)
    for want in ("all_reduce_eager", "all_gather_eager", "ll_eager", "compiled",
                 "cuda_graph", "all_reduce_or_nccl"):  # fmt: skip
        assert want in names
    for name in names:
        assert callable(getattr(ops_worker, f"scenario_{name}")), name
    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_run.sh").read_text()
    assert 'run "ops-$n"' in script and "tests/multi_gpu/ops_worker.py" in script


class WorkerComm(StandInAllReduce):
    """A one-rank stand-in with what the worker reads of an AllReduce;
    ``error`` is added to every allreduce result (a broken communicator)."""

    def __init__(self, group, max_bytes: int, error: float = 0.0) -> None:
        super().__init__(world=1, max_bytes=max_bytes, group=group)
        self.last_choice = None
        self.error = error
        self.handle = mops.register(self)

    def all_reduce(self, tensor, op="sum", algorithm=None, out=None, accum_dtype=None, **kw):
        self.last_choice = ("stand-in", 0, 0)
        dst = super().all_reduce(tensor, op, algorithm, out, accum_dtype)
        if self.error:
            dst.copy_((dst.double() + self.error).to(dst.dtype))
        return dst

    def check(self) -> None:
        pass


class WorkerBuffer(StandInLowLatency):
    def __init__(self, drop_count: bool = False) -> None:
        super().__init__(group_size=1)
        self.drop_count = drop_count

    def low_latency_dispatch(self, *args, **kwargs):
        recv, count, handle, event, hook = super().low_latency_dispatch(*args, **kwargs)
        if self.drop_count:
            count = count - (count > 0).to(count.dtype)  # a lost token
        return recv, count, handle, event, hook

    def check(self) -> None:
        pass


@pytest.mark.parametrize("broken", [False, True])
def test_gpu_worker_scenarios_on_cpu_stand_ins(monkeypatch, gloo_world, broken):
    """Some of the worker's scenarios on one CPU rank through stand-ins: they pass
    with correct ones and fail with broken ones (its checks can fail)."""
    ow = import_worker(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(ow, "poison_free", lambda ctx: None)
    dev = torch.device("cpu")
    ar_ctx = ow.arw.Ctx(0, 1, dev, gloo_world, gloo_world, 1234, ow.MAX_BYTES, False)
    ll_ctx = ow.llw.Ctx(0, 1, 1234, dev, 1, gloo_world)
    ctx = ow.Ctx(ar_ctx, ll_ctx)
    ctx.ar.comm = WorkerComm(gloo_world, ow.MAX_BYTES, error=1.0 if broken else 0.0)
    ctx.buf = WorkerBuffer(drop_count=broken)
    ctx.buf_handle = mops.register(ctx.buf)
    try:
        for name in ("all_reduce_or_nccl", "ll_eager"):
            if broken:
                with pytest.raises(AssertionError):
                    ow.run_one(ctx, name)
            else:
                ow.run_one(ctx, name)
    finally:
        mops.unregister(ctx.ar.comm)
        mops.unregister(ctx.buf)
