"""``moelink.launch`` without a GPU: placement, the MPS decision table, the MPS
daemon's lifecycle (a fake ``nvidia-cuda-mps-control`` first on PATH records every
start and quit), supervision (failures, timeouts, signals), the ranks'
environment, ``init_distributed``, and the command-line errors.

The launcher plans for G GPUs through ``MOELINK_LAUNCH_GPUS_OVERRIDE`` (for tests),
so the MPS paths run here; the ranks are tiny Python scripts that never touch CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from moelink import launch

# ----------------------------------------------------------------------------
# Placement


@pytest.mark.parametrize(
    "num_ranks, num_gpus, devices, per_device, percentages",
    [
        (1, 1, [0], [1], [100]),
        (4, 4, [0, 1, 2, 3], [1, 1, 1, 1], [100, 100, 100, 100]),
        (2, 4, [0, 1], [1, 1], [100, 100]),
        (4, 1, [0, 0, 0, 0], [4, 4, 4, 4], [25, 25, 25, 25]),
        (3, 1, [0, 0, 0], [3, 3, 3], [33, 33, 33]),
        (3, 2, [0, 1, 0], [2, 1, 2], [50, 100, 50]),
        (8, 1, [0] * 8, [8] * 8, [12] * 8),
        (
            8,
            3,
            [0, 1, 2, 0, 1, 2, 0, 1],
            [3, 3, 2, 3, 3, 2, 3, 3],
            [33, 33, 50, 33, 33, 50, 33, 33],
        ),
        (2, 0, [None, None], [1, 1], [100, 100]),
    ],
)
def test_placements_round_robin(num_ranks, num_gpus, devices, per_device, percentages):
    got = launch.placements(num_ranks, num_gpus)
    assert [p.rank for p in got] == list(range(num_ranks))
    assert [p.device for p in got] == devices
    assert [p.ranks_on_device for p in got] == per_device
    assert [p.thread_percentage for p in got] == percentages
    # Under MPS the ranks of one GPU never ask for more than all of it.
    for d in set(devices) - {None}:
        assert sum(p.thread_percentage for p in got if p.device == d) <= 100


def test_placements_reject_nonsense():
    with pytest.raises(ValueError, match="num_ranks"):
        launch.placements(0, 1)
    with pytest.raises(ValueError, match="num_gpus"):
        launch.placements(2, -1)


# ----------------------------------------------------------------------------
# The MPS decision table (4 ranks on 1 GPU unless said otherwise)

S, T, E, N = "start", "timeslice", "existing", "none"
ERR = "error"
# (mode, root, binary present, daemon running) -> action
TABLE = {
    ("auto", True, True, False): S,
    ("auto", True, False, False): T,
    ("auto", False, True, False): T,
    ("auto", False, False, False): T,
    ("auto", True, True, True): E,
    ("auto", True, False, True): E,
    ("auto", False, True, True): E,
    ("auto", False, False, True): E,
    ("on", True, True, False): S,
    ("on", True, False, False): ERR,
    ("on", False, True, False): S,
    ("on", False, False, False): ERR,
    ("on", True, True, True): E,
    ("on", True, False, True): E,
    ("on", False, True, True): E,
    ("on", False, False, True): E,
    ("off", True, True, False): T,
    ("off", True, False, False): T,
    ("off", False, True, False): T,
    ("off", False, False, False): T,
    ("off", True, True, True): T,
    ("off", True, False, True): T,
    ("off", False, True, True): T,
    ("off", False, False, True): T,
}


@pytest.mark.parametrize("case", sorted(TABLE), ids=lambda c: "-".join(map(str, c)))
def test_mps_decision_table(case):
    mode, root, binary, running = case
    kwargs = {
        "is_root": root,
        "binary": "/usr/bin/nvidia-cuda-mps-control" if binary else None,
        "existing_pipe_dir": "/tmp/some-pipe" if running else None,
    }
    want = TABLE[case]
    if want == ERR:
        with pytest.raises(launch.LaunchError, match="--mps on: cannot use MPS"):
            launch.decide_mps(mode, 4, 1, **kwargs)
        return
    plan = launch.decide_mps(mode, 4, 1, **kwargs)
    assert plan.action == want
    assert plan.uses_mps == (want in (S, E))
    assert plan.pipe_dir == ("/tmp/some-pipe" if want == E else None)
    # MPS off hides a running daemon from the ranks; nothing else does.
    assert plan.hide_existing == (mode == "off" and running)
    if want == T:
        assert plan.reason


@pytest.mark.parametrize("case", sorted(TABLE), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("num_ranks, num_gpus", [(4, 4), (2, 4), (3, 0), (1, 1)])
def test_mps_untouched_where_no_gpu_is_shared(case, num_ranks, num_gpus):
    mode, root, binary, running = case
    plan = launch.decide_mps(
        mode,
        num_ranks,
        num_gpus,
        is_root=root,
        binary="/x" if binary else None,
        existing_pipe_dir="/p" if running else None,
    )
    assert plan.action == N and not plan.uses_mps


def test_mps_mode_comes_from_the_option_then_the_environment():
    assert launch.mps_mode(None, {}) == "auto"
    assert launch.mps_mode(None, {"MOELINK_MPS": "off"}) == "off"
    assert launch.mps_mode(None, {"MOELINK_MPS": " ON "}) == "on"
    assert launch.mps_mode("on", {"MOELINK_MPS": "off"}) == "on"
    with pytest.raises(launch.LaunchError, match="MOELINK_MPS must be one of auto, on, off"):
        launch.mps_mode(None, {"MOELINK_MPS": "yes"})
    with pytest.raises(launch.LaunchError, match="--mps"):
        launch.mps_mode("maybe", {})


def test_mps_percentage_is_none_unless_asked():
    assert launch.mps_percentage(None, {}) == "none"
    assert launch.mps_percentage(None, {"MOELINK_MPS_PERCENTAGE": "Auto"}) == "auto"
    assert launch.mps_percentage("25", {"MOELINK_MPS_PERCENTAGE": "auto"}) == "25"
    assert launch.mps_percentage("100", {}) == "100"
    for bad in ("0", "101", "12.5", "-3", "half"):
        with pytest.raises(launch.LaunchError, match="none, auto or a whole number"):
            launch.mps_percentage(bad, {})
    sharing = launch.GpuSharing(
        3, 1, launch.MpsPlan("start"), launch.placements(3, 1), percentage="none"
    )
    assert [sharing.thread_percentage(r) for r in range(3)] == [None] * 3
    sharing.percentage = "auto"
    assert [sharing.thread_percentage(r) for r in range(3)] == [33] * 3
    sharing.percentage = "40"
    assert sharing.env(1)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    sharing.plan = launch.MpsPlan("timeslice")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in sharing.env(1)
    # gpu_sharing reads $MOELINK_MPS_PERCENTAGE where no percentage is given.
    env = {"MOELINK_MPS_PERCENTAGE": "auto", "PATH": ""}
    with launch.gpu_sharing(3, 1, "off", env=env, log=lambda msg: None) as s:
        assert s.percentage == "auto"
    with launch.gpu_sharing(3, 1, "off", percentage="20", env=env, log=lambda m: None) as s:
        assert s.percentage == "20"


def test_a_daemon_is_reachable_only_while_its_control_socket_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "DEFAULT_MPS_PIPE_DIR", str(tmp_path / "default"))
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    assert launch.reachable_mps_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}) is None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(pipe / "control"))
    server.listen(4)
    try:
        assert launch.reachable_mps_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}) == str(pipe)
        # Without the variable, clients use the default directory: nothing there.
        assert launch.reachable_mps_daemon({}) is None
    finally:
        server.close()
    # A daemon that quit leaves its socket behind: not reachable.
    assert (pipe / "control").exists()
    assert launch.reachable_mps_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}) is None
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "control").touch()
    assert launch.reachable_mps_daemon({}) == str(tmp_path / "default")


# ----------------------------------------------------------------------------
# The launcher as a command

FAKE_MPS = """#!/bin/sh
# A stand-in for nvidia-cuda-mps-control: records what it is asked.
if [ "$1" = "-d" ]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
  [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start" >&2; exit 1; }
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read cmd
echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MOELINK_LAUNCH_GPUS",
    "MOELINK_LAUNCH_MPS",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)

