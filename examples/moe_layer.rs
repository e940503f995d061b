//! A mixture-of-experts layer on moelink's Rust API (crate `moelink-tch`):
//! a router picks the top-k experts of every token, dispatch sends each
//! token to the ranks holding them, every rank runs its experts' matmuls on
//! what it received, and combine brings the outputs back, weighted by the
//! router. Both paths: intranode (`dispatch` / `combine`, the expert rank
//! applies the router weights) and low-latency (`low_latency_dispatch` /
//! `low_latency_combine`, which weighs). Each rank checks its output against
//! a single-process computation of the same layer (every rank can build
//! every expert's weights: they come from one seed), then prints the time
//! per step.
//!
//! Build (here): `LIBTORCH_USE_PYTORCH=1 PATH=$PWD/.venv/bin:$PATH cargo build
//! --release -p moelink-tch --features tch --example moe_layer`. Run, ranks
//! sharing GPUs where they outnumber them:
//!
//! ```text
//! python3 -m moelink.launch -n 2 --no-python target/release/examples/moe_layer
//! torchrun --nproc-per-node=4 --no-python target/release/examples/moe_layer --tokens 256
//! ```
//!
//! Options (all `--name value`): `--tokens` per rank (128), `--hidden` (1024),
//! `--experts-per-rank` (4), `--topk` (4), `--iters` (20), `--warmup` (3),
//! `--seed` (1), `--mode` normal|ll|both (both). Exit status 0 when every
//! check passed.

use std::time::Instant;

use anyhow::{bail, Context};
use moelink_tch::group::env_timeout;
use moelink_tch::tch::{self, Device, Kind, Tensor};
use moelink_tch::{
    default_num_sms, default_ranks_per_node, local_device, Bias, Buffer, BufferOptions,
    DispatchArgs, DispatchX, Group, LlCombineOptions, LlDispatchOptions, SmsCall,
};

struct Args {
    tokens: i64,
    hidden: i64,
    experts_per_rank: i64,
    topk: i64,
    iters: usize,
    warmup: usize,
    seed: i64,
    normal: bool,
    ll: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        tokens: 128,
        hidden: 1024,
        experts_per_rank: 4,
        topk: 4,
        iters: 20,
        warmup: 3,
        seed: 1,
        normal: true,
        ll: true,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let int = || -> anyhow::Result<i64> {
            value
                .parse::<i64>()
                .with_context(|| format!("{flag}: not an integer: {value}"))
        };
        match flag.as_str() {
            "--tokens" => a.tokens = int()?,
            "--hidden" => a.hidden = int()?,
            "--experts-per-rank" => a.experts_per_rank = int()?,
            "--topk" => a.topk = int()?,
            "--iters" => a.iters = int()? as usize,
            "--warmup" => a.warmup = int()? as usize,
            "--seed" => a.seed = int()?,
            "--mode" => {
                (a.normal, a.ll) = match value.as_str() {
                    "normal" => (true, false),
                    "ll" => (false, true),
                    "both" => (true, true),
                    m => bail!("--mode must be normal, ll or both, got {m}"),
                }
            }
            f => bail!("unknown option {f} (see the header of examples/moe_layer.rs)"),
        }
    }
    Ok(a)
}

/// The layer's parameters and one rank's tokens, the same on every rank
/// (from one seed): what a single process needs to compute the layer.
struct Layer {
    /// f32 `[H, E]`.
    router: Tensor,
    /// bf16 `[E, H, H]`.
    experts: Tensor,
}

impl Layer {
    fn new(a: &Args, num_experts: i64, device: Device) -> Self {
        tch::manual_seed(a.seed);
        let h = a.hidden;
        let router = Tensor::randn([h, num_experts], (Kind::Float, Device::Cpu));
        let experts = (Tensor::randn([num_experts, h, h], (Kind::Float, Device::Cpu))
            / (h as f64).sqrt())
        .to_kind(Kind::BFloat16);
        Self {
            router: router.to_device(device),
            experts: experts.to_device(device),
        }
    }

