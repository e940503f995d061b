//! A loopback "NIC" in memory, for CPU tests of everything above the verbs:
//! [`FakeFabric`] implements [`RdmaProvider`] with devices whose queue pairs
//! execute RDMA write, write with immediate and 64-bit fetch-and-add on this
//! process's host memory, and produce completions as a NIC does, errors
//! included. Ranks of a test are threads of one process sharing one fabric.
//!
//! What it checks as hardware would: the RC state machine (RESET -> INIT ->
//! RTR -> RTS, the attribute mask each transition needs, posting only in
//! RTS), the remote's address (LID on InfiniBand, GID on RoCE) and its packet
//! sequence numbers, memory keys, ranges and access rights, alignment and
//! support of atomics, posted receives for every write with immediate, and
//! completion-queue overruns. A failed work request moves its queue pair to
//! the error state; later ones complete as flushed.
//!
//! What it does not model: timing (a work request completes while it is
//! posted, unless the device is held: [`FakeFabric::set_hold`]), GPU memory,
//! packet loss and retransmission, and partial placement of a message.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::error::{CommError, Result};

use super::device::{
    opcode, Completion, DeviceCaps, MrSource, PortAttr, QpInit, RdmaCq, RdmaDevice, RdmaMr,
    RdmaProvider, RdmaQp, SendOp, SendWr,
};
use super::qp::{access, mask, LinkLayer, QpState, Transition};

/// `enum ibv_wc_status` values the fake produces.
pub mod status {
    pub const LOC_LEN_ERR: u32 = 1;
    pub const LOC_QP_OP_ERR: u32 = 2;
    pub const LOC_PROT_ERR: u32 = 4;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const REM_INV_REQ_ERR: u32 = 9;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const RETRY_EXC_ERR: u32 = 12;
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn einval(what: String) -> CommError {
    CommError::Io {
        context: what,
        source: std::io::Error::from_raw_os_error(libc::EINVAL),
    }
}

/// One fake device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeDeviceSpec {
    pub name: String,
    pub link_layer: LinkLayer,
    /// RDMA atomics (a NIC without them needs `host-no-atomic`).
    pub atomics: bool,
    pub ports: u8,
    /// `enum ibv_mtu` of every port.
    pub active_mtu: u32,
    pub max_msg_size: u32,
}

impl FakeDeviceSpec {
    /// An InfiniBand device with atomics, one port, 4096-byte MTU.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            link_layer: LinkLayer::InfiniBand,
            atomics: true,
            ports: 1,
            active_mtu: 5,
            max_msg_size: 1 << 30,
        }
    }
}

#[derive(Debug, Default)]
struct Faults {
    hold: bool,
    fail_next: Option<(u32, u32)>,
}

#[derive(Debug)]
struct Mr {
    addr: u64,
    len: u64,
    access: u32,
}

#[derive(Debug)]
struct Dev {
    spec: FakeDeviceSpec,
    index: u16,
    fabric: Weak<Fabric>,
    mrs: Mutex<HashMap<u32, Mr>>,
    faults: Mutex<Faults>,
    /// Work requests of held queue pairs, in posting order.
    held: Mutex<VecDeque<(Arc<Qp>, SendWr)>>,
}

impl Dev {
    fn lid(&self, port: u8) -> u16 {
        0x100 + self.index * 16 + port as u16
    }

    fn gid(&self, port: u8, index: u8) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[13] = index;
        g[14] = self.index as u8;
        g[15] = port;
        g
    }

    /// Whether `[addr, addr + len)` lies in region `key` with `need` access.
    fn check(&self, key: u32, addr: u64, len: u64, need: u32) -> bool {
        let mrs = lock(&self.mrs);
        mrs.get(&key).is_some_and(|m| {
            addr >= m.addr
                && addr.checked_add(len).is_some_and(|e| e <= m.addr + m.len)
                && m.access & need == need
        })
    }
}

#[derive(Debug, Default)]
struct Fabric {
    devices: Mutex<Vec<Arc<Dev>>>,
    qps: Mutex<HashMap<u32, Weak<Qp>>>,
    next_qp: AtomicU32,
    next_key: AtomicU32,
}

/// A set of fake devices that can reach each other (one "subnet").
#[derive(Clone, Debug, Default)]
pub struct FakeFabric {
    inner: Arc<Fabric>,
}

