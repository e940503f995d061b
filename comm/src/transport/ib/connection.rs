//! [`IbConnection`]: a [`Connection`] over reliable-connected queue pairs
//! (`num_qps_per_rank` of them, `MOELINK_IB_QPS_PER_RANK`).
//!
//! - **write**: RDMA writes from this rank's registered memory. A write of at
//!   least [`STRIPE_MIN`] bytes is split across every queue pair; smaller ones
//!   go on the current queue pair. Pieces above the port's largest message
//!   are split further.
//! - **signal** (`update_and_sync`) and **add** (`atomic_add`): in `host`
//!   mode a 64-bit fetch-and-add (a signal adds the difference to the value
//!   it last sent, so the peer's counter reads the value set); in
//!   `host-no-atomic` mode, and for every 32-bit add in either mode, a write
//!   with immediate carrying a [`Record`] that the peer's receiving proxy
//!   applies. In `host` mode a signal or 64-bit add that follows records the
//!   peer has not yet consumed goes as a record too, so it cannot overtake
//!   them. Either goes on the queue pair of the latest write, after the
//!   writes on the other queue pairs have completed: data before signal.
//!   (Writes on different queue pairs may land in any order among
//!   themselves.)
//! - **completions**: every work request is signalled; the proxy thread
//!   polls the send completion queue whenever it issues, flushes or asks
//!   [`Connection::progress`]. The first failed completion breaks the
//!   connection: it becomes a `CommError::Rdma` naming the peer and the work
//!   request, returned by that call and by every later one.
//! - **flow control** of records: the peer's record ring has [`RING`] slots
//!   per queue pair and as many receives posted; the receiving proxy returns
//!   credits (an RDMA write of how many records it consumed) and a sender
//!   without credit waits, bounded.
//!
//! Every wait is bounded by the connection's timeout and fails with
//! `CommError::Timeout` naming this rank, the peer and what it waited for.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::host_memory::HostMemory;
use crate::registered_memory::RegisteredMemory;
use crate::transport::inbound::{ApplyStreams, Regions};
use crate::transport::{AtomicAdd, AtomicWidth, Connection, Put, Transport};

use super::config::SignalMode;
use super::device::{Completion, RdmaCq, RdmaMr, RdmaQp, SendOp, SendWr, Sge};
use super::imm::{self, Action, Record, RECORD_BYTES};
use super::wc::{completion_error, WorkKind};

/// Record slots (and posted receives) per queue pair.
pub const RING: u64 = 128;
/// Writes from this size on are split across every queue pair.
pub const STRIPE_MIN: u64 = 256 << 10;
/// Send queue depth requested per queue pair.
pub const SEND_DEPTH: u32 = 256;

/// Byte offsets in one queue pair's block of the control memory.
const RING_IN: u64 = 0;
const RECORDS_OUT: u64 = RING * RECORD_BYTES as u64;
const CREDIT_IN: u64 = 2 * RING * RECORD_BYTES as u64;
const CREDIT_OUT: u64 = CREDIT_IN + 8;
const FETCH_OUT: u64 = CREDIT_IN + 16;
/// Bytes of one queue pair's block.
pub const BLOCK: u64 = CREDIT_IN + 64;

const SEQ_BITS: u32 = 48;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Host memory of one connection, registered with the RDMA device: per queue
/// pair, the peer's records (written by the peer), staging for ours, the
/// credit the peer returns, the credit we return, fetch-and-add results.
#[derive(Debug)]
pub(crate) struct ControlBlock {
    mem: HostMemory,
    pub(crate) mr: Box<dyn RdmaMr>,
}

impl ControlBlock {
    pub(crate) fn new(mem: HostMemory, mr: Box<dyn RdmaMr>) -> Self {
        Self { mem, mr }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    fn at(&self, q: usize, offset: u64) -> u64 {
        self.addr() + q as u64 * BLOCK + offset
    }

    fn word(&self, q: usize, offset: u64) -> &AtomicU64 {
        self.mem.atomic_u64((q as u64 * BLOCK + offset) as usize)
    }

    fn sge(&self, q: usize, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.at(q, offset),
            len,
            lkey: self.mr.lkey(),
        }
    }
}

