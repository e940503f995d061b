//! CPU tests of the tch API (CI, no GPU): a CPU tensor gets a clear error,
//! wrong dtypes and shapes are refused with the Python API's messages and
//! error kinds, outputs are planned and allocated through tch, and the CPU
//! reference (`ep-reference`, the oracle) runs on tch CPU tensors.

#![cfg(feature = "tch")]

use std::time::Duration;

use ep_core::calls::DispatchPlan;
use ep_core::limits::MAX_HIDDEN_BYTES;
use moelink_tch::checks::{self, Target};
use moelink_tch::reference::{self, RankTokens};
use moelink_tch::tch::{Device, Kind, Tensor};
use moelink_tch::tensor::required;
use moelink_tch::{
    AllReduce, AllReduceOptions, Bias, Buffer, BufferOptions, DispatchArgs, DispatchX, Error,
    Group, Handle, InternodeHandle, LlCombineOptions, LlDispatchOptions, LlHandle,
};

const R: usize = 4;
const N: i64 = 32;
const H: i64 = 256;
const K: i64 = 4;
const E: i64 = 16;
const GPU: Device = Device::Cuda(0);
/// `max_bytes` of the allreduce checks where the size does not matter (1 MiB).
const MAX_BYTES: usize = 1 << 20;

fn cpu(kind: Kind, shape: &[i64]) -> Tensor {
    Tensor::zeros(shape, (kind, Device::Cpu))
}

#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, Error>, class: &str, message: &str) {
    let e = r.expect_err("the call must be refused");
    assert_eq!((e.python_class(), e.to_string().as_str()), (class, message));
}

/// `checks::dispatch` of `x` with `layout`'s routing by `idx` (weights `w`),
/// Python's defaults otherwise.
fn check_dispatch(
    t: &Target,
    x: DispatchX<'_>,
    layout: &moelink_tch::Layout,
    idx: &Tensor,
    w: Option<&Tensor>,
) -> Result<DispatchPlan, Error> {
    checks::dispatch(t, x, &DispatchArgs::new(layout, idx, w))
}

/// Expert ids `[n, K]`: token t's column k is `(t + 3k) % E`, column 3 of
/// every fifth token -1.
fn topk(n: i64) -> Tensor {
    let mut v = Vec::new();
    for t in 0..n {
        for k in 0..K {
            v.push(if k == 3 && t % 5 == 0 {
                -1
            } else {
                (t + 3 * k) % E
            });
        }
    }
    Tensor::from_slice(&v).reshape([n, K])
}

// ----- a CPU tensor gets a clear error ------------------------------------------------

#[test]
fn cpu_tensors_are_refused_naming_the_argument_and_the_device() {
    let gpu = Target::new(R, GPU);
    let (idx, x) = (topk(N), cpu(Kind::BFloat16, &[N, H]));
    refused(
        checks::layout(&gpu, &idx, E),
        "ValueError",
        "topk_idx must be on this Buffer's device cuda:0, got cpu",
    );
    let layout = reference::layout(&idx, E, R as i64).unwrap();
    refused(
        check_dispatch(&gpu, DispatchX::Bf16(&x), &layout, &idx, None),
        "ValueError",
        "x must be on this Buffer's device cuda:0, got cpu",
    );
    refused(
        checks::ll_dispatch(&gpu, &x, &idx, N, E, &LlDispatchOptions::default()),
        "ValueError",
        "x must be on this Buffer's device cuda:0, got cpu",
    );
    refused(
        checks::all_reduce(&cpu(Kind::Float, &[8]), None, GPU, MAX_BYTES),
        "ValueError",
        "tensor is on cpu, but this communicator runs on cuda:0",
    );
}

#[test]
fn a_cpu_device_is_refused_for_buffer_and_allreduce() {
    let id = Group::unique_id().unwrap();
    let group = Group::new(&id, 0, 1, Duration::from_secs(20)).unwrap();
    assert_eq!((group.rank(), group.size()), (0, 1));
    let opts = BufferOptions {
        num_nvl_bytes: 1 << 20,
        ..BufferOptions::default()
    };
    refused(
        Buffer::new(&group, Device::Cpu, &opts),
        "RuntimeError",
        "moelink.Buffer needs a CUDA device, got Cpu",
    );
    refused(
        AllReduce::new(&group, Device::Cpu, &AllReduceOptions::default()),
        "RuntimeError",
        "moelink.AllReduce needs a CUDA device, got Cpu",
    );
    // The Buffer's own argument checks come first, as in Python.
    let bad = BufferOptions {
        num_nvl_bytes: 1000,
        ..BufferOptions::default()
    };
    refused(
        Buffer::new(&group, GPU, &bad),
        "ValueError",
        "num_nvl_bytes must be a multiple of 128, got 1000",
    );
}

