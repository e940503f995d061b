//! [`Group`]: what every object made on one process group shares:
//! one bootstrap and one [`Communicator`] (so one fd server, one Ethernet
//! receiver, one set of signal pages, one [`Topology`](crate::Topology) and
//! [`DeviceShare`](crate::DeviceShare)), however many objects (Buffer halves,
//! AllReduce) are made on it.
//!
//! # Making objects
//!
//! Objects are made collectively and in the same order on every rank, as NCCL
//! communicators and DeepEP buffers are: the n-th object of a group is object
//! #n on every rank. [`Group::join`] (or [`Group::scope`], for an object that
//! does not use the group's Communicator) checks that the ranks agree (an
//! all_gather in the group's own scope 0) and names the ranks that do not,
//! instead of letting their messages miss each other until a timeout.
//!
//! Within a process, a group makes one object at a time: `join` waits (at
//! most the group's timeout) while another thread is making an object on the
//! same group, from its `join` until its [`Member::ready`] (or until its
//! [`Member`] is dropped). Python makes objects one at a time anyway; the wait
//! makes the rule hold for any Rust caller.
//!
//! # The shared Communicator
//!
//! The group's Communicator is made by [`Group::communicator`], collectively,
//! the first time an object asks for it (so by the first object of every
//! rank; [`Group::join`] asks), with that caller's device and options, and is
//! shared by every later object:
//! - every later call must name the same device (else `InvalidArgument`);
//! - the first caller's options decide: its `timeout` bounds the shared
//!   Communicator's host waits (peer imports, connects), its
//!   `semaphore_slots` sizes each signal page (pages are added as needed, so it
//!   bounds nothing), and an Ethernet receiver runs only if it asked for one.
//!   A later call that asks for Ethernet where none runs gets
//!   `InvalidArgument` (nothing can be started later: the memory registered
//!   so far would not be reachable over it); a program that needs Ethernet
//!   asks for it with the first object, or calls `communicator` before making
//!   any object;
//! - if making it fails, the object that asked fails; the next object of the
//!   group tries again (on every rank), never the same object twice.
//!
//! # Whose collectives run where
//!
//! - Setup exchanges (memory exchanges, semaphores, channels) go through the
//!   shared Communicator, which numbers them on its own tags (a scope of the
//!   bootstrap of its own: `COMM_SCOPE_BASE` + the number of the object that
//!   made it). They are made only while an object is being made: one object
//!   at a time per process, in the same order on every rank, so they pair up.
//! - Runtime collectives of an object (its `barrier()`, a barrier before
//!   destroying or deregistering something, the low-latency `clean()`, the
//!   allreduce's registrations) may run at any time, from any thread, while
//!   another object does the same or is being made: they go through the
//!   object's own scope ([`Member::bootstrap`], scope #n for object #n), never
//!   through the shared Communicator.
//!
//! # What each object keeps for itself
//!
//! A [`Member`]: the shared Communicator, its scope, its own device error
//! record (the channel handles and kernel contexts it builds point there, so
//! an error one object's kernels record is reported by that object only), and
//! its own bound of device waits.
//!
//! Semaphore slots are never reused: those of a dropped object stay allocated
//! (32 bytes each) until the Communicator goes, with the group and its last
//! object.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::bootstrap::{Bootstrap, ScopedBootstrap};
use crate::communicator::{Communicator, CommunicatorOptions};
use crate::cuda::Device;
use crate::device_error::DeviceErrorRecord;
use crate::error::{check_device_timeout_ns, CommError, Result, DEFAULT_DEVICE_TIMEOUT_NS};

/// Objects a group can make: scopes 1..=MAX_OBJECTS are theirs; the
/// Communicator made while making object #n (0: before any) takes scope
/// `COMM_SCOPE_BASE + n`, so a failed attempt's messages never meet a later
/// attempt's.
pub const MAX_OBJECTS: u64 = COMM_SCOPE_BASE - 1;
/// Half of the scopes (`ScopedBootstrap::MAX_SCOPE` is 2^22 - 1).
const COMM_SCOPE_BASE: u64 = 1 << 21;
const _: () = assert!(COMM_SCOPE_BASE + MAX_OBJECTS <= ScopedBootstrap::MAX_SCOPE);

/// How long `join` waits for another thread's object by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest object kind name sent in the agreement check.
const MAX_KIND: usize = 64;

