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
use comm::proxy::testing::{fake_host_memory, TestConnection};
use comm::proxy::ProxyService;

fn main() -> comm::Result<()> {
    let n = 1_000_000u64;
    let mut samples = Vec::new();
    for _ in 0..7 {
        let mut proxy = ProxyService::new(0, None, 1024, 0)?;
        let m = proxy.add_memory(fake_host_memory(0, 1 << 20))?;
        let null = Arc::new(TestConnection::default());
        let ch = proxy.add_channel(null, fake_host_memory(1, 1 << 20), 0)?;
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