// ----- wrong dtypes and shapes ---------------------------------------------------------

#[test]
fn wrong_dtypes_are_dtype_errors() {
    // Checked against a CPU "device" so that only the dtypes are wrong.
    let t = Target::new(R, Device::Cpu);
    let idx = topk(N);
    refused(
        checks::layout(&t, &idx.to_kind(Kind::Int), E),
        "moelink.DtypeError",
        "topk_idx must have dtype torch.int64, got torch.int32",
    );
    let layout = reference::layout(&idx, E, R as i64).unwrap();
    let x32 = cpu(Kind::Float, &[N, H]);
    refused(
        check_dispatch(&t, DispatchX::Bf16(&x32), &layout, &idx, None),
        "moelink.DtypeError",
        "x must have dtype torch.bfloat16, got torch.float32",
    );
    let (x8, s64) = (
        cpu(Kind::Float8e4m3fn, &[N, H]),
        cpu(Kind::Double, &[N, H / 128]),
    );
    refused(
        check_dispatch(&t, DispatchX::Fp8(&x8, &s64), &layout, &idx, None),
        "moelink.DtypeError",
        "x[1] (scales) must have dtype torch.float32, got torch.float64",
    );
    let x = cpu(Kind::BFloat16, &[N, H]);
    let w64 = cpu(Kind::Double, &[N, K]);
    refused(
        check_dispatch(&t, DispatchX::Bf16(&x), &layout, &idx, Some(&w64)),
        "moelink.DtypeError",
        "topk_weights must have dtype torch.float32, got torch.float64",
    );
    refused(
        checks::all_reduce(&cpu(Kind::Double, &[8]), None, Device::Cpu, MAX_BYTES),
        "TypeError",
        "tensor dtype torch.float64 is not supported; supported: torch.bfloat16, \
         torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2",
    );
    refused(
        checks::all_reduce(
            &cpu(Kind::Float, &[8]),
            Some(&cpu(Kind::Half, &[8])),
            Device::Cpu,
            MAX_BYTES,
        ),
        "TypeError",
        "out has dtype torch.float16, tensor torch.float32",
    );
}

#[test]
fn wrong_shapes_are_value_errors() {
    let t = Target::new(R, Device::Cpu);
    let idx = topk(N);
    refused(
        checks::layout(&t, &idx, 18),
        "ValueError",
        "num_experts must be a multiple of num_ranks, got num_experts=18 and num_ranks=4",
    );
    refused(
        checks::layout(&t, &cpu(Kind::Int64, &[N, 33]), E),
        "ValueError",
        "topk_idx must have 1 to 32 columns (experts per token), got shape [32, 33]",
    );
    let layout = reference::layout(&idx, E, R as i64).unwrap();
    let odd = cpu(Kind::BFloat16, &[N, 100]);
    refused(
        check_dispatch(&t, DispatchX::Bf16(&odd), &layout, &idx, None),
        "ValueError",
        &format!(
            "x rows must be a positive multiple of 128 bytes up to {MAX_HIDDEN_BYTES}, got \
             hidden=100 of torch.bfloat16 (200 bytes)"
        ),
    );
    let x = cpu(Kind::BFloat16, &[N, H]);
    let short = topk(N - 1);
    refused(
        check_dispatch(&t, DispatchX::Bf16(&x), &layout, &short, None),
        "ValueError",
        "topk_idx must have shape [32, *], got [31, 4]",
    );
    let tr = cpu(Kind::BFloat16, &[H, N]).tr();
    refused(
        check_dispatch(&t, DispatchX::Bf16(&tr), &layout, &idx, None),
        "ValueError",
        "x must be contiguous, got shape [32, 256] with strides [1, 32]",
    );
    refused(
        checks::ll_dispatch(&t, &x, &idx, N - 1, E, &LlDispatchOptions::default()),
        "ValueError",
        "x has 32 tokens, more than num_max_dispatch_tokens_per_rank=31",
    );
    let o = LlDispatchOptions {
        use_ue8m0: true,
        ..LlDispatchOptions::default()
    };
    refused(
        checks::ll_dispatch(&t, &x, &idx, N, E, &o),
        "ValueError",
        "use_ue8m0=True needs round_scale=True",
    );
    refused(
        checks::all_reduce(
            &cpu(Kind::Float, &[8]),
            Some(&cpu(Kind::Float, &[9])),
            Device::Cpu,
            MAX_BYTES,
        ),
        "ValueError",
        "out has 9 elements, tensor 8",
    );
    refused(
        checks::all_gather(
            &cpu(Kind::Float, &[10]),
            &cpu(Kind::Float, &[3]),
            4,
            Device::Cpu,
            MAX_BYTES,
        ),
        "ValueError",
        "out must hold world_size * inp.numel() = 4 * 3 elements, it holds 10",
    );
    refused(
        checks::all_reduce(&cpu(Kind::Float, &[257]), None, Device::Cpu, 1024),
        "ValueError",
        "tensor has 1028 bytes, more than this communicator's max_bytes=1024",
    );
    refused(
        checks::all_gather(
            &cpu(Kind::Float, &[20]),
            &cpu(Kind::Float, &[5]),
            4,
            Device::Cpu,
            79,
        ),
        "ValueError",
        "out has 80 bytes, more than this communicator's max_bytes=79",
    );
    let row = cpu(Kind::BFloat16, &[2 * N * H + 1]);
    let view = row.narrow(0, 1, N * H).view([N, H]);
    refused(
        check_dispatch(&t, DispatchX::Bf16(&view), &layout, &idx, None),
        "ValueError",
        "x must start on a 16-byte boundary (it is a view at an odd offset)",
    );
}

