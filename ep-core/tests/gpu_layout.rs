//! The layout kernel against the CPU reference, on fresh random routing with
//! poisoned outputs. Needs a CUDA GPU: `#[ignore]`d here, run on the GPU
//! machine by scripts/gpu_run.sh (`--include-ignored`).

use comm::device_error::DeviceErrorRecord;
use comm::{Device, DeviceMemory, StreamHandle};
use ep_kernels::{launch, DeviceKernels};
use ep_reference::normal;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

/// Top-k of random scores (distinct experts), then some ids replaced by -1
/// and, in some tokens, an id repeated; some tokens routed nowhere.
fn routing(rng: &mut impl Rng, n: usize, k: usize, e: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(n * k);
    let all: Vec<i64> = (0..e as i64).collect();
    for t in 0..n {
        let mut row: Vec<i64> = all.choose_multiple(rng, k).copied().collect();
        match t % 7 {
            0 => row.iter_mut().for_each(|x| *x = -1),
            1 => row[rng.random_range(0..k)] = -1,
            2 if k > 1 => row[1] = row[0],
            _ => {}
        }
        ids.extend(row);
    }
    ids
}

/// Nodes of consecutive ranks a case's layout also counts tokens for: 2
/// ranks per node where the rank count is even (else none).
fn ranks_per_node(r: usize) -> usize {
    if r % 2 == 0 {
        2
    } else {
        0
    }
}

/// Outputs of the layout kernel on `ids`: (tokens per rank, tokens per
/// expert, is_token_in_rank as bytes, tokens per node of
/// [`ranks_per_node`]), and what it recorded in `g.err`.
fn run_layout(
    g: &Gpu,
    ids: &[i64],
    (n, k, e, r): (usize, usize, usize, usize),
) -> (Vec<i32>, Vec<i32>, Vec<u8>, Vec<i32>) {
    let dev = g.dev;
    let l = ranks_per_node(r);
    let nodes = r.checked_div(l).unwrap_or(0);
    let per_node = DeviceMemory::alloc(dev, (nodes * 4).max(4)).unwrap();
    per_node.fill(0xAB).unwrap();
    let d_ids = DeviceMemory::alloc(dev, (n * k * 8).max(8)).unwrap();
    if n > 0 {
        d_ids.copy_from_host(0, ids).unwrap();
    }
    let per_rank = DeviceMemory::alloc(dev, r * 4).unwrap();
    let per_expert = DeviceMemory::alloc(dev, e * 4).unwrap();
    let in_rank = DeviceMemory::alloc(dev, (n * r).max(1)).unwrap();
    let partials = DeviceMemory::alloc(dev, 4 * launch::layout_scratch_elems(n, e, r)).unwrap();
    partials.fill(0x7f).unwrap();
    let ticket = DeviceMemory::alloc(dev, 4).unwrap();
    ticket.fill(0).unwrap();
    for m in [&per_rank, &per_expert, &in_rank] {
        m.fill(0xAB).unwrap(); // poison: every element must be written
    }
    // SAFETY: buffers sized as the launcher documents.
    unsafe {
        launch::layout_dispatch(
            &g.kernels,
            StreamHandle(0),
            launch::LayoutParams {
                topk_idx: d_ids.ptr(),
                num_tokens_per_rank: per_rank.ptr(),
                num_tokens_per_expert: per_expert.ptr(),
                is_token_in_rank: in_rank.ptr(),
                partials: partials.ptr(),
                ticket: ticket.ptr(),
                error: g.err.device_ptr(),
                num_tokens: n as i32,
                num_topk: k as i32,
                num_experts: e as i32,
                num_ranks: r as i32,
                rank: 7,
                num_tokens_per_node: if l > 0 { per_node.ptr() } else { 0 },
                ranks_per_node: l as i32,
                pad: 0,
            },
        )
    }
    .unwrap();
    dev.synchronize().unwrap();
    let mut got_rank = vec![0i32; r];
    let mut got_expert = vec![0i32; e];
    let mut got_in = vec![0u8; n * r];
    per_rank.copy_to_host(0, &mut got_rank).unwrap();
    per_expert.copy_to_host(0, &mut got_expert).unwrap();
    if n > 0 {
        in_rank.copy_to_host(0, &mut got_in).unwrap();
    }
    let mut got_node = vec![0i32; nodes];
    per_node.copy_to_host(0, &mut got_node).unwrap();
    (got_rank, got_expert, got_in, got_node)
}

