"""CPU tests of ``moelink.reference``, the dispatch / combine oracle of the GPU tests.

Most tests use one hand-checked job: 2 ranks, 4 experts (rank 0 hosts experts 0 and 1,
rank 1 experts 2 and 3), top-2, bf16 rows of 64 elements (128 bytes).
"""

from __future__ import annotations

import pytest
import torch
from moelink import reference

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
E, K, H = 4, 2, 64

# Rank 0: t0 -> rank 0 only; t1 -> both; t2 -> nowhere; t3 -> rank 1, a duplicate id.
# Rank 1: t0 -> rank 1 (and a -1); t1 -> both; t2 -> rank 0 (after a -1).
TOPK = [
    [[0, 1], [1, 2], [-1, -1], [3, 3]],
    [[2, -1], [0, 3], [-1, 1]],
]


def hand_x(r: int) -> torch.Tensor:
    """bf16 [N_r, H]: token t of rank r is 10 * r + t + 1 plus column % 4 (exact)."""
    n = len(TOPK[r])
    base = torch.arange(n, dtype=torch.float32)[:, None] + 10 * r + 1
    return (base + torch.arange(H)[None, :] % 4).to(BF16)


def hand_weights(r: int) -> torch.Tensor:
    """float32 [N_r, K], all different and exact: (10 * r + 2 * t + k + 1) / 8."""
    n = len(TOPK[r])
    t = torch.arange(n, dtype=torch.float32)[:, None]
    k = torch.arange(K, dtype=torch.float32)[None, :]
    return (10 * r + 2 * t + k + 1) / 8


def hand_inputs(weights: bool = True) -> list:
    return [
        {
            "x": hand_x(r),
            "topk_idx": torch.tensor(TOPK[r], dtype=torch.int64),
            "topk_weights": hand_weights(r) if weights else None,
        }
        for r in range(2)
    ]


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# --- layout --------------------------------------------------------------------------


def test_layout_hand_checked():
    per_rank, per_expert, in_rank = reference.layout(torch.tensor(TOPK[0]), E, 2)
    assert torch.equal(per_rank, i32([2, 2]))
    # Expert 3 appears twice in t3's row but counts once.
    assert torch.equal(per_expert, i32([1, 2, 1, 1]))
    want = torch.tensor([[True, False], [True, True], [False, False], [False, True]])
    assert torch.equal(in_rank, want)

    per_rank, per_expert, in_rank = reference.layout(torch.tensor(TOPK[1]), E, 2)
    assert torch.equal(per_rank, i32([2, 2]))
    assert torch.equal(per_expert, i32([1, 1, 1, 1]))
    assert torch.equal(in_rank, torch.tensor([[False, True], [True, True], [True, False]]))


def test_layout_no_tokens():
    per_rank, per_expert, in_rank = reference.layout(torch.empty(0, 3, dtype=torch.int64), 8, 4)
    assert torch.equal(per_rank, i32([0] * 4))
    assert torch.equal(per_expert, i32([0] * 8))
    assert in_rank.shape == (0, 4) and in_rank.dtype == torch.bool


# --- dispatch ------------------------------------------------------------------------


def test_dispatch_hand_checked():
    ref = reference.dispatch(hand_inputs(), E)
    assert ref.num_ranks == 2
    assert torch.equal(ref.rank_prefix_matrix, i32([[2, 2], [4, 4]]))
    assert torch.equal(
        ref.is_token_in_rank(1), torch.tensor([[False, True], [True, True], [True, False]])
    )

    # (source rank, source token, recv_topk_idx row) of every received row, in order.
    want = {
        0: [(0, 0, [0, 1]), (0, 1, [1, -1]), (1, 1, [0, -1]), (1, 2, [-1, 1])],
        1: [(0, 1, [-1, 0]), (0, 3, [1, 1]), (1, 0, [0, -1]), (1, 1, [-1, 1])],
    }
    want_per_expert = {0: [2, 3], 1: [2, 2]}
    for d, rows in want.items():
        o = ref.ranks[d]
        assert o.num_recv_tokens == len(rows)
        assert torch.equal(o.recv_src_rank, i32([s for s, _, _ in rows]))
        assert torch.equal(o.recv_src_idx, i32([t for _, t, _ in rows]))
        assert torch.equal(o.recv_topk_idx, torch.tensor([i for _, _, i in rows]))
        assert o.recv_x.dtype == BF16
        assert torch.equal(o.recv_x, torch.stack([hand_x(s)[t] for s, t, _ in rows]))
        weights = torch.stack([hand_weights(s)[t] for s, t, _ in rows])
        kept = torch.tensor([i for _, _, i in rows]) != -1
        assert torch.equal(o.recv_topk_weights, torch.where(kept, weights, 0.0))
        assert o.recv_scales is None
        assert o.num_recv_tokens_per_expert == want_per_expert[d]


