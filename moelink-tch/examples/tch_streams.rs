//! GPU checks of the tch API's stream arguments, events, CUDA graphs,
//! AllReduce tuning file and host-side expert-id check, every
//! output compared exactly with the CPU reference (`moelink_tch::reference`,
//! `ep-reference`'s oracle) on fresh random data per round, outputs poisoned first
//! (graph outputs and `out=` tensors filled with NaN / -1 before each call;
//! for outputs a call allocates, blocks of their sizes are filled with 0xff
//! and freed first on the stream it allocates on, so a call that wrote
//! nothing reads back garbage, not an earlier round's result):
//!
//! - `async`: layout, dispatch, combine with `previous_event`, `async_finish`
//!   (and `allocate_on_comm_stream` every other round), the caller waiting
//!   on the returned events; a cached dispatch with `async_finish` alone.
//! - `ll_async`: low-latency dispatch and combine (`out=`) with `async_finish`.
//! - `graph`: a cached dispatch, an "expert" (`y = 2 x`) and a combine
//!   captured in one CUDA graph (`CudaGraph::capture`, torch's graph) and
//!   replayed with fresh tokens each time.
//! - `ll_graph`: low-latency dispatch, expert, combine in one graph, replayed.
//! - `tune`: an AllReduce loading a tuning file (written by rank 0) that pins
//!   different algorithms for eager calls and CUDA-graph capture; the
//!   choices and results checked, a graph replayed; a file of another world
//!   size ignored.
//! - `check_ids`: with the host-side id check on, an expert id out of range
//!   is refused by layout and low-latency dispatch with Python's message.
//!
//! With `MOELINK_RANKS_PER_NODE` splitting the ranks into emulated nodes the
//! Buffer takes the internode path: dispatch is checked against the same
//! reference, layout's per-node counts against `reference::layout_internode`
//! and combine against the internode model (`reference::combine_internode`).
//!
//! Every rank can compute every rank's inputs (one seed per round and rank).
//! Prints `PASS name (rank r)` / `FAIL name (rank r): why` per check and
//! `tch_streams: rank r/R: P passed, F failed`; exits non-zero on a failure.
//! Run: `python3 -m moelink.launch -n 2 --no-python .gpu/tch/tch_streams`.

use anyhow::{bail, Context};
use moelink_tch::group::env_timeout;
use moelink_tch::reference::{self, RankTokens};
use moelink_tch::stream::StreamGuard;
use moelink_tch::tch::{self, Device, Kind, Tensor};
use moelink_tch::{
    local_device, AllReduce, AllReduceArgs, AllReduceOptions, Bias, Buffer, BufferOptions,
    CudaGraph, DispatchArgs, DispatchX, Error, Group, LlCombineOptions, LlDispatchOptions,
    ReduceOp, StreamArgs, TuneFile,
};

/// Tokens per rank, hidden, experts per rank, top-k.
const N: i64 = 64;
const H: i64 = 512;
const EL: i64 = 4;
const K: i64 = 4;
/// Rounds of the eager checks, replays of each graph.
const ROUNDS: i64 = 4;
const REPLAYS: i64 = 6;
/// Allreduce elements (f32: 64 KiB, one tuned bucket).
const AR: i64 = 16_384;

/// One rank's tokens (CPU): bf16 x, distinct top-k experts (about 10% -1),
/// positive weights.
struct Tokens {
    x: Tensor,
    idx: Tensor,
    w: Tensor,
}

impl Tokens {
    /// `(x, idx, w)` copied to `device`.
    fn to_device(&self, device: Device) -> (Tensor, Tensor, Tensor) {
        (
            self.x.to_device(device),
            self.idx.to_device(device),
            self.w.to_device(device),
        )
    }
}

fn tokens(seed: i64, rank: usize, size: usize) -> Tokens {
    tch::manual_seed(seed * 1000 + rank as i64);
    let cpu = Device::Cpu;
    let e = EL * size as i64;
    let x = Tensor::randn([N, H], (Kind::Float, cpu)).to_kind(Kind::BFloat16);
    let (_, idx) = Tensor::rand([N, e], (Kind::Float, cpu)).topk(K, -1, true, true);
    let drop = Tensor::rand([N, K], (Kind::Float, cpu)).lt(0.1);
    let idx = idx.masked_fill(&drop, -1);
    let w = Tensor::rand([N, K], (Kind::Float, cpu)) + 0.1;
    Tokens { x, idx, w }
}

/// Every rank's tokens of round `seed`.
fn all_tokens(seed: i64, size: usize) -> Vec<Tokens> {
    (0..size).map(|r| tokens(seed, r, size)).collect()
}

