//! The Rust half of the bit-for-bit comparison of moelink's tch API with its
//! Python API (`examples/tch_parity.py` is the other half and the driver):
//! every rank makes deterministic inputs, runs every call of the tch API on
//! them (layout, dispatch with top-k weights, cached fp8 dispatch, combine
//! with weights and bias, low-latency dispatch in bf16 and fp8, low-latency
//! combine, allreduce, allgather), and writes inputs and outputs to
//! `DIR/rank<r>/` as raw row-major bytes with a manifest (`manifest.txt`:
//! `name dtype shape...` per line). The Python worker runs the same calls on
//! the same inputs and compares.
//!
//! Run by the driver (`python3 examples/tch_parity.py --bin <this binary> -n N`);
//! alone: `python3 -m moelink.launch -n 2 --no-python tch_parity --out DIR`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use moelink_tch::group::env_timeout;
use moelink_tch::tch::{self, Device, Kind, Tensor};
use moelink_tch::tensor::dtype_of;
use moelink_tch::{
    local_device, AllReduce, AllReduceArgs, AllReduceOptions, Bias, Buffer, BufferOptions,
    DispatchArgs, DispatchX, Group, LlCombineOptions, LlDispatchOptions, ReduceOp,
};

/// Tokens per rank, hidden, experts per rank, top-k, allreduce elements:
/// the driver passes the same to the Python worker (`SHAPE` there).
const N: i64 = 96;
const H: i64 = 512;
const EL: i64 = 4;
const K: i64 = 4;
const AR: i64 = 12_345;

/// Tensors written to one directory, with their manifest.
struct Dump {
    dir: PathBuf,
    manifest: String,
}

impl Dump {
    fn new(dir: PathBuf) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir,
            manifest: String::new(),
        })
    }

    /// `t` (any device, any strides) as row-major bytes of its shape.
    fn put(&mut self, name: &str, t: &Tensor) -> anyhow::Result<()> {
        let t = t.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, t.numel())?;
        std::fs::write(self.dir.join(format!("{name}.bin")), &bytes)?;
        let shape: Vec<String> = t.size().iter().map(|d| d.to_string()).collect();
        writeln!(
            self.manifest,
            "{name} {} {}",
            dtype_of(t.kind()).torch_name(),
            shape.join(" ")
        )?;
        Ok(())
    }

    fn finish(self) -> anyhow::Result<()> {
        std::fs::write(self.dir.join("manifest.txt"), self.manifest)?;
        Ok(())
    }
}

/// Deterministic inputs of rank `rank` (CPU, then moved to `device`).
struct Inputs {
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    x_fp8: Tensor,
    scales: Tensor,
    bias: Tensor,
    ar_bf16: Tensor,
    ar_f32: Tensor,
}

fn inputs(rank: usize, size: usize, device: Device) -> Inputs {
    tch::manual_seed(1000 + rank as i64);
    let cpu = Device::Cpu;
    let e = EL * size as i64;
    let x = Tensor::randn([N, H], (Kind::Float, cpu)).to_kind(Kind::BFloat16);
    // Distinct experts per token (top-k of random scores), a few -1 columns.
    let scores = Tensor::rand([N, e], (Kind::Float, cpu));
    let (_, mut idx) = scores.topk(K, -1, true, true);
    let drop = Tensor::rand([N, K], (Kind::Float, cpu)).lt(0.1);
    idx = idx.masked_fill(&drop, -1);
    let w = Tensor::rand([N, K], (Kind::Float, cpu)) + 0.1;
    let x_fp8 = (Tensor::randn([N, H], (Kind::Float, cpu)) * 4.0).to_kind(Kind::Float8e4m3fn);
    let scales = Tensor::rand([N, H / 128], (Kind::Float, cpu)) + 0.5;
    let bias = Tensor::randn([N, H], (Kind::Float, cpu)).to_kind(Kind::BFloat16);
    let ar_bf16 = Tensor::randn([AR], (Kind::Float, cpu)).to_kind(Kind::BFloat16);
    let ar_f32 = Tensor::randn([AR], (Kind::Float, cpu));
    let d = |t: Tensor| t.to_device(device);
    Inputs {
        x: d(x),
        topk_idx: d(idx),
        topk_weights: d(w),
        x_fp8: d(x_fp8),
        scales: d(scales),
        bias: d(bias),
        ar_bf16: d(ar_bf16),
        ar_f32: d(ar_f32),
    }
}

fn out_dir() -> anyhow::Result<PathBuf> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, dir] if flag == "--out" => Ok(PathBuf::from(dir)),
        _ => bail!("usage: tch_parity --out DIR (under torchrun or python3 -m moelink.launch)"),
    }
}

