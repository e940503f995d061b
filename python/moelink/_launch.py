"""Runs one spawned process per local GPU and collects one report (a dict) from
each: what the main job and the peer-write diagnostic share."""

from __future__ import annotations

import queue as queue_mod
import socket
import time


def run_local_ranks(worker, num_ranks: int, payload, timeout_s: float) -> list:
    """Starts ``worker(rank, num_ranks, port, payload, queue)`` in ``num_ranks``
    spawned processes (``port``: a free 127.0.0.1 port for the process group) and
    returns the dicts they put on ``queue``, sorted by ``"rank"``.

    A rank that dies without reporting ends the wait (its peers cannot finish
    either); after a report with ``"error"`` the others get 30 s more. A rank that
    did not report within ``timeout_s`` appears as ``{"rank": r, "error": ...}``.
    """
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, num_ranks, port, payload, q)) for r in range(num_ranks)
    ]
    for p in procs:
        p.start()
    reports: dict = {}
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
                deadline = min(deadline, time.monotonic() + 30)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for r, p in enumerate(procs):
        if r not in reports:
            why = f"exit code {p.exitcode}" if p.exitcode is not None else "no report in time"
            reports[r] = {"rank": r, "error": f"rank {r} did not report ({why})"}
    return [reports[r] for r in sorted(reports)]