/// Which object, if any, a thread of this process is making on the group.
#[derive(Debug, Default)]
struct Making {
    now: Mutex<Option<String>>,
    done: Condvar,
}

/// Held while an object is being made; ends it on drop.
#[derive(Debug)]
struct MakingGuard {
    making: Arc<Making>,
}

impl Drop for MakingGuard {
    fn drop(&mut self) {
        *self.making.now.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.making.done.notify_all();
    }
}

#[derive(Debug, Default)]
struct Shared {
    comm: Option<Arc<Communicator>>,
    /// The object whose making made `comm`.
    made_by: u64,
    /// The object whose making failed to make it (not tried again for it).
    failed_at: Option<u64>,
}

/// The shared bootstrap and Communicator of one process group and the count of
/// objects made on it. `Send + Sync`: objects may be made from any thread, one
/// at a time (see the module's documentation).
pub struct Group {
    root: Arc<dyn Bootstrap>,
    /// Scope 0: the group's own collectives (the agreement check).
    control: ScopedBootstrap,
    /// Bound of the wait for another thread's object.
    timeout: Duration,
    /// Scopes handed out so far (the next object gets `made + 1`).
    made: Mutex<u64>,
    making: Arc<Making>,
    shared: Mutex<Shared>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("objects", &self.objects())
            .field("communicator", &self.shared_communicator().is_some())
            .finish()
    }
}

impl Group {
    /// A group over `root`; `join` waits at most [`DEFAULT_TIMEOUT`] for
    /// another thread's object.
    pub fn new(root: Arc<dyn Bootstrap>) -> Result<Self> {
        Self::with_timeout(root, DEFAULT_TIMEOUT)
    }

