"""``Config``: launch settings of dispatch/combine, and the buffer sizes they need.

``Config`` takes DeepEP's arguments (``deep_ep.Config``) with DeepEP's defaults and
rules, so existing code builds and passes it unchanged. moelink's intranode kernels
store every token in a fixed slot sized for the worst case (docs/design-intranode.md)
instead of streaming chunks through small ring buffers, so the chunk sizes are
accepted and validated but do not change how much memory a ``Buffer`` needs: the
size hints depend on the number of tokens instead.
"""

from __future__ import annotations

import os

from . import _env, _native
from .checks import LIMITS, MAX_TOPK, check_int

__all__ = [
    "COMBINE_RECORD_TOPK",
    "COUNTER_BYTES",
    "DEFAULT_MAX_TOKENS_PER_RANK",
    "Config",
    "combine_record_bytes",
    "get_combine_config",
    "get_dispatch_config",
    "token_record_bytes",
]

#: Tokens per rank the size hints plan for unless told otherwise.
DEFAULT_MAX_TOKENS_PER_RANK = 4096
#: Bytes of the counter region (per-rank/per-expert counts, signals) of a buffer:
#: 64 KiB (``ep_core::calls::COUNTER_BYTES``).
COUNTER_BYTES = _native.NVL_COUNTER_BYTES
#: Top-k weights (float32) a combine slot carries next to the row: 32.
COMBINE_RECORD_TOPK = _native.COMBINE_RECORD_TOPK

# The sizes below are computed and checked in Rust (``ep_core::calls``, module
# ``sizing``; the Rust API's ``Buffer::nvl_buffer_size_hint`` is the same function):
# Python checks only that the arguments are ints.


def token_record_bytes(
    hidden_bytes: int, num_topk: int = MAX_TOPK, num_scales: int | None = None
) -> int:
    """Bytes of one dispatch slot: what one token carries to one destination rank.

    ``hidden_bytes`` of row data, ``num_scales`` float32 scales (default
    ``hidden_bytes // 128``, which covers fp8 rows with one scale per 128 channels),
    ``num_topk`` expert ids (int64) and weights (float32), and 16 bytes for the
    source token index, the 8-byte flag the fused kernels set after the record and
    padding; rounded up to a multiple of 16.

    ``hidden_bytes`` is 1 to ``max_hidden_bytes``, ``num_topk`` 0 to ``max_topk``,
    ``num_scales`` 0 to ``max_num_scales`` (``moelink.checks.LIMITS``); else
    ``ValueError`` (``TypeError`` for a non-integer).
    """
    return _native.token_record_bytes(
        check_int("hidden_bytes", hidden_bytes),
        check_int("num_topk", num_topk),
        None if num_scales is None else check_int("num_scales", num_scales),
    )


def combine_record_bytes(hidden_bytes: int, num_topk: int = COMBINE_RECORD_TOPK) -> int:
    """Bytes of one combine slot: one expert-output row plus ``num_topk`` float32
    weights and the 8-byte flag the fused kernels set after the record, rounded up
    to a multiple of 16. Arguments checked as ``token_record_bytes`` checks them."""
    return _native.combine_record_bytes(
        check_int("hidden_bytes", hidden_bytes), check_int("num_topk", num_topk)
    )


