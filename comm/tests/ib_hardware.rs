//! IB verbs on a real RDMA device (libibverbs loaded at run time): the
//! scenarios of `ib_fake.rs`, on hardware. Ignored by default; on a machine
//! with an RDMA NIC (docs/ib.md):
//!
//!     cargo test -p comm --test ib_hardware -- --include-ignored --test-threads=1 --nocapture
//!
//! Each test prints `SKIPPED: <reason>` and passes where there is no
//! libibverbs or no usable device, so the suite can run anywhere.

use std::sync::Arc;
use std::time::Duration;

use comm::registered_memory::{Location, MemoryInfo, RegisteredMemory};
use comm::transport::ib::config::{IbConfig, SignalMode};
use comm::transport::ib::context::IbContext;
use comm::transport::ib::device::RdmaProvider;
use comm::transport::ib::native::shared_verbs;
use comm::transport::ib::verbs::usable_devices;
use comm::transport::Connection;
use comm::{Bootstrap, Device, DeviceMemory, TcpBootstrap};

mod common;
#[path = "common/ib.rs"]
mod ib;
use ib::*;

const T: Duration = Duration::from_secs(30);

/// libibverbs and the `MOELINK_IB_*` settings, or why the test is skipped.
fn verbs() -> Option<(Arc<dyn RdmaProvider>, IbConfig)> {
    let config = match IbConfig::from_env() {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let found = shared_verbs().and_then(|v| {
        let p: Arc<dyn RdmaProvider> = v;
        usable_devices(&*p, &config.hca).map(|d| (p, d))
    });
    match found {
        Ok((p, devices)) => {
            println!("RDMA devices: {devices:?}");
            Some((p, config))
        }
        Err(e) => {
            println!("SKIPPED: {e}");
            None
        }
    }
}

#[test]
#[ignore = "needs an RDMA NIC; see docs/ib.md"]
fn loopback_two_queue_pairs_on_one_hca() {
    let Some((verbs, config)) = verbs() else {
        return;
    };
    for (mode, qps) in [
        (config.mode, config.qps_per_rank),
        (SignalMode::Host, 1),
        (SignalMode::HostNoAtomic, 1),
        (SignalMode::Host, 4),
    ] {
        let cfg = IbConfig {
            mode,
            qps_per_rank: qps,
            ..config.clone()
        };
        let p = pair(&*verbs, &cfg, &cfg, T).unwrap();
        println!(
            "{} port {}: {:?} mode (asked {mode:?}), {qps} queue pairs",
            p.a.device_name(),
            p.a.port(),
            p.ab.mode()
        );
        put_signal_adds(&p).unwrap();
        data_before_signal(&p, 2000).unwrap();
        println!("PASS loopback {mode:?} x{qps}");
    }
}

#[test]
#[ignore = "needs an RDMA NIC and a CUDA GPU; see docs/ib.md"]
fn gpu_memory_is_registered_and_written() {
    let Some((verbs, config)) = verbs() else {
        return;
    };
    if comm::device_count() == 0 {
        println!("SKIPPED: no CUDA device");
        return;
    }
    let dev = Device::bind(0).unwrap();
    let cfg = IbConfig {
        mode: SignalMode::HostNoAtomic,
        ..config
    };
    let a = IbContext::open(0, &*verbs, cfg.clone(), 0, None, T).unwrap();
    let b = IbContext::open(1, &*verbs, cfg, 0, Some(dev), T).unwrap();
    let (ab, _ba) = connect_pair(&a, &b).unwrap();
    let len = 4 << 20;
    let gpu = DeviceMemory::alloc(dev, len).unwrap();
    gpu.fill(0).unwrap();
    let reg = b
        .register(gpu.ptr(), len as u64, Location::Device(0), false)
        .unwrap();
    println!("GPU memory registered by {}", reg.how);
    let info = MemoryInfo {
        rank: 1,
        len: len as u64,
        location: Location::Device(0),
        host_id: 0,
        owner_ptr: gpu.ptr(),
        ipc: None,
        ethernet: None,
        ib: Some(reg.key()),
    };
    let dst = RegisteredMemory::local(info, None);
    let src = HostBuf::new(&a, 0, len).unwrap();
    let data = pattern(7, len - 4096);
    src.write(0, &data);
    ab.write(&dst, 0, &src.mem, 0, data.len() as u64).unwrap();
    // A signal the receiving proxy applies to GPU memory (cuMemcpy).
    let sem = (len - 64) as u64;
    ab.update_and_sync(&dst, sem, 11).unwrap();
    ab.flush(T).unwrap();
    wait_until("the GPU semaphore", T, || {
        let mut v = [0u64; 1];
        gpu.copy_to_host(sem as usize, &mut v).unwrap();
        v[0] == 11
    })
    .unwrap();
    let mut back = vec![0u8; data.len()];
    gpu.copy_to_host(0, &mut back).unwrap();
    assert!(back == data, "the data in GPU memory differs");
    b.check().unwrap();
    println!("PASS gpu memory ({})", reg.how);
}

#[test]
#[ignore = "needs an RDMA NIC; see docs/ib.md"]
fn two_rank_port_channel_suite() {
    if verbs().is_none() {
        return;
    }
    // Under torchrun (one process per rank, on one or two hosts): the
    // launcher's environment; else two ranks as threads of this process.
    if let (Ok(_), Ok(size)) = (std::env::var("RANK"), std::env::var("WORLD_SIZE")) {
        assert_eq!(size, "2", "the suite runs on 2 ranks");
        let boot: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::from_env(T).unwrap());
        let rank = boot.rank();
        port_channel_suite(rank, boot, None).unwrap();
        println!("PASS port channels over ib (rank {rank})");
        return;
    }
    if comm::env::var("MOELINK_RANKS_PER_NODE").is_none() {
        // One host: two emulated nodes of one rank each.
        std::env::set_var("MOELINK_RANKS_PER_NODE", "1");
    }
    for (r, res) in on_ranks(2, |rank, boot| port_channel_suite(rank, boot, None))
        .into_iter()
        .enumerate()
    {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    println!("PASS port channels over ib (2 ranks as threads)");
}
