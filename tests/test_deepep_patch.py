"""benches/deepep_patch.py (the allowed edits to DeepEP V1's test programs) on
synthetic snippets that hold the lines it targets, and benches/deepep_tests.sh's
shell syntax and step handling with stand-in test programs and GPU list, on the CPU."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))

import deepep_patch  # noqa: E402

SCRIPT = BENCHES / "deepep_tests.sh"
GPU = deepep_patch.GPU_EXPR

# Synthetic files shaped like the targets (not DeepEP's code): each target line,
# and look-alikes outside the edits' scopes that must stay as they are.
UTILS = """import os


def init_dist(local_rank: int, num_local_ranks: int):
    node_rank = int(os.getenv('RANK', 0))
    params = {'rank': node_rank * num_local_ranks + local_rank}
    if want_device:
        params['device_id'] = torch.device(f'cuda:{local_rank}')
    setup(**params)
    torch.cuda.set_device(local_rank)
    return params


def other(local_rank):
    torch.cuda.set_device(local_rank)
    return torch.device(f'cuda:{local_rank}')
"""

INTERNODE = """import os


def test_main(args, local_rank: int, num_local_ranks: int,
              num_ranks: int):
    num_experts = args.num_experts
    assert num_experts % num_ranks == 0 and num_local_ranks == 8
    return num_experts


# a comment at column 0
def test_loop(local_rank: int, num_local_ranks: int, args):
    num_ranks = 16
    assert num_local_ranks == 8 and num_ranks > 8
    return num_ranks


def unrelated(num_local_ranks, num_ranks):
    assert num_local_ranks == 8 and num_ranks > 8
"""

LOW_LATENCY = """import torch


def simulate_failure_and_skip(rank, api, expected_masked_ranks):
    failed_api_ranks = {
        'dispatch': 1,
        'combine': 3,
        'clean': 5
    }
    return failed_api_ranks[api] == rank


def test_loop(local_rank, num_local_ranks, args):
    table = {'clean': 5}
