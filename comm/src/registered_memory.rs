//! Registered memory: a buffer plus what each transport needs to reach it,
//! serializable so ranks exchange it through the bootstrap and map the peer's
//! copy.
//!
//! A local registration holds the buffer's address; the description sent to
//! peers ([`MemoryInfo`]) holds how to reach it: a CUDA IPC export (legacy
//! handle, or a cuMem POSIX fd served by the owner's fd server) for peers on the
//! same host, an Ethernet endpoint for anyone. [`RegisteredMemory::import`]
//! turns a peer's description into a usable registration, mapping the memory
//! when it can and keeping the mapping alive as long as any clone lives.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::cuda::Device;
use crate::error::{CommError, Result};
use crate::fd_passing::{fetch_fd, FdAddress};
use crate::host_memory::HostMemory;
use crate::memory::{IpcHandle, PeerMemory};
use crate::vmm::VmmMapping;
use crate::wire::{Reader, Writer};

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    Host,
    Device(i32),
}

/// How a peer on the same host maps the memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpcExport {
    /// `cuIpcGetMemHandle` of a `cuMemAlloc` allocation.
    Legacy(IpcHandle),
    /// A cuMem allocation whose fd the owner's fd server hands out under `key`.
    Vmm {
        server: FdAddress,
        key: u64,
        len: u64,
    },
    /// Shared host memory (a memfd, [`HostMemory::shared`]) whose fd the owner's
    /// fd server hands out under `key`: a peer maps the same pages, its CPU
    /// stores into them and its GPU reads them.
    SharedHost {
        server: FdAddress,
        key: u64,
        len: u64,
    },
}

/// The transports a memory can be reached through (bit set).
pub mod transports {
    pub const CUDA_IPC: u32 = 1;
    pub const ETHERNET: u32 = 2;
    pub const IB_VERBS: u32 = 4;
}

/// The keys of a buffer's IB verbs registration (on its owner's RDMA
/// device; peers address it at `owner_ptr`, registered as its IO address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IbKey {
    /// Used by the owner's own work requests (write sources).
    pub lkey: u32,
    /// Used by peers' RDMA writes and atomics.
    pub rkey: u32,
}

/// What a peer needs to know to reach a registered buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub rank: u32,
    pub len: u64,
    pub location: Location,
    /// Identifies the owner's host: CUDA IPC is attempted only on equal ids.
    pub host_id: u64,
    /// The owner's address of the buffer (meaningful in the owner's process only;
    /// used as the key of Ethernet writes).
    pub owner_ptr: u64,
    pub ipc: Option<IpcExport>,
    /// The owner's Ethernet receiver ("host:port"), if it accepts Ethernet writes.
    pub ethernet: Option<String>,
    /// The owner's IB verbs registration, if its RDMA device registered it.
    pub ib: Option<IbKey>,
}