# A rank: prints its environment as JSON, spawns a child that would outlive it,
# writes its pids, then acts on $RANK_ACT_<rank>: "exit:N" (once every rank
# wrote its pids), "late:N" (the same, a second later), "sleep", "stubborn"
# (sleeps and ignores SIGTERM); default: exit 0.
RANK_SCRIPT = f"""
import json, os, signal, subprocess, sys, time
keys = {ENV_KEYS!r}
rank = os.environ["RANK"]
report = {{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}
os.write(1, (json.dumps(report) + chr(10)).encode())  # one write: lines of ranks never mix
out = os.environ.get("RANK_PIDS")
if out:
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(out, rank), "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
act = os.environ.get("RANK_ACT_" + rank, "")
if act.startswith(("exit:", "late:")):
    # Leave only once every rank has written its pids (bounded): else, on a
    # loaded machine, the launcher stops ranks that have not started their
    # child yet, and the test cannot count what it cleaned up.
    deadline = time.time() + 10
    world = int(os.environ.get("WORLD_SIZE", "1"))
    while out and len(os.listdir(out)) < world and time.time() < deadline:
        time.sleep(0.01)
    if act.startswith("late:"):
        time.sleep(1)
    sys.exit(int(act[5:]))
if act == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if act in ("sleep", "stubborn"):
    time.sleep(300)
"""


