"""Peer-write diagnostic: can every GPU of a job store into every other's memory?

Each rank allocates a buffer with one slot per rank, the ranks exchange their
buffers' CUDA IPC handles through the torch.distributed group, every rank maps
its peers' buffers and one Rust-launched kernel writes a rank-specific pattern
into slot ``rank`` of every buffer over NVLink. Each rank then checks every slot
of its own (poisoned beforehand) buffer against the pattern computed on the CPU.
"""

from __future__ import annotations

import random
import time

from . import _native


def peer_write_check(group=None, words: int = 1 << 20, seed: int | None = None) -> dict:
    """Runs the diagnostic on every rank of ``group``; returns this rank's report.

    Raises ``RuntimeError`` naming the source ranks whose data arrived wrong.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("peer_write_check needs torch.distributed to be initialised")
    if words <= 0:
        raise ValueError(f"words must be positive, got {words}")
    rank = dist.get_rank(group)
    nranks = dist.get_world_size(group)
    device = torch.cuda.current_device()

    # All ranks agree on one fresh seed.
    box = [seed if seed is not None else random.getrandbits(63)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    seed = int(box[0])

    check = _native.PeerWriteCheck(device, rank, nranks, words)
    handles: list = [None] * nranks
    dist.all_gather_object(handles, check.export(), group=group)
    check.connect(handles)
    dist.barrier(group=group)  # every buffer poisoned and mapped before anyone writes

    stream = torch.cuda.current_stream()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record(stream)
    check.write(stream.cuda_stream, seed)
    end.record(stream)
    end.synchronize()
    wall = time.perf_counter() - t0
    dist.barrier(group=group)  # every rank's writes are complete

    bad = check.verify(seed)
    kernel_ms = start.elapsed_time(end)
    report = {
        "rank": rank,
        "nranks": nranks,
        "device": device,
        "words_per_slot": words,
        "seed": seed,
        "bytes_written": words * 8 * nranks,
        "kernel_ms": kernel_ms,
        "wall_s": wall,
        "mismatches": bad,
    }
    if bad:
        detail = "; ".join(
            f"from rank {s}: {n} bad words, first at {i} (expected {e:#x}, got {g:#x})"
            for s, i, n, e, g in bad
        )
        raise RuntimeError(f"rank {rank}: peer-write check failed: {detail}")
    return report


def _local_worker(rank: int, nranks: int, port: int, words: int, queue) -> None:
    import torch.distributed as dist

    from .launch import init_distributed

    try:
        # RANK, LOCAL_WORLD_SIZE, MASTER_PORT, MPS: set by run_on_local_gpus.
        init_distributed(backend="gloo")
    except Exception as e:  # reported by the parent
        queue.put({"rank": rank, "error": repr(e)})
        return
    try:
        report = peer_write_check(words=words)
        report.pop("mismatches")
        queue.put(report)
    except Exception as e:  # reported by the parent
        queue.put({"rank": rank, "error": repr(e)})
    finally:
        dist.destroy_process_group()


def run_on_local_gpus(nranks: int, words: int, timeout_s: float = 120.0, sharing=None) -> list:
    """Runs :func:`peer_write_check` on ``nranks`` spawned processes, rank ``r`` on
    local GPU ``r % G`` (several per GPU where ranks outnumber GPUs), over a gloo
    group. ``sharing``: a ``moelink.launch.GpuSharing`` whose MPS daemon the
    caller holds; None: one is set up here for the run (``$MOELINK_MPS``).

    Returns the reports sorted by rank; a rank that died or did not report
    within ``timeout_s`` appears as ``{"rank": r, "error": ...}``.
    """
    from ._launch import run_local_ranks

    return run_local_ranks(_local_worker, nranks, words, timeout_s, sharing)
