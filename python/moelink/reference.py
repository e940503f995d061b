"""CPU reference of dispatch and combine (intranode and internode): the oracle of
the GPU tests.

A torch wrapper of the Rust reference ``ep_reference::normal`` (through
``moelink._native``); its docs are the exact contract. In short, with ``R`` ranks
(``len(inputs)``) and ``E`` experts (a multiple of ``R``), rank ``d`` hosts experts
``d * E / R .. (d + 1) * E / R``:

- rank ``d`` receives every token (of every source rank) that has at least one
  expert on ``d``, once, ordered by source rank then token index;
- ``recv_topk_idx`` holds local expert ids where the expert is on ``d`` and ``-1``
  elsewhere; ``recv_topk_weights`` the source weight where the id is kept, ``0.0``
  elsewhere;
- ``combine`` adds, in float32, ``bias0 + bias1`` and then the rows returned by
  the destination ranks in ascending rank order (the intranode kernels' model);
- internode, with nodes of ``ranks_per_node`` consecutive ranks: ``layout`` also
  counts tokens per node; dispatch results are the same for every split; and
  ``combine(..., ranks_per_node=n)`` models the internode kernels: per token and
  node, the node's rows summed in float32 and rounded to bf16, then ``bias0 +
  bias1`` plus those partials in ascending node order, in float32.

Dispatch results are exact (compare bit for bit); combine sums depend on the
summation order, see the Rust module docs for the tolerances to use.

Inputs should be CPU tensors (others are copied to the CPU); every result is a
fresh CPU tensor. Arguments are checked here for types, shapes, dtypes and the
limits (``moelink.checks.LIMITS``, the GPU path's) and in Rust for everything
else: an argument of the wrong kind raises ``TypeError`` (a tensor of the wrong
dtype ``moelink.checks.DtypeError``, both a ``TypeError`` and a ``ValueError``),
a bad value ``ValueError``, each naming the argument (and the rank, where ranks
disagree). Outputs larger than ``$MOELINK_REFERENCE_MAX_BYTES`` (default 16 GiB)
are refused with a ``ValueError`` instead of exhausting memory.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _native
from .checks import (
    LIMITS,
    check_bool,
    check_experts_ranks,
    check_int,
    check_keys,
    check_multiple,
    check_rank_list,
    check_row_bytes,
    check_tensor,
    check_topk_idx,
)

__all__ = [
    "RefDispatch",
    "RefRankOutput",
    "combine",
    "dispatch",
    "dispatch_cached",
    "layout",
    "ll_combine",
    "ll_dispatch",
    "to_bf16",
]

#: dtypes of dispatched token data ``x`` (moved as raw bytes).
X_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
#: dtypes accepted for combine's rows and biases (converted exactly to float32).
COMBINE_DTYPES = (torch.bfloat16, torch.float32)
#: Combine's rows (``hidden`` bf16 elements) are a multiple of this many elements.
HIDDEN_UNIT = LIMITS["row_bytes_alignment"] // 2


def _same_on_every_rank(name: str, value: int, first, what: str, first_name: str) -> int:
    """``value`` (rank ``r``'s ``what`` of ``name``) must equal rank 0's ``first``
    (None for rank 0 itself); returns the common value."""
    if first is not None and value != first:
        raise ValueError(
            f"{name} has {value} {what}, but {first_name} has {first}: "
            "every rank must have the same"
        )
    return value


def _to_bytes(t: torch.Tensor) -> bytes:
    """The elements of ``t`` in row-major order, as raw (little-endian) bytes."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _opt_bytes(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else _to_bytes(t)


def _from_bytes(b: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    """A fresh CPU tensor of ``dtype`` and ``shape`` holding the raw bytes ``b``."""
    if len(b) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)


def _opt_from_bytes(b: bytes | None, dtype: torch.dtype, shape) -> torch.Tensor | None:
    return None if b is None else _from_bytes(b, dtype, shape)


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16, to nearest with ties to even: the reference's
    ``round_to_bf16``, i.e. what a GPU bf16 store of a float32 result holds."""
    return t.to(torch.bfloat16)


def _check_ranks_per_node(ranks_per_node, num_ranks: int, what: str) -> int | None:
    """``ranks_per_node`` (None, or a positive int dividing ``num_ranks``, the
    number of ranks that ``what`` gives) as an ``int`` or None."""
    if ranks_per_node is None:
        return None
    ranks_per_node = check_int("ranks_per_node", ranks_per_node, minimum=1)
    if num_ranks % ranks_per_node != 0:
        raise ValueError(
            f"ranks_per_node must divide the number of ranks ({what} = {num_ranks}), "
            f"got {ranks_per_node}"
        )
    return ranks_per_node


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node=None):
    """Dispatch layout of one rank's tokens (``Buffer.get_dispatch_layout``).

    ``topk_idx``: int64 [N, K], ids in ``-1 .. num_experts - 1``. Returns
    ``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
    is_token_in_rank bool [N, R])``: per rank / expert, the tokens with at least
    one expert there (each token once, duplicated ids included).

    With ``ranks_per_node`` (nodes of that many consecutive ranks; it must divide
    ``num_ranks``), returns ``get_dispatch_layout``'s four tensors instead:
    ``(num_tokens_per_rank, num_tokens_per_rdma_rank int32 [R / ranks_per_node],
    num_tokens_per_expert, is_token_in_rank)``, ``num_tokens_per_rdma_rank[n]``
    counting the tokens with at least one expert on a rank of node ``n``, once.
    """
    num_ranks = check_int("num_ranks", num_ranks, minimum=1, maximum=LIMITS["max_ranks"])
    num_experts = check_int("num_experts", num_experts, minimum=1, maximum=LIMITS["max_experts"])
    check_experts_ranks(num_experts, num_ranks)
    ranks_per_node = _check_ranks_per_node(ranks_per_node, num_ranks, "num_ranks")
    # Values are checked in Rust, which names the token and column.
    check_topk_idx(topk_idx, num_experts, check_values=False)
    n, k = topk_idx.shape
    per_rank, per_node, per_expert, in_rank = _native.reference_layout(
        _to_bytes(topk_idx), k, num_experts, num_ranks, ranks_per_node
    )
    per_rank = _from_bytes(per_rank, torch.int32, (num_ranks,))
    per_expert = _from_bytes(per_expert, torch.int32, (num_experts,))
    in_rank = _from_bytes(in_rank, torch.bool, (n, num_ranks))
    if ranks_per_node is None:
        return per_rank, per_expert, in_rank
    per_node = _from_bytes(per_node, torch.int32, (num_ranks // ranks_per_node,))
    return per_rank, per_node, per_expert, in_rank


@dataclasses.dataclass(frozen=True)
class RefRankOutput:
    """What one destination rank receives. ``rows`` is ``num_worst_tokens`` when
    that is positive, else ``num_recv_tokens``; padding rows (``num_recv_tokens``
    and up) have ``recv_topk_idx == -1`` and ``recv_topk_weights == 0``, and zeros /
    ``-1`` elsewhere, which GPU results need not match."""

    #: Tokens received (rows ``< num_recv_tokens`` are real).
    num_recv_tokens: int
    #: [rows, H], the dtype of ``x``: the source tokens' data, unchanged.
    recv_x: torch.Tensor
    #: float32 [rows, S] when dispatched with scales, else ``None``.
    recv_scales: torch.Tensor | None
    #: int64 [rows, K]: local expert ids of this rank, ``-1`` for the others.
    recv_topk_idx: torch.Tensor
    #: float32 [rows, K] when dispatched with weights, else ``None``.
    recv_topk_weights: torch.Tensor | None
    #: int32 [rows]: each row's token index on its source rank.
    recv_src_idx: torch.Tensor
    #: int32 [rows]: each row's source rank.
    recv_src_rank: torch.Tensor
    #: Per local expert, received tokens that have it (once per token), rounded
    #: up to ``expert_alignment``; empty when ``num_worst_tokens > 0``.
    num_recv_tokens_per_expert: list


class RefDispatch:
    """Result of :func:`dispatch`: every rank's outputs (``ranks[d]``) plus the
    routing, which :func:`dispatch_cached` and :func:`combine` take back."""

    def __init__(self, handle: _native.RefDispatched, dtype: torch.dtype, hidden: int):
        self._handle = handle
        #: Number of ranks ``R``.
        self.num_ranks = handle.num_ranks
        r = self.num_ranks
        #: int32 [R, R]: entry [i, j] counts the tokens ranks ``0..=i`` send to ``j``.
        self.rank_prefix_matrix = _from_bytes(handle.rank_prefix_matrix, torch.int32, (r, r))
        #: ``ranks[d]``: what rank ``d`` receives.
        self.ranks = [self._rank_output(d, dtype, hidden) for d in range(r)]

    def num_tokens(self, rank: int) -> int:
        """``N`` of source rank ``rank``."""
        return self._handle.num_tokens(self._rank(rank))

    def is_token_in_rank(self, rank: int) -> torch.Tensor:
        """bool [N, R] of source rank ``rank``: token ``t`` has an expert on rank ``j``."""
        rank = self._rank(rank)
        shape = (self.num_tokens(rank), self.num_ranks)
        return _from_bytes(self._handle.is_token_in_rank(rank), torch.bool, shape)

    def _rank(self, rank) -> int:
        return check_int("rank", rank, minimum=0, maximum=self.num_ranks - 1)

    def _rank_output(self, d: int, dtype: torch.dtype, hidden: int) -> RefRankOutput:
        o = self._handle.rank_output(d)
        rows, k, s = o["num_rows"], self._handle.num_topk, self._handle.num_scales
        return RefRankOutput(
            num_recv_tokens=o["num_recv_tokens"],
            recv_x=_from_bytes(o["recv_x"], dtype, (rows, hidden)),
            recv_scales=_opt_from_bytes(o["recv_scales"], torch.float32, (rows, s)),
            recv_topk_idx=_from_bytes(o["recv_topk_idx"], torch.int64, (rows, k)),
            recv_topk_weights=_opt_from_bytes(o["recv_topk_weights"], torch.float32, (rows, k)),
            recv_src_idx=_from_bytes(o["recv_src_idx"], torch.int32, (rows,)),
            recv_src_rank=_from_bytes(o["recv_src_rank"], torch.int32, (rows,)),
            num_recv_tokens_per_expert=list(o["num_recv_tokens_per_expert"]),
        )


def _check_ref(ref) -> None:
    if not isinstance(ref, RefDispatch):
        raise TypeError(
            f"ref must be the RefDispatch that moelink.reference.dispatch returned, "
            f"got {type(ref).__name__}"
        )


def _check_token_data(name: str, x, scales, num_tokens: int | None, first):
    """Checks one rank's ``x`` ([N, H] of ``X_DTYPES``) and ``scales`` (float32 [N, S]
    or None) against rank 0's ``(x, scales)`` (``first``, None for rank 0)."""
    check_tensor(name, x, dtype=X_DTYPES, dims=2)
    if num_tokens is not None and x.shape[0] != num_tokens:
        raise ValueError(f"{name} must have {num_tokens} rows (tokens), got {x.shape[0]}")
    if first is None:
        check_row_bytes(name, x)
    if scales is not None:
        check_tensor(f"{name} scales", scales, dtype=torch.float32, shape=(x.shape[0], None))
        if scales.shape[1] > LIMITS["max_num_scales"]:
            raise ValueError(
                f"{name} scales must have at most {LIMITS['max_num_scales']} columns, "
                f"got {scales.shape[1]}"
            )
    if first is not None:
        x0, s0 = first
        if x.dtype != x0.dtype or x.shape[1] != x0.shape[1]:
            raise ValueError(
                f"{name} must be {x0.dtype} with {x0.shape[1]} columns like rank 0's, "
                f"got {x.dtype} of shape {list(x.shape)}"
            )
        if scales is not None and s0 is not None and scales.shape[1] != s0.shape[1]:
            raise ValueError(
                f"{name} scales must have {s0.shape[1]} columns like rank 0's, "
                f"got {scales.shape[1]}"
            )