/// A work request in flight, for the error of its completion.
#[derive(Clone, Copy, Debug)]
struct Pending {
    seq: u64,
    kind: WorkKind,
    bytes: u64,
    remote: u64,
}

#[derive(Debug, Default)]
struct QpSend {
    inflight: VecDeque<Pending>,
    /// Work requests posted so far (the next one's sequence number).
    posted: u64,
    /// One past the sequence number of the latest data write.
    last_data: u64,
    /// Work requests completed so far.
    done: u64,
    /// Records sent so far.
    records: u64,
}

#[derive(Debug, Default)]
pub(crate) struct SendState {
    qps: Vec<QpSend>,
    /// The queue pair small writes, signals and adds go on.
    current: usize,
    /// Host mode: the value each semaphore (by target address) was last set to.
    signals: HashMap<u64, u64>,
    /// The first failure (the connection is unusable since).
    broken: Option<String>,
    /// Whether `progress` returned it already.
    reported: bool,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RecvQp {
    /// Records consumed (and receives reposted) so far.
    consumed: u64,
    /// The count last returned to the sender as credit.
    returned: u64,
}

/// What both directions of one peer's queue pairs share: the sending side
/// (this rank's proxy) and the receiving side (this rank's receiving proxy).
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) rank: usize,
    pub(crate) peer: usize,
    pub(crate) mode: SignalMode,
    pub(crate) qps: Vec<Box<dyn RdmaQp>>,
    pub(crate) send_cq: Arc<dyn RdmaCq>,
    pub(crate) ctrl: ControlBlock,
    /// The peer's control block.
    pub(crate) remote_ctrl: (u64, u32),
    pub(crate) max_msg: u64,
    pub(crate) send_depth: u32,
    pub(crate) regions: Arc<Regions>,
    pub(crate) timeout: Duration,
    pub(crate) send: Mutex<SendState>,
    pub(crate) recv: Mutex<Vec<RecvQp>>,
    /// Set while the connection is dropped (flushed receives are expected).
    pub(crate) closing: AtomicBool,
}

impl Link {
    /// The sending state of `n` queue pairs.
    pub(crate) fn send_state(n: usize) -> Mutex<SendState> {
        Mutex::new(SendState {
            qps: (0..n).map(|_| QpSend::default()).collect(),
            ..SendState::default()
        })
    }

    /// The receiving state of `n` queue pairs.
    pub(crate) fn recv_state(n: usize) -> Mutex<Vec<RecvQp>> {
        Mutex::new(vec![RecvQp::default(); n])
    }

    fn broken_error(&self, why: &str) -> CommError {
        CommError::Rdma {
            peer: self.peer,
            what: format!("{why} (the connection is unusable since)"),
        }
    }

    /// Records `e` as the connection's failure, if it is the first.
    pub(crate) fn fail(&self, e: &CommError) {
        let mut st = lock(&self.send);
        if st.broken.is_none() {
            tracing::error!("rank {}: {e}", self.rank);
            st.broken = Some(e.to_string());
        }
    }

    /// Polls the send completion queue dry, matching each completion with
    /// its work request; a failed one breaks the connection.
    fn reap(&self, st: &mut SendState) -> Result<()> {
        let mut got = Vec::new();
        loop {
            got.clear();
            self.send_cq.poll(&mut got, 32)?;
            if got.is_empty() {
                return Ok(());
            }
            for c in &got {
                self.complete(st, c);
            }
        }
    }