/// Every rank's tokens of round `seed` with the routing of `routing`.
fn fresh_x(seed: i64, routing: &[Tokens]) -> Vec<Tokens> {
    routing
        .iter()
        .enumerate()
        .map(|(r, t)| {
            tch::manual_seed(seed * 1000 + 500 + r as i64);
            Tokens {
                x: Tensor::randn([N, H], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
                idx: t.idx.shallow_clone(),
                w: t.w.shallow_clone(),
            }
        })
        .collect()
}

struct Checker {
    rank: usize,
    passed: usize,
    failed: usize,
}

impl Checker {
    fn ok(&mut self, name: &str, ok: bool, why: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
            println!("PASS {name} (rank {})", self.rank);
        } else {
            self.failed += 1;
            println!("FAIL {name} (rank {}): {}", self.rank, why());
        }
    }

    /// `got` (any device) equals `want` exactly: shape, dtype, values (a
    /// NaN, i.e. a poisoned element left unwritten, never equals).
    fn equal(&mut self, name: &str, got: &Tensor, want: &Tensor) {
        let got = got.to_device(Device::Cpu);
        let want = want.to_device(Device::Cpu);
        let same = got.size() == want.size() && got.kind() == want.kind() && got.equal(&want);
        self.ok(name, same, || {
            if got.size() != want.size() || got.kind() != want.kind() {
                return format!(
                    "{:?} {:?} vs {:?} {:?}",
                    got.kind(),
                    got.size(),
                    want.kind(),
                    want.size()
                );
            }
            let (g, w) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
            let bad = g.ne_tensor(&w).logical_or(&g.isnan());
            let n = bad.sum(Kind::Int64).int64_value(&[]);
            let at: Vec<i64> = Vec::try_from(&bad.nonzero().get(0)).unwrap_or_default();
            format!("{n} elements differ, first at {at:?}")
        });
    }

    fn vec_equal(&mut self, name: &str, got: &[i64], want: &[i64]) {
        self.ok(name, got == want, || format!("{got:?} vs {want:?}"));
    }
}

/// Fills `t` with a value no call writes (NaN for floats, -7777 for ints).
fn poison(t: &Tensor) {
    let mut t = t.shallow_clone();
    match t.kind() {
        Kind::BFloat16 | Kind::Float | Kind::Half | Kind::Double => {
            let _ = t.fill_(f64::NAN);
        }
        Kind::Bool => {
            let _ = t.fill_(1);
        }
        _ => {
            let _ = t.fill_(-7777);
        }
    }
}

/// Blocks of `bytes` each filled with 0xff and freed, on the current
/// stream, so that the next allocations of these sizes there get garbage,
/// not an earlier round's output.
fn poison_pool(device: Device, bytes: &[i64]) {
    let blocks: Vec<Tensor> = bytes
        .iter()
        .map(|&b| Tensor::full([b.max(1)], 255, (Kind::Uint8, device)))
        .collect();
    drop(blocks);
}

/// [`poison_pool`] on the Buffer's communication stream (torch's current
/// stream meanwhile), or on the current stream.
fn poison_outputs(buffer: &Buffer, on_comm: bool, bytes: &[i64]) -> anyhow::Result<()> {
    let dev = match buffer.device() {
        Device::Cuda(i) => i as i32,
        _ => bail!("not a CUDA buffer"),
    };
    let _guard = if on_comm {
        Some(StreamGuard::new(buffer.comm_stream(), dev)?)
    } else {
        None
    };
    poison_pool(buffer.device(), bytes);
    Ok(())
}

fn bf16(t: &Tensor) -> Tensor {
    t.to_kind(Kind::BFloat16)
}

/// Each rank's reference combine: (combined_x f32, combined weights).
type Combined = Vec<(Tensor, Option<Tensor>)>;

/// The reference combine of the path the Buffer takes: the intranode model,
/// or across nodes of `per_node` ranks the internode one.
fn reference_combine(
    d: &reference::RefDispatched,
    ys: &[&Tensor],
    ws: Option<&[&Tensor]>,
    per_node: Option<usize>,
) -> anyhow::Result<Combined> {
    Ok(match per_node {
        None => reference::combine(d, ys, ws, None)?,
        Some(l) => reference::combine_internode(d, ys, ws, None, l)?,
    })
}

