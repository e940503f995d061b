//! [`EpBuffer`]: the Rust half of one `moelink.Buffer`, made on one
//! `comm::Group`: its intranode part ([`IntranodeBuffer`]) and its
//! low-latency part ([`LowLatencyBuffer`]), either of which may be absent.
//!
//! Each part is an object of the group of its own (kinds "intranode buffer"
//! and "low-latency buffer", made in that order), so it keeps its own scope of
//! the group's bootstrap, device error record and device-wait bound: an error
//! one part's kernels record is reported by that part only, and the
//! low-latency `clean()` forgets its own. What the parts share lives here:
//! joining the group and allocating the part's region (`PartBase::join`:
//! the rank limit, the size check, the device-wait bound, the GPU share), the
//! device-error checks and the barrier ([`BufferPart`]) and the order in which
//! a Buffer is destroyed ([`EpBuffer::destroy`]). `intranode` and
//! `low_latency` keep their buffer layouts and launch sequences.

use std::sync::Arc;
use std::time::Duration;

use comm::error::{check_device_timeout_ns, CommError, Result};
use comm::{
    Communicator, CommunicatorOptions, Device, DeviceMemory, DeviceShare, Group, Member,
    SymmetricRegion,
};
use ep_kernels::intranode::CTRL_BYTES;
use ep_kernels::low_latency::FLAGS_BYTES;
use ep_kernels::DeviceKernels;

use crate::internode::InternodeBuffer;
use crate::intranode::IntranodeBuffer;
use crate::limits::MAX_RANKS;
use crate::low_latency::{LowLatencyBuffer, LowLatencyOptions};

/// Bound of host waits by default (the Communicator's, the CPU wait for the
/// intranode notify kernel's counts).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound of every device wait by default: 30 s of GPU time (below
/// [`DEFAULT_TIMEOUT`], so a hang is reported by the device, naming rank and peer).
pub const DEFAULT_DEVICE_TIMEOUT_NS: i64 = comm::error::DEFAULT_DEVICE_TIMEOUT_NS;

/// The parts of an [`EpBuffer`], in the order they are made and destroyed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartKind {
    Intranode,
    LowLatency,
}

impl PartKind {
    /// Both parts, in the order they are made and destroyed.
    pub const ALL: [PartKind; 2] = [PartKind::Intranode, PartKind::LowLatency];

    /// "intranode" or "low-latency", as the part's messages name it.
    pub fn name(self) -> &'static str {
        match self {
            PartKind::Intranode => "intranode",
            PartKind::LowLatency => "low-latency",
        }
    }

    /// (bytes at the start of the part's region that start zeroed: the
    /// intranode control region, the low-latency flags; the least size of
    /// the region).
    pub fn region_bounds(self) -> (u64, u64) {
        match self {
            PartKind::Intranode => (CTRL_BYTES, CTRL_BYTES + 4096),
            PartKind::LowLatency => (FLAGS_BYTES, FLAGS_BYTES),
        }
    }

    /// (bytes of the part's region, bound of its device waits) that `opts`
    /// ask for on a group of `nodes` nodes: the intranode part adds the
    /// cross-node regions only where the group spans nodes.
    fn args(self, opts: &EpBufferOptions, nodes: usize) -> (usize, i64) {
        match self {
            PartKind::Intranode => (
                opts.num_nvl_bytes
                    + if nodes > 1 {
                        opts.num_internode_bytes
                    } else {
                        0
                    },
                opts.device_timeout_ns,
            ),
            PartKind::LowLatency => (opts.num_ll_bytes, opts.low_latency.device_timeout_ns),
        }
    }

    /// `InvalidArgument` where this part cannot be made as `opts` ask in a
    /// group of `size` ranks: above [`MAX_RANKS`], a region size that is not a
    /// multiple of 128 of at least the part's least, a device-wait bound that
    /// is not positive (in this order).
    fn check_args(self, size: usize, opts: &EpBufferOptions) -> Result<()> {
        if size > MAX_RANKS {
            return Err(CommError::invalid(
                "group",
                format!(
                    "{size} ranks; {} kernels handle at most {MAX_RANKS}",
                    self.name()
                ),
            ));
        }
        let (bytes, device_timeout_ns) = self.args(opts, 1);
        let (_, least) = self.region_bounds();
        if bytes < least as usize || bytes % 128 != 0 {
            let (arg, hint) = self.bytes_arg();
            return Err(CommError::invalid(
                arg,
                format!("{bytes} bytes: need a multiple of 128 of at least {least} (see {hint})"),
            ));
        }
        check_device_timeout_ns(device_timeout_ns).map(|_| ())
    }

    /// (the `moelink.Buffer` argument that sizes the part's region, the size
    /// hint that computes it).
    fn bytes_arg(self) -> (&'static str, &'static str) {
        match self {
            PartKind::Intranode => ("num_nvl_bytes", "Config.get_nvl_buffer_size_hint"),
            PartKind::LowLatency => ("num_rdma_bytes", "Buffer.get_low_latency_rdma_size_hint"),
        }
    }
}