impl FakeFabric {
    pub fn new() -> Self {
        let f = Self::default();
        f.inner.next_qp.store(0x40, Ordering::Relaxed);
        f.inner.next_key.store(0x1000, Ordering::Relaxed);
        f
    }

    /// A fabric with the given devices.
    pub fn with_devices(specs: &[FakeDeviceSpec]) -> Self {
        let f = Self::new();
        for s in specs {
            f.add_device(s.clone());
        }
        f
    }

    pub fn add_device(&self, spec: FakeDeviceSpec) {
        let mut devs = lock(&self.inner.devices);
        let index = devs.len() as u16;
        devs.push(Arc::new(Dev {
            spec,
            index,
            fabric: Arc::downgrade(&self.inner),
            mrs: Mutex::default(),
            faults: Mutex::default(),
            held: Mutex::default(),
        }));
    }

    fn device(&self, name: &str) -> Arc<Dev> {
        let devs = lock(&self.inner.devices);
        let dev = devs.iter().find(|d| d.spec.name == name);
        dev.unwrap_or_else(|| panic!("no fake device {name}"))
            .clone()
    }

    /// While `hold` is set, work requests posted on `device` wait (in flight,
    /// as on a slow or stalled link); clearing it runs them in order.
    pub fn set_hold(&self, device: &str, hold: bool) {
        let dev = self.device(device);
        lock(&dev.faults).hold = hold;
        if !hold {
            let held: Vec<_> = lock(&dev.held).drain(..).collect();
            for (qp, wr) in held {
                qp.execute(&wr);
            }
        }
    }

    /// The next work request executed on `device` completes with `status`
    /// (and `vendor_err`) instead of running.
    pub fn fail_next_send(&self, device: &str, status: u32, vendor_err: u32) {
        lock(&self.device(device).faults).fail_next = Some((status, vendor_err));
    }

    /// Memory regions registered on `device` now.
    pub fn registrations(&self, device: &str) -> usize {
        lock(&self.device(device).mrs).len()
    }

    /// Queue pairs alive on the fabric.
    pub fn live_qps(&self) -> usize {
        let qps = lock(&self.inner.qps);
        qps.values().filter(|q| q.strong_count() > 0).count()
    }
}

impl RdmaProvider for FakeFabric {
    fn device_names(&self) -> Result<Vec<String>> {
        let devs = lock(&self.inner.devices);
        if devs.is_empty() {
            return Err(CommError::NoRdma {
                reason: "the fake fabric has no device".into(),
            });
        }
        Ok(devs.iter().map(|d| d.spec.name.clone()).collect())
    }

    fn open(&self, name: &str) -> Result<Arc<dyn RdmaDevice>> {
        let devs = lock(&self.inner.devices);
        let dev = devs.iter().find(|d| d.spec.name == name);
        let dev = dev.ok_or_else(|| CommError::NoRdma {
            reason: format!("no RDMA device named {name}"),
        })?;
        Ok(Arc::new(Handle(dev.clone())))
    }
}

/// An open fake device.
#[derive(Debug)]
struct Handle(Arc<Dev>);

