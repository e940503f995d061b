//! Zero-copy registration of memory the caller owns (torch tensors): each
//! rank exports the allocation that holds its range through a legacy CUDA IPC
//! handle, the ranks exchange them over the communicator's bootstrap, and
//! every rank maps every peer's allocation (once per allocation: a legacy
//! handle may be opened only once per process, so mappings are shared and
//! reference counted).
//!
//! Contract (documented in the Python API): every rank registers its range in
//! the same collective call, with the same length; a call then uses a
//! registered tensor at the same offset of the range on every rank; the
//! tensor stays allocated until it is deregistered. PyTorch's default caching
//! allocator hands out `cudaMalloc` memory, which legacy IPC can export;
//! memory from expandable segments (cuMem) cannot, and registering it fails
//! with a clear error on every rank.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::time::Duration;

use comm::registered_memory::{host_id, IpcExport, Location, MemoryInfo, RegisteredMemory};
use comm::wire::{Reader, Writer};
use comm::{Bootstrap, CommError, Device, IpcHandle, Result};
use cudarc::driver::sys;

/// One registered range and where every rank's copy of it is mapped here.
#[derive(Debug)]
pub struct Registration {
    pub id: u64,
    /// Our range.
    pub ptr: u64,
    pub len: u64,
    /// Rank p's range, mapped here (ours: `ptr`).
    pub peer_ptrs: Vec<u64>,
    keys: Vec<Option<ImportKey>>,
}

impl Registration {
    /// Whether `[ptr, ptr + len)` lies inside this registration.
    pub fn contains(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.ptr
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= self.ptr + self.len)
    }

    /// Where rank `p` has what we have at `ptr` (same offset in its range).
    pub fn peer_ptr(&self, p: usize, ptr: u64) -> u64 {
        self.peer_ptrs[p] + (ptr - self.ptr)
    }
}

/// (peer, its IPC handle): one mapping per peer allocation.
type ImportKey = (usize, [u8; IpcHandle::LEN]);

#[derive(Default)]
pub struct Registry {
    next_id: u64,
    regs: Vec<Registration>,
    imports: HashMap<ImportKey, (RegisteredMemory, usize)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("registrations", &self.regs.len())
            .field("mappings", &self.imports.len())
            .finish()
    }
}

