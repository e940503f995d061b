//! CPU tests of the IB verbs transport on the in-memory NIC
//! (`comm::transport::ib::fake`): everything above the verbs runs as it does
//! on hardware (queue-pair setup and transitions, both signalling modes,
//! striping over several queue pairs, credits, completion polling, error
//! completions, bounded waits), and the Communicator builds port channels
//! over it. `ib_hardware.rs` runs the same scenarios on a real NIC.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::registered_memory::MemoryInfo;
use comm::transport::ib::config::{HcaFilter, SignalMode};
use comm::transport::ib::device::RdmaProvider;
use comm::transport::ib::fake::{status, FakeDeviceSpec, FakeFabric};
use comm::transport::ib::qp::LinkLayer;
use comm::transport::{AtomicWidth, Connection};
use comm::CommError;

mod common;
#[path = "common/ib.rs"]
mod ib;
use ib::*;

const T: Duration = Duration::from_secs(10);

fn fabric() -> FakeFabric {
    FakeFabric::with_devices(&[FakeDeviceSpec::new("mlx5_0")])
}

/// A pair whose two sides ask for `a` and `b` (signal mode, queue pairs).
fn pair_asking(f: &FakeFabric, a: (SignalMode, u32), b: (SignalMode, u32)) -> R<Pair> {
    pair(f, &config(a.0, a.1), &config(b.0, b.1), T)
}

fn host_pair(f: &FakeFabric, mode: SignalMode, qps: u32) -> Pair {
    pair_asking(f, (mode, qps), (mode, qps)).unwrap()
}

/// A pair of `qps` queue pairs in `mode` that has carried puts, signals and
/// adds, and then `writes` writes each ahead of its signal.
fn exercised_pair(f: &FakeFabric, mode: SignalMode, qps: u32, writes: u64) -> Pair {
    let p = host_pair(f, mode, qps);
    assert_eq!(p.ab.mode(), mode);
    put_signal_adds(&p).unwrap();
    data_before_signal(&p, writes).unwrap();
    p
}

#[test]
fn host_mode_writes_signals_and_adds() {
    exercised_pair(&fabric(), SignalMode::Host, 1, 700);
}

#[test]
fn host_no_atomic_mode_goes_through_the_receiving_proxy() {
    let f = fabric();
    // Five times the record ring: credits must come back.
    let p = exercised_pair(&f, SignalMode::HostNoAtomic, 1, 640);
    // The other direction works too (the same queue pairs).
    p.ba.update_and_sync(&p.buf_a.mem, SEM as u64, 3).unwrap();
    p.ba.flush(T).unwrap();
    wait_until("a's semaphore", T, || {
        p.buf_a.u64(SEM).load(Ordering::Acquire) == 3
    })
    .unwrap();
}

#[test]
fn striped_writes_keep_data_before_signal() {
    let f = fabric();
    for mode in [SignalMode::Host, SignalMode::HostNoAtomic] {
        let p = exercised_pair(&f, mode, 4, 300);
        assert_eq!(p.ab.num_qps(), 4);
    }
}

#[test]
fn a_device_without_atomics_makes_the_pair_use_immediates() {
    let mut spec = FakeDeviceSpec::new("irdma0");
    spec.atomics = false;
    spec.link_layer = LinkLayer::Ethernet;
    let f = FakeFabric::with_devices(&[spec]);
    // Both ask for host mode; the device says no.
    let mut cfg = config(SignalMode::Host, 2);
    cfg.gid_index = 3;
    cfg.traffic_class = 106;
    let p = pair(&f, &cfg, &cfg, T).unwrap();
    assert_eq!(p.ab.mode(), SignalMode::HostNoAtomic);
    put_signal_adds(&p).unwrap();
}

#[test]
fn one_side_asking_for_host_no_atomic_decides_the_pair() {
    let f = fabric();
    let p = pair_asking(&f, (SignalMode::Host, 1), (SignalMode::HostNoAtomic, 1)).unwrap();
    assert_eq!(p.ab.mode(), SignalMode::HostNoAtomic);
    assert_eq!(p.ba.mode(), SignalMode::HostNoAtomic);
}

#[test]
fn mismatched_queue_pair_counts_fail_naming_the_variable() {
    let f = fabric();
    let e = pair_asking(&f, (SignalMode::Host, 1), (SignalMode::Host, 2))
        .err()
        .unwrap();
    assert!(e.contains("MOELINK_IB_QPS_PER_RANK"), "{e}");
}

/// `p.buf_b` with another rkey: memory the peer never registered so.
fn bad_key(p: &Pair) -> comm::registered_memory::RegisteredMemory {
    let mut key = p.buf_b.mem.info().ib.unwrap();
    key.rkey ^= 0x7777;
    let info = MemoryInfo {
        ib: Some(key),
        ..p.buf_b.mem.info().clone()
    };
    comm::registered_memory::RegisteredMemory::local(info, None)
}