/// Phase stamps of a part's kernels: `words` zeroed u64 of device memory,
/// allocated only where the environment variable `env` is `1` (else the
/// kernels get a null pointer and stamp nothing).
pub(crate) struct PhaseStamps {
    mem: Option<DeviceMemory>,
    env: &'static str,
}

impl PhaseStamps {
    pub(crate) fn from_env(device: Device, env: &'static str, words: usize) -> Result<Self> {
        let mem = if std::env::var(env).is_ok_and(|v| v == "1") {
            let m = DeviceMemory::alloc(device, 8 * words)?;
            m.fill(0)?;
            Some(m)
        } else {
            None
        };
        Ok(Self { mem, env })
    }

    /// The kernels' stamp pointer (0: none).
    pub(crate) fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr())
    }

    /// The stamps, after synchronising `device`; an error unless `env` was set.
    pub(crate) fn read(&self, device: Device) -> Result<Vec<u64>> {
        let m = self.mem.as_ref().ok_or_else(|| {
            CommError::invalid(
                "profile",
                format!(
                    "create the Buffer with {}=1 to record phase stamps",
                    self.env
                ),
            )
        })?;
        device.synchronize()?;
        let mut v = vec![0u64; m.len() / 8];
        m.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// As [`read`](Self::read), then zeroes the stamps: the next read shows only
    /// the blocks that launches after this one stamped (a launch with fewer
    /// blocks than an earlier one would otherwise leave the earlier one's
    /// stamps in its other block rows).
    pub(crate) fn take(&self, device: Device) -> Result<Vec<u64>> {
        let v = self.read(device)?;
        if let Some(m) = &self.mem {
            m.fill(0)?;
        }
        Ok(v)
    }
}

/// What each part keeps of its group and device: the group's Communicator
/// with the part's own scope, device error record and device-wait bound (its
/// [`Member`]), and the kernels of its device.
pub struct PartBase {
    kind: PartKind,
    member: Member,
    kernels: DeviceKernels,
}

