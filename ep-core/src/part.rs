//! What the parts of an [`EpBuffer`](crate::EpBuffer) share with it and
//! with each other: the options they are made from ([`EpBufferOptions`],
//! with the low-latency part's [`LowLatencyOptions`]), which part is which
//! ([`PartKind`]), what each part keeps of its group and device
//! ([`PartBase`]: joining the group and allocating the part's region, the
//! rank limit, the size check, the device-wait bound, the GPU share), the
//! device-error checks and the barrier ([`BufferPart`]), and the phase stamps
//! of a part's kernels (`PhaseStamps`).
//!
//! The parts (`intranode`, `internode`, `low_latency`) import this module
//! and never `ep_buffer`; `ep_buffer` imports the parts and this module, so
//! that no file imports one that imports it back.

use std::net::SocketAddr;
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

use crate::limits::MAX_RANKS;

/// Bound of host waits by default (the Communicator's, the CPU wait for the
/// intranode notify kernel's counts).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound of every device wait by default: 30 s of GPU time (below
/// [`DEFAULT_TIMEOUT`], so a hang is reported by the device, naming rank and peer).
pub const DEFAULT_DEVICE_TIMEOUT_NS: i64 = comm::error::DEFAULT_DEVICE_TIMEOUT_NS;

/// The parts of an [`EpBuffer`](crate::EpBuffer), in the order they are made and destroyed.
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
        let mem = if comm::env::var(env).is_some_and(|v| v == "1") {
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
    /// part's device waits are bounded by `opts`' bound for it. `ethernet`,
    /// asked after these checks, says where this rank's Ethernet receiver
    /// listens (for the Communicator, if this part makes it): the internode
    /// part's `ethernet_receiver`, else `Ok(None)`. The object is being made
    /// until [`ready`](Self::ready).
    pub(crate) fn join(
        group: &Group,
        device: Device,
        opts: &EpBufferOptions,
        kind: PartKind,
        ethernet: impl FnOnce() -> Result<Option<SocketAddr>>,
    ) -> Result<(Self, SymmetricRegion)> {
        kind.check_args(group.size(), opts)?;
        let copts = CommunicatorOptions {
            timeout: opts.timeout,
            ethernet: ethernet()?,
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

    /// The refusal (of argument `name`) of a call of `num_tokens` tokens on
    /// this rank, more than the part's `region` holds: "... but the buffer of
    /// N bytes holds `holds`".
    pub(crate) fn too_many_tokens(
        &self,
        name: &'static str,
        num_tokens: usize,
        region: &SymmetricRegion,
        holds: std::fmt::Arguments<'_>,
    ) -> CommError {
        CommError::invalid(
            name,
            format!(
                "{num_tokens} tokens on rank {}, but the buffer of {} bytes holds {holds}",
                self.rank(),
                region.len()
            ),
        )
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

/// How to make an [`EpBuffer`](crate::EpBuffer).
#[derive(Clone, Copy, Debug)]
pub struct EpBufferOptions {
    /// Bytes of the intranode part's NVL buffer (0: no intranode part).
    pub num_nvl_bytes: usize,
    /// Bytes the intranode part adds for the cross-node regions when the
    /// group spans more than one node (DeepEP's `num_rdma_bytes` outside
    /// low-latency mode): the part is then an
    /// [`InternodeBuffer`](crate::internode::InternodeBuffer) over
    /// `num_nvl_bytes + num_internode_bytes`. Needed (> 0) on such a group.
    pub num_internode_bytes: usize,
    /// Bytes of the low-latency part's buffer (0: no low-latency part).
    pub num_ll_bytes: usize,
    /// Bound of host waits: the group's Communicator's when this buffer makes
    /// it, and [`IntranodeBuffer::wait_counts`](crate::intranode::IntranodeBuffer::wait_counts).
    pub timeout: Duration,
    /// Bound of every device wait of the intranode part, nanoseconds of GPU
    /// time (positive).
    pub device_timeout_ns: i64,
    /// The low-latency part's transport, shrink mode and device-wait bound.
    pub low_latency: LowLatencyOptions,
}

/// How the buffer reaches its peers and how long a receive may wait.
#[derive(Clone, Copy, Debug)]
pub struct LowLatencyOptions {
    /// Peers mapped over NVLink get direct stores; `false` forces the proxy
    /// (port channels) for every peer, as across nodes without GPU-initiated RDMA.
    pub allow_nvlink: bool,
    /// A peer silent for `device_timeout_ns` is masked instead of reported.
    pub shrink: bool,
    /// Bound of every device-side receive wait, nanoseconds of GPU time
    /// (positive).
    pub device_timeout_ns: i64,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn opts(
        num_nvl_bytes: usize,
        num_ll_bytes: usize,
        device_timeout_ns: i64,
    ) -> EpBufferOptions {
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

    pub(crate) fn message(r: Result<()>) -> (&'static str, String) {
        match r {
            Err(CommError::InvalidArgument { name, reason }) => (name, reason),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
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
