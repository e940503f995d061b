"""One expert-parallel MoE layer with moelink, checked: run it on N ranks.

    python -m moelink.launch -n 4 examples/moe_layer.py
    torchrun --nproc-per-node 4 examples/moe_layer.py

Every rank holds ``--num-tokens`` tokens and ``--num-experts / N`` experts. A
router picks the top-k experts of each token; ``get_dispatch_layout`` counts where
the tokens go, ``dispatch`` moves each token to the ranks holding its experts,
a stand-in expert computes on the received rows, and ``combine`` brings the
results back to the tokens' ranks, where they are compared with what the layer
must produce. Rank 0 prints ``PASS`` (exit 0) or the first mismatch (exit 1).

The stand-in expert ``e`` scales a row by ``1 + (e mod experts per rank) /
experts per rank``, and a rank returns, for each row it received, the sum of
that over the token's experts it holds, each times the router's weight. So the
layer's output for token ``t`` is ``x[t] * sum_k w[t, k] * scale(expert[t, k])``,
which every rank can compute from its own inputs.

More ranks than GPUs share them (``moelink.launch`` places rank ``r`` on GPU
``r % G``; ``init_distributed`` then makes a gloo group, as NCCL refuses two
ranks on one GPU). ``MOELINK_RANKS_PER_NODE=2`` with 4 ranks runs the same layer
across two emulated nodes (the internode path).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="examples/moe_layer.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-tokens", type=int, default=1024, help="tokens per rank (1024)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (4096)")
    p.add_argument("--num-experts", type=int, default=64, help="experts in all (64)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (8)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import moelink
    import torch
    import torch.distributed as dist
    from moelink.launch import init_distributed

    if torch.cuda.device_count() == 0:
        print("examples/moe_layer.py needs a CUDA GPU, found none", file=sys.stderr)
        return 1
    if "RANK" not in os.environ:
        print(
            "examples/moe_layer.py: start it with `python -m moelink.launch -n N` or torchrun",
            file=sys.stderr,
        )
        return 1

    # The process group: device local_rank % GPUs; NCCL, or gloo where ranks share GPUs.
    info = init_distributed(timeout_s=300)
    group = dist.group.WORLD
    ranks, rank = info.world_size, info.rank
    if args.num_experts % ranks:
        print(f"--num-experts must be a multiple of the {ranks} ranks", file=sys.stderr)
        return 2
    experts_per_rank = args.num_experts // ranks

    # One Buffer, sized by DeepEP's hints for the largest batch it will see.
    dispatch_config = moelink.Buffer.get_dispatch_config(ranks)
    combine_config = moelink.Buffer.get_combine_config(ranks)
    hidden_bytes = args.hidden * 2  # bf16 rows (fp8 rows plus scales fit too)
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (dispatch_config, combine_config):
        num_nvl_bytes = max(
            num_nvl_bytes,
            config.get_nvl_buffer_size_hint(
                hidden_bytes, ranks, max_tokens_per_rank=args.num_tokens
            ),
        )
        num_rdma_bytes = max(
            num_rdma_bytes,
            config.get_rdma_buffer_size_hint(
                hidden_bytes, ranks, max_tokens_per_rank=args.num_tokens
            ),
        )
    buffer = moelink.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)

    # This rank's tokens and the router's choice.
    gen = torch.Generator(device=info.device).manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.num_tokens, args.hidden, generator=gen, device=info.device).to(
        torch.bfloat16
    )
    scores = torch.randn(args.num_tokens, args.num_experts, generator=gen, device=info.device)
    top = scores.topk(args.topk, dim=1)
    topk_idx = top.indices.to(moelink.topk_idx_t)
    topk_weights = top.values.softmax(dim=1)

    # Layout, then dispatch.
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
        buffer.get_dispatch_layout(topk_idx, args.num_experts)
    )
    recv_x, recv_topk_idx, recv_topk_weights, recv_per_expert, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        config=dispatch_config,
    )

    # The experts (a stand-in): recv_topk_idx holds local expert ids, -1 elsewhere.
    held = recv_topk_idx >= 0
    scale = 1.0 + recv_topk_idx.clamp(min=0).float() / experts_per_rank
    row_weight = (recv_topk_weights * scale * held).sum(dim=1, keepdim=True)
    expert_out = (recv_x.float() * row_weight).to(torch.bfloat16)

    # Combine: every token gets the sum of what the ranks holding its experts returned.
    y, _, _ = buffer.combine(expert_out, handle, config=combine_config)

    # Check against what the layer must compute, from this rank's own inputs.
    want_scale = 1.0 + (topk_idx % experts_per_rank).float() / experts_per_rank
    want = (x.float() * (topk_weights * want_scale).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    failures = []
    if sum(recv_per_expert) != int(held.sum()):
        failures.append(
            f"rank {rank}: per-expert counts sum to {sum(recv_per_expert)}, "
            f"received {int(held.sum())} (row, expert) pairs"
        )
    if not torch.allclose(y.float(), want.float(), rtol=2e-2, atol=2e-2):
        worst = (y.float() - want.float()).abs().max().item()
        failures.append(f"rank {rank}: combined output differs from the layer's by up to {worst}")
    torch.cuda.synchronize()
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr, flush=True)

    failed = torch.tensor([len(failures)], dtype=torch.int64)
    if info.backend == "nccl":
        failed = failed.to(info.device)
    dist.all_reduce(failed, group=group)
    if rank == 0 and failed.item() == 0:
        print(
            f"PASS moe_layer: {ranks} ranks, {args.num_tokens} tokens x {args.hidden} per rank, "
            f"top-{args.topk} of {args.num_experts} experts ({info.backend} group)",
            flush=True,
        )
    buffer.destroy()
    dist.destroy_process_group()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
