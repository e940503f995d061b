"""Scenario driver shared by the torchrun workers (intranode, allreduce,
low-latency): the process-group setup (ranks may share GPUs), the hang watchdog,
the scenario selection from an environment variable, the run's shared seed,
quiesced free-memory readings, one scenario run whose verdict every rank agrees
on before rank 0 prints ``PASS <name>`` / ``FAIL <name>: ...``, and the frame of
a worker's ``main`` around its scenario runs.

The workers run as scripts (``python tests/multi_gpu/<worker>.py``), so they import
this module by its bare name from their own folder.
"""

from __future__ import annotations

import cProfile
import faulthandler
import functools
import io
import json
import os
import pstats
import re
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from moelink.launch import init_distributed


@dataclass
class WorkerGroup:
    """What a worker's ``main`` sets up: the rank, its device, the group the
    Buffers are made on (``group``: NCCL where every rank has its own GPU, gloo
    where ranks share one, since NCCL refuses that) and a gloo group for control
    messages (``gloo``; the same group where ranks share a GPU)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup
    gloo: dist.ProcessGroup
    ranks_per_gpu: int

    @property
    def shares_gpu(self) -> bool:
        return self.ranks_per_gpu > 1


#: ``MOELINK_TEST_THREADS=N``: CPU threads per worker for the inputs and the
#: references (default: the CPUs this process may run on, shared among the
#: host's ranks, at most ``MAX_TEST_THREADS``).
THREADS_ENV = "MOELINK_TEST_THREADS"
MAX_TEST_THREADS = 16


def cpu_threads(local_world: int) -> int:
    """CPU threads for one of ``local_world`` workers on this host. torchrun sets
    ``OMP_NUM_THREADS=1``, which left every worker building its inputs and the
    references on one core (most of a checked round's second, measured by
    ``$MOELINK_TEST_PROFILE``); ``$MOELINK_TEST_THREADS`` overrides."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"${THREADS_ENV} must be a positive number of threads, got {raw!r}")
        return n
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_TEST_THREADS, (cpus or 1) // max(1, local_world)))


def init_worker(control_timeout_s: float) -> WorkerGroup:
    """Process group and device of a worker started by torchrun or
    ``python -m moelink.launch``: device ``local_rank % device_count``; CPU
    threads from ``cpu_threads``."""
    torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    d = init_distributed(timeout_s=control_timeout_s)
    if d.backend == "gloo":
        gloo = dist.group.WORLD
    else:
        gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    return WorkerGroup(
        d.rank, d.world_size, d.local_rank, d.device, dist.group.WORLD, gloo, d.ranks_per_gpu
    )


def quiesced_free_memory(device: torch.device, gloo) -> int:
    """Free device memory read while no rank of the group allocates or frees:
    ranks that share the GPU move its free memory too, so every rank releases
    its cache, the ranks meet, read, and meet again."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    dist.barrier(group=gloo)
    free = torch.cuda.mem_get_info(device)[0]
    dist.barrier(group=gloo)
    return free


#: ``1``: every ``in_step`` behaves as ``together=False`` (an experiment switch:
#: how the 8-rank forced-proxy timeouts were reproduced).
LOOSE_STEPS_ENV = "MOELINK_TEST_LOOSE_STEPS"


def in_step(fn, group=None, *, together: bool = True):
    """Calls ``fn`` (one call every rank makes, such as a low-latency dispatch)
    once every rank of ``group`` is here, and leaves it together: if ``fn``
    raised on any rank, every rank raises (its own exception, or a RuntimeError
    naming the ranks that raised). So the ranks' next collective is the same
    one, also after a failure (a rank leaving alone would wait in another).

    ``together=False``: ranks enter together but leave on their own, as in a
    framework that launches a call and moves on (each rank's next kernels may
    start while a peer still launches this call). A rank that raises then
    leaves the others in their next collective until the watchdog ends the run."""
    dist.barrier(group=group)
    if not together or os.environ.get(LOOSE_STEPS_ENV) == "1":
        return fn()
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    said = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(said, mine, group=group)
    if error is not None:
        raise error
    raised = [f"rank {r}: {m}" for r, m in enumerate(said) if m is not None]
    if raised:
        raise RuntimeError("another rank's call raised; " + "; ".join(raised))
    return result


def all_gather_tensor(t: torch.Tensor, group) -> list:
    """Every rank's ``t`` (same shape), through ``group`` whatever its backend
    (gloo moves CPU tensors only)."""
    if dist.get_backend(group) == "nccl":
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return out
    host = t.cpu()
    out = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, host, group=group)
    return [o.to(t.device) for o in out]


class Watchdog:
    """Ends the process with a FAIL line when a scenario runs past its time: a hang
    in a kernel or a collective must not keep the test (and the GPUs) forever."""

    def __init__(self, name: str, rank: int, seconds: float) -> None:
        self.name, self.rank, self.seconds = name, rank, seconds
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        print(
            f"FAIL {self.name} [rank {self.rank}]: no progress for {self.seconds} s (hang?); "
            "where every thread of this rank is:",
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(3)

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False


def selected_scenarios(env: str, known: tuple) -> list[str]:
    """The scenarios named in ``$env`` (a comma list), else all of ``known``;
    ValueError for a name not in ``known``."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return list(known)
    names = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise ValueError(f"{env}: unknown scenarios {unknown}; known: {known}")
    return names


