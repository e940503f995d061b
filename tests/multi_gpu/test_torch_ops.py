"""moelink's torch ops (``torch.ops.moelink.*``) eager, compiled and in CUDA graphs
on the GPUs, under ``moelink.launch`` with 2, 4 and 8 ranks, several per GPU where
ranks outnumber the GPUs (the scenarios live in ``ops_worker.py``;
``MOELINK_OPS_SCENARIOS`` selects some, ``MOELINK_TEST_SEED`` replays a run's data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multi_gpu.torchrun_suite import suite_test

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("ops_worker.py")
test_torch_ops = suite_test(WORKER, "MOELINK_OPS_SCENARIOS", timeout=1200)