def dispatch(
    inputs, num_experts: int, *, expert_alignment: int = 1, num_worst_tokens: int = 0
) -> RefDispatch:
    """Dispatch over all ranks at once; ``inputs[r]`` is rank ``r``'s input, a dict:

    - ``x``: bf16 or float8_e4m3fn [N_r, H] (same dtype and H on every rank);
    - ``scales`` (optional): float32 [N_r, S] or None, any strides; every rank or none;
    - ``topk_idx``: int64 [N_r, K], ids in ``-1 .. num_experts - 1``;
    - ``topk_weights`` (optional): float32 [N_r, K] or None; every rank or none.

    ``expert_alignment`` rounds up ``num_recv_tokens_per_expert``;
    ``num_worst_tokens > 0`` pads every rank's outputs to that many rows (an
    error if a rank receives more). Rows are a positive multiple of 128 bytes.
    """
    inputs = check_rank_list("inputs", inputs)
    num_experts = check_int("num_experts", num_experts, minimum=1, maximum=LIMITS["max_experts"])
    check_experts_ranks(num_experts, len(inputs), "len(inputs)")
    expert_alignment = check_int(
        "expert_alignment", expert_alignment, minimum=1, maximum=LIMITS["max_expert_alignment"]
    )
    num_worst_tokens = check_int(
        "num_worst_tokens", num_worst_tokens, minimum=0, maximum=LIMITS["max_recv_tokens"]
    )
    native_inputs, first, k = [], None, None
    for r, inp in enumerate(inputs):
        check_keys(f"inputs[{r}]", inp, ("x", "topk_idx"), ("scales", "topk_weights"))
        x, scales = inp["x"], inp.get("scales")
        idx, weights = inp["topk_idx"], inp.get("topk_weights")
        name = f"inputs[{r}]['topk_idx']"
        check_topk_idx(idx, num_experts, check_values=False, name=name)
        k = _same_on_every_rank(name, idx.shape[1], k, "columns (K)", "inputs[0]['topk_idx']")
        _check_token_data(f"inputs[{r}]['x']", x, scales, idx.shape[0], first)
        if weights is not None:
            check_tensor(
                f"inputs[{r}]['topk_weights']", weights, dtype=torch.float32, shape=idx.shape
            )
        if first is None:
            first = (x, scales)
        native_inputs.append(
            (_to_bytes(idx), _opt_bytes(weights), _to_bytes(x), _opt_bytes(scales))
        )
    x0, s0 = first
    handle = _native.reference_dispatch(
        native_inputs,
        num_experts,
        k,
        x0.shape[1] * x0.element_size(),
        0 if s0 is None else s0.shape[1],
        expert_alignment,
        num_worst_tokens,
    )
    return RefDispatch(handle, x0.dtype, x0.shape[1])