def scenario_table(namespace: dict, names: tuple) -> dict:
    """``{name: scenario_<name>}`` for every one of ``names``, in order, from a
    worker's ``globals()`` (a KeyError names a scenario without its function)."""
    return {name: namespace[f"scenario_{name}"] for name in names}


def shared_seed(env: str, rank: int, gloo) -> int:
    """The run's data seed, the same on every rank: ``$env`` where it is set and
    not 0, else one rank 0 draws; rank 0 prints how to replay the run."""
    seed = [int(os.environ.get(env, "0")) or int.from_bytes(os.urandom(6), "little")]
    dist.broadcast_object_list(seed, src=0, group=gloo)
    if rank == 0:
        print(f"seed {seed[0]} ({env}={seed[0]} replays this run)", flush=True)
    return seed[0]


def start_scenarios(
    wg: WorkerGroup,
    scenarios_env: str,
    known: tuple,
    seed_env: str,
    *,
    who: str = "",
    note: str = "",
) -> tuple[list[str], int]:
    """The scenarios selected through ``scenarios_env`` (``selected_scenarios``) and
    the seed every rank shares (``shared_seed``); rank 0 prints them with where
    the ranks run, between ``who`` and ``note``."""
    names = selected_scenarios(scenarios_env, known)
    seed = shared_seed(seed_env, wg.rank, wg.gloo)
    if wg.rank == 0:
        print(
            f"{who}scenarios {','.join(names)} on {wg.world} ranks, "
            f"{wg.ranks_per_gpu} per GPU ({dist.get_backend(wg.group)}){note}",
            flush=True,
        )
    return names, seed


#: ``MOELINK_TEST_PROFILE=N``: rank 0 runs each scenario under cProfile and prints
#: the N functions with the most own time after its verdict (where a scenario's
#: seconds go: the GPU waits, the references, the checks).
PROFILE_ENV = "MOELINK_TEST_PROFILE"


def _profile_top() -> int:
    raw = os.environ.get(PROFILE_ENV, "").strip()
    try:
        return max(int(raw), 0) if raw else 0
    except ValueError:
        raise ValueError(f"${PROFILE_ENV} must be a number of lines, got {raw!r}") from None