class Config:
    """Launch settings of normal (non low-latency) dispatch and combine.

    ``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
    num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``, as ``deep_ep.Config``.

    - ``num_sms``: SMs the kernels use; even, because they run in pairs (one sender
      and one receiver block per channel), from 2 to 1024 (``LIMITS["max_num_sms"]``;
      a call uses at most the SMs of its rank's share of the GPU).
    - The chunk sizes (tokens): every count positive and, for both the NVLink and
      the RDMA pair, the send chunk smaller than the receive chunk.

    Invalid values raise ``ValueError`` (``TypeError`` for non-integers) naming the
    argument. A ``Config`` is immutable, compares and hashes by value, and its
    ``repr`` rebuilds it.
    """

    __slots__ = (
        "num_sms",
        "num_max_nvl_chunked_send_tokens",
        "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens",
        "num_max_rdma_chunked_recv_tokens",
    )

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        # 1 to max_num_sms, even (ep_core::calls::num_sms, the Rust API's check too).
        num_sms = _native.check_num_sms("num_sms", check_int("num_sms", num_sms))
        values = {"num_sms": num_sms}
        for name, value in (
            ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens),
        ):
            values[name] = check_int(name, value, minimum=1)
        for kind in ("nvl", "rdma"):
            send = f"num_max_{kind}_chunked_send_tokens"
            recv = f"num_max_{kind}_chunked_recv_tokens"
            if values[send] >= values[recv]:
                raise ValueError(
                    f"{send} must be smaller than {recv}, got {send}={values[send]} "
                    f"and {recv}={values[recv]}"
                )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"Config is immutable; build a new one to change {name}")

    def __delattr__(self, name):
        raise AttributeError(f"Config is immutable; cannot delete {name}")

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"Config({args})"

    def __eq__(self, other):
        if not isinstance(other, Config):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        return (Config, self._key())

    def get_nvl_buffer_size_hint(
        self,
        hidden_bytes: int,
        num_ranks: int,
        *,
        max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
    ) -> int:
        """Bytes of NVLink buffer (``num_nvl_bytes``) a ``Buffer`` needs for
        intranode dispatch/combine of rows of ``hidden_bytes`` bytes among
        ``num_ranks`` ranks, each sending at most ``max_tokens_per_rank`` tokens.

        Pass ``hidden_bytes`` as DeepEP users do (``hidden * max(element_size, 2)``)
        so that one size serves both bf16 and fp8 inputs. The result is a multiple
        of 128:

        - ``COUNTER_BYTES`` (64 KiB) of counters,
        - two equal data regions, dispatch and combine, each of ``num_ranks *
          max_tokens_per_rank`` slots of ``max(token_record_bytes(hidden_bytes),
          combine_record_bytes(hidden_bytes))`` bytes (a slot per possible source
          token with worst-case top-k and scales; an expert-output row plus 32 float32
          weights). The kernels split whatever follows the counters in two halves, so
          a bigger buffer holds proportionally more tokens.

        DeepEP's hint depends on the chunk sizes, because DeepEP streams tokens
        through per-channel ring buffers of ``num_max_nvl_chunked_recv_tokens``
        slots with head/tail flow control, whatever the batch size. moelink gives
        every token a fixed slot (no flow control, one signal per peer instead of
        one per chunk), so the buffer must hold the largest batch: the hint depends
        on ``max_tokens_per_rank`` and not on this config's chunk sizes; a buffer
        sized with this hint holds batches of up to ``max_tokens_per_rank`` tokens
        per rank.

        ``hidden_bytes`` is a positive multiple of 128 up to ``max_hidden_bytes``,
        ``num_ranks`` at most ``max_ranks`` and ``max_tokens_per_rank`` at most
        ``max_tokens_per_rank`` (``moelink.checks.LIMITS``); else ``ValueError``.
        The formula and its checks are Rust's (``ep_core::calls::nvl_buffer_size_hint``,
        which the Rust API's ``Buffer::nvl_buffer_size_hint`` is too); no GPU needed.
        """
        return _native.nvl_buffer_size_hint(
            check_int("hidden_bytes", hidden_bytes),
            check_int("num_ranks", num_ranks),
            check_int("max_tokens_per_rank", max_tokens_per_rank),
        )

    def get_rdma_buffer_size_hint(
        self,
        hidden_bytes: int,
        num_ranks: int,
        *,
        max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
        ranks_per_node: int | None = None,
    ) -> int:
        """Bytes of RDMA buffer (``num_rdma_bytes``) a ``Buffer`` needs for internode
        dispatch/combine: what the internode part adds to
        ``get_nvl_buffer_size_hint``'s bytes (the same ``hidden_bytes``,
        ``num_ranks`` and ``max_tokens_per_rank``) when the ranks span nodes of
        ``ranks_per_node`` ranks; 0 within one node (DeepEP users call it
        unconditionally and pass the result to ``Buffer``).

        ``ranks_per_node`` defaults to ``MOELINK_RANKS_PER_NODE`` (emulated nodes),
        else torchrun's ``LOCAL_WORLD_SIZE``, else 8 (DeepEP's NVLink domain). The
        formula and its checks are Rust's (``ep_core::calls::rdma_buffer_size_hint``):
        64 KiB of staging plus two halves of ``max_tokens_per_rank * (num_ranks + 2 *
        nodes)`` records of the NVLink slot plus ``4 * ranks_per_node + 16`` bytes.
        """
        if ranks_per_node is None:
            ranks_per_node = _env_ranks_per_node()
        if ranks_per_node is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            ranks_per_node = int(local) if local.strip().isdigit() else 8
        return _native.rdma_buffer_size_hint(
            check_int("hidden_bytes", hidden_bytes),
            check_int("num_ranks", num_ranks),
            check_int("max_tokens_per_rank", max_tokens_per_rank),
            check_int("ranks_per_node", ranks_per_node),
        )


