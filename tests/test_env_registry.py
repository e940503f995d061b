"""The registry of environment switches (comm::env): the table in
docs/environment.md is ``_native.env_switches()``; the library's code names no
``MOELINK_*`` variable outside it and reads them in one place per language
(comm/src/env.rs, python/moelink/_env.py). Runs on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from moelink import _env, _native

ROOT = Path(__file__).resolve().parents[1]
RUST_CRATES = ["comm", "ep-kernels", "ep-core", "ep-python", "moelink-tch", "collectives",
               "ep-reference"]  # fmt: skip
SUFFIXES = {".rs", ".py", ".cu", ".cuh"}

#: ``MOELINK_*`` names in library code that are not environment switches.
NOT_SWITCHES = {
    # rustc-env values a build script sets for include_bytes! (build-utils).
    "MOELINK_FATBIN": "ep-kernels' fatbin path (build.rs)",
    "MOELINK_COLL_FATBIN": "collectives' fatbin path (build.rs)",
    "MOELINK_COLL": "the prefix collectives/build.rs gives build-utils",
    # CUDA macros of collectives/cuda/allreduce.cu.
    "MOELINK_AR_VARIANTS": "a CUDA macro",
    "MOELINK_AR_KERNEL": "a CUDA macro",
    # A prefix of the MOELINK_INTRANODE_* names (an error message test).
    "MOELINK_INTRANODE": "a prefix",
}

#: A MOELINK_ name: not part of a longer identifier (DEP_MOELINK_COMM_INCLUDE,
#: cargo's links metadata), not a prefix pattern (``MOELINK_IB_*``).
NAME = re.compile(r"(?<![A-Za-z0-9_])MOELINK_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")

ROW = re.compile(r"\| `(MOELINK_[A-Z0-9_]+)` \| (\w+) \| (.+?) \| (.+) \|")


def library_files() -> list[Path]:
    roots = [ROOT / c / "src" for c in RUST_CRATES] + [ROOT / "python" / "moelink"]
    return sorted(p for r in roots for p in r.rglob("*") if p.suffix in SUFFIXES)


def documented() -> list[tuple[str, str, str, str]]:
    """The rows of the table in docs/environment.md."""
    rows = []
    for line in (ROOT / "docs" / "environment.md").read_text().splitlines():
        if line.startswith("| `MOELINK_"):
            m = ROW.fullmatch(line.strip())
            assert m, f"not a row of the table: {line}"
            rows.append(m.groups())
    return rows


def test_the_docs_table_is_the_registry():
    assert documented() == [tuple(s) for s in _native.env_switches()]


def test_the_registry_is_sorted_unique_and_of_three_kinds():
    names = [s[0] for s in _native.env_switches()]
    assert names == sorted(set(names))
    assert {s[1] for s in _native.env_switches()} <= {"user", "diagnostic"}


def test_every_name_in_library_code_is_registered():
    registered = _env.registered()
    unknown = {}
    for path in library_files():
        for name in NAME.findall(path.read_text()):
            if name not in registered and name not in NOT_SWITCHES:
                unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert unknown == {}, "add them to comm/src/env.rs (and docs/environment.md)"
    assert not registered & NOT_SWITCHES.keys()


#: A Rust read of the environment: std::env::var / var_os (not comm::env's).
RUST_READ = re.compile(r"(?<!comm::)(?<!crate::)\benv::var(?:_os)?\s*\(\s*([^)]*)\)")
#: Rust reads whose argument is a variable known to name no MOELINK_* switch.
RUST_OTHER_READS = {
    ("comm/src/bootstrap/tcp.rs", "name"),  # env_var: RANK, WORLD_SIZE, MASTER_*
}
#: A Python read by name: ``<mapping>.get(KEY`` or ``<mapping>[KEY]``, and
#: ``KEY in os.environ``, where KEY is a MOELINK_ literal or a ``*_ENV`` constant.
KEY = r"(?:[\"']MOELINK_[A-Z0-9_]+[\"']|[A-Z][A-Z0-9_]*_ENV\b)"
PY_READ = re.compile(
    rf"(?<![\w.])([\w.]+)(?:\.get\(\s*{KEY}|\[\s*{KEY}\s*\](?!\s*=[^=]))|{KEY}\s+in\s+os\.environ"
)


def test_only_comm_env_reads_moelink_variables_in_rust():
    bad = []
    for path in library_files():
        rel = str(path.relative_to(ROOT))
        if path.suffix != ".rs" or rel == "comm/src/env.rs":
            continue
        for m in RUST_READ.finditer(path.read_text()):
            arg = m[1].strip()
            literal = arg.startswith('"')
            if (literal and "MOELINK" in arg) or (
                not literal and (rel, arg) not in RUST_OTHER_READS
            ):
                bad.append(f"{rel}: {m[0]}")
    assert bad == [], "read MOELINK_* variables through comm::env::var"


def test_only_env_py_reads_moelink_variables_in_python():
    bad = []
    for path in library_files():
        if path.suffix != ".py" or path.name == "_env.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in PY_READ.finditer(line):
                if m[1] != "_env":
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert bad == [], "read MOELINK_* variables through moelink._env.get"


def test_env_get_checks_the_name(monkeypatch):
    monkeypatch.setenv("MOELINK_TIMEOUT_S", "12")
    assert _env.get("MOELINK_TIMEOUT_S") == "12"
    assert _env.get("MOELINK_TIMEOUT_S", environ={}) is None
    assert _env.get("MOELINK_TIMEOUT_S", "60", environ={}) == "60"
    monkeypatch.delenv("MOELINK_TIMEOUT_S")
    assert _env.get("MOELINK_TIMEOUT_S", "60") == "60"
    assert _env.name("MOELINK_TIMEOUT_S") == "MOELINK_TIMEOUT_S"
    for bad in ["MOELINK_NOT_A_SWITCH", "TIMEOUT_S"]:
        with pytest.raises(KeyError, match=bad):
            _env.get(bad)
        with pytest.raises(KeyError, match=bad):
            _env.name(bad)


@pytest.mark.parametrize("raw, want", [(None, 60.0), (" 12.5 ", 12.5), ("1e-3", 1e-3)])
def test_host_timeout_takes_a_positive_number(monkeypatch, raw, want):
    from moelink._device_timeout import env_host_timeout_s

    if raw is None:
        monkeypatch.delenv("MOELINK_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("MOELINK_TIMEOUT_S", raw)
    assert env_host_timeout_s() == want


# "" too: set but empty is not a number of seconds (as MOELINK_DEVICE_TIMEOUT_S,
# and as the Rust API reads MOELINK_TIMEOUT_S).
@pytest.mark.parametrize("raw", ["", "0", "-5", "inf", "nan", "ten", "1s"])
def test_host_timeout_refuses_what_would_hang_or_fail_every_wait(monkeypatch, raw):
    from moelink._device_timeout import env_host_timeout_s

    monkeypatch.setenv("MOELINK_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="MOELINK_TIMEOUT_S"):
        env_host_timeout_s()


def test_ranks_per_node_is_a_positive_integer_or_unset(monkeypatch):
    from moelink.config import _env_ranks_per_node

    monkeypatch.delenv("MOELINK_RANKS_PER_NODE", raising=False)
    assert _env_ranks_per_node() is None
    monkeypatch.setenv("MOELINK_RANKS_PER_NODE", " 2 ")
    assert _env_ranks_per_node() == 2
    for raw in ["0", "-2", "two", "2.5"]:
        monkeypatch.setenv("MOELINK_RANKS_PER_NODE", raw)
        with pytest.raises(ValueError, match="MOELINK_RANKS_PER_NODE"):
            _env_ranks_per_node()


def test_the_rdma_size_hint_names_a_bad_ranks_per_node(monkeypatch):
    from moelink import Config

    config = Config(24, 6, 256, 6, 256)
    monkeypatch.setenv("MOELINK_RANKS_PER_NODE", "2")
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) > 0
    monkeypatch.setenv("MOELINK_RANKS_PER_NODE", "x")
    with pytest.raises(ValueError, match="MOELINK_RANKS_PER_NODE"):
        config.get_rdma_buffer_size_hint(7168 * 2, 8)