class Env:
    """A sandbox for launcher runs: the rank script, a fake MPS binary on PATH,
    its log, and a pid folder."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.script = tmp_path / "rank.py"
        self.script.write_text(RANK_SCRIPT)
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        fake = self.bin / launch.MPS_BINARY
        fake.write_text(FAKE_MPS)
        fake.chmod(0o755)
        self.nobin = tmp_path / "nobin"
        self.nobin.mkdir()
        self.log = tmp_path / "mps.log"
        self.pids = tmp_path / "pids"
        self.pids.mkdir()
        self.vars = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CUDA_MPS_", "MOELINK_", "RANK_"))
            and k not in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        }
        self.vars.update(
            {
                "PATH": f"{self.bin}:/usr/bin:/bin",
                "FAKE_MPS_LOG": str(self.log),
                "RANK_PIDS": str(self.pids),
                "MOELINK_LAUNCH_GPUS_OVERRIDE": "1",
                # No real daemon may be found through the default directory.
                "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "no-daemon"),
            }
        )

    def command(self, *opts, n=3) -> list:
        return [sys.executable, "-m", "moelink.launch", "-n", str(n), *opts, str(self.script)]

    def popen(self, cmd, **extra) -> subprocess.Popen:
        return subprocess.Popen(
            cmd,
            env={**self.vars, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, cmd, timeout=60, **extra) -> tuple:
        p = self.popen(cmd, **extra)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, time.monotonic() - t0

    def mps_log(self) -> list:
        return self.log.read_text().split("\n")[:-1] if self.log.exists() else []

    def rank_pids(self) -> list:
        return [int(x) for f in self.pids.iterdir() for x in f.read_text().split()]


@pytest.fixture
def sandbox(tmp_path):
    return Env(tmp_path)


def _reports(out: str) -> dict:
    """Each rank's printed report, by rank."""
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["env"]["RANK"]): r for r in reports}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, parent gone or not waiting) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list, seconds: float = 5.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _assert_started_and_stopped_once(sandbox: Env) -> str:
    """The fake daemon was started once and quit once, with one pipe directory
    (in a temporary folder that is gone now); returns that directory."""
    log = sandbox.mps_log()
    starts = [line for line in log if line.startswith("start ")]
    quits = [line for line in log if line.startswith("quit ")]
    assert len(starts) == 1 and len(quits) == 1, log
    pipe_dir = starts[0].split()[1]
    assert quits[0].split()[1] == pipe_dir
    assert log.index(starts[0]) < log.index(quits[0])
    assert not Path(pipe_dir).exists(), "the launcher left its MPS directories behind"
    return pipe_dir