impl MemoryInfo {
    /// Whether a context of this process other than the primary one (the
    /// proxies' own, [`crate::cuda::Device::proxy_context`]) can address the
    /// memory: cuMem (VMM) allocations and host memory (allocated or
    /// registered PORTABLE) are mapped process-wide; a `cuMemAlloc`
    /// allocation (legacy IPC) or memory of another allocator belongs to the
    /// primary context.
    pub fn process_wide(&self) -> bool {
        self.location == Location::Host || matches!(self.ipc, Some(IpcExport::Vmm { .. }))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(0x4d454d31) // "MEM1"
            .u32(self.rank)
            .u64(self.len)
            .i32(match self.location {
                Location::Host => -1,
                Location::Device(d) => d,
            })
            .u64(self.host_id)
            .u64(self.owner_ptr);
        match &self.ipc {
            None => {
                w.u8(0);
            }
            Some(IpcExport::Legacy(h)) => {
                w.u8(1).bytes(&h.to_bytes());
            }
            Some(IpcExport::Vmm { server, key, len }) => {
                w.u8(2).bytes(&server.to_bytes()).u64(*key).u64(*len);
            }
            Some(IpcExport::SharedHost { server, key, len }) => {
                w.u8(3).bytes(&server.to_bytes()).u64(*key).u64(*len);
            }
        }
        w.bytes(self.ethernet.as_deref().unwrap_or("").as_bytes());
        match self.ib {
            None => w.u8(0),
            Some(k) => w.u8(1).u32(k.lkey).u32(k.rkey),
        };
        w.finish()
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b, "memory info");
        if r.u32()? != 0x4d454d31 {
            return Err(r.bad("bad magic (not a moelink memory description)"));
        }
        let rank = r.u32()?;
        let len = r.u64()?;
        let location = match r.i32()? {
            -1 => Location::Host,
            d if d >= 0 => Location::Device(d),
            d => return Err(r.bad(format!("bad device {d}"))),
        };
        let host_id = r.u64()?;
        let owner_ptr = r.u64()?;
        let ipc = match r.u8()? {
            0 => None,
            1 => Some(IpcExport::Legacy(IpcHandle::from_bytes(r.bytes()?)?)),
            kind @ (2 | 3) => {
                // Both are an fd the owner's server hands out: its address, key and length.
                let server = FdAddress::from_bytes(r.bytes()?)?;
                let (key, len) = (r.u64()?, r.u64()?);
                Some(if kind == 2 {
                    IpcExport::Vmm { server, key, len }
                } else {
                    IpcExport::SharedHost { server, key, len }
                })
            }
            t => return Err(r.bad(format!("bad IPC kind {t}"))),
        };
        let eth = r.bytes()?;
        let ethernet = if eth.is_empty() {
            None
        } else {
            Some(String::from_utf8(eth.to_vec()).map_err(|_| r.bad("ethernet address not UTF-8"))?)
        };
        let ib = match r.u8()? {
            0 => None,
            1 => Some(IbKey {
                lkey: r.u32()?,
                rkey: r.u32()?,
            }),
            t => return Err(r.bad(format!("bad IB key kind {t}"))),
        };
        r.end()?;
        Ok(Self {
            rank,
            len,
            location,
            host_id,
            owner_ptr,
            ipc,
            ethernet,
            ib,
        })
    }
}

/// A registered buffer, local or a peer's. Clones share the mapping.
#[derive(Clone)]
pub struct RegisteredMemory {
    info: MemoryInfo,
    /// The buffer's address in this process: the owner's pointer, or where a
    /// peer's buffer is mapped here; 0 when it is not mapped (reach it by
    /// Ethernet only).
    ptr: u64,
    /// Where this process's CPU can store into the buffer (shared host
    /// memory, [`IpcExport::SharedHost`]); 0 otherwise.
    host_ptr: u64,
    _keep: Option<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMemory")
            .field("info", &self.info)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("host_ptr", &format_args!("{:#x}", self.host_ptr))
            .finish()
    }
}

impl RegisteredMemory {
    /// Registers this process's buffer. `keep` (if any) is held as long as any
    /// clone lives (e.g. the allocation itself).
    pub fn local(info: MemoryInfo, keep: Option<Arc<dyn Any + Send + Sync>>) -> Self {
        Self {
            ptr: info.owner_ptr,
            host_ptr: 0,
            info,
            _keep: keep,
        }
    }

    /// A peer's buffer: mapped into `device`'s address space when it is on this
    /// host and exports CUDA IPC, else unmapped (Ethernet only).
    /// Fetching a cuMem fd from the owner waits at most 30 s; see
    /// [`RegisteredMemory::import_with_timeout`].
    pub fn import(info: MemoryInfo, device: Option<Device>, host_id: u64) -> Result<Self> {
        Self::import_with_timeout(info, device, host_id, Duration::from_secs(30))
    }

    /// As [`RegisteredMemory::import`], waiting at most `timeout` for the
    /// owner's fd server.
    pub fn import_with_timeout(
        info: MemoryInfo,
        device: Option<Device>,
        host_id: u64,
        timeout: Duration,
    ) -> Result<Self> {
        let (Some(dev), true, Some(ipc)) = (device, info.host_id == host_id, info.ipc.as_ref())
        else {
            return Ok(Self {
                info,
                ptr: 0,
                host_ptr: 0,
                _keep: None,
            });
        };
        let mut host_ptr = 0;
        let (ptr, keep): (u64, Arc<dyn Any + Send + Sync>) = match ipc {
            IpcExport::Legacy(h) => {
                let m = PeerMemory::open(dev, h)?;
                (m.ptr(), Arc::new(m))
            }
            IpcExport::Vmm { server, key, len } => {
                let fd = fetch_fd(server, *key, timeout)?;
                let m = VmmMapping::import(dev, fd, *len as usize)?;
                (m.ptr(), Arc::new(m))
            }
            IpcExport::SharedHost { server, key, len } => {
                let fd = fetch_fd(server, *key, timeout)?;
                let m = HostMemory::import_shared(Some(dev), fd, *len as usize)?;
                host_ptr = m.as_ptr() as u64;
                (m.device_ptr(), Arc::new(m))
            }
        };
        Ok(Self {
            info,
            ptr,
            host_ptr,
            _keep: Some(keep),
        })
    }