impl PartBase {
    /// *Collective.* Makes the group's next object, a "`{kind} buffer`" on
    /// `device`, on the group's Communicator (made now, its host waits bounded
    /// by `opts.timeout`, if this is the group's first object), and the part's
    /// region: `opts`' bytes of it per rank, mapped by every peer, its first
    /// [`PartKind::region_bounds`] bytes zeroed. Refuses a group above
    /// [`MAX_RANKS`], a size that is not a multiple of 128 of at least the
    /// part's least, and a rank whose share of its GPU is not one SM. The
    /// part's device waits are bounded by `opts`' bound for it. The object is
    /// being made until [`ready`](Self::ready).
    pub(crate) fn join(
        group: &Group,
        device: Device,
        opts: &EpBufferOptions,
        kind: PartKind,
    ) -> Result<(Self, SymmetricRegion)> {
        kind.check_args(group.size(), opts)?;
        let copts = CommunicatorOptions {
            timeout: opts.timeout,
            ethernet: match kind {
                PartKind::Intranode if opts.num_internode_bytes > 0 => {
                    crate::internode::ethernet_receiver()?
                }
                _ => None,
            },
            ..CommunicatorOptions::default()
        };
        let mut member = group.join(&format!("{} buffer", kind.name()), Some(device), &copts)?;
        let nodes = member.comm().topology().num_nodes();
        let (bytes, device_timeout_ns) = kind.args(opts, nodes);
        member.set_device_timeout_ns(device_timeout_ns)?;
        member
            .comm()
            .device_share()
            .require(&format!("{} dispatch/combine", kind.name()), 1)?;
        let kernels = DeviceKernels::get(device)?;
        let (zeroed, _) = kind.region_bounds();
        let region = SymmetricRegion::new(member.comm(), bytes, zeroed as usize)?;
        let part = Self {
            kind,
            member,
            kernels,
        };
        Ok((part, region))
    }

    /// *Collective.* Every rank has finished this part's setup (mapped every
    /// peer's memory) before any uses it.
    pub(crate) fn ready(&mut self) -> Result<()> {
        self.member.ready()
    }

    /// The part's group object: the shared Communicator, its scope, device
    /// error record and device-wait bound.
    pub fn member(&self) -> &Member {
        &self.member
    }

    /// The group's Communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        self.member.comm()
    }

    pub fn kind(&self) -> PartKind {
        self.kind
    }

    pub fn rank(&self) -> usize {
        self.member.rank()
    }

    pub fn num_ranks(&self) -> usize {
        self.member.size()
    }

    /// The device (the one its kernels were loaded on).
    pub fn device(&self) -> Device {
        self.kernels.device()
    }

    pub(crate) fn kernels(&self) -> &DeviceKernels {
        &self.kernels
    }

    /// This rank's share of its GPU (ranks that share it, SMs per rank).
    pub fn device_share(&self) -> DeviceShare {
        self.member.comm().device_share()
    }

    /// Bound of every device-side wait of this part, nanoseconds of GPU time.
    pub fn device_timeout_ns(&self) -> i64 {
        self.member.device_timeout_ns()
    }

    /// Address of this part's device error record (kernel argument).
    pub(crate) fn error_ptr(&self) -> u64 {
        self.member.device_error().device_ptr()
    }
}

/// What both parts are: an object of the group whose errors and barrier work
/// alike; a part says only where its memory is and what it runs beside its
/// kernels.
pub trait BufferPart: Sync {
    /// The part's group object, device and kernels.
    fn base(&self) -> &PartBase;

    /// Device address and length of this rank's buffer of this part.
    fn local_buffer(&self) -> (u64, usize);

    /// Errors of what the part runs beside its kernels (the low-latency proxy
    /// and its FIFO), if any.
    fn check_transport(&self) -> Result<()> {
        Ok(())
    }

    /// Errors that leave the ranks out of step (a device wait of this part
    /// that timed out, its proxy or its FIFO), if any; an expert id out of
    /// range stays for [`check_device`](Self::check_device).
    fn check_device_timeout(&self) -> Result<()> {
        self.base().member().check_device_timeout()?;
        self.check_transport()
    }

    /// Errors one of this part's kernels recorded (a device wait that ran
    /// out: rank, peer, what; an expert id out of range, reported once), its
    /// proxy or its FIFO, if any.
    fn check_device(&self) -> Result<()> {
        self.check_device_timeout()?;
        self.base().member().check_device()
    }

    /// *Collective.* A host barrier of this part's ranks, in its own scope of
    /// the group's bootstrap (so it never meets another object's collectives).
    fn barrier(&self) -> Result<()> {
        self.base().member().barrier()
    }
}

