"""MOELINK_TRAP_ON_TIMEOUT=1: a device wait that runs out traps its kernel, so the
call fails loudly (the CUDA context is lost) instead of returning. Rank 1 skips a
low-latency dispatch; rank 0's dispatch must trap within seconds, and rank 0
prints ``PASS trap_on_timeout`` when its synchronize raised.

Run with 2 ranks under ``python -m moelink.launch`` (or torchrun); it sets its own
environment (the trap switch and a 1 s device timeout) before moelink loads.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["MOELINK_TRAP_ON_TIMEOUT"] = "1"
os.environ["MOELINK_LL_TIMEOUT_S"] = "1"

import moelink  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_driver  # noqa: E402


def main() -> int:
    wg = worker_driver.init_worker(120)
    rank, dev = wg.rank, wg.device
    e, t, h = 8 * wg.world, 32, 1024
    buf = moelink.Buffer(
        wg.group,
        0,
        moelink.Buffer.get_low_latency_rdma_size_hint(t, h, wg.world, e),
        low_latency_mode=True,
    )
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, e, (t, 4), device=dev)
    dist.barrier(group=wg.gloo)
    status = 0
    if rank == 0:
        t0 = time.time()
        try:
            buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
            torch.cuda.synchronize(dev)
            print(f"FAIL trap_on_timeout: the dispatch returned ({time.time() - t0:.1f} s)")
            status = 1
        except Exception as ex:  # noqa: BLE001 - a trap surfaces as a CUDA error
            took = time.time() - t0
            ok = took < 30
            print(
                f"{'PASS' if ok else 'FAIL'} trap_on_timeout ({took:.1f} s): "
                f"{type(ex).__name__}: {str(ex)[:200]}",
                flush=True,
            )
            status = 0 if ok else 1
    dist.barrier(group=wg.gloo)
    # The trapped context cannot free anything: leave without tearing down.
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
