//! One object's view of a bootstrap that several objects share (the
//! Group: one bootstrap per torch process group, under every Buffer and
//! AllReduce made on it).
//!
//! A shared bootstrap alone would let one object's collective pair with
//! another object's on a peer: a `destroy` barrier that runs when a rank's
//! garbage collector gets to it, say, against another rank's all_gather in a
//! constructor. A [`ScopedBootstrap`] gives its object a tag space of its own,
//! for its point-to-point tags and for its all_gather / barrier call numbers,
//! so messages of different scopes never meet. Scopes must be the same on
//! every rank for the same object: take them from a counter that advances at
//! each (collective, ordered) object creation.
//!
//! Tags on the shared bootstrap (its user tags: the top bit stays clear):
//! bit 62 set, the scope in bits 40..62, the kind (0 point-to-point, 1
//! all_gather, 2 barrier) in bits 38..40, the caller's tag or the call number
//! in bits 0..38.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Bootstrap;
use crate::error::{CommError, Result};

const SCOPED: u64 = 1 << 62;
const SCOPE_SHIFT: u32 = 40;
const KIND_SHIFT: u32 = 38;
const LOW_MASK: u64 = (1 << KIND_SHIFT) - 1;
const KIND_USER: u64 = 0;
const KIND_ALL_GATHER: u64 = 1;
const KIND_BARRIER: u64 = 2;

/// One object's tag space on a shared [`Bootstrap`]; itself a [`Bootstrap`].
pub struct ScopedBootstrap {
    inner: Arc<dyn Bootstrap>,
    scope: u64,
    gather_seq: AtomicU64,
    barrier_seq: AtomicU64,
}

impl std::fmt::Debug for ScopedBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedBootstrap")
            .field("rank", &self.inner.rank())
            .field("size", &self.inner.size())
            .field("scope", &self.scope)
            .finish()
    }
}

impl ScopedBootstrap {
    /// The largest scope.
    pub const MAX_SCOPE: u64 = (1 << (62 - SCOPE_SHIFT)) - 1;
    /// The largest point-to-point tag a scoped view takes.
    pub const MAX_TAG: u64 = LOW_MASK;

    /// Scope `scope` of `inner` (`InvalidArgument` above [`Self::MAX_SCOPE`]).
    pub fn new(inner: Arc<dyn Bootstrap>, scope: u64) -> Result<Self> {
        if scope > Self::MAX_SCOPE {
            return Err(CommError::invalid(
                "scope",
                format!("{scope} is above {}", Self::MAX_SCOPE),
            ));
        }
        Ok(Self {
            inner,
            scope,
            gather_seq: AtomicU64::new(0),
            barrier_seq: AtomicU64::new(0),
        })
    }

    pub fn scope(&self) -> u64 {
        self.scope
    }

    fn tag(&self, kind: u64, low: u64) -> u64 {
        SCOPED | (self.scope << SCOPE_SHIFT) | (kind << KIND_SHIFT) | (low & LOW_MASK)
    }

    fn check_tag(&self, tag: u64) -> Result<()> {
        if tag > Self::MAX_TAG {
            return Err(CommError::invalid(
                "tag",
                format!(
                    "{tag:#x} is above {:#x}, the largest tag of a scoped bootstrap",
                    Self::MAX_TAG
                ),
            ));
        }
        Ok(())
    }

    /// The inner error, with a timeout saying which scope and call it was.
    fn named(&self, e: CommError, what: impl FnOnce() -> String) -> CommError {
        match e {
            CommError::Timeout {
                rank, waited_ms, ..
            } => CommError::Timeout {
                rank,
                what: what(),
                waited_ms,
            },
            e => e,
        }
    }

    /// Sends `data` to every other rank under a fresh tag of `kind`, gathers
    /// theirs (ours at our index). Bounded by the inner bootstrap's timeout:
    /// the first peer whose part does not come ends it.
    fn exchange(&self, kind: u64, seq: u64, data: &[u8], call: &str) -> Result<Vec<Vec<u8>>> {
        let (rank, size) = (self.inner.rank(), self.inner.size());
        let tag = self.tag(kind, seq);
        for k in 1..size {
            self.inner.send((rank + k) % size, tag, data)?;
        }
        (0..size)
            .map(|p| {
                if p == rank {
                    Ok(data.to_vec())
                } else {
                    self.inner.recv(p, tag).map_err(|e| {
                        self.named(e, || {
                            format!(
                                "rank {p}'s part of {call} #{seq} (bootstrap scope {})",
                                self.scope
                            )
                        })
                    })
                }
            })
            .collect()
    }
}