def dispatch_cached(ref: RefDispatch, xs) -> list:
    """Cached dispatch: moves new token data along ``ref``'s routing.

    ``xs[r]`` is rank ``r``'s data: a tensor (bf16 or float8_e4m3fn [N_r, H']) or a
    ``(data, scales)`` tuple with float32 [N_r, S'] scales (or None); dtype, H'
    and S' may differ from the original dispatch but must agree across ranks.
    Returns, per destination rank, ``(recv_x [rows, H'], recv_scales float32
    [rows, S'] or None)``, row ``i`` holding the token of ``ref.ranks[d]``'s row ``i``.
    """
    _check_ref(ref)
    xs = check_rank_list("xs", xs, ref.num_ranks)
    native_inputs, first = [], None
    for r, item in enumerate(xs):
        if isinstance(item, tuple) and len(item) != 2:
            raise ValueError(
                f"xs[{r}] must be a tensor or a (data, scales) pair, got a {len(item)}-tuple"
            )
        x, scales = item if isinstance(item, tuple) else (item, None)
        _check_token_data(f"xs[{r}]", x, scales, ref.num_tokens(r), first)
        if first is None:
            first = (x, scales)
        native_inputs.append((_to_bytes(x), _opt_bytes(scales)))
    x0, s0 = first
    num_scales = 0 if s0 is None else s0.shape[1]
    out = _native.reference_dispatch_cached(
        ref._handle, native_inputs, x0.shape[1] * x0.element_size(), num_scales
    )
    results = []
    for o, (recv_x, recv_scales) in zip(ref.ranks, out):
        rows = o.recv_src_idx.shape[0]
        results.append(
            (
                _from_bytes(recv_x, x0.dtype, (rows, x0.shape[1])),
                _opt_from_bytes(recv_scales, torch.float32, (rows, num_scales)),
            )
        )
    return results


