//! [`Group`]: what every object made on one process group shares (issue 16).
//!
//! Today: one bootstrap. Every Buffer half and every AllReduce made on the
//! group gets its own [`ScopedBootstrap`] on it, so a torch process group needs
//! one unique-id broadcast and one set of TCP connections however many objects
//! it serves. (Later: one Communicator and the peers' topology.)
//!
//! Objects are made collectively and in the same order on every rank, as NCCL
//! communicators and DeepEP buffers are: the n-th object of a group gets scope n
//! on every rank. [`Group::scope`] checks that the ranks agree (an all_gather in
//! the group's own scope 0) and names the ranks that do not, instead of letting
//! their messages miss each other until a timeout.

use std::sync::{Arc, Mutex};

use crate::bootstrap::{Bootstrap, ScopedBootstrap};
use crate::error::{CommError, Result};

/// The shared bootstrap of one process group and the count of objects made on
/// it. `Send + Sync`: objects may be made from any thread, one at a time.
pub struct Group {
    root: Arc<dyn Bootstrap>,
    /// Scope 0: the group's own collectives (the agreement check).
    control: ScopedBootstrap,
    /// Scopes handed out so far (the next object gets `made + 1`).
    made: Mutex<u64>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("objects", &self.objects())
            .finish()
    }
}

/// Longest object kind name sent in the agreement check.
const MAX_KIND: usize = 64;

impl Group {
    pub fn new(root: Arc<dyn Bootstrap>) -> Result<Self> {
        let control = ScopedBootstrap::new(root.clone(), 0)?;
        Ok(Self {
            root,
            control,
            made: Mutex::new(0),
        })
    }

    pub fn rank(&self) -> usize {
        self.root.rank()
    }

    pub fn size(&self) -> usize {
        self.root.size()
    }

    /// Objects made on this group so far.
    pub fn objects(&self) -> u64 {
        *self.made.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// *Collective.* The tag space of the next object made on this group, an
    /// object of kind `kind` ("intranode buffer", "allreduce", ...). Every rank
    /// must make the same objects in the same order: where the ranks' counts or
    /// kinds differ, every rank gets `InvalidArgument` naming them (and the
    /// count does not advance).
    pub fn scope(&self, kind: &str) -> Result<ScopedBootstrap> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        let next = *made + 1;
        let kind = &kind.as_bytes()[..kind.len().min(MAX_KIND)];
        let mut msg = next.to_le_bytes().to_vec();
        msg.extend_from_slice(kind);
        let all = self.control.all_gather(&msg)?;
        let parse = |m: &[u8]| -> (u64, String) {
            let mut n = [0u8; 8];
            let k = m.len().min(8);
            n[..k].copy_from_slice(&m[..k]);
            let name = String::from_utf8_lossy(m.get(8..).unwrap_or(&[])).into_owned();
            (u64::from_le_bytes(n), name)
        };
        let mine = parse(&msg);
        let differ: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| parse(m) != mine)
            .map(|(p, m)| {
                let (n, k) = parse(m);
                format!("rank {p} makes its object #{n} ({k})")
            })
            .collect();
        if !differ.is_empty() {
            return Err(CommError::invalid(
                "group",
                format!(
                    "ranks make objects on this group in different orders: rank {} makes its \
                     object #{next} ({}), {}; make every Buffer and AllReduce of a group on \
                     every rank, in the same order",
                    self.rank(),
                    mine.1,
                    differ.join(", ")
                ),
            ));
        }
        let scoped = ScopedBootstrap::new(self.root.clone(), next)?;
        *made = next;
        Ok(scoped)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::testing::on_ranks;

    #[test]
    fn objects_get_the_same_scopes_and_separate_tag_spaces() {
        let got = on_ranks(3, Duration::from_secs(20), |rank, boot| {
            let g = Group::new(boot).unwrap();
            let a = g.scope("intranode buffer").unwrap();
            let b = g.scope("allreduce").unwrap();
            // The same tag in both objects, sent in opposite orders by odd and
            // even ranks; each object's collective gathers its own parts.
            let next = (rank + 1) % 3;
            let (first, second) = if rank % 2 == 1 { (&b, &a) } else { (&a, &b) };
            first.send(next, 7, &[first.scope() as u8]).unwrap();
            second.send(next, 7, &[second.scope() as u8]).unwrap();
            let ga = a.all_gather(&[10 + rank as u8]).unwrap();
            let gb = b.all_gather(&[20 + rank as u8]).unwrap();
            let prev = (rank + 2) % 3;
            assert_eq!(b.recv(prev, 7).unwrap(), vec![2]);
            assert_eq!(a.recv(prev, 7).unwrap(), vec![1]);
            (a.scope(), b.scope(), g.objects(), ga, gb)
        });
        for (rank, (sa, sb, n, ga, gb)) in got.into_iter().enumerate() {
            assert_eq!((sa, sb, n), (1, 2, 2), "rank {rank}");
            assert_eq!(ga, vec![vec![10], vec![11], vec![12]]);
            assert_eq!(gb, vec![vec![20], vec![21], vec![22]]);
        }
    }

    #[test]
    fn ranks_that_make_different_objects_are_named_on_every_rank() {
        let got = on_ranks(2, Duration::from_secs(20), |rank, boot| {
            let g = Group::new(boot).unwrap();
            let kind = if rank == 0 {
                "allreduce"
            } else {
                "intranode buffer"
            };
            let e = g.scope(kind).unwrap_err().to_string();
            // The count did not advance: the next agreed object is #1.
            let ok = g.scope("low-latency buffer").map(|s| s.scope());
            (e, ok.unwrap(), g.objects())
        });
        for (rank, (e, scope, n)) in got.into_iter().enumerate() {
            let other = 1 - rank;
            assert!(
                e.contains(&format!("rank {other} makes its object #1")),
                "{e}"
            );
            assert!(
                e.contains("allreduce") && e.contains("intranode buffer"),
                "{e}"
            );
            assert_eq!((scope, n), (1, 1), "rank {rank}");
        }
    }

    #[test]
    fn an_object_made_on_one_rank_only_times_out_and_says_so() {
        let got = on_ranks(2, Duration::from_secs(1), |rank, boot| {
            let g = Group::new(boot).unwrap();
            if rank == 0 {
                // Stay connected past rank 1's bound, making nothing.
                std::thread::sleep(Duration::from_millis(2500));
                return (String::new(), g.objects());
            }
            let e = g.scope("allreduce").unwrap_err().to_string();
            (e, g.objects())
        });
        let (e, n) = &got[1];
        assert!(e.contains("all_gather") && e.contains("scope 0"), "{e}");
        assert_eq!(*n, 0);
    }
}
