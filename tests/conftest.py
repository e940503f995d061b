"""Shared test setup: GPU tests skip themselves, with a reason, where there is no GPU;
``gloo_world``, a one-rank gloo group for the CPU tests of collective code;
``deep_ep``, the alias package imported from the source tree."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

#: The ``deep_ep`` alias package's source folder.
ALIAS = Path(__file__).resolve().parents[1] / "python" / "deep_ep_alias"

# The no-multicast policy applies to every process the tests start.
for _k, _v in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ[_k] = _v


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = cuda_device_count()
    for item in items:
        if "multi_gpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n}"))
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo process group (the default group), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def deep_ep(monkeypatch):
    """``import deep_ep`` from the alias package's source folder (a fresh import)."""
    monkeypatch.syspath_prepend(str(ALIAS))
    for name in ("deep_ep", "deep_ep.utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("deep_ep")