/// The reference dispatch of `ins` (bf16, weights), and each rank's combine
/// of `2 * recv_x` with the received weights (nodes of `per_node` ranks, or
/// one node): (dispatch, combined per rank).
fn reference_round(
    ins: &[Tokens],
    e: i64,
    per_node: Option<usize>,
) -> anyhow::Result<(reference::RefDispatched, Combined)> {
    let rt: Vec<RankTokens<'_>> = ins
        .iter()
        .map(|t| RankTokens {
            x: DispatchX::Bf16(&t.x),
            topk_idx: &t.idx,
            topk_weights: Some(&t.w),
        })
        .collect();
    let d = reference::dispatch(&rt, e, 1, 0)?;
    let ys: Vec<Tensor> = d.ranks.iter().map(|r| bf16(&(&r.recv_x.x * 2))).collect();
    let yr: Vec<&Tensor> = ys.iter().collect();
    let ws: Vec<&Tensor> = d
        .ranks
        .iter()
        .map(|r| r.recv_topk_weights.as_ref().expect("weights"))
        .collect();
    let c = reference_combine(&d, &yr, Some(&ws), per_node)?;
    Ok((d, c))
}

fn bytes_of(shape: &[i64], elt: i64) -> i64 {
    shape.iter().product::<i64>() * elt
}

// ----- intranode with events ----------------------------------------------------------

fn check_async(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device, r) = (b.rank(), b.device(), size as i64);
    let e = EL * r;
    let per_node = b.nodes().map(|(_, l)| l);
    for round in 0..ROUNDS {
        let tag = format!("async round {round}");
        let ins = all_tokens(10 + round, size);
        let (want, want_c) = reference_round(&ins, e, per_node)?;
        let me = &want.ranks[rank];
        let rows = me.recv_x.x.size()[0];
        let on_comm = round % 2 == 0;
        // Made on the current stream: the calls must wait for them through
        // previous_event (the communication stream does not wait for the
        // current stream when an event is given).
        let (x, idx, w) = ins[rank].to_device(device);
        let ev0 = Buffer::capture(device)?;
        poison_outputs(
            b,
            on_comm,
            &[
                4 * r,
                4 * e,
                N * r,
                bytes_of(&[rows, H], 2),
                bytes_of(&[rows, K], 8),
            ],
        )?;
        let s = StreamArgs {
            previous_event: Some(&ev0),
            async_finish: true,
            allocate_on_comm_stream: on_comm,
        };
        let (layout, ev1) = b.get_dispatch_layout_with(&idx, e, &s)?;
        chk.ok(&format!("{tag} layout event"), ev1.has_event(), || {
            "async_finish returned no event".into()
        });
        let d = b.dispatch(
            DispatchX::Bf16(&x),
            &DispatchArgs {
                stream: StreamArgs {
                    previous_event: Some(&ev1),
                    ..s
                },
                ..DispatchArgs::new(&layout, &idx, Some(&w))
            },
        )?;
        d.event.current_stream_wait()?;
        let wl = match per_node {
            None => reference::layout(&ins[rank].idx, e, r)?,
            Some(l) => reference::layout_internode(&ins[rank].idx, e, r, l)?,
        };
        match (
            &layout.num_tokens_per_rdma_rank,
            &wl.num_tokens_per_rdma_rank,
        ) {
            (Some(got), Some(want)) => {
                chk.equal(&format!("{tag} num_tokens_per_rdma_rank"), got, want)
            }
            (got, want) => chk.ok(
                &format!("{tag} num_tokens_per_rdma_rank"),
                got.is_none() && want.is_none(),
                || format!("{got:?} vs {want:?}"),
            ),
        }
        chk.equal(
            &format!("{tag} num_tokens_per_rank"),
            &layout.num_tokens_per_rank,
            &wl.num_tokens_per_rank,
        );
        chk.equal(
            &format!("{tag} num_tokens_per_expert"),
            &layout.num_tokens_per_expert,
            &wl.num_tokens_per_expert,
        );
        chk.equal(
            &format!("{tag} is_token_in_rank"),
            &layout.is_token_in_rank,
            &wl.is_token_in_rank,
        );
        chk.equal(&format!("{tag} recv_x"), &d.recv_x.x, &me.recv_x.x);
        let recv_w = d.recv_topk_weights.as_ref().context("recv_topk_weights")?;
        chk.equal(
            &format!("{tag} recv_topk_idx"),
            d.recv_topk_idx.as_ref().context("recv_topk_idx")?,
            &me.recv_topk_idx,
        );
        chk.equal(
            &format!("{tag} recv_topk_weights"),
            recv_w,
            me.recv_topk_weights.as_ref().context("w")?,
        );
        chk.equal(
            &format!("{tag} recv_src_idx"),
            &d.handle.recv_src_idx,
            &me.recv_src_idx,
        );
        chk.vec_equal(
            &format!("{tag} num_recv_tokens_per_expert"),
            &d.num_recv_tokens_per_expert,
            &me.num_recv_tokens_per_expert,
        );
        // The expert, on the current stream (which waited for dispatch).
        let y = &d.recv_x.x * 2;
        let ev2 = Buffer::capture(device)?;
        poison_outputs(b, on_comm, &[bytes_of(&[N, H], 2), bytes_of(&[N, K], 4)])?;
        let (out, out_w, ev3) = b.combine_with(
            &y,
            &d.handle,
            Some(recv_w),
            Bias::None,
            None,
            &StreamArgs {
                previous_event: Some(&ev2),
                ..s
            },
        )?;
        ev3.current_stream_wait()?;
        chk.equal(&format!("{tag} combined_x"), &out, &bf16(&want_c[rank].0));
        chk.equal(
            &format!("{tag} combined_topk_weights"),
            out_w.as_ref().context("combined weights")?,
            want_c[rank].1.as_ref().context("w")?,
        );
        // A cached dispatch of fresh tokens, async_finish alone (the
        // communication stream waits for the current one).
        let fresh = fresh_x(50 + round, &ins);
        let (want2, _) = reference_round(&fresh, e, per_node)?;
        let x2 = fresh[rank].x.to_device(device);
        poison_outputs(b, false, &[bytes_of(&[rows, H], 2)])?;
        let (rx, ev4) = b.dispatch_cached_with(
            DispatchX::Bf16(&x2),
            &d.handle,
            None,
            &StreamArgs::asynchronous(None),
        )?;
        chk.ok(
            &format!("{tag} cached event keeps tensors"),
            ev4.extra_tensors().len() >= 3,
            || format!("{} tensors kept", ev4.extra_tensors().len()),
        );
        ev4.current_stream_wait()?;
        chk.equal(
            &format!("{tag} cached recv_x"),
            &rx.x,
            &want2.ranks[rank].recv_x.x,
        );
    }
    Ok(())
}

