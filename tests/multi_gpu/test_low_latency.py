"""Low-latency dispatch/combine against the CPU reference, under ``moelink.launch``
with 2, 4 and 8 ranks, several per GPU where ranks outnumber the GPUs (the
scenarios live in ``ll_worker.py``; ``MOELINK_LL_SCENARIOS`` selects some,
``MOELINK_TEST_SEED`` replays a run's data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cuda_device_count
from tests.multi_gpu.torchrun_suite import run_launcher, scenario_names, suite_test

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("ll_worker.py")


def test_scenario_names_match_functions():
    src = WORKER.read_text()
    for name in scenario_names(WORKER):
        assert f"def scenario_{name}(" in src, name


test_low_latency = suite_test(WORKER, "MOELINK_LL_SCENARIOS", timeout=900)


def test_trap_on_timeout():
    """MOELINK_TRAP_ON_TIMEOUT=1 turns a device timeout into a trap (2 ranks, no MPS:
    under MPS a trap would take down every rank on the GPU)."""
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    code, out = run_launcher(2, WORKER.with_name("trap_worker.py"), 120, {"MOELINK_MPS": "off"})
    assert "PASS trap_on_timeout" in out, f"exit {code}:\n{out[-4000:]}"
