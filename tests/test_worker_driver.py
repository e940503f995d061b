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


def test_cpu_threads(monkeypatch):
    """Each worker gets its share of the host's CPUs (torchrun's OMP_NUM_THREADS=1
    left the inputs and references on one core); $MOELINK_TEST_THREADS overrides."""
    monkeypatch.delenv(worker_driver.THREADS_ENV, raising=False)
    monkeypatch.setattr(worker_driver.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert worker_driver.cpu_threads(4) == worker_driver.MAX_TEST_THREADS
    assert worker_driver.cpu_threads(8) == 8
    monkeypatch.setattr(worker_driver.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert worker_driver.cpu_threads(8) == 2
    assert worker_driver.cpu_threads(32) == 1
    monkeypatch.setenv(worker_driver.THREADS_ENV, "3")
    assert worker_driver.cpu_threads(8) == 3
    for bad in ("0", "many"):
        monkeypatch.setenv(worker_driver.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=r"MOELINK_TEST_THREADS must be a positive"):
            worker_driver.cpu_threads(8)


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


def test_run_scenario_pass(gloo_world, capsys):
    calls = []
    assert run(gloo_world, "fine", lambda: calls.append("ran"), calls)
    assert calls == ["ran", "sync"]
    out = capsys.readouterr().out
    assert "PASS fine (" in out
    assert "FAIL" not in out


def test_run_scenario_profile(gloo_world, capsys, monkeypatch):
    """$MOELINK_TEST_PROFILE=N: rank 0 prints where the scenario's time went."""

    def busy_scenario_body():
        sum(i * i for i in range(20000))

    monkeypatch.setenv(worker_driver.PROFILE_ENV, "5")
    assert run(gloo_world, "timed", busy_scenario_body, [])
    out = capsys.readouterr().out
    assert "PASS timed (" in out
    assert "profile timed (rank 0, by own time):" in out
    assert "busy_scenario_body" in out
    monkeypatch.setenv(worker_driver.PROFILE_ENV, "")
    assert run(gloo_world, "plain", busy_scenario_body, [])
    assert "profile" not in capsys.readouterr().out
    monkeypatch.setenv(worker_driver.PROFILE_ENV, "many")
    with pytest.raises(ValueError, match=r"MOELINK_TEST_PROFILE must be a number of lines"):
        run(gloo_world, "bad", busy_scenario_body, [])


def test_run_scenario_fail(gloo_world, capsys):
    calls = []

    def broken():
        calls.append("ran")
        raise RuntimeError("boom")

    assert not run(gloo_world, "broken", broken, calls)
    assert calls == ["ran", "replaced"]  # no sync after a raise; the resource is replaced
    out = capsys.readouterr().out
    assert "FAIL broken [rank 0]: RuntimeError: boom" in out
    assert "FAIL broken: failed on ranks [0] (" in out
    assert "PASS" not in out


def test_scenario_table():
    def scenario_a():
        pass

    def scenario_b():
        pass

    namespace = {"scenario_b": scenario_b, "scenario_a": scenario_a, "other": None}
    assert worker_driver.scenario_table(namespace, ("a", "b")) == {"a": scenario_a, "b": scenario_b}
    with pytest.raises(KeyError, match="scenario_c"):
        worker_driver.scenario_table(namespace, ("a", "c"))


def test_shared_seed(gloo_world, monkeypatch, capsys):
    monkeypatch.setenv("MOELINK_TEST_DRIVER_SEED", "1234")
    assert worker_driver.shared_seed("MOELINK_TEST_DRIVER_SEED", 0, gloo_world) == 1234
    assert "seed 1234 (MOELINK_TEST_DRIVER_SEED=1234 replays this run)" in capsys.readouterr().out
    monkeypatch.setenv("MOELINK_TEST_DRIVER_SEED", "0")  # 0: draw one
    assert 0 < worker_driver.shared_seed("MOELINK_TEST_DRIVER_SEED", 1, gloo_world) < 1 << 48
    assert capsys.readouterr().out == ""  # only rank 0 prints


def _group(gloo):
    return worker_driver.WorkerGroup(0, 1, 0, None, gloo, gloo, 1)


def test_run_scenarios(gloo_world, capsys):
    calls = []

    def run(name):
        calls.append(name)
        if name == "bad":
            raise RuntimeError("boom")

    status = worker_driver.run_scenarios(
        _group(gloo_world),
        ["good", "bad", "later"],
        run,
        timeout_s=60,
        on_failure=lambda: calls.append("replaced"),
        sync=lambda: calls.append("sync"),
    )
    assert status == 1
    assert calls == ["good", "sync", "bad", "replaced", "later", "sync"]
    out = capsys.readouterr().out
    assert "PASS good (" in out and "FAIL bad [rank 0]: RuntimeError: boom" in out
    assert "PASS later (" in out


def test_destroy_after_failure_prints_what_destroy_raises(monkeypatch, capsys):
    monkeypatch.setattr(worker_driver.torch.cuda, "synchronize", lambda: None)

    class Broken:
        def destroy(self):
            raise RuntimeError("gone")

    worker_driver.destroy_after_failure(Broken(), "Buffer", 3)
    assert "[rank 3] destroying the Buffer after a failure: RuntimeError('gone')" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("body_raises", [False, True])
def test_run_worker(gloo_world, monkeypatch, capsys, body_raises):
    destroyed = []
    monkeypatch.setattr(worker_driver.dist, "destroy_process_group", lambda: destroyed.append(1))

    def body():
        if body_raises:
            raise ValueError("no such scenario")
        return 1

    assert worker_driver.run_worker(_group(gloo_world), body) == 1
    assert destroyed == [1]
    out = capsys.readouterr().out
    assert ("FAIL setup [rank 0]: ValueError: no such scenario" in out) == body_raises


def _in_step_rank(rank: int, store: str, raise_on: int, out, together: bool = True) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:

        def call():
            if rank == raise_on:
                raise ValueError(f"bad input on rank {rank}")
            return rank * 10

        try:
            got = worker_driver.in_step(call, together=together)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's data
            got = f"{type(e).__name__}: {e}"
        # The next collective is the same on both ranks after a failure too.
        seen = [None] * 2
        dist.all_gather_object(seen, rank)
        out.put((rank, got, seen))
    finally:
        dist.destroy_process_group()


def _in_step_ranks(tmp_path, raise_on: int, together: bool) -> dict:
    """Two gloo ranks in processes of their own, each making one ``in_step``
    call (rank ``raise_on`` raises); {rank: (what the call gave, the next
    all_gather)}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    args = [(r, store, raise_on, out, together) for r in range(2)]
    procs = [ctx.Process(target=_in_step_rank, args=a) for a in args]
    for p in procs:
        p.start()
    results = dict((r, (got, seen)) for r, got, seen in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("raise_on", [-1, 0, 1])
def test_in_step_leaves_together(tmp_path, raise_on):
    results = _in_step_ranks(tmp_path, raise_on, together=True)
    for r in range(2):
        got, seen = results[r]
        assert seen == [0, 1]
        if raise_on < 0:
            assert got == r * 10
        elif r == raise_on:
            assert got == f"ValueError: bad input on rank {r}"
        else:
            assert got == (
                f"RuntimeError: another rank's call raised; rank {raise_on}: "
                f"ValueError: bad input on rank {raise_on}"
            )


@pytest.mark.parametrize("raise_on", [-1, 1])
def test_in_step_apart_leaves_each_rank_on_its_own(tmp_path, raise_on):
    """together=False: only the barrier before the call; a rank's raise stays its
    own, and the other rank returns its result without waiting for it."""
    results = _in_step_ranks(tmp_path, raise_on, together=False)
    assert results[0] == (0, [0, 1])
    want_1 = "ValueError: bad input on rank 1" if raise_on == 1 else 10
    assert results[1] == (want_1, [0, 1])


def test_named_rank_reads_the_timeout_message():
    e = RuntimeError("rank 6 timed out waiting for (on the GPU) a chunk ... from rank 2 (id 11)")
    assert worker_driver.named_rank(e) == 2
    assert worker_driver.named_rank(RuntimeError("no peer here")) is None
    assert worker_driver.named_rank(None) is None


def test_chain_fault_follows_the_names_to_the_dead_rank():
    # 4 x 2 with rank 7 dead, as measured: 6 names 2, 2 names 7 (or 3 names 7).
    named = {0: 7, 1: 3, 2: 7, 3: 7, 4: 7, 5: 7, 6: 2}
    assert all(worker_driver.chain_fault(r, named, 7) is None for r in named)
    assert "cycle" in worker_driver.chain_fault(0, {0: 1, 1: 0}, 7)
    assert "named no rank" in worker_driver.chain_fault(0, {0: 1, 1: None}, 7)
    assert "not a survivor" in worker_driver.chain_fault(0, {0: 5}, 7)


def test_post_and_collect_shares_the_posts_and_removes_the_folder(tmp_path):
    folder = tmp_path / "posts"
    folder.mkdir()
    (folder / "1.json").write_text('{"named": 7}')
    (folder / "1.read").write_text("")
    got = worker_driver.post_and_collect(str(folder), 0, [0, 1], 1)
    assert got == {0: 1, 1: 7}
    assert not folder.exists()


def test_post_and_collect_returns_what_came_in_time(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_driver, "POST_WAIT_S", 0.2)
    got = worker_driver.post_and_collect(str(tmp_path), 1, [0, 1], 7)
    assert got == {1: 7}
    assert (tmp_path / "1.read").exists()
