"""``python -m moelink.launch``: N ranks on the local GPUs, several per GPU where
ranks outnumber GPUs (torchrun-like, one host).

Usage::

    python -m moelink.launch -n N [--mps auto|on|off] [--timeout S] [--kill-grace S]
                             [--no-python | -m] prog [args...]

Starts ``N`` rank processes of ``python prog args...`` (``-m``: ``python -m prog``;
``--no-python``: ``prog args...`` as an executable, e.g. a Rust test binary or
``compute-sanitizer``). Each rank gets ``RANK``, ``LOCAL_RANK`` (the same: one
host), ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT`` (a free port), ``MOELINK_LAUNCH_GPUS`` (the GPUs found),
``MOELINK_LAUNCH_MPS`` (1 where the rank runs under MPS, else 0) and moelink's
no-multicast policy (``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1``).

**Placement.** Rank ``r`` uses GPU ``r % G`` (``G``: the GPUs the CUDA driver
shows). ``CUDA_VISIBLE_DEVICES`` is left as it is: every rank sees every GPU, so
CUDA IPC between GPUs keeps working. A script picks its device with
:func:`init_distributed` (``local_rank % device_count``), which also works under
torchrun.

**Ranks that share a GPU** (``N > G``). NCCL refuses two ranks on one GPU, so
:func:`init_distributed` makes a gloo group there. Kernels of different processes
run at once only under NVIDIA MPS; without it the driver time-slices the
processes' contexts (correct, but every wait between ranks costs milliseconds).
``--mps`` (default: ``$MOELINK_MPS``, else ``auto``) decides:

========  ====================================================================
``auto``  an MPS daemon already reachable (``$CUDA_MPS_PIPE_DIRECTORY``, else
          ``/tmp/nvidia-mps``, holds its ``control`` pipe): use it, leave it
          running. Else, as root with ``nvidia-cuda-mps-control`` on ``PATH``:
          start a private daemon (pipe and log directories in a fresh temporary
          directory) and stop it at exit. Else: time-slice, with one note.
``on``    as ``auto``, but starts the daemon without root too, and fails (exit 2,
          one ``error:`` line) where no daemon can be had.
``off``   no MPS: the ranks time-slice. A reachable daemon is hidden from them
          (their ``CUDA_MPS_PIPE_DIRECTORY`` names an empty directory).
========  ====================================================================

Under MPS no rank gets an SM limit by default: moelink sizes every grid to
(the GPU's SMs - the ranks on it) / the ranks on it, so all ranks' blocks are
resident together with an SM per rank to spare.
``--mps-percentage`` (default ``$MOELINK_MPS_PERCENTAGE``, else ``none``) sets
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for every rank: ``auto`` is ``floor(100 /
ranks on its GPU)``, a number 1 to 100 that percentage. Measured on one H200 with
2 ranks at 50 %: grids of the limit (66 blocks of 1024 threads each) deadlock,
because the clients' SM sets may overlap; so under a limit of L SMs moelink
uses (L - ranks) / ranks per rank, which halves the grids again. A limit is for keeping
other work of a rank from taking the GPU, not for speed. Where every rank has
its own GPU, nothing about MPS is changed.
A daemon the launcher started is stopped (``quit``) when the run ends, whether the
ranks passed, one failed, the run timed out, or the launcher got SIGINT / SIGTERM
/ SIGHUP; its temporary directory is removed.

**Supervision.** Every rank runs in a process group of its own (stdin from
``/dev/null``, stdout and stderr shared with the launcher). When a rank exits
non-zero, the others get SIGTERM, then SIGKILL after ``--kill-grace`` seconds
(default 5), and the launcher exits with that rank's code (128 + signal where a
signal ended it; :func:`describe_failures` says which rank where several failed,
and under MPS which rank's exit may have faulted the others). ``--timeout S``
bounds the whole run: the ranks are killed the same way and the launcher exits
124. On SIGINT / SIGTERM / SIGHUP it stops the ranks and exits 128 + the signal
number. Whatever a rank left running in its
process group is killed at the end.

For tests only: ``MOELINK_LAUNCH_GPUS_OVERRIDE=G`` makes the launcher plan for
``G`` GPUs without asking the driver.

The launcher's messages go to stderr, prefixed ``[moelink.launch]``. This module
imports only the standard library and ``moelink._env``, which checks switch names
against the native module's registry (torch where :func:`init_distributed` runs);
the launcher process never initialises CUDA itself (it counts GPUs in a short
child process), so it can start an MPS daemon after counting them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import _env

__all__ = [
    "NO_MULTICAST_ENV",
    "DistInfo",
    "GpuSharing",
    "Interrupted",
    "LaunchError",
    "MpsPlan",
    "Placement",
    "decide_mps",
    "describe_failures",
    "gpu_sharing",
    "init_distributed",
    "main",
    "placements",
    "rank_env",
]

#: moelink never uses NVLink multicast: every launcher exports these.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
MPS_MODES = ("auto", "on", "off")
MPS_MODE_ENV = "MOELINK_MPS"
MPS_PERCENTAGE_ENV = "MOELINK_MPS_PERCENTAGE"
MPS_BINARY = "nvidia-cuda-mps-control"
#: Where CUDA clients look for the MPS control pipe without $CUDA_MPS_PIPE_DIRECTORY.
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
#: For tests: plan for this many GPUs instead of asking the driver.
GPUS_OVERRIDE_ENV = "MOELINK_LAUNCH_GPUS_OVERRIDE"
DEFAULT_KILL_GRACE_S = 5.0
#: Seconds an MPS control command (start, quit) may take, and the control pipe
#: may take to appear after a start.
MPS_COMMAND_TIMEOUT_S = 30.0
MPS_PIPE_WAIT_S = 10.0
EXIT_TIMEOUT = 124
EXIT_USAGE = 2
#: Under MPS, a rank that exited 0 this many seconds or less before another rank
#: failed is named as the likely cause (an MPS client that exits while its
#: kernels run faults the other clients' kernels: docs/one-gpu.md).
MPS_EXIT_WINDOW_S = 30.0

_PREFIX = "[moelink.launch]"


def _log(msg: str) -> None:
    print(f"{_PREFIX} {msg}", file=sys.stderr, flush=True)


class LaunchError(Exception):
    """A launch that cannot run as asked (bad option, MPS required but not
    available): the launcher prints one ``error:`` line and exits 2."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived while :func:`signals_raise` was active."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# ----------------------------------------------------------------------------
