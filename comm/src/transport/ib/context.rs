//! [`IbContext`]: one rank's RDMA device, port and protection domain, the
//! registrations peers reach, the queue pairs of its connections, and its
//! receiving proxy: a thread that polls the receive completion queue and
//! applies the records peers send with write-with-immediate (signals in the
//! `host-no-atomic` mode, 32-bit adds), then returns credits.
//!
//! The receiving proxy is one thread per context, not the sending
//! `ProxyService`: it must run whether or not this rank has a proxy started,
//! and one thread applies a peer's records in order (a semaphore store must
//! not overtake an earlier one). It binds the rank's GPU before its first
//! CUDA call, like every proxy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cuda::Device;
use crate::error::{CommError, Result};
use crate::host_memory::HostMemory;
use crate::registered_memory::{IbKey, Location};
use crate::transport::inbound::{ApplyStreams, Regions};
use crate::wire::{Reader, Writer};

use super::config::{IbConfig, SignalMode};
use super::connection::{ControlBlock, IbConnection, Link, BLOCK, RING, SEND_DEPTH};
use super::device::{
    Completion, MrSource, PortAttr, QpInit, RdmaCq, RdmaDevice, RdmaMr, RdmaProvider,
};
use super::qp::{self, access, LinkLayer, QpEndpoint};
use super::verbs::usable_devices;

/// Depth of the receive completion queue every connection shares.
const RECV_CQ_DEPTH: u32 = 16384;
const MAGIC: u32 = 0x4942_4331; // "IBC1"
/// Every access a registration grants (peers write and add into it).
const ACCESS: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

type LinkTable = RwLock<HashMap<u32, (Weak<Link>, usize)>>;

/// What the receiving proxy thread shares with the context.
#[derive(Debug)]
struct RecvShared {
    rank: usize,
    device: Option<Device>,
    recv_cq: Arc<dyn RdmaCq>,
    /// Queue pair number -> (connection, queue pair index).
    links: LinkTable,
    stop: AtomicBool,
    first_error: Mutex<Option<String>>,
}

impl RecvShared {
    fn record(&self, e: &CommError) {
        tracing::error!("rank {}: IB receiving proxy: {e}", self.rank);
        lock(&self.first_error).get_or_insert_with(|| e.to_string());
    }
}

/// Removes a connection's queue pairs from the receiving proxy's table.
#[derive(Debug)]
struct Unlink {
    shared: Arc<RecvShared>,
    qp_nums: Vec<u32>,
}

impl Drop for Unlink {
    fn drop(&mut self) {
        let mut links = self
            .shared
            .links
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for n in &self.qp_nums {
            links.remove(n);
        }
    }
}

/// A memory registration with the context's device; peers reach the memory
/// while it lives.
#[derive(Debug)]
pub struct IbRegistration {
    regions: Arc<Regions>,
    ptr: u64,
    mr: Box<dyn RdmaMr>,
    /// How the device registered it ("host", "dma-buf", "peer memory").
    pub how: &'static str,
}

impl IbRegistration {
    pub fn key(&self) -> IbKey {
        IbKey {
            lkey: self.mr.lkey(),
            rkey: self.mr.rkey(),
        }
    }
}

impl Drop for IbRegistration {
    fn drop(&mut self) {
        // No record is applied there once this returns; then the region goes.
        self.regions.unregister(self.ptr);
    }
}

/// One rank's IB verbs state (see the module docs).
#[derive(Debug)]
pub struct IbContext {
    rank: usize,
    config: IbConfig,
    device: Arc<dyn RdmaDevice>,
    port: u8,
    port_attr: PortAttr,
    gid: [u8; 16],
    regions: Arc<Regions>,
    shared: Arc<RecvShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
}

