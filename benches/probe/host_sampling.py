"""The sampling loop of the host-parts probes (``ll_host_parts.py``,
``combine_host_parts.py``): CPU time from a call to its return, in interleaved
rounds, the GPU synchronized before each sample outside the timed region."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

# The normal-mode probes' shape: tokens, hidden, top-k, experts.
N, H, TOPK, E = 4096, 7168, 8, 256


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


def probe_args(doc: str, iters: int, argv=None) -> argparse.Namespace:
    """The probes' options: ``--iters`` (default ``iters``) and ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def normal_setup(seed: int) -> SimpleNamespace:
    """The normal-mode probes' start (under ``moelink.launch``): the process
    group, a Buffer sized for ``N`` x ``H`` bf16 tokens, random ``x`` / top-k
    ids / weights of the standard shape (generator seeded ``seed + rank``), and
    their layout. Fields: torch, dist, rank, dev, buf, x, idx, w, per_rank,
    per_expert, in_rank, and ``dispatch(**kw)``: the full dispatch of them."""
    import moelink
    import torch
    import torch.distributed as dist
    from moelink.launch import init_distributed

    init_distributed()
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    nvl = moelink.Config(num_sms=24).get_nvl_buffer_size_hint(H * 2, size, max_tokens_per_rank=N)
    buf = moelink.Buffer(dist.group.WORLD, nvl, explicitly_destroy=True)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(N, E, generator=g).topk(TOPK, dim=1).indices.to(dev)
    w = torch.rand(N, TOPK, generator=g).to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    s = SimpleNamespace(torch=torch, dist=dist, rank=rank, dev=dev, buf=buf, x=x, idx=idx, w=w)
    s.per_rank, s.per_expert, s.in_rank = per_rank, per_expert, in_rank

    def dispatch(**kw):
        return buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **kw,
        )  # fmt: skip

    s.dispatch = dispatch
    return s