// ----- plans and outputs ------------------------------------------------------------------

/// A handle of `rows` received rows for N tokens (what combine reads).
fn handle(rows: i64) -> Handle {
    Handle {
        rank_prefix_matrix: cpu(Kind::Int, &[R as i64, R as i64]),
        channel_prefix_matrix: cpu(Kind::Int, &[R as i64, 1]),
        recv_channel_prefix_matrix: cpu(Kind::Int, &[R as i64, 1]),
        recv_src_idx: cpu(Kind::Int, &[rows]),
        is_token_in_rank: cpu(Kind::Bool, &[N, R as i64]),
        send_head: cpu(Kind::Int, &[N, R as i64]),
        internode: None,
    }
}

/// [`handle`] with the internode entries of `nodes` nodes of `per_node`
/// ranks and forwarding records of `slots` tokens per node.
fn internode_handle(rows: i64, nodes: i64, per_node: i64, slots: i64) -> Handle {
    let h = handle(rows);
    let rpm = h.rank_prefix_matrix.shallow_clone();
    Handle {
        internode: Some(InternodeHandle {
            node_head: cpu(Kind::Int, &[N, nodes]),
            xcounts: cpu(Kind::Int, &[2 * nodes]),
            fwd_meta: cpu(Kind::Int, &[nodes, slots, 1 + per_node]),
            recv_rdma_rank_prefix_sum: cpu(Kind::Int, &[nodes]),
            recv_gbl_rank_prefix_sum: rpm.select(1, 0),
        }),
        ..h
    }
}

