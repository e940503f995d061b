"""CPU tests of the argument checks in ``moelink.checks``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from moelink import _native
from moelink.checks import (
    LIMITS,
    MAX_TOPK,
    check_bias,
    check_dispatch_x,
    check_experts_ranks,
    check_hidden_bytes,
    check_int,
    check_same_device,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
)

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def fp8(n, h):
    return torch.zeros(n, h, dtype=FP8)


def col_major_scales(n, h):
    """float32 [n, h/128] with column-major strides, as DeepGEMM-style quantisers give."""
    return torch.randn(h // 128, n).t()


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


# --- check_topk_idx / check_topk_weights ----------------------------------------------


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
    check_topk_idx(idx, 8, check_values=False)  # the sync-free path skips the values


def test_check_topk_weights():
    idx = torch.zeros(6, 4, dtype=torch.int64)
    w = torch.rand(6, 4)
    assert check_topk_weights(w, idx) is w
    check_topk_weights(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="topk_weights must be a torch.Tensor"):
        check_topk_weights(None, idx)
    with pytest.raises(ValueError, match=r"topk_weights must have dtype torch\.float32"):
        check_topk_weights(w.to(BF16), idx)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \[6, 4\], got \[6, 3\]"):
        check_topk_weights(torch.rand(6, 3), idx)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \[6, 4\], got \[5, 4\]"):
        check_topk_weights(torch.rand(5, 4), idx)
    with pytest.raises(ValueError, match="topk_weights must be 2-D, got 1-D"):
        check_topk_weights(torch.rand(24), idx)


# --- check_experts_ranks / check_hidden_bytes -----------------------------------------


def test_check_experts_ranks():
    assert check_experts_ranks(256, 8) == 32
    assert check_experts_ranks(3, 1) == 3
    assert check_experts_ranks(4, 4) == 1


def test_check_hidden_bytes():
    assert check_hidden_bytes(7168, 2) == 14336
    assert check_hidden_bytes(128, 1) == 128
    assert check_hidden_bytes(64, 2) == 128
    assert check_hidden_bytes(32, 4) == 128


@pytest.mark.parametrize(
    "check, args, exc, match",
    [
        (
            check_experts_ranks,
            (10, 4),
            ValueError,
            "num_experts must be a multiple of num_ranks, got ",
        ),
        (check_experts_ranks, (2, 4), ValueError, "num_experts=2 and num_ranks=4"),
        (check_experts_ranks, (0, 4), ValueError, "num_experts must be positive, got 0"),
        (check_experts_ranks, (8, -1), ValueError, "num_ranks must be positive, got -1"),
        (check_experts_ranks, (8, 2.0), TypeError, "num_ranks must be an int"),
        (
            check_hidden_bytes,
            (100, 2),
            ValueError,
            r"multiple of 128 bytes up to 1048576, got hidden=100 \*",
        ),
        (
            check_hidden_bytes,
            ((1 << 19) + 64, 2),
            ValueError,
            r"up to 1048576, got hidden=524352 \* element_size=2",
        ),
        (check_hidden_bytes, (64, 1), ValueError, "= 64"),
        (check_hidden_bytes, (0, 2), ValueError, "hidden must be positive, got 0"),
        (check_hidden_bytes, (128, 0), ValueError, "element_size must be positive, got 0"),
    ],
)
def test_check_experts_ranks_and_hidden_bytes_reject(check, args, exc, match):
    with pytest.raises(exc, match=match):
        check(*args)


# --- check_dispatch_x ------------------------------------------------------------------


def test_check_dispatch_x_bf16():
    x = torch.randn(5, 256).to(BF16)
    data, scales = check_dispatch_x(x)
    assert data is x and scales is None
    assert check_dispatch_x(x, num_tokens=5)[0] is x
    assert check_dispatch_x(torch.zeros(0, 256, dtype=BF16), num_tokens=0)[1] is None
    check_dispatch_x(torch.zeros(3, 64, dtype=BF16))  # 128 bytes per row


def test_check_dispatch_x_fp8():
    n, h = 6, 512
    for scales in (
        torch.rand(n, h // 128),  # row-major
        col_major_scales(n, h),  # column-major view (not contiguous)
        torch.rand(n, 2 * (h // 128))[:, ::2],  # strided columns
        torch.rand(1, h // 128).expand(n, h // 128),  # broadcast rows
    ):
        x = fp8(n, h)
        data, s = check_dispatch_x((x, scales), num_tokens=n)
        assert data is x and s is scales
    data, s = check_dispatch_x((fp8(0, h), torch.empty(0, h // 128)), num_tokens=0)
    assert s.shape == (0, 4)
    check_dispatch_x((fp8(2, 128), torch.rand(2, 1)))


def test_check_dispatch_x_rejects_bf16():
    with pytest.raises(TypeError, match="x must be a torch.Tensor or a .* tuple, got list"):
        check_dispatch_x([torch.zeros(2, 128, dtype=BF16)])
    with pytest.raises(TypeError, match="got NoneType"):
        check_dispatch_x(None)
    with pytest.raises(ValueError, match=r"x must have dtype torch\.bfloat16, got torch\.float32"):
        check_dispatch_x(torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"x must have dtype torch\.bfloat16, got torch\.float8"):
        check_dispatch_x(fp8(2, 128))  # fp8 without scales
    with pytest.raises(ValueError, match="x must be 2-D, got 3-D"):
        check_dispatch_x(torch.zeros(2, 2, 128, dtype=BF16))
    with pytest.raises(ValueError, match="x must be contiguous"):
        check_dispatch_x(torch.zeros(256, 4, dtype=BF16).t())
    with pytest.raises(ValueError, match=r"x must have 4 rows \(tokens\), got 3"):
        check_dispatch_x(torch.zeros(3, 128, dtype=BF16), num_tokens=4)
    with pytest.raises(ValueError, match=r"x rows must be a positive multiple of 128 bytes.*100"):
        check_dispatch_x(torch.zeros(3, 100, dtype=BF16))
    with pytest.raises(ValueError, match="x rows must be a positive multiple of 128 bytes"):
        check_dispatch_x(torch.zeros(3, 0, dtype=BF16))


def test_check_dispatch_x_rejects_fp8():
    x, s = fp8(4, 256), torch.rand(4, 2)
    with pytest.raises(ValueError, match="x must be a tensor or a .*pair, got a 3-tuple"):
        check_dispatch_x((x, s, s))
    with pytest.raises(ValueError, match="x must be a tensor or a .*pair, got a 1-tuple"):
        check_dispatch_x((x,))
    with pytest.raises(ValueError, match=r"x\[0\] must have dtype torch\.float8_e4m3fn, got"):
        check_dispatch_x((torch.zeros(4, 256, dtype=BF16), s))
    with pytest.raises(ValueError, match=r"x\[0\] must have dtype torch\.float8_e4m3fn, got"):
        check_dispatch_x((x.view(torch.float8_e5m2), s))
    with pytest.raises(ValueError, match=r"x\[0\] must be contiguous"):
        check_dispatch_x((fp8(256, 4).t(), s))
    with pytest.raises(ValueError, match=r"x\[0\] rows must be a positive multiple of 128 bytes"):
        check_dispatch_x((fp8(4, 192), torch.rand(4, 1)))
    with pytest.raises(ValueError, match=r"x\[0\] must have 5 rows \(tokens\), got 4"):
        check_dispatch_x((x, s), num_tokens=5)
    with pytest.raises(TypeError, match=r"x\[1\] \(scales\) must be a torch.Tensor, got NoneType"):
        check_dispatch_x((x, None))
    with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must have dtype torch\.float32"):
        check_dispatch_x((x, s.to(BF16)))
    with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must have dtype torch\.float32"):
        check_dispatch_x((x, torch.zeros(4, 2, dtype=torch.int32)))
    with pytest.raises(
        ValueError, match=r"x\[1\] \(scales\) must have shape \[4, 2\], got \[4, 3\]"
    ):
        check_dispatch_x((x, torch.rand(4, 3)))
    with pytest.raises(
        ValueError, match=r"x\[1\] \(scales\) must have shape \[4, 2\], got \[2, 4\]"
    ):
        check_dispatch_x((x, col_major_scales(4, 256).t()))
    with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must be 2-D, got 1-D"):
        check_dispatch_x((x, torch.rand(4)))


@pytest.mark.gpu
def test_check_dispatch_x_scales_on_other_device():
    x = fp8(4, 256).cuda()
    with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must be on the same device as x\[0\]"):
        check_dispatch_x((x, torch.rand(4, 2)))


# --- check_bias ------------------------------------------------------------------------


def test_check_bias_accepts():
    b0, b1 = torch.zeros(3, 128, dtype=BF16), torch.ones(3, 128, dtype=BF16)
    assert check_bias(None, 3, 128) == (None, None)
    out = check_bias(b0, 3, 128)
    assert isinstance(out, tuple) and out[0] is b0 and out[1] is None
    out = check_bias((b0, b1), 3, 128)
    assert out[0] is b0 and out[1] is b1
    assert check_bias((None, b1), 3, 128)[1] is b1
    assert check_bias((b0, None), 3, 128)[0] is b0
    assert check_bias((None, None), 3, 128) == (None, None)
    empty = torch.zeros(0, 128, dtype=BF16)
    assert check_bias((empty, empty), 0, 128)[0] is empty


def test_check_bias_rejects():
    good = torch.zeros(3, 128, dtype=BF16)
    with pytest.raises(TypeError, match="bias must be None, a torch.Tensor or a tuple of two"):
        check_bias([good, good], 3, 128)
    with pytest.raises(ValueError, match="bias must be None, a tensor or a pair, got a 3-tuple"):
        check_bias((good, good, good), 3, 128)
    with pytest.raises(
        ValueError, match=r"bias must have dtype torch\.bfloat16, got torch\.float32"
    ):
        check_bias(torch.zeros(3, 128), 3, 128)
    with pytest.raises(ValueError, match=r"bias must have shape \[3, 128\], got \[4, 128\]"):
        check_bias(torch.zeros(4, 128, dtype=BF16), 3, 128)
    with pytest.raises(ValueError, match=r"bias\[1\] must have shape \[3, 128\], got \[3, 256\]"):
        check_bias((good, torch.zeros(3, 256, dtype=BF16)), 3, 128)
    with pytest.raises(ValueError, match=r"bias\[0\] must have dtype torch\.bfloat16"):
        check_bias((torch.zeros(3, 128, dtype=torch.float16), None), 3, 128)
    with pytest.raises(ValueError, match=r"bias\[0\] must be contiguous"):
        check_bias((torch.zeros(128, 3, dtype=BF16).t(), None), 3, 128)
    with pytest.raises(TypeError, match=r"bias\[1\] must be a torch.Tensor, got int"):
        check_bias((good, 0), 3, 128)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        check_bias(None, -1, 128)


# --- check_same_device -----------------------------------------------------------------


def test_check_same_device_accepts():
    a, b = torch.zeros(2), torch.zeros(3, dtype=torch.int64)
    assert check_same_device(a, b) == torch.device("cpu")
    assert check_same_device(x=a, topk_idx=b, bias=None) == torch.device("cpu")
    assert check_same_device(a, None, w=b) == torch.device("cpu")
    assert check_same_device() is None
    assert check_same_device(None, x=None) is None


def test_check_same_device_rejects():
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor, got list"):
        check_same_device(torch.zeros(1), [1])
    with pytest.raises(TypeError, match="topk_idx must be a torch.Tensor, got int"):
        check_same_device(x=torch.zeros(1), topk_idx=3)
    meta = torch.empty(2, device="meta")
    with pytest.raises(
        ValueError, match=r"topk_idx must be on the same device as x \(cpu\), got meta"
    ):
        check_same_device(x=torch.zeros(1), topk_idx=meta)
    with pytest.raises(
        ValueError, match=r"tensors\[1\] must be on the same device as tensors\[0\]"
    ):
        check_same_device(torch.zeros(1), meta)


@pytest.mark.gpu
def test_check_same_device_cuda():
    with pytest.raises(ValueError, match=r"w must be on the same device as x \(cuda:0\), got cpu"):
        check_same_device(x=torch.zeros(1, device="cuda:0"), w=torch.zeros(1))


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
