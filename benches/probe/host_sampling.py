"""The sampling loop of the host-parts probes (``ll_host_parts.py``,
``combine_host_parts.py``): CPU time from a call to its return, in interleaved
rounds, the GPU synchronized before each sample outside the timed region."""

from __future__ import annotations

import json
import time


def timed(fn, n: int, sync, warm: int = 3) -> list:
    """``n`` CPU times (ns) of ``fn()`` after ``warm`` untimed calls, ``sync()``
    before each."""
    out = []
    for i in range(n + warm):
        sync()
        t0 = time.perf_counter_ns()
        fn()
        dt = time.perf_counter_ns() - t0
        if i >= warm:
            out.append(dt)
    return out


def sample_rows(rows: dict, iters: int, sync, skip=(), each_round=None, rounds: int = 10) -> dict:
    """``{name: [ns, ...]}`` of every row of ``rows`` (name -> callable) but those
    in ``skip``, about ``iters`` samples each over ``rounds`` interleaved rounds;
    ``each_round(per, samples)`` (where given) adds its own samples at the end of
    each round (``per``: samples per row and round)."""
    samples = {name: [] for name in rows}
    per = max(1, iters // rounds)
    for _ in range(rounds):
        for name, fn in rows.items():
            if name not in skip:
                samples[name].extend(timed(fn, per, sync))
        if each_round is not None:
            each_round(per, samples)
    return samples


def report(med: dict, json_path, **extra) -> None:
    """Prints every row of ``med`` (name -> median us) with its ratio to
    ``x.add_(0)``'s and writes ``{**extra, "median_us": med}`` to ``json_path``
    (where given)."""
    width = max(len(name) for name in med)
    for name, v in med.items():
        print(f"{name:{width}s} {v:8.2f} us  {v / med['x.add_(0)']:5.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**extra, "median_us": med}, f, indent=1)
