//! [`EpBuffer`]: the Rust half of one `moelink.Buffer`, made on one
//! `comm::Group`: its intranode part ([`IntranodeBuffer`]) and its
//! low-latency part ([`LowLatencyBuffer`]), either of which may be absent.
//!
//! Each part is an object of the group of its own (kinds "intranode buffer"
//! and "low-latency buffer", made in that order), so it keeps its own scope of
//! the group's bootstrap, device error record and device-wait bound: an error
//! one part's kernels record is reported by that part only, and the
//! low-latency `clean()` forgets its own. What the parts share with the
//! Buffer and each other lives in [`crate::part`]: the options
//! ([`EpBufferOptions`]), joining the group and allocating the part's region
//! (`PartBase::join`: the rank limit, the size check, the device-wait bound,
//! the GPU share), the device-error checks and the barrier ([`BufferPart`]).
//! Here: the check that the byte counts fit the device, which parts are made
//! (the internode part in the intranode part's place where the group spans
//! nodes) and the order in which a Buffer is destroyed
//! ([`EpBuffer::destroy`]). `intranode`, `internode` and `low_latency` keep
//! their buffer layouts and launch sequences.

use comm::error::{CommError, Result};
use comm::{Device, Group};

use crate::internode::{ethernet_receiver, InternodeBuffer};
use crate::intranode::IntranodeBuffer;
use crate::low_latency::LowLatencyBuffer;
use crate::part::{BufferPart, EpBufferOptions, PartBase, PartKind};

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
            let ethernet = || match opts.num_internode_bytes {
                0 => Ok(None),
                _ => ethernet_receiver(),
            };
            let (part, region) =
                PartBase::join(group, device, opts, PartKind::Intranode, ethernet)?;
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
    use crate::part::tests::{message, opts};

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
}
