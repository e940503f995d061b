//! comm's own kernels (`cuda/`): remote atomics for the transports and the
//! layout probe of the device handles; the test kernels (`cuda_testing/`, a
//! fatbin of their own) under [`testing`]. One typed launcher each.

use crate::cuda::{Device, StreamHandle};
use crate::error::Result;
use crate::module::ModuleCache;

static FATBIN: &[u8] = include_bytes!(env!("COMM_FATBIN"));
crate::kernel_table! {
    /// Every kernel entry point of comm's production fatbin (`extern "C"` names).
    pub enum KernelId {
        AtomicAdd64 => "comm_atomic_add64",
        AtomicAdd32 => "comm_atomic_add32",
        LayoutProbe => "comm_layout_probe",
    }
}
static MODULES: ModuleCache = ModuleCache::new("comm", FATBIN, KernelId::NAMES);

/// Atomically adds `value` to the u64 (`wide`) or u32 at `target` (device or
/// peer-mapped address) on `stream`.
///
/// # Safety
/// `target` must be a valid, suitably aligned address for `device`.
pub unsafe fn atomic_add(
    device: Device,
    stream: StreamHandle,
    target: u64,
    value: i64,
    wide: bool,
) -> Result<()> {
    let (id, value) = if wide {
        (KernelId::AtomicAdd64, value)
    } else {
        // The 32-bit kernel reads the low half (little-endian) as its int.
        (KernelId::AtomicAdd32, value as i32 as i64)
    };
    let p = AtomicParams { target, value };
    // SAFETY: AtomicParams mirrors the kernels' block; target validity is the caller's.
    unsafe { MODULES.launch_params(device, id.index(), 1, 1, stream, p) }
}

/// The argument block of `comm_atomic_add64` / `comm_atomic_add32` (the latter
/// reads `value`'s low 32 bits).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct AtomicParams {
    target: u64,
    value: i64,
}

/// Runs `comm_layout_probe` and returns what the device compiler laid out
/// (compare with [`crate::device_handles::layout_probe_expected`]).
pub fn layout_probe(device: Device) -> Result<Vec<u64>> {
    let n = crate::device_handles::layout_probe_expected().len() + 1;
    // SAFETY: comm_layout_probe's one argument is the u64* out; it writes at
    // most n words.
    unsafe {
        MODULES
            .get(device)?
            .run_probe(KernelId::LayoutProbe.index(), n, 0xEE)
    }
}

/// Launchers of the kernels behind comm's GPU tests and benchmarks
/// (`cuda_testing/test_kernels.cu`, a fatbin of their own). Grid sizes are the
/// caller's. `timeout_ns` bounds each device wait in nanoseconds of GPU time;
/// these test launchers take it as given (no check; a very large value such as
/// [`i64::MAX`] is no bound).
pub mod testing {
    use std::mem::{offset_of, size_of};

    use crate::cuda::{Device, StreamHandle};
    use crate::device_handles::{MemoryChannelDeviceHandle, PortChannelDeviceHandle};
    use crate::error::Result;
    use crate::module::ModuleCache;

    /// The test kernels' own fatbin (`cuda_testing/`): kept out of the module
    /// that every process loads, and loaded on a device at the first launch here.
    pub(super) static FATBIN: &[u8] = include_bytes!(env!("COMM_TEST_FATBIN"));

    crate::kernel_table! {
        /// Every kernel entry point of the test fatbin (`extern "C"` names).
        pub enum TestKernelId {
            MemchanPingpong => "comm_test_memchan_pingpong",
            MemchanPingpongFloor => "comm_test_memchan_pingpong_floor",
            PortchanPingpong => "comm_test_portchan_pingpong",
            MemchanCopy => "comm_test_memchan_copy",
            MemchanWait => "comm_test_memchan_wait",
            Packets => "comm_test_packets",
            PortchanOp => "comm_test_portchan_op",
            PortchanAtomics => "comm_test_portchan_atomics",
            FifoRoundtrip => "comm_test_fifo_roundtrip",
            FifoPushOnly => "comm_test_fifo_push_only",
            FifoPushMany => "comm_test_fifo_push_many",
        }
    }
    static MODULES: ModuleCache = ModuleCache::new("comm-testing", FATBIN, TestKernelId::NAMES);