impl std::fmt::Debug for dyn BufferPart + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let base = self.base();
        f.debug_struct(base.kind().name())
            .field("rank", &base.rank())
            .field("num_ranks", &base.num_ranks())
            .field("bytes", &self.local_buffer().1)
            .finish()
    }
}

/// How to make an [`EpBuffer`].
#[derive(Clone, Copy, Debug)]
pub struct EpBufferOptions {
    /// Bytes of the intranode part's NVL buffer (0: no intranode part).
    pub num_nvl_bytes: usize,
    /// Bytes the intranode part adds for the cross-node regions when the
    /// group spans more than one node (DeepEP's `num_rdma_bytes` outside
    /// low-latency mode): the part is then an [`InternodeBuffer`] over
    /// `num_nvl_bytes + num_internode_bytes`. Needed (> 0) on such a group.
    pub num_internode_bytes: usize,
    /// Bytes of the low-latency part's buffer (0: no low-latency part).
    pub num_ll_bytes: usize,
    /// Bound of host waits: the group's Communicator's when this buffer makes
    /// it, and [`IntranodeBuffer::wait_counts`].
    pub timeout: Duration,
    /// Bound of every device wait of the intranode part, nanoseconds of GPU
    /// time (positive).
    pub device_timeout_ns: i64,
    /// The low-latency part's transport, shrink mode and device-wait bound.
    pub low_latency: LowLatencyOptions,
}

/// `InvalidArgument` naming the byte count that the device of rank `rank`
/// (`total` bytes of memory) cannot hold: `num_nvl_bytes`, `num_rdma_bytes`
/// (each part's share of it), or the two together where both parts are
/// certain to be allocated. Checked before the Buffer's first collective
/// step, so that such a Buffer fails at once with a clear error instead of
/// an out-of-memory error from the allocator.
pub fn check_fits_device(rank: usize, opts: &EpBufferOptions, total: usize) -> Result<()> {
    let gb = |b: usize| b as f64 / 1e9;
    let too_big = |name: &'static str, what: String| {
        Err(CommError::invalid(
            name,
            format!(
                "rank {rank}: {what} is more than the device's {:.1} GB of memory",
                gb(total)
            ),
        ))
    };
    let rdma = opts.num_ll_bytes.max(opts.num_internode_bytes);
    if opts.num_nvl_bytes > total {
        return too_big("num_nvl_bytes", format!("{} bytes", opts.num_nvl_bytes));
    }
    if rdma > total {
        return too_big("num_rdma_bytes", format!("{rdma} bytes"));
    }
    let both = opts.num_nvl_bytes.saturating_add(opts.num_ll_bytes);
    if both > total {
        return too_big(
            "num_rdma_bytes",
            format!(
                "num_nvl_bytes + num_rdma_bytes ({} + {} bytes)",
                opts.num_nvl_bytes, opts.num_ll_bytes
            ),
        );
    }
    Ok(())
}

/// One `moelink.Buffer`'s intranode and low-latency parts (either may be
/// absent), made on one group. Dropping it frees the parts, intranode first,
/// without a barrier.
#[derive(Default)]
pub struct EpBuffer {
    intranode: Option<IntranodeBuffer>,
    /// The intranode part of a group that spans nodes (instead of `intranode`).
    internode: Option<InternodeBuffer>,
    low_latency: Option<LowLatencyBuffer>,
}

impl std::fmt::Debug for EpBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.parts()).finish()
    }
}

