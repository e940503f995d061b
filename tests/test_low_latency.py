"""CPU tests of the low-latency API pieces that need no GPU: the buffer size hint
and the Python bindings of the CPU reference (``moelink.reference.ll_*``)."""

from __future__ import annotations

import moelink
import pytest
import torch
from moelink import reference


def test_size_hint_grows_and_is_aligned():
    h = moelink.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 288)
    assert h % 128 == 0
    assert h > 128 * 288 * 7168 * 2  # at least the zero-copy combine input
    assert moelink.Buffer.get_low_latency_rdma_size_hint(256, 7168, 4, 288) > h
    assert moelink.Buffer.get_low_latency_rdma_size_hint(128, 4096, 4, 288) < h


@pytest.mark.parametrize(
    "args, exc",
    [
        ((128, 7168, 4, 287), ValueError),  # experts not divisible by ranks
        ((128, 100, 4, 288), ValueError),  # hidden not a multiple of 128
        ((128, 8320, 4, 288), ValueError),  # hidden above 8192
        ((0, 7168, 4, 288), ValueError),
        ((128, 7168, 33, 33 * 8), ValueError),  # more than 32 ranks
        ((128.0, 7168, 4, 288), TypeError),
    ],
)
def test_size_hint_rejects(args, exc):
    with pytest.raises(exc):
        moelink.Buffer.get_low_latency_rdma_size_hint(*args)


def _inputs(num_ranks, n, h, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, idxs = [], []
    for _ in range(num_ranks):
        xs.append(torch.randn(n, h, generator=g).to(torch.bfloat16))
        idx = torch.rand(n, e, generator=g).topk(k, dim=1).indices
        idx[0, 0] = -1
        idxs.append(idx)
    return xs, idxs


def test_ll_reference_bf16_moves_rows_unchanged():
    r, n, h, e, k, t = 2, 5, 256, 8, 3, 8
    xs, idxs = _inputs(r, n, h, e, k)
    out = reference.ll_dispatch(xs, idxs, t, e, use_fp8=False)
    el = e // r
    for d in range(r):
        o = out[d]
        assert o["recv_x"].shape == (el, r * t, h)
        for j in range(el):
            expert = d * el + j
            want = [
                (s, tok) for s in range(r) for tok in range(n) for c in range(k)
                if idxs[s][tok, c] == expert
            ]  # fmt: skip
            assert int(o["recv_count"][j]) == len(want)
            rows = []
            for s in range(r):
                lr = int(o["layout_range"][j, s])
                b, c = lr >> 32, lr & 0xFFFFFFFF
                for i in range(b, b + c):
                    tok = int(o["src_info"][j, i])
                    assert torch.equal(o["recv_x"][j, i], xs[s][tok])
                    rows.append((s, tok))
            assert rows == want


@pytest.mark.parametrize("use_fp8", [False, True])
def test_ll_reference_of_one_rank_is_that_rank_of_all(use_fp8):
    r, n, h, e, k, t = 3, 5, 256, 9, 3, 8
    xs, idxs = _inputs(r, n, h, e, k, seed=2)
    every = reference.ll_dispatch(xs, idxs, t, e, use_fp8=use_fp8)
    for d in range(r):
        one = reference.ll_dispatch(xs, idxs, t, e, use_fp8=use_fp8, rank=d)
        assert [o is None for o in one] == [q != d for q in range(r)]
        for key, want in every[d].items():
            got = one[d][key]
            if want is None:
                assert got is None
            else:
                a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
                assert torch.equal(a, b), key
    for bad in (-1, r, 2**70):
        with pytest.raises(ValueError, match="rank"):
            reference.ll_dispatch(xs, idxs, t, e, rank=bad)


def test_ll_reference_fp8_scales_are_column_major_and_dequantize():
    r, n, h, e, k, t = 2, 4, 512, 4, 2, 4
    xs, idxs = _inputs(r, n, h, e, k, seed=1)
    out = reference.ll_dispatch(xs, idxs, t, e, use_fp8=True)
    o = out[0]
    s = o["scales"]
    assert s.shape == (e // r, r * t, h // 128)
    assert s.stride()[1] == 1  # rows contiguous: column-major last two dims
    j, row = 0, 0
    tok = int(o["src_info"][j, row])
    lr = int(o["layout_range"][j, 0])
    src = 0 if (lr & 0xFFFFFFFF) > 0 else 1
    deq = (o["recv_x"][j, row].float().view(-1, 128) * s[j, row].unsqueeze(1)).view(-1)
    x = xs[src][tok].float()
    assert torch.allclose(deq, x, rtol=0.07, atol=1e-3)


def test_ll_reference_combine_is_weighted_sum():
    r, n, h, e, k, t = 2, 6, 256, 8, 4, 8
    xs, idxs = _inputs(r, n, h, e, k, seed=2)
    out = reference.ll_dispatch(xs, idxs, t, e, use_fp8=False)
    ws = [torch.rand(n, k) for _ in range(r)]
    ys = [o["recv_x"] for o in out]  # identity experts
    handles = [(o["src_info"], o["layout_range"]) for o in out]
    comb = reference.ll_combine(ys, idxs, ws, handles, t, e)
    for s in range(r):
        wsum = (ws[s] * (idxs[s] >= 0)).sum(1, keepdim=True)
        want = (xs[s].float() * wsum).to(torch.bfloat16)
        got = comb[s][0]
        assert got.shape == (n, h)
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    # A token without any expert combines to zero.
    assert torch.all(comb[0][0][0] == 0) == bool((idxs[0][0] < 0).all())


def test_ll_reference_combine_reads_the_rows_in_use_only():
    """The rows of ``ys`` outside the handle's blocks are never read (NaN there
    changes nothing), and every row inside is (one changed row changes its token)."""
    r, n, h, e, k, t = 3, 7, 256, 9, 3, 8
    xs, idxs = _inputs(r, n, h, e, k, seed=5)
    out = reference.ll_dispatch(xs, idxs, t, e, use_fp8=False)
    ws = [torch.rand(n, k) for _ in range(r)]
    handles = [(o["src_info"], o["layout_range"]) for o in out]
    ys = [o["recv_x"].clone() for o in out]
    base = reference.ll_combine(ys, idxs, ws, handles, t, e)
    for o, y in zip(out, ys):
        for j, c in enumerate(o["recv_count"].tolist()):
            y[j, c:] = float("nan")
    again = reference.ll_combine(ys, idxs, ws, handles, t, e)
    for (a, _), (b, _) in zip(base, again):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # The last row in use of rank 1's last non-empty expert feeds its source token.
    j = max(i for i, c in enumerate(out[1]["recv_count"].tolist()) if c > 0)
    row = int(out[1]["recv_count"][j]) - 1
    tok = int(out[1]["src_info"][j, row])
    src = next(s for s, p in enumerate(out[1]["layout_range"][j].tolist())
               if (p >> 32) <= row < (p >> 32) + (p & 0xFFFFFFFF))  # fmt: skip
    ys[1][j, row] += 1.0
    moved = reference.ll_combine(ys, idxs, ws, handles, t, e)
    assert not torch.equal(moved[src][0][tok], base[src][0][tok])


def test_ll_reference_rejects_bad_ids():
    xs, idxs = _inputs(2, 3, 256, 8, 2)
    idxs[0][1, 1] = 8
    with pytest.raises(ValueError):
        reference.ll_dispatch(xs, idxs, 4, 8)