"""

OTHERS = {
    "test_intranode.py": "def test_loop(local_rank, num_local_ranks, args):\n    pass\n",
}


def _texts(**overrides):
    texts = {
        "utils.py": UTILS,
        "test_internode.py": INTERNODE,
        "test_low_latency.py": LOW_LATENCY,
        **OTHERS,
    }
    texts.update({k.replace("__", "."): v for k, v in overrides.items()})
    return texts


#: edit -> (file, target line, its replacement); the targets come before the look-alikes.
EXPECTED = {
    "internode-main-8-local-ranks": (
        "test_internode.py",
        "    assert num_experts % num_ranks == 0 and num_local_ranks == 8",
        "    assert num_experts % num_ranks == 0",
    ),
    "internode-loop-8-local-ranks": (
        "test_internode.py",
        "    assert num_local_ranks == 8 and num_ranks > 8",
        "    assert num_ranks > num_local_ranks",
    ),
    "init-dist-device-id": (
        "utils.py",
        "        params['device_id'] = torch.device(f'cuda:{local_rank}')",
        "        params['device_id'] = torch.device(f'cuda:{" + GPU + "}')",
    ),
    "init-dist-set-device": (
        "utils.py",
        "    torch.cuda.set_device(local_rank)",
        "    torch.cuda.set_device(" + GPU + ")",
    ),
    "shrink-clean-rank": (
        "test_low_latency.py",
        "        'clean': 5",
        "        'clean': 5 if torch.distributed.get_world_size() > 5 else 2",
    ),
}


def _changed_lines(before: str, after: str) -> list:
    a, b = before.splitlines(), after.splitlines()
    assert len(a) == len(b)
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_the_edits_are_the_five_allowed_ones():
    assert [e.name for e in deepep_patch.EDITS] == list(EXPECTED)
    assert GPU == "(node_rank * num_local_ranks + local_rank) % torch.cuda.device_count()"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_edit_applies_to_its_target_only(name):
    edit = next(e for e in deepep_patch.EDITS if e.name == name)
    file, old, new = EXPECTED[name]
    assert edit.file == file
    text = _texts()[file]
    patched, n = deepep_patch.apply_edit(text, edit)
    assert n == 1
    assert _changed_lines(text, patched) == [(old, new)]


def test_nothing_else_changes():
    before = _texts()
    after, applied = deepep_patch.patch_files(before)
    assert [(e.name, n) for e, n in applied] == [(k, 1) for k in EXPECTED]
    for f in OTHERS:
        assert after[f] == before[f]
    changed = set()
    for f in ("utils.py", "test_internode.py", "test_low_latency.py"):
        changed.update((f, x, y) for x, y in _changed_lines(before[f], after[f]))
    assert changed == set(EXPECTED.values())
    # The look-alikes outside the edits' functions are untouched.
    assert after["utils.py"].endswith(UTILS[UTILS.index("def other") :])
    assert after["test_internode.py"].endswith(INTERNODE[INTERNODE.index("def unrelated") :])
    assert after["test_low_latency.py"].endswith(LOW_LATENCY[LOW_LATENCY.index("def test_loop") :])


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_missing_target_fails_naming_the_edit(name):
    file, old, _ = EXPECTED[name]
    texts = _texts()
    texts[file] = texts[file].replace(old, "    pass", 1)  # the target, not the look-alike
    with pytest.raises(deepep_patch.PatchError) as err:
        deepep_patch.patch_files(texts)
    assert err.value.edit == name
    assert name in str(err.value)


def test_a_missing_scope_or_variable_fails_naming_the_edit():
    texts = _texts(utils__py=UTILS.replace("def init_dist(", "def setup_dist("))
    with pytest.raises(deepep_patch.PatchError, match="init-dist-device-id.*init_dist"):
        deepep_patch.patch_files(texts)
    # init_dist without node_rank: the replacement would not be valid code there.
    texts = _texts(utils__py=UTILS.replace("node_rank = int", "node = int"))
    with pytest.raises(deepep_patch.PatchError, match="init-dist-device-id.*node_rank"):
        deepep_patch.patch_files(texts)


def _write(folder: Path, texts: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder


def _cli(*args):
    return subprocess.run(
        [sys.executable, str(BENCHES / "deepep_patch.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_copies_patches_and_writes_the_diff(tmp_path):
    # A checkout folder is accepted too: its tests/ subfolder holds the files.
    src = _write(tmp_path / "DeepEP" / "tests", _texts())
    dst = tmp_path / "out"
    p = _cli(src.parent, dst)
    assert p.returncode == 0, p.stderr
    for name in EXPECTED:
        assert f"applied {name}" in p.stdout
    after, _ = deepep_patch.patch_files(_texts())
    for f in deepep_patch.FILES:
        assert (dst / f).read_text() == after[f]
    diff = (dst / "PATCH.diff").read_text()
    minus = [x for x in diff.splitlines() if x.startswith("-") and not x.startswith("---")]
    plus = [x for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]
    assert len(minus) == len(plus) == len(EXPECTED) == 5
    assert "--- a/tests/utils.py" in diff and "+++ b/tests/test_internode.py" in diff
    assert "test_intranode" not in diff


def test_cli_fails_naming_the_edit_and_writes_nothing(tmp_path):
    bad = UTILS.replace("    torch.cuda.set_device(local_rank)\n", "", 1)
    src = _write(tmp_path / "src", _texts(utils__py=bad))
    dst = tmp_path / "out"
    p = _cli(src, dst)
    assert p.returncode != 0
    assert "init-dist-set-device" in p.stderr
    assert not dst.exists()
    # A folder without DeepEP's files says which are missing.
    p = _cli(tmp_path / "empty", dst)
    assert p.returncode != 0 and "utils.py" in p.stderr


def test_runner_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    p = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


# Stand-ins for DeepEP's programs: they print what they were given and a timing
# line; node 1 of internode_ll fails, so that its peer is stopped after the grace.
_FAKE_INTRANODE = """import os, sys
print('args', sys.argv[1:], 'port', os.environ['MASTER_PORT'], os.environ.get('WORLD_SIZE'))
print('[rank 0] Dispatch bandwidth: 1.00 GB/s, avg_t=1.00 us')
"""
_FAKE_INTERNODE_MAIN = """
if __name__ == '__main__':
    import os, sys, time
    print('node', os.environ['RANK'], os.environ['WORLD_SIZE'],
          os.environ['MOELINK_RANKS_PER_NODE'], sys.argv[1:], flush=True)
    if '--test-ll-compatibility' in sys.argv:
        if os.environ['RANK'] == '1':
            sys.exit(3)
        time.sleep(600)
    print('[tuning] Best dispatch: 1.0 GB/s')