def run_scenario(
    name: str, fn, *, rank: int, world: int, gloo, timeout_s: float, sync, on_failure
) -> bool:
    """Runs ``fn()`` then ``sync()`` under a watchdog; a raise is this rank's FAIL
    line. The ranks agree on the verdict over ``gloo``; rank 0 prints PASS / FAIL
    with the failed ranks (then, with ``$MOELINK_TEST_PROFILE``, its profile); if
    any rank failed, ``on_failure()`` replaces what the scenario may have left
    broken. Returns True if every rank passed."""
    top = _profile_top() if rank == 0 else 0
    prof = cProfile.Profile() if top else None
    start = time.perf_counter()
    ok = True
    with Watchdog(name, rank, timeout_s):
        try:
            if prof is not None:
                prof.enable()
            try:
                fn()
                sync()
            finally:
                if prof is not None:
                    prof.disable()
        except Exception as e:  # noqa: BLE001 - every failure becomes a FAIL line
            ok = False
            print(f"FAIL {name} [rank {rank}]: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        verdicts = [None] * world
        dist.all_gather_object(verdicts, ok, group=gloo)
        failed = [r for r, v in enumerate(verdicts) if not v]
        if rank == 0:
            seconds = time.perf_counter() - start
            if failed:
                print(f"FAIL {name}: failed on ranks {failed} ({seconds:.1f} s)", flush=True)
            else:
                print(f"PASS {name} ({seconds:.1f} s)", flush=True)
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
            print(f"profile {name} (rank 0, by own time):\n{text.getvalue()}", flush=True)
        if failed:
            on_failure()
    return not failed


def run_scenarios(wg: WorkerGroup, names, run, *, timeout_s: float, on_failure, sync=None) -> int:
    """Runs each of ``names`` as one scenario (``run_scenario``): ``run(name)``,
    then ``sync()`` (default: ``torch.cuda.synchronize``); ``on_failure()`` after
    one that failed on any rank. Returns the exit status: 1 if any failed."""
    status = 0
    for name in names:
        passed = run_scenario(
            name,
            functools.partial(run, name),
            rank=wg.rank,
            world=wg.world,
            gloo=wg.gloo,
            timeout_s=timeout_s,
            sync=sync or torch.cuda.synchronize,
            on_failure=on_failure,
        )
        if not passed:
            status = 1
    return status


def destroy_after_failure(obj, what: str, rank: int) -> None:
    """Destroys ``obj`` (the ``what``, a communicator or Buffer that a failed
    scenario may have left broken) once the GPU is done; what that raises is
    printed, not raised."""
    try:
        torch.cuda.synchronize()
        obj.destroy()
    except Exception as e:  # noqa: BLE001 - the object is being replaced anyway
        print(f"[rank {rank}] destroying the {what} after a failure: {e!r}", flush=True)


def run_worker(wg: WorkerGroup, body) -> int:
    """A worker's ``main`` once its group is up: ``body()`` (the setup and the
    scenario runs; returns the exit status), then a barrier of every rank. A
    raise anywhere is this rank's ``FAIL setup`` line and exit status 1; the
    process group is destroyed in any case. Returns the exit status."""
    status = 0
    try:
        status = body()
        dist.barrier(group=wg.gloo)
    except Exception as e:  # noqa: BLE001 - any failure becomes a FAIL line
        print(f"FAIL setup [rank {wg.rank}]: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        status = 1
    finally:
        dist.destroy_process_group()
    return status


def worker_main(control_timeout_s: float, run_all) -> int:
    """The whole ``main`` of a worker: its group (``init_worker``), then
    ``run_all(group)`` (the setup and the scenario runs; returns the exit status)
    inside ``run_worker``. Returns the exit status."""
    wg = init_worker(control_timeout_s)
    return run_worker(wg, lambda: run_all(wg))


# The blame chain of a rank that died (killed_worker.py): every survivor's
# TimeoutError names the rank it waited for; following the names from any
# survivor must reach the dead rank. The survivors compare notes through files
# in a folder of the host (the emulated nodes share it).

#: Seconds a survivor waits for the others' posts.
POST_WAIT_S = 30


def named_rank(error: BaseException | None) -> int | None:
    """The rank a TimeoutError says this rank waited for ("from rank N")."""
    m = re.search(r"from rank (\d+)", str(error)) if error is not None else None
    return int(m.group(1)) if m else None


def chain_fault(rank: int, named: dict[int, int | None], dead: int) -> str | None:
    """Why following the names from ``rank`` (``named``: survivor -> the rank it
    named, None for none) does not reach ``dead``; None when it does."""
    seen = [rank]
    while seen[-1] != dead:
        nxt = named.get(seen[-1])
        if nxt is None:
            return f"rank {seen[-1]} named no rank (chain {seen})"
        if nxt in seen:
            return f"the chain {seen + [nxt]} has a cycle"
        if nxt != dead and nxt not in named:
            return f"rank {nxt} (chain {seen + [nxt]}) is not a survivor that posted"
        seen.append(nxt)
    return None


def _wait_for_files(folder: str, names: list[str], deadline: float) -> list[str]:
    """The files of ``names`` in ``folder`` that appeared before ``deadline``."""
    while True:
        there = [n for n in names if os.path.exists(os.path.join(folder, n))]
        if len(there) == len(names) or time.time() > deadline:
            return there
        time.sleep(0.05)


def post_and_collect(
    folder: str, rank: int, survivors: list[int], mine: int | None
) -> dict[int, int | None]:
    """Posts the rank this one named (``mine``) into ``folder`` and returns every
    survivor's post that came within ``POST_WAIT_S``. The lowest survivor then
    removes the folder, once each survivor has read the posts (bounded alike)."""
    tmp = os.path.join(folder, f".{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump({"named": mine}, f)
    os.replace(tmp, os.path.join(folder, f"{rank}.json"))
    deadline = time.time() + POST_WAIT_S
    posts: dict[int, int | None] = {}
    for name in _wait_for_files(folder, [f"{r}.json" for r in survivors], deadline):
        with open(os.path.join(folder, name)) as f:
            posts[int(name.split(".")[0])] = json.load(f)["named"]
    open(os.path.join(folder, f"{rank}.read"), "w").close()
    if rank == min(survivors):
        _wait_for_files(folder, [f"{r}.read" for r in survivors], time.time() + POST_WAIT_S)
        shutil.rmtree(folder, ignore_errors=True)
    return posts


def bad_ids_failure(launch, check, device, token: int, column: int) -> str | None:
    """Runs ``launch()``, a collective call (every rank makes it) whose ``topk_idx``
    holds an expert id out of range at (``token``, ``column``). The kernels flag it:
    the ``ValueError`` comes at the end of that call, or, where the call does not
    wait for the GPU, from ``check()`` once the GPU has run it. Returns None when
    it named the token and column, else what went wrong."""
    msg = None
    try:
        launch()
    except ValueError as e:
        msg = str(e)
    if msg is None:
        torch.cuda.synchronize(device)
        try:
            check()
        except ValueError as e:
            msg = str(e)
    if msg is None:
        return "no ValueError, neither from the call nor from check()"
    want = f"token {token}, column {column}"
    if want not in msg or "topk_idx" not in msg:
        return f"the ValueError does not name topk_idx and {want!r}: {msg}"
    try:
        check()
    except ValueError as e:
        return f"reported twice: {e}"
    return None