def _env_ranks_per_node() -> int | None:
    """``MOELINK_RANKS_PER_NODE`` (emulated nodes of that many consecutive ranks),
    or None where unset or empty; anything but a positive integer raises
    ``ValueError`` naming the variable, as the native side does."""
    raw = _env.get("MOELINK_RANKS_PER_NODE")
    if raw is None or not raw.strip():
        return None
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ValueError(f"MOELINK_RANKS_PER_NODE must be a positive integer, got {raw!r}")
    return int(raw)


# Chunk sizes mirror DeepEP's tuned tables so printed configs look familiar; they do
# not affect moelink's fixed-slot kernels. The SM count is what matters; its default
# per rank count is the native `default_num_sms` (ep_core::calls): the smallest count
# that reached 95 % of the best in the SM sweep on 4 x H200
# (benches/results/2026-11-28_h200x4_sm-table).
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
}
_GENERIC_CHUNKS = (6, 256, 6, 256)


def _check_config_ranks(num_ranks) -> int:
    """``num_ranks`` of a config lookup: 1 to ``max_ranks``. Beyond that a
    ``ValueError`` that names the count and says why (frameworks such as vLLM
    ask for counts up to 160; never a ``KeyError``)."""
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    limit = LIMITS["max_ranks"]
    if num_ranks > limit:
        raise ValueError(
            f"num_ranks must be <= {limit}, got {num_ranks}: moelink has no dispatch/combine "
            f"config for {num_ranks} ranks because a moelink Buffer serves at most {limit} "
            "ranks in all (moelink.checks.LIMITS['max_ranks']), on one host, as one node or "
            "split into nodes for the internode path"
        )
    return num_ranks


def _config_for(call: str, table: dict, num_ranks: int, num_sms: int | None) -> Config:
    num_ranks = _check_config_ranks(num_ranks)
    if num_sms is None:
        num_sms = _native.default_num_sms(call, num_ranks)
    return Config(num_sms, *table.get(num_ranks, _GENERIC_CHUNKS))


def get_dispatch_config(num_ranks: int, *, num_sms: int | None = None) -> Config:
    """Default ``Config`` for dispatch among ``num_ranks`` ranks.

    Rank counts 2, 4 and 8 have their own chunk sizes, any other count from 1 to
    ``max_ranks`` (32) generic ones. ``num_sms``, unless given (as
    ``Buffer.set_num_sms`` does), is the smallest count that reached 95 % of the
    best in the SM sweep on 4 x H200 (docs/performance.md, "Default SM counts"):
    64 for 1 or 2 ranks, 32 for 3 or more. A group spanning nodes (the internode
    path) takes the same configs: ``num_ranks`` counts every rank of the group.
    Above 32 ranks (vLLM asks up to 160): ``ValueError`` naming the count and why (a
    Buffer serves at most 32 ranks in all, split into nodes or not); below 1 too;
    ``TypeError`` for a non-integer.
    """
    return _config_for("dispatch", _DISPATCH_CONFIGS, num_ranks, num_sms)


def get_combine_config(num_ranks: int, *, num_sms: int | None = None) -> Config:
    """Default ``Config`` for combine among ``num_ranks`` ranks; rank counts,
    ``num_sms`` and errors as ``get_dispatch_config``. The default SMs are those of
    a combine whose ``x`` is sent as records: 48 for 1 or 2 ranks, 32 for 3 or
    more. A ``Buffer`` called without a config takes fewer (32 and 16) for an ``x``
    that its peers read where it lies (``MOELINK_INTRANODE_RECV=direct``, ``x`` in
    the receive pool)."""
    return _config_for("combine", _COMBINE_CONFIGS, num_ranks, num_sms)
