# The probe of the internode stall (run as the NOTE says, with MOELINK_RANKS_PER_NODE=2):
# full dispatch, cached dispatch and combine of the PERFORMANCE.md workload, PROBE_SYNC =
# poll (the host polls an event) | sync (torch.cuda.synchronize) | cpu (a small D2H copy).
import os
import time

import moelink
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank % torch.cuda.device_count())
mode = os.environ.get("PROBE_SYNC", "poll")
T, H, E, K = 4096, 7168, 256, 8
g = torch.Generator(device="cuda").manual_seed(rank + 1)
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
scores = torch.rand(T, E, device="cuda", generator=g)
topk_idx = scores.topk(K, dim=1).indices.to(torch.int64)
topk_w = torch.rand(T, K, device="cuda", generator=g)
cfg = moelink.Config(num_sms=24)
nvl = cfg.get_nvl_buffer_size_hint(H * 2, world, max_tokens_per_rank=T)
rdma = cfg.get_rdma_buffer_size_hint(H * 2, world, max_tokens_per_rank=T, ranks_per_node=world // 2)
buf = moelink.Buffer(dist.group.WORLD, nvl, rdma, explicitly_destroy=True)


def sync():
    if mode == "poll":
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass
    elif mode == "sync":
        torch.cuda.synchronize()
    else:
        torch.zeros(4, device="cuda").add_(1).cpu()


ok = True
t0 = time.time()
try:
    lay = buf.get_dispatch_layout(topk_idx, E)
    sync()
    for i in range(int(os.environ.get("PROBE_ITERS", "8"))):
        out = buf.dispatch(
            x,
            num_tokens_per_rank=lay[0],
            is_token_in_rank=lay[3],
            num_tokens_per_expert=lay[2],
            topk_idx=topk_idx,
            topk_weights=topk_w,
            config=cfg,
        )
        sync()
        h = out[4]
        r2 = buf.dispatch(x, handle=h, config=cfg)[0]
        sync()
        c = buf.combine(out[0], h, config=cfg)[0]
        sync()
        if rank == 0:
            print(f"[{mode}] iter {i} ok {time.time() - t0:.2f}s", flush=True)
except Exception as e:
    ok = False
    print(f"[{mode}] rank {rank} FAILED after {time.time() - t0:.1f}s: {str(e)[:600]}", flush=True)
finally:
    try:
        buf.destroy()
    except Exception as e:
        print(f"[{mode}] rank {rank} destroy: {str(e)[:200]}", flush=True)
print(f"[{mode}] rank {rank} RESULT {'PASS' if ok else 'FAIL'}", flush=True)