impl RdmaDevice for Handle {
    fn name(&self) -> &str {
        &self.0.spec.name
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            atomics: self.0.spec.atomics,
            max_qp_wr: 1024,
            max_cqe: 1 << 16,
            ports: self.0.spec.ports,
        }
    }

    fn port(&self, port: u8) -> Result<PortAttr> {
        if port == 0 || port > self.0.spec.ports {
            return Err(einval(format!("ibv_query_port {port} on {}", self.name())));
        }
        Ok(PortAttr {
            active: true,
            lid: match self.0.spec.link_layer {
                LinkLayer::InfiniBand => self.0.lid(port),
                LinkLayer::Ethernet => 0,
            },
            active_mtu: self.0.spec.active_mtu,
            link_layer: self.0.spec.link_layer,
            max_msg_size: self.0.spec.max_msg_size,
        })
    }

    fn gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        if port == 0 || port > self.0.spec.ports || index >= 4 {
            return Err(einval(format!(
                "ibv_query_gid {port}/{index} on {}",
                self.name()
            )));
        }
        Ok(self.0.gid(port, index))
    }

    fn register(&self, source: MrSource, access: u32) -> Result<Box<dyn RdmaMr>> {
        let MrSource::Host { addr, len } = source else {
            return Err(CommError::invalid(
                "memory",
                "the fake RDMA device registers host memory only",
            ));
        };
        let fabric = self.0.fabric.upgrade().expect("fabric alive");
        let key = fabric.next_key.fetch_add(1, Ordering::Relaxed);
        lock(&self.0.mrs).insert(key, Mr { addr, len, access });
        Ok(Box::new(FakeMr {
            dev: self.0.clone(),
            key,
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn RdmaCq>> {
        Ok(Arc::new(Cq {
            depth: depth as usize,
            q: Mutex::default(),
        }))
    }

    fn create_qp(&self, init: QpInit<'_>) -> Result<Box<dyn RdmaQp>> {
        let cq = |c: &Arc<dyn RdmaCq>| -> Result<Arc<dyn RdmaCq>> {
            if c.as_any().downcast_ref::<Cq>().is_none() {
                return Err(CommError::invalid("completion queue", "not a fake one"));
            }
            Ok(c.clone())
        };
        let fabric = self.0.fabric.upgrade().expect("fabric alive");
        let num = fabric.next_qp.fetch_add(1, Ordering::Relaxed);
        let qp = Arc::new(Qp {
            num,
            dev: self.0.clone(),
            send_cq: cq(init.send_cq)?,
            recv_cq: cq(init.recv_cq)?,
            max_send_wr: init.max_send_wr,
            max_recv_wr: init.max_recv_wr,
            st: Mutex::new(QpSt::default()),
        });
        lock(&fabric.qps).insert(num, Arc::downgrade(&qp));
        Ok(Box::new(QpHandle(qp)))
    }
}

#[derive(Debug)]
struct FakeMr {
    dev: Arc<Dev>,
    key: u32,
}

impl RdmaMr for FakeMr {
    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for FakeMr {
    fn drop(&mut self) {
        lock(&self.dev.mrs).remove(&self.key);
    }
}

#[derive(Debug)]
struct Cq {
    depth: usize,
    q: Mutex<(VecDeque<Completion>, bool)>,
}

impl Cq {
    fn push(&self, c: Completion) {
        let mut q = lock(&self.q);
        if q.0.len() >= self.depth {
            q.1 = true;
        } else {
            q.0.push_back(c);
        }
    }
}

impl RdmaCq for Cq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        let mut q = lock(&self.q);
        if q.1 {
            return Err(CommError::Io {
                context: "polling a fake completion queue".into(),
                source: std::io::Error::other("completion queue overrun"),
            });
        }
        let n = max.min(q.0.len());
        out.extend(q.0.drain(..n));
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `IBV_QPS_ERR`.
const QPS_ERR: u32 = 6;

#[derive(Debug, Default)]
struct QpSt {
    /// `enum ibv_qp_state`.
    state: u32,
    port: u8,
    access: u32,
    dest: u32,
    rq_psn: u32,
    sq_psn: u32,
    max_rd_atomic: u8,
    recvs: VecDeque<u64>,
    /// Sends posted and not yet completed (held ones).
    outstanding: u32,
}

#[derive(Debug)]
struct Qp {
    num: u32,
    dev: Arc<Dev>,
    send_cq: Arc<dyn RdmaCq>,
    recv_cq: Arc<dyn RdmaCq>,
    max_send_wr: u32,
    max_recv_wr: u32,
    st: Mutex<QpSt>,
}

fn fake_cq(c: &Arc<dyn RdmaCq>) -> &Cq {
    c.as_any()
        .downcast_ref::<Cq>()
        .expect("checked at creation")
}

impl Qp {
    fn fabric(&self) -> Arc<Fabric> {
        self.dev.fabric.upgrade().expect("fabric alive")
    }

    fn peer(&self, num: u32) -> Option<Arc<Qp>> {
        lock(&self.fabric().qps).get(&num).and_then(Weak::upgrade)
    }

    fn complete(&self, wr: &SendWr, status: u32, vendor_err: u32) {
        let op = match wr.op {
            SendOp::FetchAdd { .. } => opcode::FETCH_ADD,
            _ => opcode::RDMA_WRITE,
        };
        fake_cq(&self.send_cq).push(Completion {
            wr_id: wr.wr_id,
            status,
            opcode: op,
            vendor_err,
            byte_len: wr.local.len,
            imm: None,
            qp_num: self.num,
        });
    }

    /// Runs one work request: checks, moves memory, completes.
    fn execute(&self, wr: &SendWr) {
        let (state, dest, sq_psn, max_rd_atomic) = {
            let mut st = lock(&self.st);
            st.outstanding = st.outstanding.saturating_sub(1);
            (st.state, st.dest, st.sq_psn, st.max_rd_atomic)
        };
        if state == QPS_ERR {
            return self.complete(wr, status::WR_FLUSH_ERR, 0);
        }
        let (status, vendor) = match self.run(wr, dest, sq_psn, max_rd_atomic) {
            Ok(()) => return self.complete(wr, 0, 0),
            Err(s) => s,
        };
        lock(&self.st).state = QPS_ERR;
        self.complete(wr, status, vendor);
    }

    fn run(&self, wr: &SendWr, dest: u32, sq_psn: u32, max_rd: u8) -> Result<(), (u32, u32)> {
        if let Some(f) = lock(&self.dev.faults).fail_next.take() {
            return Err(f);
        }
        let l = wr.local;
        let need_local = match wr.op {
            SendOp::FetchAdd { .. } => access::LOCAL_WRITE,
            _ => 0,
        };
        if l.len > 0 && !self.dev.check(l.lkey, l.addr, l.len as u64, need_local) {
            return Err((status::LOC_PROT_ERR, 0x51));
        }
        if l.len > self.dev.spec.max_msg_size {
            return Err((status::LOC_LEN_ERR, 0x52));
        }
        let peer = self.peer(dest).ok_or((status::RETRY_EXC_ERR, 0x81))?;
        let (peer_state, rq_psn) = {
            let st = lock(&peer.st);
            (st.state, st.rq_psn)
        };
        if !(2..=3).contains(&peer_state) || rq_psn != sq_psn {
            // No answer from the peer (not ready, or out of sequence).
            return Err((status::RETRY_EXC_ERR, 0x81));
        }
        let (remote, rkey, len, need) = match wr.op {
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteImm {
                remote_addr, rkey, ..
            } => (remote_addr, rkey, l.len as u64, access::REMOTE_WRITE),
            SendOp::FetchAdd {
                remote_addr, rkey, ..
            } => (remote_addr, rkey, 8, access::REMOTE_ATOMIC),
        };
        if !peer.dev.check(rkey, remote, len, need) {
            return Err((status::REM_ACCESS_ERR, 0x88));
        }
        match wr.op {
            SendOp::Write { .. } | SendOp::WriteImm { .. } if len > 0 => {
                // SAFETY: both ranges lie in registered host memory of this
                // process (checked above), which their owners keep alive
                // while registered; overlapping is allowed (memmove).
                unsafe { std::ptr::copy(l.addr as *const u8, remote as *mut u8, len as usize) }
            }
            SendOp::FetchAdd { add, .. } => {
                if !self.dev.spec.atomics || !peer.dev.spec.atomics || remote % 8 != 0 {
                    return Err((status::REM_INV_REQ_ERR, 0x89));
                }
                if l.len != 8 {
                    return Err((status::LOC_LEN_ERR, 0x52));
                }
                if max_rd == 0 {
                    return Err((status::LOC_QP_OP_ERR, 0x53));
                }
                // SAFETY: an aligned u64 in registered memory (checked above).
                let old = unsafe { AtomicU64::from_ptr(remote as *mut u64) }
                    .fetch_add(add, Ordering::AcqRel);
                // SAFETY: 8 bytes of registered local memory (checked above).
                unsafe { std::ptr::write_unaligned(l.addr as *mut u64, old) };
            }
            _ => {}
        }
        if let SendOp::WriteImm { imm, .. } = wr.op {
            let recv = lock(&peer.st).recvs.pop_front();
            let Some(recv_id) = recv else {
                return Err((status::RNR_RETRY_EXC_ERR, 0x82));
            };
            fake_cq(&peer.recv_cq).push(Completion {
                wr_id: recv_id,
                status: 0,
                opcode: opcode::RECV_RDMA_WITH_IMM,
                vendor_err: 0,
                byte_len: l.len,
                imm: Some(imm),
                qp_num: peer.num,
            });
        }
        Ok(())
    }
}

#[derive(Debug)]
struct QpHandle(Arc<Qp>);

/// The attribute bits a transition of an RC queue pair must carry.
fn required(to: QpState) -> u32 {
    match to {
        QpState::Reset => mask::STATE,
        QpState::Init => mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS,
        QpState::Rtr => {
            mask::STATE
                | mask::AV
                | mask::PATH_MTU
                | mask::DEST_QPN
                | mask::RQ_PSN
                | mask::MAX_DEST_RD_ATOMIC
                | mask::MIN_RNR_TIMER
        }
        QpState::Rts => {
            mask::STATE
                | mask::TIMEOUT
                | mask::RETRY_CNT
                | mask::RNR_RETRY
                | mask::SQ_PSN
                | mask::MAX_QP_RD_ATOMIC
        }
    }
}

impl RdmaQp for QpHandle {
    fn qp_num(&self) -> u32 {
        self.0.num
    }

    fn modify(&self, t: &Transition) -> Result<()> {
        let qp = &self.0;
        let bad = |why: &str| einval(format!("ibv_modify_qp to {:?}: {why}", t.state));
        let mut st = lock(&qp.st);
        if st.state + 1 != t.state as u32 {
            return Err(bad(&format!("the queue pair is in state {}", st.state)));
        }
        let need = required(t.state);
        if t.mask & need != need {
            return Err(bad(&format!(
                "attribute mask {:#x} lacks {:#x}",
                t.mask,
                need & !t.mask
            )));
        }
        match t.state {
            QpState::Init => {
                if t.port_num == 0 || t.port_num > qp.dev.spec.ports {
                    return Err(bad(&format!("no port {}", t.port_num)));
                }
                st.port = t.port_num;
                st.access = t.access_flags;
            }
            QpState::Rtr => {
                if t.path_mtu == 0 || t.path_mtu > qp.dev.spec.active_mtu {
                    return Err(bad(&format!("path MTU code {}", t.path_mtu)));
                }
                let av = t.av.ok_or_else(|| bad("no address vector"))?;
                let peer = qp
                    .peer(t.dest_qp_num)
                    .ok_or_else(|| bad(&format!("no queue pair {}", t.dest_qp_num)))?;
                // The remote may not be in INIT yet: any of its ports.
                let reaches =
                    (1..=peer.dev.spec.ports).any(|port| match (qp.dev.spec.link_layer, av.grh) {
                        (LinkLayer::InfiniBand, None) => av.dlid == peer.dev.lid(port),
                        (LinkLayer::Ethernet, Some(g)) => {
                            g.sgid_index < 4 && g.dgid == peer.dev.gid(port, g.dgid[13])
                        }
                        _ => false,
                    });
                if !reaches {
                    return Err(bad("the address vector does not name the remote port"));
                }
                st.dest = t.dest_qp_num;
                st.rq_psn = t.rq_psn;
            }
            QpState::Rts => {
                st.sq_psn = t.sq_psn;
                st.max_rd_atomic = t.max_rd_atomic;
            }
            QpState::Reset => return Err(bad("not a forward transition")),
        }
        st.state = t.state as u32;
        Ok(())
    }

    fn post_send(&self, wr: &SendWr) -> Result<()> {
        let qp = &self.0;
        {
            let mut st = lock(&qp.st);
            if st.state != QpState::Rts as u32 && st.state != QPS_ERR {
                return Err(einval(format!(
                    "ibv_post_send on queue pair {} in state {}",
                    qp.num, st.state
                )));
            }
            if st.outstanding >= qp.max_send_wr {
                return Err(CommError::Io {
                    context: format!("ibv_post_send on queue pair {}", qp.num),
                    source: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            st.outstanding += 1;
        }
        if lock(&qp.dev.faults).hold {
            lock(&qp.dev.held).push_back((qp.clone(), *wr));
            return Ok(());
        }
        qp.execute(wr);
        Ok(())
    }

    fn post_recv(&self, wr_ids: &[u64]) -> Result<()> {
        let qp = &self.0;
        let mut st = lock(&qp.st);
        if st.state == QpState::Reset as u32 {
            return Err(einval(format!(
                "ibv_post_recv on queue pair {} in RESET",
                qp.num
            )));
        }
        if st.recvs.len() + wr_ids.len() > qp.max_recv_wr as usize {
            return Err(CommError::Io {
                context: format!("ibv_post_recv on queue pair {}", qp.num),
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        st.recvs.extend(wr_ids);
        Ok(())
    }
}
