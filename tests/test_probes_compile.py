"""The standalone CUDA probes under benches/probe compile (CPU only: ``nvcc -c``
for sm_90a, no GPU needed), so a probe that a record cites still builds.

nvcc is the project's pinned one (scripts/setup.sh puts it in .venv), else
``MOELINK_NVCC`` / ``nvcc`` on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = sorted((ROOT / "benches" / "probe").glob("*.cu"))


def _nvcc() -> str | None:
    given = os.environ.get("MOELINK_NVCC")
    if given:
        return given
    venv = Path(sys.prefix) / "lib"
    for found in sorted(venv.glob("python3*/site-packages/nvidia/cu13/bin/nvcc")):
        return str(found)
    return shutil.which("nvcc")


def test_there_are_probes():
    assert PROBES, "benches/probe has no .cu file"


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_compiles(probe: Path, tmp_path: Path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (scripts/setup.sh installs the pinned one into .venv)")
    out = subprocess.run(
        [nvcc, "-O3", "-arch=sm_90a", "-std=c++17", "-c", "-o", str(tmp_path / "p.o"), str(probe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
