"""Runs one spawned process per rank and collects one report (a dict) from each:
what the main job and the peer-write diagnostic share."""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import time

#: Seconds the other ranks get to report after one reported an error.
AFTER_ERROR_S = 30.0


@contextlib.contextmanager
def _environ(values: dict):
    """``os.environ`` with ``values`` set for the block (a process started in it
    inherits them), restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_local_ranks(worker, num_ranks: int, payload, timeout_s: float, sharing=None) -> list:
    """Starts ``worker(rank, num_ranks, port, payload, queue)`` in ``num_ranks``
    spawned processes (``port``: a free 127.0.0.1 port for the process group) and
    returns the dicts they put on ``queue``, sorted by ``"rank"``.

    Each process starts with the variables of ``moelink.launch`` (``RANK``,
    ``LOCAL_WORLD_SIZE``, ...; rank ``r`` on GPU ``r % G``), so the worker calls
    ``moelink.launch.init_distributed``. ``sharing``: the
    ``moelink.launch.GpuSharing`` (MPS daemon) the caller holds; None: one is
    set up for this call (mode ``$MOELINK_MPS``, else auto).

    A rank that dies without reporting ends the wait (its peers cannot finish
    either); after a report with ``"error"`` the others get 30 s more. A rank that
    did not report within ``timeout_s`` appears as ``{"rank": r, "error": ...}``.
    The processes are stopped before it returns, also when it is interrupted.
    """
    from .launch import gpu_sharing, local_gpu_count, mps_mode

    if sharing is None:
        with gpu_sharing(num_ranks, local_gpu_count(), mps_mode(None)) as own:
            return run_local_ranks(worker, num_ranks, payload, timeout_s, own)

    import torch.multiprocessing as mp

    from .launch import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    reports: dict = {}
    finished = False
    try:
        for r in range(num_ranks):
            p = ctx.Process(target=worker, args=(r, num_ranks, port, payload, q))
            with _environ(sharing.variables(r, port)):
                p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        while len(reports) < num_ranks and time.monotonic() < deadline:
            try:
                r = q.get(timeout=0.5)
                reports[r["rank"]] = r
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if any(i not in reports for i in dead):
                    break
                if any("error" in r for r in reports.values()):
                    deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
        finished = True
    finally:
        for p in procs:
            if finished:
                p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r, p in enumerate(procs):
        if r not in reports:
            why = f"exit code {p.exitcode}" if p.exitcode is not None else "no report in time"
            reports[r] = {"rank": r, "error": f"rank {r} did not report ({why})"}
    return [reports[r] for r in sorted(reports)]
