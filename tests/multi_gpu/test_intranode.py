"""Intranode dispatch/combine against the CPU reference, under ``moelink.launch``
with 2, 4 and 8 ranks, several per GPU where ranks outnumber the GPUs (the
scenarios live in ``intranode_worker.py``).

``MOELINK_INTRANODE_SCENARIOS`` (a comma list of names from the worker's
``SCENARIO_NAMES``) runs only those; ``MOELINK_TEST_SEED`` replays a run's data.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multi_gpu.torchrun_suite import suite_test

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("intranode_worker.py")
test_intranode = suite_test(WORKER, "MOELINK_INTRANODE_SCENARIOS", timeout=600)