impl Bootstrap for ScopedBootstrap {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.check_tag(tag)?;
        self.inner.send(peer, self.tag(KIND_USER, tag), data)
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        self.check_tag(tag)?;
        self.inner
            .recv(peer, self.tag(KIND_USER, tag))
            .map_err(|e| {
                self.named(e, || {
                    format!(
                        "a message from rank {peer} with tag {tag} (bootstrap scope {})",
                        self.scope
                    )
                })
            })
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.gather_seq.fetch_add(1, Ordering::Relaxed);
        self.exchange(KIND_ALL_GATHER, seq, data, "all_gather")
    }

    fn barrier(&self) -> Result<()> {
        let seq = self.barrier_seq.fetch_add(1, Ordering::Relaxed);
        self.exchange(KIND_BARRIER, seq, &[], "barrier").map(drop)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::testing::on_ranks;

    #[test]
    fn scopes_on_one_bootstrap_never_take_each_others_messages() {
        // The same point-to-point tag in two scopes, sent in opposite orders by
        // the two ranks; then each scope's collectives (in one order: they wait).
        let got = on_ranks(2, Duration::from_secs(20), |rank, boot| {
            let a = ScopedBootstrap::new(boot.clone(), 1).unwrap();
            let b = ScopedBootstrap::new(boot, 2).unwrap();
            let peer = 1 - rank;
            let (first, second) = if rank == 0 { (&a, &b) } else { (&b, &a) };
            first
                .send(peer, 5, &[first.scope() as u8, rank as u8])
                .unwrap();
            second
                .send(peer, 5, &[second.scope() as u8, rank as u8])
                .unwrap();
            let ga = a.all_gather(&[10 + rank as u8]).unwrap();
            let gb = b.all_gather(&[20 + rank as u8]).unwrap();
            a.barrier().unwrap();
            b.barrier().unwrap();
            let rb = b.recv(peer, 5).unwrap();
            let ra = a.recv(peer, 5).unwrap();
            (ga, gb, ra, rb)
        });
        for (rank, (ga, gb, ra, rb)) in got.into_iter().enumerate() {
            assert_eq!(ga, vec![vec![10], vec![11]], "rank {rank}, scope 1");
            assert_eq!(gb, vec![vec![20], vec![21]], "rank {rank}, scope 2");
            assert_eq!(ra, vec![1, 1 - rank as u8]);
            assert_eq!(rb, vec![2, 1 - rank as u8]);
        }
    }

    #[test]
    fn objects_out_of_step_fail_instead_of_swapping_data() {
        // Rank 0's object A and rank 1's object B each gather at once. On the
        // bare shared bootstrap the two calls pair up: each rank takes the
        // other object's data as its own. Scoped, each waits for its own
        // object on the peer and times out, naming the scope.
        let got = on_ranks(2, Duration::from_millis(500), |rank, boot| {
            let bare = boot.all_gather(&[b'A' + rank as u8]).unwrap();
            let scoped = ScopedBootstrap::new(boot, 1 + rank as u64).unwrap();
            let e = scoped.all_gather(&[rank as u8]).unwrap_err();
            // Stay connected until the peer has timed out too: leaving first
            // would make its wait end with "shut down" instead (seen under load).
            std::thread::sleep(Duration::from_millis(1500));
            (bare, e.to_string())
        });
        assert_eq!(got[0].0, vec![b"A".to_vec(), b"B".to_vec()]);
        assert!(
            got[0]
                .1
                .contains("rank 1's part of all_gather #0 (bootstrap scope 1)"),
            "{}",
            got[0].1
        );
        assert!(
            got[1]
                .1
                .contains("rank 0's part of all_gather #0 (bootstrap scope 2)"),
            "{}",
            got[1].1
        );
    }

    #[test]
    fn a_missing_peer_is_named_with_the_scope() {
        let got = on_ranks(2, Duration::from_millis(300), |rank, boot| {
            let s = ScopedBootstrap::new(boot, 7).unwrap();
            if rank == 0 {
                Some(s.barrier().unwrap_err().to_string())
            } else {
                // Rank 1 never enters scope 7's barrier; it stays until rank 0 gave up.
                std::thread::sleep(Duration::from_millis(1500));
                None
            }
        });
        let msg = got[0].clone().unwrap();
        assert!(
            msg.starts_with(
                "rank 0 timed out waiting for rank 1's part of barrier #0 (bootstrap scope 7)"
            ),
            "{msg}"
        );
    }

    #[test]
    fn communicators_of_two_scopes_set_up_on_one_bootstrap() {
        // What a Group will do: each object's Communicator on its own scope of
        // the group's one bootstrap (CPU-only Communicators: no device).
        let got = on_ranks(2, Duration::from_secs(20), |_, boot| {
            let make = |scope| {
                let view: Arc<dyn Bootstrap> =
                    Arc::new(ScopedBootstrap::new(boot.clone(), scope).unwrap());
                crate::Communicator::new(view, None, crate::CommunicatorOptions::default()).unwrap()
            };
            let (a, b) = (make(1), make(2));
            a.barrier().unwrap();
            b.barrier().unwrap();
            (a.rank(), a.size(), b.rank(), b.size())
        });
        assert_eq!(got, vec![(0, 2, 0, 2), (1, 2, 1, 2)]);
    }

    #[test]
    fn tags_and_scopes_out_of_range_are_refused() {
        let got = on_ranks(1, Duration::from_secs(5), |_, boot| {
            assert!(ScopedBootstrap::new(boot.clone(), ScopedBootstrap::MAX_SCOPE + 1).is_err());
            let s = ScopedBootstrap::new(boot, ScopedBootstrap::MAX_SCOPE).unwrap();
            let e = s.send(0, ScopedBootstrap::MAX_TAG + 1, b"x").unwrap_err();
            assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
            s.send(0, ScopedBootstrap::MAX_TAG, b"x").unwrap();
            s.recv(0, ScopedBootstrap::MAX_TAG).unwrap()
        });
        assert_eq!(got, vec![b"x".to_vec()]);
    }
}