# Placement


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its GPU (None without GPUs), how many ranks share that
    GPU, and its MPS thread percentage (``floor(100 / ranks_on_device)``)."""

    rank: int
    device: int | None
    ranks_on_device: int
    thread_percentage: int


def placements(num_ranks: int, num_gpus: int) -> list[Placement]:
    """Round-robin placement of ``num_ranks`` ranks on ``num_gpus`` GPUs: rank
    ``r`` on GPU ``r % num_gpus``. Without GPUs every rank has device None."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if num_gpus == 0:
        return [Placement(r, None, 1, 100) for r in range(num_ranks)]
    out = []
    for r in range(num_ranks):
        d = r % num_gpus
        k = len(range(d, num_ranks, num_gpus))
        out.append(Placement(r, d, k, 100 // k))
    return out


def ranks_share_gpus(num_ranks: int, num_gpus: int) -> bool:
    """Whether some GPU holds more than one of ``num_ranks`` round-robin ranks."""
    return num_gpus > 0 and num_ranks > num_gpus


def rank_env(rank: int, num_ranks: int, port: int, num_gpus: int) -> dict:
    """The variables a rank of a one-host job gets (torchrun's names, the
    no-multicast policy, ``MOELINK_LAUNCH_GPUS``)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(num_ranks),
        "LOCAL_WORLD_SIZE": str(num_ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        _env.name("MOELINK_LAUNCH_GPUS"): str(num_gpus),
        **NO_MULTICAST_ENV,
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_COUNT_GPUS = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0); sys.exit()
n = ctypes.c_int(0)
ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
print(n.value if ok else 0)
"""


def local_gpu_count(env=None) -> int:
    """GPUs the CUDA driver shows (``CUDA_VISIBLE_DEVICES`` applies); 0 without a
    driver. Asked in a short child process, so that this process never
    initialises CUDA (it may start an MPS daemon afterwards).
    ``$MOELINK_LAUNCH_GPUS_OVERRIDE`` answers instead where it is set (tests)."""
    override = _env.get(GPUS_OVERRIDE_ENV, environ=env)
    if override is not None:
        try:
            n = int(override)
        except ValueError:
            n = -1
        if n < 0:
            raise LaunchError(f"{GPUS_OVERRIDE_ENV} must be an integer >= 0, got {override!r}")
        return n
    try:
        p = subprocess.run(
            [sys.executable, "-c", _COUNT_GPUS],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        return int(p.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


# ----------------------------------------------------------------------------
# MPS decision


@dataclass(frozen=True)
class MpsPlan:
    """What to do about MPS for one run.

    ``action``: ``"none"`` (no GPU is shared: MPS is left alone), ``"start"``
    (start a private daemon), ``"existing"`` (use the daemon at ``pipe_dir``),
    ``"timeslice"`` (ranks share GPUs without MPS). ``hide_existing``: with
    ``"timeslice"``, a daemon is reachable and must be hidden from the ranks.
    ``reason``: why, in words (printed with the time-slicing note)."""

    action: str
    pipe_dir: str | None = None
    hide_existing: bool = False
    reason: str = ""

    @property
    def uses_mps(self) -> bool:
        return self.action in ("start", "existing")


def mps_mode(value: str | None, env=None) -> str:
    """The MPS mode: ``value`` (the ``--mps`` option) if given, else
    ``$MOELINK_MPS``, else ``auto``; LaunchError for anything else."""
    source = "--mps"
    if value is None:
        value, source = _env.get(MPS_MODE_ENV, environ=env) or "auto", MPS_MODE_ENV
    mode = value.strip().lower()
    if mode not in MPS_MODES:
        raise LaunchError(f"{source} must be one of {', '.join(MPS_MODES)}, got {value!r}")
    return mode


def mps_percentage(value: str | None, env=None) -> str:
    """The MPS thread percentage: ``value`` (``--mps-percentage``) if given, else
    ``$MOELINK_MPS_PERCENTAGE``, else ``none``: ``none``, ``auto`` or a whole
    number 1 to 100 (as a string); LaunchError for anything else."""
    source = "--mps-percentage"
    if value is None:
        value, source = (
            _env.get(MPS_PERCENTAGE_ENV, environ=env) or "none",
            MPS_PERCENTAGE_ENV,
        )
    v = value.strip().lower()
    if v in ("none", "auto"):
        return v
    if v.isdigit() and 1 <= int(v) <= 100:
        return str(int(v))
    raise LaunchError(f"{source} must be none, auto or a whole number 1 to 100, got {value!r}")


def _control_answers(path: str) -> bool:
    """Whether an MPS control endpoint at ``path`` is live. The daemon listens on
    a UNIX socket named ``control`` and leaves it behind when it quits, so a
    socket must accept a connection; anything else counts by its existence."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not stat.S_ISSOCK(mode):
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def reachable_mps_daemon(env=None) -> str | None:
    """The pipe directory of a running MPS control daemon that CUDA clients
    started with ``env`` would connect to (``$CUDA_MPS_PIPE_DIRECTORY``, else
    ``/tmp/nvidia-mps``, whose ``control`` socket accepts a connection), or None."""
    env = os.environ if env is None else env
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
    return pipe_dir if _control_answers(os.path.join(pipe_dir, "control")) else None


def decide_mps(
    mode: str,
    num_ranks: int,
    num_gpus: int,
    *,
    is_root: bool,
    binary: str | None,
    existing_pipe_dir: str | None,
) -> MpsPlan:
    """The MPS plan for ``num_ranks`` round-robin ranks on ``num_gpus`` GPUs
    (the table in this module's docstring). ``binary``: the path of
    ``nvidia-cuda-mps-control`` or None; ``existing_pipe_dir``: a reachable
    daemon's pipe directory or None. LaunchError where ``mode`` is ``on`` and no
    daemon can be had."""
    if mode not in MPS_MODES:
        raise LaunchError(f"MPS mode must be one of {', '.join(MPS_MODES)}, got {mode!r}")
    if not ranks_share_gpus(num_ranks, num_gpus):
        return MpsPlan("none")
    if mode == "off":
        return MpsPlan(
            "timeslice", hide_existing=existing_pipe_dir is not None, reason="MPS is off"
        )
    if existing_pipe_dir is not None:
        return MpsPlan("existing", pipe_dir=existing_pipe_dir)
    if binary is None:
        why = f"{MPS_BINARY} is not on PATH"
    elif not is_root and mode == "auto":
        why = f"not running as root (--mps on starts {MPS_BINARY} anyway)"
    else:
        return MpsPlan("start")
    if mode == "on":
        raise LaunchError(f"--mps on: cannot use MPS: {why}")
    return MpsPlan("timeslice", reason=why)


# ----------------------------------------------------------------------------
# MPS daemon


class MpsDaemon:
    """A private MPS control daemon: pipe and log directories in a fresh
    temporary directory, started with ``nvidia-cuda-mps-control -d``, stopped
    with ``quit``."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.root = tempfile.mkdtemp(prefix="moelink-mps-")
        self.pipe_dir = os.path.join(self.root, "pipe")
        self.log_dir = os.path.join(self.root, "log")
        os.mkdir(self.pipe_dir)
        os.mkdir(self.log_dir)
        self.started = False

    @property
    def env(self) -> dict:
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def _control(self, args: list, stdin: str | None, what: str) -> str | None:
        """Runs the control binary; returns None on success, else why not. Its
        output goes to a file: a daemonised child may keep pipes open."""
        out_path = os.path.join(self.root, f"{what}.out")
        try:
            with open(out_path, "w+") as out:
                p = subprocess.run(
                    [self.binary, *args],
                    input=stdin,
                    stdin=None if stdin is not None else subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                    timeout=MPS_COMMAND_TIMEOUT_S,
                    text=True,
                )
                out.seek(0)
                text = out.read().strip()
        except subprocess.TimeoutExpired:
            return f"{self.binary} {' '.join(args)} took over {MPS_COMMAND_TIMEOUT_S:g} s"
        except OSError as e:
            return f"{self.binary}: {e}"
        if p.returncode != 0:
            return f"{self.binary} {' '.join(args)} exited {p.returncode}" + (
                f": {text}" if text else ""
            )
        return None

    def start(self) -> str | None:
        """Starts the daemon and waits for its control pipe; None on success,
        else why not (the caller stops what may have started)."""
        self.started = True  # from here on, stop() sends quit
        why = self._control(["-d"], None, "start")
        if why is not None:
            return why
        control = os.path.join(self.pipe_dir, "control")
        deadline = time.monotonic() + MPS_PIPE_WAIT_S
        while not os.path.exists(control):
            if time.monotonic() > deadline:
                return f"no control pipe in {self.pipe_dir} {MPS_PIPE_WAIT_S:g} s after the start"
            time.sleep(0.02)
        return None

    def stop(self) -> None:
        """Sends ``quit`` (where the daemon came up: its control socket exists)
        and removes the temporary directory. Says so, with the command to finish
        by hand, if quit fails."""
        why = None
        if self.started and os.path.exists(os.path.join(self.pipe_dir, "control")):
            why = self._control([], "quit\n", "quit")
        self.started = False
        if why is None:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # its directories stay: the daemon may still use them
            _log(
                f"could not stop the MPS daemon: {why}; stop it with: echo quit | "
                f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir} {self.binary}"
            )


# ----------------------------------------------------------------------------
# GPU sharing: the MPS plan put into effect, for the launcher and the main job


@dataclass
class GpuSharing:
    """How ``num_ranks`` ranks share ``num_gpus`` GPUs in one run: the
    placement, the MPS plan, and each rank's MPS variables (:meth:`env`)."""

    num_ranks: int
    num_gpus: int
    plan: MpsPlan
    placement: list = field(default_factory=list)
    mps_env: dict = field(default_factory=dict)
    #: ``none``, ``auto`` or a number 1..100 (:func:`mps_percentage`).
    percentage: str = "none"

    def thread_percentage(self, rank: int) -> int | None:
        """``rank``'s ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (None: not set)."""
        if not self.uses_mps or self.percentage == "none":
            return None
        if self.percentage == "auto":
            return self.placement[rank].thread_percentage
        return int(self.percentage)

    @property
    def shared(self) -> bool:
        return ranks_share_gpus(self.num_ranks, self.num_gpus)

    @property
    def uses_mps(self) -> bool:
        return self.plan.uses_mps

    def env(self, rank: int) -> dict:
        """MPS variables of ``rank``: the daemon's directories (or, MPS off, an
        empty pipe directory), its thread percentage, ``MOELINK_LAUNCH_MPS``."""
        out = dict(self.mps_env)
        pct = self.thread_percentage(rank)
        if pct is not None:
            out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
        out[_env.name("MOELINK_LAUNCH_MPS")] = "1" if self.uses_mps else "0"
        return out

    def variables(self, rank: int, port: int) -> dict:
        """Every variable ``rank`` gets: :func:`rank_env` (``port``: the rendezvous
        port) and :meth:`env`."""
        return {**rank_env(rank, self.num_ranks, port, self.num_gpus), **self.env(rank)}

    def describe(self) -> str:
        """E.g. ``4 ranks on 1 GPU (MPS)``, ``3 ranks on 2 GPUs (time-sliced)``."""
        gpus = f"{self.num_gpus} GPU{'s' if self.num_gpus != 1 else ''}"
        ranks = f"{self.num_ranks} rank{'s' if self.num_ranks != 1 else ''}"
        if self.num_gpus == 0:
            return f"{ranks}, no GPU"
        if not self.shared:
            return f"{ranks} on {gpus}, one per GPU"
        return f"{ranks} on {gpus} ({'MPS' if self.uses_mps else 'time-sliced'})"


def _percentages(sharing: GpuSharing) -> str:
    """How much of its GPU each rank may use, for the launcher's line."""
    values = sorted({sharing.thread_percentage(r) for r in range(sharing.num_ranks)} - {None})
    if not values:
        return (
            "each rank may use every SM (no MPS thread percentage); grids use (SMs - ranks) / ranks"
        )
    return "each rank may use " + " or ".join(f"{v}%" for v in values) + " of its GPU's SMs"


@contextlib.contextmanager
def gpu_sharing(
    num_ranks: int,
    num_gpus: int,
    mode: str = "auto",
    *,
    percentage: str | None = None,
    log=_log,
    env=None,
) -> Iterator[GpuSharing]:
    """Carries out the MPS plan of ``num_ranks`` round-robin ranks on ``num_gpus``
    GPUs (:func:`decide_mps` with this process's uid, ``PATH`` and environment)
    for the ``with`` block: starts a private daemon where the plan says so and
    stops it when the block ends, however it ends. Yields a :class:`GpuSharing`
    whose :meth:`GpuSharing.env` gives each rank's variables. Prints (``log``)
    one line saying what it did where ranks share GPUs. ``percentage``: as
    :func:`mps_percentage` (None: ``$MOELINK_MPS_PERCENTAGE``, else none).
    LaunchError where ``mode`` is ``on`` and no daemon can be had, or the
    percentage is invalid."""
    env = os.environ if env is None else env
    percentage = mps_percentage(percentage, env)
    binary = shutil.which(MPS_BINARY, path=env.get("PATH"))
    plan = decide_mps(
        mode,
        num_ranks,
        num_gpus,
        is_root=os.geteuid() == 0,
        binary=binary,
        existing_pipe_dir=reachable_mps_daemon(env),
    )
    sharing = GpuSharing(
        num_ranks, num_gpus, plan, placements(num_ranks, num_gpus), percentage=percentage
    )
    daemon = None
    hidden_dir = None
    try:
        if plan.action == "start":
            assert binary is not None
            daemon = MpsDaemon(binary)
            why = daemon.start()
            if why is None:
                sharing.mps_env = daemon.env
                log(
                    f"{sharing.describe()}: started an MPS control daemon ({daemon.pipe_dir}); "
                    f"{_percentages(sharing)}"
                )
            elif mode == "on":
                raise LaunchError(f"--mps on: could not start MPS: {why}")
            else:
                daemon.stop()
                daemon = None
                sharing.plan = plan = MpsPlan("timeslice", reason=f"starting MPS failed: {why}")
        elif plan.action == "existing":
            sharing.mps_env = {"CUDA_MPS_PIPE_DIRECTORY": plan.pipe_dir}
            log(
                f"{sharing.describe()}: using the running MPS daemon ({plan.pipe_dir}); "
                f"{_percentages(sharing)}"
            )
        if plan.action == "timeslice":
            if plan.hide_existing:
                hidden_dir = tempfile.mkdtemp(prefix="moelink-no-mps-")
                sharing.mps_env = {"CUDA_MPS_PIPE_DIRECTORY": hidden_dir}
            log(
                f"note: {sharing.num_ranks} ranks share {sharing.num_gpus} GPU(s) without MPS "
                f"({plan.reason}): their kernels time-slice; correct, but every wait between "
                "ranks costs milliseconds"
            )
        yield sharing
    finally:
        if daemon is not None:
            daemon.stop()
        if hidden_dir is not None:
            shutil.rmtree(hidden_dir, ignore_errors=True)


# ----------------------------------------------------------------------------
# Signals and supervision


@contextlib.contextmanager
def signals_raise(signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block, the first of ``signals`` raises :class:`Interrupted`
    (so ``finally`` clauses run: ranks are stopped, the MPS daemon quits); later
    ones are ignored while that cleanup runs. The old handlers come back after."""
    old = {}

    def handler(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    try:
        for s in signals:
            old[s] = signal.signal(s, handler)
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_code_of(returncode: int) -> int:
    """A process's exit status as a shell reports it (128 + N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_ranks(procs: list, grace_s: float) -> None:
    """SIGTERM to every running rank's process group, SIGKILL to those still
    running ``grace_s`` later, then SIGKILL to every rank's group (what a rank
    left behind)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def describe_failures(codes: list, exited_at: dict, now: float, mps: bool) -> tuple:
    """What the launcher says when ranks failed: ``(exit_code, lines)``.

    ``codes``: each rank's return code as ``Popen.poll`` gives it (None: running);
    ``exited_at``: rank -> monotonic time it was first seen exited with 0;
    ``mps``: whether the ranks share GPUs under MPS. Every rank that failed is
    named (several can be seen at one poll); a rank killed by a signal comes first
    and gives the exit code, being the likelier cause. Under MPS the lines add
    which rank's exit may have faulted the others: one killed by a signal, or one
    that exited 0 within ``MPS_EXIT_WINDOW_S`` before."""
    failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    if not failed:
        return 0, []
    failed.sort(key=lambda rc: (rc[1] >= 0, rc[0]))  # signals first, then by rank
    said = ", ".join(f"rank {r} {_describe_exit(c)}" for r, c in failed)
    lines = [f"{said}; stopping the other ranks"]
    if mps:
        killed = [f"rank {r} ({_describe_exit(c)})" for r, c in failed if c < 0]
        early = sorted((now - t, r) for r, t in exited_at.items() if now - t <= MPS_EXIT_WINDOW_S)
        causes = killed + [f"rank {r} (exited 0, {ago:.1f} s before)" for ago, r in early]
        if causes:
            lines.append(
                "under MPS a rank that exits while its kernels run faults the kernels of "
                "every other rank on its GPU (they report an illegal memory access): "
                f"look first at {', '.join(causes)}; run with --mps off to keep each "
                "rank's faults its own (docs/one-gpu.md)"
            )
    return exit_code_of(failed[0][1]), lines


def supervise(
    commands: list,
    envs: list,
    *,
    timeout_s: float | None,
    grace_s: float = DEFAULT_KILL_GRACE_S,
    mps: bool = False,
    log=_log,
) -> int:
    """Runs ``commands[r]`` with environment ``envs[r]`` for every rank ``r``,
    each in a process group of its own, until all exit 0 (returns 0), one exits
    non-zero (the others are stopped; returns its exit code, see
    :func:`describe_failures`), or ``timeout_s`` passes (all are stopped; returns
    124). Every rank's group is killed before it returns, also when it is
    interrupted. ``mps``: the ranks share GPUs under MPS (the failure message then
    names a rank whose exit may have faulted the others)."""
    procs: list = []
    exited_at: dict = {}
    try:
        for r, (cmd, env) in enumerate(zip(commands, envs)):
            try:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
                )
            except OSError as e:
                raise LaunchError(f"cannot start rank {r} ({cmd[0]}): {e}") from None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            # Before the failures: a rank seen leaving at the same poll as a
            # failure is a suspect too.
            for r, code in enumerate(codes):
                if code == 0:
                    exited_at.setdefault(r, now)
            exit_code, lines = describe_failures(codes, exited_at, now, mps)
            if lines:
                for line in lines:
                    log(line)
                return exit_code
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                left = [r for r, code in enumerate(codes) if code is None]
                print(
                    f"error: timeout: rank(s) {left} still running after {timeout_s:g} s; "
                    "killing them",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_TIMEOUT
            time.sleep(0.05)
    finally:
        stop_ranks(procs, grace_s)


# ----------------------------------------------------------------------------
# In a rank: the process group


@dataclass(frozen=True)
class DistInfo:
    """What :func:`init_distributed` set up.

    ``device``: ``cuda:<local_rank % device_count>`` (``cpu`` without a GPU);
    ``ranks_per_gpu``: local ranks on this rank's GPU (1 without a GPU);
    ``ranks_share_gpus``: whether any GPU of this host holds several ranks;
    ``backend``: ``gloo`` where ranks share GPUs (NCCL refuses that) or there is
    no GPU, else ``nccl``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: object  # torch.device
    ranks_per_gpu: int
    ranks_share_gpus: bool
    backend: str


def _env_int(env, name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise RuntimeError(
                f"init_distributed: ${name} is not set; start the script with "
                "python -m moelink.launch or torchrun"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"init_distributed: ${name} must be an integer, got {raw!r}") from None


def init_distributed(timeout_s: float = 600.0, backend: str | None = None) -> DistInfo:
    """Sets this rank's device and initialises ``torch.distributed`` for a script
    started by ``python -m moelink.launch`` or torchrun (env: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``).

    The device is ``local_rank % torch.cuda.device_count()``. The backend is gloo
    where the host's ranks outnumber its GPUs (``LOCAL_WORLD_SIZE >
    device_count``: NCCL refuses two ranks on one GPU) or there is no GPU, else
    NCCL bound to the device (``device_id``). ``backend`` overrides, and where it is
    None so does ``$MOELINK_DIST_BACKEND`` (``gloo`` or ``nccl``: the runs under
    compute-sanitizer take gloo, whose start-up does not probe NCCL's kernels with
    calls the sanitizer reports as API errors). ``timeout_s`` bounds every
    collective of the group. The no-multicast variables are set before the group
    is made. Where torch.distributed is already initialised,
    only the device is set and the group is described. Returns a
    :class:`DistInfo`.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    env = os.environ
    rank = _env_int(env, "RANK")
    world = _env_int(env, "WORLD_SIZE")
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world or not 0 <= local_rank < local_world:
        raise RuntimeError(
            f"init_distributed: rank {rank} of {world}, local rank {local_rank} of "
            f"{local_world} is not a valid placement"
        )
    if backend is None and _env.get("MOELINK_DIST_BACKEND"):
        backend = _env.get("MOELINK_DIST_BACKEND")
        if backend not in ("gloo", "nccl"):
            raise RuntimeError(
                f"init_distributed: $MOELINK_DIST_BACKEND must be gloo or nccl, got {backend!r}"
            )
    os.environ.update(NO_MULTICAST_ENV)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        device = torch.device("cpu")
        per_gpu, shared = 1, False
        chosen = backend or "gloo"
    else:
        index = local_rank % gpus
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        per_gpu = len(range(index, local_world, gpus))
        shared = local_world > gpus
        chosen = backend or ("gloo" if shared else "nccl")
    if dist.is_initialized():
        chosen = str(dist.get_backend())
    else:
        kwargs = {"device_id": device} if chosen == "nccl" else {}
        dist.init_process_group(
            chosen, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs
        )
    return DistInfo(rank, world, local_rank, local_world, device, per_gpu, shared, chosen)


# ----------------------------------------------------------------------------
# Command line


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``error: ...``, on stderr,
    with exit code 2 (no usage block, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def build_parser() -> CliParser:
    p = CliParser(
        prog="python -m moelink.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n", "--nproc-per-node", dest="nproc", type=int, required=True, help="ranks to start"
    )
    p.add_argument(
        "--mps",
        choices=MPS_MODES,
        help=f"MPS where ranks share a GPU (default: ${MPS_MODE_ENV}, else auto)",
    )
    p.add_argument(
        "--mps-percentage",
        metavar="none|auto|N",
        help=f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of every rank under MPS (default: "
        f"${MPS_PERCENTAGE_ENV}, else none; auto: 100 / ranks on the GPU)",
    )
    p.add_argument("--timeout", type=positive_seconds, help="seconds for the whole run")
    p.add_argument(
        "--kill-grace",
        type=positive_seconds,
        default=DEFAULT_KILL_GRACE_S,
        help=f"seconds between SIGTERM and SIGKILL (default: {DEFAULT_KILL_GRACE_S:g})",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--no-python", action="store_true", help="run prog as an executable, not a Python script"
    )
    how.add_argument("-m", "--module", action="store_true", help="run python -m prog")
    p.add_argument("prog", help="the script (module with -m, executable with --no-python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def rank_command(args) -> list:
    """The command line every rank runs."""
    if args.no_python:
        return [args.prog, *args.args]
    if args.module:
        return [sys.executable, "-m", args.prog, *args.args]
    return [sys.executable, args.prog, *args.args]


def check_args(args) -> None:
    """LaunchError for options that cannot work, before anything starts."""
    if args.nproc < 1:
        raise LaunchError(f"-n must be a positive number of ranks, got {args.nproc}")
    if args.no_python:
        if shutil.which(args.prog) is None:
            raise LaunchError(f"--no-python: {args.prog!r} is not an executable (or on PATH)")
    elif not args.module and not os.path.isfile(args.prog):
        raise LaunchError(f"no such script: {args.prog!r}")
    args.mps = mps_mode(args.mps)
    args.mps_percentage = mps_percentage(args.mps_percentage)


def main(argv=None) -> int:
    """``python -m moelink.launch``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        num_gpus = local_gpu_count()
    except LaunchError as e:
        parser.error(str(e))
    command = rank_command(args)
    code = 1
    with signals_raise():
        try:
            with gpu_sharing(
                args.nproc, num_gpus, args.mps, percentage=args.mps_percentage
            ) as sharing:
                if num_gpus == 0:
                    _log(f"no CUDA GPU found: {args.nproc} ranks run without one")
                port = free_port()
                envs = [{**os.environ, **sharing.variables(r, port)} for r in range(args.nproc)]
                code = supervise(
                    [command] * args.nproc,
                    envs,
                    timeout_s=args.timeout,
                    grace_s=args.kill_grace,
                    mps=sharing.uses_mps,
                )
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            code = EXIT_USAGE
        except Interrupted as e:
            _log(f"got {signal.Signals(e.signum).name}: stopped the ranks")
            code = 128 + e.signum
    return code


if __name__ == "__main__":
    sys.exit(main())