    pub fn info(&self) -> &MemoryInfo {
        &self.info
    }

    /// Adds the keys of an IB verbs registration made after this
    /// description was built (a Communicator's first signal page).
    pub(crate) fn set_ib(&mut self, key: IbKey) {
        self.info.ib = Some(key);
    }

    pub fn rank(&self) -> usize {
        self.info.rank as usize
    }

    pub fn len(&self) -> u64 {
        self.info.len
    }

    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }

    /// The address in this process (0 if not mapped here).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn is_mapped(&self) -> bool {
        self.ptr != 0
    }

    /// Where this process's CPU can store into the buffer: Some for a peer's
    /// shared host memory mapped here ([`IpcExport::SharedHost`]).
    pub fn host_ptr(&self) -> Option<u64> {
        (self.host_ptr != 0).then_some(self.host_ptr)
    }

    /// Checks that `[offset, offset + size)` lies inside the buffer.
    pub fn check_range(&self, offset: u64, size: u64, what: &'static str) -> Result<()> {
        if offset
            .checked_add(size)
            .is_none_or(|end| end > self.info.len)
        {
            return Err(CommError::invalid(
                what,
                format!(
                    "{size} bytes at offset {offset} exceed rank {}'s {}-byte buffer",
                    self.info.rank, self.info.len
                ),
            ));
        }
        Ok(())
    }
}

/// An id for this host: CUDA IPC is only attempted between equal ids. Taken
/// from /etc/machine-id (or the hostname), mixed with the boot id so two
/// containers sharing a machine-id but not a kernel do not match.
pub fn host_id() -> u64 {
    let mut text = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    text.push_str(&std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default());
    if text.trim().is_empty() {
        text = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown-host".into());
    }
    // FNV-1a
    text.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ipc: Option<IpcExport>, eth: Option<&str>) -> MemoryInfo {
        MemoryInfo {
            rank: 3,
            len: 1 << 30,
            location: Location::Device(2),
            host_id: 0xdead_beef,
            owner_ptr: 0x7f00_0000_0000,
            ipc,
            ethernet: eth.map(String::from),
            ib: None,
        }
    }

    #[test]
    fn memory_info_round_trips() {
        let legacy = IpcExport::Legacy(IpcHandle {
            bytes: [7; 64],
            len: 4096,
        });
        for info in [
            sample(None, None),
            sample(Some(legacy), Some("10.0.0.1:5000")),
            MemoryInfo {
                location: Location::Host,
                ..sample(
                    Some(IpcExport::SharedHost {
                        server: FdAddress::from_bytes(b"moelink-1-abc").unwrap(),
                        key: 9,
                        len: 4096,
                    }),
                    None,
                )
            },
            MemoryInfo {
                location: Location::Host,
                ib: Some(IbKey {
                    lkey: 0x11,
                    rkey: 0x2233,
                }),
                ..sample(None, Some("[::1]:1"))
            },
        ] {
            let b = info.to_bytes();
            assert_eq!(MemoryInfo::from_bytes(&b).unwrap(), info);
            assert!(MemoryInfo::from_bytes(&b[..b.len() - 1]).is_err());
            let mut extra = b.clone();
            extra.push(0);
            assert!(MemoryInfo::from_bytes(&extra).is_err());
        }
        assert!(MemoryInfo::from_bytes(b"garbage!").is_err());
    }

    #[test]
    fn check_range_rejects_overflow() {
        let m = RegisteredMemory::local(sample(None, None), None);
        assert!(m.check_range(0, 1 << 30, "x").is_ok());
        assert!(m.check_range(1, 1 << 30, "x").is_err());
        assert!(m.check_range(u64::MAX, 2, "x").is_err());
    }

    #[test]
    fn host_id_is_stable() {
        assert_eq!(host_id(), host_id());
    }
}