// ----- low latency with events ----------------------------------------------------------

/// Each (local expert, source) block of a low-latency receive, in source
/// order: (rows, src_info) of `recv_x` `[E_local, R*T, H]` by `layout_range`.
fn ll_blocks(recv_x: &Tensor, src_info: &Tensor, layout_range: &Tensor) -> (Tensor, Tensor) {
    let (recv_x, src_info) = (
        recv_x.to_device(Device::Cpu),
        src_info.to_device(Device::Cpu),
    );
    let lr = layout_range.to_device(Device::Cpu);
    let (el, r) = (lr.size()[0], lr.size()[1]);
    let (mut xs, mut ss) = (Vec::new(), Vec::new());
    for j in 0..el {
        for s in 0..r {
            let v = lr.int64_value(&[j, s]);
            let (begin, n) = (v >> 32, v & 0xffff_ffff);
            xs.push(recv_x.get(j).narrow(0, begin, n));
            ss.push(src_info.get(j).narrow(0, begin, n));
        }
    }
    (Tensor::cat(&xs, 0), Tensor::cat(&ss, 0))
}

/// The reference low-latency dispatch (bf16) of `ins` and every rank's
/// combine of `2 * recv_x`.
fn reference_ll(
    ins: &[Tokens],
    e: i64,
) -> anyhow::Result<(Vec<reference::LlReceived>, Vec<Tensor>)> {
    let xs: Vec<&Tensor> = ins.iter().map(|t| &t.x).collect();
    let is: Vec<&Tensor> = ins.iter().map(|t| &t.idx).collect();
    let ws: Vec<&Tensor> = ins.iter().map(|t| &t.w).collect();
    let d = reference::ll_dispatch(&xs, &is, N, e, false, false, false)?;
    let ys: Vec<Tensor> = d.iter().map(|o| bf16(&(&o.recv_x.x * 2))).collect();
    let yr: Vec<&Tensor> = ys.iter().collect();
    let hs: Vec<(&Tensor, &Tensor)> = d.iter().map(|o| (&o.src_info, &o.layout_range)).collect();
    let c = reference::ll_combine(&yr, &is, &ws, &hs, N, e)?;
    Ok((d, c))
}

