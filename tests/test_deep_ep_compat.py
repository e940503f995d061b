"""What frameworks pass to ``deep_ep`` (served by moelink through
python/deep_ep_alias), on the CPU: DeepEP V1's constructor keywords
as vLLM, SGLang and Megatron-Core pass them, unknown keywords refused before
any CUDA use, and ``get_dispatch_config`` / ``get_combine_config`` for every
rank count vLLM asks (2 to 160)."""

from __future__ import annotations

import inspect

import moelink
import pytest
import torch
from moelink import config as moelink_config
from moelink.checks import LIMITS

#: DeepEP V1's ``Buffer.__init__`` parameters, in order, with their defaults.
DEEP_EP_V1_PARAMS = [
    ("group", inspect.Parameter.empty),
    ("num_nvl_bytes", 0),
    ("num_rdma_bytes", 0),
    ("low_latency_mode", False),
    ("num_qps_per_rank", 24),
    ("allow_nvlink_for_low_latency_mode", True),
    ("allow_mnnvl", False),
    ("use_fabric", False),
    ("explicitly_destroy", False),
    ("enable_shrink", False),
    ("comm", None),
]

LL_BYTES = 1 << 30
#: How the frameworks construct a Buffer (Megatron-Core, SGLang, vLLM).
FRAMEWORK_CALLS = {
    "vllm high-throughput": (
        (None, 1 << 30, 0),
        {"low_latency_mode": False, "num_qps_per_rank": 10, "explicitly_destroy": True},
    ),
    "vllm low-latency": (
        (None,),
        {
            "num_nvl_bytes": 0,
            "num_rdma_bytes": LL_BYTES,
            "low_latency_mode": True,
            "num_qps_per_rank": 8,
            "allow_nvlink_for_low_latency_mode": True,
            "allow_mnnvl": False,
            "enable_shrink": True,
            "explicitly_destroy": True,
        },
    ),
    "sglang": (
        (None,),
        {
            "num_nvl_bytes": 1 << 30,
            "num_rdma_bytes": 0,
            "low_latency_mode": False,
            "num_qps_per_rank": 24,
            "allow_mnnvl": True,
        },
    ),
    "megatron flex": ((None, 1 << 30, 0), {}),
    "every keyword": (
        (),
        {
            "group": None,
            "num_nvl_bytes": 0,
            "num_rdma_bytes": LL_BYTES,
            "low_latency_mode": True,
            "num_qps_per_rank": 24,
            "allow_nvlink_for_low_latency_mode": False,
            "allow_mnnvl": False,
            "use_fabric": False,
            "explicitly_destroy": True,
            "enable_shrink": False,
            "comm": None,
        },
    ),
}


@pytest.fixture
def no_cuda_use(monkeypatch):
    """Any CUDA query fails the test: what a constructor raises before it asks
    for the device is raised before any CUDA use."""

    def used(*args, **kwargs):
        raise AssertionError("the constructor touched CUDA before refusing its arguments")

    for name in ("is_available", "current_device", "device_count", "Stream"):
        monkeypatch.setattr(torch.cuda, name, used)


def test_the_constructor_is_deep_ep_v1s(deep_ep):
    params = list(inspect.signature(deep_ep.Buffer).parameters.values())
    assert [(p.name, p.default) for p in params] == DEEP_EP_V1_PARAMS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_CALLS))
