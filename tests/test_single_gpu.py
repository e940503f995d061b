"""Single-GPU kernel test: bf16 row reduction vs the CPU, on fresh random data."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def cpu_reference(x):
    import torch

    acc = torch.zeros(x.shape[1], dtype=torch.float32)
    for r in range(x.shape[0]):  # same order as the kernel: exact agreement expected
        acc += x[r].float()
    return acc.to(torch.bfloat16)


def poisoned(n):
    import torch

    return torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("rows,cols", [(1, 8), (3, 7168), (8, 1000), (17, 4099), (0, 64)])
def test_reduce_rows_matches_cpu(rows, cols):
    import torch
    from moelink._testing import reduce_rows_bf16

    g = torch.Generator().manual_seed(rows * 100003 + cols)
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    got = reduce_rows_bf16(x.cuda(), out=poisoned(cols)).cpu()
    want = cpu_reference(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_reduce_rows_unaligned_view():
    import torch
    from moelink._testing import reduce_rows_bf16

    flat = torch.randn(1 + 5 * 128).to(torch.bfloat16)
    x = flat.cuda()[1:].view(5, 128)  # contiguous, but 2 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 != 0
    got = reduce_rows_bf16(x, out=poisoned(128)).cpu()
    want = cpu_reference(flat[1:].view(5, 128))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_reduce_rows_rejects_bad_input():
    import torch
    from moelink._testing import reduce_rows_bf16

    with pytest.raises(ValueError, match="bfloat16"):
        reduce_rows_bf16(torch.zeros(2, 8, device="cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        reduce_rows_bf16(torch.zeros(2, 8, dtype=torch.bfloat16))
