"""Multi-rank smoke test: 2, 4 and 8 ranks under ``moelink.launch`` (several per GPU
where ranks outnumber the GPUs), stores into every peer's memory (NVLink between
GPUs, the same HBM between ranks that share one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cuda_device_count
from tests.multi_gpu.torchrun_suite import rank_counts, run_launcher

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("peer_write_worker.py")


@pytest.mark.parametrize("nproc", rank_counts())
def test_peer_write_smoke(nproc):
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    code, out = run_launcher(nproc, WORKER, 300)
    assert code == 0, f"launcher exited {code}:\n{out[-4000:]}"
    passes = [line for line in out.splitlines() if line.startswith("PASS ")]
    assert len(passes) == 3 * nproc, out[-4000:]
    assert "FAIL" not in out
