"""Run under torchrun: the peer-write smoke test on every rank.

Each process binds its GPU, allocates and exports a buffer, maps every peer's
buffer, and one kernel launched from Rust through moelink._native stores a
rank-specific pattern into every peer; each rank checks what it received.
The check is repeated with a fresh seed, so a stale buffer cannot pass.
"""

from __future__ import annotations

import json
import os
import sys

import moelink
import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # Ranks may share GPUs (round-robin); the control plane is gloo either way.
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group("gloo")
    status = 0
    try:
        for words in (1, 1000, 1 << 20):  # 8 B, an odd size, 8 MiB per slot
            report = moelink.peer_write_check(words=words)
            report.pop("mismatches")
            print("PASS " + json.dumps(report), flush=True)
    except Exception as e:
        print(f"FAIL rank {rank}: {e!r}", flush=True)
        status = 1
    finally:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
