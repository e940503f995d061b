"""A rank killed mid-dispatch: every other rank raises ``moelink.TimeoutError``
naming it within the device time bound, and no process hangs.

Every rank builds a ``moelink.Buffer`` (``MOELINK_DEVICE_TIMEOUT_S=3``, set here
before moelink loads) and runs one dispatch and combine. Then the last rank (the
victim) starts a second dispatch with ``async_finish=True`` and leaves at once with
``os._exit(0)``: no teardown, its CUDA context dies with the process while its
kernels run (it exits 0 because the launcher stops every rank on a non-zero exit).
The others run the same dispatch, then a combine, synchronizing and calling
``check()`` after each: one of these must raise ``moelink.TimeoutError`` that names
a rank ("from rank N"), within ``BOUND_S`` of the dispatch's start.

The rank named is the one this rank waited for, and a survivor that gave up stops
too: across emulated nodes (``MOELINK_RANKS_PER_NODE=L``) a rank of another node
waits for the victim's node through a forwarder (measured, 4 x 2: rank 6, the
victim's node-mate, waited in its combine for rank 2, which had stopped at its
dispatch's wait for the victim). So the contract is the chain: following "names"
from any survivor reaches the victim, without a cycle. The survivors post what
they named as files in a folder of this host (``MOELINK_KILLED_DIR``, default
the temporary folder; the emulated nodes share it) and each checks the whole
chain. Each survivor prints ``PASS killed_rank [rank r]`` or ``FAIL killed_rank
[rank r]: ...`` and leaves with ``os._exit`` (a Buffer whose peer is gone is not
torn down collectively); the exit code is 1 on FAIL.

Run with 2 or more ranks under ``python -m moelink.launch`` (or torchrun), all on
one host; where ranks share a GPU, without MPS (``--mps off``): under MPS a client
that exits while its kernel runs faults every other client of the GPU
(``benches/mps_kill_probe.py``), so the survivors would get an illegal memory access
instead of the TimeoutError this test asks for.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

DEVICE_TIMEOUT_S = 3
os.environ["MOELINK_DEVICE_TIMEOUT_S"] = str(DEVICE_TIMEOUT_S)

import moelink  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_driver  # noqa: E402
from intranode_worker import buffer_bytes, layout_args  # noqa: E402

#: Seconds from the survivors' dispatch to the TimeoutError, at most: the
#: dispatch's and the combine's device bounds, the host's wait for notify's
#: counts, and launch and synchronization slack.
BOUND_S = 4 * DEVICE_TIMEOUT_S + 10
TOKENS, HIDDEN, TOPK = 128, 2048, 4


def inputs(rank: int, world: int, device):
    g = torch.Generator().manual_seed(1000 + rank)
    experts = 4 * world
    scores = torch.rand(TOKENS, experts, generator=g)
    idx = scores.topk(TOPK, dim=1).indices
    w = torch.rand(TOKENS, TOPK, generator=g)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    return x.to(device), idx.to(device), w.to(device), experts


def dispatch(buf: moelink.Buffer, x, idx, w, experts: int, **kwargs):
    layout = layout_args(buf, idx, experts)
    return buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout, **kwargs)


def settle(buf: moelink.Buffer, device) -> None:
    """Waits for this rank's kernels (each wait on the GPU is bounded), then
    raises what they recorded."""
    torch.cuda.synchronize(device)
    buf.check()


def main() -> int:
    wg = worker_driver.init_worker(120)
    rank, world, dev = wg.rank, wg.world, wg.device
    victim = world - 1
    # A fault under MPS is logged by the server with the client's PID: name it.
    print(f"killed_worker: rank {rank} pid {os.getpid()}", flush=True)
    survivors = [r for r in range(world) if r != victim]
    buf = moelink.Buffer(wg.group, *buffer_bytes(world, HIDDEN, TOKENS), explicitly_destroy=True)
    x, idx, w, experts = inputs(rank, world, dev)
    # One round that every rank finishes: the Buffer works before the kill.
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, x, idx, w, experts)
    buf.combine(recv_x, handle, topk_weights=recv_w)
    settle(buf, dev)
    del recv_x, recv_w, handle
    # A folder of this run's posts (rank 0 names it; every rank agrees before the kill).
    token = [None]
    if rank == 0:
        root = os.environ.get("MOELINK_KILLED_DIR") or tempfile.gettempdir()
        token[0] = tempfile.mkdtemp(prefix="moelink-killed-", dir=root)
    dist.broadcast_object_list(token, src=0, group=wg.gloo)
    folder = token[0]
    dist.barrier(group=wg.gloo)
    if rank == victim:
        dispatch(buf, x, idx, w, experts, async_finish=True)
        sys.stdout.flush()
        os._exit(0)
    t0 = time.time()
    error = None
    try:
        recv_x, _, recv_w, _, handle, _ = dispatch(buf, x, idx, w, experts)
        settle(buf, dev)
        buf.combine(recv_x, handle, topk_weights=recv_w)
        settle(buf, dev)
    except moelink.TimeoutError as e:
        error = e
    took = time.time() - t0
    named = worker_driver.post_and_collect(folder, rank, survivors, worker_driver.named_rank(error))
    missing = [r for r in survivors if r not in named]
    if error is None:
        why = f"no TimeoutError after the victim (rank {victim}) left ({took:.1f} s)"
    elif took > BOUND_S:
        why = f"the TimeoutError came after {took:.1f} s (bound {BOUND_S} s)"
    elif missing:
        why = f"ranks {missing} posted nothing in {worker_driver.POST_WAIT_S} s"
    else:
        fault = worker_driver.chain_fault(rank, named, victim)
        why = None if fault is None else f"{fault}: {str(error)[:300]}"
    if why is None:
        print(f"PASS killed_rank [rank {rank}] ({took:.1f} s): {str(error)[:160]}", flush=True)
    else:
        print(f"FAIL killed_rank [rank {rank}]: {why}", flush=True)
    sys.stdout.flush()
    os._exit(0 if why is None else 1)


if __name__ == "__main__":
    main()
