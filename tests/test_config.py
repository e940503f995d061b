"""CPU tests of ``moelink.Config``, its buffer size hints and the default configs."""

from __future__ import annotations

import copy
import pickle
import types

import moelink
import pytest
import torch
from moelink.config import (
    COMBINE_RECORD_TOPK,
    COUNTER_BYTES,
    Config,
    combine_record_bytes,
    get_combine_config,
    get_dispatch_config,
    token_record_bytes,
)

NAMES = (
    "num_sms",
    "num_max_nvl_chunked_send_tokens",
    "num_max_nvl_chunked_recv_tokens",
    "num_max_rdma_chunked_send_tokens",
    "num_max_rdma_chunked_recv_tokens",
)


def test_package_exports():
    assert moelink.Config is Config
    assert moelink.topk_idx_t is torch.int64
    assert {"Config", "topk_idx_t"} <= set(moelink.__all__)


def test_defaults_match_deepep():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (
        20,
        6,
        256,
    )
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)


def test_positional_and_keyword_arguments():
    # DeepEP's tables build configs positionally.
    c = Config(24, 6, 256, 6, 128)
    assert c == Config(
        num_sms=24,
        num_max_nvl_chunked_send_tokens=6,
        num_max_nvl_chunked_recv_tokens=256,
        num_max_rdma_chunked_send_tokens=6,
        num_max_rdma_chunked_recv_tokens=128,
    )
    assert Config(2, 1, 2, 1, 2).num_max_rdma_chunked_recv_tokens == 2


def test_repr_eq_hash_and_immutability():
    c = Config(24, 6, 256, 6, 128)
    assert repr(c) == (
        "Config(num_sms=24, num_max_nvl_chunked_send_tokens=6, "
        "num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6, "
        "num_max_rdma_chunked_recv_tokens=128)"
    )
    assert eval(repr(c), {"Config": Config}) == c
    assert c == Config(24, 6, 256, 6, 128)
    assert c != Config(26, 6, 256, 6, 128)
    assert c != "Config"
    assert hash(c) == hash(Config(24, 6, 256, 6, 128))
    assert len({c, Config(24, 6, 256, 6, 128), Config()}) == 2
    with pytest.raises(AttributeError, match="immutable"):
        c.num_sms = 4
    with pytest.raises(AttributeError):
        c.other = 1
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(c) == c


def test_numpy_and_torch_style_integers_accepted():
    import numpy as np

    c = Config(np.int64(8), np.int32(3))
    assert c.num_sms == 8 and type(c.num_sms) is int
    assert c.num_max_nvl_chunked_send_tokens == 3


@pytest.mark.parametrize("num_sms", [1, 3, 21, 131])
def test_odd_num_sms(num_sms):
    with pytest.raises(ValueError, match=rf"num_sms must be even .*got {num_sms}"):
        Config(num_sms=num_sms)


@pytest.mark.parametrize("num_sms", [1026, 10**6, 2**64])
def test_num_sms_above_the_limit(num_sms):
    with pytest.raises(ValueError, match=rf"num_sms must be <= 1024, got {num_sms}"):
        Config(num_sms=num_sms)
    assert Config(num_sms=1024).num_sms == 1024


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0, -2])
def test_non_positive(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be positive, got {value}"):
        Config(**{name: value})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [2.0, "8", None, True])
