//! Host-only proxy benchmark: how long the proxy thread needs per trigger when
//! the producer is a host thread and the connection does nothing. Compared
//! with comm_bench's `fifo_proxy_service_us` (GPU producer, same proxy), it
//! separates the proxy's own software cost from the cost of GPU writes to and
//! reads of host-mapped memory.
//!
//!     cargo run --release -p moelink-benches --bin proxy_cpu_bench
//!
//! Two numbers, each the median of 7 runs:
//! - `streaming`: a host thread pushes 1 M put triggers into a 1024-slot ring
//!   while the proxy pops them (the producer and the proxy on their own
//!   cores, sharing the ring's cache lines, as a GPU producer would);
//! - `drain`: 1 M triggers are pushed into a ring of 1 M slots before the proxy
//!   starts, then timed until it has performed them all: the proxy's own cost
//!   per trigger, with no producer running beside it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::device_handles::{trigger_type as tt, ProxyTrigger};
use comm::proxy::testing::{fake_host_memory, TestConnection};
use comm::proxy::ProxyService;

const N: u64 = 1_000_000;
const RUNS: usize = 7;

/// A proxy with one memory and one no-op channel (not started) and the
/// trigger to push: `(proxy, trigger)`.
fn proxy(slots: usize) -> comm::Result<(ProxyService, ProxyTrigger)> {
    let proxy = ProxyService::new(0, None, slots, 0)?;
    let m = proxy.add_memory(fake_host_memory(0, 1 << 20))?;
    let null = Arc::new(TestConnection::default());
    let ch = proxy.add_channel(null, fake_host_memory(1, 1 << 20), 0)?;
    Ok((proxy, ProxyTrigger::data(tt::DATA, ch, m, 0, m, 0, 0)))
}

/// ns per trigger, producer and proxy running together.
fn streaming() -> comm::Result<f64> {
    let (mut proxy, t) = proxy(1024)?;
    proxy.start()?;
    let p = proxy.fifo().host_producer()?;
    let t0 = Instant::now();
    let mut last = 0;
    for _ in 0..N {
        last = p.push(t, Duration::from_secs(10))?;
    }
    p.sync(last, Duration::from_secs(10))?;
    let ns = t0.elapsed().as_secs_f64() * 1e9 / N as f64;
    proxy.check()?;
    Ok(ns)
}

/// ns per trigger of the proxy alone, draining a ring filled beforehand.
fn drain() -> comm::Result<f64> {
    let (mut proxy, t) = proxy(N as usize)?;
    {
        let p = proxy.fifo().host_producer()?;
        for _ in 0..N {
            p.push(t, Duration::from_secs(10))?;
        }
    }
    let t0 = Instant::now();
    proxy.start()?;
    // Polled rarely: the loads must not steal the line the proxy writes.
    while proxy.processed() < N {
        std::thread::sleep(Duration::from_micros(100));
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(comm::CommError::invalid("proxy", "did not drain"));
        }
    }
    let ns = t0.elapsed().as_secs_f64() * 1e9 / N as f64;
    proxy.check()?;
    Ok(ns)
}

fn report(what: &str, run: fn() -> comm::Result<f64>) -> comm::Result<()> {
    let mut samples = (0..RUNS).map(|_| run()).collect::<comm::Result<Vec<_>>>()?;
    samples.sort_by(f64::total_cmp);
    println!(
        "proxy per no-op trigger, host producer, {what}: median {:.0} ns (min {:.0}, max {:.0}; {N} triggers x {RUNS} runs)",
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1],
    );
    Ok(())
}

fn main() -> comm::Result<()> {
    report("streaming", streaming)?;
    report("drain", drain)?;
    Ok(())
}