    fn complete(&self, st: &mut SendState, c: &Completion) {
        let q = (c.wr_id >> SEQ_BITS) as usize;
        let seq = c.wr_id & ((1 << SEQ_BITS) - 1);
        let Some(qs) = st.qps.get_mut(q) else {
            tracing::warn!("rank {}: a completion of unknown queue pair {q}", self.rank);
            return;
        };
        let mut pending = None;
        while qs.inflight.front().is_some_and(|p| p.seq <= seq) {
            pending = qs.inflight.pop_front();
        }
        qs.done = qs.done.max(seq + 1);
        if c.status == 0 || st.broken.is_some() {
            return;
        }
        let (kind, detail) = match pending {
            Some(p) => (
                p.kind,
                format!("{} bytes to {:#x} on queue pair {q}", p.bytes, p.remote),
            ),
            None => (WorkKind::Write, format!("on queue pair {q}")),
        };
        let e = completion_error(self.peer, kind, c.wr_id, &detail, c.status, c.vendor_err);
        tracing::error!("rank {}: {e}", self.rank);
        st.broken = Some(e.to_string());
    }

    /// Takes the send state once `ready` says so (polling completions in
    /// between, the lock released), or fails: the connection broke, or
    /// `deadline` passed (a Timeout naming `what` it waited for).
    fn wait_for(
        &self,
        deadline: Instant,
        what: impl Fn(&SendState) -> String,
        mut ready: impl FnMut(&SendState) -> bool,
    ) -> Result<MutexGuard<'_, SendState>> {
        let start = Instant::now();
        loop {
            let mut st = lock(&self.send);
            self.reap(&mut st)?;
            if let Some(why) = &st.broken {
                return Err(self.broken_error(why));
            }
            if ready(&st) {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank as i64,
                    what: format!("rank {} {}", self.peer, what(&st)),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            drop(st);
            std::thread::yield_now();
        }
    }

    /// Posts one work request on queue pair `q` once its send queue has room.
    fn post(&self, q: usize, kind: WorkKind, local: Sge, op: SendOp, remote: u64) -> Result<()> {
        let mut st = self.wait_for_room(q, None)?;
        self.post_locked(&mut st, q, kind, local, op, remote)
    }

