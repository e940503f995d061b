"""CPU tests of the internode parts of ``moelink.reference``: ``layout`` with
``ranks_per_node`` (tokens per node) and ``combine`` with ``ranks_per_node`` (the
internode kernels' model: per node a float32 sum rounded to bf16, then the biases and
those partials in ascending node order), checked against a pure-torch computation.

Splits are written ``nodes x ranks per node``; nodes are groups of consecutive ranks.
"""

from __future__ import annotations

import pytest
import torch
from moelink import reference

BF16 = torch.bfloat16
H = 64
#: (nodes, ranks per node) of the issue: 1x4, 2x2, 4x1, 2x4, 3x2.
SPLITS = [(1, 4), (2, 2), (4, 1), (2, 4), (3, 2)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` as its int32 bit patterns (so -0.0 and 0.0 differ)."""
    return t.contiguous().view(torch.int32)


def random_job(num_ranks: int, k: int, experts_per_rank: int, seed: int, max_tokens: int = 6):
    """Random routing (some -1 ids, whole rows of -1, duplicated ids) over
    ``num_ranks`` ranks, bf16 rows and float32 weights."""
    g = torch.Generator().manual_seed(seed)
    e = num_ranks * experts_per_rank
    inputs = []
    for _ in range(num_ranks):
        n = int(torch.randint(0, max_tokens + 1, (), generator=g))
        idx = torch.empty(n, k, dtype=torch.int64)
        for t in range(n):
            idx[t] = torch.randperm(e, generator=g)[:k]
        idx[torch.rand(n, k, generator=g) < 0.15] = -1
        if n > 0:
            idx[0] = -1  # a token routed nowhere
        if n > 1 and k > 1:
            idx[1, 1] = idx[1, 0]  # a duplicated id
        inputs.append(
            {
                "x": torch.randn(n, H, generator=g).to(BF16),
                "topk_idx": idx,
                "topk_weights": torch.rand(n, k, generator=g),
            }
        )
    return inputs, e


def random_bf16(shape, g: torch.Generator) -> torch.Tensor:
    """bf16 values of both signs over 2^-8 .. 2^8, so float32 sums rarely fit in bf16."""
    scale = torch.pow(2.0, torch.randint(-8, 9, shape, generator=g).float())
    return (torch.randn(shape, generator=g) * scale).to(BF16)


def returned(ref, g: torch.Generator):
    """What every rank returns: random bf16 rows and float32 weights (NaN in
    padding rows, which combine must ignore)."""
    ys, ws = [], []
    k = ref.ranks[0].recv_topk_idx.shape[1]
    for o in ref.ranks:
        rows = o.recv_src_idx.shape[0]
        y = random_bf16((rows, H), g)
        y[o.num_recv_tokens :] = float("nan")
        w = torch.rand(rows, k, generator=g) * 4 - 2
        w[o.num_recv_tokens :] = float("nan")
        ys.append(y)
        ws.append(w)
    return ys, ws


def bias_pair(bias):
    if bias is None:
        return (None, None)
    return bias if isinstance(bias, tuple) else (bias, None)


def torch_model(inputs, num_experts, ref, ys, ws, biases, ranks_per_node):
    """The internode combine model in plain torch: destinations from each token's
    ids, rows found by searching ``recv_src_rank`` / ``recv_src_idx``, explicit loops
    over the nodes and their ranks."""
    num_ranks = len(inputs)
    el = num_experts // num_ranks
    out = []
    for s, inp in enumerate(inputs):
        n, k = inp["topk_idx"].shape
        b0, b1 = bias_pair(None if biases is None else biases[s])
        xs, wts = torch.empty(n, H), torch.empty(n, k)
        for t in range(n):
            dests = {e // el for e in inp["topk_idx"][t].tolist() if e >= 0}
            acc = (torch.zeros(H) if b0 is None else b0[t].float()) + (
                torch.zeros(H) if b1 is None else b1[t].float()
            )
            acc_w = torch.zeros(k)
            for node in range(num_ranks // ranks_per_node):
                partial, partial_w, any_rank = torch.zeros(H), torch.zeros(k), False
                for d in range(node * ranks_per_node, (node + 1) * ranks_per_node):
                    if d not in dests:
                        continue
                    o = ref.ranks[d]
                    m = o.num_recv_tokens
                    hit = (o.recv_src_rank[:m] == s) & (o.recv_src_idx[:m] == t)
                    (row,) = hit.nonzero().flatten().tolist()
                    partial = partial + ys[d][row].float()
                    partial_w = partial_w + ws[d][row]
                    any_rank = True
                if any_rank:
                    acc = acc + partial.to(BF16).float()
                    acc_w = acc_w + partial_w
            xs[t], wts[t] = acc, acc_w
        out.append((xs, wts))
    return out


# --- layout --------------------------------------------------------------------------


def test_layout_counts_tokens_per_node():
    # 4 ranks in 2 nodes of 2, 8 experts (2 per rank, 4 per node).
    idx = torch.tensor([[0, 1], [0, 2], [1, 7], [-1, -1], [5, 6], [4, 4]])
    per_rank, per_node, per_expert, in_rank = reference.layout(idx, 8, 4, ranks_per_node=2)
    assert per_node.dtype == torch.int32
    assert torch.equal(per_node, torch.tensor([3, 3], dtype=torch.int32))
    # The rest is the single-node layout.
    plain = reference.layout(idx, 8, 4)
    assert len(plain) == 3
    for got, want in zip((per_rank, per_expert, in_rank), plain):
        assert torch.equal(got, want)
    # One node, and one rank per node.
    assert torch.equal(reference.layout(idx, 8, 4, 4)[1], torch.tensor([5], dtype=torch.int32))
    assert torch.equal(reference.layout(idx, 8, 4, 1)[1], per_rank)


@pytest.mark.parametrize(("nodes", "rpn"), SPLITS)
def test_layout_per_node_counts_match_is_token_in_rank(nodes, rpn):
    inputs, e = random_job(nodes * rpn, 3, 2, seed=nodes * 10 + rpn, max_tokens=20)
    for inp in inputs:
        idx = inp["topk_idx"]
        per_rank, per_node, per_expert, in_rank = reference.layout(idx, e, nodes * rpn, rpn)
        want = in_rank.reshape(-1, nodes, rpn).any(dim=2).sum(dim=0, dtype=torch.int32)
        assert torch.equal(per_node, want)
        assert torch.equal(per_rank, reference.layout(idx, e, nodes * rpn)[0])


def test_layout_no_tokens():
    out = reference.layout(torch.empty(0, 2, dtype=torch.int64), 6, 6, ranks_per_node=3)
    assert torch.equal(out[1], torch.zeros(2, dtype=torch.int32))
    assert out[3].shape == (0, 6)


# --- combine -------------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "rpn"), SPLITS)
@pytest.mark.parametrize("num_biases", [0, 1, 2])
def test_combine_matches_torch_model(nodes, rpn, num_biases):
    num_ranks = nodes * rpn
    seed = 100 * nodes + 10 * rpn + num_biases
    inputs, e = random_job(num_ranks, 4, 2, seed)
    g = torch.Generator().manual_seed(seed)
    ref = reference.dispatch(inputs, e, num_worst_tokens=3 * 6 * num_ranks)
    ys, ws = returned(ref, g)
    if num_biases == 0:
        biases = None
    elif num_biases == 1:
        # One tensor on some ranks, in the second slot on others, none on the rest.
        biases = []
        for r, inp in enumerate(inputs):
            b = random_bf16((len(inp["x"]), H), g)
            biases.append([None, b, (None, b)][r % 3])
    else:
        biases = [
            (random_bf16((len(inp["x"]), H), g), random_bf16((len(inp["x"]), H), g))
            for inp in inputs
        ]
    out = reference.combine(ref, ys, ws, biases, ranks_per_node=rpn)
    want = torch_model(inputs, e, ref, ys, ws, biases, rpn)
    for (x, w), (wx, ww) in zip(out, want):
        assert x.dtype == torch.float32 and w.dtype == torch.float32
        assert torch.equal(bits(x), bits(wx))
        assert torch.equal(bits(w), bits(ww))
    # Without weights: the same rows, no weights.
    for (x, w), (wx, _) in zip(reference.combine(ref, ys, None, biases, rpn), want):
        assert w is None
        assert torch.equal(bits(x), bits(wx))


def test_partials_are_rounded_per_node():
    # 4 ranks, expert j on rank j. Rank 0's token goes to ranks 0, 1 (node 0 of a 2x2
    # split) and 2 (node 1), which return 1, 2^-8 and 2^-8.
    a = 2.0**-8
    empty = {"x": torch.empty(0, H, dtype=BF16), "topk_idx": torch.empty(0, 4, dtype=torch.int64)}
    inputs = [{"x": torch.zeros(1, H, dtype=BF16), "topk_idx": torch.tensor([[0, 1, 2, -1]])}]
    inputs += [dict(empty) for _ in range(3)]
    ref = reference.dispatch(inputs, 4)
    ys = [torch.full((o.num_recv_tokens, H), v, dtype=BF16) for o, v in zip(ref.ranks, [1, a, a])]
    ys.append(torch.empty(0, H, dtype=BF16))

    def combined(**kwargs) -> float:
        (x, _), *rest = reference.combine(ref, ys, **kwargs)
        assert all(r.shape == (0, H) for r, _ in rest)
        assert (x == x[0, 0]).all()
        return x[0, 0].item()

    # Intranode: 1 + 2^-8 + 2^-8 = 1 + 2^-7, a bf16 value.
    assert combined() == combined(ranks_per_node=None) == 1 + 2 * a
    # 2x2: node 0's partial 1 + 2^-8 rounds (a tie, to even) to 1; 1 + 2^-8 is what
    # the source sums, and the GPU stores 1.0.
    assert combined(ranks_per_node=2) == 1 + a
    x = reference.combine(ref, ys, ranks_per_node=2)[0][0]
    assert torch.equal(reference.to_bf16(x), torch.ones(1, H, dtype=BF16))
    # 4x1 and 1x4: every partial is exact here.
    assert combined(ranks_per_node=1) == combined(ranks_per_node=4) == 1 + 2 * a
    # A bias of 2^-8: added first intranode, after the node's partial internode.
    b = [torch.full((1, H), a, dtype=BF16), None, None, None]
    assert combined(biases=b) == combined(biases=b, ranks_per_node=4) == 1 + 3 * a
    ys[2] = torch.full((1, H), 2 * a, dtype=BF16)  # now 1, 2^-8, 2^-7
    # Intranode: ((2^-8 + 1) + 2^-8) + 2^-7 = 1 + 2^-6. One node: the partial
    # 1 + 3 * 2^-8 is a tie between bf16 neighbours, rounded to the even 1 + 2^-6,
    # then 2^-8 is added.
    assert combined(biases=b) == 1 + 4 * a
    assert combined(biases=b, ranks_per_node=4) == 1 + 5 * a


def test_token_routed_nowhere_is_its_bias():
    inputs = [
        {"x": torch.ones(2, H, dtype=BF16), "topk_idx": torch.tensor([[-1, -1], [0, 3]])},
        {"x": torch.ones(1, H, dtype=BF16), "topk_idx": torch.tensor([[-1, -1]])},
    ]
    ref = reference.dispatch(inputs, 4)
    ys = [o.recv_x for o in ref.ranks]
    b0 = [torch.full((2, H), 0.5), torch.full((1, H), -0.25)]
    b1 = [torch.full((2, H), 0.25), torch.full((1, H), -0.0)]
    for rpn in (1, 2):
        out = reference.combine(ref, ys, ranks_per_node=rpn)
        assert torch.equal(bits(out[0][0][0]), bits(torch.zeros(H)))
        assert torch.equal(bits(out[1][0]), bits(torch.zeros(1, H)))
        assert torch.equal(out[0][0][1], torch.full((H,), 2.0))
        out = reference.combine(ref, ys, biases=list(zip(b0, b1)), ranks_per_node=rpn)
        assert torch.equal(out[0][0][0], torch.full((H,), 0.75))
        assert torch.equal(out[0][0][1], torch.full((H,), 2.75))
        assert torch.equal(out[1][0], torch.full((1, H), -0.25))


def test_none_is_the_intranode_model():
    inputs, e = random_job(4, 3, 2, seed=7)
    ref = reference.dispatch(inputs, e)
    ys, ws = returned(ref, torch.Generator().manual_seed(7))
    plain = reference.combine(ref, ys, ws)
    for (x, w), (px, pw) in zip(reference.combine(ref, ys, ws, None, None), plain):
        assert torch.equal(bits(x), bits(px)) and torch.equal(bits(w), bits(pw))


def test_dispatched_weights_come_back():
    # With the dispatched weights returned unchanged, every split rebuilds the
    # original weight where the id is valid (duplicates included) and 0 at -1.
    inputs, e = random_job(6, 4, 2, seed=11)
    ref = reference.dispatch(inputs, e)
    ys = [o.recv_x for o in ref.ranks]
    ws = [o.recv_topk_weights for o in ref.ranks]
    for rpn in (1, 2, 3, 6):
        for r, (_, w) in enumerate(reference.combine(ref, ys, ws, ranks_per_node=rpn)):
            idx, orig = inputs[r]["topk_idx"], inputs[r]["topk_weights"]
            assert torch.equal(bits(w), bits(torch.where(idx >= 0, orig, 0.0)))


# --- errors --------------------------------------------------------------------------


def check_ranks_per_node_raises(bad, error):
    idx = torch.tensor([[0, 1]])
    with pytest.raises(error, match="ranks_per_node"):
        reference.layout(idx, 4, 4, ranks_per_node=bad)
    ref = reference.dispatch([{"x": torch.zeros(1, H, dtype=BF16), "topk_idx": idx}] * 4, 4)
    ys = [o.recv_x for o in ref.ranks]
    with pytest.raises(error, match="ranks_per_node"):
        reference.combine(ref, ys, ranks_per_node=bad)


@pytest.mark.parametrize("bad", [0, -2, 3, 5, 8, 2**70])
def test_bad_ranks_per_node_raise_value_error(bad):
    check_ranks_per_node_raises(bad, ValueError)


@pytest.mark.parametrize("bad", [True, 2.0, "2", torch.tensor(2)])
def test_ranks_per_node_of_the_wrong_type_raise_type_error(bad):
    check_ranks_per_node_raises(bad, TypeError)


def test_other_combine_errors_are_unchanged_with_ranks_per_node():
    idx = torch.tensor([[0, 3]])
    ref = reference.dispatch([{"x": torch.zeros(1, H, dtype=BF16), "topk_idx": idx}] * 4, 4)
    ys = [o.recv_x for o in ref.ranks]
    with pytest.raises(ValueError, match="ys"):
        reference.combine(ref, ys[:3], ranks_per_node=2)
    with pytest.raises(ValueError, match="ys"):
        reference.combine(ref, [ys[0][:0]] + ys[1:], ranks_per_node=2)
    ws = [o.recv_topk_weights for o in ref.ranks]
    with pytest.raises(ValueError, match="topk_weights"):
        reference.combine(ref, ys, [torch.ones(1, 2)] * 4, ranks_per_node=2)
    with pytest.raises(ValueError, match="bias"):
        reference.combine(ref, ys, ws, [torch.zeros(2, H)] * 4, ranks_per_node=2)
    with pytest.raises(TypeError, match="ref"):
        reference.combine(None, ys, ranks_per_node=2)