#[test]
fn the_internode_handle_is_checked_naming_the_entry() {
    let t = Target::new(R, Device::Cpu);
    let split = Some((2, 2));
    // Within one node: the intranode handle only.
    assert!(checks::internode_handle(&t, 1, None, &handle(7)).is_ok());
    refused(
        checks::internode_handle(&t, 1, None, &internode_handle(7, 2, 2, N)),
        "ValueError",
        "rank 1: handle.internode is set (an internode dispatch's handle); a Buffer within one \
         node takes the handle of an intranode dispatch",
    );
    // Across nodes: the internode entries, of this Buffer's split.
    refused(
        checks::internode_handle(&t, 1, split, &handle(7)),
        "ValueError",
        "rank 1: handle.internode is None; a Buffer whose group spans 2 nodes takes the handle \
         of an internode dispatch",
    );
    assert!(checks::internode_handle(&t, 1, split, &internode_handle(7, 2, 2, N)).is_ok());
    // Forwarding records of more tokens than the dispatch's (the buffer's
    // capacity) are what a dispatch makes.
    assert!(checks::internode_handle(&t, 1, split, &internode_handle(7, 2, 2, 4 * N)).is_ok());
    let shape = |h: Handle, message: &str| {
        refused(
            checks::internode_handle(&t, 1, split, &h),
            "ValueError",
            message,
        )
    };
    shape(
        internode_handle(7, 4, 1, N),
        "rank 1: handle.internode.node_head has shape [32, 4]: not the one this Buffer's \
         dispatch made (2 nodes of 2 ranks, 32 tokens)",
    );
    let mut h = internode_handle(7, 2, 2, N);
    h.internode.as_mut().unwrap().xcounts = cpu(Kind::Int, &[2]);
    shape(
        h,
        "rank 1: handle.internode.xcounts has shape [2]: not the one this Buffer's dispatch \
         made (2 nodes of 2 ranks, 32 tokens)",
    );
    shape(
        internode_handle(7, 2, 4, N),
        "rank 1: handle.internode.fwd_meta has shape [2, 32, 5]: not the one this Buffer's \
         dispatch made (2 nodes of 2 ranks, 32 tokens)",
    );
    // Dtype, device, layout.
    let mut h = internode_handle(7, 2, 2, N);
    h.internode.as_mut().unwrap().node_head = cpu(Kind::Int64, &[N, 2]);
    shape(
        h,
        "rank 1: handle.internode.node_head must be a contiguous int32 tensor on cpu, got \
         torch.int64 on cpu",
    );
    let mut h = internode_handle(7, 2, 2, N);
    h.internode.as_mut().unwrap().fwd_meta = cpu(Kind::Int, &[2, 3, N]).transpose(1, 2);
    shape(
        h,
        "rank 1: handle.internode.fwd_meta must be a contiguous int32 tensor on cpu, got \
         torch.int32 on cpu",
    );
    let gpu = Target::new(R, GPU);
    refused(
        checks::internode_handle(&gpu, 0, split, &internode_handle(7, 2, 2, N)),
        "ValueError",
        "rank 0: handle.internode.node_head must be a contiguous int32 tensor on cuda:0, got \
         torch.int32 on cpu",
    );
    // An undefined tensor is Python's TypeError for a non-tensor.
    let mut h = internode_handle(7, 2, 2, N);
    h.internode.as_mut().unwrap().xcounts = Tensor::new();
    refused(
        checks::internode_handle(&t, 1, split, &h),
        "TypeError",
        "handle.internode.xcounts must be a torch.Tensor, got an undefined tensor",
    );
}

#[test]
fn plans_allocate_the_outputs_python_allocates() {
    let t = Target::new(R, Device::Cpu);
    let idx = topk(N);
    let p = checks::layout(&t, &idx, E).unwrap();
    let in_rank = required(&p.outputs, "is_token_in_rank", Device::Cpu).unwrap();
    assert_eq!(
        (in_rank.size(), in_rank.kind()),
        (vec![N, R as i64], Kind::Bool)
    );

    let layout = reference::layout(&idx, E, R as i64).unwrap();
    let (x8, scales) = (
        cpu(Kind::Float8e4m3fn, &[N, H]),
        cpu(Kind::Float, &[H / 128, N]).tr(),
    );
    let w = cpu(Kind::Float, &[N, K]);
    let p = check_dispatch(&t, DispatchX::Fp8(&x8, &scales), &layout, &idx, Some(&w)).unwrap();
    assert_eq!((p.num_topk, p.num_scales, p.num_experts), (K, H / 128, E));
    let specs: Vec<_> = p.outputs.iter().map(|s| s.resolve(7)).collect();
    // Column-major scales in, column-major scales out.
    let s = required(&specs, "recv_x_scales", Device::Cpu).unwrap();
    assert_eq!((s.size(), s.stride()), (vec![7, H / 128], vec![1, 7]));
    let cpm = required(&specs, "channel_prefix_matrix", Device::Cpu).unwrap();
    assert_eq!(cpm.abs().sum(Kind::Int64).int64_value(&[]), 0, "zeroed");

    let y = cpu(Kind::BFloat16, &[7, H]);
    let b = cpu(Kind::BFloat16, &[N, H]);
    let p = checks::combine(&t, &y, &handle(7), None, Bias::One(&b)).unwrap();
    assert_eq!((p.num_recv_rows, p.hidden, p.num_tokens), (7, H, N));
    refused(
        checks::combine(
            &t,
            &cpu(Kind::BFloat16, &[8, H]),
            &handle(7),
            None,
            Bias::None,
        ),
        "ValueError",
        "x must have the 7 rows dispatch delivered, got 8",
    );
    let b2 = cpu(Kind::BFloat16, &[N, 2 * H]);
    refused(
        checks::combine(&t, &y, &handle(7), None, Bias::Pair(None, Some(&b2))),
        "ValueError",
        "bias[1] must have shape [32, 256], got [32, 512]",
    );

    let x = cpu(Kind::BFloat16, &[N, H]);
    let p = checks::ll_dispatch(&t, &x, &idx, N, E, &LlDispatchOptions::default()).unwrap();
    let rt = R as i64 * N;
    let s = required(&p.outputs, "recv_x_scales", Device::Cpu).unwrap();
    assert_eq!(
        (s.size(), s.stride(), s.kind()),
        (
            vec![E / R as i64, rt, H / 128],
            vec![rt * H / 128, 1, rt],
            Kind::Float
        )
    );
    let h = LlHandle {
        src_info: cpu(Kind::Int, &[E / R as i64, rt]),
        layout_range: cpu(Kind::Int64, &[E / R as i64, R as i64]),
        num_max_dispatch_tokens_per_rank: N,
        hidden: H,
        num_experts: E,
    };
    let y = cpu(Kind::BFloat16, &[E / R as i64, rt, H]);
    let p = checks::ll_combine(&t, &y, &idx, &w, &h, &LlCombineOptions::default()).unwrap();
    assert_eq!((p.num_tokens, p.num_topk), (N, K));
    let lf = LlCombineOptions {
        use_logfmt: true,
        ..LlCombineOptions::default()
    };
    refused(
        checks::ll_combine(&t, &y, &idx, &w, &h, &lf),
        "ValueError",
        "use_logfmt=True is not supported by moelink (bf16 combine only)",
    );
}