    /// The send state once queue pair `q` has room for a work request and,
    /// with `credit` (the peer's returned count), the peer a free record slot.
    fn wait_for_room(
        &self,
        q: usize,
        credit: Option<&AtomicU64>,
    ) -> Result<MutexGuard<'_, SendState>> {
        let depth = self.send_depth as usize;
        let consumed = || credit.map_or(u64::MAX - RING, |c| c.load(Ordering::Acquire));
        let what = |st: &SendState| match credit {
            Some(_) => format!(
                "'s receiving proxy to consume signal records of queue pair {q} ({} sent, {} \
                 consumed, {RING} slots)",
                st.qps[q].records,
                consumed()
            ),
            None => format!(
                "to complete work requests of queue pair {q} (send queue full: {} in flight)",
                st.qps[q].inflight.len()
            ),
        };
        let ready = |st: &SendState| {
            st.qps[q].inflight.len() < depth && st.qps[q].records < consumed() + RING
        };
        self.wait_for(Instant::now() + self.timeout, what, ready)
    }

    fn post_locked(
        &self,
        st: &mut SendState,
        q: usize,
        kind: WorkKind,
        local: Sge,
        op: SendOp,
        remote: u64,
    ) -> Result<()> {
        let qs = &mut st.qps[q];
        let seq = qs.posted;
        let wr = SendWr {
            wr_id: ((q as u64) << SEQ_BITS) | seq,
            local,
            op,
        };
        self.qps[q].post_send(&wr).map_err(|e| CommError::Rdma {
            peer: self.peer,
            what: format!("posting a {} on queue pair {q}: {e}", kind.name()),
        })?;
        qs.posted += 1;
        if matches!(kind, WorkKind::Write) {
            qs.last_data = seq + 1;
        }
        qs.inflight.push_back(Pending {
            seq,
            kind,
            bytes: local.len as u64,
            remote,
        });
        Ok(())
    }

    /// Waits until the writes on every queue pair but `q` have completed,
    /// so that what goes on `q` next lands after them.
    fn fence(&self, q: usize) -> Result<()> {
        if self.qps.len() == 1 {
            return Ok(());
        }
        let behind = |st: &SendState| {
            let others = st.qps.iter().enumerate().filter(|(i, _)| *i != q);
            others.filter(|(_, s)| s.done < s.last_data).count()
        };
        let deadline = Instant::now() + self.timeout;
        let what = |st: &SendState| {
            format!(
                "to complete the writes on {} other queue pairs (before a signal on queue pair {q})",
                behind(st)
            )
        };
        self.wait_for(deadline, what, |st| behind(st) == 0)
            .map(drop)
    }

    /// Sends one record (write with immediate) on queue pair `q`, once the
    /// peer has a free slot for it and the send queue has room.
    fn send_record(&self, q: usize, action: Action, target: u64, value: u64) -> Result<()> {
        let mut st = self.wait_for_room(q, Some(self.ctrl.word(q, CREDIT_IN)))?;
        let seq = st.qps[q].records;
        let record = Record {
            seq,
            target,
            value,
            action,
        };
        let slot = (seq % RING) * RECORD_BYTES as u64;
        let local = self.ctrl.sge(q, RECORDS_OUT + slot, RECORD_BYTES as u32);
        // SAFETY: a 32-byte slot of our control block, which the NIC last
        // read for record seq - RING (consumed by the peer: credits above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                record.to_bytes().as_ptr(),
                local.addr as *mut u8,
                RECORD_BYTES,
            )
        };
        let (raddr, rkey) = self.remote_ctrl;
        let remote = raddr + q as u64 * BLOCK + RING_IN + slot;
        let op = SendOp::WriteImm {
            remote_addr: remote,
            rkey,
            imm: record.imm(),
        };
        self.post_locked(&mut st, q, WorkKind::WriteWithImm, local, op, target)?;
        st.qps[q].records += 1;
        Ok(())
    }

    fn current(&self) -> usize {
        lock(&self.send).current
    }

    // ------------------------------------------------- receiving proxy side --

    /// Applies the receive completion `c` of queue pair `q` (a record the
    /// peer wrote with an immediate) and reposts its receive. GPU targets
    /// go on `stream`.
    pub(crate) fn on_receive(
        &self,
        q: usize,
        c: &Completion,
        stream: &mut ApplyStreams,
    ) -> Result<()> {
        if c.status != 0 {
            if self.closing.load(Ordering::Acquire) {
                return Ok(());
            }
            let detail = format!("on queue pair {q}");
            let e = completion_error(self.peer, WorkKind::Recv, c.wr_id, &detail, c.status, 0);
            return Err(e);
        }
        let imm = c.imm.ok_or_else(|| CommError::Rdma {
            peer: self.peer,
            what: format!("a receive completion without immediate on queue pair {q}"),
        })?;
        let mut recv = lock(&self.recv);
        let seq = recv[q].consumed;
        let mut bytes = [0u8; RECORD_BYTES];
        let slot = self
            .ctrl
            .at(q, RING_IN + (seq % RING) * RECORD_BYTES as u64);
        // SAFETY: a slot of our control block that the peer's write (placed
        // before this completion) filled; the peer does not rewrite it before
        // we return its credit.
        unsafe {
            std::ptr::copy_nonoverlapping(slot as *const u8, bytes.as_mut_ptr(), RECORD_BYTES)
        };
        let op = imm::decode(imm, &bytes, seq, self.peer)?;
        let applied = self.regions.apply(&op, stream);
        recv[q].consumed += 1;
        self.qps[q].post_recv(&[c.wr_id])?;
        applied.map_err(|e| CommError::Rdma {
            peer: self.peer,
            what: format!("applying signal record {seq} of queue pair {q}: {e}"),
        })
    }

    /// Returns credits for the records consumed since the last return (one
    /// RDMA write per queue pair).
    pub(crate) fn return_credits(&self) -> Result<()> {
        let todo: Vec<(usize, u64)> = {
            let mut recv = lock(&self.recv);
            let todo = recv.iter().enumerate();
            let todo: Vec<_> = todo
                .filter(|(_, r)| r.consumed > r.returned)
                .map(|(q, r)| (q, r.consumed))
                .collect();
            for &(q, n) in &todo {
                recv[q].returned = n;
            }
            todo
        };
        let (raddr, rkey) = self.remote_ctrl;
        for (q, n) in todo {
            self.ctrl.word(q, CREDIT_OUT).store(n, Ordering::Release);
            let local = self.ctrl.sge(q, CREDIT_OUT, 8);
            let remote = raddr + q as u64 * BLOCK + CREDIT_IN;
            let op = SendOp::Write {
                remote_addr: remote,
                rkey,
            };
            self.post(q, WorkKind::Credit, local, op, remote)?;
        }
        Ok(())
    }

    /// Receives to post on queue pair `q` at the start (one per ring slot).
    pub(crate) fn initial_receives(q: usize) -> Vec<u64> {
        (0..RING).map(|i| ((q as u64) << SEQ_BITS) | i).collect()
    }
}

