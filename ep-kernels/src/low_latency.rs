//! Launchers of the low-latency dispatch/combine kernels (`cuda/low_latency.cu`)
//! and the buffer layout they share with the host (`ep_core::low_latency`).
//!
//! All pointers are device addresses (`0` = absent where the kernel allows it).

use std::mem::{offset_of, size_of};

use comm::error::{CommError, Result};
use comm::StreamHandle;

use crate::module::{DeviceKernels, KernelId};

use crate::limits::FP8_GROUP_SIZE;
/// Largest rank count (one flag per rank and parity, one lane per rank), top-k,
/// number of local experts and hidden size: the crate's [`limits`](crate::limits).
pub use crate::limits::{
    LL_MAX_HIDDEN as MAX_HIDDEN, LL_MAX_TOKENS_PER_RANK as MAX_TOKENS,
    MAX_EXPERTS_PER_RANK as MAX_LOCAL_EXPERTS, MAX_RANKS, MAX_TOPK,
};
/// Threads per block.
pub const THREADS: u32 = 1024;
/// Bytes of the flags region at the start of the buffer: the data flags
/// `[2 parities][32]` u64 at 0, the release counts `[32 peers][2 parities]` u64
/// at [`RELEASE_OFFSET`], and the outgoing values of both that the proxy copies
/// at 2048 / 3072 (`kOutFlagsOffset`, `kOutReleaseOffset`).
pub const FLAGS_BYTES: u64 = 4096;
/// Byte offset of the release counts in the flags region (`kReleaseOffset`):
/// entry `[d][p]` is the number of calls of parity `p` that peer `d` has
/// finished receiving (what a send of the next call of parity `p` waits for).
pub const RELEASE_OFFSET: u64 = 1024;
/// u32 words of the device state (`kStateWords`): the receive counter (u64),
/// the receive half's ticket, one unused word, the send half's per-destination
/// arrivals, the send counter (u64, calls `<< SEND_SHIFT`) and the receive
/// count last published through the proxy (u64).
pub const STATE_WORDS: usize = 8 + MAX_RANKS;
/// The send counter counts calls in units of `1 << SEND_SHIFT` (`kSendShift`:
/// each block of a send half adds its share).
pub const SEND_SHIFT: u32 = 20;
/// Bytes of static shared memory of each kernel (`blocked`, padded), next to
/// the dynamic shared memory below.
const STATIC_SMEM: usize = 16;
/// Blocks and slots per kernel of the optional phase stamps (`kProfBlocks`,
/// `kProfSlots`): slot 0 / `PROF_SLOTS - 1` globaltimer ns at a block's start /
/// end, the others `clock64` at the phase boundaries listed in the kernel.
pub const PROF_BLOCKS: usize = 256;
pub const PROF_SLOTS: usize = 16;
/// Fixed part of a dispatch message header (`{token, n, 0, 0}`); then 8 bytes
/// per top-k slot (`msg_header_bytes`).
pub const HEADER_BYTES: u64 = 16;
/// Dynamic shared memory a block may use without opting in (48 KiB, less the
/// kernels' static shared memory).
const MAX_SMEM: usize = 48 * 1024 - STATIC_SMEM;

/// `moelink::ll::LlCtx`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct LlCtx {
    /// Device array of `num_ranks` buffer bases as mapped here.
    pub peers: u64,
    /// Device array of `num_ranks` `PortChannelDeviceHandle`s, or 0.
    pub ports: u64,
    pub local: u64,
    /// Device u32 array of [`STATE_WORDS`].
    pub state: u64,
    /// Device int32 `[R]`.
    pub mask: u64,
    /// Host-mapped `DeviceError`.
    pub error: u64,
    pub zc_offset: u64,
    pub recv_offset: [u64; 2],
    pub stage_offset: [u64; 2],
    pub timeout_ns: u64,
    pub rank: i32,
    pub num_ranks: i32,
    /// Bit d set: peer d is reached through its port channel (the proxy),
    /// else by direct stores; 0: NVLink only (this rank's bit is ignored).
    pub use_proxy: i32,
    pub shrink: i32,
    /// Device u64 `[2][PROF_BLOCKS][PROF_SLOTS]` phase stamps, or 0 (off).
    pub prof: u64,
}

/// Where a low-latency dispatch writes (fields `recv_x` to `stats_wait` of
/// `moelink::ll::DispatchArgs`; 0 = absent where allowed).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct DispatchOutputs {
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_count: u64,
    pub src_info: u64,
    pub layout_range: u64,
    pub stats_count: u64,
    pub stats_wait: u64,
}