    // The test kernels' argument blocks (test_kernels.cu, same field order).
    #[derive(Clone, Copy)]
    #[repr(C)]
    struct PingpongParams<H> {
        h: H,
        timeout_ns: i64,
        out_ns: u64,
        iters: i32,
        initiator: i32,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct MemchanCopyParams {
        h: MemoryChannelDeviceHandle,
        dst_off: u64,
        src_off: u64,
        bytes: u64,
        get: i32,
        iters: i32,
        signal: i32,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct MemchanWaitParams {
        h: MemoryChannelDeviceHandle,
        timeout_ns: i64,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct PacketsParams {
        h: MemoryChannelDeviceHandle,
        dst_off: u64,
        src_off: u64,
        bytes: u64,
        timeout_ns: i64,
        flag: u32,
        ll16: i32,
        read: i32,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct PortchanOpParams {
        h: PortChannelDeviceHandle,
        dst_off: u64,
        src_off: u64,
        size: u64,
        timeout_ns: i64,
        op: i32,
        iters: i32,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct PortchanAtomicsParams {
        h: PortChannelDeviceHandle,
        dst_off64: u64,
        dst_off32: u64,
        v64: i64,
        per_thread: i32,
        v32: i32,
    }

    #[derive(Clone, Copy)]
    #[repr(C)]
    struct FifoParams {
        h: PortChannelDeviceHandle,
        timeout_ns: i64,
        out_ns: u64,
        iters: i32,
        lanes: i32,
        batch: i32,
    }

    // The same numbers as test_kernels.cu's static_asserts.
    const MH: usize = size_of::<MemoryChannelDeviceHandle>();
    const PH: usize = size_of::<PortChannelDeviceHandle>();
    const _: () = {
        assert!(offset_of!(PingpongParams<MemoryChannelDeviceHandle>, iters) == MH + 16);
        assert!(offset_of!(PingpongParams<PortChannelDeviceHandle>, iters) == PH + 16);
        assert!(offset_of!(MemchanCopyParams, signal) == MH + 32);
        assert!(offset_of!(MemchanWaitParams, timeout_ns) == MH);
        assert!(offset_of!(PacketsParams, read) == MH + 40);
        assert!(offset_of!(PortchanOpParams, iters) == PH + 36);
        assert!(offset_of!(PortchanAtomicsParams, v32) == PH + 28);
        assert!(offset_of!(FifoParams, iters) == PH + 16);
        assert!(offset_of!(FifoParams, batch) == PH + 24);
    };

    /// # Safety
    /// `P` mirrors kernel `id`'s argument block; its pointers are valid.
    unsafe fn launch<P: Copy>(
        device: Device,
        stream: StreamHandle,
        id: TestKernelId,
        blocks: u32,
        threads: u32,
        p: P,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { MODULES.launch_params(device, id.index(), blocks, threads, stream, p) }
    }

    /// Port channel operations of `comm_test_portchan_op`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(i32)]
    pub enum PortOp {
        Put = 0,
        PutWithSignal = 1,
        PutWithSignalAndFlush = 2,
        Signal = 3,
        Wait = 4,
        Flush = 5,
        PutThenFlush = 6,
        /// Puts with signals, then as many waits, in one kernel.
        PutWithSignalThenWait = 7,
    }

    /// # Safety
    /// `id` is the ping-pong kernel of handle type `H`; as [`memchan_pingpong`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn pingpong<H: Copy>(
        device: Device,
        stream: StreamHandle,
        id: TestKernelId,
        h: H,
        iters: i32,
        initiator: bool,
        timeout_ns: i64,
        out_ns: u64,
    ) -> Result<()> {
        let p = PingpongParams {
            h,
            timeout_ns,
            out_ns,
            iters,
            initiator: initiator as i32,
        };
        // SAFETY: PingpongParams<H> mirrors the kernel's block.
        unsafe { launch(device, stream, id, 1, 32, p) }
    }

    /// Which memory-channel ping-pong [`memchan_pingpong`] runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Pingpong {
        /// The semaphore's own signal (release) and wait (acquire).
        Ordered,
        /// A relaxed reduction and relaxed polling on the same counters: the
        /// round trip's floor, for timing only (it orders no data).
        RelaxedFloor,
    }

    /// Signal/wait ping-pong; `out_ns` (device u64) receives the elapsed time.
    ///
    /// # Safety
    /// The handle's pointers must be valid for `device`; `out_ns` a device u64.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn memchan_pingpong(
        device: Device,
        stream: StreamHandle,
        h: MemoryChannelDeviceHandle,
        kind: Pingpong,
        iters: i32,
        initiator: bool,
        timeout_ns: i64,
        out_ns: u64,
    ) -> Result<()> {
        let id = match kind {
            Pingpong::Ordered => TestKernelId::MemchanPingpong,
            Pingpong::RelaxedFloor => TestKernelId::MemchanPingpongFloor,
        };
        // SAFETY: forwarded from the caller's contract.
        unsafe { pingpong(device, stream, id, h, iters, initiator, timeout_ns, out_ns) }
    }

    /// # Safety
    /// As [`memchan_pingpong`].
    pub unsafe fn portchan_pingpong(
        device: Device,
        stream: StreamHandle,
        h: PortChannelDeviceHandle,
        iters: i32,
        initiator: bool,
        timeout_ns: i64,
        out_ns: u64,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            pingpong(
                device,
                stream,
                TestKernelId::PortchanPingpong,
                h,
                iters,
                initiator,
                timeout_ns,
                out_ns,
            )
        }
    }