/// A connection to one peer over IB verbs (see the module docs). Made by
/// [`super::context::IbContext::connect`].
#[derive(Debug)]
pub struct IbConnection {
    pub(crate) link: Arc<Link>,
    /// Removes the link from its context's receiving proxy on drop (a guard
    /// of the context's, opaque here so that this module does not import it).
    pub(crate) _unlink: Box<dyn std::fmt::Debug + Send + Sync>,
}

impl Drop for IbConnection {
    fn drop(&mut self) {
        self.link.closing.store(true, Ordering::Release);
    }
}

impl IbConnection {
    /// The signalling mode both sides agreed on.
    pub fn mode(&self) -> SignalMode {
        self.link.mode
    }

    /// Queue pairs of this connection.
    pub fn num_qps(&self) -> usize {
        self.link.qps.len()
    }

    /// The peer's memory `dst` as (RDMA address, rkey), checking that this
    /// connection reaches it.
    fn target(
        &self,
        dst: &RegisteredMemory,
        offset: u64,
        what: &'static str,
    ) -> Result<(u64, u32)> {
        let key = dst.info().ib.filter(|_| dst.rank() == self.link.peer);
        let key = key.ok_or_else(|| {
            CommError::invalid(
                what,
                format!(
                    "rank {}'s memory is not registered for IB verbs on the connection to rank {}",
                    dst.rank(),
                    self.link.peer
                ),
            )
        })?;
        Ok((dst.info().owner_ptr + offset, key.rkey))
    }

    /// Issues a signal or add on the current queue pair, after the fence.
    fn signal_op(&self, action: Action, target: u64, rkey: u32, value: u64) -> Result<()> {
        let link = &self.link;
        let q = link.current();
        link.fence(q)?;
        // An RDMA atomic lands when the NIC runs it; a record when the peer's
        // receiving proxy applies it. So an atomic may follow records only
        // once the peer consumed them all (its credits say so), or it could
        // overtake them; until then it goes as a record too.
        let records_applied = {
            let st = lock(&link.send);
            st.qps[q].records <= link.ctrl.word(q, CREDIT_IN).load(Ordering::Acquire)
        };
        let atomic = link.mode == SignalMode::Host
            && action != Action::Add(AtomicWidth::U32)
            && records_applied;
        // A signal sets the peer's u64: an atomic adds what it lacks.
        let add = match action {
            Action::Set => {
                let mut st = lock(&link.send);
                let last = st.signals.get(&target).copied().unwrap_or(0);
                if value < last {
                    return Err(CommError::invalid(
                        "signal value",
                        format!(
                            "{value} is below {last}, which the semaphore at {target:#x} of rank {} \
                             already holds (semaphores only grow)",
                            link.peer
                        ),
                    ));
                }
                st.signals.insert(target, value);
                value - last
            }
            Action::Add(_) => value,
        };
        if !atomic {
            return link.send_record(q, action, target, value);
        }
        let local = link.ctrl.sge(q, FETCH_OUT, 8);
        let op = SendOp::FetchAdd {
            remote_addr: target,
            rkey,
            add,
        };
        link.post(q, WorkKind::FetchAdd, local, op, target)
    }
}