def _bias_pair(name: str, bias, shape) -> tuple:
    """One rank's bias (None, a tensor, or a pair of tensors / None) as a pair."""
    if bias is None:
        return (None, None)
    pair = bias if isinstance(bias, tuple) else (bias, None)
    if len(pair) != 2:
        raise ValueError(f"{name} must be None, a tensor or a pair, got a {len(pair)}-tuple")
    for i, b in enumerate(pair):
        if b is not None:
            check_tensor(f"{name}[{i}]", b, dtype=COMBINE_DTYPES, shape=shape)
    return pair


def combine(ref: RefDispatch, ys, topk_weights=None, biases=None, ranks_per_node=None) -> list:
    """Combine over all ranks at once.

    - ``ys[r]``: bf16 (or float32) [rows_r, H], what rank ``r`` returns for the
      rows it received (``rows_r = ref.ranks[r].recv_x.shape[0]``; padding rows
      are ignored);
    - ``topk_weights``: None, or per rank float32 [rows_r, K];
    - ``biases``: None, or per rank None, one tensor or a pair ``(b0, b1)`` (each
      None or bf16 / float32 [N_r, H]) for rank ``r``'s own tokens;
    - ``ranks_per_node``: None for the intranode model, or the internode model
      with nodes of that many consecutive ranks (it must divide ``ref.num_ranks``).

    bf16 values are converted to float32 exactly. Returns, per source rank,
    ``(combined_x float32 [N_r, H], combined_topk_weights float32 [N_r, K] or
    None)``. Intranode: ``(b0 + b1) + y_d0 + y_d1 + ...`` in float32 over the
    ranks ``d0 < d1 < ...`` the token went to; weights likewise from ``0.0``.
    Internode: for each node ``n0 < n1 < ...`` holding some of those ranks, the
    partial ``p_n = bf16(0.0 + y_d + ...)`` over its ranks ascending (float32
    sum, rounded once to bf16), then ``(b0 + b1) + p_n0 + p_n1 + ...`` in
    float32; weights the same two-level float32 sum, not rounded. A token sent
    nowhere is ``b0 + b1`` (zeros without bias). Round ``combined_x`` with
    :func:`to_bf16` to get what a GPU bf16 output holds (bit for bit for the
    kernels the model describes: intranode, or internode with that split).
    """
    _check_ref(ref)
    r_count = ref.num_ranks
    ranks_per_node = _check_ranks_per_node(ranks_per_node, r_count, "ref.num_ranks")
    ys = check_rank_list("ys", ys, r_count)
    if topk_weights is not None:
        topk_weights = check_rank_list("topk_weights", topk_weights, r_count)
    if biases is not None:
        biases = check_rank_list("biases", biases, r_count)
    check_tensor("ys[0]", ys[0], dtype=COMBINE_DTYPES, dims=2)
    # bf16 rows of a positive multiple of 128 bytes, as the GPU combine moves them.
    max_hidden = LIMITS["max_hidden_bytes"] // 2
    check_multiple("ys[0].shape[1] (hidden)", ys[0].shape[1], HIDDEN_UNIT, max_hidden)
    hidden, k = ys[0].shape[1], ref._handle.num_topk
    native_inputs = []
    for r in range(r_count):
        rows, n = ref.ranks[r].recv_src_idx.shape[0], ref.num_tokens(r)
        y = check_tensor(f"ys[{r}]", ys[r], dtype=COMBINE_DTYPES, shape=(rows, hidden))
        w = None if topk_weights is None else topk_weights[r]
        if w is not None:
            check_tensor(f"topk_weights[{r}]", w, dtype=torch.float32, shape=(rows, k))
        b0, b1 = _bias_pair(f"biases[{r}]", None if biases is None else biases[r], (n, hidden))
        native_inputs.append(
            tuple(_opt_bytes(None if t is None else t.float()) for t in (y, w, b0, b1))
        )
    out = _native.reference_combine(ref._handle, native_inputs, hidden, ranks_per_node)
    return [
        (
            _from_bytes(x, torch.float32, (ref.num_tokens(r), hidden)),
            _opt_from_bytes(w, torch.float32, (ref.num_tokens(r), k)),
        )
        for r, (x, w) in enumerate(out)
    ]