def test_the_frameworks_calls_bind(deep_ep, framework):
    args, kwargs = FRAMEWORK_CALLS[framework]
    bound = inspect.signature(deep_ep.Buffer).bind(*args, **kwargs)
    bound.apply_defaults()
    assert set(bound.arguments) == {name for name, _ in DEEP_EP_V1_PARAMS}


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_CALLS))
def test_the_frameworks_calls_pass_every_check_before_the_device(deep_ep, framework):
    """On a machine without a GPU each call gets as far as asking for the
    device: its keywords are taken and their values pass the checks."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the GPU tests construct Buffers)")
    args, kwargs = FRAMEWORK_CALLS[framework]
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        deep_ep.Buffer(*args, **kwargs)


@pytest.mark.parametrize(
    "keyword", ["num_sms_per_rank", "use_nvshmem", "num_max_dispatch_tokens_per_rank", "Group"]
)
def test_unknown_keywords_are_a_type_error_before_any_cuda_use(deep_ep, no_cuda_use, keyword):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        deep_ep.Buffer(None, 0, LL_BYTES, low_latency_mode=True, **{keyword: 1})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_qps_per_rank": 0}, "num_qps_per_rank"),
        ({"num_qps_per_rank": "24"}, "num_qps_per_rank"),
        ({"num_nvl_bytes": 100}, "num_nvl_bytes must be a multiple of 128"),
        ({"num_rdma_bytes": -128}, "num_rdma_bytes"),
        ({"enable_shrink": True}, "enable_shrink=True needs low_latency_mode=True"),
        ({"low_latency_mode": True}, "low_latency_mode=True needs num_rdma_bytes > 0"),
        ({"num_rdma_bytes": 100}, "num_rdma_bytes must be a multiple of 128"),
    ],
)
def test_bad_values_are_refused_before_any_cuda_use(deep_ep, no_cuda_use, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        deep_ep.Buffer(None, **kwargs)


# ----- configs for vLLM's rank counts ------------------------------------------------------------

VLLM_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


@pytest.mark.parametrize("n", range(2, 161))
def test_configs_for_every_rank_count_up_to_160(deep_ep, n):
    """A Config where moelink serves the count (one host, up to max_ranks), else a
    ValueError naming the count and why; never a KeyError."""
    getters = (
        deep_ep.Buffer.get_dispatch_config,
        deep_ep.Buffer.get_combine_config,
        moelink_config.get_dispatch_config,
        moelink_config.get_combine_config,
    )
    for get in getters:
        if n <= LIMITS["max_ranks"]:
            cfg = get(n)
            assert isinstance(cfg, moelink.Config) and isinstance(cfg, deep_ep.Config)
            assert cfg.num_sms % 2 == 0 and cfg.num_sms >= 2
            assert (
                cfg.num_max_nvl_chunked_send_tokens < cfg.num_max_nvl_chunked_recv_tokens
                and cfg.num_max_rdma_chunked_send_tokens < cfg.num_max_rdma_chunked_recv_tokens
            )
        else:
            with pytest.raises(ValueError) as info:
                get(n)
            msg = str(info.value)
            assert f"got {n}:" in msg and f"config for {n} ranks" in msg, msg
            assert "one host" in msg and "internode" in msg, msg


def test_vllm_rank_counts_are_covered():
    assert set(VLLM_RANKS) <= set(range(2, 161))
    assert LIMITS["max_ranks"] == 32  # the split above: 2..32 served, 64.. refused


def test_config_rank_count_types():
    for get in (moelink.Buffer.get_dispatch_config, moelink.Buffer.get_combine_config):
        for bad in (0, -8):
            with pytest.raises(ValueError, match="num_ranks"):
                get(bad)
        for bad in ("8", 8.0, True, None):
            with pytest.raises(TypeError, match="num_ranks"):
                get(bad)


def test_set_num_sms_applies_to_every_served_count(monkeypatch):
    monkeypatch.setattr(moelink.Buffer, "num_sms", moelink.Buffer.num_sms)
    monkeypatch.setattr(moelink.Buffer, "_num_sms_set", moelink.Buffer._num_sms_set)
    moelink.Buffer.set_num_sms(16)
    for n in range(1, LIMITS["max_ranks"] + 1):
        assert moelink.Buffer.get_dispatch_config(n).num_sms == 16
        assert moelink.Buffer.get_combine_config(n).num_sms == 16
    with pytest.raises(ValueError, match="config for 33 ranks"):
        moelink.Buffer.get_dispatch_config(33)
