"""Peer benchmark: DeepEP V1, UCCL-EP and moelink measured by the same code.

    python3 -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benches/peer_bench.py --impl deep_ep|uccl|moelink --out DIR [--only intranode|ll]

One process per GPU (torchrun; every rank on its own GPU, NCCL group). ``--impl``
picks the library behind the DeepEP Python API (``Buffer``, ``set_num_sms``,
``get_dispatch_config`` / ``get_combine_config``, ``get_dispatch_layout``,
``dispatch``, ``combine``, ``low_latency_dispatch``, ``low_latency_combine``):

- ``deep_ep``: the real DeepEP V1, imported from ``PEERS/deepep`` (``--peers-dir``,
  default ``.peers`` of this checkout), never moelink's ``deep_ep`` alias: the run
  stops unless ``deep_ep.__file__`` lies under that folder;
- ``uccl``: UCCL-EP's DeepEP-compatible ``Buffer`` (``PEERS/uccl``: the ``uccl.ep``
  extension and its ``deep_ep`` wrapper, imported as ``uccl_deep_ep``);
- ``moelink``: ``moelink.Buffer``.

The workloads, timing and byte formulas are ``intranode_bench.py``'s and
``ll_bench.py``'s (docs/performance.md):

- intranode (``--only intranode``): 4096 tokens per rank, hidden 7168, top-8 of
  256 experts. ``Buffer(group, num_nvl_bytes, 0)``; for every ``--sms`` count (24
  and 48 by default) ``Buffer.set_num_sms(s)`` and the library's own
  ``get_dispatch_config`` / ``get_combine_config`` for the rank count (as DeepEP's
  tests/test_intranode.py does for its default entry; ``--tune`` also sweeps the
  NVLink chunk sizes as that test does and adds ``*_tuned`` rows). Layout, full
  bf16 dispatch, cached bf16 and fp8 dispatch, full fp8 dispatch and combine are
  first checked against ``moelink.reference`` (the CPU oracle of
  ``intranode_bench.py``) on this run's random inputs, then timed: CUDA events,
  L2 flushed before every call, median of ``--iters``; GB/s = bytes received per
  rank (``recv_x.numel() * 2``, fp8 times ``(1 + 4/128) / 2``) / median, median
  over ranks. Baseline: NCCL ``all_to_all_single`` of the same rows.
- low latency (``--only ll``): 128 tokens per rank, hidden 7168, top-8 of 288
  experts, fp8 dispatch, bf16 combine. ``Buffer(group, 0, num_rdma_bytes,
  low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks)``. Checked
  against ``moelink.reference.ll_dispatch`` (per local expert and source rank the
  same tokens, the same fp8 rows and scales, in whatever slot order the library
  uses) and combine of the dequantised rows (identity experts) against ``x * sum(w)``;
  then timed: eager (CUDA events around each Python call, dispatch + combine pairs),
  in CUDA graphs (10 calls per graph, per-call median of 20 replays), and the GPU
  time of the calls' kernels (torch.profiler: every kernel, memset and copy of a
  call); medians per rank, max over ranks. Baseline: NCCL ``all_to_all_single`` of
  the same bytes (``ll_bench.py``'s ``a2a_*``).

A failed check prints the impl, rank and op, skips that part's timing, and the run
exits 1. Rank 0 writes DIR/peer_<impl>.json (machine, commit, command, impl and
how it was loaded, per-op results, every rank's values) and prints the tables;
``benches/peer_table.py`` compares several runs. NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``
are set before torch or a peer library loads).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import statistics
import sys
import types
from collections import Counter
from pathlib import Path

import bench_common

#: No NVLink multicast anywhere (NCCL, torch symmetric memory, NVSHMEM): the
#: project's policy. Set before torch or any peer library is imported.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NO_MULTICAST_ENV)

REPO = Path(__file__).resolve().parent.parent
IMPLS = ("deep_ep", "uccl", "moelink")
IMPL_LABELS = {"deep_ep": "DeepEP V1", "uccl": "UCCL-EP", "moelink": "moelink"}
DEFAULT_SMS = (24, 48)
#: Each part's workload: an int option per name (``--num-tokens`` for ``num_tokens``)
#: with its default.
INTRANODE_WORKLOAD = {"num_tokens": 4096, "hidden": 7168, "num_experts": 256, "num_topk": 8}
LL_WORKLOAD = {"ll_tokens": 128, "ll_hidden": 7168, "ll_experts": 288, "ll_topk": 8}
NCCL_LABEL = "NCCL all_to_all_single"
#: Environment variables recorded in the JSON (what shapes the peers' transports).
RECORDED_ENV = (
    *NO_MULTICAST_ENV,
    "MOELINK_INTRANODE_RECV",
    "MOELINK_INTRANODE_RECV_POOL_BYTES",
    "NVSHMEM_REMOTE_TRANSPORT",
    "NVSHMEM_IB_ENABLE_IBGDA",
    "NVSHMEM_DISABLE_P2P",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
    "UCCL_SOCKET_IFNAME",
    "UCCL_IB_GID_INDEX",
    "CUDA_VISIBLE_DEVICES",
)
#: Chunk sizes ``--tune`` tries (DeepEP tests/test_intranode.py's ranges, thinned).
TUNE_DISPATCH_CHUNKS = (4, 6, 8, 12, 16, 20, 24, 28, 32)
TUNE_COMBINE_CHUNKS = (1, 2, 3, 4, 6, 8, 9, 12, 16)
TUNE_NVL_RECV_TOKENS = 256
TUNE_ITERS = 5
#: CUDA-graph timing of the low-latency calls: calls per graph, timed replays.
GRAPH_CALLS, GRAPH_REPS = 10, 20
#: Check thresholds of the low-latency part.
LL_COMBINE_VS_X = 9e-4  # calc_diff(combine, x * sum(w)), as ll_bench.py
LL_COMBINE_VS_REF = 5e-5  # calc_diff(combine, dequant(fp8(x)) * sum(w))
LL_DEQUANT_DIFF = 1e-4  # calc_diff of the received rows, dequantised, vs the reference


class PeerError(RuntimeError):
    """A failure of one impl on one rank in one op (the message names all three)."""


@contextlib.contextmanager
def stage(impl: str, rank: int, op: str):
    """Re-raise any exception of the block as :class:`PeerError` naming ``impl``,
    ``rank`` and ``op``."""
    try:
        yield
    except PeerError:
        raise
    except Exception as e:
        raise PeerError(f"{impl}, rank {rank}, {op}: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------
# Loading the implementations


class Impl:
    """One DeepEP-API implementation: its ``Buffer`` and ``Config`` classes, the
    dtype of ``topk_idx`` it takes, where its intranode handle keeps
    ``recv_src_idx``, and how it was loaded (for the JSON)."""

    def __init__(self, name, buffer_cls, config_cls, topk_idx_dtype, src_idx_pos, info):
        self.name = name
        self.Buffer = buffer_cls
        self.Config = config_cls
        self.topk_idx_dtype = topk_idx_dtype
        self.src_idx_pos = src_idx_pos
        self.info = info

    def nvl_bytes(self, configs, hidden: int, num_ranks: int, num_tokens: int) -> int:
        """``num_nvl_bytes`` for every config of the run: the largest of the
        library's own hints (moelink's depends on the tokens per rank), rounded up
        to 128 bytes."""
        sizes = []
        for cfg in configs:
            if self.name == "moelink":
                sizes.append(
                    cfg.get_nvl_buffer_size_hint(
                        hidden * 2, num_ranks, max_tokens_per_rank=num_tokens
                    )
                )
            else:
                sizes.append(cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks))
        return -(-max(sizes) // 128) * 128

    def make_config(self, num_sms: int, nvl_chunk: int):
        """``Config(num_sms, nvl_chunk, 256, 6, 128)`` (``--tune``)."""
        return self.Config(num_sms, nvl_chunk, TUNE_NVL_RECV_TOKENS, 6, 128)


def _under(path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _build_info(root: Path) -> dict:
    f = root / "BUILD_INFO.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return {"note": f"{f} missing or unreadable"}


def _preload(name: str, fallback_dir: Path) -> str:
    """Loads the shared library ``name`` (by soname, so that an extension that
    lists it as NEEDED finds it already loaded): the system's copy where the
    loader finds one, else the one carried in ``fallback_dir``. Returns which."""
    try:
        ctypes.CDLL(name)
        return f"{name}: system"
    except OSError:
        pass
    path = fallback_dir / name
    try:
        ctypes.CDLL(str(path))
    except OSError as e:
        raise PeerError(f"uccl: cannot load {name} (system or {path}): {e}") from e
    return f"{name}: {path}"


def load_impl(name: str, peers_dir: Path) -> Impl:
    """Imports implementation ``name`` (torch and moelink's native module first).
    The peers come from ``peers_dir`` only: the module files must lie under it."""
    import moelink
    import torch
    from moelink import intranode_demo  # noqa: F401 - moelink's native module before a peer's

    if name == "moelink":
        info = {"module": moelink.__file__, "version": moelink.__version__}
        return Impl(name, moelink.Buffer, moelink.Config, moelink.topk_idx_t, 3, info)
    if name == "deep_ep":
        root = peers_dir / "deepep"
        if not (root / "deep_ep" / "__init__.py").is_file():
            raise PeerError(f"deep_ep: no DeepEP build under {root} (see --peers-dir)")
        for mod in ("deep_ep", "deep_ep_cpp"):
            loaded = sys.modules.get(mod)
            if loaded is not None and not _under(getattr(loaded, "__file__", "") or "", root):
                raise PeerError(f"deep_ep: {mod} already imported from {loaded.__file__}")
        sys.path.insert(0, str(root))
        deep_ep = importlib.import_module("deep_ep")
        cpp = sys.modules.get("deep_ep_cpp")
        for mod in (deep_ep, cpp):
            where = getattr(mod, "__file__", None)
            if where is None or not _under(where, root):
                raise PeerError(
                    f"deep_ep: imported {where}, not the DeepEP build under {root} "
                    "(moelink's deep_ep alias must not stand in for DeepEP)"
                )
        if getattr(deep_ep, "BACKEND", None) == "moelink":
            raise PeerError("deep_ep: got moelink's alias package, not DeepEP")
        info = {
            "module": deep_ep.__file__,
            "extension": cpp.__file__,
            "build": _build_info(root),
            "sm90": bool(deep_ep.Buffer.is_sm90_compiled()),
        }
        idx = getattr(deep_ep, "topk_idx_t", torch.int64)
        return Impl(name, deep_ep.Buffer, deep_ep.Config, idx, 3, info)
    if name == "uccl":
        root = peers_dir / "uccl"
        if not (root / "uccl" / "__init__.py").is_file():
            raise PeerError(f"uccl: no UCCL-EP under {root} (see --peers-dir)")
        loaded = [_preload(lib, root / "lib") for lib in ("libcudart.so.12", "libibverbs.so.1")]
        notes = []
        if importlib.util.find_spec("numpy") is None:
            # The wrapper's utils.py imports numpy at the top for its own timing
            # helper, which this bench never calls.
            sys.modules["numpy"] = types.ModuleType("numpy")
            notes.append("numpy absent: an empty stand-in module was installed for the wrapper")
        sys.path.insert(0, str(root))
        wrapper = importlib.import_module("uccl_deep_ep")
        ep = importlib.import_module("uccl.ep")
        for mod in (wrapper, ep):
            if not _under(mod.__file__, root):
                raise PeerError(f"uccl: imported {mod.__file__}, not the copy under {root}")
        uccl = sys.modules["uccl"]
        info = {
            "module": wrapper.__file__,
            "extension": ep.__file__,
            "version": getattr(uccl, "__version__", None),
            "build": _build_info(root),
            "preloaded": loaded,
            "notes": notes,
        }
        return Impl(name, wrapper.Buffer, wrapper.Config, torch.int64, 4, info)
    raise PeerError(f"unknown impl {name!r}; expected one of {IMPLS}")


# ----------------------------------------------------------------------------
# Checks


def _note(notes: list, text: str) -> None:
    if text not in notes:
        notes.append(text)


def check_meta(checks, notes: list, name: str, got, want) -> bool:
    """Integer / bool metadata: the same values (a different integer dtype is a
    note, not a failure)."""
    import torch

    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype != want.dtype:
        if got.is_floating_point() or want.is_floating_point():
            return checks.add(name, False, f"dtype {got.dtype}, expected {want.dtype}")
        _note(notes, f"{name}: dtype {got.dtype} (the reference's: {want.dtype})")
        got = got.to(want.dtype)
    return checks.equal(name, got, want)


def check_close(checks, notes: list, name: str, got, want, rtol: float) -> bool:
    """Bit-exact, or every element within ``rtol`` of the reference (float32
    comparison; a note says it was not bit-exact). For sums whose order may
    differ between libraries (combine)."""
    import torch

    if not isinstance(got, torch.Tensor):
        return checks.add(name, False, f"got {type(got).__name__}, expected a tensor")
    want = want.to(got.device)
    if got.shape != want.shape or got.dtype != want.dtype:
        return checks.add(
            name,
            False,
            f"{got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}",
        )
    if torch.equal(got, want):
        return checks.add(name, True)
    g, w = got.float(), want.float()
    bad = ((g - w).abs() > rtol * w.abs()) | g.isnan()
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
        return checks.add(
            name,
            False,
            f"{rows.numel()} rows differ by more than rtol {rtol:g}, first at row {int(rows[0])}",
        )
    _note(notes, f"{name}: not bit-exact, every element within rtol {rtol:g}")
    return checks.add(name, True)


def check_fp8(checks, name: str, got, want) -> None:
    """fp8 dispatch output ``(recv_x, recv_scales)``: the same fp8 bits and scale
    values as the reference (the scales' memory layout is the library's)."""
    if not isinstance(got, tuple) or len(got) != 2:
        checks.add(f"{name}.recv_x", False, f"expected a (data, scales) tuple, got {type(got)}")
        return
    data, scales = got
    checks.equal(f"{name}.recv_x", data, want.recv_x)
    if scales is None:
        checks.add(f"{name}.recv_scales", False, "no scales returned")
        return
    checks.equal(f"{name}.recv_scales", scales.contiguous(), want.recv_scales.contiguous())


def all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (collective)."""
    import torch.distributed as dist

    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return all(flags)


# ----------------------------------------------------------------------------
# Intranode


def intranode_configs(impl: Impl, sms: list, num_ranks: int) -> dict:
    """Per SM count, ``(dispatch config, combine config)`` as the library
    recommends them for ``num_ranks`` after ``Buffer.set_num_sms``."""
    out = {}
    for s in sms:
        impl.Buffer.set_num_sms(s)
        out[s] = (
            impl.Buffer.get_dispatch_config(num_ranks),
            impl.Buffer.get_combine_config(num_ranks),
        )
    return out


def describe_config(cfg) -> str:
    names = (
        "num_sms",
        "num_max_nvl_chunked_send_tokens",
        "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens",
        "num_max_rdma_chunked_recv_tokens",
    )
    if all(hasattr(cfg, n) for n in names):
        return "Config(" + ", ".join(str(getattr(cfg, n)) for n in names) + ")"
    return type(cfg).__name__ + " (fields not exposed)"


def _reference(rank: int, world: int, workload: dict, device, group) -> tuple:
    """``intranode_demo._own_reference`` for this rank, ranks taking turns where
    the hosts' memory cannot hold every rank's reference at once (as
    ``intranode_demo.run_rank``)."""
    import torch.distributed as dist
    from moelink import intranode_demo as demo

    mem: list = [None] * world
    dist.all_gather_object(mem, demo._mem_available_bytes(), group=group)
    known = [m for m in mem if m is not None]
    at_once = demo._reference_builders(world, workload, min(known) if known else None)
    error, out = None, None
    for turn in range(0, world, at_once):
        if turn <= rank < turn + at_once:
            try:
                out = demo._own_reference(rank, world, workload, device)
            except Exception as e:  # noqa: BLE001 - raised after the turns
                error = e
        dist.barrier(group=group)
    if error is not None:
        raise error
    return out


def _pick_on_rank0(value):
    import torch.distributed as dist

    picks: list = [None] * dist.get_world_size()
    dist.all_gather_object(picks, value)
    return picks[0]


def tune(impl: Impl, fns, chunks, iters: int, scratch, s: int) -> tuple:
    """The NVLink chunk size whose config gives ``fns(config)`` the lowest median
    time on rank 0 (every rank uses rank 0's pick, as DeepEP's test does)."""
    import torch.distributed as dist
    from moelink import intranode_demo as demo

    # DeepEP asserts send chunk < recv chunk / ranks.
    chunks = [c for c in chunks if c < TUNE_NVL_RECV_TOKENS // dist.get_world_size()]
    best = None
    for chunk in chunks:
        cfg = impl.make_config(s, chunk)
        dist.barrier()
        t = statistics.median(demo._time_gpu(lambda c=cfg: fns(c), iters, 1, scratch))
        if best is None or t < best[1]:
            best = (chunk, t)
    chunk = _pick_on_rank0(best[0])
    return chunk, impl.make_config(s, chunk)


def run_intranode(impl: Impl, rank: int, world: int, group, args) -> dict:
    """Checks, then times, the intranode workload on this rank; returns a result
    shaped as ``intranode_demo.run_rank``'s (for ``intranode_demo.aggregate``)."""
    import torch
    import torch.distributed as dist
    from moelink import intranode_demo as demo

    name = impl.name
    workload = {**{k: getattr(args, k) for k in INTRANODE_WORKLOAD}, "seed": args.seed}
    n, hidden, num_experts = args.num_tokens, args.hidden, args.num_experts
    iters, warmup = args.iters, args.warmup
    device = torch.device("cuda", torch.cuda.current_device())
    with stage(name, rank, "intranode reference"):
        mine, own = _reference(rank, world, workload, device, group)
    want, want_fp8 = own["want"], own["want_fp8"]
    ref_layout, rank_prefix = own["layout"], own["rank_prefix"]
    want_combined_x = own["combined_x"].to(torch.bfloat16)
    recv_tokens = own["recv_tokens"]
    bf16_bytes = recv_tokens[rank] * hidden * 2
    topk_idx = mine["topk_idx"].to(impl.topk_idx_dtype)
    x, x_fp8 = mine["x"], (mine["x_fp8"], mine["x_scales"])

    checks, notes, rows = demo.Checks(), [], []
    scratch = torch.empty(demo.L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    with stage(name, rank, "configs"):
        configs = intranode_configs(impl, args.sms, world)
        nvl_bytes = impl.nvl_bytes([c for pair in configs.values() for c in pair], hidden, world, n)
    with stage(name, rank, f"Buffer(group, {nvl_bytes}, 0)"):
        buffer = impl.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)

    with stage(name, rank, "get_dispatch_layout"):
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
        per_rank, per_rdma_rank, per_expert, in_rank = layout[:4]
        torch.cuda.synchronize()
    check_meta(checks, notes, f"{name} layout.num_tokens_per_rank", per_rank, ref_layout[0])
    checks.add(
        f"{name} layout.num_tokens_per_rdma_rank is None",
        per_rdma_rank is None,
        f"got {type(per_rdma_rank).__name__}",
    )
    check_meta(checks, notes, f"{name} layout.num_tokens_per_expert", per_expert, ref_layout[1])
    check_meta(checks, notes, f"{name} layout.is_token_in_rank", in_rank, ref_layout[2])
    layout_args = {
        "num_tokens_per_rank": per_rank,
        "is_token_in_rank": in_rank,
        "num_tokens_per_expert": per_expert,
        "topk_idx": topk_idx,
        "topk_weights": mine["topk_weights"],
    }

    handles = {}
    for s in args.sms:
        dcfg, ccfg = configs[s]
        tag = f"[sms={s}]"
        op = f"dispatch_bf16{tag}"
        with stage(name, rank, op):
            recv_x, recv_idx, recv_w, per_exp_list, handle, _ = buffer.dispatch(
                x, config=dcfg, **layout_args
            )
            torch.cuda.synchronize()
        checks.equal(f"{name} {op}.recv_x", recv_x, want.recv_x)
        check_meta(checks, notes, f"{name} {op}.recv_topk_idx", recv_idx, want.recv_topk_idx)
        checks.equal(f"{name} {op}.recv_topk_weights", recv_w, want.recv_topk_weights)
        checks.equal(
            f"{name} {op}.num_recv_tokens_per_expert_list",
            [int(v) for v in per_exp_list],
            [int(v) for v in want.num_recv_tokens_per_expert],
        )
        if isinstance(handle, (tuple, list)) and len(handle) > impl.src_idx_pos:
            # The handle is opaque to users (docs/api.md): a peer's own encoding of the
            # prefix matrix is a note, moelink's is checked.
            rpm = handle[0].to(torch.int32).cpu()
            if args.impl == "moelink":
                check_meta(
                    checks,
                    notes,
                    f"{name} {op}.handle.rank_prefix_matrix",
                    handle[0],
                    rank_prefix.to(torch.int32),
                )
            elif not torch.equal(rpm, rank_prefix.to(torch.int32).cpu()):
                _note(notes, f"{name} {op}.handle.rank_prefix_matrix: the peer's own encoding")
            check_meta(
                checks,
                notes,
                f"{name} {op}.handle.recv_src_idx",
                handle[impl.src_idx_pos],
                want.recv_src_idx.to(torch.int32),
            )
        else:
            checks.add(f"{name} {op}.handle", False, f"unexpected handle {type(handle).__name__}")
        op = f"dispatch_bf16_cached{tag}"
        with stage(name, rank, op):
            got = buffer.dispatch(x, handle=handle, config=dcfg)[0]
            torch.cuda.synchronize()
        checks.equal(f"{name} {op}.recv_x", got, want.recv_x)
        op = f"dispatch_fp8_cached{tag}"
        with stage(name, rank, op):
            got = buffer.dispatch(x_fp8, handle=handle, config=dcfg)[0]
            torch.cuda.synchronize()
        check_fp8(checks, f"{name} {op}", got, want_fp8)
        op = f"dispatch_fp8{tag}"
        with stage(name, rank, op):
            got = buffer.dispatch(x_fp8, config=dcfg, **layout_args)[0]
            torch.cuda.synchronize()
        check_fp8(checks, f"{name} {op}", got, want_fp8)
        op = f"combine_bf16{tag}"
        with stage(name, rank, op):
            combined_x, combined_w, _ = buffer.combine(
                recv_x, handle, topk_weights=recv_w, config=ccfg
            )
            torch.cuda.synchronize()
        check_close(checks, notes, f"{name} {op}.combined_x", combined_x, want_combined_x, 2**-7)
        check_close(
            checks, notes, f"{name} {op}.combined_topk_weights", combined_w, own["combined_w"], 1e-6
        )
        del got, combined_x, combined_w
        handles[s] = (recv_x, handle)

    timing_skipped = None
    if not all_ranks_ok(checks.ok):
        timing_skipped = "a check failed on some rank: nothing timed"
    else:
        with stage(name, rank, "timing get_dispatch_layout"):
            dist.barrier(group=group)
            times = demo._time_gpu(
                lambda: buffer.get_dispatch_layout(topk_idx, num_experts), iters, warmup, scratch
            )
            rows.append(demo._row(demo.LAYOUT, None, times, None))
        for s in args.sms:
            dcfg, ccfg = configs[s]
            recv_x, handle = handles[s]
            x_copy = recv_x.clone()
            ops = [
                (
                    demo.DISPATCH_BF16,
                    lambda c=dcfg, h=handle: buffer.dispatch(x, handle=h, config=c),
                    bf16_bytes,
                ),
                (
                    demo.DISPATCH_FP8,
                    lambda c=dcfg, h=handle: buffer.dispatch(x_fp8, handle=h, config=c),
                    bf16_bytes * demo.FP8_BYTES_FACTOR,
                ),
                (
                    demo.COMBINE_BF16,
                    lambda c=ccfg, h=handle, r=recv_x: buffer.combine(r, h, config=c),
                    bf16_bytes,
                ),
                (
                    demo.COMBINE_BF16_X_COPY,
                    lambda c=ccfg, h=handle, r=x_copy: buffer.combine(r, h, config=c),
                    bf16_bytes,
                ),
                (
                    demo.DISPATCH_BF16_UNCACHED,
                    lambda c=dcfg: buffer.dispatch(x, config=c, **layout_args),
                    bf16_bytes,
                ),
            ]
            for op, fn, nbytes in ops:
                with stage(name, rank, f"timing {op}[sms={s}]"):
                    dist.barrier(group=group)
                    rows.append(
                        demo._row(op, s, demo._time_gpu(fn, iters, warmup, scratch), nbytes)
                    )
            if args.tune and impl.name != "moelink":
                rows += tune_rows(
                    impl, buffer, s, x, x_fp8, recv_x, handle, bf16_bytes, args, scratch, checks,
                    want, rank,
                )  # fmt: skip

    if timing_skipped is None:
        with stage(name, rank, "NCCL all_to_all_single baseline"):
            rows.append(a2a_row(x, own, rank, world, group, args, scratch, checks, name))
    # moelink's direct dispatch (MOELINK_INTRANODE_RECV=direct): how many
    # dispatches wrote recv_x in place, and how many fell back to a copy.
    native = getattr(buffer, "_native", None)
    pool = native.recv_pool_stats() if hasattr(native, "recv_pool_stats") else None
    if pool is not None:
        line = f"rank {rank} receive pool: {pool[3]} direct dispatches, {pool[4]} copied"
        notes.append(line)
        sys.stdout.write(line + "\n")  # one write: ranks print at once
        sys.stdout.flush()
    with stage(name, rank, "Buffer.destroy"):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        buffer.destroy()
    return {
        "mode": "gpu",
        "impl": name,
        "rank": rank,
        "num_ranks": world,
        "device": torch.cuda.get_device_name(device),
        "workload": workload,
        "timing": {
            "clock": "CUDA events",
            "iters": iters,
            "warmup": warmup,
            "l2_flush_bytes": demo.L2_FLUSH_BYTES,
        },
        "num_nvl_bytes": nvl_bytes,
        "configs": {
            str(s): {"dispatch": describe_config(d), "combine": describe_config(c)}
            for s, (d, c) in configs.items()
        },
        "recv_tokens": recv_tokens,
        "correct": checks.ok,
        "checks": checks.items,
        "notes": notes,
        "timing_skipped": timing_skipped,
        "rows": rows,
    }


def tune_rows(
    impl, buffer, s, x, x_fp8, recv_x, handle, bf16_bytes, args, scratch, checks, want, rank
) -> list:
    """``--tune``: the best NVLink chunk size for bf16 dispatch, fp8 dispatch and
    combine at ``s`` SMs (rank 0's pick), each checked once, then timed as the
    other rows (op names ``*_tuned``)."""
    import torch
    import torch.distributed as dist
    from moelink import intranode_demo as demo

    name = impl.name
    out = []
    plans = [
        (
            "dispatch_bf16_tuned",
            TUNE_DISPATCH_CHUNKS,
            lambda c: buffer.dispatch(x, handle=handle, config=c),
            bf16_bytes,
        ),
        (
            "dispatch_fp8_tuned",
            TUNE_DISPATCH_CHUNKS,
            lambda c: buffer.dispatch(x_fp8, handle=handle, config=c),
            bf16_bytes * demo.FP8_BYTES_FACTOR,
        ),
        (
            "combine_bf16_tuned",
            TUNE_COMBINE_CHUNKS,
            lambda c: buffer.combine(recv_x, handle, config=c),
            bf16_bytes,
        ),
    ]
    for op, chunks, fn, nbytes in plans:
        with stage(name, rank, f"{op}[sms={s}]"):
            chunk, cfg = tune(impl, fn, chunks, TUNE_ITERS, scratch, s)
            if op == "dispatch_bf16_tuned":
                got = fn(cfg)[0]
                torch.cuda.synchronize()
                checks.equal(f"{name} {op}[sms={s}, chunk={chunk}].recv_x", got, want.recv_x)
            dist.barrier()
            row = demo._row(
                op,
                s,
                demo._time_gpu(lambda c=cfg, f=fn: f(c), args.iters, args.warmup, scratch),
                nbytes,
            )
            row["nvl_chunk"] = chunk
            out.append(row)
    return out


def a2a_row(x, own, rank, world, group, args, scratch, checks, name) -> dict:
    """NCCL ``all_to_all_single`` of the rows a bf16 dispatch moves (this rank's
    tokens grouped by destination; the output is ``recv_x`` exactly), checked
    once against ``own`` (this rank's ``_reference``), then timed as the ops
    (``intranode_demo.run_rank``'s baseline)."""
    import torch
    import torch.distributed as dist
    from moelink import intranode_demo as demo

    ref_layout, rank_prefix = own["layout"], own["rank_prefix"]
    mask = ref_layout[2].to(x.device)
    send = torch.cat([x[mask[:, d]] for d in range(world)])
    in_splits = [int(c) for c in ref_layout[0]]
    column = rank_prefix[:, rank]
    out_splits = [int(column[0])] + [int(column[s] - column[s - 1]) for s in range(1, world)]
    recv = torch.empty(sum(out_splits), x.shape[1], dtype=x.dtype, device=x.device)

    def call():
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

    call()
    torch.cuda.synchronize()
    checks.equal(f"{name} (NCCL baseline) all_to_all_single.recv", recv, own["want"].recv_x)
    dist.barrier(group=group)
    nbytes = int(recv.numel()) * recv.element_size()
    timed = demo._time_gpu(call, args.iters, args.warmup, scratch)
    return demo._row(demo.BASELINE, None, timed, nbytes)


# ----------------------------------------------------------------------------
# Low latency


def ll_slot_keys(torch, handle, num_tokens: int, num_ranks: int) -> tuple:
    """Per local expert and receive slot, ``src_rank * T + src_token`` of the row
    there (-1: no row), from a low-latency handle ``(src_info, layout_range, ...)``
    whose ``layout_range[e][r]`` packs ``(begin << 32) | count`` (DeepEP's); and the
    number of rows whose source token lies outside ``0..T-1`` (left out)."""
    src_info, layout_range = handle[0], handle[1]
    src = src_info.long()
    begin = layout_range.long() >> 32
    count = layout_range.long() & 0xFFFFFFFF
    slots = torch.arange(src.shape[1], device=src.device).unsqueeze(0)
    key = torch.full_like(src, -1)
    bad = 0
    for r in range(num_ranks):
        b, c = begin[:, r : r + 1], count[:, r : r + 1]
        inside = (slots >= b) & (slots < b + c)
        valid = inside & (src >= 0) & (src < num_tokens)
        bad += int((inside & ~valid).sum())
        key = torch.where(valid, r * num_tokens + src, key)
    return key, bad


def ll_slot_of_key(torch, key):
    """``pos[e][k]``: the slot of key ``k`` at expert ``e`` (-1: absent), and how
    many keys appear twice at one expert."""
    el, slots = key.shape
    pos = torch.full((el, slots), -1, dtype=torch.long, device=key.device)
    e_idx, s_idx = (key >= 0).nonzero(as_tuple=True)
    pos[e_idx, key[e_idx, s_idx]] = s_idx
    dup = int((key >= 0).sum()) - int((pos >= 0).sum())
    return pos, dup


def ll_dequant_rows(data, scales):
    """float32 rows of fp8 ``data`` [N, H] times their per-128-channel ``scales``."""
    n, h = data.shape
    return (data.float().view(n, h // 128, 128) * scales.float().unsqueeze(-1)).view(n, h)


def check_ll_dispatch(torch, checks, notes, name, recv, count, handle, ref, t, world) -> None:
    """A low-latency fp8 dispatch against ``reference.ll_dispatch`` of this rank,
    independent of the slot order (which DeepEP leaves to arrival order): per local
    expert the same count and the same (source rank, token) rows, each with the same
    fp8 row and scales (bit-exact, or dequantised within ``LL_DEQUANT_DIFF``)."""
    from ll_bench import calc_diff

    device = count.device
    want_count = ref["recv_count"].to(device)
    check_meta(checks, notes, f"{name} ll_dispatch.recv_count", count, want_count)
    if not (isinstance(recv, tuple) and len(recv) == 2):
        checks.add(
            f"{name} ll_dispatch.recv_x", False, f"expected (data, scales), got {type(recv)}"
        )
        return
    data, scales = recv
    ref_handle = (ref["src_info"].to(device), ref["layout_range"].to(device))
    got_key, got_bad = ll_slot_keys(torch, handle, t, world)
    want_key, _ = ll_slot_keys(torch, ref_handle, t, world)
    checks.add(
        f"{name} ll_dispatch.handle source tokens in 0..T-1",
        got_bad == 0,
        f"{got_bad} rows name a source token outside 0..{t - 1}",
    )
    got_pos, got_dup = ll_slot_of_key(torch, got_key)
    want_pos, _ = ll_slot_of_key(torch, want_key)
    checks.add(f"{name} ll_dispatch.no duplicate rows", got_dup == 0, f"{got_dup} duplicate rows")
    got_rows_per_expert = (got_key >= 0).sum(dim=1)
    checks.add(
        f"{name} ll_dispatch.layout_range counts == recv_count",
        bool(torch.equal(got_rows_per_expert.to(torch.int64), count.to(torch.int64))),
        "the handle's per-source counts do not add up to recv_count",
    )
    same_rows = torch.equal(got_pos >= 0, want_pos >= 0)
    checks.add(
        f"{name} ll_dispatch.(source rank, token) rows per expert",
        same_rows,
        f"{int(((got_pos >= 0) != (want_pos >= 0)).sum())} (expert, source token) pairs differ",
    )
    if not same_rows:
        return
    e_idx, k_idx = (want_pos >= 0).nonzero(as_tuple=True)
    gs, ws = got_pos[e_idx, k_idx], want_pos[e_idx, k_idx]
    got_data, want_data = data[e_idx, gs], ref["recv_x"].to(device)[e_idx, ws]
    got_sc, want_sc = scales[e_idx, gs], ref["scales"].to(device)[e_idx, ws]
    if torch.equal(got_data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(
        got_sc, want_sc
    ):
        checks.add(f"{name} ll_dispatch.fp8 rows and scales", True)
        return
    d = calc_diff(ll_dequant_rows(got_data, got_sc), ll_dequant_rows(want_data, want_sc))
    flips = int((got_data.view(torch.uint8) != want_data.view(torch.uint8)).sum())
    ok = d < LL_DEQUANT_DIFF
    if ok:
        _note(
            notes,
            f"{name} ll_dispatch: fp8 not bit-exact ({flips} bytes differ), "
            f"dequantised calc_diff {d:.3g}",
        )
    checks.add(
        f"{name} ll_dispatch.fp8 rows and scales",
        ok,
        f"dequantised calc_diff {d:.3g} >= {LL_DEQUANT_DIFF:g} ({flips} fp8 bytes differ)",
    )


def kernel_us(torch, fn, iters: int) -> tuple:
    """GPU time of ``fn``'s device work (every kernel, memset and copy it
    launches, from torch.profiler): median per call where every call launched
    the same number, else the mean; and the most frequent kernel names."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    evs = sorted(
        (e for e in prof.events() if getattr(e, "device_type", None) == cuda),
        key=lambda e: e.time_range.start,
    )
    if not evs:
        return None, {}
    durs = [e.time_range.elapsed_us() for e in evs]
    names = dict(Counter(e.name[:120] for e in evs).most_common(4))
    if len(durs) % iters == 0:
        m = len(durs) // iters
        return statistics.median(sum(durs[i : i + m]) for i in range(0, len(durs), m)), names
    return sum(durs) / iters, names


def run_ll(impl: Impl, rank: int, world: int, group, args) -> dict:
    """Checks, then times, the low-latency workload on this rank."""
    import ll_bench
    import torch
    import torch.distributed as dist
    from moelink import reference
    from moelink.intranode_demo import Checks, cast_to_fp8, dequantize_fp8

    name = impl.name
    t, h, e, k = args.ll_tokens, args.ll_hidden, args.ll_experts, args.ll_topk
    device = torch.device("cuda", torch.cuda.current_device())
    checks, notes = Checks(), []
    # ll_bench.Bench: its inputs (seed * 1000 + rank, on the CPU for every rank),
    # dequantisation and NCCL baseline.
    bench = ll_bench.Bench(args, None, rank, world, device, True)
    with stage(name, rank, "ll reference"):
        cpu = [
            ll_bench.Bench(args, None, r, world, torch.device("cpu"), True) for r in range(world)
        ]
        ins = [b.inputs(t, h, e, k, seed=7) for b in cpu]
        ref = reference.ll_dispatch(
            [i[0] for i in ins], [i[1] for i in ins], t, e, use_fp8=True, rank=rank
        )[rank]
    with stage(name, rank, "ll Buffer"):
        nbytes = impl.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
        buf = impl.Buffer(
            group,
            0,
            nbytes,
            low_latency_mode=True,
            num_qps_per_rank=e // world,
            allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True,
        )
    bench.buf = buf
    x, idx, w = (v.to(device).contiguous() for v in ins[rank])
    idx = idx.to(impl.topk_idx_dtype)
    with stage(name, rank, "low_latency_dispatch (check)"):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
        torch.cuda.synchronize()
    check_ll_dispatch(torch, checks, notes, name, recv, count, handle, ref, t, world)
    with stage(name, rank, "low_latency_combine (check)"):
        y = bench.dequant(recv, True).contiguous()
        comb = buf.low_latency_combine(y, idx, w, handle)[0]
        torch.cuda.synchronize()
    wsum = w.sum(dim=1, keepdim=True)
    d = ll_bench.calc_diff(comb.float(), x.float() * wsum)
    checks.add(
        f"{name} ll_combine vs x * sum(w)",
        d < LL_COMBINE_VS_X,
        f"calc_diff {d:.3g} >= {LL_COMBINE_VS_X:g}",
    )
    y_ref = dequantize_fp8(*cast_to_fp8(x)).to(torch.bfloat16).float()
    d = ll_bench.calc_diff(comb.float(), y_ref * wsum)
    checks.add(
        f"{name} ll_combine vs dequant(fp8(x)) * sum(w)",
        d < LL_COMBINE_VS_REF,
        f"calc_diff {d:.3g} >= {LL_COMBINE_VS_REF:g}",
    )
    recv_rows = int(count.sum())
    del recv, y, comb, ref

    times, kernel_names, graph_errors = {}, {}, {}
    timing_skipped = None
    if not all_ranks_ok(checks.ok):
        timing_skipped = "a check failed on some rank: nothing timed"
    else:
        x, idx, w = bench.inputs(t, h, e, k, seed=11)
        idx = idx.to(impl.topk_idx_dtype)
        with stage(name, rank, "ll eager timing"):
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e)
            y = bench.dequant(recv, True).contiguous()
            times.update(ll_eager(torch, buf, x, idx, w, y, t, e, args))
        with stage(name, rank, "ll kernel timing"):
            calls = bench_common.ll_calls(buf, x, idx, w, y, t, e, handle)
            for op, fn in calls.items():
                dist.barrier(group=group)
                times[f"kernel_{op}"], kernel_names[op] = kernel_us(torch, fn, args.ll_iters)
        with stage(name, rank, "ll CUDA-graph timing"):
            g_times, graph_errors = ll_graphs(torch, buf, x, idx, w, y, handle, t, e)
            times.update(g_times)
        with stage(name, rank, "ll NCCL baseline"):
            times.update(bench.baseline(t, h, k, args.ll_iters))
    with stage(name, rank, "ll Buffer.destroy"):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        buf.destroy()
    return {
        "impl": name,
        "rank": rank,
        "correct": checks.ok,
        "checks": checks.items,
        "notes": notes,
        "timing_skipped": timing_skipped,
        "num_rdma_bytes": nbytes,
        "recv_rows": recv_rows,
        "times": times,
        "kernel_names": kernel_names,
        "graph_errors": graph_errors,
    }


def ll_eager(torch, buf, x, idx, w, y, t, e, args) -> dict:
    """Dispatch + combine pairs back to back, CUDA events around each Python call
    (launch and Python overhead included); medians in us (``ll_bench``'s eager_*)."""
    import torch.distributed as dist

    for _ in range(args.ll_warmup):
        hh = buf.low_latency_dispatch(x, idx, t, e)[2]
        buf.low_latency_combine(y, idx, w, hh)
    torch.cuda.synchronize()
    dist.barrier()
    ev = bench_common.ll_round_trips(torch, buf, x, idx, w, y, t, e, args.ll_iters)
    torch.cuda.synchronize()
    return bench_common.ll_eager_us(ev)


def ll_graphs(torch, buf, x, idx, w, y, handle, t, e) -> tuple:
    """Per-call us inside CUDA graphs of ``GRAPH_CALLS`` calls (dispatch only,
    combine only, dispatch + combine pairs), median of ``GRAPH_REPS`` replays
    (``ll_bench``'s graph_*). Every graph is captured first; only graphs that every
    rank captured are replayed (a capture a library refuses is recorded, not
    fatal). Returns (times, this rank's capture errors)."""
    import torch.distributed as dist

    s = torch.cuda.Stream(x.device)
    s.wait_stream(torch.cuda.current_stream(x.device))
    bodies = {
        "graph_dispatch": lambda: buf.low_latency_dispatch(x, idx, t, e),
        "graph_combine": lambda: buf.low_latency_combine(y, idx, w, handle),
        "graph_both": lambda: buf.low_latency_combine(
            y, idx, w, buf.low_latency_dispatch(x, idx, t, e)[2]
        ),
    }
    graphs, errors, out = {}, {}, {}
    with torch.cuda.stream(s):
        bodies["graph_both"]()  # one untimed pair on the capture stream first
        torch.cuda.synchronize(x.device)
        for name, body in bodies.items():
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, stream=s):
                    for _ in range(GRAPH_CALLS):
                        body()
                graphs[name] = g
            except Exception as ex:  # noqa: BLE001 - recorded, the others still run
                errors[name] = f"{type(ex).__name__}: {ex}"
    torch.cuda.synchronize(x.device)
    captured: list = [None] * dist.get_world_size()
    dist.all_gather_object(captured, sorted(graphs))
    common = set.intersection(*(set(c) for c in captured))
    with torch.cuda.stream(s):
        for name in bodies:
            if name not in common:
                continue
            g = graphs[name]
            dist.barrier()
            g.replay()
            torch.cuda.synchronize(x.device)
            dist.barrier()
            reps = bench_common.replay_times_us(torch, g, GRAPH_REPS, GRAPH_CALLS, s)
            out[name] = statistics.median(reps)
    torch.cuda.current_stream(x.device).wait_stream(s)
    torch.cuda.synchronize(x.device)
    del graphs
    return out, errors


# ----------------------------------------------------------------------------
# Aggregation, JSON, tables

LL_OPS = ("dispatch", "combine", "both")
LL_KINDS = ("graph", "eager", "kernel")


def aggregate_ll(gathered: list) -> dict:
    """Per key, the max over ranks of the per-rank medians (the slowest rank sets
    the step), as ``ll_bench.gather_max``; keys missing on a rank are left out."""
    gathered = sorted(gathered, key=lambda r: r["rank"])
    keys = set.intersection(*(set(r["times"]) for r in gathered)) if gathered else set()
    main = {}
    for key in sorted(keys):
        vals = [r["times"][key] for r in gathered]
        main[key] = None if any(v is None for v in vals) else max(vals)
    checks = [
        {**c, "name": f"rank {r['rank']}: {c['name']}"} for r in gathered for c in r["checks"]
    ]
    return {
        "correct": all(r["correct"] for r in gathered),
        "checks_failed": [c for c in checks if not c["ok"]],
        "checks_run": len(checks),
        "notes": sorted({f"rank {r['rank']}: {n}" for r in gathered for n in r["notes"]}),
        "timing_skipped": next(
            (r["timing_skipped"] for r in gathered if r["timing_skipped"]), None
        ),
        "main": main,
        "graph_errors": {r["rank"]: r["graph_errors"] for r in gathered if r["graph_errors"]},
        "kernel_names": gathered[0]["kernel_names"] if gathered else {},
        "per_rank": gathered,
    }


def aggregate_intranode(gathered: list) -> dict:
    from moelink import intranode_demo as demo

    results = demo.aggregate(gathered)
    first = sorted(gathered, key=lambda r: r["rank"])[0]
    for row, mine in zip(results["rows"], first["rows"]):
        if "nvl_chunk" in mine:
            row["nvl_chunk"] = mine["nvl_chunk"]  # rank 0's pick, every rank's config
    return {
        "correct": results["correct"],
        "checks_failed": [c for c in results["checks"] if not c["ok"]],
        "checks_run": len(results["checks"]),
        "notes": sorted({f"rank {r['rank']}: {n}" for r in gathered for n in r["notes"]}),
        "timing_skipped": first["timing_skipped"],
        "rows": results["rows"],
        "recv_tokens": results["recv_tokens"],
        "configs": first["configs"],
        "num_nvl_bytes": first["num_nvl_bytes"],
        "device": first["device"],
        "per_rank": [{k: v for k, v in r.items() if k != "checks"} for r in gathered],
    }


def intranode_lines(impl: str, data: dict, args) -> list:
    from moelink import intranode_demo as demo

    rows = data["rows"]
    base = next((r for r in rows if r["op"] == demo.BASELINE), None)
    recv = data["recv_tokens"]
    lines = [
        f"intranode, {IMPL_LABELS[impl]}: {len(recv)} x {data['device']}, {args.num_tokens} "
        f"tokens/rank, hidden {args.hidden}, top-{args.num_topk} of {args.num_experts}; "
        f"median over ranks of {args.iters}-call medians (CUDA events, L2 flushed)",
        f"checks: {'PASS' if data['correct'] else 'FAIL'} ({data['checks_run']} run, "
        f"{len(data['checks_failed'])} failed)",
    ]
    if data["timing_skipped"]:
        lines.append(f"timing skipped: {data['timing_skipped']}")
    lines.append(f"{'op':<24} {'SMs':>4} {'median us':>10} {'GB/s':>8} {'vs NCCL':>8}")
    for r in rows:
        gbps = "-" if r["GBps"] is None else f"{r['GBps']:.1f}"
        ratio = "-"
        if r["GBps"] is not None and base and base["GBps"]:
            ratio = f"{r['GBps'] / base['GBps']:.2f}x"
        sms = "-" if r["num_sms"] is None else str(r["num_sms"])
        label = demo.OP_LABELS.get(r["op"], r["op"])
        if r["op"] == demo.BASELINE:
            label = NCCL_LABEL
        lines.append(f"{label:<24} {sms:>4} {r['median_us']:>10.1f} {gbps:>8} {ratio:>8}")
    return lines


def ll_lines(impl: str, data: dict, args, world: int) -> list:
    m = data["main"]
    lines = [
        f"low latency, {IMPL_LABELS[impl]}: {world} ranks, T={args.ll_tokens} H={args.ll_hidden} "
        f"top-{args.ll_topk} of {args.ll_experts}, fp8 dispatch, bf16 combine; us, max over "
        "ranks of per-rank medians",
        f"checks: {'PASS' if data['correct'] else 'FAIL'} ({data['checks_run']} run, "
        f"{len(data['checks_failed'])} failed)",
    ]
    if data["timing_skipped"]:
        lines.append(f"timing skipped: {data['timing_skipped']}")
    lines.append(f"{'':<28}" + "".join(f"{op:>10}" for op in LL_OPS))
    what = {
        "graph": f"CUDA graph ({GRAPH_CALLS}/graph)",
        "eager": "eager (events, Python)",
        "kernel": "kernel time (profiler)",
    }

    def cell(v):
        return f"{v:>10.1f}" if isinstance(v, (int, float)) else f"{'-':>10}"

    for kind in LL_KINDS:
        lines.append(f"{what[kind]:<28}" + "".join(cell(m.get(f"{kind}_{op}")) for op in LL_OPS))
    lines.append(
        f"{'NCCL a2a, same bytes':<28}" + cell(m.get("a2a_dispatch")) + cell(m.get("a2a_combine"))
    )
    for rank, errs in data["graph_errors"].items():
        for g, err in errs.items():
            lines.append(f"rank {rank}: {g} not captured: {err}")
    return lines


def add_workload_options(g, workload: dict) -> None:
    for name, default in workload.items():
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--impl", choices=IMPLS, required=True, help="library behind the DeepEP API")
    p.add_argument("--out", type=Path, required=True, help="folder for peer_<impl>.json")
    p.add_argument("--only", choices=("intranode", "ll"), help="run one part only")
    p.add_argument(
        "--peers-dir",
        type=Path,
        default=REPO / ".peers",
        help="folder of the peer builds (default: .peers of this checkout)",
    )
    g = p.add_argument_group("intranode")
    add_workload_options(g, INTRANODE_WORKLOAD)
    g.add_argument(
        "--sms",
        type=int,
        nargs="+",
        default=list(DEFAULT_SMS),
        help="SM counts, even (default: 24 48)",
    )
    g.add_argument("--iters", type=int, default=20, help="timed calls per op (default: 20)")
    g.add_argument("--warmup", type=int, default=5, help="untimed calls per op (default: 5)")
    g.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    g.add_argument(
        "--tune",
        action="store_true",
        help="deep_ep/uccl: also sweep the NVLink chunk sizes (rows *_tuned)",
    )
    g = p.add_argument_group("low latency")
    add_workload_options(g, LL_WORKLOAD)
    g.add_argument("--ll-iters", type=int, default=50, help="timed calls (default: 50)")
    g.add_argument("--ll-warmup", type=int, default=10, help="untimed pairs (default: 10)")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any collective may wait (default: 300)",
    )
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    if any(s < 2 or s % 2 for s in args.sms):
        p.error(f"--sms: even counts of at least 2, got {args.sms}")
    args.sms = sorted(set(args.sms))
    for opt in ("iters", "ll_iters"):
        if getattr(args, opt) < 1:
            p.error(f"--{opt.replace('_', '-')} must be positive")
    if args.hidden % 128 or args.ll_hidden % 128:
        p.error("--hidden and --ll-hidden must be multiples of 128")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    os.environ.update(NO_MULTICAST_ENV)

    import torch.distributed as dist

    rank_env = int(os.environ.get("RANK", "0"))
    try:
        impl = load_impl(args.impl, args.peers_dir.resolve())
    except Exception as e:
        print(f"rank {rank_env}: cannot load {args.impl}: {e}", file=sys.stderr, flush=True)
        return 2
    info = bench_common.init(timeout_s=args.timeout)
    rank, world = info.rank, info.world_size
    if not bench_common.uses_nccl(info) or info.ranks_share_gpus:
        if rank == 0:
            print(
                "peer_bench needs one GPU per rank (an NCCL group): the peers cannot share a GPU",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return 2
    group = dist.group.WORLD
    parts = [args.only] if args.only else ["intranode", "ll"]
    out = {}
    for part in parts:
        if rank == 0:
            print(f"[peer_bench] {args.impl}: {part}", flush=True)
        if part == "intranode":
            gathered = bench_common.gather_or_exit(
                rank, world, lambda: run_intranode(impl, rank, world, group, args)
            )
            out[part] = aggregate_intranode(gathered)
        else:
            gathered = bench_common.gather_or_exit(
                rank, world, lambda: run_ll(impl, rank, world, group, args)
            )
            out[part] = aggregate_ll(gathered)
    correct = all(v["correct"] for v in out.values())
    if rank == 0:
        data = {
            **bench_common.record_header(f"peer bench ({args.impl})", info, world, argv),
            "impl": {"name": args.impl, "label": IMPL_LABELS[args.impl], **impl.info},
            "env": {k: os.environ.get(k) for k in RECORDED_ENV},
            "baseline": bench_common.baseline_record(info, NCCL_LABEL),
            "config": {
                "intranode": {
                    **{k: getattr(args, k) for k in INTRANODE_WORKLOAD},
                    "seed": args.seed,
                    "sms": args.sms,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "tune": args.tune,
                },
                "ll": {
                    **{k.removeprefix("ll_"): getattr(args, k) for k in LL_WORKLOAD},
                    "iters": args.ll_iters,
                    "warmup": args.ll_warmup,
                    "graph_calls": GRAPH_CALLS,
                    "graph_reps": GRAPH_REPS,
                },
            },
            "metric": {
                "intranode": "bytes received per rank / median time (median over ranks); bf16 "
                "and combine: recv_x.numel() * 2, fp8: times (1 + 4/128) / 2",
                "ll": "us per call, max over ranks of per-rank medians",
            },
            "correct": correct,
            **out,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"peer_{args.impl}.json"
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        lines = []
        if "intranode" in out:
            lines += intranode_lines(args.impl, out["intranode"], args) + [""]
        if "ll" in out:
            lines += ll_lines(args.impl, out["ll"], args, world) + [""]
        for part, v in out.items():
            for c in v["checks_failed"][:30]:
                lines.append(f"CHECK FAILED ({args.impl}, {part}) {c['name']}: {c['detail']}")
            for n in v["notes"][:20]:
                lines.append(f"note ({args.impl}, {part}) {n}")
        lines.append(f"wrote {path}")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