/// `moelink::ll::DispatchArgs` (its outputs as one [`DispatchOutputs`]: the
/// same layout).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct DispatchArgs {
    pub x: u64,
    pub topk: u64,
    pub out: DispatchOutputs,
    pub msg_bytes: i64,
    pub inbox_bytes: i64,
    pub sizes: LlSizes,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    pub phases: i32,
    pub pad_: i32,
}

/// `moelink::ll::CombineArgs`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct CombineArgs {
    pub x: u64,
    pub layout_range: u64,
    pub topk: u64,
    pub weights: u64,
    pub out: u64,
    pub stats_wait: u64,
    pub inbox_bytes: i64,
    pub sizes: LlSizes,
    pub phases: i32,
}

/// The fields `num_tokens` to `num_experts` of `moelink::ll::DispatchArgs`
/// and of `moelink::ll::CombineArgs` (the same bytes): a call of
/// `num_tokens` tokens and its shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct LlSizes {
    pub num_tokens: i32,
    pub max_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
}

// Without padding: the fields after it stay where the .cu structs have them.
const _: () = assert!(size_of::<LlSizes>() == 20);

impl LlSizes {
    /// A call of `num_tokens` tokens of `shape`.
    pub fn new(num_tokens: usize, shape: &LlShape) -> Self {
        Self {
            num_tokens: num_tokens as i32,
            max_tokens: shape.max_tokens as i32,
            hidden: shape.hidden as i32,
            num_topk: shape.num_topk as i32,
            num_experts: shape.num_experts as i32,
        }
    }
}

/// `ll_dispatch`'s argument block (`LlDispatchParams` of low_latency.cu).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct LlDispatchParams {
    c: LlCtx,
    a: DispatchArgs,
}

/// `ll_combine`'s argument block (`LlCombineParams` of low_latency.cu).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct LlCombineParams {
    c: LlCtx,
    a: CombineArgs,
}

const _: () = {
    // The receive half moves at most 64 fp8 scales per message (two per lane):
    // `kMaxHidden` in low_latency.cu.
    assert!(MAX_HIDDEN == 8192 && MAX_HIDDEN / FP8_GROUP_SIZE <= 64);
    // A send-half chunk holds whole tokens, one entry per thread.
    assert!(MAX_TOPK <= THREADS as usize);
    assert!(size_of::<LlCtx>() == 120);
    assert!(size_of::<DispatchArgs>() == 128);
    assert!(offset_of!(DispatchArgs, out) == 16);
    assert!(offset_of!(DispatchArgs, msg_bytes) == 72);
    assert!(size_of::<CombineArgs>() == 80);
    assert!(size_of::<LlDispatchParams>() == 248);
    assert!(size_of::<LlCombineParams>() == 200);
    // `kStateWords == 8 + kMaxRanks`, the send counter 8-byte aligned.
    assert!(MAX_RANKS == 32 && STATE_WORDS == 40 && (4 + MAX_RANKS) % 2 == 0);
    // The release counts and the outgoing values fit the flags region.
    assert!(RELEASE_OFFSET + 16 * MAX_RANKS as u64 <= 2048);
    assert!(3072 + 16 * MAX_RANKS as u64 <= FLAGS_BYTES);
};

/// Which halves a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phases {
    Send = 1,
    Recv = 2,
    Both = 3,
}

const fn round16(n: u64) -> u64 {
    n.div_ceil(16) * 16
}

/// The shape of one low-latency call, from which every size follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlShape {
    pub num_ranks: usize,
    /// `T`: `num_max_dispatch_tokens_per_rank`.
    pub max_tokens: usize,
    pub hidden: usize,
    pub num_experts: usize,
    /// `K` (at most [`MAX_TOPK`]).
    pub num_topk: usize,
}