impl EpBuffer {
    /// *Collective.* Makes the parts `opts` asks for on `group`, on `device`,
    /// the intranode part first (each the group's next object); a part that
    /// fails frees what was made before it.
    pub fn new(group: &Group, device: Device, opts: &EpBufferOptions) -> Result<Self> {
        let (_, total) = device.mem_info()?;
        check_fits_device(group.rank(), opts, total)?;
        let (mut intranode, mut internode) = (None, None);
        if opts.num_nvl_bytes > 0 {
            let (part, region) = PartBase::join(group, device, opts, PartKind::Intranode)?;
            let nodes = part.comm().topology().num_nodes();
            if nodes > 1 {
                if opts.num_internode_bytes == 0 {
                    return Err(CommError::invalid(
                        "num_rdma_bytes",
                        format!(
                            "the group spans {nodes} nodes: dispatch and combine need \
                             num_rdma_bytes > 0 (see Config.get_rdma_buffer_size_hint)"
                        ),
                    ));
                }
                internode = Some(InternodeBuffer::new(part, region, opts)?);
            } else {
                intranode = Some(IntranodeBuffer::over(part, region, opts)?);
            }
        }
        let low_latency = (opts.num_ll_bytes > 0)
            .then(|| LowLatencyBuffer::new(group, device, opts))
            .transpose()?;
        Ok(Self {
            intranode,
            internode,
            low_latency,
        })
    }

    /// The intranode part of a group that spans nodes.
    pub fn internode(&self) -> Option<&InternodeBuffer> {
        self.internode.as_ref()
    }

    pub fn internode_mut(&mut self) -> Option<&mut InternodeBuffer> {
        self.internode.as_mut()
    }

    pub fn intranode(&self) -> Option<&IntranodeBuffer> {
        self.intranode.as_ref()
    }

    pub fn intranode_mut(&mut self) -> Option<&mut IntranodeBuffer> {
        self.intranode.as_mut()
    }

    pub fn low_latency(&self) -> Option<&LowLatencyBuffer> {
        self.low_latency.as_ref()
    }

    pub fn low_latency_mut(&mut self) -> Option<&mut LowLatencyBuffer> {
        self.low_latency.as_mut()
    }

    /// Part `kind`, if present.
    pub fn part(&self, kind: PartKind) -> Option<&dyn BufferPart> {
        match kind {
            PartKind::Intranode => match (&self.intranode, &self.internode) {
                (Some(b), _) => Some(b as &dyn BufferPart),
                (None, Some(b)) => Some(b as &dyn BufferPart),
                (None, None) => None,
            },
            PartKind::LowLatency => self.low_latency.as_ref().map(|b| b as &dyn BufferPart),
        }
    }

    /// The parts present, intranode first.
    pub fn parts(&self) -> impl Iterator<Item = &dyn BufferPart> {
        PartKind::ALL.into_iter().filter_map(|k| self.part(k))
    }

    /// Whether no part is left (none was made, or both were destroyed).
    pub fn is_empty(&self) -> bool {
        self.intranode.is_none() && self.internode.is_none() && self.low_latency.is_none()
    }

    /// *Collective.* Destroys the parts, intranode first: per part, reads its
    /// device error, meets its ranks in a barrier (no peer still uses what it
    /// frees) and frees it. The first device error (a timeout of an earlier
    /// call) is returned after both parts are freed, so that no rank's
    /// destroy is left waiting and nothing stays allocated; a barrier that
    /// fails returns its error at once, leaving its part and the later one.
    ///
    /// A Buffer made with shrink (its low-latency part masks silent peers) is
    /// destroyed without any barrier: its ranks reach destroy at any time
    /// (a failed rank at once, the others after the timeouts that mask it).
    /// Each part is freed as [`free_mode`] says: at once where its region is
    /// a cuMem allocation (peers that mapped it keep its memory until they
    /// unmap it, so their late stores land in memory nobody else gets), kept
    /// until the process exits where it is legacy CUDA IPC memory (which a
    /// peer could still write after a free). The low-latency proxy first
    /// performs what the kernels queued (at most the device-wait bound).
    pub fn destroy(&mut self) -> Result<()> {
        if self.shrink() {
            return self.destroy_local();
        }
        let mut error = None;
        for kind in PartKind::ALL {
            let Some(part) = self.part(kind) else {
                continue;
            };
            if let Err(e) = part.check_device() {
                error.get_or_insert(e);
            }
            part.barrier()?;
            match kind {
                PartKind::Intranode => {
                    self.intranode = None;
                    self.internode = None;
                }
                PartKind::LowLatency => self.low_latency = None,
            }
        }
        error.map_or(Ok(()), Err)
    }
}

