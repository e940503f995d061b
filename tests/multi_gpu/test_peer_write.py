"""Multi-GPU smoke test: torchrun with 2 and 4 ranks, NVLink stores into every peer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cuda_device_count

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("peer_write_worker.py")


def run_torchrun(nproc: int, script: Path, timeout: int = 300) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_peer_write_smoke(nproc):
    if cuda_device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, found {cuda_device_count()}")
    out = run_torchrun(nproc, WORKER)
    passes = [line for line in out.splitlines() if line.startswith("PASS ")]
    assert len(passes) == 3 * nproc, out[-4000:]
    assert "FAIL" not in out
