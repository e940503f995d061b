//! `Communicator`: ties bootstrap, memory registration, connections,
//! semaphores and channels together, so one collective call builds channels to
//! every peer.
//!
//! Every method marked *collective* must be called by all ranks in the same
//! order: the communicator numbers its exchanges so their bootstrap messages
//! never mix. A Communicator may be shared (a [`Group`](crate::Group) makes
//! one for all its objects): its collectives are then made only while an
//! object is being made, one object at a time (see [`crate::group`]), and
//! each object keeps its own device error record and device-wait bound
//! ([`Member`](crate::group::Member)); [`Communicator::device_error`] is the
//! record of code that uses a Communicator on its own (tests, benchmarks).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bootstrap::Bootstrap;
use crate::channel::{HostInbound, MemoryChannel, PortChannel};
use crate::cuda::Device;
use crate::device_error::DeviceErrorRecord;
use crate::device_share::{ranks_on_same_device, DeviceShare};
use crate::error::{CommError, Result};
use crate::fd_passing::FdServer;
use crate::host_memory::HostMemory;
use crate::memory::DeviceMemory;
use crate::proxy::ProxyService;
use crate::proxy_pool::ProxyPool;
use crate::registered_memory::{host_id, IbKey, IpcExport, Location, MemoryInfo, RegisteredMemory};
use crate::semaphore::{Semaphore, SignalPage, SlotCursor, SLOT_BYTES};
use crate::topology::{ranks_per_node_from_env, Topology};
use crate::transport::cuda_ipc::{CudaIpcConnection, IpcStreams};
use crate::transport::ethernet::{EthernetConnection, EthernetReceiver};
use crate::transport::ib::config::IbConfig;
use crate::transport::ib::context::{IbContext, IbRegistration};
use crate::transport::ib::device::RdmaProvider;
use crate::transport::{Connection, CrossNode, Transport};
use crate::vmm::VmmMemory;
use crate::wire::{Reader, Writer};

/// `table[peer]`, made by `make` at the first call (one connection per peer).
fn cached(
    table: &Mutex<Vec<Option<Arc<dyn Connection>>>>,
    peer: usize,
    make: impl FnOnce() -> Result<Arc<dyn Connection>>,
) -> Result<Arc<dyn Connection>> {
    let mut conns = table.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = &conns[peer] {
        return Ok(c.clone());
    }
    let c = make()?;
    conns[peer] = Some(c.clone());
    Ok(c)
}

/// Bootstrap tags of the communicator's own exchanges (top bit clear, as the
/// bootstrap requires; high enough to stay out of users' way, and low enough
/// for a [`ScopedBootstrap`](crate::bootstrap::ScopedBootstrap), whose tags
/// end at 2^38 - 1: room for 2^37 exchanges).
const TAG_BASE: u64 = 1 << 37;
const _: () = assert!(TAG_BASE + (1 << 36) <= crate::bootstrap::ScopedBootstrap::MAX_TAG);
/// The tag of the IB queue-pair exchange of a pair of ranks (once per pair),
/// above every numbered exchange.
const TAG_IB: u64 = TAG_BASE + (1 << 36);

#[derive(Clone, Debug)]
pub struct CommunicatorOptions {
    /// Start an Ethernet receiver bound here (port 0: any), so peers can reach
    /// this rank's registered memory over TCP.
    pub ethernet: Option<SocketAddr>,
    /// Semaphore slots of one signal page (32 bytes each; raised to the
    /// number of ranks; where ranks ask for different counts, every rank uses
    /// the smallest). Pages are added as semaphores are made, so this bounds
    /// nothing: it is the step by which this rank's signal memory grows.
    pub semaphore_slots: u32,
    /// Bound of every host-side wait the communicator makes.
    pub timeout: Duration,
    /// Where IB verbs come from for peers on other nodes: None (the
    /// default) loads libibverbs at run time; tests pass a fake fabric
    /// ([`crate::transport::ib::fake::FakeFabric`]).
    pub rdma: Option<Arc<dyn RdmaProvider>>,
}

impl Default for CommunicatorOptions {
    fn default() -> Self {
        Self {
            ethernet: None,
            // One page: 2 MiB, the usual cuMem allocation granularity.
            semaphore_slots: 65536,
            timeout: Duration::from_secs(60),
            rdma: None,
        }
    }
}

/// Keeps an allocation and its registrations alive; undoes them on drop
/// (the RDMA registration first, before the memory goes).
struct Registration {
    _ib: Option<IbRegistration>,
    _memory: Arc<VmmMemory>,
    fd_server: Arc<FdServer>,
    fd_key: u64,
    ethernet: Option<(Arc<EthernetReceiver>, u64)>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.fd_server.withdraw(self.fd_key);
        if let Some((rx, ptr)) = &self.ethernet {
            rx.unregister(*ptr);
        }
    }
}

/// Bytes between two inbound counters of a port-channel inbound block (one
/// cache line each: a peer's CPU writes one while this GPU polls another).
pub const INBOUND_STRIDE: u64 = 64;

