//! Host-only proxy benchmark: how long the proxy thread needs per trigger when
//! the producer is a host thread and the connection does nothing. Compared
//! with comm_bench's `fifo_proxy_service_us` (GPU producer, same proxy), it
//! separates the proxy's own software cost from the cost of GPU writes to and
//! reads of host-mapped memory.
//!
//!     cargo run --release -p moelink-benches --bin proxy_cpu_bench

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::device_handles::{trigger_type as tt, ProxyTrigger};
use comm::proxy::ProxyService;
use comm::registered_memory::{Location, MemoryInfo, RegisteredMemory};
use comm::transport::{AtomicWidth, Connection, Transport};

#[derive(Debug)]
struct Null;

impl Connection for Null {
    fn transport(&self) -> Transport {
        Transport::Ethernet
    }
    fn remote_rank(&self) -> usize {
        1
    }
    fn write(
        &self,
        _: &RegisteredMemory,
        _: u64,
        _: &RegisteredMemory,
        _: u64,
        _: u64,
    ) -> comm::Result<()> {
        Ok(())
    }
    fn update_and_sync(&self, _: &RegisteredMemory, _: u64, _: u64) -> comm::Result<()> {
        Ok(())
    }
    fn atomic_add(&self, _: &RegisteredMemory, _: u64, _: i64, _: AtomicWidth) -> comm::Result<()> {
        Ok(())
    }
    fn flush(&self, _: Duration) -> comm::Result<()> {
        Ok(())
    }
}

fn mem(rank: u32) -> RegisteredMemory {
    RegisteredMemory::local(
        MemoryInfo {
            rank,
            len: 1 << 20,
            location: Location::Host,
            host_id: 0,
            owner_ptr: 0x1000,
            ipc: None,
            ethernet: None,
        },
        None,
    )
}

fn main() -> comm::Result<()> {
    let n = 1_000_000u64;
    let mut samples = Vec::new();
    for _ in 0..7 {
        let mut proxy = ProxyService::new(0, None, 1024, 0)?;
        let m = proxy.add_memory(mem(0))?;
        let ch = proxy.add_channel(Arc::new(Null), mem(1), 0)?;
        proxy.start()?;
        let p = proxy.fifo().host_producer()?;
        let t0 = Instant::now();
        let mut last = 0;
        for _ in 0..n {
            last = p.push(
                ProxyTrigger::data(tt::DATA, ch, m, 0, m, 0, 0),
                Duration::from_secs(10),
            )?;
        }
        p.sync(last, Duration::from_secs(10))?;
        samples.push(t0.elapsed().as_secs_f64() * 1e9 / n as f64);
        proxy.check()?;
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "proxy service per no-op trigger, host producer: median {:.0} ns (min {:.0}, max {:.0}; {} triggers x {} runs)",
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1],
        n,
        samples.len()
    );
    Ok(())
}