def test_dispatch_without_weights_and_an_empty_rank():
    inputs = hand_inputs(weights=False)
    inputs[1] = {
        "x": torch.empty(0, H, dtype=BF16),
        "topk_idx": torch.empty(0, K, dtype=torch.int64),
    }
    ref = reference.dispatch(inputs, E)
    assert torch.equal(ref.rank_prefix_matrix, i32([[2, 2], [2, 2]]))
    assert ref.is_token_in_rank(1).shape == (0, 2)
    for d, tokens in enumerate([[0, 1], [1, 3]]):
        o = ref.ranks[d]
        assert o.recv_topk_weights is None
        assert torch.equal(o.recv_src_idx, i32(tokens))
        assert torch.equal(o.recv_x, hand_x(0)[tokens])


def fp8_inputs(n_per_rank, hidden, num_scales, num_experts, seed=0):
    """Random fp8 rows (every byte pattern, NaNs included) with column-major scales."""
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for n in n_per_rank:
        x = torch.randint(0, 256, (n, hidden), dtype=torch.uint8, generator=g).view(FP8)
        scales = torch.randn(num_scales, n, generator=g).t()  # [n, S], column-major
        assert not scales.is_contiguous() or n <= 1
        topk = torch.randint(-1, num_experts, (n, 3), generator=g)
        inputs.append({"x": x, "scales": scales, "topk_idx": topk, "topk_weights": None})
    return inputs