fn check_ll_async(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device) = (b.rank(), b.device());
    let e = EL * size as i64;
    for round in 0..ROUNDS {
        let tag = format!("ll_async round {round}");
        let ins = all_tokens(100 + round, size);
        let (want, want_c) = reference_ll(&ins, e)?;
        let (x, idx, w) = ins[rank].to_device(device);
        let o = LlDispatchOptions {
            use_fp8: false,
            async_finish: true,
            ..LlDispatchOptions::default()
        };
        let d = b.low_latency_dispatch(&x, &idx, N, e, &o)?;
        chk.ok(
            &format!("{tag} dispatch event"),
            d.event.has_event(),
            || "no event".into(),
        );
        d.event.current_stream_wait()?;
        let me = &want[rank];
        chk.equal(&format!("{tag} recv_count"), &d.recv_count, &me.recv_count);
        let (gx, gs) = ll_blocks(&d.recv_x.x, &d.handle.src_info, &d.handle.layout_range);
        let (wx, ws) = ll_blocks(&me.recv_x.x, &me.src_info, &me.layout_range);
        chk.equal(&format!("{tag} recv_x (source order)"), &gx, &wx);
        chk.equal(&format!("{tag} src_info (source order)"), &gs, &ws);
        let y = &d.recv_x.x * 2;
        let out = Tensor::empty([N, H], (Kind::BFloat16, device));
        poison(&out);
        let c = LlCombineOptions {
            out: Some(&out),
            async_finish: true,
            ..LlCombineOptions::default()
        };
        let (combined, ev, _) = b.low_latency_combine(&y, &idx, &w, &d.handle, &c)?;
        ev.current_stream_wait()?;
        chk.ok(
            &format!("{tag} combine wrote out="),
            combined.data_ptr() == out.data_ptr(),
            || "a new tensor".into(),
        );
        chk.equal(&format!("{tag} combined_x"), &out, &want_c[rank]);
    }
    Ok(())
}

/// A refusal of the hook rules: a `RuntimeError`-class error whose message
/// holds `want`.
fn refused_with(r: moelink_tch::Result<()>, want: &str) -> (bool, String) {
    match r {
        Err(e) => (
            e.python_class() == "RuntimeError" && e.to_string().contains(want),
            e.to_string(),
        ),
        Ok(()) => (false, "accepted".to_string()),
    }
}

/// Receive hooks in SGLang's two-batch order (Python's rules: two calls in
/// flight, hooks in call order, each once): batch A's dispatch and its hook,
/// A's combine send, batch B's dispatch send with A's combine hook pending;
/// a third call, B's hook before A's and a hook run twice are refused; then
/// every output is checked against the reference.
fn check_ll_hooks(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device) = (b.rank(), b.device());
    let e = EL * size as i64;
    let (ins_a, ins_b) = (all_tokens(800, size), all_tokens(801, size));
    let ((want_a, want_ca), (want_b, want_cb)) =
        (reference_ll(&ins_a, e)?, reference_ll(&ins_b, e)?);
    let (xa, idx_a, wa) = ins_a[rank].to_device(device);
    let (xb, idx_b, wb) = ins_b[rank].to_device(device);
    let o = LlDispatchOptions {
        use_fp8: false,
        return_recv_hook: true,
        ..LlDispatchOptions::default()
    };
    let c = LlCombineOptions {
        return_recv_hook: true,
        ..LlCombineOptions::default()
    };
    let mut da = b.low_latency_dispatch(&xa, &idx_a, N, e, &o)?;
    let mut hook = da.hook.take().context("dispatch A returned no hook")?;
    b.run_recv_hook(&mut hook)?;
    let (ok, got) = refused_with(b.run_recv_hook(&mut hook), "already called");
    chk.ok("ll_hooks a hook runs once", ok, || got);
    let ya = &da.recv_x.x * 2;
    let (ca, _, hook_ca) = b.low_latency_combine(&ya, &idx_a, &wa, &da.handle, &c)?;
    let mut hook_ca = hook_ca.context("combine A returned no hook")?;
    let mut db = b.low_latency_dispatch(&xb, &idx_b, N, e, &o)?;
    let mut hook_db = db.hook.take().context("dispatch B returned no hook")?;
    let third = b.low_latency_dispatch(&xb, &idx_b, N, e, &o).map(|_| ());
    let (ok, got) = refused_with(third, "have not run");
    chk.ok("ll_hooks a third call in flight is refused", ok, || got);
    let (ok, got) = refused_with(b.run_recv_hook(&mut hook_db), "run in call order");
    chk.ok("ll_hooks hooks run in call order", ok, || got);
    b.run_recv_hook(&mut hook_ca)?;
    b.run_recv_hook(&mut hook_db)?;
    let yb = &db.recv_x.x * 2;
    let (cb, _, hook_cb) = b.low_latency_combine(&yb, &idx_b, &wb, &db.handle, &c)?;
    b.run_recv_hook(&mut hook_cb.context("combine B returned no hook")?)?;
    for (tag, d, want, combined, want_c) in [
        ("A", &da, &want_a[rank], &ca, &want_ca[rank]),
        ("B", &db, &want_b[rank], &cb, &want_cb[rank]),
    ] {
        chk.equal(
            &format!("ll_hooks {tag} recv_count"),
            &d.recv_count,
            &want.recv_count,
        );
        let (gx, gs) = ll_blocks(&d.recv_x.x, &d.handle.src_info, &d.handle.layout_range);
        let (wx, ws) = ll_blocks(&want.recv_x.x, &want.src_info, &want.layout_range);
        chk.equal(&format!("ll_hooks {tag} recv_x (source order)"), &gx, &wx);
        chk.equal(&format!("ll_hooks {tag} src_info (source order)"), &gs, &ws);
        chk.equal(&format!("ll_hooks {tag} combined_x"), combined, want_c);
    }
    Ok(())
}

