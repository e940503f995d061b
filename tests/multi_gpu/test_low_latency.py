"""Low-latency dispatch/combine against the CPU reference, under torchrun with 2 and
4 ranks (the scenarios live in ``ll_worker.py``; ``MOELINK_LL_SCENARIOS`` selects
some, ``MOELINK_TEST_SEED`` replays a run's data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multi_gpu.torchrun_suite import run_suite, scenario_names

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("ll_worker.py")
SCENARIOS_ENV = "MOELINK_LL_SCENARIOS"
TIMEOUT_S = 900


def test_scenario_names_match_functions():
    src = WORKER.read_text()
    for name in scenario_names(WORKER):
        assert f"def scenario_{name}(" in src, name


@pytest.mark.parametrize("nproc", [2, 4])
def test_low_latency(nproc):
    run_suite(nproc, WORKER, SCENARIOS_ENV, TIMEOUT_S)
