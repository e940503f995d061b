"""moelink.AllReduce (allreduce, allgather) against a float64 CPU reference, under
``moelink.launch`` with 2, 4 and 8 ranks, several per GPU where ranks outnumber the
GPUs (the scenarios live in ``allreduce_worker.py``).

``MOELINK_AR_SCENARIOS`` (a comma list of names from the worker's
``SCENARIO_NAMES``) runs only those; ``MOELINK_TEST_SEED`` replays a run's data;
``MOELINK_AR_MAX_MIB`` caps message sizes (default 256); ``MOELINK_AR_FULL=1`` runs
every dtype x op at every size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multi_gpu.torchrun_suite import suite_test

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("allreduce_worker.py")
test_allreduce = suite_test(WORKER, "MOELINK_AR_SCENARIOS", timeout=1800)