// ----- CUDA graphs -------------------------------------------------------------------------

/// Copies `x` into the captured input `input`, poisons the captured outputs
/// `outs`, replays `graph` and waits for it.
fn replay(graph: &CudaGraph, input: &Tensor, x: &Tensor, outs: &[&Tensor]) -> anyhow::Result<()> {
    let device = input.device();
    input.shallow_clone().copy_(&x.to_device(device));
    for t in outs {
        poison(t);
    }
    graph.replay()?;
    tch::Cuda::synchronize(index(device));
    Ok(())
}

fn check_graph(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device) = (b.rank(), b.device());
    let e = EL * size as i64;
    let per_node = b.nodes().map(|(_, l)| l);
    let routing = all_tokens(300, size);
    let (x_s, idx, w) = routing[rank].to_device(device);
    // The handle, from an eager dispatch; a warm-up of the captured calls.
    let layout = b.get_dispatch_layout(&idx, e)?;
    let d = b.dispatch(
        DispatchX::Bf16(&x_s),
        &DispatchArgs::new(&layout, &idx, Some(&w)),
    )?;
    let warm = b.dispatch_cached(DispatchX::Bf16(&x_s), &d.handle, None)?;
    let _ = b.combine(&(&warm.x * 2), &d.handle, None, Bias::None, None)?;
    let (graph, (recv_x, y, combined)) = CudaGraph::capture(device, || {
        let rx = b.dispatch_cached(DispatchX::Bf16(&x_s), &d.handle, None)?;
        let y = &rx.x * 2;
        let (c, _) = b.combine(&y, &d.handle, None, Bias::None, None)?;
        Ok((rx.x, y, c))
    })?;
    for i in 0..REPLAYS {
        let fresh = fresh_x(400 + i, &routing);
        let (want, _) = reference_round(&fresh, e, per_node)?;
        // Combine without weights: the plain sum of 2 * the copies.
        let ys: Vec<Tensor> = want
            .ranks
            .iter()
            .map(|r| bf16(&(&r.recv_x.x * 2)))
            .collect();
        let yr: Vec<&Tensor> = ys.iter().collect();
        let want_c = reference_combine(&want, &yr, None, per_node)?;
        replay(&graph, &x_s, &fresh[rank].x, &[&recv_x, &y, &combined])?;
        chk.equal(
            &format!("graph replay {i} recv_x"),
            &recv_x,
            &want.ranks[rank].recv_x.x,
        );
        chk.equal(
            &format!("graph replay {i} combined_x"),
            &combined,
            &bf16(&want_c[rank].0),
        );
    }
    drop(graph);
    b.check()?;
    Ok(())
}

fn check_ll_graph(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device) = (b.rank(), b.device());
    let e = EL * size as i64;
    let routing = all_tokens(500, size);
    let (x_s, idx, w) = routing[rank].to_device(device);
    let o = LlDispatchOptions {
        use_fp8: false,
        ..LlDispatchOptions::default()
    };
    // Warm-up outside the capture.
    let d = b.low_latency_dispatch(&x_s, &idx, N, e, &o)?;
    let _ = b.low_latency_combine(
        &(&d.recv_x.x * 2),
        &idx,
        &w,
        &d.handle,
        &LlCombineOptions::default(),
    )?;
    drop(d);
    let (graph, (recv_count, recv_x, src_info, layout_range, combined)) =
        CudaGraph::capture(device, || {
            let d = b.low_latency_dispatch(&x_s, &idx, N, e, &o)?;
            let y = &d.recv_x.x * 2;
            let (c, _, _) =
                b.low_latency_combine(&y, &idx, &w, &d.handle, &LlCombineOptions::default())?;
            Ok((
                d.recv_count,
                d.recv_x.x,
                d.handle.src_info,
                d.handle.layout_range,
                c,
            ))
        })?;
    for i in 0..REPLAYS {
        let fresh = fresh_x(600 + i, &routing);
        let (want, want_c) = reference_ll(&fresh, e)?;
        replay(
            &graph,
            &x_s,
            &fresh[rank].x,
            &[&recv_count, &recv_x, &combined],
        )?;
        let me = &want[rank];
        chk.equal(
            &format!("ll_graph replay {i} recv_count"),
            &recv_count,
            &me.recv_count,
        );
        let (gx, _) = ll_blocks(&recv_x, &src_info, &layout_range);
        let (wx, _) = ll_blocks(&me.recv_x.x, &me.src_info, &me.layout_range);
        chk.equal(
            &format!("ll_graph replay {i} recv_x (source order)"),
            &gx,
            &wx,
        );
        chk.equal(
            &format!("ll_graph replay {i} combined_x"),
            &combined,
            &want_c[rank],
        );
    }
    drop(graph);
    b.check()?;
    Ok(())
}