fn run(root: &Path) -> anyhow::Result<()> {
    let group = Group::from_env(env_timeout()?).context("bootstrap")?;
    let (rank, size) = (group.rank(), group.size());
    let device = local_device()?;
    let r = size as i64;
    let e = EL * r;
    let i = inputs(rank, size, device);
    let mut inp = Dump::new(root.join(format!("rank{rank}/inputs")))?;
    for (name, t) in [
        ("x", &i.x),
        ("topk_idx", &i.topk_idx),
        ("topk_weights", &i.topk_weights),
        ("x_fp8", &i.x_fp8),
        ("scales", &i.scales),
        ("bias", &i.bias),
        ("ar_bf16", &i.ar_bf16),
        ("ar_f32", &i.ar_f32),
    ] {
        inp.put(name, t)?;
    }
    inp.finish()?;

    let opts = BufferOptions::sized_for(N, H, size, e)?;
    let mut b = Buffer::new(&group, device, &opts)?;
    let mut ar = AllReduce::new(&group, device, &AllReduceOptions::default())?;
    let mut out = Dump::new(root.join(format!("rank{rank}/rust")))?;

    // Intranode: layout, dispatch (bf16, weights), cached fp8 dispatch,
    // combine of what arrived (weights and bias).
    let layout = b.get_dispatch_layout(&i.topk_idx, e)?;
    out.put("num_tokens_per_rank", &layout.num_tokens_per_rank)?;
    out.put("num_tokens_per_expert", &layout.num_tokens_per_expert)?;
    out.put("is_token_in_rank", &layout.is_token_in_rank)?;
    let d = b.dispatch(
        DispatchX::Bf16(&i.x),
        &DispatchArgs::new(&layout, &i.topk_idx, Some(&i.topk_weights)),
    )?;
    out.put("recv_x", &d.recv_x.x)?;
    out.put("recv_topk_idx", d.recv_topk_idx.as_ref().context("idx")?)?;
    let recv_w = d.recv_topk_weights.as_ref().context("weights")?;
    out.put("recv_topk_weights", recv_w)?;
    out.put(
        "num_recv_tokens_per_expert",
        &Tensor::from_slice(&d.num_recv_tokens_per_expert),
    )?;
    out.put("rank_prefix_matrix", &d.handle.rank_prefix_matrix)?;
    out.put("recv_src_idx", &d.handle.recv_src_idx)?;
    out.put("send_head", &d.handle.send_head)?;
    let cached = b.dispatch_cached(DispatchX::Fp8(&i.x_fp8, &i.scales), &d.handle, None)?;
    out.put("cached_recv_x", &cached.x)?;
    out.put(
        "cached_recv_scales",
        cached.scales.as_ref().context("scales")?,
    )?;
    let (combined, combined_w) = b.combine(
        &d.recv_x.x,
        &d.handle,
        Some(recv_w),
        Bias::One(&i.bias),
        None,
    )?;
    out.put("combined_x", &combined)?;
    out.put("combined_topk_weights", combined_w.as_ref().context("w")?)?;

    // Low latency: bf16 then fp8 dispatch, combine of the bf16 rows.
    let bf16 = LlDispatchOptions {
        use_fp8: false,
        ..LlDispatchOptions::default()
    };
    let ll = b.low_latency_dispatch(&i.x, &i.topk_idx, N, e, &bf16)?;
    out.put("ll_recv_x", &ll.recv_x.x)?;
    out.put("ll_recv_count", &ll.recv_count)?;
    out.put("ll_src_info", &ll.handle.src_info)?;
    out.put("ll_layout_range", &ll.handle.layout_range)?;
    let (ll_out, _, _) = b.low_latency_combine(
        &ll.recv_x.x,
        &i.topk_idx,
        &i.topk_weights,
        &ll.handle,
        &LlCombineOptions::default(),
    )?;
    out.put("ll_combined_x", &ll_out)?;
    let fp8 = b.low_latency_dispatch(&i.x, &i.topk_idx, N, e, &LlDispatchOptions::default())?;
    out.put("ll8_recv_x", &fp8.recv_x.x)?;
    out.put("ll8_recv_scales", fp8.recv_x.scales.as_ref().context("s")?)?;
    out.put("ll8_recv_count", &fp8.recv_count)?;
    out.put("ll8_src_info", &fp8.handle.src_info)?;
    out.put("ll8_layout_range", &fp8.handle.layout_range)?;

    // AllReduce: bf16 sum out of place, f32 max in place, allgather.
    let sum = Tensor::empty_like(&i.ar_bf16);
    let _ = ar.all_reduce(
        &i.ar_bf16,
        ReduceOp::Sum,
        &AllReduceArgs {
            out: Some(&sum),
            ..AllReduceArgs::default()
        },
    )?;
    out.put("ar_sum_bf16", &sum)?;
    let max = i.ar_f32.copy();
    let _ = ar.all_reduce(&max, ReduceOp::Max, &AllReduceArgs::default())?;
    out.put("ar_max_f32", &max)?;
    let gathered = Tensor::empty([r * AR], (Kind::Float, device));
    let _ = ar.all_gather(&gathered, &i.ar_f32, None, None, None)?;
    out.put("ag_f32", &gathered)?;

    tch::Cuda::synchronize(device_index(device));
    b.check()?;
    ar.destroy()?;
    b.destroy()?;
    out.finish()?;
    println!("tch_parity: rank {rank}/{size} wrote {}", root.display());
    Ok(())
}

fn device_index(d: Device) -> i64 {
    match d {
        Device::Cuda(i) => i as i64,
        _ => 0,
    }
}

fn main() -> anyhow::Result<()> {
    let root = out_dir()?;
    run(&root)
}