impl LlShape {
    pub fn check(&self) -> Result<()> {
        let r = self.num_ranks;
        if r == 0 || r > MAX_RANKS {
            return Err(CommError::invalid(
                "group",
                format!("{r} ranks; low-latency kernels handle 1..={MAX_RANKS}"),
            ));
        }
        if self.num_experts == 0 || self.num_experts % r != 0 {
            return Err(CommError::invalid(
                "num_experts",
                format!(
                    "{} experts cannot be split evenly over {r} ranks",
                    self.num_experts
                ),
            ));
        }
        if self.num_experts / r > MAX_LOCAL_EXPERTS {
            return Err(CommError::invalid(
                "num_experts",
                format!(
                    "{} experts per rank; at most {MAX_LOCAL_EXPERTS}",
                    self.num_experts / r
                ),
            ));
        }
        if self.hidden == 0 || self.hidden % FP8_GROUP_SIZE != 0 || self.hidden > MAX_HIDDEN {
            return Err(CommError::invalid(
                "hidden",
                format!(
                    "{}: must be a positive multiple of {FP8_GROUP_SIZE}, at most {MAX_HIDDEN}",
                    self.hidden
                ),
            ));
        }
        if self.num_topk == 0 || self.num_topk > MAX_TOPK {
            return Err(CommError::invalid(
                "topk_idx",
                format!("top-k {}: must be 1..={MAX_TOPK}", self.num_topk),
            ));
        }
        if self.max_tokens == 0 || self.max_tokens > MAX_TOKENS {
            return Err(CommError::invalid(
                "num_max_dispatch_tokens_per_rank",
                format!("{} is not in 1..={MAX_TOKENS}", self.max_tokens),
            ));
        }
        Ok(())
    }

    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// Most rows one expert rank returns to one source in combine: `T * min(K,
    /// E_local)`.
    pub fn max_messages(&self) -> u64 {
        (self.max_tokens * self.num_topk.min(self.experts_per_rank())) as u64
    }

    /// Header of a dispatch message (one per token and destination rank): the
    /// token, the number n of its top-k slots on that rank, and n (local
    /// expert, occurrence) pairs; `msg_header_bytes` in the kernel.
    pub fn msg_header_bytes(&self) -> u64 {
        round16(HEADER_BYTES + 8 * self.num_topk as u64)
    }

    /// Bytes of a dispatch message.
    pub fn msg_bytes(&self, use_fp8: bool, use_ue8m0: bool) -> u64 {
        let h = self.hidden as u64;
        if use_fp8 {
            let g = h / 128;
            let scales = if use_ue8m0 { g.div_ceil(4) * 4 } else { 4 * g };
            self.msg_header_bytes() + round16(h + scales)
        } else {
            self.msg_header_bytes() + 2 * h
        }
    }

    /// Header of a dispatch inbox: the local experts' counts and the number of
    /// messages.
    pub fn header_bytes(&self) -> u64 {
        round16(4 * (self.experts_per_rank() as u64 + 1))
    }

    /// Bytes of one source's dispatch inbox: at most one message per token.
    pub fn dispatch_inbox_bytes(&self, use_fp8: bool, use_ue8m0: bool) -> u64 {
        self.header_bytes() + self.max_tokens as u64 * self.msg_bytes(use_fp8, use_ue8m0)
    }

    /// Bytes of one expert rank's combine inbox.
    pub fn combine_inbox_bytes(&self) -> u64 {
        self.max_messages() * 2 * self.hidden as u64
    }

    /// Bytes of the region per parity (the larger of both inbox sets; bf16
    /// dispatch is the largest message).
    pub fn region_bytes(&self) -> u64 {
        let inbox = self
            .dispatch_inbox_bytes(false, false)
            .max(self.combine_inbox_bytes());
        round16(self.num_ranks as u64 * inbox)
    }

    /// Bytes of the zero-copy combine input `[E_local, R*T, H]` bf16.
    pub fn zero_copy_bytes(&self) -> u64 {
        (self.experts_per_rank() * self.num_ranks * self.max_tokens * self.hidden * 2) as u64
    }

    /// Byte offsets of (zero-copy, `recv[2]`, `stage[2]`) and the total buffer
    /// size. The zero-copy region sits right after the flags for every K, so
    /// its address depends only on (T, H, E).
    pub fn layout(&self, with_staging: bool) -> LlLayout {
        let zc = FLAGS_BYTES;
        let region = self.region_bytes();
        let r0 = round16(zc + self.zero_copy_bytes());
        let recv = [r0, r0 + region];
        let (stage, end) = if with_staging {
            ([r0 + 2 * region, r0 + 3 * region], r0 + 4 * region)
        } else {
            ([0, 0], r0 + 2 * region)
        };
        LlLayout {
            zero_copy: zc,
            recv,
            stage,
            total: end,
        }
    }