// ----- AllReduce tuning file ----------------------------------------------------------------

fn tune_doc(gpu: &str, world: usize) -> String {
    // 64 KiB: bucket 16. Eager: twoshot_ll 4 x 256; in a graph: oneshot_ll 2 x 128.
    format!(
        r#"{{"format": "moelink-allreduce-tune/1", "gpu": "{gpu}", "world_size": {world},
 "entries": [
  {{"collective": "allreduce", "graph": false, "registered": false, "log2_bytes": 16,
    "algorithm": "twoshot_ll", "num_blocks": 4, "num_threads": 256}},
  {{"collective": "allreduce", "graph": true, "registered": false, "log2_bytes": 16,
    "algorithm": "oneshot_ll", "num_blocks": 2, "num_threads": 128}}]}}
"#
    )
}

/// Small integers (exact f32 sums in any order) of rank `rank`, round `seed`.
fn ar_data(seed: i64, rank: usize) -> Tensor {
    tch::manual_seed(seed * 1000 + rank as i64);
    Tensor::randint_low(-64, 64, [AR], (Kind::Float, Device::Cpu))
}

fn ar_sum(seed: i64, size: usize) -> Tensor {
    (0..size)
        .map(|r| ar_data(seed, r))
        .reduce(|a, b| a + b)
        .expect("ranks")
}

fn choice(ar: &AllReduce) -> (String, u32, u32) {
    ar.last_choice().map_or((String::new(), 0, 0), |c| {
        (c.algorithm.name().to_string(), c.num_blocks, c.num_threads)
    })
}

fn check_tune(chk: &mut Checker, group: &Group, device: Device) -> anyhow::Result<()> {
    let (rank, size) = (group.rank(), group.size());
    let gpu = comm_device_name(device)?;
    // Rank 0 reads the file; only it writes one.
    let dir = std::env::temp_dir().join(format!(
        "moelink-tch-streams-{}",
        std::env::var("MASTER_PORT").unwrap_or_else(|_| "0".into())
    ));
    let path = dir.join("tune.json");
    let other = dir.join("tune-other.json");
    if rank == 0 {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(&path, tune_doc(&gpu, size))?;
        std::fs::write(&other, tune_doc(&gpu, size + 1))?;
    }
    let opts = AllReduceOptions {
        tune_file: TuneFile::Path(path.clone()),
        ..AllReduceOptions::default()
    };
    let mut ar = AllReduce::new(group, device, &opts)?;
    chk.ok("tune file loaded", ar.tuning_loaded(), || {
        format!("{} not loaded", path.display())
    });
    chk.ok("tune table", ar.tuned()?.len() == 2, || {
        format!("{:?}", ar.tuned())
    });
    // Eager: the tuned eager entry.
    for round in 0..2 {
        let t = ar_data(round, rank).to_device(device);
        let out = Tensor::empty([AR], (Kind::Float, device));
        poison(&out);
        sum_into(&mut ar, &t, &out)?;
        chk.equal(
            &format!("tune eager round {round} sum"),
            &out,
            &ar_sum(round, size),
        );
        let c = choice(&ar);
        chk.ok(
            &format!("tune eager round {round} choice"),
            c == ("twoshot_ll".into(), 4, 256),
            || format!("{c:?}"),
        );
    }
    // Captured: the tuned graph entry; replays of fresh data.
    let t_s = Tensor::zeros([AR], (Kind::Float, device));
    let o_s = Tensor::zeros([AR], (Kind::Float, device));
    sum_into(&mut ar, &t_s, &o_s)?;
    let (graph, ()) = CudaGraph::capture(device, || sum_into(&mut ar, &t_s, &o_s))?;
    let c = choice(&ar);
    chk.ok(
        "tune graph choice",
        c == ("oneshot_ll".into(), 2, 128),
        || format!("{c:?}"),
    );
    for i in 0..REPLAYS {
        replay(&graph, &t_s, &ar_data(10 + i, rank), &[&o_s])?;
        chk.equal(
            &format!("tune graph replay {i} sum"),
            &o_s,
            &ar_sum(10 + i, size),
        );
    }
    drop(graph);
    ar.destroy()?;
    // A file of another world size: ignored (a warning on stderr).
    let opts = AllReduceOptions {
        max_bytes: 1 << 20,
        tune_file: TuneFile::Path(other),
        ..AllReduceOptions::default()
    };
    let mut ar2 = AllReduce::new(group, device, &opts)?;
    chk.ok(
        "tune file of another job ignored",
        !ar2.tuning_loaded(),
        || "loaded".into(),
    );
    ar2.destroy()?;
    Ok(())
}