    /// Grid-wide put (or get) of `bytes`, `iters` times, then optionally a
    /// signal (only with `blocks == 1`).
    ///
    /// # Safety
    /// The ranges must lie inside the channel's memories.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn memchan_copy(
        device: Device,
        stream: StreamHandle,
        blocks: u32,
        threads: u32,
        h: MemoryChannelDeviceHandle,
        dst_off: u64,
        src_off: u64,
        bytes: u64,
        get: bool,
        iters: i32,
        signal: bool,
    ) -> Result<()> {
        let p = MemchanCopyParams {
            h,
            dst_off,
            src_off,
            bytes,
            get: get as i32,
            iters,
            signal: signal as i32,
        };
        // SAFETY: MemchanCopyParams mirrors the kernel's block.
        unsafe {
            launch(
                device,
                stream,
                TestKernelId::MemchanCopy,
                blocks,
                threads,
                p,
            )
        }
    }

    /// # Safety
    /// The handle's pointers must be valid for `device`.
    pub unsafe fn memchan_wait(
        device: Device,
        stream: StreamHandle,
        h: MemoryChannelDeviceHandle,
        timeout_ns: i64,
    ) -> Result<()> {
        let p = MemchanWaitParams { h, timeout_ns };
        // SAFETY: MemchanWaitParams mirrors the kernel's block.
        unsafe { launch(device, stream, TestKernelId::MemchanWait, 1, 32, p) }
    }

