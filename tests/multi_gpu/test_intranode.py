"""Intranode dispatch/combine against the CPU reference, under ``moelink.launch``
with 2, 4 and 8 ranks, several per GPU where ranks outnumber the GPUs (the
scenarios live in ``intranode_worker.py``).

``MOELINK_INTRANODE_SCENARIOS`` (a comma list of names from the worker's
``SCENARIO_NAMES``) runs only those; ``MOELINK_TEST_SEED`` replays a run's data.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cuda_device_count
from tests.multi_gpu.torchrun_suite import run_launcher, suite_test

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("intranode_worker.py")
test_intranode = suite_test(WORKER, "MOELINK_INTRANODE_SCENARIOS", timeout=600)


@pytest.mark.parametrize("split", [None, 1], ids=["one-node", "nodes-of-1"])
def test_killed_rank(split):
    """A rank that leaves mid-dispatch: the other makes TimeoutError name it in time
    (2 ranks; ``nodes-of-1``: the internode path, every byte through the proxy)."""
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    env = {} if split is None else {"MOELINK_RANKS_PER_NODE": str(split)}
    code, out = run_launcher(2, WORKER.with_name("killed_worker.py"), 180, env)
    assert code == 0 and "PASS killed_rank [rank 0]" in out, f"exit {code}:\n{out[-4000:]}"