#[test]
fn size_hints_need_no_gpu() {
    let nvl = Buffer::nvl_buffer_size_hint(2 * 7168, 8, 128).unwrap();
    assert_eq!(nvl % 128, 0);
    // Python's number for the standard workload (tests/test_config.py).
    assert_eq!(
        Buffer::nvl_buffer_size_hint(2 * 7168, 4, 4096).unwrap(),
        2 * 4 * 4096 * 15184 + 65536
    );
    refused(
        Buffer::nvl_buffer_size_hint(100, 4, 4096),
        "ValueError",
        "hidden_bytes must be a positive multiple of 128 up to 1048576, got 100",
    );
    assert!(nvl > 2 * 8 * 128 * 2 * 7168);
    let ll = Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 256).unwrap();
    assert!(ll > 0);
    refused(
        Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 250),
        "ValueError",
        "num_experts must be a multiple of num_ranks, got num_experts=250 and num_ranks=8",
    );
    // The internode hint (Python's numbers, tests/test_config.py): 0 within one
    // node; across nodes 64 KiB + two halves of T * (R + 2 nodes) records of
    // the NVLink slot plus 4L + 16 bytes.
    for ranks in [1, 2, 8] {
        assert_eq!(
            Buffer::rdma_buffer_size_hint(256, ranks, 128, 8).unwrap(),
            0
        );
    }
    for (ranks, per_node) in [(4, 2), (8, 4), (8, 2), (6, 2)] {
        let slot =
            (Buffer::nvl_buffer_size_hint(1024, ranks, 100).unwrap() - 65536) / (2 * ranks * 100);
        let nodes = ranks / per_node;
        let want = 2 * 100 * (ranks + 2 * nodes) * (slot + 4 * per_node + 16) + 65536;
        assert_eq!(
            Buffer::rdma_buffer_size_hint(1024, ranks, 100, per_node).unwrap(),
            want.div_ceil(128) * 128,
            "{ranks} ranks, {per_node} per node"
        );
    }
    refused(
        Buffer::rdma_buffer_size_hint(1024, 6, 100, 4),
        "ValueError",
        "ranks_per_node 4 does not divide num_ranks 6",
    );
}

// ----- the reference on tch CPU tensors --------------------------------------------------------

/// Rank r's tokens: row t holds the bf16 value `r * 100 + t` in every channel.
fn tokens(r: i64, n: i64) -> Tensor {
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) + (r * 100) as f64)
        .unsqueeze(1)
        .expand([n, H], false)
        .to_kind(Kind::BFloat16)
        .contiguous()
}