/// As [`Registration`], for memory without an fd offer (a legacy-IPC
/// registration, a host signal page).
struct LegacyRegistration {
    _ib: Option<IbRegistration>,
    _memory: Arc<dyn std::any::Any + Send + Sync>,
    ethernet: Option<(Arc<EthernetReceiver>, u64)>,
}

impl Drop for LegacyRegistration {
    fn drop(&mut self) {
        if let Some((rx, ptr)) = &self.ethernet {
            rx.unregister(*ptr);
        }
    }
}

pub struct Communicator {
    /// IB verbs for peers on other nodes (None: not used). Its
    /// connections, one per peer, are made at the first `connect`.
    ib: Option<Arc<IbContext>>,
    ib_connections: Mutex<Vec<Option<Arc<dyn Connection>>>>,
    /// The first signal page's RDMA registration (dropped before the page).
    ib_first_page: Option<IbRegistration>,
    bootstrap: Arc<dyn Bootstrap>,
    device: Option<Device>,
    host_id: u64,
    fd_server: Arc<FdServer>,
    ethernet: Option<Arc<EthernetReceiver>>,
    /// Every rank's Ethernet receiver address (if it runs one).
    peer_ethernet: Vec<Option<String>>,
    /// This rank's signal pages, every rank's pages as seen from here, and
    /// where the next semaphores go.
    signals: Mutex<Signals>,
    /// The record of code that uses this Communicator on its own (objects
    /// made on a Group keep their own).
    error: DeviceErrorRecord,
    seq: AtomicU64,
    timeout: Duration,
    ipc_connections: Mutex<Vec<Option<Arc<dyn Connection>>>>,
    /// The one stream of every CUDA IPC connection (made at the first).
    ipc_stream: Mutex<Option<Arc<IpcStreams>>>,
    /// Our inbound blocks of CUDA IPC port channels (one per `port_channels`
    /// call), kept as long as the Communicator, like the signal pages.
    inbound_blocks: Mutex<Vec<RegisteredMemory>>,
    /// This rank's share of its device (ranks on the same GPU found through
    /// the setup exchange); the whole device when alone or without a device.
    share: DeviceShare,
    /// Ranks of the group on this rank's device, this one included.
    device_peers: Vec<usize>,
    /// Where every rank is and how this one reaches it.
    topology: Topology,
}

/// A Communicator's semaphore counters (see [`crate::semaphore`]).
struct Signals {
    /// Ours, oldest first.
    pages: Vec<SignalPage>,
    /// `peers[k][r]`: rank r's page k as seen from here (ours: our own).
    peers: Vec<Vec<RegisteredMemory>>,
    cursor: SlotCursor,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("device", &self.device.map(|d| d.ordinal))
            .finish()
    }
}