# ----- low latency ---------------------------------------------------------------------


def ll_dispatch(
    xs,
    topk_idxs,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    rank: int | None = None,
) -> list:
    """``low_latency_dispatch`` of every rank at once (``ep_reference::low_latency``):
    ``xs[r]`` bf16 ``[T_r, H]``, ``topk_idxs[r]`` int64 ``[T_r, K]``. Returns one dict
    per rank with CPU tensors ``recv_x`` (bf16 or float8_e4m3fn ``[E_local, R*T, H]``),
    ``scales`` (None, float32 ``[E_local, R*T, G]`` or int32 ``[E_local, R*T, W]``, last
    two dims column-major as on the GPU), ``recv_count`` int32 ``[E_local]``,
    ``src_info`` int32 ``[E_local, R*T]``, ``layout_range`` int64 ``[E_local, R]``.
    Blocks are in source-rank order, rows in token order. ``use_ue8m0`` needs
    ``use_fp8`` (and ``round_scale``). With ``rank``, only that rank's dict is
    computed (1 / R of the work and memory; a rank checking its own GPU results)
    and the other entries are None."""
    xs = check_rank_list("xs", xs)
    r = len(xs)
    topk_idxs = check_rank_list("topk_idxs", topk_idxs, r)
    t = _check_ll_tokens(num_max_dispatch_tokens_per_rank)
    num_experts = check_int("num_experts", num_experts, minimum=1, maximum=LIMITS["max_experts"])
    el = check_experts_ranks(num_experts, r, "len(xs)")
    use_fp8 = check_bool("use_fp8", use_fp8)
    round_scale = check_bool("round_scale", round_scale)
    use_ue8m0 = check_bool("use_ue8m0", use_ue8m0)
    if use_ue8m0 and not use_fp8:
        raise ValueError("use_ue8m0=True needs use_fp8=True (bf16 dispatch has no scales)")
    if rank is not None:
        rank = check_int("rank", rank, minimum=0, maximum=r - 1)
    inputs, hidden, k = [], None, None
    for i, (x, idx) in enumerate(zip(xs, topk_idxs)):
        check_tensor(f"xs[{i}]", x, dtype=torch.bfloat16, dims=2)
        if hidden is None:
            hidden = _check_ll_hidden("xs[0].shape[1] (hidden)", x.shape[1])
        _same_on_every_rank(f"xs[{i}]", x.shape[1], hidden, "columns (hidden)", "xs[0]")
        check_topk_idx(idx, num_experts, check_values=False, name=f"topk_idxs[{i}]")
        k = _same_on_every_rank(f"topk_idxs[{i}]", idx.shape[1], k, "columns (K)", "topk_idxs[0]")
        if idx.shape[0] != x.shape[0]:
            raise ValueError(
                f"topk_idxs[{i}] must have {x.shape[0]} rows like xs[{i}], got {idx.shape[0]}"
            )
        inputs.append((_to_bytes(x.float()), _to_bytes(idx)))
    outs = _native.ref_ll_dispatch(
        inputs, t, hidden, num_experts, k, use_fp8, round_scale, use_ue8m0, rank
    )
    rt = r * t
    res = []
    for o in outs:
        if o is None:
            res.append(None)
            continue
        if use_fp8:
            recv_x = _from_bytes(o["recv_x"], torch.uint8, (el, rt, hidden)).view(
                torch.float8_e4m3fn
            )
            g = hidden // 128
            if use_ue8m0:
                w = (g + 3) // 4
                scales = _from_bytes(o["scales"], torch.int32, (el, w, rt)).transpose(1, 2)
            else:
                scales = _from_bytes(o["scales"], torch.float32, (el, g, rt)).transpose(1, 2)
        else:
            recv_x = _from_bytes(o["recv_x"], torch.bfloat16, (el, rt, hidden))
            scales = None
        res.append(
            {
                "recv_x": recv_x,
                "scales": scales,
                "recv_count": _from_bytes(o["recv_count"], torch.int32, (el,)),
                "src_info": _from_bytes(o["src_info"], torch.int32, (el, rt)),
                "layout_range": _from_bytes(o["layout_range"], torch.int64, (el, r)),
            }
        )
    return res


