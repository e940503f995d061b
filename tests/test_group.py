"""The process-group checks a Buffer / AllReduce runs before its first collective
(moelink._group), on a one-rank gloo group: no GPU needed."""

from __future__ import annotations

import pytest
import torch
from moelink import _group


def test_ranks_share_gpus_reads_local_world_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _group.ranks_share_gpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not _group.ranks_share_gpus()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert not _group.ranks_share_gpus()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not _group.ranks_share_gpus()


def test_nccl_group_with_shared_gpus_is_refused(gloo_world, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(_group.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="group: Buffer on an NCCL process group.*gloo"):
        _group.check_group(gloo_world, "Buffer")


def test_gloo_group_with_shared_gpus_passes(gloo_world, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _group.check_group(gloo_world, "AllReduce")


def test_ranks_on_two_hosts_are_refused(gloo_world, monkeypatch):
    def two_hosts(out, obj, group=None):
        out[0] = "host-a"
        out.append("host-b")

    monkeypatch.setattr(_group.dist, "all_gather_object", two_hosts)
    with pytest.raises(ValueError, match="one host"):
        _group.check_group(gloo_world, "Buffer")


def test_one_native_group_per_torch_group(gloo_world, monkeypatch):
    """The first object on a group makes its native Group (one bootstrap id
    broadcast), every later one gets the same; a failed check makes none."""
    monkeypatch.setattr(_group, "_GROUPS", {})
    checks = []
    real_check = _group.check_group
    monkeypatch.setattr(_group, "check_group", lambda g, w: checks.append(w) or real_check(g, w))
    a = _group.native_group(gloo_world, "Buffer")
    b = _group.native_group(gloo_world, "AllReduce")
    assert a is b
    assert checks == ["Buffer"]
    assert (a.rank, a.size, a.objects) == (0, 1, 0)


def test_a_group_that_fails_its_check_is_not_cached(gloo_world, monkeypatch):
    monkeypatch.setattr(_group, "_GROUPS", {})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(_group.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="NCCL"):
        _group.native_group(gloo_world, "Buffer")
    assert _group._GROUPS == {}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_native_group_timeout_must_be_positive(bad):
    from moelink import _native

    with pytest.raises(ValueError, match="timeout_s must be positive"):
        _native.Group(_native.bootstrap_unique_id(), 0, 1, bad)