impl IbContext {
    /// Opens the device and port this rank uses: the active ports of the
    /// devices `MOELINK_IB_HCA` allows, in its order, the `local_rank`-th
    /// (round robin). `gpu`: the device whose memory will be registered
    /// (and which the receiving proxy binds). `timeout` bounds every wait
    /// of its connections.
    pub fn open(
        rank: usize,
        provider: &dyn RdmaProvider,
        config: IbConfig,
        local_rank: usize,
        gpu: Option<Device>,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let names = usable_devices(provider, &config.hca)?;
        let mut opened = HashMap::new();
        let mut ports = Vec::new();
        for name in names {
            let dev = provider.open(&name)?;
            for p in 1..=dev.caps().ports {
                if dev.port(p)?.active {
                    ports.push((name.clone(), p));
                }
            }
            opened.insert(name, dev);
        }
        let chosen = config.hca.select(&ports);
        if chosen.is_empty() {
            return Err(CommError::NoRdma {
                reason: format!(
                    "no active port among {:?} that MOELINK_IB_HCA allows",
                    opened.keys().collect::<Vec<_>>()
                ),
            });
        }
        let (name, port) = chosen[local_rank % chosen.len()].clone();
        let device = opened.remove(&name).expect("opened above");
        drop(opened);
        let port_attr = device.port(port)?;
        let gid = match device.gid(port, config.gid_index) {
            Ok(g) => g,
            // InfiniBand addresses by LID; only RoCE needs the GID.
            Err(_) if port_attr.link_layer == LinkLayer::InfiniBand => [0; 16],
            Err(e) => return Err(e),
        };
        let recv_cq = device.create_cq(RECV_CQ_DEPTH)?;
        tracing::info!(
            "rank {rank}: IB verbs on {name} port {port} ({:?}, GID index {}, mode {:?}, {} \
             queue pairs per peer)",
            port_attr.link_layer,
            config.gid_index,
            config.mode,
            config.qps_per_rank
        );
        Ok(Arc::new(Self {
            rank,
            device,
            port,
            port_attr,
            gid,
            regions: Arc::new(Regions::new(rank, gpu)),
            shared: Arc::new(RecvShared {
                rank,
                device: gpu,
                recv_cq,
                links: RwLock::new(HashMap::new()),
                stop: AtomicBool::new(false),
                first_error: Mutex::new(None),
            }),
            thread: Mutex::new(None),
            config,
            timeout,
        }))
    }

    pub fn device_name(&self) -> &str {
        self.device.name()
    }

    pub fn port(&self) -> u8 {
        self.port
    }

    pub fn config(&self) -> &IbConfig {
        &self.config
    }

    /// The first error the receiving proxy hit, if any (kept).
    pub fn check(&self) -> Result<()> {
        match &*lock(&self.shared.first_error) {
            None => Ok(()),
            Some(e) => Err(CommError::invalid(
                "IB receiving proxy",
                format!("rank {}: {e}", self.rank),
            )),
        }
    }

    /// Registers `[ptr, ptr + len)` of `location` with the device: host
    /// memory directly, GPU memory as a dma-buf where the driver exports
    /// one, else by device pointer (the peer-memory module). Peers' records
    /// may target it while the registration lives. `process_wide`: the
    /// memory is a cuMem allocation, so the receiving thread applies records
    /// to it on the proxies' own context ([`Regions::register_process_wide`]).
    pub fn register(
        &self,
        ptr: u64,
        len: u64,
        location: Location,
        process_wide: bool,
    ) -> Result<IbRegistration> {
        let (mr, how) = match location {
            Location::Host => (
                self.device
                    .register(MrSource::Host { addr: ptr, len }, ACCESS)?,
                "host",
            ),
            Location::Device(d) => self.register_gpu(d, ptr, len)?,
        };
        if process_wide {
            self.regions.register_process_wide(ptr, len, location);
        } else {
            self.regions.register(ptr, len, location);
        }
        Ok(IbRegistration {
            regions: self.regions.clone(),
            ptr,
            mr,
            how,
        })
    }

