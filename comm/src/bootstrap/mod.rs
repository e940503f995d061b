//! Bootstrap: how ranks find each other and exchange small messages (memory
//! handles, addresses, ids) before any GPU channel exists.

mod scoped;
mod tcp;
#[cfg(test)]
pub(crate) mod testing;

pub use scoped::ScopedBootstrap;
pub use tcp::{TcpBootstrap, UniqueId};

use crate::error::Result;

/// Point-to-point and collective exchange of small byte messages between the
/// ranks of one job. Every blocking call is bounded by the implementation's
/// timeout and fails with `CommError::Timeout` naming the rank and what it
/// waited for.
pub trait Bootstrap: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `data` to `peer` under `tag`; does not wait for the peer to receive.
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receives the next message `peer` sent under `tag` (messages of one
    /// (peer, tag) pair arrive in order; other tags may be pending meanwhile).
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>>;
    /// Every rank's `data`, indexed by rank (ours included).
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
}
