"""The ``deep_ep`` alias package (python/deep_ep_alias) on the CPU: it serves
DeepEP's names from moelink, refuses to shadow a real DeepEP, installs with pip,
and keeps DeepEP's constructor keywords and config lookups."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import moelink
import pytest

from .conftest import ALIAS


def test_deep_ep_names_are_moelinks(deep_ep):
    assert deep_ep.BACKEND == "moelink"
    assert deep_ep.Buffer is moelink.Buffer
    assert deep_ep.Config is moelink.Config
    assert deep_ep.EventOverlap is moelink.EventOverlap
    assert deep_ep.topk_idx_t is moelink.topk_idx_t
    from deep_ep.utils import EventHandle, EventOverlap

    assert EventOverlap is moelink.EventOverlap
    assert EventHandle is moelink.EventHandle


def test_it_refuses_to_shadow_a_real_deep_ep(monkeypatch):
    monkeypatch.syspath_prepend(str(ALIAS))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        if name == "deep_ep_cpp":
            return importlib.machinery.ModuleSpec("deep_ep_cpp", None)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="refuses to shadow"):
        importlib.import_module("deep_ep")
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)


def test_the_frameworks_constructor_keywords(deep_ep):
    params = inspect.signature(deep_ep.Buffer).parameters
    for kw in (
        "group",
        "num_nvl_bytes",
        "num_rdma_bytes",
        "low_latency_mode",
        "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode",
        "allow_mnnvl",
        "use_fabric",
        "explicitly_destroy",
        "enable_shrink",
        "comm",
    ):
        assert kw in params, kw
    with pytest.raises(TypeError, match="unexpected keyword"):
        deep_ep.Buffer(None, 0, 0, num_sms_per_rank=4)


def test_vllm_config_lookups(deep_ep):
    """vLLM asks for these rank counts; what moelink cannot serve is a clear
    ValueError naming the count, never a KeyError."""
    for n in (2, 4, 8, 16, 24, 32):
        assert isinstance(deep_ep.Buffer.get_dispatch_config(n), deep_ep.Config)
        assert isinstance(deep_ep.Buffer.get_combine_config(n), deep_ep.Config)
    for n in (64, 128, 144, 160):
        for get in (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config):
            with pytest.raises(ValueError, match=str(n)):
                get(n)


def test_pip_installs_it(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--target", str(target), str(ALIAS)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert (target / "deep_ep" / "__init__.py").is_file()
    assert (target / "deep_ep" / "utils.py").is_file()


def test_the_moelink_wheel_does_not_carry_deep_ep():
    """Only the alias package may provide ``deep_ep``: moelink's own wheel never
    does (it would shadow a real DeepEP)."""
    from importlib.metadata import files

    listed = [str(f) for f in files("moelink") or []]
    assert listed, "moelink's installed file list"
    assert not [f for f in listed if f.startswith("deep_ep")], listed