#[test]
fn reference_dispatch_and_combine_on_cpu_tensors() {
    let r = R as i64;
    let l = reference::layout(&topk(N), E, r).unwrap();
    // Token 0: experts 0, 3, 6, -1 -> ranks 0 and 1.
    let in0: Vec<bool> = Vec::<bool>::try_from(l.is_token_in_rank.get(0)).unwrap();
    assert_eq!(in0, [true, true, false, false]);
    assert_eq!(
        l.num_tokens_per_rank.sum(Kind::Int64).int64_value(&[]),
        l.is_token_in_rank.sum(Kind::Int64).int64_value(&[])
    );

    let xs: Vec<Tensor> = (0..r).map(|rank| tokens(rank, N)).collect();
    let idx = topk(N);
    let ws: Vec<Tensor> = (0..r)
        .map(|rank| Tensor::rand([N, K], (Kind::Float, Device::Cpu)) + rank as f64)
        .collect();
    let inputs: Vec<RankTokens<'_>> = (0..R)
        .map(|rank| RankTokens {
            x: DispatchX::Bf16(&xs[rank]),
            topk_idx: &idx,
            topk_weights: Some(&ws[rank]),
        })
        .collect();
    let d = reference::dispatch(&inputs, E, 1, 0).unwrap();
    for (dst, out) in d.ranks.iter().enumerate() {
        // Every received row is its source token's (value r * 100 + t).
        let src_rank = out.recv_src_rank.to_kind(Kind::Float);
        let src_idx = out.recv_src_idx.to_kind(Kind::Float);
        let want = (src_rank * 100.0 + src_idx)
            .to_kind(Kind::BFloat16)
            .to_kind(Kind::Float);
        let got = out.recv_x.x.select(1, 0).to_kind(Kind::Float);
        assert!(got.equal(&want), "rank {dst}");
        // Local ids in [0, E/R) or -1.
        let ids = out.recv_topk_idx.shallow_clone();
        assert!(
            ids.ge(-1).all().int64_value(&[]) == 1 && ids.lt(E / r).all().int64_value(&[]) == 1
        );
    }
    // Combine of the received rows (every copy) with the received weights:
    // x times the number of ranks the token went to; the weights rebuild the
    // originals where the id is not -1.
    let ys: Vec<&Tensor> = d.ranks.iter().map(|o| &o.recv_x.x).collect();
    let rw: Vec<&Tensor> = d
        .ranks
        .iter()
        .map(|o| o.recv_topk_weights.as_ref().unwrap())
        .collect();
    let out = reference::combine(&d, &ys, Some(&rw), None).unwrap();
    for (rank, (x, w)) in out.iter().enumerate() {
        let copies = l.is_token_in_rank.sum_dim_intlist(-1, false, Kind::Float);
        let want = xs[rank].to_kind(Kind::Float) * copies.unsqueeze(1);
        assert!(x.equal(&want), "rank {rank}");
        let kept = idx.ne(-1).to_kind(Kind::Float);
        assert!(
            w.as_ref().unwrap().equal(&(&ws[rank] * kept)),
            "rank {rank}"
        );
    }
    // Wrong dtypes are refused with the reference's messages.
    let x32 = cpu(Kind::Float, &[N, H]);
    let bad = [RankTokens {
        x: DispatchX::Bf16(&x32),
        topk_idx: &idx,
        topk_weights: None,
    }];
    refused(
        reference::dispatch(&bad, E, 1, 0),
        "moelink.DtypeError",
        "xs[0] must have dtype torch.bfloat16, got torch.float32",
    );
    // Ids out of range are the core's to find.
    let e = reference::layout(&(topk(N) + E), E, r).unwrap_err();
    assert_eq!(e.python_class(), "ValueError", "{e}");
    assert!(l.num_tokens_per_rdma_rank.is_none());

    // Two nodes of two ranks: the same layout plus the tokens per node; the
    // internode combine equals the intranode one where every sum is exact
    // (small integers), and its weights are the same sums.
    let li = reference::layout_internode(&topk(N), E, r, 2).unwrap();
    assert!(li.is_token_in_rank.equal(&l.is_token_in_rank));
    let per_node = li.num_tokens_per_rdma_rank.as_ref().unwrap();
    let node_in = l.is_token_in_rank.view([N, 2, 2]).any_dim(2, false);
    assert!(per_node.equal(&node_in.sum_dim_intlist(0, false, Kind::Int)));
    let xi = reference::combine_internode(&d, &ys, Some(&rw), None, 2).unwrap();
    for (rank, ((x, w), (xo, wo))) in xi.iter().zip(&out).enumerate() {
        assert!(x.equal(xo), "rank {rank}");
        assert!(w
            .as_ref()
            .unwrap()
            .allclose(wo.as_ref().unwrap(), 1e-6, 1e-6, false));
    }
    let e = reference::combine_internode(&d, &ys, None, None, 3).unwrap_err();
    assert_eq!(e.python_class(), "ValueError", "{e}");
}