def test_non_integer(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be an int"):
        Config(**{name: value})


@pytest.mark.parametrize("kind", ["nvl", "rdma"])
@pytest.mark.parametrize("send,recv", [(256, 256), (300, 256), (2, 1)])
def test_send_chunk_not_below_recv_chunk(kind, send, recv):
    send_name = f"num_max_{kind}_chunked_send_tokens"
    recv_name = f"num_max_{kind}_chunked_recv_tokens"
    with pytest.raises(
        ValueError,
        match=rf"{send_name} must be smaller than {recv_name}, "
        rf"got {send_name}={send} and {recv_name}={recv}",
    ):
        Config(**{send_name: send, recv_name: recv})


def test_token_record_bytes():
    # 7168 bf16 channels: row 14336 + 112 scales * 4 + 32 * 12 + 16 = 15184.
    assert token_record_bytes(7168 * 2) == 15184
    assert token_record_bytes(7168 * 2, num_topk=8, num_scales=56) == 14336 + 224 + 96 + 16
    # Rounded up to 16.
    assert token_record_bytes(130, num_topk=1) == 176  # 130 + 1 * 4 + 12 + 16 = 162
    assert token_record_bytes(128, num_topk=0, num_scales=1) == 160  # 148
    for hidden_bytes in (128, 256, 2048, 7168, 14336):
        for k in (1, 7, 32):
            assert token_record_bytes(hidden_bytes, num_topk=k) % 16 == 0
    assert combine_record_bytes(14336) == 14336 + 128 + 16  # + the 8-byte flag, rounded to 16
    with pytest.raises(ValueError, match="hidden_bytes must be positive"):
        token_record_bytes(0)
    with pytest.raises(ValueError, match="num_topk must be >= 0"):
        token_record_bytes(128, num_topk=-1)


def test_record_bytes_limits():
    """The record sizes are Rust's (``ep_core::calls``), checked there: each bound
    names its argument."""
    assert (COUNTER_BYTES, COMBINE_RECORD_TOPK) == (64 * 1024, 32)
    assert combine_record_bytes(64, 0) == 80  # 64 + the flag, rounded to 16
    assert token_record_bytes(1 << 20, 32, 8192) % 16 == 0
    for f, args, match in [
        (token_record_bytes, (128, 1, 8193), r"^num_scales must be <= 8192, got 8193$"),
        (token_record_bytes, (128, 1, -1), r"^num_scales must be >= 0, got -1$"),
        (token_record_bytes, (128, 33), r"^num_topk must be <= 32, got 33$"),
        (token_record_bytes, ((1 << 20) + 1,), r"^hidden_bytes must be <= 1048576, got 1048577$"),
        (
            token_record_bytes,
            (2**64,),
            r"^hidden_bytes must be <= 1048576, got 18446744073709551616$",
        ),
        (combine_record_bytes, (0,), r"^hidden_bytes must be positive, got 0$"),
        (combine_record_bytes, (128, 40), r"^num_topk must be <= 32, got 40$"),
    ]:
        with pytest.raises(ValueError, match=match):
            f(*args)
    with pytest.raises(TypeError, match="num_scales must be an int, got float"):
        token_record_bytes(128, 1, 1.0)
    with pytest.raises(TypeError, match="num_topk must be an int, got bool"):
        combine_record_bytes(128, True)


def test_nvl_hint_is_the_native_one():
    """``Config.get_nvl_buffer_size_hint`` is ``ep_core::calls::nvl_buffer_size_hint``
    (which the Rust API's ``Buffer::nvl_buffer_size_hint`` is too), callable without a
    GPU; the standard workload's number."""
    assert Config().get_nvl_buffer_size_hint(7168 * 2, 4) == 497_614_848
    for args in ((7168 * 2, 8, 4096), (128, 1, 1), (384, 3, 7), (1 << 20, 32, 1000)):
        assert Config().get_nvl_buffer_size_hint(
            *args[:2], max_tokens_per_rank=args[2]
        ) == moelink._native.nvl_buffer_size_hint(*args)
    with pytest.raises(
        ValueError,
        match=r"^hidden_bytes must be a positive multiple of 128 up to 1048576, "
        r"got 18446744073709551616$",
    ):
        Config().get_nvl_buffer_size_hint(2**64, 4)
    with pytest.raises(TypeError, match="max_tokens_per_rank must be an int, got float"):
        Config().get_nvl_buffer_size_hint(1024, 4, max_tokens_per_rank=4.0)


def test_set_num_sms_checks_as_config_does(monkeypatch):
    from moelink.buffer import Buffer

    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    monkeypatch.setattr(Buffer, "_num_sms_set", Buffer._num_sms_set)
    for bad, match in [
        (0, r"^new_num_sms must be positive, got 0$"),
        (7, r"^new_num_sms must be even \(SMs are used in pairs: .*\), got 7$"),
        (1026, r"^new_num_sms must be <= 1024, got 1026$"),
        (-(2**70), r"^new_num_sms must be positive, got -1180591620717411303424$"),
    ]:
        with pytest.raises(ValueError, match=match):
            Buffer.set_num_sms(bad)
    with pytest.raises(TypeError, match="new_num_sms must be an int"):
        Buffer.set_num_sms(2.0)
    Buffer.set_num_sms(1024)
    assert Buffer.num_sms == 1024 and type(Buffer.num_sms) is int


def test_nvl_hint_formula():
    c = Config()
    hidden_bytes, ranks, tokens = 7168 * 2, 4, 4096
    want = 2 * ranks * tokens * max(15184, 14336 + 128) + COUNTER_BYTES
    assert c.get_nvl_buffer_size_hint(hidden_bytes, ranks) == want
    assert c.get_nvl_buffer_size_hint(hidden_bytes, ranks, max_tokens_per_rank=tokens) == want
    # The chunk sizes do not matter for fixed slots.
    assert Config(2, 1, 2, 1, 2).get_nvl_buffer_size_hint(hidden_bytes, ranks) == want


def test_nvl_hint_multiple_of_128_and_monotonic():
    c = Config()
    prev_h = 0
    for hidden_bytes in (128, 256, 1024, 4096, 7168, 14336):
        prev_r = 0
        size_h = c.get_nvl_buffer_size_hint(hidden_bytes, 8)
        assert size_h > prev_h
        prev_h = size_h
        for ranks in range(1, 9):
            prev_t = 0
            size_r = c.get_nvl_buffer_size_hint(hidden_bytes, ranks)
            assert size_r > prev_r
            prev_r = size_r
            for tokens in (1, 2, 33, 128, 4096, 8192):
                size = c.get_nvl_buffer_size_hint(hidden_bytes, ranks, max_tokens_per_rank=tokens)
                assert size % 128 == 0
                assert size > prev_t
                prev_t = size
    # Odd ranks and token counts still give a multiple of 128.
    assert c.get_nvl_buffer_size_hint(384, 3, max_tokens_per_rank=7) % 128 == 0
    # The largest shape within the limits.
    assert c.get_nvl_buffer_size_hint(1 << 20, 32, max_tokens_per_rank=(1 << 26) - 1) > 1 << 50


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((0, 4), {}, "hidden_bytes must be a positive multiple of 128"),
        ((100, 4), {}, "hidden_bytes must be a positive multiple of 128 up to 1048576, got 100"),
        ((-128, 4), {}, "hidden_bytes must be a positive multiple of 128"),
        (((1 << 20) + 128, 4), {}, "hidden_bytes must be a positive multiple of 128 up to"),
        ((2**64, 4), {}, "hidden_bytes must be a positive multiple of 128 up to"),
        ((1024, 0), {}, "num_ranks must be positive"),
        ((1024, 33), {}, "num_ranks must be <= 32, got 33"),
        ((1024, 4), {"max_tokens_per_rank": 0}, "max_tokens_per_rank must be positive"),
        ((1024, 4), {"max_tokens_per_rank": 1 << 26}, "max_tokens_per_rank must be <= 67108863"),
        ((1024, 4), {"max_tokens_per_rank": -(2**63)}, "max_tokens_per_rank must be positive"),
    ],
)
def test_nvl_hint_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config().get_nvl_buffer_size_hint(*args, **kwargs)