/// How [`EpBuffer::destroy`] frees a part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeMode {
    /// After a barrier of the part's ranks, when no peer uses it any more
    /// (a Buffer without shrink).
    AfterBarrier,
    /// At once, without waiting for any peer: a shrink Buffer's part whose
    /// region is a cuMem (virtual memory) allocation, which peers that
    /// mapped it keep alive until they unmap it.
    Now,
    /// Kept until the process exits: a shrink Buffer's part whose region is
    /// a `cuMemAlloc` allocation shared by legacy CUDA IPC (the fallback where
    /// cuMem is not available), which a peer could still write after a free
    /// and which nobody may be handed in the meantime.
    KeptUntilExit,
}

/// How a part of a Buffer made with (`shrink`) or without shrink, whose
/// region is (`vmm`) or is not a cuMem allocation, is freed by destroy.
pub fn free_mode(shrink: bool, vmm: bool) -> FreeMode {
    match (shrink, vmm) {
        (false, _) => FreeMode::AfterBarrier,
        (true, true) => FreeMode::Now,
        (true, false) => FreeMode::KeptUntilExit,
    }
}

/// Parts kept until the process exits ([`FreeMode::KeptUntilExit`]): never
/// dropped (statics are not), so their memory is never handed out again.
static KEPT_UNTIL_EXIT: std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>> =
    std::sync::Mutex::new(Vec::new());

impl EpBuffer {
    /// Whether the Buffer was made with shrink (its low-latency part is).
    pub fn shrink(&self) -> bool {
        self.low_latency.as_ref().is_some_and(|b| b.shrink())
    }

