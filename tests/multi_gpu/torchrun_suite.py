"""Shared driver of the multi-rank pytest wrappers: each wraps one worker script
(run under ``python -m moelink.launch``, which places ranks round-robin on the
local GPUs, several per GPU when ranks outnumber GPUs, under MPS where it can)
whose ``SCENARIO_NAMES`` tuple lists its scenarios, selectable through an
environment variable, and which prints ``PASS <name>`` / ``FAIL <name>: ...``.

``MOELINK_TEST_RANKS`` (a comma list, default ``2,4,8``) says which rank counts
the wrappers are parametrized over."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cuda_device_count


def scenario_names(worker: Path) -> tuple:
    """The worker's ``SCENARIO_NAMES``, read from its source (importing the worker
    would need the GPU stack)."""
    tree = ast.parse(worker.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SCENARIO_NAMES" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"SCENARIO_NAMES not found in {worker}")


def selected_scenarios(worker: Path, env: str) -> list:
    """The worker's scenarios that ``$env`` selects, as the worker selects them
    (all by default); an unknown name fails the test."""
    # Imported here: the driver needs torch, which only a GPU run has to have.
    from tests.multi_gpu import worker_driver

    try:
        return worker_driver.selected_scenarios(env, scenario_names(worker))
    except ValueError as e:
        pytest.fail(str(e))


RANKS_ENV = "MOELINK_TEST_RANKS"
DEFAULT_RANKS = (2, 4, 8)


def rank_counts() -> tuple:
    """The rank counts the multi-rank suites are parametrized over."""
    raw = os.environ.get(RANKS_ENV, "").strip()
    if not raw:
        return DEFAULT_RANKS
    return tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))


def run_launcher(nproc: int, script: Path, timeout: int, env: dict | None = None) -> tuple:
    """Runs ``script`` on ``nproc`` ranks under ``python -m moelink.launch`` in its
    own process group (``env``: extra variables); on timeout the whole group
    (launcher and ranks) is killed. Returns (returncode, output)."""
    cmd = [
        sys.executable,
        "-m",
        "moelink.launch",
        "-n",
        str(nproc),
        "--timeout",
        str(timeout),
        str(script),
    ]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout + 60)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out + f"\n[test] killed after {timeout} s"


def suite_test(worker: Path, env: str, timeout: int):
    """A pytest test that runs ``worker`` with ``run_suite`` on each of
    ``rank_counts()`` rank counts (``env`` selects its scenarios)."""

    @pytest.mark.parametrize("nproc", rank_counts())
    def test(nproc):
        run_suite(nproc, worker, env, timeout)

    return test


def run_suite(nproc: int, worker: Path, env: str, timeout: int) -> None:
    """Runs the worker on ``nproc`` ranks over the local GPUs (skips without a GPU)
    and asserts that every selected scenario printed PASS and none FAIL."""
    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU, found none")
    names = selected_scenarios(worker, env)
    code, out = run_launcher(nproc, worker, timeout)
    tail = out[-8000:]
    assert code == 0, f"torchrun exited {code}:\n{tail}"
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed[:20]) + "\n" + tail
    passed = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert sorted(passed) == sorted(names), f"PASS lines {passed}, expected {names}:\n{tail}"
