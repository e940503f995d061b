"""The torch process group a Buffer or AllReduce is made on: checked before its
first collective, so that a group moelink cannot use fails with a clear
``ValueError`` instead of an error deep inside NCCL or a hang; and its native
``Group`` (one bootstrap, one unique-id broadcast), made once and shared by every
Buffer half and AllReduce made on the group."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from . import _native
from ._device_timeout import env_host_timeout_s

#: torch process group -> its native Group (the group object is kept alive
#: with it, so that its id is never reused by another group).
_GROUPS: dict = {}


def ranks_share_gpus() -> bool:
    """Whether the local ranks (``LOCAL_WORLD_SIZE``, set by torchrun and
    ``moelink.launch``) outnumber this host's GPUs, so that some share a GPU."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    except ValueError:
        return False
    n = torch.cuda.device_count()
    return n > 0 and local > n


def check_group(group, what: str) -> None:
    """Raises ``ValueError`` for a group ``what`` cannot be made on: an NCCL group
    whose ranks share GPUs (NCCL refuses them: use gloo, as
    ``moelink.launch.init_distributed`` does), or ranks on more than one host.
    Collective: every rank of ``group`` calls it."""
    if dist.get_backend(group) == "nccl" and ranks_share_gpus():
        raise ValueError(
            f"group: {what} on an NCCL process group whose ranks share GPUs "
            f"({os.environ.get('LOCAL_WORLD_SIZE')} local ranks, {torch.cuda.device_count()} "
            "GPUs): NCCL refuses two ranks on one GPU; create the group with backend='gloo' "
            "(moelink.launch.init_distributed() picks it)"
        )
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        raise ValueError(
            f"group: all ranks of a {what} group must be on one host, got {sorted(set(hosts))}"
        )


def native_group(group, what: str):
    """*Collective.* The native ``Group`` of torch process group ``group``: made
    at the first Buffer or AllReduce on it (after ``check_group``; one bootstrap
    id, broadcast from the group's first rank), then shared. Every rank must make
    its objects on a group in the same order; the native side checks that and
    names the ranks that differ. Bootstrap waits are bounded by
    ``MOELINK_TIMEOUT_S`` (default 60 s)."""
    found = _GROUPS.get(group)
    if found is not None:
        return found[1]
    check_group(group, what)
    rank = dist.get_rank(group)
    uid = [_native.bootstrap_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
    timeout = env_host_timeout_s()
    native = _native.Group(uid[0], rank, dist.get_world_size(group), timeout)
    _GROUPS[group] = (group, native)
    return native