def test_children_get_the_rank_environment(sandbox):
    code, out, err, _ = sandbox.run(
        sandbox.command("--mps", "off") + ["-n", "5", "--timeout", "1"],
        MOELINK_LAUNCH_GPUS_OVERRIDE="2",
    )
    assert code == 0, err
    reports = _reports(out)
    assert sorted(reports) == [0, 1, 2]
    ports = {r["env"]["MASTER_PORT"] for r in reports.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, r in reports.items():
        env = r["env"]
        assert r["argv"] == ["-n", "5", "--timeout", "1"]  # the script's own options
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MOELINK_LAUNCH_GPUS"] == "2"
        assert env["MOELINK_LAUNCH_MPS"] == "0"
        assert env["CUDA_VISIBLE_DEVICES"] is None  # every rank sees every GPU
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None
        assert env["NCCL_NVLS_ENABLE"] == "0"
        assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert sandbox.mps_log() == []
    assert err.count("time-slice") == 1  # one note: 3 ranks share 2 GPUs without MPS


def test_mps_daemon_started_once_and_stopped_at_normal_exit(sandbox):
    code, out, err, _ = sandbox.run(
        sandbox.command("--mps", "on", "--mps-percentage", "auto"),
        MOELINK_LAUNCH_GPUS_OVERRIDE="2",
    )
    assert code == 0, err
    pipe_dir = _assert_started_and_stopped_once(sandbox)
    reports = _reports(out)
    pct = {r: rep["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r, rep in reports.items()}
    assert pct == {0: "50", 1: "100", 2: "50"}  # ranks 0 and 2 share GPU 0
    for rep in reports.values():
        assert rep["env"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe_dir
        assert rep["env"]["MOELINK_LAUNCH_MPS"] == "1"
    assert "started an MPS control daemon" in err


def test_auto_starts_the_daemon_as_root(sandbox):
    if os.geteuid() != 0:
        pytest.skip("auto starts MPS only as root")
    code, out, err, _ = sandbox.run(sandbox.command(), MOELINK_LAUNCH_GPUS_OVERRIDE="1")
    assert code == 0, err
    _assert_started_and_stopped_once(sandbox)
    # No thread percentage by default (grids already use (SMs - ranks) / ranks).
    assert {r["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for r in _reports(out).values()} == {None}
    assert "no MPS thread percentage" in err


def test_no_mps_where_every_rank_has_its_own_gpu(sandbox):
    code, out, err, _ = sandbox.run(
        sandbox.command("--mps", "on"), MOELINK_LAUNCH_GPUS_OVERRIDE="4"
    )
    assert code == 0, err
    assert sandbox.mps_log() == []
    assert all(r["env"]["MOELINK_LAUNCH_MPS"] == "0" for r in _reports(out).values())
    assert "time-slice" not in err


def test_mps_daemon_stopped_when_a_rank_fails_and_the_others_are_killed(sandbox):
    code, out, err, elapsed = sandbox.run(
        sandbox.command("--mps", "on"),
        RANK_ACT_0="sleep",
        RANK_ACT_1="exit:7",
        RANK_ACT_2="sleep",
    )
    assert code == 7, err
    assert "rank 1 exited with code 7" in err
    assert elapsed < 20
    _assert_started_and_stopped_once(sandbox)
    pids = sandbox.rank_pids()
    assert len(pids) == 6  # every rank and the child it left behind
    assert _wait_gone(pids) == []


@pytest.mark.parametrize("mps", ["on", "off"])
def test_under_mps_a_failure_names_the_rank_that_left_before(sandbox, mps):
    """Under MPS a rank that exits while its kernels run faults the others; the
    launcher names it beside the rank that failed. Without MPS it does not."""
    code, _, err, _ = sandbox.run(
        sandbox.command("--mps", mps),
        RANK_ACT_0="sleep",
        RANK_ACT_1="late:3",
        RANK_ACT_2="exit:0",
    )
    assert code == 3, err
    assert "rank 1 exited with code 3; stopping the other ranks" in err
    hint = [line for line in err.splitlines() if "under MPS" in line]
    if mps == "on":
        assert len(hint) == 1 and "look first at rank 2 (exited 0, " in hint[0], err
    else:
        assert hint == [], err


def test_failures_are_described_signal_first_with_the_mps_suspects():
    ok = launch.describe_failures([None, 0, None], {1: 5.0}, 6.0, mps=True)
    assert ok == (0, [])
    # Two failures seen at one poll: the signal comes first and gives the code.
    code, lines = launch.describe_failures([1, None, -9, None], {}, 10.0, mps=False)
    assert code == 128 + 9
    assert lines == [
        "rank 2 was killed by SIGKILL, rank 0 exited with code 1; stopping the other ranks"
    ]
    code, lines = launch.describe_failures([1, -9, None, 0, 0], {3: 10.5, 4: 1.0}, 40.0, mps=True)
    assert code == 137 and len(lines) == 2
    # Rank 4 left 39 s before: past the window, not named.
    assert (
        "look first at rank 1 (was killed by SIGKILL), rank 3 (exited 0, 29.5 s before)" in lines[1]
    )
    assert "rank 4" not in lines[1]
    code, lines = launch.describe_failures([None, 2], {}, 1.0, mps=True)
    assert (code, len(lines)) == (2, 1)  # nothing to suspect: no hint


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(sandbox):
    script = sandbox.tmp / "kill_self.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    cmd = [sys.executable, "-m", "moelink.launch", "-n", "2", "--mps", "off", str(script)]
    code, _, err, _ = sandbox.run(cmd)
    assert code == 128 + signal.SIGKILL, err
    assert "killed by SIGKILL" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_mps_daemon_stopped_when_the_launcher_is_interrupted(sandbox, sig):
    p = sandbox.popen(
        sandbox.command("--mps", "on", "--kill-grace", "1"),
        RANK_ACT_0="sleep",
        RANK_ACT_1="sleep",
        RANK_ACT_2="stubborn",
    )
    deadline = time.monotonic() + 30
    while len(list(sandbox.pids.iterdir())) < 3:
        assert time.monotonic() < deadline, "the ranks did not start"
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(0.2)  # the files are written; the stubborn rank ignores SIGTERM by now
    t0 = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, err
    # SIGTERM, then SIGKILL for the stubborn rank after the 1 s grace.
    assert 1 <= time.monotonic() - t0 < 10
    _assert_started_and_stopped_once(sandbox)
    assert _wait_gone(sandbox.rank_pids()) == []


def test_timeout_kills_hanging_ranks(sandbox):
    code, _, err, elapsed = sandbox.run(
        sandbox.command("--mps", "on", "--timeout", "1.5", "--kill-grace", "1"),
        RANK_ACT_0="sleep",
        RANK_ACT_1="stubborn",
        RANK_ACT_2="exit:0",
    )
    assert code == 124, err
    assert "error: timeout: rank(s) [0, 1] still running after 1.5 s" in err
    # Launcher start-up (~2 s), the 1.5 s timeout, the 1 s grace for the stubborn rank.
    assert 1.5 < elapsed < 12
    _assert_started_and_stopped_once(sandbox)
    assert _wait_gone(sandbox.rank_pids()) == []


def test_a_running_daemon_is_used_and_left_running(sandbox, tmp_path):
    pipe = tmp_path / "running"
    pipe.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(pipe / "control"))
    server.listen(16)
    try:
        code, out, err, _ = sandbox.run(
            sandbox.command(),
            CUDA_MPS_PIPE_DIRECTORY=str(pipe),
            MOELINK_MPS="on",
            MOELINK_MPS_PERCENTAGE="auto",
        )
        assert code == 0, err
        assert sandbox.mps_log() == []  # neither started nor stopped
        for r in _reports(out).values():
            assert r["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
            assert r["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"
        assert "using the running MPS daemon" in err

        # MPS off: the ranks are pointed away from it.
        code, out, err, _ = sandbox.run(
            sandbox.command("--mps", "off"), CUDA_MPS_PIPE_DIRECTORY=str(pipe)
        )
        assert code == 0, err
        hidden = {r["env"]["CUDA_MPS_PIPE_DIRECTORY"] for r in _reports(out).values()}
        assert len(hidden) == 1 and str(pipe) not in hidden
        assert not Path(hidden.pop()).exists()  # an empty folder, removed at the end
        assert (pipe / "control").exists()
    finally:
        server.close()


def test_auto_without_the_binary_time_slices_with_one_note(sandbox):
    if _mps_binary_in_system_path():
        pytest.skip("a real nvidia-cuda-mps-control is in /usr/bin or /bin")
    code, out, err, _ = sandbox.run(sandbox.command(), PATH=f"{sandbox.nobin}:/usr/bin:/bin")
    assert code == 0, err
    assert err.count("note:") == 1 and "time-slice" in err
    assert all(r["env"]["MOELINK_LAUNCH_MPS"] == "0" for r in _reports(out).values())


def test_auto_falls_back_when_the_daemon_does_not_start(sandbox):
    if os.geteuid() != 0:
        pytest.skip("auto starts MPS only as root")
    code, out, err, _ = sandbox.run(sandbox.command(), FAKE_MPS_FAIL="1")
    assert code == 0, err
    assert "starting MPS failed" in err and "cannot start" in err
    assert all(r["env"]["MOELINK_LAUNCH_MPS"] == "0" for r in _reports(out).values())
    log = sandbox.mps_log()
    assert len(log) == 1 and log[0].startswith("start ")  # no quit: it never came up
    assert not Path(log[0].split()[1]).exists()


# ----------------------------------------------------------------------------
# Command-line errors: exit 2, one "error:" line, no traceback, nothing started

BAD_LAUNCHES = [
    (["-n", "0", "{script}"], "-n must be a positive"),
    (["-n", "x", "{script}"], "argument -n"),
    (["{script}"], "-n/--nproc-per-node"),
    (["-n", "2"], "prog"),
    (["-n", "2", "/nonexistent/script.py"], "no such script"),
    (["-n", "2", "--timeout", "-1", "{script}"], "--timeout"),
    (["-n", "2", "--timeout", "nan", "{script}"], "--timeout"),
    (["-n", "2", "--kill-grace", "0", "{script}"], "--kill-grace"),
    (["-n", "2", "--mps", "maybe", "{script}"], "--mps"),
    (["-n", "2", "--mps-percentage", "0", "{script}"], "--mps-percentage"),
    (["-n", "2", "--no-python", "/nonexistent/binary"], "not an executable"),
    (["-n", "2", "--no-python", "-m", "{script}"], "not allowed with"),
    (["-n", "2", "--mps", "on", "{script}"], "--mps on: cannot use MPS"),
]


def _mps_binary_in_system_path() -> bool:
    return any((Path(d) / launch.MPS_BINARY).exists() for d in ("/usr/bin", "/bin"))


def one_error_line(err: str) -> str:
    """The one ``error: ...`` line of a CLI's stderr (asserts there is no other)."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, message", BAD_LAUNCHES)
def test_bad_launch_options_exit_2_withone_error_line(argv, message, sandbox, capsys, monkeypatch):
    if "--mps on" in " ".join(argv) and _mps_binary_in_system_path():
        pytest.skip("a real nvidia-cuda-mps-control is in /usr/bin or /bin")
    argv = [a.format(script=sandbox.script) for a in argv]
    env = {**sandbox.vars, "PATH": f"{sandbox.nobin}:/usr/bin:/bin", "RANK_ACT_0": "exit:9"}
    for k in list(os.environ):
        if k not in env:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        sys.exit(launch.main(argv))
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert message in one_error_line(err)
    assert out == ""
    assert list(sandbox.pids.iterdir()) == []  # no rank started


def test_bad_launches_from_the_shell(sandbox):
    """Some of them through ``python -m moelink.launch``: exit 2, one line, no
    traceback (each run imports torch: a few only)."""
    procs = []
    for argv, message in [BAD_LAUNCHES[i] for i in (2, 6, 11)] + [([], "MOELINK_MPS")]:
        if "--mps on" in " ".join(argv) and _mps_binary_in_system_path():
            continue
        argv = [a.format(script=sandbox.script) for a in argv] or ["-n", "2", str(sandbox.script)]
        extra = {"MOELINK_MPS": "bogus"} if message == "MOELINK_MPS" else {}
        cmd = [sys.executable, "-m", "moelink.launch", *argv]
        procs.append((sandbox.popen(cmd, PATH=f"{sandbox.nobin}:/usr/bin:/bin", **extra), message))
    for p, message in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 2, (message, err)
        assert message in one_error_line(err)
        assert out == ""
    assert list(sandbox.pids.iterdir()) == []


# ----------------------------------------------------------------------------
# init_distributed


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


@pytest.mark.parametrize(
    "local_rank, local_world, gpus, device, per_gpu, shared, backend",
    [
        (3, 4, 1, 0, 4, True, "gloo"),
        (1, 2, 4, 1, 1, False, "nccl"),
        (1, 3, 2, 1, 1, True, "gloo"),  # alone on GPU 1, but ranks 0 and 2 share GPU 0
        (2, 3, 2, 0, 2, True, "gloo"),
        (5, 8, 8, 5, 1, False, "nccl"),
    ],
)
def test_init_distributed_picks_device_and_backend(
    monkeypatch, local_rank, local_world, gpus, device, per_gpu, shared, backend
):
    import torch.distributed as dist

    init, set_device = _Recorder(), _Recorder()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    for k, v in {
        "RANK": str(local_rank + 8),  # the second host of a torchrun job
        "WORLD_SIZE": str(local_world + 8),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "NCCL_NVLS_ENABLE": "1",
    }.items():
        monkeypatch.setenv(k, v)
    info = launch.init_distributed(timeout_s=12)
    assert info.device == torch.device("cuda", device)
    assert set_device.calls == [((device,), {})]
    assert (info.ranks_per_gpu, info.ranks_share_gpus, info.backend) == (per_gpu, shared, backend)
    assert (info.rank, info.world_size) == (local_rank + 8, local_world + 8)
    (args, kwargs), *more = init.calls
    assert not more
    assert args == (backend,)
    assert kwargs["rank"] == local_rank + 8 and kwargs["world_size"] == local_world + 8
    assert kwargs["timeout"].total_seconds() == 12
    assert kwargs.get("device_id") == (torch.device("cuda", device) if backend == "nccl" else None)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # the no-multicast policy, before the group


def test_init_distributed_backend_from_the_environment(monkeypatch):
    """$MOELINK_DIST_BACKEND picks gloo on GPUs that would get NCCL (the runs under
    compute-sanitizer); an unknown name is refused before any group is made; an
    explicit ``backend`` wins."""
    import torch.distributed as dist

    init = _Recorder()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", _Recorder())
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    for k, v in {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MOELINK_DIST_BACKEND", "gloo")
    assert launch.init_distributed().backend == "gloo"
    ((args, kwargs),) = init.calls
    assert args == ("gloo",) and "device_id" not in kwargs
    assert launch.init_distributed(backend="nccl").backend == "nccl"
    monkeypatch.setenv("MOELINK_DIST_BACKEND", "mpi")
    with pytest.raises(
        RuntimeError, match=r"\$MOELINK_DIST_BACKEND must be gloo or nccl, got 'mpi'"
    ):
        launch.init_distributed()
    assert len(init.calls) == 2


def test_init_distributed_needs_the_launcher_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"\$RANK is not set.*moelink.launch"):
        launch.init_distributed()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="rank 3 of 2"):
        launch.init_distributed()


def test_init_distributed_under_the_launcher_without_gpu(sandbox):
    """Real ranks: a gloo group on the CPU, and an all_reduce through it."""
    script = sandbox.tmp / "dist.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, torch, torch.distributed as dist
            from moelink.launch import init_distributed
            info = init_distributed(timeout_s=60)
            t = torch.tensor([info.rank + 1.0])
            dist.all_reduce(t)
            line = json.dumps({"rank": info.rank, "world": info.world_size,
                               "device": str(info.device), "backend": info.backend,
                               "per_gpu": info.ranks_per_gpu, "sum": t.item()})
            os.write(1, (line + chr(10)).encode())
            dist.destroy_process_group()
            """
        )
    )
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the ranks would pick it")
    cmd = [sys.executable, "-m", "moelink.launch", "-n", "3", "--timeout", "120", str(script)]
    code, out, err, _ = sandbox.run(cmd, timeout=180, MOELINK_LAUNCH_GPUS_OVERRIDE="0")
    assert code == 0, err
    got = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in got] == [0, 1, 2]
    for r in got:
        assert (r["world"], r["device"], r["backend"], r["per_gpu"]) == (3, "cpu", "gloo", 1)
        assert r["sum"] == 6.0