impl Communicator {
    /// *Collective.* Sets up this rank: fd server, optional Ethernet receiver,
    /// first signal page (GPU memory, or heap memory without a device), and
    /// exchanges how to reach them.
    pub fn new(
        bootstrap: Arc<dyn Bootstrap>,
        device: Option<Device>,
        opts: CommunicatorOptions,
    ) -> Result<Self> {
        let rank = bootstrap.rank();
        let size = bootstrap.size();
        if let Some(d) = device {
            d.make_current()?;
        }
        let fd_server = Arc::new(FdServer::start("moelink")?);
        let ethernet = match opts.ethernet {
            Some(addr) => Some(EthernetReceiver::start(addr, device, rank)?),
            None => None,
        };
        let host_id = host_id();
        // At least one slot per peer, so that one call's semaphores fit a page.
        let slots = opts.semaphore_slots.max(size as u32);
        let page = match device {
            Some(d) => SignalPage::new(d, slots)?,
            None => SignalPage::host(slots),
        };
        let mut comm = Self {
            ib: None,
            ib_connections: Mutex::new(vec![None; size]),
            ib_first_page: None,
            bootstrap,
            device,
            host_id,
            fd_server,
            ethernet,
            peer_ethernet: vec![None; size],
            signals: Mutex::new(Signals {
                pages: Vec::new(),
                peers: Vec::new(),
                cursor: SlotCursor::new(page.slots()),
            }),
            error: DeviceErrorRecord::new(device)?,
            seq: AtomicU64::new(0),
            timeout: opts.timeout,
            ipc_connections: Mutex::new(vec![None; size]),
            ipc_stream: Mutex::new(None),
            inbound_blocks: Mutex::new(Vec::new()),
            share: DeviceShare::whole(0),
            device_peers: vec![rank],
            topology: Topology::single(rank, size),
        };
        let page_reg = comm.register_page(&page)?;
        let mut w = Writer::default();
        w.bytes(
            comm.ethernet
                .as_ref()
                .map(|e| e.address())
                .unwrap_or_default()
                .as_bytes(),
        );
        w.bytes(&page_reg.info().to_bytes());
        w.u64(page.slots() as u64);
        // Which GPU each rank uses: (host, device UUID); zeros without a device.
        let uuid = match device {
            Some(d) => d.uuid()?,
            None => [0; 16],
        };
        // The context's SM limit (MPS), lowered by MOELINK_SMS_PER_RANK: it is
        // exchanged, so every rank's group share (allreduce's block count,
        // which must agree) sees every rank's limit.
        let (device_sms, context_sms) = match device {
            Some(d) => crate::device_share::local_sm_counts(d)?,
            None => (0, None),
        };
        w.u64(host_id);
        w.bytes(&uuid);
        w.u64(device_sms as u64);
        w.u64(context_sms.unwrap_or(0) as u64);
        let all = comm.bootstrap.all_gather(&w.finish())?;
        let mut placement = Vec::with_capacity(size);
        let mut sm_counts = Vec::with_capacity(size);
        let mut peer_pages = Vec::with_capacity(size);
        let mut per_page = page.slots();
        for (r, b) in all.iter().enumerate() {
            let mut rd = Reader::new(b, "communicator setup");
            let eth = rd.bytes()?;
            if !eth.is_empty() {
                comm.peer_ethernet[r] = Some(String::from_utf8_lossy(eth).into_owned());
            }
            let peer_page = rd.bytes()?;
            let peer_slots = rd.u64()?;
            per_page = per_page.min(peer_slots.min(u32::MAX as u64) as u32);
            let peer_host = rd.u64()?;
            let mut peer_uuid = [0u8; 16];
            let u = rd.bytes()?;
            if u.len() != 16 {
                return Err(CommError::invalid(
                    "bootstrap",
                    format!(
                        "rank {r} sent a device id of {} bytes, expected 16",
                        u.len()
                    ),
                ));
            }
            peer_uuid.copy_from_slice(u);
            let sms = rd.u64()?.min(u32::MAX as u64) as u32;
            let ctx_sms = rd.u64()?.min(u32::MAX as u64) as u32;
            placement.push((peer_host, peer_uuid));
            sm_counts.push((sms, (ctx_sms > 0).then_some(ctx_sms)));
            rd.end()?;
            peer_pages.push(if r == rank {
                page_reg.clone()
            } else {
                RegisteredMemory::import_with_timeout(
                    MemoryInfo::from_bytes(peer_page)?,
                    device,
                    host_id,
                    comm.timeout,
                )?
            });
        }
        {
            let signals = comm.signals.get_mut().unwrap_or_else(|p| p.into_inner());
            signals.pages.push(page);
            signals.peers.push(peer_pages);
            // Every rank's pages hold at least the smallest rank's count.
            signals.cursor = SlotCursor::new(per_page);
        }
        let ranks_per_node = ranks_per_node_from_env()?;
        let cross_node = crate::transport::CrossNode::from_env()?;
        let topology = |ib| {
            Topology::new(
                rank,
                &placement,
                |peer| match device {
                    // A failed query counts as no P2P: the peer then goes
                    // through the proxy, which is slower but works.
                    Some(d) => d.can_access_peer_uuid(&placement[peer].1).unwrap_or(false),
                    None => false,
                },
                ranks_per_node,
                ib,
            )
        };
        comm.topology = topology(false)?;
        // Peers on other nodes: IB verbs where every rank has a usable device
        // (or MOELINK_TRANSPORT=ib demands it), else Ethernet.
        if comm.topology.num_nodes() > 1
            && !matches!(cross_node, CrossNode::Ethernet | CrossNode::CudaIpc)
        {
            let rdma = opts.rdma.clone();
            if comm.open_ib(cross_node, rdma, &page_reg)? {
                comm.topology = topology(true)?;
            }
        }
        if let Some(d) = device {
            comm.device_peers = ranks_on_same_device(&placement, rank);
            comm.share = DeviceShare::of_group(&placement, &sm_counts, rank);
            if comm.share.is_shared() {
                tracing::debug!(
                    "rank {rank}: {} ranks on device {} ({:?}); share {:?}",
                    comm.device_peers.len(),
                    d.ordinal,
                    comm.device_peers,
                    comm.share
                );
            }
        }
        // Every rank has mapped every signal page before anyone may drop theirs.
        comm.bootstrap.barrier()?;
        Ok(comm)
    }

    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    /// *Collective.* Opens this rank's RDMA device where a usable one
    /// exists, registers the first signal page with it, and agrees with
    /// every rank: IB verbs are used only if every rank has them (a rank
    /// without is logged once, or fails all ranks under
    /// `MOELINK_TRANSPORT=ib`). Returns whether they are used.
    fn open_ib(
        &mut self,
        cross_node: CrossNode,
        rdma: Option<Arc<dyn RdmaProvider>>,
        page: &RegisteredMemory,
    ) -> Result<bool> {
        let rank = self.rank();
        let config = IbConfig::from_env()?;
        let provider = || -> Result<Arc<dyn RdmaProvider>> {
            match &rdma {
                Some(p) => Ok(p.clone()),
                None => Ok(crate::transport::ib::native::shared_verbs()?),
            }
        };
        let local = cross_node
            .uses_ib(rank, true, || {
                crate::transport::ib::verbs::usable_devices(&*provider()?, &config.hca)
            })
            .and_then(|usable| {
                if !usable {
                    return Ok(None);
                }
                let local_rank = self.topology.peer(rank).local_rank;
                let ctx = IbContext::open(
                    rank,
                    &*provider()?,
                    config.clone(),
                    local_rank,
                    self.device,
                    self.timeout,
                )?;
                let info = page.info();
                let reg =
                    ctx.register(info.owner_ptr, info.len, info.location, info.process_wide())?;
                Ok(Some((ctx, reg)))
            });
        let mut w = Writer::default();
        match &local {
            Ok(Some((_, reg))) => w.u8(1).u32(reg.key().lkey).u32(reg.key().rkey),
            Ok(None) => w.u8(0).u32(0).u32(0),
            Err(_) => w.u8(2).u32(0).u32(0),
        };
        let all = self.bootstrap.all_gather(&w.finish())?;
        let mut keys = Vec::with_capacity(all.len());
        let mut without = Vec::new();
        for (r, b) in all.iter().enumerate() {
            let mut rd = Reader::new(b, "IB verbs agreement");
            let (usable, lkey, rkey) = (rd.u8()?, rd.u32()?, rd.u32()?);
            rd.end()?;
            if usable != 1 {
                without.push(r);
            }
            keys.push(IbKey { lkey, rkey });
        }
        let (ctx, reg) = match local {
            Err(e) => return Err(e),
            Ok(_) if !without.is_empty() => {
                if cross_node == CrossNode::Ib {
                    return Err(CommError::NoRdma {
                        reason: format!(
                            "{}=ib, but ranks {without:?} have no usable RDMA device",
                            crate::transport::TRANSPORT_ENV
                        ),
                    });
                }
                tracing::info!(
                    "rank {rank}: ranks {without:?} have no usable RDMA device; peers on other \
                     nodes use Ethernet"
                );
                return Ok(false);
            }
            Ok(None) => return Ok(false),
            Ok(Some(x)) => x,
        };
        let signals = self.signals.get_mut().unwrap_or_else(|p| p.into_inner());
        for (r, m) in signals.peers[0].iter_mut().enumerate() {
            m.set_ib(keys[r]);
        }
        self.ib = Some(ctx);
        self.ib_first_page = Some(reg);
        Ok(true)
    }