    fn dispatch_smem(&self, use_fp8: bool, use_ue8m0: bool) -> usize {
        // Send half (`SendRouting`): hist [E], tpos [32], ek, occ, dl, dpos
        // [32 each], nd (+3 words), padded to 16 bytes; one byte per thread
        // (a chunk's destinations); the message.
        let send = self.num_experts + MAX_RANKS + 4 * MAX_TOPK + 4;
        let send = round16(4 * send as u64) as usize
            + THREADS as usize
            + self.msg_bytes(use_fp8, use_ue8m0) as usize;
        // cnt, begin [R][EL]; nmsg, live, before [32]; the total; the timeout flag.
        let recv = 4 * (2 * self.num_experts + 3 * MAX_RANKS + 2);
        send.max(recv)
    }

    fn combine_smem(&self) -> usize {
        let el = self.experts_per_rank();
        let send = 3 * el * self.num_ranks + MAX_RANKS + el + 1;
        let recv = 2 * self.num_experts + MAX_RANKS + 3 * MAX_TOPK;
        4 * send.max(recv)
    }

    /// Errors when a block's shared memory would exceed 48 KiB.
    pub fn check_smem(&self) -> Result<()> {
        let need = self.dispatch_smem(false, false).max(self.combine_smem());
        if need > MAX_SMEM {
            return Err(CommError::invalid(
                "num_experts",
                format!(
                    "{} experts with hidden {} need {need} bytes of shared memory per block; \
                     at most {MAX_SMEM}",
                    self.num_experts, self.hidden
                ),
            ));
        }
        Ok(())
    }
}

/// Where the regions of a low-latency buffer start (bytes from its base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    pub zero_copy: u64,
    pub recv: [u64; 2],
    pub stage: [u64; 2],
    pub total: u64,
}

/// One launch of a low-latency kernel: the device's kernels and the stream,
/// the buffer's context, the call's shape and the grid (`num_blocks` blocks).
#[derive(Clone, Copy)]
pub struct Launch<'a> {
    pub kernels: &'a DeviceKernels,
    pub stream: StreamHandle,
    pub ctx: LlCtx,
    pub shape: LlShape,
    pub num_blocks: u32,
}

impl Launch<'_> {
    /// # Safety
    /// `params` is kernel `id`'s argument block, every pointer of it valid.
    unsafe fn run<P: Copy>(&self, id: KernelId, params: P, smem: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.kernels.launch_params(
                id,
                (self.num_blocks.max(1), 1),
                THREADS,
                smem as u32,
                self.stream,
                params,
            )
        }
    }
}

/// Launches `ll_dispatch` (`phases` of it).
///
/// # Safety
/// Every pointer of `l.ctx` and `a` must be valid for the shapes in `a`.
pub unsafe fn dispatch(l: &Launch<'_>, a: DispatchArgs) -> Result<()> {
    l.shape.check()?;
    let smem = l.shape.dispatch_smem(a.use_fp8 != 0, a.use_ue8m0 != 0);
    if smem > MAX_SMEM {
        l.shape.check_smem()?;
    }
    // SAFETY: LlDispatchParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe { l.run(KernelId::LlDispatch, LlDispatchParams { c: l.ctx, a }, smem) }
}

/// Launches `ll_combine` (`phases` of it).
///
/// # Safety
/// Every pointer of `l.ctx` and `a` must be valid for the shapes in `a`.
pub unsafe fn combine(l: &Launch<'_>, a: CombineArgs) -> Result<()> {
    l.shape.check()?;
    l.shape.check_smem()?;
    let p = LlCombineParams { c: l.ctx, a };
    // SAFETY: as above.
    unsafe { l.run(KernelId::LlCombine, p, l.shape.combine_smem()) }
}

/// Host access to words of low-latency buffers, for what the host does
/// between calls (the rank barrier of a shrink `clean`, draining the proxy
/// before a shrink `destroy`): synchronous copies through the driver.
pub mod host {
    use comm::error::{CudaResultExt, Result};
    use comm::Device;
    use cudarc::driver::{result, sys};