#[test]
fn a_failed_completion_names_peer_and_work_request_and_breaks_the_connection() {
    let f = fabric();
    let p = host_pair(&f, SignalMode::Host, 1);
    let dst = bad_key(&p);
    // Posting succeeds; the completion fails.
    p.ab.write(&dst, 64, &p.buf_a.mem, 0, 4096).unwrap();
    let e = p.ab.flush(T).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, CommError::Rdma { peer: 1, .. }), "{e:?}");
    assert!(
        text.contains("RDMA write (work request 0x0: 4096 bytes to")
            && text.contains("remote access error")
            && text.contains("(10)"),
        "{text}"
    );
    // Every later call says the connection is unusable.
    let e =
        p.ab.update_and_sync(&p.buf_b.mem, SEM as u64, 1)
            .unwrap_err();
    assert!(e.to_string().contains("unusable since"), "{e}");
    // progress() reports it once, then only busy-ness.
    assert!(p.ab.progress().is_err());
    assert!(matches!(p.ab.progress(), Ok(Some(false))));
}

#[test]
fn injected_errors_map_to_their_status_names() {
    for (st, name, op) in [
        (
            status::RETRY_EXC_ERR,
            "transport retry counter exceeded",
            "fetch-and-add",
        ),
        (
            status::RNR_RETRY_EXC_ERR,
            "RNR retry counter exceeded",
            "fetch-and-add",
        ),
        (
            status::REM_INV_REQ_ERR,
            "remote invalid request",
            "RDMA write with immediate",
        ),
    ] {
        let f = fabric();
        let mode = if op == "fetch-and-add" {
            SignalMode::Host
        } else {
            SignalMode::HostNoAtomic
        };
        let p = host_pair(&f, mode, 1);
        f.fail_next_send("mlx5_0", st, 0x42);
        p.ab.atomic_add(&p.buf_b.mem, C64 as u64, 1, AtomicWidth::U64)
            .unwrap();
        let e = p.ab.flush(T).unwrap_err().to_string();
        assert!(
            e.contains("rank 1") && e.contains(name) && e.contains(op) && e.contains("0x42"),
            "{e}"
        );
    }
}

#[test]
fn waits_are_bounded_and_say_what_they_waited_for() {
    let f = fabric();
    let timeout = Duration::from_millis(300);
    let cfg = config(SignalMode::Host, 2);
    let a = open(&f, 0, &cfg, timeout).unwrap();
    let b = open(&f, 1, &cfg, timeout).unwrap();
    let (ab, _ba) = connect_pair(&a, &b).unwrap();
    let src = HostBuf::new(&a, 0, 4 << 20).unwrap();
    let dst = HostBuf::new(&b, 1, 8 << 20).unwrap();
    f.set_hold("mlx5_0", true);
    ab.write(&dst.mem, 0, &src.mem, 0, 1 << 20).unwrap();
    // The flush waits for the held writes, then gives up.
    let start = Instant::now();
    let e = ab.flush(Duration::from_millis(200)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(200));
    match &e {
        CommError::Timeout { rank: 0, what, .. } => assert!(
            what.contains("rank 1 to complete 2 RDMA work requests")
                && what.contains("oldest: RDMA write of 524288 bytes"),
            "{what}"
        ),
        e => panic!("{e:?}"),
    }
    assert_eq!(ab.busy(), Some(true));
    // A signal after a striped write waits for the other queue pair's half.
    let e = ab.update_and_sync(&dst.mem, SEM as u64, 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("to complete the writes on 1 other queue pairs"),
        "{e}"
    );
    f.set_hold("mlx5_0", false);
    ab.flush(T).unwrap();
    assert_eq!(ab.busy(), Some(false));
    ab.update_and_sync(&dst.mem, SEM as u64, 1).unwrap();
    ab.flush(T).unwrap();
    assert_eq!(dst.u64(SEM).load(Ordering::Acquire), 1);
}

#[test]
fn a_receiver_that_returns_no_credit_stalls_the_sender_boundedly() {
    let f =
        FakeFabric::with_devices(&[FakeDeviceSpec::new("mlx5_0"), FakeDeviceSpec::new("mlx5_1")]);
    let timeout = Duration::from_millis(300);
    let cfg_a = config(SignalMode::HostNoAtomic, 1);
    let mut cfg_b = cfg_a.clone();
    cfg_b.hca = HcaFilter::parse("MOELINK_IB_HCA", "=mlx5_1").unwrap();
    let a = open(&f, 0, &cfg_a, timeout).unwrap();
    let b = open(&f, 1, &cfg_b, timeout).unwrap();
    assert_eq!((a.device_name(), b.device_name()), ("mlx5_0", "mlx5_1"));
    let (ab, _ba) = connect_pair(&a, &b).unwrap();
    let dst = HostBuf::new(&b, 1, 8 << 20).unwrap();
    // b applies a's records, but its credit writes stay held.
    f.set_hold("mlx5_1", true);
    let mut err = None;
    for i in 1..=200u64 {
        if let Err(e) = ab.update_and_sync(&dst.mem, SEM as u64, i) {
            err = Some((i, e));
            break;
        }
    }
    let (i, e) = err.expect("the sender ran out of credit");
    assert_eq!(i, 129, "{e}");
    assert!(
        e.to_string()
            .contains("rank 1 's receiving proxy to consume signal records of queue pair 0 (128 sent, 0 consumed"),
        "{e}"
    );
    // The receiving proxy applied all 128 records it had room for.
    wait_until("128 signals applied", T, || {
        dst.u64(SEM).load(Ordering::Acquire) == 128
    })
    .unwrap();
    // Credits released: the sender goes on.
    f.set_hold("mlx5_1", false);
    ab.update_and_sync(&dst.mem, SEM as u64, 129).unwrap();
    ab.flush(T).unwrap();
    wait_until("the 129th signal", T, || {
        dst.u64(SEM).load(Ordering::Acquire) == 129
    })
    .unwrap();
}