/// `out` = the sum of every rank's `t`, on the current stream.
fn sum_into(ar: &mut AllReduce, t: &Tensor, out: &Tensor) -> moelink_tch::Result<()> {
    let args = AllReduceArgs {
        out: Some(out),
        ..AllReduceArgs::default()
    };
    ar.all_reduce(t, ReduceOp::Sum, &args).map(drop)
}

fn comm_device_name(device: Device) -> anyhow::Result<String> {
    // What AllReduce reads (cuDeviceGetName: torch.cuda.get_device_name).
    let dev = comm::Device::get(index(device) as i32)?;
    Ok(dev.name()?)
}

// ----- the host-side expert-id check ----------------------------------------------------------

fn check_ids(chk: &mut Checker, b: &mut Buffer, size: usize) -> anyhow::Result<()> {
    let (rank, device) = (b.rank(), b.device());
    let e = EL * size as i64;
    let t = tokens(700, rank, size);
    let bad = t.idx.copy();
    let _ = bad.get(3).get(2).fill_(e);
    let bad = bad.to_device(device);
    let x = t.x.to_device(device);
    let want = format!("topk_idx values must be in [-1, num_experts={e}), got {e} at [3, 2]");
    let before = moelink_tch::set_check_ids(true);
    let expect = |r: Result<(), Error>| match r {
        Err(e) => (
            e.python_class() == "ValueError" && e.to_string() == want,
            e.to_string(),
        ),
        Ok(()) => (false, "accepted".to_string()),
    };
    let (ok, got) = expect(b.get_dispatch_layout(&bad, e).map(|_| ()));
    chk.ok("check_ids layout", ok, || got);
    let o = LlDispatchOptions {
        use_fp8: false,
        ..LlDispatchOptions::default()
    };
    let (ok, got) = expect(b.low_latency_dispatch(&x, &bad, N, e, &o).map(|_| ()));
    chk.ok("check_ids low_latency_dispatch", ok, || got);
    // Valid ids pass with the check on.
    let good = t.idx.to_device(device);
    let l = b.get_dispatch_layout(&good, e)?;
    chk.equal(
        "check_ids valid layout",
        &l.num_tokens_per_expert,
        &reference::layout(&t.idx, e, size as i64)?.num_tokens_per_expert,
    );
    moelink_tch::set_check_ids(before);
    Ok(())
}

fn index(d: Device) -> i64 {
    match d {
        Device::Cuda(i) => i as i64,
        _ => 0,
    }
}

fn run() -> anyhow::Result<bool> {
    let group = Group::from_env(env_timeout()?).context("bootstrap")?;
    let (rank, size) = (group.rank(), group.size());
    let device = local_device()?;
    let opts = BufferOptions::sized_for(N, H, size, EL * size as i64)?;
    let mut b = Buffer::new(&group, device, &opts)?;
    let mut chk = Checker {
        rank,
        passed: 0,
        failed: 0,
    };
    check_async(&mut chk, &mut b, size).context("async")?;
    check_ll_async(&mut chk, &mut b, size).context("ll_async")?;
    check_ll_hooks(&mut chk, &mut b, size).context("ll_hooks")?;
    check_graph(&mut chk, &mut b, size).context("graph")?;
    check_ll_graph(&mut chk, &mut b, size).context("ll_graph")?;
    check_ids(&mut chk, &mut b, size).context("check_ids")?;
    check_tune(&mut chk, &group, device).context("tune")?;
    tch::Cuda::synchronize(index(device));
    b.check()?;
    b.destroy()?;
    println!(
        "tch_streams: rank {rank}/{size}: {} passed, {} failed",
        chk.passed, chk.failed
    );
    Ok(chk.failed == 0)
}

fn main() -> anyhow::Result<()> {
    if !run()? {
        bail!("some checks failed");
    }
    Ok(())
}
