"""CPU tests of the argument checks in ``moelink.checks`` (those of the Buffer's
calls, which live in Rust, are tested in ``test_calls.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from moelink import _native
from moelink.checks import (
    LIMITS,
    MAX_TOPK,
    check_experts_ranks,
    check_int,
    check_tensor,
    check_topk_idx,
    check_topk_values,
    device_index,
    tensor_meta,
)

BF16 = torch.bfloat16


# --- check_int -------------------------------------------------------------------------


def test_check_int():
    assert check_int("n", 5) == 5
    assert check_int("n", torch.tensor(3).item()) == 3
    assert check_int("n", 0, minimum=0) == 0
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match="n must be >= -1, got -2"):
        check_int("n", -2, minimum=-1)
    with pytest.raises(ValueError, match="n must be <= 32, got 33"):
        check_int("n", 33, maximum=32)
    for bad in (1.0, "1", None, True, torch.tensor(1)):
        with pytest.raises(TypeError, match="n must be an int"):
            check_int("n", bad)


# --- check_tensor ----------------------------------------------------------------------


def test_check_tensor_accepts():
    t = torch.zeros(4, 8, dtype=BF16)
    assert check_tensor("x", t) is t
    check_tensor("x", t, dtype=BF16, dims=2, shape=(4, 8), device="cpu", contiguous=True)
    check_tensor("x", t, dtype=(torch.float32, BF16))
    check_tensor("x", t, shape=(None, 8))
    check_tensor("x", t, device=torch.device("cpu"))
    check_tensor("x", torch.zeros(0, 8), shape=(0, 8), contiguous=True)
    check_tensor("x", t.t(), shape=(8, 4))  # non-contiguous is fine unless asked


def test_check_tensor_rejects():
    t = torch.zeros(4, 8, dtype=BF16)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1, 2])
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        check_tensor("x", None)
    with pytest.raises(ValueError, match=r"x must have dtype torch\.float32, got torch\.bfloat16"):
        check_tensor("x", t, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must have dtype one of .*float16.*got torch\.bf"):
        check_tensor("x", t, dtype=(torch.float16, torch.float32))
    with pytest.raises(ValueError, match=r"x must be 3-D, got 2-D with shape \[4, 8\]"):
        check_tensor("x", t, dims=3)
    with pytest.raises(ValueError, match=r"x must have shape \[4, 16\], got \[4, 8\]"):
        check_tensor("x", t, shape=(4, 16))
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 16\], got \[4, 8\]"):
        check_tensor("x", t, shape=(None, 16))
    with pytest.raises(ValueError, match=r"x must be 1-D, got 2-D"):
        check_tensor("x", t, shape=(4,))
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        check_tensor("x", t, device="cuda")
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        check_tensor("x", t, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="x must be on cuda:1, got cpu"):
        check_tensor("x", t, device="cuda:1")
    with pytest.raises(ValueError, match=r"x must be contiguous, got shape \[8, 4\] with strides"):
        check_tensor("x", t.t(), contiguous=True)


@pytest.mark.gpu
def test_check_tensor_cuda_device():
    t = torch.zeros(2, device="cuda")
    check_tensor("x", t, device="cuda")
    check_tensor("x", t, device=t.device)
    with pytest.raises(ValueError, match="x must be on cpu"):
        check_tensor("x", t, device="cpu")


# --- check_topk_idx / check_topk_values -----------------------------------------------


def test_check_topk_idx_accepts():
    idx = torch.tensor([[0, 7], [-1, 3], [-1, -1]])
    assert check_topk_idx(idx, 8) is idx
    check_topk_idx(torch.randint(-1, 256, (128, 8)), 256)
    check_topk_idx(torch.full((5, 32), -1), 1)  # all "no expert", K = 32
    check_topk_idx(torch.zeros(5, 1, dtype=torch.int64), 1)  # K = 1
    check_topk_idx(torch.empty(0, 8, dtype=torch.int64), 64)  # no tokens
    check_topk_idx(torch.randint(0, 8, (16, 4)).t().contiguous().t(), 8)  # strided


def test_check_topk_idx_rejects_form():
    with pytest.raises(TypeError, match="topk_idx must be a torch.Tensor"):
        check_topk_idx([[0, 1]], 8)
    with pytest.raises(
        ValueError, match=r"topk_idx must have dtype torch\.int64, got torch\.int32"
    ):
        check_topk_idx(torch.zeros(4, 2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="topk_idx must be 2-D, got 1-D"):
        check_topk_idx(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match=r"topk_idx must have 1 to 32 columns .*\[4, 0\]"):
        check_topk_idx(torch.zeros(4, 0, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match=r"topk_idx must have 1 to 32 columns .*\[4, 33\]"):
        check_topk_idx(torch.zeros(4, 33, dtype=torch.int64), 64)
    with pytest.raises(ValueError, match="num_experts must be positive, got 0"):
        check_topk_idx(torch.zeros(4, 2, dtype=torch.int64), 0)


@pytest.mark.parametrize(
    "bad,where",
    [(8, [1, 0]), (100, [2, 1]), (-2, [0, 1]), (-(2**40), [2, 0])],
)
def test_check_topk_idx_rejects_values(bad, where):
    idx = torch.tensor([[0, 7], [-1, 3], [5, -1]])
    idx[where[0], where[1]] = bad
    with pytest.raises(
        ValueError,
        match=re.escape(f"topk_idx values must be in [-1, num_experts=8), got {bad} at {where}"),
    ):
        check_topk_idx(idx, 8)
    with pytest.raises(ValueError, match=re.escape(f"got {bad} at {where}")):
        check_topk_values(idx, 8)
    check_topk_idx(idx, 8, check_values=False)  # the sync-free path skips the values
    check_topk_values(idx[:0], 8)  # no tokens


# --- check_experts_ranks -----------------------------------------------------------------


def test_check_experts_ranks():
    assert check_experts_ranks(256, 8) == 32
    assert check_experts_ranks(3, 1) == 3
    assert check_experts_ranks(4, 4) == 1


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((10, 4), ValueError, "num_experts must be a multiple of num_ranks, got "),
        ((2, 4), ValueError, "num_experts=2 and num_ranks=4"),
        ((0, 4), ValueError, "num_experts must be positive, got 0"),
        ((8, -1), ValueError, "num_ranks must be positive, got -1"),
        ((8, 2.0), TypeError, "num_ranks must be an int"),
    ],
)
def test_check_experts_ranks_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        check_experts_ranks(*args)


# --- tensor_meta -------------------------------------------------------------------------


def test_tensor_meta_is_what_the_native_plans_read():
    t = torch.zeros(4, 8, dtype=BF16).t()
    assert tensor_meta("x", t) == ("torch.bfloat16", (8, 4), (1, 8), _native.CPU_DEVICE)
    assert tensor_meta("x", torch.empty(2, device="meta"))[3] == _native.OTHER_DEVICE
    assert device_index(torch.device("cuda", 3)) == 3
    for bad in (None, [1], 3):
        with pytest.raises(TypeError, match=f"x must be a torch.Tensor, got {type(bad).__name__}"):
            tensor_meta("x", bad)


def test_tensor_ptr_is_zero_for_absent_tensors():
    from moelink.checks import tensor_ptr

    assert tensor_ptr(None) == 0
    assert tensor_ptr(torch.empty(0)) == 0
    t = torch.arange(4)
    assert tensor_ptr(t) == t.data_ptr() != 0
    assert tensor_ptr(t[1:]) == t.data_ptr() + t.element_size()


# --- the limits table ------------------------------------------------------------------


def _documented_limits() -> list:
    """``(name, value, bounds)`` rows of the table under "## Limits" in docs/api-notes.md."""
    text = (Path(__file__).parent.parent / "docs" / "api-notes.md").read_text()
    section = text.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.fullmatch(r"\| `(\w+)` \| (\d+) \| (.+) \|", line.strip())
        if m:
            rows.append((m[1], int(m[2]), m[3]))
    return rows


def test_docs_limits_table_matches_the_exported_limits():
    assert _documented_limits() == [tuple(row) for row in _native.limits()]
    assert LIMITS == {name: value for name, value, _ in _native.limits()}
    assert (MAX_TOPK, LIMITS["ll_max_hidden"], LIMITS["allreduce_max_ranks"]) == (32, 8192, 8)
