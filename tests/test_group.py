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