"""
_FAKE_LOW_LATENCY_MAIN = """
if __name__ == '__main__':
    import os, sys
    print('ll node', os.environ.get('RANK'), os.environ.get('MOELINK_RANKS_PER_NODE'),
          os.environ.get('MOELINK_LL_TIMEOUT_S'), sys.argv[1:], flush=True)
"""


def _fake_gpus(tmp_path: Path, n: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f'echo "GPU {i}: Stand-in (UUID: GPU-{i})"\n' for i in range(n))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHON=sys.executable,
        DEEPEP_TESTS_PEER_GRACE_S="2",
        DEEPEP_TESTS_TIMEOUT_S="60",
        DEEPEP_TESTS_INTERNODE_TIMEOUT_S="60",
    )
    return env


def _run_script(tmp_path, steps, n_gpus):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    texts = _texts()
    texts["test_intranode.py"] += _FAKE_INTRANODE
    texts["test_internode.py"] += _FAKE_INTERNODE_MAIN
    # The stand-in must run without torch: its import becomes a no-op.
    ll = texts["test_low_latency.py"].replace("import torch", "torch = None")
    texts["test_low_latency.py"] = ll + _FAKE_LOW_LATENCY_MAIN
    src = _write(tmp_path / "src", texts)
    out = tmp_path / "out"
    p = subprocess.run(
        ["bash", str(SCRIPT), str(src), str(out), steps],
        capture_output=True,
        text=True,
        timeout=120,
        env=_fake_gpus(tmp_path, n_gpus),
    )
    return p, out


def test_runner_runs_steps_and_counts_failures(tmp_path):
    p, out = _run_script(tmp_path, "intranode,shrink_2x2,internode,internode_ll", 4)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "shrink_2x2: PASS rc=0 (node0 rc=0, node1 rc=0)" in p.stdout
    shrink = (out / "shrink_2x2.node1.log").read_text()
    assert "ll node 1 2 5 ['--num-processes', '2', '--shrink-test']" in shrink
    assert "intranode: PASS rc=0" in p.stdout
    assert "internode: PASS rc=0 (node0 rc=0, node1 rc=0)" in p.stdout
    assert "internode_ll: FAIL" in p.stdout and "node1 rc=3" in p.stdout
    assert "args ['--num-processes', '4']" in (out / "intranode.log").read_text()
    node1 = (out / "internode.node1.log").read_text()
    assert "node 1 2 2 ['--num-processes', '2']" in node1
    assert "--test-ll-compatibility" in (out / "internode_ll.node0.log").read_text()
    assert (out / "PATCH.diff").read_text().count("\n+ ") == 5
    table = (out / "summary.txt").read_text().splitlines()
    assert [row.split()[:2] for row in table[1:]] == [
        ["intranode", "PASS"],
        ["shrink_2x2", "PASS"],
        ["internode", "PASS"],
        ["internode_ll", "FAIL"],
    ]


def test_runner_with_two_gpus_skips_internode_and_says_so(tmp_path):
    p, out = _run_script(tmp_path, "intranode,internode", 2)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fewer than 4" in p.stdout
    assert "internode: SKIP" in p.stdout
    assert "args ['--num-processes', '2']" in (out / "intranode.log").read_text()
