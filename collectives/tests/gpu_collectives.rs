//! Single-GPU tests of the collectives. They need a CUDA device, so they are
//! `#[ignore]`d (cargo prints the reason) and run on the GPU machine by
//! scripts/gpu_run.sh with `--include-ignored`. The multi-rank tests are the
//! torchrun worker `tests/multi_gpu/allreduce_worker.py`.
//!
//! With one rank every algorithm still runs its whole kernel (LL packets to no
//! peer, barriers with nobody): the reduction of one input is the input
//! converted through the accumulation type, so this checks loads, stores,
//! tails, misaligned paths and the counter on one GPU.

use std::sync::Arc;
use std::time::Duration;

use collectives::{
    args, Algorithm, AllGatherCall, AllReduceCall, AllReduceComm, AllReduceConfig, CollKernels,
    DType, Kernel, ReduceOp, TestHooks,
};
use comm::{Device, DeviceMemory, StreamHandle, TcpBootstrap, UniqueId};
use rand::{Rng, SeedableRng};

fn device() -> Device {
    assert!(comm::device_count() > 0, "no CUDA device visible");
    Device::bind(0).expect("bind device 0")
}

fn single_rank_comm(dev: Device) -> AllReduceComm {
    let id = UniqueId::new(None).unwrap();
    let boot = TcpBootstrap::new(&id, 0, 1, Duration::from_secs(30)).unwrap();
    let cfg = AllReduceConfig {
        max_bytes: 8 << 20,
        device_timeout_ns: 5_000_000_000,
        ..AllReduceConfig::default()
    };
    let group = comm::Group::new(Arc::new(boot)).unwrap();
    AllReduceComm::new(&group, dev, &cfg).unwrap()
}

/// Waits for the collective just launched on `dev`, fails on any error the
/// kernel reported, and reads back `len` elements of `output` from byte `offset`.
fn wait_and_read<T: Copy + Default>(
    dev: Device,
    c: &AllReduceComm,
    output: &DeviceMemory,
    offset: usize,
    len: usize,
) -> Vec<T> {
    dev.synchronize().unwrap();
    c.check_device().unwrap();
    let mut got = vec![T::default(); len];
    output.copy_to_host(offset, &mut got).unwrap();
    got
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn a_device_timeout_must_be_positive() {
    let dev = device();
    let mut comm = single_rank_comm(dev);
    assert_eq!(comm.device_timeout_ns(), 5_000_000_000);
    for bad in [0, -1] {
        let e = comm.set_device_timeout_ns(bad).unwrap_err();
        assert!(e.to_string().contains("timeout"), "{e}");
    }
    assert_eq!(comm.device_timeout_ns(), 5_000_000_000);
    comm.set_device_timeout_ns(1_000).unwrap();
    assert_eq!(comm.device_timeout_ns(), 1_000);

    let id = UniqueId::new(None).unwrap();
    let boot = TcpBootstrap::new(&id, 0, 1, Duration::from_secs(30)).unwrap();
    let cfg = AllReduceConfig {
        device_timeout_ns: 0,
        ..AllReduceConfig::default()
    };
    let group = comm::Group::new(Arc::new(boot)).unwrap();
    let e = AllReduceComm::new(&group, dev, &cfg).unwrap_err();
    assert!(e.to_string().contains("timeout"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn test_hooks_take_a_bounded_delay_only() {
    let mut comm = single_rank_comm(device());
    for bad in [-1, collectives::allreduce::MAX_TEST_DELAY_US + 1, i32::MAX] {
        let e = comm
            .set_test_hooks(TestHooks {
                copy_out_delay_us: bad,
                results_in_data_region: false,
            })
            .unwrap_err();
        assert!(e.to_string().contains("copy_out_delay_us"), "{e}");
    }
    comm.set_test_hooks(TestHooks {
        copy_out_delay_us: collectives::allreduce::MAX_TEST_DELAY_US,
        results_in_data_region: true,
    })
    .unwrap();
    comm.set_test_hooks(TestHooks::default()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn module_loads_and_every_kernel_resolves() {
    let k = CollKernels::get(device()).expect("load module");
    for name in collectives::module::NAMES {
        assert!(!name.is_empty());
    }
    assert!(!k.function(Kernel::AllGatherMesh).is_null());
    assert!(!k.function(Kernel::LayoutProbe).is_null());
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn device_layout_matches_rust() {
    let k = CollKernels::get(device()).unwrap();
    assert_eq!(k.layout_probe().unwrap(), args::layout_probe_expected());
}

/// fp32 sum/min/max of one rank, every algorithm, odd sizes and a misaligned
/// view: the output must equal the input bit for bit.
#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn single_rank_allreduce_is_identity() {
    let dev = device();
    let mut c = single_rank_comm(dev);
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
    let cap = 1 << 20; // elements
    let input = DeviceMemory::alloc(dev, cap * 4 + 64).unwrap();
    let output = DeviceMemory::alloc(dev, cap * 4 + 64).unwrap();
    for &count in &[1usize, 3, 17, 1023, 4097, 100_003] {
        for &offset in &[0usize, 4] {
            let host: Vec<f32> = (0..count)
                .map(|_| rng.random_range(-1.0f32..1.0) + 2.0)
                .collect();
            input.copy_from_host(offset, &host).unwrap();
            for alg in [
                Algorithm::OneShotLl,
                Algorithm::TwoShotLl,
                Algorithm::RsAg,
                Algorithm::RsAgPush,
            ] {
                for op in ReduceOp::ALL {
                    output.fill(0xFF).unwrap();
                    let call = AllReduceCall {
                        input: input.ptr() + offset as u64,
                        output: output.ptr() + offset as u64,
                        count: count as u64,
                        dtype: DType::Fp32,
                        op,
                        accum: None,
                        algorithm: Some(alg),
                        num_blocks: 0,
                        num_threads: 0,
                        capturing: false,
                    };
                    c.all_reduce(StreamHandle(0), &call).unwrap();
                    let got: Vec<f32> = wait_and_read(dev, &c, &output, offset, count);
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        host.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{alg:?} {op:?} count {count} offset {offset}"
                    );
                }
            }
        }
    }
    // allgather of one rank: a copy (both algorithms), odd byte counts.
    for &bytes in &[1usize, 7, 4096, 65_537] {
        let host: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
        input.copy_from_host(0, &host).unwrap();
        for alg in [Algorithm::AgLl, Algorithm::AgMesh] {
            output.fill(0).unwrap();
            let call = AllGatherCall {
                input: input.ptr(),
                output: output.ptr() + 1,
                nbytes: bytes as u64,
                algorithm: Some(alg),
                num_blocks: 0,
                num_threads: 0,
                capturing: false,
            };
            c.all_gather(StreamHandle(0), &call).unwrap();
            let got: Vec<u8> = wait_and_read(dev, &c, &output, 1, bytes);
            assert_eq!(got, host, "{alg:?} {bytes} bytes");
        }
    }
}