def test_fp8_with_column_major_scales_moves_bytes_exactly():
    inputs = fp8_inputs([5, 7, 6], hidden=256, num_scales=2, num_experts=6)
    ref = reference.dispatch(inputs, 6)
    total = 0
    for d, o in enumerate(ref.ranks):
        assert o.recv_x.dtype == FP8 and o.recv_x.shape == (o.num_recv_tokens, 256)
        src = list(zip(o.recv_src_rank.tolist(), o.recv_src_idx.tolist()))
        want_x = torch.stack([inputs[s]["x"][t].view(torch.uint8) for s, t in src])
        assert torch.equal(o.recv_x.view(torch.uint8), want_x)
        want_scales = torch.stack([inputs[s]["scales"][t] for s, t in src])
        assert torch.equal(o.recv_scales.view(torch.int32), want_scales.view(torch.int32))
        # Exactly the tokens with an expert on d (experts 2d and 2d + 1).
        want_src = [
            (s, t)
            for s, inp in enumerate(inputs)
            for t, row in enumerate(inp["topk_idx"].tolist())
            if any(e // 2 == d for e in row if e >= 0)
        ]
        assert src == want_src
        total += o.num_recv_tokens
    assert total > 0


def test_num_worst_tokens_pads():
    plain = reference.dispatch(hand_inputs(), E)
    padded = reference.dispatch(hand_inputs(), E, num_worst_tokens=6)
    for p, o in zip(padded.ranks, plain.ranks):
        assert p.num_recv_tokens == o.num_recv_tokens == 4
        assert p.recv_x.shape == (6, H) and p.recv_topk_idx.shape == (6, K)
        assert torch.equal(p.recv_x[:4], o.recv_x)
        assert torch.equal(p.recv_topk_idx[:4], o.recv_topk_idx)
        assert torch.equal(p.recv_topk_weights[:4], o.recv_topk_weights)
        assert torch.equal(p.recv_src_idx[:4], o.recv_src_idx)
        assert (p.recv_topk_idx[4:] == -1).all()
        assert (p.recv_topk_weights[4:] == 0).all()
        assert p.num_recv_tokens_per_expert == []
    assert torch.equal(padded.rank_prefix_matrix, plain.rank_prefix_matrix)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        reference.dispatch(hand_inputs(), E, num_worst_tokens=3)


@pytest.mark.parametrize(
    ("alignment", "want"), [(1, [[2, 3], [2, 2]]), (2, [[2, 4], [2, 2]]), (3, [[3, 3], [3, 3]])]
)
def test_expert_alignment_rounds_up(alignment, want):
    ref = reference.dispatch(hand_inputs(), E, expert_alignment=alignment)
    assert [o.num_recv_tokens_per_expert for o in ref.ranks] == want


def test_expert_alignment_keeps_zero():
    inputs = [{"x": hand_x(0), "topk_idx": torch.tensor([[0, -1]] * 4)}]
    ref = reference.dispatch(inputs, 2, expert_alignment=8)
    assert ref.ranks[0].num_recv_tokens_per_expert == [8, 0]


# --- dispatch_cached -----------------------------------------------------------------


def test_dispatch_cached_matches_dispatch():
    ref = reference.dispatch(hand_inputs(), E, num_worst_tokens=5)
    cached = reference.dispatch_cached(ref, [hand_x(0), hand_x(1)])
    for (x, scales), o in zip(cached, ref.ranks):
        assert scales is None
        assert torch.equal(x, o.recv_x)

    # New fp8 data with scales, of another width, along the same routing.
    new = fp8_inputs([4, 3], hidden=384, num_scales=3, num_experts=E, seed=1)
    xs = [(inp["x"], inp["scales"]) for inp in new]
    fresh_inputs = [dict(inp, topk_idx=torch.tensor(TOPK[r])) for r, inp in enumerate(new)]
    fresh = reference.dispatch(fresh_inputs, E, num_worst_tokens=5)
    for (x, scales), o in zip(reference.dispatch_cached(ref, xs), fresh.ranks):
        assert x.dtype == FP8 and x.shape == (5, 384)
        assert torch.equal(x.view(torch.uint8), o.recv_x.view(torch.uint8))
        assert torch.equal(scales.view(torch.int32), o.recv_scales.view(torch.int32))


# --- combine -------------------------------------------------------------------------


def bias(r: int, value: float) -> torch.Tensor:
    n = len(TOPK[r])
    return (torch.arange(n, dtype=torch.float32)[:, None] * value + torch.zeros(n, H)).to(BF16)


@pytest.mark.parametrize("num_biases", [0, 1, 2])
def test_combine_sums_copies_and_rebuilds_weights(num_biases):
    ref = reference.dispatch(hand_inputs(), E)
    ys = [o.recv_x for o in ref.ranks]  # every rank returns what it received
    weights = [o.recv_topk_weights for o in ref.ranks]
    if num_biases == 0:
        biases = None
    elif num_biases == 1:
        biases = [bias(0, 0.5), (None, bias(1, 0.25))]
    else:
        biases = [(bias(0, 0.5), bias(0, 2.0)), (bias(1, 0.25), bias(1, -1.0))]
    out = reference.combine(ref, ys, weights, biases)
    for r, (x, w) in enumerate(out):
        copies = ref.is_token_in_rank(r).sum(dim=1, dtype=torch.float32)[:, None]
        want = copies * hand_x(r).float()
        if biases is not None:
            pair = biases[r] if isinstance(biases[r], tuple) else (biases[r], None)
            want = want + sum(b.float() for b in pair if b is not None)
        assert x.dtype == torch.float32 and torch.equal(x, want)
        assert torch.equal(reference.to_bf16(x), want.to(BF16))
        idx = torch.tensor(TOPK[r])
        assert torch.equal(w, torch.where(idx != -1, hand_weights(r), 0.0))
    # Token 2 of rank 0 went nowhere: it combines to its biases, 2 * (0.5 + 2.0) with
    # both, 2 * 0.5 with one, zeros without.
    assert torch.equal(out[0][0][2], torch.full((H,), [0.0, 1.0, 5.0][num_biases]))


def test_combine_adds_bias_first_then_ranks_in_order():
    # One token sent to both ranks: (1 + 2^24) - 2^24 is 0 in this order, 1 in others.
    inputs = [{"x": hand_x(0)[:1], "topk_idx": torch.tensor([[0, 2]])}, hand_inputs()[1]]
    inputs[1]["topk_idx"] = torch.full((3, K), -1)
    inputs[1]["topk_weights"] = None
    ref = reference.dispatch(inputs, E)
    big = float(2**24)
    ys = [torch.full((1, H), big, dtype=BF16), torch.full((1, H), -big, dtype=BF16)]
    b = torch.ones(1, H, dtype=BF16)
    (x0, w0), (x1, w1) = reference.combine(ref, ys, biases=[b, None])
    assert w0 is None and w1 is None
    assert torch.equal(x0, torch.zeros(1, H))
    assert torch.equal(x1, torch.zeros(3, H))


def test_combine_float32_rows_and_padding_ignored():
    ref = reference.dispatch(hand_inputs(), E, num_worst_tokens=7)
    ys = [torch.ones(7, H) for _ in range(2)]
    for y in ys:
        y[4:] = 1000.0  # padding rows are not added anywhere
    out = reference.combine(ref, ys)
    for r, (x, w) in enumerate(out):
        assert w is None
        want = ref.is_token_in_rank(r).sum(dim=1, dtype=torch.float32)[:, None].expand(-1, H)
        assert torch.equal(x, want)


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [4, -2])
def test_ids_out_of_range_raise_value_error(bad_id):
    inputs = hand_inputs()
    inputs[1]["topk_idx"][2, 0] = bad_id
    with pytest.raises(ValueError, match="topk_idx"):
        reference.dispatch(inputs, E)
    with pytest.raises(ValueError, match="topk_idx"):
        reference.layout(inputs[1]["topk_idx"], E, 2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_experts"):
        reference.dispatch(hand_inputs(), 3)
    inputs = hand_inputs()
    inputs[1]["topk_weights"] = None
    with pytest.raises(ValueError, match="topk_weights"):
        reference.dispatch(inputs, E)
    inputs = hand_inputs()
    inputs[0]["x"] = inputs[0]["x"].float()
    with pytest.raises(ValueError, match="dtype"):
        reference.dispatch(inputs, E)
    inputs = hand_inputs()
    for inp in inputs:
        inp["x"] = inp["x"][:, :32]  # 64 bytes per row
    with pytest.raises(
        ValueError, match=r"inputs\[0\]\['x'\] rows must be a positive multiple of 128"
    ):
        reference.dispatch(inputs, E)
    inputs = hand_inputs()
    inputs[0]["scales"] = torch.ones(4, 1)
    with pytest.raises(ValueError, match="scales"):
        reference.dispatch(inputs, E)
    with pytest.raises(TypeError):
        reference.dispatch([{"x": [1], "topk_idx": torch.tensor(TOPK[0])}], E)

    ref = reference.dispatch(hand_inputs(), E)
    with pytest.raises(ValueError, match="xs"):
        reference.dispatch_cached(ref, [hand_x(0)])
    with pytest.raises(ValueError, match="rows"):
        reference.dispatch_cached(ref, [hand_x(0), hand_x(0)])
    ys = [o.recv_x for o in ref.ranks]
    with pytest.raises(ValueError, match="ys"):
        reference.combine(ref, [ys[0], ys[1][:3]])
    with pytest.raises(ValueError, match="topk_weights"):
        reference.combine(ref, ys, [ref.ranks[0].recv_topk_weights, None])
    with pytest.raises(ValueError, match="bias"):
        reference.combine(ref, ys, biases=[bias(1, 1.0), None])