def test_rdma_hint_is_zero_within_a_node_and_covers_the_internode_regions():
    c = Config()
    for hidden_bytes in (256, 14336):
        for ranks in (1, 2, 8):
            assert c.get_rdma_buffer_size_hint(hidden_bytes, ranks, ranks_per_node=8) == 0
    # Across nodes: 64 KiB of staging + two halves of T * (R + 2N) records of the
    # NVLink slot plus 4L + 16 bytes (ep_core::calls::rdma_buffer_size_hint).
    slot = max(moelink.config.token_record_bytes(1024), moelink.config.combine_record_bytes(1024))
    for ranks, per_node in ((4, 2), (8, 4), (8, 2), (6, 2)):
        nodes = ranks // per_node
        want = 2 * 100 * (ranks + 2 * nodes) * (slot + 4 * per_node + 16) + 65536
        want = (want + 127) // 128 * 128
        got = c.get_rdma_buffer_size_hint(
            1024, ranks, max_tokens_per_rank=100, ranks_per_node=per_node
        )
        assert got == want, (ranks, per_node)
    with pytest.raises(ValueError, match="ranks_per_node 4 does not divide num_ranks 6"):
        c.get_rdma_buffer_size_hint(1024, 6, ranks_per_node=4)
    with pytest.raises(ValueError, match="num_ranks must be positive"):
        c.get_rdma_buffer_size_hint(1024, 0)
    with pytest.raises(ValueError, match="num_ranks must be <= 32"):
        c.get_rdma_buffer_size_hint(1024, 64)
    with pytest.raises(ValueError, match="hidden_bytes must be a positive multiple of 128"):
        c.get_rdma_buffer_size_hint(100, 4)


#: The default SMs by call, for 1-2 ranks and for 3 or more (the SM sweep of
#: benches/results/2026-11-28_h200x4_sm-table: 95 % of the best).
DEFAULT_SMS = {"dispatch": (64, 48), "combine": (48, 48), "combine_in_pool": (32, 16)}


@pytest.mark.parametrize("get", [get_dispatch_config, get_combine_config])
def test_default_configs(get):
    call = "dispatch" if get is get_dispatch_config else "combine"
    for ranks in range(1, 9):
        c = get(ranks)
        assert isinstance(c, Config)
        assert c.num_sms == DEFAULT_SMS[call][ranks > 2], ranks
        assert c.num_max_nvl_chunked_send_tokens < c.num_max_nvl_chunked_recv_tokens
        assert c.num_max_rdma_chunked_send_tokens < c.num_max_rdma_chunked_recv_tokens
        assert c.get_nvl_buffer_size_hint(7168 * 2, ranks) > 0
    assert get(3) == get(5) == get(7)  # generic chunks, the 4-rank SMs
    assert get(1).num_sms == get(2).num_sms
    assert get(32).num_sms == DEFAULT_SMS[call][1]
    with pytest.raises(ValueError, match="num_ranks must be <= 32, got 64"):
        get(64)
    assert get(8, num_sms=32).num_sms == 32
    with pytest.raises(ValueError, match="num_sms must be even"):
        get(8, num_sms=31)