    fn register_gpu(
        &self,
        ordinal: i32,
        ptr: u64,
        len: u64,
    ) -> Result<(Box<dyn RdmaMr>, &'static str)> {
        use std::os::fd::AsRawFd;
        let dmabuf = Device::get(ordinal)
            .and_then(|d| d.dmabuf_fd(ptr, len as usize))
            .and_then(|fd| {
                let src = MrSource::DmaBuf {
                    fd: fd.as_raw_fd(),
                    offset: 0,
                    len,
                    iova: ptr,
                };
                // The region keeps its own reference to the dma-buf.
                self.device.register(src, ACCESS)
            });
        let first = match dmabuf {
            Ok(mr) => return Ok((mr, "dma-buf")),
            Err(e) => e,
        };
        let src = MrSource::DevicePointer { addr: ptr, len };
        match self.device.register(src, ACCESS) {
            Ok(mr) => {
                tracing::debug!(
                    "rank {}: GPU memory registered by device pointer (dma-buf: {first})",
                    self.rank
                );
                Ok((mr, "peer memory"))
            }
            Err(second) => Err(CommError::NoRdma {
                reason: format!(
                    "{} cannot register GPU memory: dma-buf: {first}; device pointer (peer \
                     memory): {second}",
                    self.device.name()
                ),
            }),
        }
    }

