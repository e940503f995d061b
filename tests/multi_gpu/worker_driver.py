"""Scenario driver shared by the torchrun workers (intranode, allreduce,
low-latency): the hang watchdog, the scenario selection from an environment
variable, and one scenario run whose verdict every rank agrees on before rank 0
prints ``PASS <name>`` / ``FAIL <name>: ...``.

The workers run as scripts (``python tests/multi_gpu/<worker>.py``), so they import
this module by its bare name from their own folder.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch.distributed as dist


class Watchdog:
    """Ends the process with a FAIL line when a scenario runs past its time: a hang
    in a kernel or a collective must not keep the test (and the GPUs) forever."""

    def __init__(self, name: str, rank: int, seconds: float) -> None:
        self.name, self.rank, self.seconds = name, rank, seconds
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        print(
            f"FAIL {self.name} [rank {self.rank}]: no progress for {self.seconds} s (hang?)",
            flush=True,
        )
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


def run_scenario(
    name: str, fn, *, rank: int, world: int, gloo, timeout_s: float, sync, on_failure
) -> bool:
    """Runs ``fn()`` then ``sync()`` under a watchdog; a raise is this rank's FAIL
    line. The ranks agree on the verdict over ``gloo``; rank 0 prints PASS / FAIL
    with the failed ranks; if any rank failed, ``on_failure()`` replaces what the
    scenario may have left broken. Returns True if every rank passed."""
    start = time.perf_counter()
    ok = True
    with Watchdog(name, rank, timeout_s):
        try:
            fn()
            sync()
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
        if failed:
            on_failure()
    return not failed