/// The allocation holding `[ptr, ptr + len)`, exported for peers:
/// (description, offset of `ptr` in the allocation).
fn export_local(device: Device, rank: usize, ptr: u64, len: u64) -> Result<(MemoryInfo, u64)> {
    device.make_current()?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers are valid locals; the driver validates `ptr`.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| {
            CommError::invalid(
                "tensor",
                format!("{ptr:#x} is not device memory of this GPU ({e})"),
            )
        })?;
    if ptr
        .checked_add(len)
        .is_none_or(|end| end > base + size as u64)
    {
        return Err(CommError::invalid(
            "tensor",
            format!("{len} bytes at {ptr:#x} run past the end of their allocation"),
        ));
    }
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: `base` is the start of an allocation of the current context.
    unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base) }
        .result()
        .map_err(|e| {
            CommError::invalid(
                "tensor",
                format!(
                    "its memory cannot be shared through CUDA IPC ({e}): PyTorch's default \
                     caching allocator (cudaMalloc) can be, expandable segments cannot"
                ),
            )
        })
        .map(|_| ())?;
    // SAFETY: initialised by the successful call above.
    let handle = unsafe { handle.assume_init() };
    let mut bytes = [0u8; IpcHandle::LEN];
    for (b, c) in bytes.iter_mut().zip(handle.reserved.iter()) {
        *b = *c as u8;
    }
    let info = MemoryInfo {
        rank: rank as u32,
        len: size as u64,
        location: Location::Device(device.ordinal),
        host_id: host_id(),
        owner_ptr: base,
        ipc: Some(IpcExport::Legacy(IpcHandle {
            bytes,
            len: size as u64,
        })),
        ethernet: None,
        ib: None,
    };
    Ok((info, ptr - base))
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// The registration holding `[ptr, ptr + len)`, if any.
    pub fn find(&self, ptr: u64, len: u64) -> Option<&Registration> {
        if len == 0 {
            return None;
        }
        self.regs.iter().find(|r| r.contains(ptr, len))
    }

    pub fn len(&self) -> usize {
        self.regs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regs.is_empty()
    }

    /// *Collective.* Registers `[ptr, ptr + len)` of every rank on `device`;
    /// returns its id (the same on every rank). Fails on every rank if it
    /// fails on any. Its exchanges go through `bootstrap` (the owning
    /// object's own scope: registrations happen at run time, beside other
    /// objects' collectives).
    pub fn register(
        &mut self,
        bootstrap: &dyn Bootstrap,
        device: Device,
        timeout: Duration,
        ptr: u64,
        len: u64,
    ) -> Result<u64> {
        let rank = bootstrap.rank();
        let local = if len == 0 {
            Err(CommError::invalid("tensor", "cannot register 0 bytes"))
        } else {
            export_local(device, rank, ptr, len)
        };
        let mut w = Writer::default();
        match &local {
            Ok((info, off)) => {
                w.u8(1).bytes(&info.to_bytes()).u64(*off).u64(len);
            }
            Err(e) => {
                w.u8(0).bytes(e.to_string().as_bytes());
            }
        }
        let all = bootstrap.all_gather(&w.finish())?;
        let mut infos = Vec::with_capacity(all.len());
        let mut errors = Vec::new();
        for (r, b) in all.iter().enumerate() {
            let mut rd = Reader::new(b, "registration");
            if rd.u8()? == 1 {
                let info = MemoryInfo::from_bytes(rd.bytes()?)?;
                let off = rd.u64()?;
                let l = rd.u64()?;
                rd.end()?;
                infos.push(Some((info, off, l)));
            } else {
                errors.push(format!(
                    "rank {r}: {}",
                    String::from_utf8_lossy(rd.bytes()?)
                ));
                infos.push(None);
            }
        }
        if !errors.is_empty() {
            return Err(CommError::invalid("tensor", errors.join("; ")));
        }
        let lens: Vec<u64> = infos.iter().flatten().map(|(_, _, l)| *l).collect();
        if lens.iter().any(|&l| l != len) {
            return Err(CommError::invalid(
                "tensor",
                format!("every rank must register the same number of bytes; got {lens:?}"),
            ));
        }

        let mut peer_ptrs = vec![0u64; infos.len()];
        let mut keys: Vec<Option<ImportKey>> = vec![None; infos.len()];
        let imported = self.import_all(
            device,
            rank,
            ptr,
            timeout,
            &infos,
            &mut peer_ptrs,
            &mut keys,
        );
        let ok = bootstrap.all_gather(&[imported.is_ok() as u8])?;
        let failed: Vec<usize> = (0..ok.len()).filter(|&r| ok[r] != [1]).collect();
        if let Err(e) = imported {
            self.release(&keys);
            return Err(e);
        }
        if !failed.is_empty() {
            self.release(&keys);
            return Err(CommError::invalid(
                "tensor",
                format!("mapping the peers' memory failed on ranks {failed:?}"),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.regs.push(Registration {
            id,
            ptr,
            len,
            peer_ptrs,
            keys,
        });
        Ok(id)
    }

    #[allow(clippy::too_many_arguments)]
    fn import_all(
        &mut self,
        device: Device,
        rank: usize,
        ptr: u64,
        timeout: Duration,
        infos: &[Option<(MemoryInfo, u64, u64)>],
        peer_ptrs: &mut [u64],
        keys: &mut [Option<ImportKey>],
    ) -> Result<()> {
        let here = host_id();
        for (p, entry) in infos.iter().enumerate() {
            let (info, off, _) = entry.as_ref().expect("checked: every rank exported");
            if p == rank {
                peer_ptrs[p] = ptr;
                continue;
            }
            let Some(IpcExport::Legacy(h)) = &info.ipc else {
                return Err(CommError::invalid(
                    "tensor",
                    format!("rank {p} sent no CUDA IPC handle"),
                ));
            };
            let key = (p, h.bytes);
            let base = match self.imports.get_mut(&key) {
                Some((mem, count)) => {
                    *count += 1;
                    mem.ptr()
                }
                None => {
                    let mem = RegisteredMemory::import_with_timeout(
                        info.clone(),
                        Some(device),
                        here,
                        timeout,
                    )?;
                    if !mem.is_mapped() {
                        return Err(CommError::invalid(
                            "tensor",
                            format!("rank {p}'s memory cannot be mapped here (another host?)"),
                        ));
                    }
                    let base = mem.ptr();
                    self.imports.insert(key, (mem, 1));
                    base
                }
            };
            keys[p] = Some(key);
            peer_ptrs[p] = base + off;
        }
        Ok(())
    }

    fn release(&mut self, keys: &[Option<ImportKey>]) {
        for key in keys.iter().flatten() {
            if let Some((_, count)) = self.imports.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    self.imports.remove(key);
                }
            }
        }
    }

    /// Forgets registration `id` and unmaps peer allocations no other
    /// registration uses. The caller makes sure no kernel still uses it.
    pub fn deregister(&mut self, id: u64) -> Result<()> {
        let i = self
            .regs
            .iter()
            .position(|r| r.id == id)
            .ok_or_else(|| CommError::invalid("id", format!("no registration {id}")))?;
        let reg = self.regs.remove(i);
        self.release(&reg.keys);
        Ok(())
    }

    /// Forgets every registration.
    pub fn clear(&mut self) {
        self.regs.clear();
        self.imports.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containment_and_peer_offsets() {
        let r = Registration {
            id: 0,
            ptr: 0x1000,
            len: 0x100,
            peer_ptrs: vec![0x1000, 0x9000],
            keys: vec![None, None],
        };
        assert!(r.contains(0x1000, 0x100));
        assert!(r.contains(0x1080, 0x80));
        assert!(!r.contains(0x1080, 0x81));
        assert!(!r.contains(0xfff, 2));
        assert!(!r.contains(u64::MAX, 2));
        assert_eq!(r.peer_ptr(1, 0x1010), 0x9010);
        let mut reg = Registry::new();
        reg.regs.push(r);
        assert!(reg.find(0x1000, 0).is_none());
        assert_eq!(reg.find(0x1010, 16).map(|r| r.id), Some(0));
        assert!(reg.deregister(7).is_err());
        reg.deregister(0).unwrap();
        assert!(reg.is_empty());
    }
}
