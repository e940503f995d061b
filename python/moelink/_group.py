"""Checks of the torch process group a Buffer or AllReduce is made on, before
its first collective, so that a group moelink cannot use fails with a clear
``ValueError`` instead of an error deep inside NCCL or a hang."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


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