    /// How peers reach this rank's `[ptr, ptr + len)`: `ipc` on this host,
    /// Ethernet where the receiver runs, IB verbs where `ib` registered it.
    fn memory_info(
        &self,
        ptr: u64,
        len: u64,
        location: Location,
        ipc: Option<IpcExport>,
        ib: &Option<IbRegistration>,
    ) -> MemoryInfo {
        MemoryInfo {
            rank: self.rank() as u32,
            len,
            location,
            host_id: self.host_id,
            owner_ptr: ptr,
            ipc,
            ethernet: self.ethernet.as_ref().map(|e| e.address()),
            ib: ib.as_ref().map(IbRegistration::key),
        }
    }

    /// The IB verbs state, where peers on other nodes use it.
    pub fn ib_context(&self) -> Option<&Arc<IbContext>> {
        self.ib.as_ref()
    }

    /// Registers `[ptr, ptr + len)` with the RDMA device, where IB verbs are used.
    fn ib_register(
        &self,
        ptr: u64,
        len: u64,
        location: Location,
        process_wide: bool,
    ) -> Result<Option<IbRegistration>> {
        match &self.ib {
            Some(ctx) => ctx.register(ptr, len, location, process_wide).map(Some),
            None => Ok(None),
        }
    }

    /// Every rank's node, local rank, device sharing, P2P reach and the way
    /// this rank reaches it (`MOELINK_RANKS_PER_NODE`: emulated nodes).
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    pub fn size(&self) -> usize {
        self.bootstrap.size()
    }

    pub fn device(&self) -> Option<Device> {
        self.device
    }

    /// This rank's share of its GPU: how many ranks of the group use it and
    /// how many SMs one of this rank's grids may take (see [`DeviceShare`]).
    pub fn device_share(&self) -> DeviceShare {
        self.share
    }

    /// Ranks of the group on this rank's GPU (this one included), in rank order.
    pub fn ranks_on_device(&self) -> &[usize] {
        &self.device_peers
    }

    pub fn bootstrap(&self) -> &Arc<dyn Bootstrap> {
        &self.bootstrap
    }

    /// The record of code that uses this Communicator on its own: pass it to
    /// the channels' `device_handle` and check it. Objects made on a
    /// [`Group`](crate::Group) share the group's Communicator and never use
    /// this record: each passes its own
    /// ([`Member::device_error`](crate::group::Member::device_error)).
    /// Check it with [`DeviceErrorRecord::check`] (a rejected argument is
    /// reported once, a timeout every time).
    pub fn device_error(&self) -> &DeviceErrorRecord {
        &self.error
    }