    /// Rank `rank`'s tokens, bf16 `[N, H]`.
    fn tokens(a: &Args, rank: usize, device: Device) -> Tensor {
        tch::manual_seed(a.seed * 1000 + 1 + rank as i64);
        Tensor::randn([a.tokens, a.hidden], (Kind::Float, Device::Cpu))
            .to_kind(Kind::BFloat16)
            .to_device(device)
    }

    /// The router: (top-k expert ids int64 `[N, K]`, their softmax weights f32).
    fn route(&self, x: &Tensor, k: i64) -> (Tensor, Tensor) {
        let logits = x.to_kind(Kind::Float).matmul(&self.router);
        let (values, idx) = logits.topk(k, -1, true, true);
        (idx, values.softmax(-1, Kind::Float))
    }

    /// The layer on one process: `sum_k w_k * (x @ W_{e_k})` (f32 of the bf16
    /// matmuls), as f32 `[N, H]`.
    fn reference(&self, x: &Tensor, idx: &Tensor, w: &Tensor) -> Tensor {
        let mut out = Tensor::zeros(x.size(), (Kind::Float, x.device()));
        for e in 0..self.experts.size()[0] {
            let coef = (w * idx.eq(e).to_kind(Kind::Float)).sum_dim_intlist(-1, false, Kind::Float);
            let y = x.matmul(&self.experts.get(e)).to_kind(Kind::Float);
            out += coef.unsqueeze(1) * y;
        }
        out
    }
}

/// (largest |a - b| / largest |b|, DeepEP's `calc_diff`: 1 - cosine-like
/// similarity) of two f32 tensors.
fn diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let scale = b.abs().max().double_value(&[]).max(1e-12);
    let max_err = (&a - &b).abs().max().double_value(&[]) / scale;
    let denom = (&a * &a + &b * &b).sum(Kind::Double).double_value(&[]);
    let sim = 2.0 * (&a * &b).sum(Kind::Double).double_value(&[]) / denom.max(1e-30);
    (max_err, 1.0 - sim)
}

/// Passes where the output is within bf16 rounding of the single-process
/// layer (expert outputs and partial sums are stored as bf16 on the way).
fn check(name: &str, rank: usize, out: &Tensor, reference: &Tensor) -> bool {
    let (max_err, calc_diff) = diff(&out.to_kind(Kind::Float), reference);
    let finite = out.isnan().any().int64_value(&[]) == 0;
    let ok = finite && max_err < 0.05 && calc_diff < 5e-4;
    println!(
        "{} {name} (rank {rank}): max |out - ref| / max |ref| = {max_err:.2e}, calc_diff = \
         {calc_diff:.2e}",
        if ok { "PASS" } else { "FAIL" }
    );
    ok
}

/// Seconds per call of `step`, after `warmup` calls, the device synchronised.
fn time_steps(
    a: &Args,
    dev: i64,
    mut step: impl FnMut() -> anyhow::Result<Tensor>,
) -> anyhow::Result<f64> {
    for _ in 0..a.warmup {
        let _ = step()?;
    }
    tch::Cuda::synchronize(dev);
    let t = Instant::now();
    for _ in 0..a.iters {
        let _ = step()?;
    }
    tch::Cuda::synchronize(dev);
    Ok(t.elapsed().as_secs_f64() / a.iters.max(1) as f64)
}

