//! `ProxyPool`: several [`ProxyService`]s of one rank and GPU, each a thread
//! bound to that GPU with a FIFO of its own, and the placement of port
//! channels on them.
//!
//! A trigger is performed by the service whose FIFO it was pushed into, so a
//! channel lives on exactly one service: its operations keep their order and
//! a flush on it still covers everything before it on that channel. Across
//! services nothing is ordered. [`Placement::ByPeer`] (the default) puts all
//! of one peer's channels on service `peer % threads`, so operations towards
//! one peer also keep the order they were pushed in across channels, as with
//! a single proxy; [`Placement::RoundRobin`] spreads channels evenly, for
//! callers that never rely on cross-channel order.
//!
//! The number of threads comes from the caller or from
//! `MOELINK_PROXY_THREADS` ([`ProxyPool::threads_from_env`], default 1).
//! Memories are registered per service (ids are per service: a port channel
//! carries the ids of the service it lives on, with that service's FIFO).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::cuda::Device;
use crate::device_handles::FifoDeviceHandle;
use crate::error::{CommError, Result};
use crate::proxy::{ChannelProgress, ProxyService};
use crate::registered_memory::RegisteredMemory;
use crate::transport::Connection;

/// The environment variable with the number of proxy threads of a pool.
pub const PROXY_THREADS_ENV: &str = "MOELINK_PROXY_THREADS";

/// The most proxy threads one pool runs.
pub const MAX_PROXY_THREADS: usize = 32;

/// Where a pool puts a new channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Service `peer % threads`: one peer's channels share a FIFO.
    #[default]
    ByPeer,
    /// The services in turn, whatever the peer.
    RoundRobin,
}

/// A channel of a pool: the service it lives on and its id there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PooledChannel {
    pub service: usize,
    pub channel: u32,
}

#[derive(Debug)]
pub struct ProxyPool {
    services: Vec<ProxyService>,
    placement: Placement,
    /// Channels placed so far (round robin's turn).
    placed: AtomicUsize,
}

