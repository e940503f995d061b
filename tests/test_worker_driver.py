"""CPU tests of the scenario driver the multi-GPU workers share
(tests/multi_gpu/worker_driver.py), on a one-rank gloo group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.multi_gpu import worker_driver

ENV = "MOELINK_TEST_DRIVER_SCENARIOS"
KNOWN = ("alpha", "beta", "gamma")


def test_selected_scenarios(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert worker_driver.selected_scenarios(ENV, KNOWN) == list(KNOWN)
    monkeypatch.setenv(ENV, " gamma, alpha ,")
    assert worker_driver.selected_scenarios(ENV, KNOWN) == ["gamma", "alpha"]
    monkeypatch.setenv(ENV, "alpha,delta")
    with pytest.raises(ValueError, match=r"unknown scenarios \['delta'\]"):
        worker_driver.selected_scenarios(ENV, KNOWN)


def test_watchdog_is_cancelled_on_exit():
    with worker_driver.Watchdog("quick", 0, 60) as w:
        assert w.timer.is_alive()
    w.timer.join(5)
    assert not w.timer.is_alive()


def test_watchdog_fires_with_every_threads_stack():
    # A scenario stuck past its time ends the process with exit code 3, a FAIL
    # line and where each thread was (here: in the sleep of stuck_here).
    code = (
        "import time\n"
        "from tests.multi_gpu import worker_driver\n"
        "def stuck_here():\n"
        "    with worker_driver.Watchdog('stuck', 5, 0.2):\n"
        "        time.sleep(30)\n"
        "stuck_here()\n"
    )
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 3, p.stderr
    assert "FAIL stuck [rank 5]: no progress for 0.2 s (hang?)" in p.stdout
    assert "in stuck_here" in p.stdout, p.stdout


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run(gloo, name, fn, calls):
    return worker_driver.run_scenario(
        name,
        fn,
        rank=0,
        world=1,
        gloo=gloo,
        timeout_s=60,
        sync=lambda: calls.append("sync"),
        on_failure=lambda: calls.append("replaced"),
    )


def test_run_scenario_pass(gloo, capsys):
    calls = []
    assert run(gloo, "fine", lambda: calls.append("ran"), calls)
    assert calls == ["ran", "sync"]
    out = capsys.readouterr().out
    assert "PASS fine (" in out
    assert "FAIL" not in out


def test_run_scenario_fail(gloo, capsys):
    calls = []

    def broken():
        calls.append("ran")
        raise RuntimeError("boom")

    assert not run(gloo, "broken", broken, calls)
    assert calls == ["ran", "replaced"]  # no sync after a raise; the resource is replaced
    out = capsys.readouterr().out
    assert "FAIL broken [rank 0]: RuntimeError: boom" in out
    assert "FAIL broken: failed on ranks [0] (" in out
    assert "PASS" not in out
