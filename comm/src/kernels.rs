//! comm's own kernels (`cuda/`): remote atomics for the transports and the
//! layout probe of the device handles; the test kernels (`cuda_testing/`, a
//! fatbin of their own) under [`testing`]. One typed launcher each.

use crate::cuda::{Device, StreamHandle};
use crate::error::Result;
use crate::module::kernel_arg as arg;
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
    let mut t = target;
    if wide {
        let mut v = value;
        // SAFETY: (u64*, i64) matches comm_atomic_add64; target validity is the caller's.
        unsafe {
            MODULES.launch_1d(
                device,
                KernelId::AtomicAdd64.index(),
                1,
                1,
                stream,
                &mut [arg(&mut t), arg(&mut v)],
            )
        }
    } else {
        let mut v = value as i32;
        // SAFETY: (u32*, i32) matches comm_atomic_add32; target validity is the caller's.
        unsafe {
            MODULES.launch_1d(
                device,
                KernelId::AtomicAdd32.index(),
                1,
                1,
                stream,
                &mut [arg(&mut t), arg(&mut v)],
            )
        }
    }
}

/// Runs `comm_layout_probe` and returns what the device compiler laid out
/// (compare with [`crate::device_handles::layout_probe_expected`]).
pub fn layout_probe(device: Device) -> Result<Vec<u64>> {
    let n = crate::device_handles::layout_probe_expected().len() + 1;
    let buf = crate::memory::DeviceMemory::alloc(device, n * 8)?;
    buf.fill(0xEE)?;
    let mut p = buf.ptr();
    // SAFETY: (u64*) matches the kernel; the buffer holds n words.
    unsafe {
        MODULES.launch_1d(
            device,
            KernelId::LayoutProbe.index(),
            1,
            1,
            StreamHandle(0),
            &mut [arg(&mut p)],
        )
    }?;
    device.synchronize()?;
    let mut out = vec![0u64; n];
    buf.copy_to_host(0, &mut out)?;
    Ok(out)
}