fn main() -> anyhow::Result<()> {
    let a = parse_args()?;
    let group = Group::from_env(env_timeout()?).context("bootstrap (torchrun's environment)")?;
    let (rank, size) = (group.rank(), group.size());
    let device = local_device()?;
    let Device::Cuda(dev) = device else {
        unreachable!("local_device is a CUDA device")
    };
    let (n, h, k) = (a.tokens, a.hidden, a.topk);
    let num_experts = a.experts_per_rank * size as i64;
    let layer = Layer::new(&a, num_experts, device);
    let x = Layer::tokens(&a, rank, device);
    let (idx, w) = layer.route(&x, k);
    let reference = layer.reference(&x, &idx, &w);
    let el = a.experts_per_rank;
    let local = layer.experts.narrow(0, rank as i64 * el, el); // [E_local, H, H]

    let opts = BufferOptions {
        num_nvl_bytes: if a.normal {
            Buffer::nvl_buffer_size_hint(2 * h as usize, size, n as usize)?
        } else {
            0
        },
        // Low latency, and normal mode across nodes (emulated ones too), size
        // the same RDMA buffer: the larger of the two needs.
        num_rdma_bytes: {
            let ll = if a.ll {
                Buffer::get_low_latency_rdma_size_hint(n, h, size as i64, num_experts)?
            } else {
                0
            };
            let internode = if a.normal {
                Buffer::rdma_buffer_size_hint(
                    2 * h as usize,
                    size,
                    n as usize,
                    default_ranks_per_node()?,
                )?
            } else {
                0
            };
            ll.max(internode)
        },
        low_latency_mode: a.ll,
        ..BufferOptions::default()
    };
    let mut buffer = Buffer::new(&group, device, &opts)?;
    let mut ok = true;
    let mut report = Vec::new();

    if a.normal {
        // Intranode: the expert rank weighs each row by the router weights it
        // received (0 for experts elsewhere); combine adds the ranks' rows.
        let step = |buffer: &mut Buffer| -> anyhow::Result<Tensor> {
            let layout = buffer.get_dispatch_layout(&idx, num_experts)?;
            let d = buffer.dispatch(
                DispatchX::Bf16(&x),
                &DispatchArgs::new(&layout, &idx, Some(&w)),
            )?;
            let recv_x = &d.recv_x.x;
            let recv_idx = d.recv_topk_idx.as_ref().context("recv_topk_idx")?;
            let recv_w = d.recv_topk_weights.as_ref().context("recv_topk_weights")?;
            let mut y = Tensor::zeros(recv_x.size(), (Kind::Float, device));
            for j in 0..el {
                let coef = (recv_w * recv_idx.eq(j).to_kind(Kind::Float)).sum_dim_intlist(
                    -1,
                    false,
                    Kind::Float,
                );
                y += coef.unsqueeze(1) * recv_x.matmul(&local.get(j)).to_kind(Kind::Float);
            }
            let (out, _) = buffer.combine(
                &y.to_kind(Kind::BFloat16),
                &d.handle,
                None,
                Bias::None,
                None,
            )?;
            Ok(out)
        };
        let out = step(&mut buffer)?;
        ok &= check("normal", rank, &out, &reference);
        // No call named its SMs: both took the default for the rank count
        // (capped where ranks share a GPU).
        let want = (
            default_num_sms(SmsCall::Dispatch, size),
            default_num_sms(SmsCall::Combine, size),
        );
        let used = buffer.num_sms_used();
        let fits = |u: Option<u32>, w: u32| u.is_some_and(|u| u > 0 && u <= w);
        if !(fits(used.0, want.0) && fits(used.1, want.1)) {
            eprintln!("rank {rank}: SMs used {used:?}, defaults {want:?}");
            ok = false;
        }
        let s = time_steps(&a, dev as i64, || step(&mut buffer))?;
        report.push(format!("normal {:.1} us/step", s * 1e6));
    }
    if a.ll {
        // Low latency: bf16 dispatch, one batched matmul over the local
        // experts' slabs, combine weighs by the router weights.
        let step = |buffer: &mut Buffer| -> anyhow::Result<Tensor> {
            let o = LlDispatchOptions {
                use_fp8: false,
                ..LlDispatchOptions::default()
            };
            let d = buffer.low_latency_dispatch(&x, &idx, n, num_experts, &o)?;
            let y = d.recv_x.x.bmm(&local); // [E_local, R*T, H]
            let (out, _, _) = buffer.low_latency_combine(
                &y,
                &idx,
                &w,
                &d.handle,
                &LlCombineOptions::default(),
            )?;
            Ok(out)
        };
        let out = step(&mut buffer)?;
        ok &= check("low_latency", rank, &out, &reference);
        let s = time_steps(&a, dev as i64, || step(&mut buffer))?;
        report.push(format!("low_latency {:.1} us/step", s * 1e6));
    }
    buffer.destroy()?;
    println!(
        "rank {rank}/{size}: {n} tokens x {h} hidden, {num_experts} experts, top-{k}: {}",
        report.join(", ")
    );
    if !ok {
        bail!("rank {rank}: the layer's output differs from the single-process layer");
    }
    Ok(())
}