impl Connection for IbConnection {
    fn transport(&self) -> Transport {
        Transport::IbVerbs
    }

    fn remote_rank(&self) -> usize {
        self.link.peer
    }

    fn put(&self, p: Put<'_>) -> Result<()> {
        let (dst, dst_offset, src, src_offset, size) =
            (p.dst, p.dst_offset, p.src, p.src_offset, p.size);
        let (remote, rkey) = self.target(dst, dst_offset, "write destination")?;
        let lkey = match (
            src.info().ib,
            src.rank() == self.link.rank && src.is_mapped(),
        ) {
            (Some(k), true) => k.lkey,
            _ => {
                return Err(CommError::invalid(
                    "write source",
                    format!(
                        "rank {}'s memory is not this rank's memory registered for IB verbs",
                        src.rank()
                    ),
                ))
            }
        };
        if size == 0 {
            return Ok(());
        }
        let link = &self.link;
        let n = link.qps.len() as u64;
        let local = src.ptr() + src_offset;
        // (queue pair, offset, length) of every piece.
        let mut pieces = Vec::new();
        if n > 1 && size >= STRIPE_MIN {
            let per = size.div_ceil(n).next_multiple_of(4096);
            let mut off = 0;
            for q in 0..n as usize {
                let len = per.min(size - off);
                if len > 0 {
                    pieces.push((q, off, len));
                }
                off += len;
            }
            // Signals and small writes follow the last stripe.
            lock(&link.send).current = pieces.last().map_or(0, |p| p.0);
        } else {
            pieces.push((link.current(), 0, size));
        }
        for (q, off, len) in pieces {
            let mut done = 0;
            while done < len {
                let part = (len - done).min(link.max_msg);
                let at = off + done;
                let sge = Sge {
                    addr: local + at,
                    len: part as u32,
                    lkey,
                };
                let op = SendOp::Write {
                    remote_addr: remote + at,
                    rkey,
                };
                link.post(q, WorkKind::Write, sge, op, remote + at)?;
                done += part;
            }
        }
        Ok(())
    }

    fn set(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()> {
        let (target, rkey) = self.target(dst, dst_offset, "signal destination")?;
        self.signal_op(Action::Set, target, rkey, value)
    }

    fn add(&self, a: AtomicAdd<'_>) -> Result<()> {
        let (target, rkey) = self.target(a.dst, a.dst_offset, "atomic_add destination")?;
        self.signal_op(Action::Add(a.width), target, rkey, a.value as u64)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        let busy = |st: &SendState| st.qps.iter().map(|q| q.inflight.len()).sum::<usize>();
        let what = |st: &SendState| {
            let oldest = st.qps.iter().enumerate().find_map(|(q, s)| {
                s.inflight.front().map(|p| {
                    format!(
                        "{} of {} bytes to {:#x} on queue pair {q}",
                        p.kind.name(),
                        p.bytes,
                        p.remote
                    )
                })
            });
            format!(
                "to complete {} RDMA work requests (oldest: {})",
                busy(st),
                oldest.unwrap_or_default()
            )
        };
        self.link
            .wait_for(Instant::now() + timeout, what, |st| busy(st) == 0)
            .map(drop)
    }

    fn busy(&self) -> Option<bool> {
        let mut st = lock(&self.link.send);
        if let Err(e) = self.link.reap(&mut st) {
            if st.broken.is_none() {
                st.broken = Some(e.to_string());
            }
        }
        Some(st.qps.iter().any(|q| !q.inflight.is_empty()))
    }

    fn progress(&self) -> Result<Option<bool>> {
        let busy = self.busy();
        let mut st = lock(&self.link.send);
        match &st.broken {
            Some(why) if !st.reported => {
                let e = self.link.broken_error(why);
                st.reported = true;
                Err(e)
            }
            _ => Ok(busy),
        }
    }
}