/// Launchers of the kernels behind comm's GPU tests and benchmarks
/// (`cuda_testing/test_kernels.cu`, a fatbin of their own). Grid sizes are the
/// caller's. `timeout_ns` bounds each device wait in nanoseconds of GPU time;
/// these test launchers take it as given (no check; a very large value such as
/// [`i64::MAX`] is no bound).
pub mod testing {
    use super::arg;
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
            PortchanPingpong => "comm_test_portchan_pingpong",
            MemchanCopy => "comm_test_memchan_copy",
            MemchanWait => "comm_test_memchan_wait",
            Packets => "comm_test_packets",
            PortchanOp => "comm_test_portchan_op",
            PortchanAtomics => "comm_test_portchan_atomics",
            FifoRoundtrip => "comm_test_fifo_roundtrip",
            FifoPushOnly => "comm_test_fifo_push_only",
        }
    }
    static MODULES: ModuleCache = ModuleCache::new("comm-testing", FATBIN, TestKernelId::NAMES);

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
    }

    /// Signal/wait ping-pong; `out_ns` (device u64) receives the elapsed time.
    ///
    /// # Safety
    /// The handle's pointers must be valid for `device`; `out_ns` a device u64.
    pub unsafe fn memchan_pingpong(
        device: Device,
        stream: StreamHandle,
        mut h: MemoryChannelDeviceHandle,
        mut iters: i32,
        initiator: bool,
        mut timeout_ns: i64,
        mut out_ns: u64,
    ) -> Result<()> {
        let mut init = initiator as i32;
        let p = &mut [
            arg(&mut h),
            arg(&mut iters),
            arg(&mut init),
            arg(&mut timeout_ns),
            arg(&mut out_ns),
        ];
        // SAFETY: parameter list matches comm_test_memchan_pingpong.
        unsafe {
            MODULES.launch_1d(
                device,
                TestKernelId::MemchanPingpong.index(),
                1,
                32,
                stream,
                p,
            )
        }
    }

    /// # Safety
    /// As [`memchan_pingpong`].
    pub unsafe fn portchan_pingpong(
        device: Device,
        stream: StreamHandle,
        mut h: PortChannelDeviceHandle,
        mut iters: i32,
        initiator: bool,
        mut timeout_ns: i64,
        mut out_ns: u64,
    ) -> Result<()> {
        let mut init = initiator as i32;
        let p = &mut [
            arg(&mut h),
            arg(&mut iters),
            arg(&mut init),
            arg(&mut timeout_ns),
            arg(&mut out_ns),
        ];
        // SAFETY: parameter list matches comm_test_portchan_pingpong.
        unsafe {
            MODULES.launch_1d(
                device,
                TestKernelId::PortchanPingpong.index(),
                1,
                32,
                stream,
                p,
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
        mut h: MemoryChannelDeviceHandle,
        mut dst_off: u64,
        mut src_off: u64,
        mut bytes: u64,
        get: bool,
        mut iters: i32,
        signal: bool,
    ) -> Result<()> {
        let (mut g, mut s) = (get as i32, signal as i32);
        let p = &mut [
            arg(&mut h),
            arg(&mut dst_off),
            arg(&mut src_off),
            arg(&mut bytes),
            arg(&mut g),
            arg(&mut iters),
            arg(&mut s),
        ];
        // SAFETY: parameter list matches comm_test_memchan_copy.
        unsafe {
            MODULES.launch_1d(
                device,
                TestKernelId::MemchanCopy.index(),
                blocks,
                threads,
                stream,
                p,
            )
        }
    }

    /// # Safety
    /// The handle's pointers must be valid for `device`.
    pub unsafe fn memchan_wait(
        device: Device,
        stream: StreamHandle,
        mut h: MemoryChannelDeviceHandle,
        mut timeout_ns: i64,
    ) -> Result<()> {
        let p = &mut [arg(&mut h), arg(&mut timeout_ns)];
        // SAFETY: parameter list matches comm_test_memchan_wait.
        unsafe { MODULES.launch_1d(device, TestKernelId::MemchanWait.index(), 1, 32, stream, p) }
    }

    /// Writes (`read == false`) or reads LL packets.
    ///
    /// # Safety
    /// The ranges (packets take 2x `bytes`) must lie inside the memories.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn packets(
        device: Device,
        stream: StreamHandle,
        mut h: MemoryChannelDeviceHandle,
        ll16: bool,
        read: bool,
        mut dst_off: u64,
        mut src_off: u64,
        mut bytes: u64,
        mut flag: u32,
        mut timeout_ns: i64,
    ) -> Result<()> {
        let (mut l, mut r) = (ll16 as i32, read as i32);
        let p = &mut [
            arg(&mut h),
            arg(&mut l),
            arg(&mut r),
            arg(&mut dst_off),
            arg(&mut src_off),
            arg(&mut bytes),
            arg(&mut flag),
            arg(&mut timeout_ns),
        ];
        // SAFETY: parameter list matches comm_test_packets.
        unsafe { MODULES.launch_1d(device, TestKernelId::Packets.index(), 4, 256, stream, p) }
    }

    /// # Safety
    /// Offsets/sizes must lie inside the proxy's registered memories.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn portchan_op(
        device: Device,
        stream: StreamHandle,
        mut h: PortChannelDeviceHandle,
        op: PortOp,
        mut dst_off: u64,
        mut src_off: u64,
        mut size: u64,
        mut iters: i32,
        mut timeout_ns: i64,
    ) -> Result<()> {
        let mut o = op as i32;
        let p = &mut [
            arg(&mut h),
            arg(&mut o),
            arg(&mut dst_off),
            arg(&mut src_off),
            arg(&mut size),
            arg(&mut iters),
            arg(&mut timeout_ns),
        ];
        // SAFETY: parameter list matches comm_test_portchan_op.
        unsafe { MODULES.launch_1d(device, TestKernelId::PortchanOp.index(), 1, 32, stream, p) }
    }

    /// # Safety
    /// Offsets must be aligned integers inside the peer's memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn portchan_atomics(
        device: Device,
        stream: StreamHandle,
        blocks: u32,
        threads: u32,
        mut h: PortChannelDeviceHandle,
        mut off64: u64,
        mut off32: u64,
        mut per_thread: i32,
        mut v64: i64,
        mut v32: i32,
    ) -> Result<()> {
        let p = &mut [
            arg(&mut h),
            arg(&mut off64),
            arg(&mut off32),
            arg(&mut per_thread),
            arg(&mut v64),
            arg(&mut v32),
        ];
        // SAFETY: parameter list matches comm_test_portchan_atomics.
        unsafe {
            MODULES.launch_1d(
                device,
                TestKernelId::PortchanAtomics.index(),
                blocks,
                threads,
                stream,
                p,
            )
        }
    }

    /// # Safety
    /// As [`portchan_pingpong`].
    pub unsafe fn fifo_roundtrip(
        device: Device,
        stream: StreamHandle,
        mut h: PortChannelDeviceHandle,
        mut iters: i32,
        mut timeout_ns: i64,
        mut out_ns: u64,
    ) -> Result<()> {
        let p = &mut [
            arg(&mut h),
            arg(&mut iters),
            arg(&mut timeout_ns),
            arg(&mut out_ns),
        ];
        // SAFETY: parameter list matches comm_test_fifo_roundtrip.
        unsafe {
            MODULES.launch_1d(
                device,
                TestKernelId::FifoRoundtrip.index(),
                1,
                32,
                stream,
                p,
            )
        }
    }

    /// Pushes `iters` no-op triggers back to back, then waits for the last.
    ///
    /// # Safety
    /// As [`portchan_pingpong`].
    pub unsafe fn fifo_push_only(
        device: Device,
        stream: StreamHandle,
        mut h: PortChannelDeviceHandle,
        mut iters: i32,
        mut timeout_ns: i64,
        mut out_ns: u64,
    ) -> Result<()> {
        let p = &mut [
            arg(&mut h),
            arg(&mut iters),
            arg(&mut timeout_ns),
            arg(&mut out_ns),
        ];
        // SAFETY: parameter list matches comm_test_fifo_push_only.
        unsafe { MODULES.launch_1d(device, TestKernelId::FifoPushOnly.index(), 1, 32, stream, p) }
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