    /// Starts the receiving proxy (once).
    fn start_receiver(&self) -> Result<()> {
        let mut t = lock(&self.thread);
        if t.is_some() {
            return Ok(());
        }
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("moelink-ib-recv-r{}", self.rank))
            .spawn(move || receive_loop(&shared));
        *t = Some(spawned.map_err(|source| CommError::Io {
            context: "spawning the IB receiving proxy".into(),
            source,
        })?);
        Ok(())
    }

    /// *Collective between this rank and `peer`* (each calls it once for the
    /// other): makes `MOELINK_IB_QPS_PER_RANK` queue pairs and the control
    /// block, sends what the peer needs through `exchange` (which sends our
    /// bytes to the peer and returns the peer's), brings the queue pairs to
    /// RTS, posts the receives, and exchanges once more so that neither side
    /// sends before the other is ready.
    pub fn connect(
        &self,
        peer: usize,
        exchange: &mut dyn FnMut(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<IbConnection> {
        let caps = self.device.caps();
        let nq = self.config.qps_per_rank as usize;
        let send_depth = SEND_DEPTH.min(caps.max_qp_wr.max(1));
        let send_cq = self.device.create_cq(send_depth * nq as u32 + 16)?;
        let mut qps = Vec::with_capacity(nq);
        for _ in 0..nq {
            let recv_cq = &self.shared.recv_cq;
            qps.push(self.device.create_qp(QpInit {
                send_cq: &send_cq,
                recv_cq,
                max_send_wr: send_depth,
                max_recv_wr: RING as u32,
            })?);
        }
        let mem = HostMemory::heap(BLOCK as usize * nq);
        let mr = self.device.register(
            MrSource::Host {
                addr: mem.as_ptr() as u64,
                len: mem.len() as u64,
            },
            ACCESS,
        )?;
        let ctrl = ControlBlock::new(mem, mr);
        let wants_no_atomic = self.config.mode == SignalMode::HostNoAtomic;
        let mut w = Writer::default();
        w.u32(MAGIC)
            .u32(nq as u32)
            .u8(wants_no_atomic as u8)
            .u8(caps.atomics as u8)
            .u64(ctrl.addr())
            .u32(ctrl.mr.rkey())
            .u32(RING as u32);
        let psn = |q: usize| (0x1000 + (self.rank as u32) * 64 + q as u32) & 0x00FF_FFFF;
        let locals: Vec<QpEndpoint> = (0..nq)
            .map(|q| QpEndpoint {
                lid: self.port_attr.lid,
                qp_num: qps[q].qp_num(),
                psn: psn(q),
                gid: self.gid,
                active_mtu: self.port_attr.active_mtu,
                link_layer: self.port_attr.link_layer,
            })
            .collect();
        for e in &locals {
            w.bytes(&e.to_bytes());
        }
        let theirs = exchange(&w.finish())?;
        let bad = |what: String| CommError::Rdma { peer, what };
        let mut r = Reader::new(&theirs, "IB connection setup");
        if r.u32()? != MAGIC {
            return Err(bad("an IB connection setup with a bad magic".into()));
        }
        let their_nq = r.u32()? as usize;
        if their_nq != nq {
            return Err(bad(format!(
                "{their_nq} queue pairs per peer against this rank's {nq} \
                 (MOELINK_IB_QPS_PER_RANK must agree)"
            )));
        }
        let (their_no_atomic, their_atomics) = (r.u8()? != 0, r.u8()? != 0);
        let remote_ctrl = (r.u64()?, r.u32()?);
        if r.u32()? as u64 != RING {
            return Err(bad("a record ring of another size".into()));
        }
        let remotes = (0..nq)
            .map(|_| QpEndpoint::from_bytes(r.bytes()?, peer))
            .collect::<Result<Vec<_>>>()?;
        r.end()?;
        let mode = if wants_no_atomic || their_no_atomic || !caps.atomics || !their_atomics {
            SignalMode::HostNoAtomic
        } else {
            SignalMode::Host
        };
        if mode != self.config.mode {
            tracing::info!(
                "rank {}: the connection to rank {peer} signals in {mode:?} mode (RDMA atomics: \
                 here {}, there {}; asked for: here {:?}, there {})",
                self.rank,
                caps.atomics,
                their_atomics,
                self.config.mode,
                if their_no_atomic {
                    "HostNoAtomic"
                } else {
                    "Host"
                }
            );
        }
        for q in 0..nq {
            let ts = qp::transitions(self.port, &locals[q], &remotes[q], &self.config)?;
            for (i, t) in ts.iter().enumerate() {
                qps[q].modify(t)?;
                if i == 0 {
                    // Receives may be posted from INIT on.
                    qps[q].post_recv(&Link::initial_receives(q))?;
                }
            }
        }
        // Both sides in RTS before either sends.
        let ready = exchange(b"ready")?;
        if ready != b"ready" {
            return Err(bad("no readiness after the queue-pair setup".into()));
        }
        let link = Arc::new(Link {
            send: Link::send_state(nq),
            recv: Link::recv_state(nq),
            closing: AtomicBool::new(false),
            rank: self.rank,
            peer,
            mode,
            qps,
            send_cq,
            ctrl,
            remote_ctrl,
            max_msg: (self.port_attr.max_msg_size as u64).clamp(4096, 1 << 30),
            send_depth,
            regions: self.regions.clone(),
            timeout: self.timeout,
        });
        let qp_nums: Vec<u32> = link.qps.iter().map(|q| q.qp_num()).collect();
        {
            let mut links = self
                .shared
                .links
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            for (q, n) in qp_nums.iter().enumerate() {
                links.insert(*n, (Arc::downgrade(&link), q));
            }
        }
        self.start_receiver()?;
        Ok(IbConnection {
            link,
            _unlink: Box::new(Unlink {
                shared: self.shared.clone(),
                qp_nums,
            }),
        })
    }
}

impl Drop for IbContext {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// The receiving proxy: polls the receive completion queue, applies every
/// record, returns credits after each batch. Idle, it yields, then sleeps
/// 50 us at a time.
fn receive_loop(shared: &RecvShared) {
    if let Some(d) = shared.device {
        if let Err(e) = d.bind_library_thread("IB receive loop") {
            shared.record(&e);
        }
    }
    let mut stream = ApplyStreams::default();
    let mut got: Vec<Completion> = Vec::new();
    let mut idle_since: Option<Instant> = None;
    while !shared.stop.load(Ordering::Acquire) {
        got.clear();
        if let Err(e) = shared.recv_cq.poll(&mut got, 64) {
            shared.record(&e);
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        if got.is_empty() {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < Duration::from_millis(10) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            continue;
        }
        idle_since = None;
        let mut touched: Vec<Arc<Link>> = Vec::new();
        for c in &got {
            let entry = {
                let links = shared.links.read().unwrap_or_else(PoisonError::into_inner);
                links
                    .get(&c.qp_num)
                    .and_then(|(l, q)| Some((l.upgrade()?, *q)))
            };
            let Some((link, q)) = entry else {
                tracing::debug!(
                    "rank {}: a receive completion of queue pair {} without a connection",
                    shared.rank,
                    c.qp_num
                );
                continue;
            };
            if let Err(e) = link.on_receive(q, c, &mut stream) {
                shared.record(&e);
                link.fail(&e);
            }
            if !touched.iter().any(|l| Arc::ptr_eq(l, &link)) {
                touched.push(link);
            }
        }
        for link in touched {
            if let Err(e) = link.return_credits() {
                if !link.closing.load(Ordering::Acquire) {
                    shared.record(&e);
                    link.fail(&e);
                }
            }
        }
    }
}