    /// Copies `out.len()` values from device address `ptr` (synchronous).
    ///
    /// # Safety
    /// `ptr..ptr + size_of_val(out)` must be device memory mapped in this
    /// process for `device` (its own allocation or a peer's mapped one).
    pub unsafe fn read<T: Copy>(device: Device, ptr: u64, out: &mut [T]) -> Result<()> {
        device.make_current()?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_dtoh_sync(out, ptr) }.call("cuMemcpyDtoH")
    }

    /// Copies `src` to device address `ptr` (the copy is issued on return; it
    /// lands before any later copy of this thread to the same memory).
    ///
    /// # Safety
    /// As [`read`], for `size_of_val(src)` bytes; nothing else may own the
    /// bytes written (they are words the host keeps for itself).
    pub unsafe fn write<T: Copy>(device: Device, ptr: u64, src: &[T]) -> Result<()> {
        device.make_current()?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_htod_sync(ptr, src) }.call("cuMemcpyHtoD")
    }

    /// Whether device address `ptr` lies in a CUDA virtual-memory (cuMem)
    /// allocation mapped in this process, as opposed to `cuMemAlloc` memory:
    /// a peer that mapped a cuMem allocation keeps its physical memory alive
    /// until it unmaps it, whoever frees it first.
    pub fn is_vmm(device: Device, ptr: u64) -> Result<bool> {
        device.make_current()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: a query on an address; the handle it returns (if any) is
        // released below.
        let r =
            unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut std::ffi::c_void) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Ok(false);
        }
        // SAFETY: retained above, released once.
        unsafe { sys::cuMemRelease(handle) }
            .result()
            .call("cuMemRelease")?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn std_shape() -> LlShape {
        LlShape {
            num_ranks: 4,
            max_tokens: 128,
            hidden: 7168,
            num_experts: 288,
            num_topk: 8,
        }
    }

    #[test]
    fn message_sizes() {
        let s = std_shape();
        // 16 + 8 pairs of 8 bytes: 80.
        assert_eq!(s.msg_header_bytes(), 80);
        assert_eq!(s.msg_bytes(false, false), 80 + 14336);
        assert_eq!(s.msg_bytes(true, false), 80 + 7168 + 56 * 4);
        assert_eq!(s.msg_bytes(true, true), 80 + 7168 + 64);
        // 72 counts + the message count, padded: 73 * 4 -> 304.
        assert_eq!(s.header_bytes(), 304);
        assert_eq!(
            s.dispatch_inbox_bytes(true, false),
            304 + 128 * (80 + 7168 + 224)
        );
        assert_eq!(s.max_messages(), 128 * 8);
    }

    #[test]
    fn layout_is_ordered_and_zero_copy_independent_of_topk() {
        let s = std_shape();
        let l = s.layout(true);
        assert_eq!(l.zero_copy, FLAGS_BYTES);
        assert!(l.recv[0] >= l.zero_copy + s.zero_copy_bytes());
        assert_eq!(l.recv[1] - l.recv[0], s.region_bytes());
        assert_eq!(l.stage[0], l.recv[1] + s.region_bytes());
        assert_eq!(l.total, l.stage[1] + s.region_bytes());
        let s2 = LlShape { num_topk: 1, ..s };
        assert_eq!(s2.layout(true).zero_copy, l.zero_copy);
        assert_eq!(s2.layout(true).recv[0], l.recv[0]);
        assert!(s2.layout(true).total < l.total);
        assert!(s.layout(false).total < l.total);
        for o in [l.zero_copy, l.recv[0], l.recv[1], l.stage[0], l.stage[1]] {
            assert_eq!(o % 16, 0);
        }
    }

    /// `send_share` of low_latency.cu: the shares of a grid's blocks sum to
    /// `1 << SEND_SHIFT`, so the send counter's call number changes only with
    /// the last block's add.
    #[test]
    fn send_shares_sum_to_one_call() {
        let whole = 1u64 << SEND_SHIFT;
        for grid in [1u64, 2, 3, 7, 33, 66, 78, 114, 132, 264, 1000, 1024] {
            let share = |b: u64| whole / grid + u64::from(b < whole % grid);
            let total: u64 = (0..grid).map(share).sum();
            assert_eq!(total, whole, "grid {grid}");
            // Any proper subset of the adds stays below one call.
            assert!(total - share(grid - 1) < whole);
        }
    }

    #[test]
    fn shape_checks() {
        let s = std_shape();
        assert!(s.check().is_ok());
        assert!(s.check_smem().is_ok());
        assert!(LlShape {
            num_experts: 287,
            ..s
        }
        .check()
        .is_err());
        assert!(LlShape { hidden: 100, ..s }.check().is_err());
        assert!(LlShape { hidden: 8320, ..s }.check().is_err());
        assert!(LlShape { num_topk: 33, ..s }.check().is_err());
        assert!(LlShape {
            num_ranks: 33,
            num_experts: 33 * 9,
            ..s
        }
        .check()
        .is_err());
        assert!(LlShape {
            num_experts: 4 * 2000,
            ..s
        }
        .check_smem()
        .is_err());
    }
}
