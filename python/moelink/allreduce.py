"""``moelink.AllReduce``: allreduce and allgather among the GPUs of one host.

A communicator over a ``torch.distributed`` group that runs moelink's own
collective kernels (crate ``collectives``; ``docs/design-allreduce.md``) on the
current torch stream: NVLink loads/stores and LL packets, never NVLink multicast,
no ``torch.distributed`` collective inside a call, CUDA-graph capturable.

    comm = moelink.AllReduce(group, max_bytes=64 << 20)
    comm.all_reduce(t)                               # in place, sum, algorithm picked by size
    comm.all_reduce(t, op="max", out=o)              # out of place
    comm.all_reduce(x8, accum_dtype=torch.float16)   # fp8 input, fp16 accumulation
    comm.all_gather(out, inp)                        # out = cat of every rank's inp
    comm.algorithms()                                # names
    comm.tune()                                      # time every candidate, keep the winners
    comm = moelink.AllReduce.from_process_group(pg)  # one per (group, settings), shared
    torch.ops.moelink.all_reduce(t, comm.handle)     # as a torch op (docs/torch-integration.md)

Algorithms: allreduce ``oneshot_ll`` (smallest), ``twoshot_ll`` (small/medium),
``rsag`` (large: copy into the registered scratch, read-reduce-scatter + all-gather
over the peers' mapped scratch), ``rsag_zc`` (the same on tensors registered with
``register``: zero copy), ``rsag_push`` (large: the reduce-scatter by stores into
the owners' scratch, the all-gather by stores into a registered output or into
the peers' scratch, copied out locally; no registration needed); allgather ``ag_ll`` and
``ag_mesh``. Every argument is
checked before anything is launched (``TypeError`` / ``ValueError`` naming it).

Every rank must make the same calls in the same order with the same sizes and
pins (like NCCL), from one stream at a time. A device wait that runs out (a peer
that never made the matching call) raises ``moelink.TimeoutError`` naming the rank
and what it waited for, at the next call or ``check()``; the communicator must
then be destroyed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import re
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from . import _env, _native, _registry
from ._buffer_common import PlanCache
from ._device_timeout import device_timeout_ns, env_device_timeout_ns, env_host_timeout_s
from ._group import native_group
from ._streams import current_raw_stream
from .checks import (
    LIMITS,
    check_bool,
    check_int,
    device_index,
    optional_meta,
    tensor_meta,
    tensor_sig,
)

__all__ = [
    "ALGORITHMS",
    "AllReduce",
    "DEFAULT_MAX_BYTES",
    "DEVICE_TIMEOUT_ENV",
    "TUNE_FILE_ENV",
    "check_all_gather_args",
    "check_all_reduce_args",
    "check_geometry",
    "default_tune_file",
    "plan",
]

#: torch dtype -> kernel dtype name, for allreduce.
DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "int32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
#: Accumulation types (``accum_dtype``): a torch dtype or its name.
ACCUM = {torch.float16: "fp16", torch.float32: "fp32", torch.int32: "int32"}
OPS = ("sum", "min", "max")
#: Algorithm name -> collective ("allreduce" / "allgather"), in tuner order.
ALGORITHMS = dict(_native.AllReduceComm.algorithm_names())

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_ONESHOT_MAX_BYTES = 512 << 10
DEFAULT_TWOSHOT_MAX_BYTES = 8 << 20
DEFAULT_ALLGATHER_LL_MAX_BYTES = 512 << 10
#: Environment variable naming the tuning file (overrides the default path).
TUNE_FILE_ENV = "MOELINK_AR_TUNE_FILE"
TUNE_FORMAT = "moelink-allreduce-tune/1"
#: Environment variable of ``AllReduce``'s ``device_timeout_s`` (seconds, default 30).
DEVICE_TIMEOUT_ENV = "MOELINK_AR_TIMEOUT_S"


def _dist_op_names() -> dict:
    try:
        r = dist.ReduceOp
        return {r.SUM: "sum", r.MIN: "min", r.MAX: "max"}
    except (AttributeError, TypeError):  # torch built without distributed
        return {}


_DIST_OPS = _dist_op_names()
# (dtype name, op, accum) combinations the kernels have (checked once each).
_VARIANTS_OK: set = set()


def _op_name(op) -> str:
    if isinstance(op, str):
        name = op.lower()
        if name not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        return name
    if not isinstance(op, (int, float)):  # ReduceOp values compare equal to ints
        for k, v in _DIST_OPS.items():
            with contextlib.suppress(Exception):
                if op == k:
                    return v
    raise TypeError(f"op must be 'sum', 'min', 'max' or a torch.distributed.ReduceOp, got {op!r}")


def _accum_name(accum_dtype):
    if accum_dtype is None:
        return None
    if isinstance(accum_dtype, torch.dtype):
        if accum_dtype not in ACCUM:
            raise ValueError(
                f"accum_dtype must be torch.float16, torch.float32 or torch.int32, "
                f"got {accum_dtype}"
            )
        return ACCUM[accum_dtype]
    if isinstance(accum_dtype, str) and accum_dtype in ACCUM.values():
        return accum_dtype
    raise TypeError(f"accum_dtype must be a torch.dtype (or 'fp16'/'fp32'), got {accum_dtype!r}")


def check_all_reduce_args(tensor, op, out, accum_dtype, device, max_bytes: int):
    """Checks an allreduce's arguments (everything that can be checked without the
    GPU); returns ``(dtype name, op name, accum name or None, out)`` with ``out``
    the tensor the result goes to. Raises ``TypeError`` for arguments of the wrong
    kind (not a tensor, unsupported dtype) and ``ValueError`` for wrong values.

    The tensors' checks are Rust's (``ep_core::calls::all_reduce``, the Rust API's
    too): ``tensor`` of a dtype of ``DTYPES``, on ``device``, contiguous, at most
    ``max_bytes``; ``out`` likewise, of ``tensor``'s dtype and element count. Here:
    that they are tensors, ``op`` and ``accum_dtype`` as names, and the kernel
    variant of the combination."""
    plan = _native.all_reduce_plan(
        device_index(device), tensor_meta("tensor", tensor), optional_meta("out", out), max_bytes
    )
    dtype = plan["dtype"]
    op_name = _op_name(op)
    accum = _accum_name(accum_dtype)
    key = (dtype, op_name, accum)
    if key not in _VARIANTS_OK:
        _native.AllReduceComm.variant(dtype, op_name, accum)  # ValueError if unsupported
        _VARIANTS_OK.add(key)
    return dtype, op_name, accum, tensor if out is None else out


def check_all_gather_args(out, inp, world_size: int, device, max_bytes: int) -> int:
    """Checks an allgather's arguments; returns the bytes per rank. The checks are
    Rust's (``ep_core::calls::all_gather``): both on ``device``, contiguous, of one
    dtype (any), ``out`` holding ``world_size * inp.numel()`` elements, at most
    ``max_bytes``."""
    out_meta, inp_meta = tensor_meta("out", out), tensor_meta("inp", inp)
    return _native.all_gather_plan(
        device_index(device), out_meta, inp_meta, inp.element_size(), world_size, max_bytes
    )["nbytes"]


def check_geometry(num_blocks, num_threads) -> tuple:
    """``(blocks, threads)`` as ints, 0 for "the algorithm's choice"; the upper
    bound of ``num_blocks`` (SMs) is checked by the communicator."""
    blocks = 0
    if num_blocks is not None:
        blocks = check_int(
            "num_blocks", num_blocks, minimum=1, maximum=LIMITS["allreduce_max_blocks"]
        )
    threads = 0
    if num_threads is not None:
        threads = check_int("num_threads", num_threads, minimum=32, maximum=1024)
        if threads % 32 != 0:
            raise ValueError(f"num_threads must be a multiple of 32, got {threads}")
    return blocks, threads


def _check_algorithm(algorithm, collective: str):
    if algorithm is None:
        return None
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a str or None, got {type(algorithm).__name__}")
    if ALGORITHMS.get(algorithm) != collective:
        known = [a for a, c in ALGORITHMS.items() if c == collective]
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; known: {known}")
    return algorithm


def plan(
    nbytes: int,
    world_size: int,
    *,
    collective: str = "allreduce",
    max_bytes: int = DEFAULT_MAX_BYTES,
    oneshot_max_bytes: int = DEFAULT_ONESHOT_MAX_BYTES,
    twoshot_max_bytes: int = DEFAULT_TWOSHOT_MAX_BYTES,
    allgather_ll_max_bytes: int = DEFAULT_ALLGATHER_LL_MAX_BYTES,
    max_blocks: int = 128,
    registered: bool = False,
    capturing: bool = False,
    algorithm=None,
    num_blocks=None,
    num_threads=None,
    tuned=(),
) -> tuple:
    """The selector without a communicator or GPU: ``(algorithm, blocks, threads)``
    a call of ``nbytes`` (allgather: per-rank input) would use under these limits
    and tuned entries (tuples as ``AllReduce.tuned()`` returns them).

    As the communicator: ``world_size`` is 1 to 8 (``LIMITS["allreduce_max_ranks"]``),
    ``max_bytes`` at most ``LIMITS["allreduce_max_bytes"]``, and a call above
    ``max_bytes`` (an allgather's whole output) raises ``ValueError``."""
    if not isinstance(collective, str):
        raise TypeError(f"collective must be 'allreduce' or 'allgather', got {collective!r}")
    max_total = LIMITS["allreduce_max_bytes"]
    nbytes = check_int("nbytes", nbytes, minimum=0, maximum=max_total)
    world_size = check_int(
        "world_size", world_size, minimum=1, maximum=LIMITS["allreduce_max_ranks"]
    )
    max_bytes = check_int("max_bytes", max_bytes, minimum=1, maximum=max_total)
    ll_caps = [
        check_int(name, value, minimum=0, maximum=max_total)
        for name, value in (
            ("oneshot_max_bytes", oneshot_max_bytes),
            ("twoshot_max_bytes", twoshot_max_bytes),
            ("allgather_ll_max_bytes", allgather_ll_max_bytes),
        )
    ]
    max_blocks = check_int(
        "max_blocks", max_blocks, minimum=1, maximum=LIMITS["allreduce_max_blocks"]
    )
    blocks, threads = check_geometry(num_blocks, num_threads)
    return tuple(
        _native.AllReduceComm.plan(
            collective,
            nbytes,
            world_size,
            max_bytes,
            *ll_caps,
            max_blocks,
            check_bool("registered", registered),
            check_bool("capturing", capturing),
            _check_algorithm(algorithm, collective),
            blocks,
            threads,
            _check_tuned(tuned),
        )
    )


def _check_tuned(tuned) -> list:
    """``tuned`` as a list of ``(collective, graph, registered, log2 bytes,
    algorithm, blocks, threads)`` tuples, as ``AllReduce.tuned()`` returns them."""
    if not isinstance(tuned, (list, tuple)):
        raise TypeError(f"tuned must be a list of tuples, got {type(tuned).__name__}")
    out = []
    for i, e in enumerate(tuned):
        name = f"tuned[{i}]"
        if not isinstance(e, (list, tuple)) or len(e) != 7:
            raise TypeError(f"{name} must be a 7-tuple like AllReduce.tuned()'s, got {e!r}")
        coll, graph, registered, log2, algorithm, blocks, threads = e
        if not isinstance(coll, str) or not isinstance(algorithm, str):
            raise TypeError(f"{name}: collective and algorithm must be str, got {e!r}")
        out.append(
            (
                coll,
                check_bool(f"{name}[1] (graph)", graph),
                check_bool(f"{name}[2] (registered)", registered),
                check_int(f"{name}[3] (log2 bytes)", log2, minimum=0, maximum=64),
                algorithm,
                check_int(f"{name}[5] (blocks)", blocks, minimum=0, maximum=2**32 - 1),
                check_int(f"{name}[6] (threads)", threads, minimum=0, maximum=2**32 - 1),
            )
        )
    return out


def _bucket(nbytes: int) -> int:
    """``ceil(log2(nbytes))`` (0 for 0 and 1): the tuned table's size key."""
    return max(0, int(nbytes) - 1).bit_length()


def default_tune_file(gpu_name: str, world_size: int) -> Path:
    """``$MOELINK_AR_TUNE_FILE``, else ``~/.cache/moelink/allreduce-<gpu>-<R>gpu.json``."""
    env = _env.get(TUNE_FILE_ENV)
    if env:
        return Path(env).expanduser()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower() or "gpu"
    return Path.home() / ".cache" / "moelink" / f"allreduce-{slug}-{world_size}gpu.json"


def _entries_from_json(data: dict, gpu: str, world_size: int) -> list:
    if data.get("format") != TUNE_FORMAT:
        raise ValueError(f"not a {TUNE_FORMAT} file (format {data.get('format')!r})")
    if data.get("gpu") != gpu or data.get("world_size") != world_size:
        raise ValueError(
            f"tuned for {data.get('world_size')} x {data.get('gpu')}, "
            f"this job is {world_size} x {gpu}"
        )
    out = []
    for e in data.get("entries", []):
        out.append(
            (
                str(e["collective"]),
                bool(e["graph"]),
                bool(e["registered"]),
                int(e["log2_bytes"]),
                str(e["algorithm"]),
                int(e["num_blocks"]),
                int(e["num_threads"]),
            )
        )
    return out


#: (class, group, keywords) -> the communicator ``from_process_group`` made for
#: them (weak: an entry goes with its communicator).
_FROM_GROUP: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class AllReduce:
    """Allreduce / allgather communicator among the ranks of ``group`` (one GPU per
    rank, all on one host; at most 8 ranks).

    ``max_bytes``: the largest allreduce tensor / allgather output in bytes (each rank
    allocates a scratch buffer of about ``2 * max_bytes`` plus the LL packet space,
    which every peer maps: a data region and a result region). ``oneshot_max_bytes``
    / ``twoshot_max_bytes`` / ``allgather_ll_max_bytes`` bound the LL algorithms
    (they size the LL space).
    ``tune_file``: tuned winners to load (default ``default_tune_file()``; ``False``:
    none); ``autotune=True`` runs ``tune()`` when there is no file and saves it.
    ``device_timeout_s``: bound of every device wait, in seconds of GPU time (default
    30; env ``MOELINK_AR_TIMEOUT_S``; positive, else ``ValueError``); ``timeout_s``:
    bound of host waits (registration, peer exchanges; env ``MOELINK_TIMEOUT_S``,
    default 60). The bootstrap is the group's, shared with every Buffer on it and
    bounded by ``MOELINK_TIMEOUT_S`` when the group's first object was made.
    ``handle``: this communicator's int handle in the registry of moelink's torch
    ops (``torch.ops.moelink.all_reduce(t, comm.handle)``; dropped by ``destroy()``).
    """

    def __init__(
        self,
        group=None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        oneshot_max_bytes: int = DEFAULT_ONESHOT_MAX_BYTES,
        twoshot_max_bytes: int = DEFAULT_TWOSHOT_MAX_BYTES,
        allgather_ll_max_bytes: int = DEFAULT_ALLGATHER_LL_MAX_BYTES,
        tune_file=None,
        autotune: bool = False,
        device_timeout_s=None,
        timeout_s=None,
    ) -> None:
        self._native = None
        self._registered: dict = {}
        # Calls whose tensors passed the checks (keyed by what the checks read).
        self._checked = PlanCache()
        max_bytes = check_int(
            "max_bytes", max_bytes, minimum=1, maximum=LIMITS["allreduce_max_bytes"]
        )
        oneshot_max_bytes = check_int("oneshot_max_bytes", oneshot_max_bytes, minimum=0)
        twoshot_max_bytes = check_int("twoshot_max_bytes", twoshot_max_bytes, minimum=0)
        allgather_ll_max_bytes = check_int(
            "allgather_ll_max_bytes", allgather_ll_max_bytes, minimum=0
        )
        if device_timeout_s is None:
            timeout_ns = env_device_timeout_ns(DEVICE_TIMEOUT_ENV)
        else:
            timeout_ns = device_timeout_ns("device_timeout_s", device_timeout_s)
        if timeout_s is None:
            timeout_s = env_host_timeout_s()
        if not torch.cuda.is_available():
            raise RuntimeError("moelink.AllReduce needs a CUDA device")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before AllReduce")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        max_ranks = LIMITS["allreduce_max_ranks"]
        if self.world_size > max_ranks:
            raise ValueError(
                f"AllReduce handles at most {max_ranks} ranks (one host), got {self.world_size}"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = max_bytes
        self.gpu_name = torch.cuda.get_device_name(self.device)
        #: (algorithm, blocks, threads) of the last call.
        self.last_choice = None

        self._native = _native.AllReduceComm(
            native_group(self.group, "AllReduce"),
            self.device.index,
            max_bytes,
            oneshot_max_bytes,
            twoshot_max_bytes,
            allgather_ll_max_bytes,
            float(timeout_s),
            timeout_ns,
        )
        #: This communicator's handle in the op registry (``torch.ops.moelink.*``).
        self.handle = _registry.register(self)
        self.tune_file = None
        if tune_file is not False:
            path = (
                Path(tune_file).expanduser()
                if tune_file is not None
                else default_tune_file(self.gpu_name, self.world_size)
            )
            self.tune_file = path
            loaded = self.load_tuning(path)
            if not loaded and autotune:
                self.tune(path=path)

    @classmethod
    def from_process_group(cls, pg, **kw) -> AllReduce:
        """*Collective.* The communicator of torch process group ``pg`` with these
        settings (``**kw``: the constructor's keywords): the live one an earlier
        ``from_process_group`` call made with the same group and keywords, else a
        new ``cls(pg, **kw)``.

        Unlike the constructor, ``pg`` is required and must be a
        ``torch.distributed.ProcessGroup`` (``TypeError`` otherwise; the
        constructor takes ``None`` as the default group), and the communicator is
        shared: every layer or module that asks for the communicator of, say, its
        tensor-parallel group gets the same one (one scratch buffer, one tuned
        table). A destroyed communicator is not handed out again. Its ``handle``
        is what ``torch.ops.moelink.*`` take. Every rank of ``pg`` must make the
        same calls (the first one creates, which is collective). Keywords whose
        values cannot be hashed make a new communicator each call."""
        process_group = getattr(dist, "ProcessGroup", None)
        if process_group is None or not isinstance(pg, process_group):
            raise TypeError(
                "from_process_group needs a torch.distributed.ProcessGroup, got "
                f"{type(pg).__name__}"
            )
        try:
            key = (cls, pg, tuple(sorted(kw.items())))
            hash(key)
        except TypeError:
            return cls(pg, **kw)
        comm = _FROM_GROUP.get(key)
        if comm is not None and getattr(comm, "_native", None) is not None:
            return comm
        comm = cls(pg, **kw)
        _FROM_GROUP[key] = comm
        return comm

    # ----- introspection ---------------------------------------------------------

    def _get(self):
        if self._native is None:
            raise RuntimeError("this AllReduce was destroyed")
        return self._native

    def algorithms(self, collective: str | None = None) -> list:
        """Algorithm names (of one collective: ``"allreduce"`` / ``"allgather"``)."""
        return [a for a, c in ALGORITHMS.items() if collective is None or c == collective]

    def limits(self) -> dict:
        """The sizes this communicator applies (bytes) and its block limit."""
        w, m, one, two, ag, blocks = self._get().limits()
        return {
            "world_size": w,
            "max_bytes": m,
            "oneshot_max_bytes": one,
            "twoshot_max_bytes": two,
            "allgather_ll_max_bytes": ag,
            "max_blocks": blocks,
        }

    def select(
        self,
        nbytes: int,
        collective: str = "allreduce",
        registered: bool = False,
        capturing: bool | None = None,
        algorithm: str | None = None,
    ) -> tuple:
        """``(algorithm, blocks, threads)`` a call of ``nbytes`` (allgather: per-rank
        input) would use now; with ``algorithm`` pinned, ``ValueError`` when that
        algorithm cannot serve such a call."""
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        algorithm = _check_algorithm(algorithm, collective)
        return tuple(
            self._get().select(collective, int(nbytes), bool(registered), capturing, algorithm)
        )

    def tuned(self) -> list:
        """The tuned table: (collective, graph, registered, log2 bytes, algorithm,
        blocks, threads) tuples."""
        return [tuple(e) for e in self._get().tuned()]

    @property
    def device_timeout_s(self) -> float:
        """Bound of every device wait, seconds of GPU time (positive)."""
        return self._get().device_timeout_ns / 1e9

    @device_timeout_s.setter
    def device_timeout_s(self, seconds: float) -> None:
        self._get().set_device_timeout_ns(device_timeout_ns("device_timeout_s", seconds))

    def check(self) -> None:
        """Raises ``moelink.TimeoutError`` if a device wait of this communicator ran
        out (synchronise first to see the latest calls' outcome)."""
        self._get().check_device()

    # ----- collectives -----------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op="sum",
        algorithm: str | None = None,
        out: torch.Tensor | None = None,
        accum_dtype=None,
        num_blocks: int | None = None,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        """Reduces ``tensor`` over every rank (``op``: "sum", "min", "max") into
        ``out`` (default: ``tensor``, in place) on the current stream; returns it.

        ``algorithm`` pins an algorithm (else the tuned table or size thresholds
        choose), ``num_blocks`` / ``num_threads`` the launch geometry (the same on
        every rank). ``accum_dtype``: the accumulation type of fp8 sums
        (``torch.float32``, default, or ``torch.float16``); bf16/fp16/fp32 always
        accumulate in fp32, int32 in int32 (sums wrap around)."""
        native = self._get()
        # What the checks read, with the types of op and accum_dtype (so that equal
        # values of other types, which the checks may refuse, never share a key).
        key = (tensor_sig(tensor), tensor_sig(out), type(op), op, type(accum_dtype), accum_dtype)
        checked = self._checked.get(key)
        if checked is None:
            checked = check_all_reduce_args(
                tensor, op, out, accum_dtype, self.device, self.max_bytes
            )[:3]
            self._checked.put(key, checked)
        dtype, op_name, accum = checked
        out = tensor if out is None else out
        algorithm = _check_algorithm(algorithm, "allreduce")
        blocks, threads = check_geometry(num_blocks, num_threads)
        stream = current_raw_stream(self.device.index)
        self.last_choice = native.all_reduce(
            stream, tensor.data_ptr(), out.data_ptr(), tensor.numel(), dtype, op_name, accum,
            algorithm, blocks, threads, torch.cuda.is_current_stream_capturing(),
        )  # fmt: skip
        return out

    def all_gather(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        algorithm: str | None = None,
        num_blocks: int | None = None,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        """``out`` (world_size x ``inp.numel()`` elements, any dtype) = every rank's
        ``inp`` in rank order, on the current stream; returns ``out``. ``inp`` may be
        this rank's chunk of ``out`` (in place)."""
        native = self._get()
        key = ("allgather", tensor_sig(out), tensor_sig(inp))
        nbytes = self._checked.get(key)
        if nbytes is None:
            nbytes = check_all_gather_args(out, inp, self.world_size, self.device, self.max_bytes)
            self._checked.put(key, nbytes)
        algorithm = _check_algorithm(algorithm, "allgather")
        blocks, threads = check_geometry(num_blocks, num_threads)
        stream = current_raw_stream(self.device.index)
        self.last_choice = native.all_gather(
            stream, inp.data_ptr(), out.data_ptr(), nbytes, algorithm, blocks, threads,
            torch.cuda.is_current_stream_capturing(),
        )  # fmt: skip
        return out

    # ----- zero copy ---------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> int:
        """*Collective.* Registers ``tensor`` (contiguous, on this GPU, the same size
        on every rank) so that calls on it (or on a slice at the same offset on every
        rank) can use zero-copy algorithms (``rsag_zc``, ``ag_mesh`` without a copy).
        The communicator keeps a reference until ``deregister``. Needs memory from
        PyTorch's default caching allocator (not expandable segments)."""
        # On this GPU, contiguous, not empty (ep_core::calls::all_reduce_register).
        nbytes = _native.all_reduce_register_plan(
            device_index(self.device), tensor_meta("tensor", tensor), tensor.element_size()
        )
        rid = self._get().register(tensor.data_ptr(), nbytes)
        self._registered[rid] = tensor
        return rid

    def deregister(self, tensor_or_id) -> None:
        """*Collective.* Forgets a registration (a tensor passed to ``register`` or its
        id), after the current stream's work and a barrier."""
        if isinstance(tensor_or_id, torch.Tensor):
            ids = [k for k, t in self._registered.items() if t is tensor_or_id]
            if not ids:
                raise ValueError("this tensor is not registered")
            rid = ids[0]
        else:
            rid = check_int("id", tensor_or_id, minimum=0)
        torch.cuda.current_stream(self.device).synchronize()
        self._get().deregister(rid)
        self._registered.pop(rid, None)

    def is_registered(self, tensor: torch.Tensor) -> bool:
        return bool(
            self._get().is_registered(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        )

    # ----- tuning --------------------------------------------------------------------

    def load_tuning(self, path) -> bool:
        """*Collective.* Rank 0 reads ``path`` (if it exists and was tuned for this
        GPU model and world size) and every rank takes its entries. Returns whether
        a table was loaded."""
        payload = [None]
        if self.rank == 0:
            p = Path(path)
            if p.is_file():
                try:
                    data = json.loads(p.read_text())
                    payload[0] = _entries_from_json(data, self.gpu_name, self.world_size)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    payload[0] = f"{p}: {e}"
        dist.broadcast_object_list(
            payload, src=dist.get_global_rank(self.group, 0), group=self.group
        )
        if isinstance(payload[0], str):
            warnings.warn(f"moelink.AllReduce: ignoring tuning file {payload[0]}", stacklevel=2)
            return False
        if payload[0] is None:
            return False
        self._get().set_tuned(payload[0])
        return True

    def _candidates(self, collective: str, nbytes: int, registered: bool) -> list:
        max_blocks = self.limits()["max_blocks"]
        out = []
        for alg in self.algorithms(collective):
            try:
                _, b, t = self.select(nbytes, collective, registered, False, alg)
            except ValueError:
                continue  # not applicable at this size / registration
            for bb, tt in (
                (b, t),
                (max(1, b // 2), t),
                (min(max_blocks, 2 * b), t),
                (b, 256 if t != 256 else 512),
                (b, 1024),
            ):
                if (alg, bb, tt) not in out:
                    out.append((alg, bb, tt))
        return out

    def _bench_fn(self, coll: str, size: int, cand: tuple, buf, res):
        """A call of ``coll`` moving ``size`` bytes (per rank for allgather) with
        candidate ``(algorithm, blocks, threads)`` on bf16 ``buf`` / ``res``."""
        alg, b, t = cand
        n = size // 2
        if coll == "allreduce":
            return lambda: self.all_reduce(
                buf[:n], out=res[:n], algorithm=alg, num_blocks=b, num_threads=t
            )
        out = res[: n * self.world_size]
        return lambda: self.all_gather(out, buf[:n], algorithm=alg, num_blocks=b, num_threads=t)

    def _time(self, fn, graph: bool, iters: int, warmup: int) -> float:
        """Mean microseconds per call of ``fn``: back-to-back eager launches, or
        replays of a graph of ``iters`` calls."""
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if not graph:
            for _ in range(warmup):
                fn()
            start.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / iters
        # capture_begin/end on a side stream: what torch.cuda.graph does, without
        # its garbage collection and cache emptying before every capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            fn()
            g.capture_begin()
            try:
                for _ in range(iters):
                    fn()
            finally:
                g.capture_end()
        stream.wait_stream(side)
        for _ in range(max(1, warmup // iters)):
            g.replay()
        start.record(stream)
        for _ in range(3):
            g.replay()
        end.record(stream)
        end.synchronize()
        del g
        return start.elapsed_time(end) * 1e3 / (3 * iters)

    def tune(
        self,
        *,
        min_bytes: int = 1024,
        max_bytes: int | None = None,
        iters: int = 20,
        warmup: int = 5,
        graph=(False, True),
        registered=(False, True),
        collectives=("allreduce", "allgather"),
        path=None,
        save: bool = True,
        verbose: bool = False,
    ) -> dict:
        """*Collective.* Times every applicable algorithm and a few launch geometries
        per power-of-two size (bf16 sum; eager and/or CUDA graph; with and without
        registered tensors), takes the maximum time over ranks, keeps each size's
        fastest and installs the table on every rank. Rank 0 writes it to ``path``
        (default: the file this communicator loaded from, else ``default_tune_file``).
        Returns the JSON document."""
        native = self._get()
        max_bytes = min(self.max_bytes, max_bytes or self.max_bytes)
        min_bytes = check_int("min_bytes", min_bytes, minimum=2)
        lo, hi = math.ceil(math.log2(min_bytes)), int(math.log2(max_bytes))
        if hi < lo:
            raise ValueError(f"no power of two between min_bytes={min_bytes} and {max_bytes}")
        sizes = [1 << k for k in range(lo, hi + 1)]
        graph = (graph,) if isinstance(graph, bool) else tuple(graph)
        registered = (registered,) if isinstance(registered, bool) else tuple(registered)
        dev = self.device
        elems = max(sizes) // 2
        gen = torch.Generator(device=dev).manual_seed(1234 + self.rank)
        buf = (torch.rand(elems, device=dev, generator=gen) + 0.5).to(torch.bfloat16)
        # Outputs: an allreduce message, or an allgather output (<= max_bytes).
        res = torch.empty(max(elems, max_bytes // 2), dtype=torch.bfloat16, device=dev)
        backend = dist.get_backend(self.group)
        entries, measurements = [], []
        for reg in registered:
            ids = []
            if reg:
                try:
                    ids = [self.register(buf), self.register(res)]
                except ValueError as e:
                    if verbose and self.rank == 0:
                        print(f"[tune] skipping registered tensors: {e}", flush=True)
                    continue
            try:
                for coll in collectives:
                    for g in graph:
                        for size in sizes:
                            # allreduce: the message; allgather: the per-rank input.
                            if coll == "allgather" and size * self.world_size > max_bytes:
                                continue
                            cands = self._candidates(coll, size, reg)
                            if not cands:
                                continue
                            times = [
                                self._time(
                                    self._bench_fn(coll, size, c, buf, res), g, iters, warmup
                                )
                                for c in cands
                            ]
                            tt = torch.tensor(times, dtype=torch.float64)
                            if backend == "nccl":
                                tt = tt.to(dev)
                            dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=self.group)
                            tt = tt.cpu().tolist()
                            best = min(range(len(cands)), key=lambda i: tt[i])
                            alg, b, t = cands[best]
                            entries.append((coll, g, reg, _bucket(size), alg, b, t))
                            measurements.append(
                                {
                                    "collective": coll,
                                    "graph": g,
                                    "registered": reg,
                                    "bytes": size,
                                    "candidates": [
                                        [a, bb, th, round(x, 3)]
                                        for (a, bb, th), x in zip(cands, tt)
                                    ],
                                }
                            )
                            if verbose and self.rank == 0:
                                mode = "graph" if g else "eager"
                                print(
                                    f"[tune] {coll} {mode} {'registered ' if reg else ''}"
                                    f"{size} B: {alg} {b}x{t} {tt[best]:.2f} us",
                                    flush=True,
                                )
            finally:
                for rid in ids:
                    self.deregister(rid)
        native.set_tuned(entries)
        doc = {
            "format": TUNE_FORMAT,
            "gpu": self.gpu_name,
            "world_size": self.world_size,
            "moelink": _native.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "limits": self.limits(),
            "iters": iters,
            "entries": [
                {
                    "collective": e[0],
                    "graph": e[1],
                    "registered": e[2],
                    "log2_bytes": e[3],
                    "algorithm": e[4],
                    "num_blocks": e[5],
                    "num_threads": e[6],
                }
                for e in entries
            ],
            "measurements": measurements,
        }
        if save and self.rank == 0:
            target = Path(path) if path is not None else self.tune_file
            if target is None:
                target = default_tune_file(self.gpu_name, self.world_size)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(target)
        return doc

    # ----- lifetime ------------------------------------------------------------------

    def destroy(self) -> None:
        """*Collective.* Waits for the current stream, then frees the communicator
        (registrations included). Idempotent."""
        if self._native is None:
            return
        _registry.unregister(self)
        native, self._native = self._native, None
        try:
            torch.cuda.current_stream(self.device).synchronize()
            native.barrier()
        finally:
            native.destroy()
            self._registered.clear()

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is None:
            return
        with contextlib.suppress(Exception):
            torch.cuda.current_stream(self.device).synchronize()
        with contextlib.suppress(Exception):
            native.destroy()