    /// A group over `root` whose `join` waits at most `timeout` for another
    /// thread's object (the bootstrap's own waits keep its own bound).
    pub fn with_timeout(root: Arc<dyn Bootstrap>, timeout: Duration) -> Result<Self> {
        let control = ScopedBootstrap::new(root.clone(), 0)?;
        Ok(Self {
            root,
            control,
            timeout,
            made: Mutex::new(0),
            making: Arc::new(Making::default()),
            shared: Mutex::new(Shared::default()),
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

    /// The group's Communicator, if an object made it already.
    pub fn shared_communicator(&self) -> Option<Arc<Communicator>> {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .comm
            .clone()
    }

    /// Waits (bounded) until no other thread makes an object on this group,
    /// then marks `kind` as being made.
    fn start_making(&self, kind: &str) -> Result<MakingGuard> {
        let start = Instant::now();
        let mut now = self.making.now.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(other) = now.as_ref() {
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(CommError::Timeout {
                    rank: self.rank() as i64,
                    what: format!(
                        "another thread of this process to finish making its {other} on this \
                         group before making a {kind} (a group makes one object at a time)"
                    ),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            now = self
                .making
                .done
                .wait_timeout(now, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *now = Some(kind.to_string());
        Ok(MakingGuard {
            making: self.making.clone(),
        })
    }

    /// *Collective.* The agreement check and the next object's number and scope.
    fn next_scope(&self, kind: &str) -> Result<(u64, ScopedBootstrap)> {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        let next = *made + 1;
        if next > MAX_OBJECTS {
            return Err(CommError::invalid(
                "group",
                format!("a group makes at most {MAX_OBJECTS} objects"),
            ));
        }
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
        Ok((next, scoped))
    }

    /// *Collective.* The tag space of the next object made on this group, an
    /// object of kind `kind` ("intranode buffer", "allreduce", ...) that does
    /// not use the group's Communicator (one that does: [`Group::join`]).
    /// Every rank must make the same objects in the same order: where the
    /// ranks' counts or kinds differ, every rank gets `InvalidArgument` naming
    /// them (and the count does not advance).
    pub fn scope(&self, kind: &str) -> Result<ScopedBootstrap> {
        let _making = self.start_making(kind)?;
        self.next_scope(kind).map(|(_, s)| s)
    }

    /// *Collective.* Starts making the next object of this group, of kind
    /// `kind`, on `device`: waits (bounded) for another thread's object,
    /// checks that the ranks agree (as [`Group::scope`]), and returns what the
    /// object keeps: the group's Communicator ([`Group::communicator`] with
    /// `device` and `opts`: made now if this is the first object), its own
    /// scope, device error record and device-wait bound. The object is being
    /// made until [`Member::ready`] or until the Member is dropped; meanwhile
    /// it may make setup exchanges on the shared Communicator.
    pub fn join(
        &self,
        kind: &str,
        device: Option<Device>,
        opts: &CommunicatorOptions,
    ) -> Result<Member> {
        let making = self.start_making(kind)?;
        let (number, scope) = self.next_scope(kind)?;
        let comm = self.communicator(device, opts)?;
        let error = DeviceErrorRecord::new(device)?;
        Ok(Member {
            comm,
            scope,
            number,
            kind: kind.to_string(),
            error,
            device_timeout_ns: DEFAULT_DEVICE_TIMEOUT_NS,
            making: Some(making),
        })
    }

    /// The group's Communicator on `device`. *Collective* the first time: it
    /// is made then, with `opts`, by every rank (every rank's first object asks
    /// for it, or a program calls this on every rank before making objects).
    /// Later calls return the same one; they must name the same device, and
    /// may not ask for Ethernet where the first did not (`InvalidArgument`
    /// naming what differs; see the module's documentation for how options
    /// combine).
    pub fn communicator(
        &self,
        device: Option<Device>,
        opts: &CommunicatorOptions,
    ) -> Result<Arc<Communicator>> {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(comm) = &shared.comm {
            self.check_compatible(comm, shared.made_by, device, opts)?;
            return Ok(comm.clone());
        }
        let n = self.objects();
        if shared.failed_at == Some(n) {
            return Err(CommError::invalid(
                "group",
                format!(
                    "rank {}: making the group's communicator failed while making object #{n}; \
                     it is tried again with the group's next object (on every rank)",
                    self.rank()
                ),
            ));
        }
        let scope = ScopedBootstrap::new(self.root.clone(), COMM_SCOPE_BASE + n)?;
        match Communicator::new(Arc::new(scope), device, opts.clone()) {
            Ok(comm) => {
                let comm = Arc::new(comm);
                shared.comm = Some(comm.clone());
                shared.made_by = n;
                Ok(comm)
            }
            Err(e) => {
                shared.failed_at = Some(n);
                Err(e)
            }
        }
    }

    fn check_compatible(
        &self,
        comm: &Communicator,
        made_by: u64,
        device: Option<Device>,
        opts: &CommunicatorOptions,
    ) -> Result<()> {
        let name = |d: Option<i32>| match d {
            Some(o) => format!("CUDA device {o}"),
            None => "no device".to_string(),
        };
        let (have, want) = (comm.device().map(|d| d.ordinal), device.map(|d| d.ordinal));
        let by = match made_by {
            0 => "before any object".to_string(),
            n => format!("by object #{n}"),
        };
        if have != want {
            return Err(CommError::invalid(
                "device",
                format!(
                    "rank {}: the group's communicator was made {by} on {}, this object asks \
                     for {}; every object of a group uses the same device",
                    self.rank(),
                    name(have),
                    name(want)
                ),
            ));
        }
        if opts.ethernet.is_some() && !comm.has_ethernet() {
            return Err(CommError::invalid(
                "ethernet",
                format!(
                    "rank {}: the group's communicator was made {by} without an Ethernet \
                     receiver; ask for Ethernet (CommunicatorOptions::ethernet) with the \
                     group's first object, or make the communicator with it before any object",
                    self.rank()
                ),
            ));
        }
        Ok(())
    }
}

/// What one object made on a [`Group`] keeps: the group's shared
/// Communicator, the object's own scope of the bootstrap (its runtime
/// collectives), its own device error record and its own bound of device
/// waits.
#[derive(Debug)]
pub struct Member {
    comm: Arc<Communicator>,
    scope: ScopedBootstrap,
    number: u64,
    kind: String,
    error: DeviceErrorRecord,
    device_timeout_ns: i64,
    /// Set while the object is being made.
    making: Option<MakingGuard>,
}

impl Member {
    /// The group's Communicator (shared: its collectives only while this
    /// object is being made).
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// This object's own scope of the group's bootstrap: its runtime
    /// collectives go here.
    pub fn bootstrap(&self) -> &ScopedBootstrap {
        &self.scope
    }

    pub fn rank(&self) -> usize {
        self.scope.rank()
    }

    pub fn size(&self) -> usize {
        self.scope.size()
    }

    /// The object's number in its group (the same on every rank; from 1).
    pub fn number(&self) -> u64 {
        self.number
    }

    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Whether the object is still being made (no [`ready`](Self::ready) yet).
    pub fn is_being_made(&self) -> bool {
        self.making.is_some()
    }

    /// This object's device error record: the `error` of every channel
    /// handle and kernel context it builds.
    pub fn device_error(&self) -> &DeviceErrorRecord {
        &self.error
    }

    /// Ok unless one of this object's kernels reported a failure (a rejected
    /// argument is reported once, a timeout every time).
    pub fn check_device(&self) -> Result<()> {
        self.error.check()
    }

    /// Ok unless one of this object's device waits timed out; leaves a
    /// rejected argument for [`check_device`](Self::check_device).
    pub fn check_device_timeout(&self) -> Result<()> {
        self.error.check_timeout()
    }

    /// Bound of this object's device waits, nanoseconds of GPU time.
    pub fn device_timeout_ns(&self) -> i64 {
        self.device_timeout_ns
    }

    /// Sets the bound of this object's device waits (positive; other objects
    /// of the group keep theirs).
    pub fn set_device_timeout_ns(&mut self, timeout_ns: i64) -> Result<()> {
        self.device_timeout_ns = check_device_timeout_ns(timeout_ns)?;
        Ok(())
    }

    /// *Collective.* A barrier of this object's ranks, in its own scope.
    pub fn barrier(&self) -> Result<()> {
        self.scope.barrier()
    }

    /// *Collective.* Ends the making of this object: a barrier in its own
    /// scope (every rank has finished its setup, e.g. mapped every peer's
    /// memory, before any uses the object), then the group may make its next
    /// object.
    pub fn ready(&mut self) -> Result<()> {
        self.scope.barrier()?;
        self.making = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bootstrap::testing::on_ranks;
    use crate::device_handles::{DeviceError, WaitKind, ERROR_TIMEOUT};

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

    /// Two ranks of a 1 s bound, each with its group: rank `idle` stays
    /// connected past the other's bound, making nothing (its result is
    /// `T::default()`); the other rank runs `f`.
    fn one_rank_idle<T: Default + Send + 'static>(
        idle: usize,
        f: impl Fn(&Group) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        on_ranks(2, Duration::from_secs(1), move |rank, boot| {
            let g = Group::new(boot).unwrap();
            if rank == idle {
                std::thread::sleep(Duration::from_millis(2500));
                return T::default();
            }
            f(&g)
        })
    }

    #[test]
    fn an_object_made_on_one_rank_only_times_out_and_says_so() {
        let got = one_rank_idle(0, |g| {
            let e = g.scope("allreduce").unwrap_err().to_string();
            (e, g.objects())
        });
        let (e, n) = &got[1];
        assert!(e.contains("all_gather") && e.contains("scope 0"), "{e}");
        assert_eq!(*n, 0);
    }

    #[test]
    fn objects_of_a_group_share_one_communicator() {
        let got = on_ranks(3, Duration::from_secs(20), |rank, boot| {
            let g = Group::new(boot).unwrap();
            assert!(g.shared_communicator().is_none());
            let opts = CommunicatorOptions::default();
            let mut a = g.join("intranode buffer", None, &opts).unwrap();
            a.ready().unwrap();
            let mut b = g.join("allreduce", None, &opts).unwrap();
            assert!(b.is_being_made());
            b.ready().unwrap();
            assert!(!b.is_being_made());
            let same = Arc::ptr_eq(a.comm(), b.comm())
                && Arc::ptr_eq(a.comm(), &g.shared_communicator().unwrap())
                && Arc::ptr_eq(a.comm(), &g.communicator(None, &opts).unwrap());
            // Each object's runtime collectives in its own scope, in opposite
            // orders on odd and even ranks from two threads at once.
            let (x, y) = if rank % 2 == 0 { (&a, &b) } else { (&b, &a) };
            std::thread::scope(|s| {
                s.spawn(|| x.barrier().unwrap());
                s.spawn(|| y.barrier().unwrap());
            });
            let ga = a.bootstrap().all_gather(&[rank as u8]).unwrap();
            let out = (same, a.number(), b.number(), g.objects(), ga);
            // The Communicator (its signal pages, fd server, ...) goes with
            // the group and its last object, whichever goes last.
            let weak = Arc::downgrade(a.comm());
            drop((a, g));
            let alive_with_b = weak.upgrade().is_some();
            drop(b);
            assert!(alive_with_b && weak.upgrade().is_none(), "rank {rank}");
            out
        });
        for (rank, (same, na, nb, n, ga)) in got.into_iter().enumerate() {
            assert!(same, "rank {rank}: objects got different communicators");
            assert_eq!((na, nb, n), (1, 2, 2), "rank {rank}");
            assert_eq!(ga, vec![vec![0], vec![1], vec![2]]);
        }
    }

    /// Semaphores of two objects on one shared Communicator, past the first
    /// page: every rank adds pages at the same calls (although the ranks asked
    /// for different page sizes: the smallest counts), every semaphore's
    /// remote counter is the peer's local counter of the same call, and no
    /// slot is handed out twice.
    #[test]
    fn semaphores_grow_past_one_page_and_agree_across_ranks() {
        const CALLS: usize = 5;
        let got = on_ranks(3, Duration::from_secs(20), |rank, boot| {
            let g = Group::new(boot).unwrap();
            // 4, 5 and 6 slots asked for: 4 per page on every rank; each call
            // takes 2 (one per peer), so pages 0, 0, 1, 1, 2.
            let opts = CommunicatorOptions {
                semaphore_slots: 4 + rank as u32,
                ..CommunicatorOptions::default()
            };
            let mut a = g.join("a", None, &opts).unwrap();
            a.ready().unwrap();
            let mut b = g.join("b", None, &opts).unwrap();
            let mut calls = Vec::new();
            for call in 0..CALLS {
                let m = if call % 2 == 0 { &a } else { &b };
                let sems = m.comm().semaphores().unwrap();
                let pairs: Vec<Option<(u64, u64)>> = sems
                    .iter()
                    .map(|s| {
                        s.as_ref().map(|s| {
                            let remote = s.remote_page.info().owner_ptr + s.remote_offset;
                            (s.local_inbound, remote)
                        })
                    })
                    .collect();
                calls.push(pairs);
            }
            b.ready().unwrap();
            let comm = b.comm();
            (calls, comm.signal_pages(), comm.semaphores_per_page())
        });
        let mut locals = std::collections::HashSet::new();
        for (rank, (calls, pages, per_page)) in got.iter().enumerate() {
            assert_eq!((*pages, *per_page), (3, 4), "rank {rank}");
            for (call, pairs) in calls.iter().enumerate() {
                for (peer, pair) in pairs.iter().enumerate() {
                    let Some((local, remote)) = pair else {
                        assert_eq!(peer, rank);
                        continue;
                    };
                    assert!(locals.insert(*local), "slot {local:#x} handed out twice");
                    let (peer_local, _) = got[peer].0[call][rank].unwrap();
                    assert_eq!(
                        *remote, peer_local,
                        "call {call}: rank {rank}'s semaphore with rank {peer}"
                    );
                }
            }
        }
        assert_eq!(locals.len(), 3 * 2 * CALLS);
    }

    fn timeout_record() -> DeviceError {
        DeviceError {
            code: ERROR_TIMEOUT,
            kind: WaitKind::Semaphore as u32,
            rank: 0,
            peer: 1,
            id: 9,
            expected: 2,
            observed: 1,
        }
    }

    #[test]
    fn each_object_keeps_its_own_device_timeout_and_error_record() {
        on_ranks(2, Duration::from_secs(20), |_, boot| {
            let g = Group::new(boot).unwrap();
            let opts = CommunicatorOptions::default();
            let mut a = g.join("a", None, &opts).unwrap();
            a.ready().unwrap();
            let mut b = g.join("b", None, &opts).unwrap();
            b.ready().unwrap();
            a.set_device_timeout_ns(5_000).unwrap();
            assert!(a.set_device_timeout_ns(0).is_err());
            assert_eq!(a.device_timeout_ns(), 5_000);
            assert_eq!(b.device_timeout_ns(), DEFAULT_DEVICE_TIMEOUT_NS);
            // What a's kernels record, a reports; b and the communicator do not.
            a.device_error().record_for_test(timeout_record());
            assert!(matches!(
                a.check_device_timeout(),
                Err(CommError::Timeout { rank: 0, .. })
            ));
            assert!(a.check_device().is_err());
            assert!(b.check_device().is_ok() && b.check_device_timeout().is_ok());
            assert!(a.comm().device_error().check().is_ok());
            b.device_error().record_for_test(timeout_record());
            a.device_error().reset();
            assert!(a.check_device().is_ok() && b.check_device().is_err());
        });
    }

    #[test]
    fn a_later_object_on_another_device_or_wanting_ethernet_is_refused() {
        let got = on_ranks(2, Duration::from_secs(20), |rank, boot| {
            let g = Group::new(boot).unwrap();
            let opts = CommunicatorOptions::default();
            let mut a = g.join("a", None, &opts).unwrap();
            a.ready().unwrap();
            let other = Device {
                ordinal: 3,
                ctx: std::ptr::null_mut(),
                own: false,
            };
            // Refused before the device is touched (it is not a real one).
            let e_dev = g.communicator(Some(other), &opts).unwrap_err();
            let eth = CommunicatorOptions {
                ethernet: Some("127.0.0.1:0".parse().unwrap()),
                ..CommunicatorOptions::default()
            };
            let e_eth = g.join("b", None, &eth).unwrap_err();
            // The failed join took its number; the next object still works.
            let mut c = g.join("c", None, &opts).unwrap();
            c.ready().unwrap();
            assert!(Arc::ptr_eq(a.comm(), c.comm()), "rank {rank}");
            (e_dev, e_eth, c.number())
        });
        for (e_dev, e_eth, n) in got {
            assert!(
                matches!(&e_dev, CommError::InvalidArgument { name: "device", .. }),
                "{e_dev}"
            );
            let msg = e_dev.to_string();
            assert!(
                msg.contains("by object #1 on no device") && msg.contains("CUDA device 3"),
                "{msg}"
            );
            assert!(
                matches!(
                    &e_eth,
                    CommError::InvalidArgument {
                        name: "ethernet",
                        ..
                    }
                ),
                "{e_eth}"
            );
            assert_eq!(n, 3);
        }
    }

    #[test]
    fn a_communicator_with_ethernet_serves_objects_with_or_without_it() {
        on_ranks(2, Duration::from_secs(20), |_, boot| {
            let g = Group::new(boot).unwrap();
            let eth = CommunicatorOptions {
                ethernet: Some("127.0.0.1:0".parse().unwrap()),
                ..CommunicatorOptions::default()
            };
            // Made before any object, by the program.
            let comm = g.communicator(None, &eth).unwrap();
            assert!(comm.has_ethernet());
            let mut a = g.join("a", None, &CommunicatorOptions::default()).unwrap();
            a.ready().unwrap();
            let mut b = g.join("b", None, &eth).unwrap();
            b.ready().unwrap();
            assert!(Arc::ptr_eq(&comm, a.comm()) && Arc::ptr_eq(&comm, b.comm()));
        });
    }

    #[test]
    fn a_failed_communicator_is_tried_again_by_the_next_object_only() {
        let got = one_rank_idle(1, |g| {
            let opts = CommunicatorOptions::default();
            let first = g.communicator(None, &opts).unwrap_err().to_string();
            let again = g.communicator(None, &opts).unwrap_err().to_string();
            (first, again)
        });
        let (first, again) = &got[0];
        assert!(first.contains("timed out"), "{first}");
        assert!(
            again.contains("failed while making object #0") && again.contains("next object"),
            "{again}"
        );
    }

    #[test]
    fn a_group_makes_one_object_at_a_time_in_a_process() {
        on_ranks(1, Duration::from_secs(20), |_, boot| {
            let g = Group::with_timeout(boot, Duration::from_millis(300)).unwrap();
            let opts = CommunicatorOptions::default();
            let mut a = g.join("a", None, &opts).unwrap();
            std::thread::scope(|s| {
                // Another thread waits for a, bounded: it gives up naming a.
                let e = s
                    .spawn(|| g.join("b", None, &opts).unwrap_err())
                    .join()
                    .unwrap();
                let msg = e.to_string();
                assert!(
                    matches!(e, CommError::Timeout { rank: 0, .. })
                        && msg.contains("making its a")
                        && msg.contains("before making a b"),
                    "{msg}"
                );
                // Once a is ready, the waiting thread goes on.
                let waiter = s.spawn(|| g.join("c", None, &opts).map(|m| m.number()));
                std::thread::sleep(Duration::from_millis(50));
                a.ready().unwrap();
                assert_eq!(waiter.join().unwrap().unwrap(), 2);
            });
            // A member dropped while being made ends its making too.
            drop(g.join("d", None, &opts).unwrap());
            assert_eq!(g.join("e", None, &opts).unwrap().number(), 4);
        });
    }
}