#[test]
fn registrations_go_with_their_memory_and_queue_pairs_with_their_connections() {
    let f = fabric();
    {
        let p = host_pair(&f, SignalMode::Host, 3);
        assert!(f.registrations("mlx5_0") >= 4);
        assert_eq!(f.live_qps(), 6);
        drop(p);
    }
    assert_eq!(f.registrations("mlx5_0"), 0);
    assert_eq!(f.live_qps(), 0);
}

#[test]
fn writes_check_sources_and_destinations() {
    let f = fabric();
    let p = host_pair(&f, SignalMode::Host, 1);
    // The peer's memory is no write source; our own memory no destination.
    let e = p.ab.write(&p.buf_b.mem, 0, &p.buf_b.mem, 0, 8).unwrap_err();
    assert!(e.to_string().contains("write source"), "{e}");
    let e = p.ab.write(&p.buf_a.mem, 0, &p.buf_a.mem, 0, 8).unwrap_err();
    assert!(
        e.to_string().contains("rank 0's memory is not registered"),
        "{e}"
    );
    let e =
        p.ab.write(&p.buf_b.mem, 8 << 20, &p.buf_a.mem, 0, 8)
            .unwrap_err();
    assert!(e.to_string().contains("exceed"), "{e}");
    let e =
        p.ab.atomic_add(&p.buf_b.mem, 4, 1, AtomicWidth::U64)
            .unwrap_err();
    assert!(e.to_string().contains("aligned"), "{e}");
    p.ab.update_and_sync(&p.buf_b.mem, SEM as u64, 4).unwrap();
    let e =
        p.ab.update_and_sync(&p.buf_b.mem, SEM as u64, 3)
            .unwrap_err();
    assert!(e.to_string().contains("only grow"), "{e}");
}

#[test]
fn a_record_outside_the_receivers_regions_is_reported_by_it() {
    let f = fabric();
    let p = host_pair(&f, SignalMode::HostNoAtomic, 1);
    // A destination whose address the receiver never registered (the key
    // is valid: the NIC accepts the record; the receiving proxy rejects it).
    let info = MemoryInfo {
        owner_ptr: 0x10,
        ..p.buf_b.mem.info().clone()
    };
    let far = comm::registered_memory::RegisteredMemory::local(info, None);
    p.ab.update_and_sync(&far, 8, 1).unwrap();
    p.ab.flush(T).unwrap();
    wait_until("the receiving proxy's error", T, || p.b.check().is_err()).unwrap();
    let e = p.b.check().unwrap_err().to_string();
    assert!(
        e.contains("rank 0") && e.contains("not inside a region"),
        "{e}"
    );
}

#[test]
fn communicators_build_port_channels_over_ib() {
    // Two emulated nodes of one rank each: the peer is on another node.
    std::env::set_var("MOELINK_RANKS_PER_NODE", "1");
    for mode in ["host", "host-no-atomic"] {
        std::env::set_var("MOELINK_IB_MODE", mode);
        let f: Arc<dyn RdmaProvider> = Arc::new(FakeFabric::with_devices(&[
            FakeDeviceSpec::new("mlx5_0"),
            FakeDeviceSpec::new("mlx5_1"),
        ]));
        let results = on_ranks(2, |rank, boot| {
            port_channel_suite(rank, boot, Some(f.clone()))
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("{mode}: rank {r}: {e}"));
        }
    }
    // Forcing Ethernet: no RDMA device is opened, and connecting says why.
    std::env::set_var("MOELINK_TRANSPORT", "ethernet");
    let f: Arc<dyn RdmaProvider> = Arc::new(fabric());
    let results = on_ranks(2, |_, boot| {
        let opts = comm::CommunicatorOptions {
            rdma: Some(f.clone()),
            ..Default::default()
        };
        let c = comm::Communicator::new(boot, None, opts).map_err(err)?;
        if c.ib_context().is_some() {
            return Err("opened an RDMA device under MOELINK_TRANSPORT=ethernet".into());
        }
        match c.connect(1 - c.rank(), comm::transport::Transport::IbVerbs) {
            Ok(_) => Err("connected".into()),
            Err(_) => Ok(()),
        }
    });
    std::env::remove_var("MOELINK_TRANSPORT");
    std::env::remove_var("MOELINK_IB_MODE");
    for r in results {
        r.unwrap();
    }
}