#[test]
fn reference_low_latency_on_cpu_tensors() {
    let r = R as i64;
    let n = 8;
    let xs: Vec<Tensor> = (0..r).map(|rank| tokens(rank, n)).collect();
    let idx = topk(n);
    let xr: Vec<&Tensor> = xs.iter().collect();
    let ir: Vec<&Tensor> = (0..R).map(|_| &idx).collect();
    let bf16 = reference::ll_dispatch(&xr, &ir, n, E, false, false, false).unwrap();
    let el = E / r;
    for out in &bf16 {
        assert_eq!(out.recv_x.x.size(), [el, r * n, H]);
        assert!(out.recv_x.scales.is_none());
        let total = out.recv_count.sum(Kind::Int64).int64_value(&[]);
        assert!(total > 0 && total <= r * n * el);
    }
    let fp8 = reference::ll_dispatch(&xr, &ir, n, E, true, false, false).unwrap();
    let s = fp8[0].recv_x.scales.as_ref().unwrap();
    assert_eq!(fp8[0].recv_x.x.kind(), Kind::Float8e4m3fn);
    assert_eq!(
        (s.size(), s.stride()),
        (vec![el, r * n, H / 128], vec![r * n * H / 128, 1, r * n])
    );

    // Combine what each expert received, unchanged, with weights summing to
    // 1 over the valid columns: every token comes back as itself.
    let valid = idx.ne(-1).to_kind(Kind::Float);
    let w = &valid / valid.sum_dim_intlist(-1, true, Kind::Float);
    let ys: Vec<&Tensor> = bf16.iter().map(|o| &o.recv_x.x).collect();
    let ws: Vec<&Tensor> = (0..R).map(|_| &w).collect();
    let handles: Vec<(&Tensor, &Tensor)> = bf16
        .iter()
        .map(|o| (&o.src_info, &o.layout_range))
        .collect();
    let out = reference::ll_combine(&ys, &ir, &ws, &handles, n, E).unwrap();
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.kind(), Kind::BFloat16);
        let diff = (o.to_kind(Kind::Float) - xs[rank].to_kind(Kind::Float))
            .abs()
            .max();
        assert!(diff.double_value(&[]) <= 2.0, "rank {rank}: {diff:?}"); // one bf16 ulp
    }
}

// ----- stream arguments, events, graphs ------------------------------------------------

#[test]
fn stream_arguments_are_checked_as_python_checks_them() {
    use moelink_tch::{EventOverlap, StreamArgs};
    assert!(checks::stream_args(&StreamArgs::default()).is_ok());
    let none = EventOverlap::none();
    let msg = "allocate_on_comm_stream=True needs previous_event and async_finish=True";
    // allocate_on_comm_stream without previous_event, or without async_finish.
    for s in [
        StreamArgs {
            allocate_on_comm_stream: true,
            ..StreamArgs::default()
        },
        StreamArgs {
            allocate_on_comm_stream: true,
            async_finish: true,
            ..StreamArgs::default()
        },
        StreamArgs {
            allocate_on_comm_stream: true,
            previous_event: Some(&none),
            ..StreamArgs::default()
        },
    ] {
        refused(checks::stream_args(&s), "ValueError", msg);
    }
    // EventOverlap(None) counts as a previous_event, as in Python.
    let ok = StreamArgs {
        previous_event: Some(&none),
        async_finish: true,
        allocate_on_comm_stream: true,
    };
    assert!(checks::stream_args(&ok).is_ok());
    assert!(checks::stream_args(&StreamArgs::asynchronous(None)).is_ok());
    // Low latency: async_finish and return_recv_hook exclude each other.
    assert!(checks::ll_stream_args(true, false).is_ok());
    assert!(checks::ll_stream_args(false, true).is_ok());
    refused(
        checks::ll_stream_args(true, true),
        "ValueError",
        "async_finish and return_recv_hook cannot both be True",
    );
    // The defaults are Python's.
    let idx = topk(N);
    let layout = reference::layout(&idx, E, R as i64).unwrap();
    let a = DispatchArgs::new(&layout, &idx, None);
    assert!(a.stream.previous_event.is_none());
    assert!(!a.stream.async_finish && !a.stream.allocate_on_comm_stream);
    let (d, c) = (LlDispatchOptions::default(), LlCombineOptions::default());
    assert!(!d.async_finish && !c.async_finish);
}

