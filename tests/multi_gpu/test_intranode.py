"""Intranode dispatch/combine against the CPU reference, under torchrun with 2 and
4 ranks (the scenarios live in ``intranode_worker.py``).

``MOELINK_INTRANODE_SCENARIOS`` (a comma list of names from the worker's
``SCENARIO_NAMES``) runs only those; ``MOELINK_TEST_SEED`` replays a run's data.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cuda_device_count

pytestmark = pytest.mark.multi_gpu
WORKER = Path(__file__).with_name("intranode_worker.py")
SCENARIOS_ENV = "MOELINK_INTRANODE_SCENARIOS"
TIMEOUT_S = 600


def scenario_names() -> tuple:
    """The worker's ``SCENARIO_NAMES``, read from its source (importing the worker
    would need the GPU stack)."""
    tree = ast.parse(WORKER.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SCENARIO_NAMES" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"SCENARIO_NAMES not found in {WORKER}")


def selected_scenarios() -> list:
    known = scenario_names()
    raw = os.environ.get(SCENARIOS_ENV, "").strip()
    if not raw:
        return list(known)
    names = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        pytest.fail(f"{SCENARIOS_ENV}: unknown scenarios {unknown}; known: {list(known)}")
    return names


def run_torchrun(nproc: int, script: Path, timeout: int) -> tuple:
    """Runs ``script`` under torchrun in its own process group; on timeout the whole
    group (torchrun and its workers) is killed. Returns (returncode, output)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
    ]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out + f"\n[test] killed after {timeout} s"


@pytest.mark.parametrize("nproc", [2, 4])
def test_intranode(nproc):
    if cuda_device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, found {cuda_device_count()}")
    names = selected_scenarios()
    code, out = run_torchrun(nproc, WORKER, TIMEOUT_S)
    tail = out[-8000:]
    assert code == 0, f"torchrun exited {code}:\n{tail}"
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed[:20]) + "\n" + tail
    passed = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert sorted(passed) == sorted(names), f"PASS lines {passed}, expected {names}:\n{tail}"