    /// [`destroy`](Self::destroy) of a shrink Buffer: per part, intranode
    /// first, no barrier; the first device error after both are gone.
    fn destroy_local(&mut self) -> Result<()> {
        let mut error = None;
        for kind in PartKind::ALL {
            let Some(part) = self.part(kind) else {
                continue;
            };
            let base = part.base();
            let rank = base.rank();
            if let Some(ll) = self
                .low_latency
                .as_ref()
                .filter(|_| kind == PartKind::LowLatency)
            {
                match ll.drain_proxy() {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        "rank {rank}: the low-latency proxy still had work queued after the \
                         device-wait bound; destroying it (peers waiting for it mask this rank)"
                    ),
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
            if let Err(e) = part.check_device() {
                error.get_or_insert(e);
            }
            let (ptr, _) = part.local_buffer();
            let vmm = ep_kernels::low_latency::host::is_vmm(base.device(), ptr).unwrap_or(false);
            let taken: Box<dyn std::any::Any + Send> = match kind {
                PartKind::Intranode => Box::new((self.intranode.take(), self.internode.take())),
                PartKind::LowLatency => Box::new(self.low_latency.take()),
            };
            match free_mode(true, vmm) {
                FreeMode::KeptUntilExit => {
                    tracing::warn!(
                        "rank {rank}: the {} buffer is legacy CUDA IPC memory, which peers may \
                         still write: destroy() keeps it until the process exits",
                        kind.name()
                    );
                    KEPT_UNTIL_EXIT
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(taken);
                }
                FreeMode::Now | FreeMode::AfterBarrier => drop(taken),
            }
        }
        error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_shrink_buffer_frees_without_a_barrier_and_keeps_legacy_memory() {
        assert_eq!(free_mode(false, true), FreeMode::AfterBarrier);
        assert_eq!(free_mode(false, false), FreeMode::AfterBarrier);
        assert_eq!(free_mode(true, true), FreeMode::Now);
        assert_eq!(free_mode(true, false), FreeMode::KeptUntilExit);
    }

    #[test]
    fn an_empty_buffer_destroys_to_nothing_either_way() {
        let mut b = EpBuffer::default();
        assert!(!b.shrink());
        assert!(b.destroy().is_ok());
        assert!(b.destroy_local().is_ok());
        assert!(b.is_empty());
    }

    fn opts(num_nvl_bytes: usize, num_ll_bytes: usize, device_timeout_ns: i64) -> EpBufferOptions {
        EpBufferOptions {
            num_nvl_bytes,
            num_internode_bytes: 0,
            num_ll_bytes,
            timeout: DEFAULT_TIMEOUT,
            device_timeout_ns,
            low_latency: LowLatencyOptions {
                allow_nvlink: true,
                shrink: false,
                device_timeout_ns,
            },
        }
    }

    fn message(r: Result<()>) -> (&'static str, String) {
        match r {
            Err(CommError::InvalidArgument { name, reason }) => (name, reason),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn byte_counts_beyond_the_device_are_refused_by_name() {
        let gb = 1usize << 30;
        let fits = opts(gb, gb, 1);
        assert!(check_fits_device(0, &fits, 80 * gb).is_ok());
        let (name, why) = message(check_fits_device(3, &opts(1 << 50, 0, 1), 80 * gb));
        assert_eq!(name, "num_nvl_bytes");
        assert!(
            why.starts_with("rank 3: 1125899906842624 bytes is more than"),
            "{why}"
        );
        let (name, _) = message(check_fits_device(0, &opts(0, 81 * gb, 1), 80 * gb));
        assert_eq!(name, "num_rdma_bytes");
        let internode = EpBufferOptions {
            num_internode_bytes: 81 * gb,
            ..fits
        };
        let (name, _) = message(check_fits_device(0, &internode, 80 * gb));
        assert_eq!(name, "num_rdma_bytes");
        let (name, why) = message(check_fits_device(1, &opts(50 * gb, 40 * gb, 1), 80 * gb));
        assert_eq!(name, "num_rdma_bytes");
        assert!(why.contains("num_nvl_bytes + num_rdma_bytes"), "{why}");
    }

    #[test]
    fn each_part_checks_its_arguments_before_joining() {
        use PartKind::{Intranode, LowLatency};
        let good = opts(CTRL_BYTES as usize + 4096, FLAGS_BYTES as usize, 1);
        assert!(Intranode.check_args(MAX_RANKS, &good).is_ok());
        assert!(LowLatency.check_args(MAX_RANKS, &good).is_ok());
        let (name, why) = message(Intranode.check_args(MAX_RANKS + 1, &good));
        assert_eq!(
            (name, why.as_str()),
            ("group", "33 ranks; intranode kernels handle at most 32")
        );
        let (name, why) = message(LowLatency.check_args(MAX_RANKS + 1, &good));
        assert_eq!(
            (name, why.as_str()),
            ("group", "33 ranks; low-latency kernels handle at most 32")
        );
        let (name, why) = message(Intranode.check_args(2, &opts(CTRL_BYTES as usize, 4096, 1)));
        assert_eq!(name, "num_nvl_bytes");
        assert_eq!(
            why,
            format!(
                "{CTRL_BYTES} bytes: need a multiple of 128 of at least {} (see \
                 Config.get_nvl_buffer_size_hint)",
                CTRL_BYTES + 4096
            )
        );
        let (name, why) = message(LowLatency.check_args(2, &opts(0, FLAGS_BYTES as usize + 64, 1)));
        assert_eq!(name, "num_rdma_bytes");
        assert_eq!(
            why,
            format!(
                "{} bytes: need a multiple of 128 of at least {FLAGS_BYTES} (see \
                 Buffer.get_low_latency_rdma_size_hint)",
                FLAGS_BYTES + 64
            )
        );
        assert!(Intranode
            .check_args(2, &opts(CTRL_BYTES as usize + 4096, 0, 0))
            .is_err());
    }
}
