"""The handle layouts of ``moelink.Buffer.dispatch`` (no GPU needed): an intranode
6-tuple and an internode 10-tuple in DeepEP's orders, and which of their entries the
checks and kernels read. The values of the DeepEP-valued entries are checked on the
GPU against the reference (tests/multi_gpu/intranode_worker.py, ``check_handle``)."""

import pytest
import torch
from moelink import buffer as B


def _i32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


def intranode_handle(n=5, r=4):
    return (_i32(r, r), _i32(r, 1), _i32(r, 1), _i32(7), torch.zeros(n, r, dtype=torch.bool),
            _i32(n, r))  # fmt: skip


def internode_handle(n=5, r=4, nodes=2, t=9):
    return (
        torch.zeros(n, r, dtype=torch.bool),  # 0 is_token_in_rank
        _i32(2 * nodes),  # 1 xcounts
        _i32(r, r),  # 2 rank_prefix_matrix
        _i32(nodes, t, 1 + r // nodes),  # 3 fwd_meta
        _i32(nodes),  # 4 recv_rdma_rank_prefix_sum
        _i32(r, 1),  # 5
        _i32(r, r)[:, 1],  # 6 recv_gbl_rank_prefix_sum (a column)
        _i32(7),  # 7 recv_src_idx
        _i32(n, nodes),  # 8 node heads
        _i32(n, r),  # 9 send heads
    )


def assert_entries(h, positions):
    """``B._entry`` finds each named entry of ``h`` at its position there."""
    for name, i in positions.items():
        assert B._entry(h, name) is h[i], name


def test_the_internode_handle_is_deepeps_ten_entries_in_deepeps_order():
    h = internode_handle()
    assert_entries(
        h, {"is_token_in_rank": 0, "rank_prefix_matrix": 2, "recv_src_idx": 7, "send_head": 9}
    )
    assert [B._entry(h, n) for n in B._X_ENTRIES] == [h[8], h[1], h[3]]
    # The checks name each entry by its position in the handle and DeepEP's name.
    names = [m for m in B._HANDLE_LAYOUT[10].values()]
    assert (4, "recv_rdma_rank_prefix_sum") not in names  # DeepEP's values, not read
    metas = B._handle_metas(h)
    assert [m[0] for m in metas] == ["torch.int32", "torch.int32", "torch.bool", "torch.int32"]
    assert [tuple(m[1]) for m in metas] == [(4, 4), (7,), (5, 4), (5, 4)]


def test_the_intranode_handle_keeps_deepeps_six_entries():
    h = intranode_handle()
    assert_entries(
        h, {"rank_prefix_matrix": 0, "recv_src_idx": 3, "is_token_in_rank": 4, "send_head": 5}
    )
    assert [tuple(m[1]) for m in B._handle_metas(h)] == [(4, 4), (7,), (5, 4), (5, 4)]


@pytest.mark.parametrize("n", [5, 9, 11])
def test_a_handle_of_another_length_is_refused(n):
    h = internode_handle()[:n] if n < 10 else (*internode_handle(), _i32(1))
    with pytest.raises(ValueError, match="6 entries within one node, 10 across nodes"):
        B._handle_metas(h)
    assert B._handle_sig(h) is B._NO_SIG


def test_the_checks_name_a_wrong_entry_by_its_internode_position():
    h = list(internode_handle())
    h[7] = None
    with pytest.raises(TypeError, match=r"handle\[7\] \(recv_src_meta: recv_src_idx\)"):
        B._handle_metas(tuple(h))


def test_the_plan_key_sees_every_entry_the_kernels_read():
    h = internode_handle()
    other = list(h)
    other[3] = _i32(2, 10, 3)  # forwarding records for more tokens
    assert B._handle_sig(h) != B._handle_sig(tuple(other))
    other = list(h)
    other[4] = _i32(3)  # DeepEP's prefix sum: not read by moelink
    assert B._handle_sig(h) == B._handle_sig(tuple(other))
    assert B._handle_sig(intranode_handle()) != B._handle_sig(h)