#[test]
fn an_empty_event_waits_for_nothing_and_cpu_devices_are_refused() {
    use moelink_tch::{CudaGraph, EventOverlap};
    let e = EventOverlap::default();
    assert!(!e.has_event() && e.device().is_none() && e.extra_tensors().is_empty());
    assert!(e.query().unwrap());
    e.current_stream_wait().unwrap();
    e.synchronize().unwrap();
    refused(
        EventOverlap::capture(Device::Cpu),
        "RuntimeError",
        "an event needs a CUDA device, got Cpu",
    );
    refused(
        Buffer::capture(Device::Cpu),
        "RuntimeError",
        "an event needs a CUDA device, got Cpu",
    );
    let mut ran = false;
    refused(
        CudaGraph::capture(Device::Cpu, || {
            ran = true;
            Ok(())
        }),
        "RuntimeError",
        "a CUDA graph needs a CUDA device, got Cpu",
    );
    assert!(!ran, "nothing is captured for a refused device");
}

// ----- the host-side expert-id check ------------------------------------------------------

#[test]
fn expert_ids_are_checked_on_the_host_with_the_python_message() {
    let idx = topk(N);
    checks::topk_values(&idx, E).unwrap();
    checks::topk_values(&cpu(Kind::Int64, &[0, K]), 0).unwrap();
    let bad = idx.copy();
    let _ = bad.get(2).get(1).fill_(E);
    let _ = bad.get(7).get(3).fill_(E + 5);
    refused(
        checks::topk_values(&bad, E),
        "ValueError",
        "topk_idx values must be in [-1, num_experts=16), got 21 at [7, 3]",
    );
    let low = idx.copy();
    let _ = low.get(5).get(0).fill_(-2);
    let _ = low.get(9).get(2).fill_(-2);
    refused(
        checks::topk_values(&low, E),
        "ValueError",
        "topk_idx values must be in [-1, num_experts=16), got -2 at [5, 0]",
    );
    // The switch (MOELINK_CHECK_IDS=1, or set at run time) returns the
    // previous setting.
    let before = moelink_tch::set_check_ids(true);
    assert!(checks::check_ids());
    assert!(moelink_tch::set_check_ids(before));
    assert_eq!(checks::check_ids(), before);
}

// ----- the AllReduce tuning file ---------------------------------------------------------

#[test]
fn the_tuning_file_is_read_as_python_reads_it() {
    use moelink_tch::allreduce::read_tune_file;
    let gpu = "NVIDIA H100 80GB HBM3";
    let dir = std::env::temp_dir().join(format!("moelink-tch-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    let _ = std::fs::remove_file(&path);
    // No file: nothing loaded, no warning.
    assert_eq!(read_tune_file(&path, gpu, 2).unwrap(), Ok(None));
    let doc = format!(
        r#"{{"format": "moelink-allreduce-tune/1", "gpu": "{gpu}", "world_size": 2,
            "entries": [{{"collective": "allreduce", "graph": true, "registered": false,
            "log2_bytes": 16, "algorithm": "oneshot_ll", "num_blocks": 4, "num_threads": 256}},
            {{"collective": "allgather", "graph": false, "registered": true,
            "log2_bytes": 20, "algorithm": "ag_mesh", "num_blocks": 8, "num_threads": 512}}],
            "measurements": []}}"#
    );
    std::fs::write(&path, &doc).unwrap();
    let entries = read_tune_file(&path, gpu, 2).unwrap().unwrap().unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(
        (
            entries[0].collective.as_str(),
            entries[0].graph,
            entries[0].log2_bytes,
            entries[0].algorithm.as_str(),
            entries[0].num_blocks,
            entries[0].num_threads
        ),
        ("allreduce", true, 16, "oneshot_ll", 4, 256)
    );
    assert!(entries[1].registered && entries[1].algorithm == "ag_mesh");
    assert!(collectives::tune_file::table_from_entries(&entries).is_ok());
    // Another job's file: ignored, with the reason.
    let why = read_tune_file(&path, gpu, 4).unwrap().unwrap_err();
    assert_eq!(
        why,
        format!(
            "{}: tuned for 2 x {gpu}, this job is 4 x {gpu}",
            path.display()
        )
    );
    std::fs::write(&path, "not json").unwrap();
    let why = read_tune_file(&path, gpu, 2).unwrap().unwrap_err();
    assert!(why.contains("invalid JSON"), "{why}");
    std::fs::remove_dir_all(&dir).unwrap();
    // The default file is Python's.
    let default = AllReduceOptions::default();
    assert_eq!(default.tune_file, moelink_tch::TuneFile::Default);
}