impl ProxyPool {
    /// `threads` proxies of rank `rank` for producers on `device` (None: host
    /// producers, for tests), each with a FIFO of `fifo_size` slots; service
    /// `i`'s FIFO has id `first_id + i` (what error records name).
    pub fn new(
        rank: usize,
        device: Option<Device>,
        threads: usize,
        fifo_size: usize,
        first_id: u64,
        placement: Placement,
    ) -> Result<Self> {
        check_threads(threads)?;
        let services = (0..threads)
            .map(|i| ProxyService::new(rank, device, fifo_size, first_id + i as u64))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            services,
            placement,
            placed: AtomicUsize::new(0),
        })
    }

    /// `MOELINK_PROXY_THREADS` (unset or empty: 1); anything but an integer
    /// in 1..=[`MAX_PROXY_THREADS`] is refused naming the variable.
    pub fn threads_from_env() -> Result<usize> {
        parse_threads(crate::env::var(PROXY_THREADS_ENV).as_deref())
    }

    /// How many services (threads) the pool has.
    pub fn threads(&self) -> usize {
        self.services.len()
    }

    pub fn services(&self) -> &[ProxyService] {
        &self.services
    }

    /// Service `i` (panics when out of range, like indexing).
    pub fn service(&self, i: usize) -> &ProxyService {
        &self.services[i]
    }

    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The service a new channel to `peer` goes to (round robin: advances
    /// the turn).
    pub fn place(&self, peer: usize) -> usize {
        match self.placement {
            Placement::ByPeer => peer % self.services.len(),
            Placement::RoundRobin => {
                self.placed.fetch_add(1, Ordering::Relaxed) % self.services.len()
            }
        }
    }

    /// Registers memory on service `service`; returns its id there.
    pub fn add_memory(&self, service: usize, m: RegisteredMemory) -> Result<u32> {
        self.get(service)?.add_memory(m)
    }

    /// Registers a port channel to `peer` on the service [`place`](Self::place)
    /// picks (see [`ProxyService::add_channel`]).
    pub fn add_channel(
        &self,
        peer: usize,
        connection: Arc<dyn Connection>,
        remote_semaphore: RegisteredMemory,
        remote_offset: u64,
    ) -> Result<PooledChannel> {
        let service = self.place(peer);
        let channel =
            self.services[service].add_channel(connection, remote_semaphore, remote_offset)?;
        Ok(PooledChannel { service, channel })
    }

    /// The FIFO of service `service`, for the port channels living there.
    pub fn fifo_handle(&self, service: usize) -> Result<FifoDeviceHandle> {
        Ok(self.get(service)?.fifo_handle())
    }

    pub fn set_flush_timeout(&mut self, t: Duration) {
        for s in &mut self.services {
            s.set_flush_timeout(t);
        }
    }

    /// Starts every service's thread (each binds the GPU first). On a
    /// failure the ones started are stopped again.
    pub fn start(&mut self) -> Result<()> {
        for i in 0..self.services.len() {
            if let Err(e) = self.services[i].start() {
                for s in &mut self.services[..i] {
                    let _ = s.stop();
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Stops every service (see [`ProxyService::stop`]); the first failure is
    /// returned after all were asked to stop.
    pub fn stop(&mut self) -> Result<()> {
        let mut first = Ok(());
        for s in &mut self.services {
            let r = s.stop();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Triggers performed so far, all services together.
    pub fn processed(&self) -> u64 {
        self.services.iter().map(ProxyService::processed).sum()
    }

    /// The service whose FIFO has id `fifo_id` (a port channel's
    /// `fifo.id`): where that channel lives.
    pub fn service_of_fifo(&self, fifo_id: u64) -> Option<usize> {
        self.services
            .iter()
            .position(|s| s.fifo_handle().id == fifo_id)
    }

    /// How far `c` got (None: no such channel).
    pub fn channel_state(&self, c: PooledChannel) -> Option<ChannelProgress> {
        self.services.get(c.service)?.channel_state(c.channel)
    }

    /// The first error of the lowest-numbered service that hit one (each
    /// keeps its own first error), naming the service.
    pub fn check(&self) -> Result<()> {
        for (i, s) in self.services.iter().enumerate() {
            if let Err(e) = s.check() {
                return Err(CommError::invalid(
                    "proxy pool",
                    format!("service {i} of {}: {e}", self.services.len()),
                ));
            }
        }
        Ok(())
    }

    fn get(&self, service: usize) -> Result<&ProxyService> {
        self.services.get(service).ok_or_else(|| {
            CommError::invalid(
                "service",
                format!("{service}: the pool has {} services", self.services.len()),
            )
        })
    }
}

fn check_threads(threads: usize) -> Result<()> {
    if threads == 0 || threads > MAX_PROXY_THREADS {
        return Err(CommError::invalid(
            "proxy threads",
            format!("{threads} (1..={MAX_PROXY_THREADS})"),
        ));
    }
    Ok(())
}

/// The value of `MOELINK_PROXY_THREADS` (None: unset).
fn parse_threads(text: Option<&str>) -> Result<usize> {
    let text = text.unwrap_or("").trim();
    if text.is_empty() {
        return Ok(1);
    }
    text.parse::<usize>()
        .ok()
        .filter(|n| check_threads(*n).is_ok())
        .ok_or_else(|| {
            CommError::invalid(
                PROXY_THREADS_ENV,
                format!("{text:?}: expected an integer in 1..={MAX_PROXY_THREADS}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_is_parsed_and_checked() {
        assert_eq!(parse_threads(None).unwrap(), 1);
        assert_eq!(parse_threads(Some(" ")).unwrap(), 1);
        assert_eq!(parse_threads(Some("4")).unwrap(), 4);
        assert_eq!(parse_threads(Some(" 32 ")).unwrap(), 32);
        for bad in ["0", "33", "-1", "two", "1.5"] {
            let e = parse_threads(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(PROXY_THREADS_ENV) && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn placement_by_peer_and_round_robin() {
        let pool = ProxyPool::new(0, None, 3, 8, 0, Placement::ByPeer).unwrap();
        let by_peer: Vec<usize> = (0..7).map(|p| pool.place(p)).collect();
        assert_eq!(by_peer, [0, 1, 2, 0, 1, 2, 0]);
        let pool = ProxyPool::new(0, None, 3, 8, 0, Placement::RoundRobin).unwrap();
        let rr: Vec<usize> = [5, 5, 5, 5, 0].iter().map(|&p| pool.place(p)).collect();
        assert_eq!(rr, [0, 1, 2, 0, 1]);
        assert!(ProxyPool::new(0, None, 0, 8, 0, Placement::ByPeer).is_err());
        assert!(ProxyPool::new(0, None, MAX_PROXY_THREADS + 1, 8, 0, Placement::ByPeer).is_err());
        assert!(pool
            .add_memory(3, crate::proxy::testing::fake_host_memory(0, 8))
            .is_err());
    }
}