    /// Writes (`read == false`) or reads LL packets.
    ///
    /// # Safety
    /// The ranges (packets take 2x `bytes`) must lie inside the memories.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn packets(
        device: Device,
        stream: StreamHandle,
        h: MemoryChannelDeviceHandle,
        ll16: bool,
        read: bool,
        dst_off: u64,
        src_off: u64,
        bytes: u64,
        flag: u32,
        timeout_ns: i64,
    ) -> Result<()> {
        let p = PacketsParams {
            h,
            dst_off,
            src_off,
            bytes,
            timeout_ns,
            flag,
            ll16: ll16 as i32,
            read: read as i32,
        };
        // SAFETY: PacketsParams mirrors the kernel's block.
        unsafe { launch(device, stream, TestKernelId::Packets, 4, 256, p) }
    }

    /// # Safety
    /// Offsets/sizes must lie inside the proxy's registered memories.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn portchan_op(
        device: Device,
        stream: StreamHandle,
        h: PortChannelDeviceHandle,
        op: PortOp,
        dst_off: u64,
        src_off: u64,
        size: u64,
        iters: i32,
        timeout_ns: i64,
    ) -> Result<()> {
        let p = PortchanOpParams {
            h,
            dst_off,
            src_off,
            size,
            timeout_ns,
            op: op as i32,
            iters,
        };
        // SAFETY: PortchanOpParams mirrors the kernel's block.
        unsafe { launch(device, stream, TestKernelId::PortchanOp, 1, 32, p) }
    }

    /// # Safety
    /// Offsets must be aligned integers inside the peer's memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn portchan_atomics(
        device: Device,
        stream: StreamHandle,
        blocks: u32,
        threads: u32,
        h: PortChannelDeviceHandle,
        off64: u64,
        off32: u64,
        per_thread: i32,
        v64: i64,
        v32: i32,
    ) -> Result<()> {
        let p = PortchanAtomicsParams {
            h,
            dst_off64: off64,
            dst_off32: off32,
            v64,
            per_thread,
            v32,
        };
        // SAFETY: PortchanAtomicsParams mirrors the kernel's block.
        unsafe {
            launch(
                device,
                stream,
                TestKernelId::PortchanAtomics,
                blocks,
                threads,
                p,
            )
        }
    }

    /// Which FIFO test kernel [`fifo`] launches.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum FifoTest {
        /// `iters` triggers, each waited for (push -> proxy pop -> done).
        RoundTrip,
        /// `iters` no-op triggers back to back, then a wait for the last.
        PushOnly,
        /// `iters` no-op triggers in all, pushed back to back by `lanes` lanes
        /// (1..=32) of each of `warps` warps (1..=32) of one block, in batches
        /// of `batch` (1: `push`, 2..=32: `push_batch`), then a wait for each
        /// producer's last.
        PushMany { warps: u32, lanes: u32, batch: u32 },
    }

    /// Runs one FIFO test kernel on `h`'s FIFO (one warp), writing the GPU time
    /// in ns to `out_ns`.
    ///
    /// # Safety
    /// As [`portchan_pingpong`].
    pub unsafe fn fifo(
        device: Device,
        stream: StreamHandle,
        test: FifoTest,
        h: PortChannelDeviceHandle,
        iters: i32,
        timeout_ns: i64,
        out_ns: u64,
    ) -> Result<()> {
        let mut p = FifoParams {
            h,
            timeout_ns,
            out_ns,
            iters,
            lanes: 1,
            batch: 1,
        };
        let (id, warps) = match test {
            FifoTest::RoundTrip => (TestKernelId::FifoRoundtrip, 1),
            FifoTest::PushOnly => (TestKernelId::FifoPushOnly, 1),
            FifoTest::PushMany {
                warps,
                lanes,
                batch,
            } => {
                p.lanes = lanes.clamp(1, 32) as i32;
                p.batch = batch.clamp(1, 32) as i32;
                (TestKernelId::FifoPushMany, warps.clamp(1, 32))
            }
        };
        // SAFETY: FifoParams mirrors the FIFO kernels' block.
        unsafe { launch(device, stream, id, 1, 32 * warps, p) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::module::{has_trap_switch, names_missing_from_fatbin};
    use testing::TestKernelId;

    /// MOELINK_TRAP_ON_TIMEOUT finds its switch in both of comm's fatbins.
    #[test]
    fn the_fatbins_have_the_trap_switch_under_its_c_name() {
        assert!(has_trap_switch(FATBIN));
        assert!(has_trap_switch(testing::FATBIN));
    }

    /// Every name of each kernel table is a kernel of its fatbin, the
    /// launchers' ids are the names' positions, and no test kernel is in the
    /// production fatbin.
    #[test]
    fn every_kernel_is_in_its_fatbin_and_test_kernels_only_in_theirs() {
        let missing = names_missing_from_fatbin(FATBIN, KernelId::NAMES);
        assert!(missing.is_empty(), "not in the fatbin: {missing:?}");
        let missing = names_missing_from_fatbin(testing::FATBIN, TestKernelId::NAMES);
        assert!(missing.is_empty(), "not in the test fatbin: {missing:?}");
        assert_eq!(
            names_missing_from_fatbin(FATBIN, TestKernelId::NAMES),
            TestKernelId::NAMES,
            "test kernels in the production fatbin"
        );
        for (i, k) in KernelId::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
        for (i, k) in TestKernelId::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
        assert_eq!(KernelId::AtomicAdd32.name(), "comm_atomic_add32");
        assert_eq!(
            TestKernelId::FifoPushOnly.name(),
            "comm_test_fifo_push_only"
        );
    }

    #[test]
    fn a_name_the_fatbin_lacks_is_reported() {
        let fake = b"\0comm_atomic_add64\0comm_atomic_add32x\0";
        let missing = crate::module::names_missing_from_fatbin(
            fake,
            &["comm_atomic_add64", "comm_atomic_add32", "comm_atomic"],
        );
        assert_eq!(missing, ["comm_atomic_add32", "comm_atomic"]);
    }
}