fn check_against_reference(
    got: (Vec<i32>, Vec<i32>, Vec<u8>, Vec<i32>),
    ids: &[i64],
    shape: (usize, usize, usize, usize),
    case: &str,
) {
    let (_, k, e, r) = shape;
    let want = normal::layout(ids, k, e, r).unwrap();
    let l = ranks_per_node(r);
    if l > 0 {
        let want_nodes = normal::layout_internode(ids, k, e, r, l).unwrap();
        assert_eq!(
            Some(got.3.clone()),
            want_nodes.num_tokens_per_rdma_rank,
            "{case}: tokens per node of {l} ranks"
        );
    }
    assert_eq!(got.0, want.num_tokens_per_rank, "{case}: tokens per rank");
    assert_eq!(
        got.1, want.num_tokens_per_expert,
        "{case}: tokens per expert"
    );
    let want_in: Vec<u8> = want.is_token_in_rank.iter().map(|&b| b as u8).collect();
    assert_eq!(got.2, want_in, "{case}: is_token_in_rank");
}

/// What a test runs on: GPU 0, its kernels, a device error record, and a
/// generator of a fresh seed (printed, and named in the test's messages).
struct Gpu {
    dev: Device,
    kernels: DeviceKernels,
    err: DeviceErrorRecord,
    seed: u64,
    rng: rand::rngs::StdRng,
}

impl Gpu {
    fn new() -> Self {
        assert!(comm::device_count() > 0, "no CUDA device");
        let dev = Device::bind(0).unwrap();
        let seed: u64 = rand::rng().random();
        println!("seed {seed}");
        Self {
            dev,
            kernels: DeviceKernels::get(dev).unwrap(),
            err: DeviceErrorRecord::new(Some(dev)).unwrap(),
            seed,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn layout_kernel_matches_reference() {
    let mut g = Gpu::new();
    let seed = g.seed;
    let cases = [
        (4096, 8, 256, 4),
        (4096, 8, 288, 8),
        (1000, 1, 8, 2),
        (333, 32, 64, 8),
        (0, 8, 256, 4),
        (17, 4, 12, 1),
        (5000, 6, 96, 3),
    ];
    for shape in cases {
        let (n, k, e, _) = shape;
        let ids = routing(&mut g.rng, n, k, e);
        let got = run_layout(&g, &ids, shape);
        check_against_reference(got, &ids, shape, &format!("seed {seed}, {shape:?}"));
        assert!(
            g.err.check().is_ok(),
            "seed {seed}, {shape:?}: valid ids were reported"
        );
    }
}

/// An id outside [-1, E) (too large, or below -1) counts nowhere, and the
/// record names its token, column and value.
#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn layout_kernel_reports_an_out_of_range_id() {
    let mut g = Gpu::new();
    let seed = g.seed;
    let shape = (1000, 8, 64, 4);
    let (n, k, e, _) = shape;
    for bad in [e as i64, 1 << 40, -2, i64::MIN] {
        let mut ids = routing(&mut g.rng, n, k, e);
        let (t, c) = (g.rng.random_range(0..n), g.rng.random_range(0..k));
        ids[t * k + c] = bad;
        let got = run_layout(&g, &ids, shape);
        let case = format!("seed {seed}, id {bad} at ({t}, {c})");
        let msg = g.err.check().expect_err(&case).to_string();
        let want =
            format!("rank 7: token {t}, column {c} holds expert id {bad}, outside [-1, {e})");
        assert!(msg.contains(&want), "{case}: {msg}");
        ids[t * k + c] = -1;
        check_against_reference(got, &ids, shape, &case);
    }
}