@pytest.mark.parametrize("get", [get_dispatch_config, get_combine_config])
@pytest.mark.parametrize("ranks", [0, -1])
def test_default_configs_reject_bad_rank_count(get, ranks):
    with pytest.raises(ValueError, match=rf"num_ranks must be positive, got {ranks}"):
        get(ranks)


def test_buffer_default_sms_follow_set_num_sms_and_the_rank_count(monkeypatch):
    """A call without ``config`` uses the default config's SMs, computed once per
    (rank count, set_num_sms state) and not at every call, and still following
    ``Buffer.set_num_sms``."""
    from moelink import buffer as buffer_mod
    from moelink.buffer import Buffer

    monkeypatch.setattr(buffer_mod, "_DEFAULT_SMS", {})
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    monkeypatch.setattr(Buffer, "_num_sms_set", Buffer._num_sms_set)
    made = []
    real = moelink.config.get_dispatch_config

    def counting(num_ranks, *, num_sms=None):
        made.append(num_ranks)
        return real(num_ranks, num_sms=num_sms)

    monkeypatch.setattr(buffer_mod, "get_dispatch_config", counting)
    b = object.__new__(Buffer)  # no GPU: only what _num_sms reads
    b.group_size = 4
    b.num_sms_used, b._launch_sms = {}, {}
    b._native = types.SimpleNamespace(launch_sms=lambda n: n)  # a GPU of its own
    want = real(4).num_sms
    got = [b._num_sms(None, Buffer.get_dispatch_config, "dispatch") for _ in range(3)]
    assert got == [want] * 3
    assert made == [4]
    assert b.num_sms_used == {"dispatch": want}
    # A combine whose x the peers read in the receive pool needs fewer SMs.
    combine = b._num_sms(None, Buffer.get_combine_config, "combine")
    in_pool = b._num_sms(None, Buffer.get_combine_config, "combine", True)
    assert (combine, in_pool) == (DEFAULT_SMS["combine"][1], DEFAULT_SMS["combine_in_pool"][1])
    assert b.num_sms_used == {"dispatch": want, "combine": in_pool}
    b.group_size = 2
    assert b._num_sms(None, Buffer.get_combine_config, "combine", True) == 32
    assert b._num_sms(None, Buffer.get_dispatch_config, "dispatch") == 64
    Buffer.set_num_sms(20)
    assert b._num_sms(None, Buffer.get_dispatch_config, "dispatch") == 20
    b.group_size = 8
    assert b._num_sms(None, Buffer.get_combine_config, "combine") == 20
    assert b._num_sms(None, Buffer.get_combine_config, "combine", True) == 20
    assert b._num_sms(moelink.Config(num_sms=6), Buffer.get_dispatch_config, "dispatch") == 6
    assert b._num_sms(moelink.Config(num_sms=6), Buffer.get_combine_config, "combine", True) == 6
    assert b.num_sms_used == {"dispatch": 6, "combine": 6}
    with pytest.raises(TypeError, match="config must be a moelink.Config"):
        b._num_sms("fast", Buffer.get_dispatch_config, "dispatch")


def test_subclass_combine_config_is_honoured_in_the_pool(monkeypatch):
    """A subclass's own ``get_combine_config`` decides a combine's SMs, also
    for an x in the receive pool (only Buffer's own default has a pool case)."""
    from moelink import buffer as buffer_mod
    from moelink.buffer import Buffer

    monkeypatch.setattr(buffer_mod, "_DEFAULT_SMS", {})

    class Tuned(Buffer):
        @classmethod
        def get_combine_config(cls, num_ranks):
            return moelink.Config(num_sms=10)

    b = object.__new__(Tuned)
    b.group_size, b.num_sms_used, b._launch_sms = 4, {}, {}
    b._native = types.SimpleNamespace(launch_sms=lambda n: n)
    assert b._num_sms(None, Tuned.get_combine_config, "combine", True) == 10


@pytest.mark.parametrize("call", sorted(DEFAULT_SMS))
def test_native_default_sms(call):
    for ranks in (1, 2, 3, 4, 8, 32):
        assert moelink._native.default_num_sms(call, ranks) == DEFAULT_SMS[call][ranks > 2]
    with pytest.raises(ValueError, match="call must be 'dispatch', 'combine' or"):
        moelink._native.default_num_sms("dispatch_fp8", 4)
