//! The `host-no-atomic` signalling of IB verbs, driven through the Ethernet
//! transport: a proxy fed by host threads issues put + signal and adds on an
//! Ethernet connection in that mode, which sends every signal and add as
//! (immediate, record); the receiver decodes and applies them with the code
//! the IB receiving proxy runs (`ib::imm::decode`, `inbound::Regions`).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::device_handles::{trigger_type as tt, ProxyTrigger};
use comm::proxy::ProxyService;
use comm::registered_memory::{Location, MemoryInfo, RegisteredMemory};
use comm::transport::ethernet::{EthernetConnection, EthernetReceiver};
use comm::transport::ib::config::SignalMode;
use comm::transport::{AtomicWidth, Connection};

const T: Duration = Duration::from_secs(20);
const LEN: usize = 1 << 20;
const SLOT: u64 = 4096;
const SEM: u64 = 512 << 10;
const C64: u64 = SEM + 64;
const C32A: u64 = SEM + 128;
const C32B: u64 = SEM + 132;

/// A leaked, zeroed host buffer of `len` bytes as rank `rank`'s memory.
fn buffer(rank: u32, len: usize, ethernet: Option<String>) -> (RegisteredMemory, u64) {
    let ptr = Vec::leak(vec![0u64; len / 8]).as_mut_ptr() as u64;
    let info = MemoryInfo {
        rank,
        len: len as u64,
        location: Location::Host,
        host_id: 0,
        owner_ptr: ptr,
        ipc: None,
        ethernet,
        ib: None,
    };
    (RegisteredMemory::local(info, None), ptr)
}

fn word(ptr: u64) -> &'static AtomicU64 {
    // SAFETY: an aligned word of a leaked buffer.
    unsafe { AtomicU64::from_ptr(ptr as *mut u64) }
}

#[test]
fn the_proxy_signals_through_records_and_data_lands_first() {
    let rx = EthernetReceiver::start("127.0.0.1:0".parse().unwrap(), None, 1).unwrap();
    let (dst, dst_ptr) = buffer(1, LEN, Some(rx.address()));
    rx.register(dst_ptr, LEN as u64, Location::Host);
    let (src, src_ptr) = buffer(0, LEN, None);
    // SAFETY: aligned words of the leaked buffers.
    unsafe { AtomicU32::from_ptr((dst_ptr + C32A) as *mut u32) }.store(u32::MAX, Ordering::SeqCst);
    word(dst_ptr + C64).store(0xFFFF_FFF0, Ordering::SeqCst);

    let conn = EthernetConnection::connect(0, 1, &rx.address(), None, T)
        .unwrap()
        .with_signal_mode(SignalMode::HostNoAtomic);
    let conn: Arc<dyn Connection> = Arc::new(conn);
    let mut proxy = ProxyService::new(0, None, 64, 0).unwrap();
    let src_mem = proxy.add_memory(src).unwrap();
    let dst_mem = proxy.add_memory(dst.clone()).unwrap();
    let ch = proxy.add_channel(conn.clone(), dst.clone(), SEM).unwrap();
    proxy.start().unwrap();
    let producer = proxy.fifo().host_producer().unwrap();

    // Rounds of (put slot i, signal), watched from the receiving side: once
    // the semaphore reads i, slot i holds round i's data.
    const ROUNDS: u64 = 300;
    let bad = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let start = Instant::now();
            let (mut seen, mut bad) = (0, Vec::new());
            while seen < ROUNDS && start.elapsed() < T {
                let v = word(dst_ptr + SEM).load(Ordering::Acquire);
                for i in seen + 1..=v {
                    let got = word(dst_ptr + (i % 64) * SLOT).load(Ordering::Acquire);
                    if got < i {
                        bad.push((i, got));
                    }
                }
                seen = v;
            }
            (seen, bad)
        });
        for i in 1..=ROUNDS {
            let off = (i % 64) * SLOT;
            word(src_ptr + off).store(i, Ordering::SeqCst);
            let tr = ProxyTrigger::data(tt::DATA | tt::SIGNAL, ch, dst_mem, off, src_mem, off, 8);
            producer.push(tr, T).unwrap();
        }
        watcher.join().unwrap()
    });
    assert_eq!(bad, (ROUNDS, vec![]), "(signals seen, signals before data)");

    for tr in [
        ProxyTrigger::atomic(tt::ATOMIC_ADD64, ch, dst_mem, C64, 0x20),
        ProxyTrigger::atomic(tt::ATOMIC_ADD32, ch, dst_mem, C32A, 2),
        ProxyTrigger::data(tt::SIGNAL | tt::FLUSH, ch, dst_mem, 0, src_mem, 0, 0),
    ] {
        producer.push(tr, T).unwrap();
    }
    let start = Instant::now();
    while word(dst_ptr + SEM).load(Ordering::Acquire) != ROUNDS + 1 {
        assert!(start.elapsed() < T, "the last signal never landed");
        std::thread::yield_now();
    }
    assert_eq!(word(dst_ptr + C64).load(Ordering::Acquire), 0x1_0000_0010);
    // SAFETY: as above.
    let c32 = |o| unsafe { AtomicU32::from_ptr((dst_ptr + o) as *mut u32) }.load(Ordering::Acquire);
    assert_eq!(
        (c32(C32A), c32(C32B)),
        (1, 0),
        "the 32-bit add wrapped alone"
    );
    proxy.check().unwrap();

    // A record the receiver cannot apply comes back through flush.
    let far = {
        let info = MemoryInfo {
            owner_ptr: 0x1000,
            ..dst.info().clone()
        };
        RegisteredMemory::local(info, None)
    };
    conn.atomic_add(&far, 8, 1, AtomicWidth::U64).unwrap();
    let e = conn.flush(T).unwrap_err().to_string();
    assert!(e.contains("not inside a region"), "{e}");
    proxy.stop().unwrap();
}