def _check_ll_tokens(value) -> int:
    return check_int(
        "num_max_dispatch_tokens_per_rank",
        value,
        minimum=1,
        maximum=LIMITS["ll_max_tokens_per_rank"],
    )


def _check_ll_hidden(name: str, value) -> int:
    return check_multiple(name, value, LIMITS["fp8_group_size"], LIMITS["ll_max_hidden"])


def ll_combine(
    ys, topk_idxs, topk_weights, handles, num_max_dispatch_tokens_per_rank: int, num_experts: int
) -> list:
    """``low_latency_combine`` of every rank at once: ``ys[r]`` bf16 ``[E_local, R*T,
    H]`` expert outputs in the layout of ``handles[r] = (src_info, layout_range)`` (a
    GPU handle works as is), ``topk_idxs[r]`` int64 / ``topk_weights[r]`` float32
    ``[T_r, K]``. Returns per rank ``(combined bf16 [T_r, H], abs_sum float32 [T_r,
    H])``: the kernel's order (fma over k ascending from +0) gives ``combined`` bit for
    bit."""
    ys = check_rank_list("ys", ys)
    r = len(ys)
    topk_idxs = check_rank_list("topk_idxs", topk_idxs, r)
    topk_weights = check_rank_list("topk_weights", topk_weights, r)
    handles = check_rank_list("handles", handles, r)
    t = _check_ll_tokens(num_max_dispatch_tokens_per_rank)
    num_experts = check_int("num_experts", num_experts, minimum=1, maximum=LIMITS["max_experts"])
    el = check_experts_ranks(num_experts, r, "len(ys)")
    inputs, hidden, k = [], None, None
    for i in range(r):
        check_tensor(f"ys[{i}]", ys[i], dtype=torch.bfloat16, dims=3)
        if hidden is None:
            hidden = _check_ll_hidden("ys[0].shape[2] (hidden)", ys[0].shape[2])
        check_tensor(f"ys[{i}]", ys[i], shape=(el, r * t, hidden))
        idx = check_topk_idx(topk_idxs[i], num_experts, check_values=False, name=f"topk_idxs[{i}]")
        k = _same_on_every_rank(f"topk_idxs[{i}]", idx.shape[1], k, "columns (K)", "topk_idxs[0]")
        w = check_tensor(
            f"topk_weights[{i}]", topk_weights[i], dtype=torch.float32, shape=idx.shape
        )
        handle = handles[i]
        if not isinstance(handle, (tuple, list)) or len(handle) < 2:
            raise TypeError(
                f"handles[{i}] must be a (src_info, layout_range, ...) tuple, "
                f"got {type(handle).__name__}"
            )
        src_info = check_tensor(
            f"handles[{i}][0] (src_info)", handle[0], dtype=torch.int32, shape=(el, r * t)
        )
        layout_range = check_tensor(
            f"handles[{i}][1] (layout_range)", handle[1], dtype=torch.int64, shape=(el, r)
        )
        inputs.append(
            (
                _to_bytes(ys[i]),
                _to_bytes(idx),
                _to_bytes(w),
                _to_bytes(src_info),
                _to_bytes(layout_range),
            )
        )
    outs = _native.ref_ll_combine(inputs, t, hidden, num_experts, k)
    res = []
    for i, (c, a) in enumerate(outs):
        n = topk_idxs[i].shape[0]
        res.append(
            (
                _from_bytes(c, torch.float32, (n, hidden)).to(torch.bfloat16),
                _from_bytes(a, torch.float32, (n, hidden)),
            )
        )
    return res