    /// Whether this rank runs an Ethernet receiver
    /// ([`CommunicatorOptions::ethernet`]).
    pub fn has_ethernet(&self) -> bool {
        self.ethernet.is_some()
    }

    /// The bound of this Communicator's host-side waits.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Signal pages this rank has so far (one at creation; one more each
    /// time a call's semaphores did not fit).
    pub fn signal_pages(&self) -> usize {
        self.signals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pages
            .len()
    }

    /// Semaphore slots of every signal page (the same on every rank).
    pub fn semaphores_per_page(&self) -> u32 {
        self.signals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cursor
            .per_page()
    }

    fn next_tag(&self) -> u64 {
        TAG_BASE + self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a cuMem allocation of this process: CUDA IPC through the fd
    /// server, plus Ethernet when the receiver runs.
    fn register(&self, memory: Arc<VmmMemory>) -> Result<RegisteredMemory> {
        let fd_key = self.fd_server.offer(memory.export_fd()?);
        let ptr = memory.ptr();
        let len = memory.len() as u64;
        let ib = self.ib_register(ptr, len, Location::Device(memory.device().ordinal), true)?;
        let ethernet = self.ethernet.as_ref().map(|rx| {
            rx.register_process_wide(ptr, len, Location::Device(memory.device().ordinal));
            (rx.clone(), ptr)
        });
        let info = self.memory_info(
            ptr,
            len,
            Location::Device(memory.device().ordinal),
            Some(IpcExport::Vmm {
                server: self.fd_server.address(),
                key: fd_key,
                len,
            }),
            &ib,
        );
        let keep = Registration {
            _ib: ib,
            _memory: memory,
            fd_server: self.fd_server.clone(),
            fd_key,
            ethernet,
        };
        Ok(RegisteredMemory::local(info, Some(Arc::new(keep))))
    }

    /// Registers a signal page: a GPU page like any cuMem allocation, a host
    /// page for Ethernet only.
    fn register_page(&self, page: &SignalPage) -> Result<RegisteredMemory> {
        if let Some(m) = page.device_memory() {
            return self.register(m.clone());
        }
        let mem: Arc<HostMemory> = page
            .host_memory()
            .cloned()
            .ok_or_else(|| CommError::invalid("signal page", "neither GPU nor host memory"))?;
        let (ptr, len) = (page.ptr(), mem.len() as u64);
        let ib = self.ib_register(ptr, len, Location::Host, true)?;
        let ethernet = self.ethernet.as_ref().map(|rx| {
            rx.register(ptr, len, Location::Host);
            (rx.clone(), ptr)
        });
        let info = self.memory_info(ptr, len, Location::Host, None, &ib);
        let keep = LegacyRegistration {
            _ib: ib,
            _memory: mem,
            ethernet,
        };
        Ok(RegisteredMemory::local(info, Some(Arc::new(keep))))
    }

    /// *Collective* (every rank at the same call, see [`SlotCursor`]): a new
    /// signal page on every rank, exchanged and imported like the first.
    fn add_signal_page(&self, signals: &mut Signals) -> Result<()> {
        let slots = signals.cursor.per_page();
        let page = match self.device {
            Some(d) => SignalPage::new(d, slots)?,
            None => SignalPage::host(slots),
        };
        let reg = self.register_page(&page)?;
        let all = self.exchange_memory(&reg)?;
        signals.pages.push(page);
        signals.peers.push(all);
        signals.cursor.add_page();
        tracing::debug!(
            "rank {}: signal page {} added ({slots} semaphores each)",
            self.rank(),
            signals.pages.len() - 1
        );
        Ok(())
    }

    /// Allocates `len` bytes of GPU memory (rounded up to the allocation
    /// granularity) and registers it for every transport this rank supports.
    /// Falls back to `cuMemAlloc` + a legacy CUDA IPC handle where the device
    /// cannot create POSIX-fd shareable cuMem allocations.
    pub fn alloc_memory(&self, len: usize) -> Result<RegisteredMemory> {
        let device = self
            .device
            .ok_or_else(|| CommError::invalid("device", "this communicator has no GPU"))?;
        match VmmMemory::alloc(device, len) {
            Ok(m) => self.register(Arc::new(m)),
            Err(CommError::Cuda { call, source }) => {
                tracing::warn!(
                    "{call} failed ({source}); falling back to cuMemAlloc + legacy CUDA IPC"
                );
                self.register_legacy(Arc::new(DeviceMemory::alloc(device, len)?))
            }
            Err(e) => Err(e),
        }
    }

    /// Registers a `cuMemAlloc` allocation through a legacy CUDA IPC handle
    /// (plus Ethernet when the receiver runs).
    pub fn register_legacy(&self, memory: Arc<DeviceMemory>) -> Result<RegisteredMemory> {
        let handle = memory.ipc_handle()?;
        let (ptr, len) = (memory.ptr(), memory.len() as u64);
        let location = Location::Device(memory.device().ordinal);
        let ib = self.ib_register(ptr, len, location, false)?;
        let ethernet = self.ethernet.as_ref().map(|rx| {
            rx.register(ptr, len, location);
            (rx.clone(), ptr)
        });
        let info = self.memory_info(ptr, len, location, Some(IpcExport::Legacy(handle)), &ib);
        let keep = LegacyRegistration {
            _ib: ib,
            _memory: memory,
            ethernet,
        };
        Ok(RegisteredMemory::local(info, Some(Arc::new(keep))))
    }

    /// Registers memory owned by the caller (host memory, or GPU memory from
    /// another allocator) for Ethernet access, and with the RDMA device where
    /// IB verbs are used (that registration lives as long as the returned
    /// memory and its clones). The caller keeps the memory alive and in
    /// place while peers may use it.
    pub fn register_external(
        &self,
        ptr: u64,
        len: u64,
        location: Location,
    ) -> Result<RegisteredMemory> {
        let ib = self.ib_register(ptr, len, location, false)?;
        if let Some(rx) = &self.ethernet {
            rx.register(ptr, len, location);
        }
        let info = self.memory_info(ptr, len, location, None, &ib);
        let keep = ib.map(|r| Arc::new(r) as Arc<dyn std::any::Any + Send + Sync>);
        Ok(RegisteredMemory::local(info, keep))
    }

    /// *Collective.* Every rank's `mem` (indexed by rank; ours is `mem` itself),
    /// peers' mapped into this process where possible. Ends with a barrier:
    /// once it returns, every peer has imported `mem`, so dropping it is safe.
    pub fn exchange_memory(&self, mem: &RegisteredMemory) -> Result<Vec<RegisteredMemory>> {
        let all = self.bootstrap.all_gather(&mem.info().to_bytes())?;
        let imported = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                if r == self.rank() {
                    Ok(mem.clone())
                } else {
                    RegisteredMemory::import_with_timeout(
                        MemoryInfo::from_bytes(b)?,
                        self.device,
                        self.host_id,
                        self.timeout,
                    )
                }
            })
            .collect::<Result<Vec<_>>>();
        // Even on a failed import: the peers wait here, not on a dropped offer.
        self.bootstrap.barrier()?;
        imported
    }

    /// A connection to `peer` over `transport` (CUDA IPC connections are kept,
    /// one per peer, and all of them issue on one stream: see
    /// [`CudaIpcConnection::new`]).
    pub fn connect(&self, peer: usize, transport: Transport) -> Result<Arc<dyn Connection>> {
        if peer >= self.size() {
            return Err(CommError::invalid(
                "peer",
                format!("{peer} of {} ranks", self.size()),
            ));
        }
        match transport {
            Transport::CudaIpc => {
                let device = self.device.ok_or_else(|| {
                    CommError::invalid("transport", "CUDA IPC needs a GPU communicator")
                })?;
                cached(&self.ipc_connections, peer, || {
                    let stream = {
                        let mut shared = self.ipc_stream.lock().unwrap_or_else(|p| p.into_inner());
                        match &*shared {
                            Some(s) => s.clone(),
                            None => shared.insert(Arc::new(IpcStreams::new(device)?)).clone(),
                        }
                    };
                    Ok(Arc::new(CudaIpcConnection::new(self.rank(), peer, stream)))
                })
            }
            Transport::Ethernet => {
                let addr = self.peer_ethernet[peer].as_ref().ok_or_else(|| {
                    CommError::invalid(
                        "transport",
                        format!(
                            "rank {peer} runs no Ethernet receiver (CommunicatorOptions::ethernet)"
                        ),
                    )
                })?;
                Ok(Arc::new(EthernetConnection::connect(
                    self.rank(),
                    peer,
                    addr,
                    self.device,
                    self.timeout,
                )?))
            }
            Transport::IbVerbs => {
                let Some(ctx) = &self.ib else {
                    return Err(crate::transport::ib::connect_unavailable());
                };
                cached(&self.ib_connections, peer, || {
                    let boot = &self.bootstrap;
                    let mut exchange = |mine: &[u8]| {
                        boot.send(peer, TAG_IB, mine)?;
                        boot.recv(peer, TAG_IB)
                    };
                    Ok(Arc::new(ctx.connect(peer, &mut exchange)?))
                })
            }
        }
    }

    /// *Collective.* One semaphore with every peer (None at our own index).
    /// Takes one slot per peer from the newest signal page; where they do not
    /// all fit, every rank first adds a page (collectively: every rank takes
    /// the same number of slots per call, so all decide alike).
    pub fn semaphores(&self) -> Result<Vec<Option<Semaphore>>> {
        let mut signals = self.signals.lock().unwrap_or_else(|p| p.into_inner());
        let (rank, size) = (self.rank(), self.size());
        if signals.cursor.needs_page(size.saturating_sub(1) as u32)? {
            self.add_signal_page(&mut signals)?;
        }
        let tag = self.next_tag();
        let mut slots = vec![(0u32, 0u32); size];
        for (peer, slot) in slots.iter_mut().enumerate() {
            if peer != rank {
                *slot = signals.cursor.take()?;
                let mut msg = slot.0.to_le_bytes().to_vec();
                msg.extend_from_slice(&slot.1.to_le_bytes());
                self.bootstrap.send(peer, tag, &msg)?;
            }
        }
        let mut out = vec![None; size];
        for peer in (0..size).filter(|&p| p != rank) {
            let b = self.bootstrap.recv(peer, tag)?;
            let (remote_page, remote_slot) = match b.as_slice() {
                [a0, a1, a2, a3, b0, b1, b2, b3] => (
                    u32::from_le_bytes([*a0, *a1, *a2, *a3]),
                    u32::from_le_bytes([*b0, *b1, *b2, *b3]),
                ),
                _ => {
                    return Err(CommError::invalid(
                        "semaphore exchange",
                        format!("rank {peer} sent a slot message of {} bytes", b.len()),
                    ))
                }
            };
            let pages = signals.peers.len();
            let per_page = signals.cursor.per_page();
            let remote = signals
                .peers
                .get(remote_page as usize)
                .filter(|_| remote_slot < per_page)
                .map(|p| p[peer].clone())
                .ok_or_else(|| {
                    CommError::invalid(
                        "semaphore exchange",
                        format!(
                            "rank {rank}: rank {peer} gave slot {remote_slot} of its signal page \
                             {remote_page}, but rank {rank} knows {pages} pages of {per_page} \
                             slots (the ranks did not make their semaphores collectively)"
                        ),
                    )
                })?;
            let (page, slot) = slots[peer];
            out[peer] = Some(Semaphore {
                rank,
                peer,
                local_inbound: signals.pages[page as usize].slot_ptr(slot),
                remote_page: remote,
                remote_offset: remote_slot as u64 * SLOT_BYTES,
                id: ((rank as u64) << 48)
                    | ((peer as u64) << 32)
                    | (signals.cursor.global(page, slot) & 0xffff_ffff),
            });
        }
        Ok(out)
    }

    /// *Collective.* Memory channels to every peer over `local` (each peer's
    /// counterpart is its `local`); `packets` is our buffer peers write LL
    /// packets into (default: `local`).
    pub fn memory_channels(
        &self,
        local: &RegisteredMemory,
        packets: Option<&RegisteredMemory>,
    ) -> Result<Vec<Option<MemoryChannel>>> {
        let peers = self.exchange_memory(local)?;
        self.memory_channels_to(local, &peers, packets)
    }

    /// *Collective.* Memory channels to every peer whose memory `peers[p]` was
    /// already exchanged (as [`Self::exchange_memory`] returns it): fresh
    /// semaphores, `peers[p]` as destination.
    pub fn memory_channels_to(
        &self,
        local: &RegisteredMemory,
        peers: &[RegisteredMemory],
        packets: Option<&RegisteredMemory>,
    ) -> Result<Vec<Option<MemoryChannel>>> {
        if peers.len() != self.size() {
            return Err(CommError::invalid(
                "peers",
                format!("{} memories for {} ranks", peers.len(), self.size()),
            ));
        }
        let sems = self.semaphores()?;
        Ok(sems
            .into_iter()
            .enumerate()
            .map(|(p, s)| {
                s.map(|semaphore| MemoryChannel {
                    semaphore,
                    dst: peers[p].clone(),
                    src: local.clone(),
                    packets: packets.unwrap_or(local).clone(),
                })
            })
            .collect())
    }

    /// *Collective.* Port channels to every peer over `local`, performed by
    /// `proxy` on `transport` connections.
    ///
    /// Over CUDA IPC, each channel's inbound counter (the word its waits poll
    /// and the peer's proxy signals) is in shared host memory of this rank
    /// (one block per call, exchanged here, [`INBOUND_STRIDE`] bytes per
    /// peer): the peer's proxy signals it with a CPU store when nothing of
    /// its connection is in flight, instead of a stream memory operation
    /// (see [`crate::transport::cuda_ipc`]). Over the other transports it is
    /// the semaphore slot's inbound counter in GPU memory, as for memory
    /// channels.
    pub fn port_channels(
        &self,
        proxy: &ProxyService,
        local: &RegisteredMemory,
        transport: Transport,
    ) -> Result<Vec<Option<PortChannel>>> {
        self.port_channels_on(&[proxy], &|_| 0, local, transport)
    }

    /// *Collective.* [`port_channels`](Self::port_channels) sharded over the
    /// services of `pool`: the channel to peer `p` lives on service
    /// `pool.place(p)` and carries that service's FIFO and memory ids (`local`
    /// is registered once on each service that gets a channel).
    pub fn port_channels_pooled(
        &self,
        pool: &ProxyPool,
        local: &RegisteredMemory,
        transport: Transport,
    ) -> Result<Vec<Option<PortChannel>>> {
        let services: Vec<&ProxyService> = pool.services().iter().collect();
        self.port_channels_on(&services, &|p| pool.place(p), local, transport)
    }

    /// Port channels to every peer; the one to peer `p` on
    /// `services[service_of(p)]`.
    fn port_channels_on(
        &self,
        services: &[&ProxyService],
        service_of: &dyn Fn(usize) -> usize,
        local: &RegisteredMemory,
        transport: Transport,
    ) -> Result<Vec<Option<PortChannel>>> {
        let peers = self.exchange_memory(local)?;
        let sems = self.semaphores()?;
        // Every rank calls with the same transport, so all take part or none.
        let inbound = match transport {
            Transport::CudaIpc => Some(self.inbound_block()?),
            _ => None,
        };
        // `local`'s id on each service, registered on first use.
        let mut src_mems: Vec<Option<u32>> = vec![None; services.len()];
        let mut out = vec![None; self.size()];
        for (p, s) in sems.into_iter().enumerate() {
            let Some(semaphore) = s else { continue };
            let service = service_of(p);
            let proxy = *services.get(service).ok_or_else(|| {
                CommError::invalid(
                    "proxy",
                    format!("peer {p} placed on service {service} of {}", services.len()),
                )
            })?;
            let src_mem = match src_mems[service] {
                Some(id) => id,
                None => {
                    let id = proxy.add_memory(local.clone())?;
                    src_mems[service] = Some(id);
                    id
                }
            };
            let conn = self.connect(p, transport)?;
            let dst_mem = proxy.add_memory(peers[p].clone())?;
            // The peer's counter for us: in its block where we mapped one,
            // else its semaphore slot. Ours for the peer: likewise (a peer
            // fails in the exchange when it cannot map a block we offer).
            let (target, target_offset) = match &inbound {
                Some((_, all)) if all[p].host_ptr().is_some() => {
                    (all[p].clone(), self.rank() as u64 * INBOUND_STRIDE)
                }
                _ => (semaphore.remote_page.clone(), semaphore.remote_offset),
            };
            let host_inbound = match &inbound {
                Some((Some((ours, dev)), _)) => Some(HostInbound {
                    device_ptr: dev + p as u64 * INBOUND_STRIDE,
                    block: ours.clone(),
                }),
                _ => None,
            };
            let channel = proxy.add_channel(conn, target, target_offset)?;
            out[p] = Some(PortChannel {
                channel,
                fifo: proxy.fifo_handle(),
                semaphore,
                dst_mem,
                src_mem,
                host_inbound,
            });
        }
        Ok(out)
    }

    /// *Collective.* A new block of port-channel inbound counters in shared
    /// host memory (zeroed, registered with our GPU), exchanged: ours and its
    /// device address (None where it could not be made: this rank's channels
    /// then wait on their semaphore slots, and the peers, finding nothing to
    /// map, signal those), and every rank's as seen here (ours at our index).
    #[allow(clippy::type_complexity)]
    fn inbound_block(&self) -> Result<(Option<(RegisteredMemory, u64)>, Vec<RegisteredMemory>)> {
        let bytes = self.size() as u64 * INBOUND_STRIDE;
        let made = match self.device {
            Some(d) => match HostMemory::shared(Some(d), bytes as usize) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(
                        "rank {}: no shared host memory for port-channel signals ({e}); \
                         CUDA IPC signals to this rank go through the proxy's stream",
                        self.rank()
                    );
                    None
                }
            },
            None => None,
        };
        let mut info = MemoryInfo {
            rank: self.rank() as u32,
            len: bytes,
            location: Location::Host,
            host_id: self.host_id,
            owner_ptr: 0,
            ipc: None,
            ethernet: None,
            ib: None,
        };
        let (ours, fd_key) = match made {
            Some((memory, fd)) => {
                let fd_key = self.fd_server.offer(fd);
                info.owner_ptr = memory.as_ptr() as u64;
                info.ipc = Some(IpcExport::SharedHost {
                    server: self.fd_server.address(),
                    key: fd_key,
                    len: memory.len() as u64,
                });
                let dev = memory.device_ptr();
                let reg = RegisteredMemory::local(info.clone(), Some(Arc::new(memory)));
                (Some((reg, dev)), Some(fd_key))
            }
            None => (None, None),
        };
        let advertised = match &ours {
            Some((reg, _)) => reg.clone(),
            None => RegisteredMemory::local(info, None),
        };
        let all = self.exchange_memory(&advertised);
        // exchange_memory ends with a barrier: every peer has its mapping (or
        // failed), so the offer (an open fd) can go.
        if let Some(k) = fd_key {
            self.fd_server.withdraw(k);
        }
        let all = all?;
        if let Some((reg, _)) = &ours {
            self.inbound_blocks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(reg.clone());
        }
        Ok((ours, all))
    }

    /// *Collective.* Barrier over the bootstrap.
    pub fn barrier(&self) -> Result<()> {
        self.bootstrap.barrier()
    }
}
