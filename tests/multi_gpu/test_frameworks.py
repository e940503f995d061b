"""The call sequences of vLLM, SGLang and Megatron-LM into DeepEP, and a plain
DeepEP-written script, run through ``import deep_ep`` (moelink's alias package,
python/deep_ep_alias) under ``moelink.launch`` with 2 ranks (several per GPU
where ranks outnumber the GPUs; ``MOELINK_TEST_RANKS`` picks other counts).

The scenarios live in ``frameworks_worker.py`` (``MOELINK_FRAMEWORKS_SCENARIOS``
selects some, ``MOELINK_TEST_SEED`` replays a run's data); the script is
``deep_ep_script.py`` (``DEEP_EP_SCRIPT_SEED``). Where ``deep_ep`` is not
installed, the alias package's folder is put on the ranks' ``PYTHONPATH``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.conftest import cuda_device_count
from tests.multi_gpu.torchrun_suite import (
    RANKS_ENV,
    rank_counts,
    run_launcher,
    scenario_names,
    selected_scenarios,
)

pytestmark = pytest.mark.multi_gpu
HERE = Path(__file__).parent
WORKER = HERE / "frameworks_worker.py"
SCRIPT = HERE / "deep_ep_script.py"
SCENARIOS_ENV = "MOELINK_FRAMEWORKS_SCENARIOS"
ALIAS = HERE.parents[1] / "python" / "deep_ep_alias"
#: 2 ranks unless MOELINK_TEST_RANKS says otherwise.
RANKS = rank_counts() if os.environ.get(RANKS_ENV, "").strip() else (2,)


def alias_env() -> dict:
    """The ranks' environment: ``deep_ep`` importable (the alias package's folder
    first on PYTHONPATH unless some ``deep_ep`` is installed already)."""
    if importlib.util.find_spec("deep_ep") is not None:
        return {}
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(ALIAS) + (os.pathsep + path if path else "")}


def test_scenario_names_match_functions():
    src = WORKER.read_text()
    for name in scenario_names(WORKER):
        assert f"def scenario_{name}(" in src, name


@pytest.mark.parametrize("nproc", RANKS)
def test_frameworks(nproc):
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    names = selected_scenarios(WORKER, SCENARIOS_ENV)
    code, out = run_launcher(nproc, WORKER, 600, alias_env())
    tail = out[-8000:]
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed[:20]) + "\n" + tail
    assert code == 0, f"moelink.launch exited {code}:\n{tail}"
    passed = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert sorted(passed) == sorted(names), f"PASS lines {passed}, expected {names}:\n{tail}"


@pytest.mark.parametrize("nproc", RANKS)
def test_deep_ep_script(nproc):
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    code, out = run_launcher(nproc, SCRIPT, 300, alias_env())
    tail = out[-8000:]
    assert code == 0, f"deep_ep_script exited {code}:\n{tail}"
    assert "PASS deep_ep_script" in out, tail
