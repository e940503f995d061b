//! `#[repr(C)]` mirror of `moelink::coll::CollArgs` (`cuda/coll_common.cuh`).
//!
//! Layout is checked three ways: the `const` assertions here, the
//! `static_assert`s in the header (same numbers), and the GPU test that runs
//! `coll_layout_probe` and compares with [`layout_probe_expected`].

use std::mem::{offset_of, size_of};

use comm::device_handles::MemoryChannelDeviceHandle;

/// Ranks a collective kernel supports (one node).
pub const MAX_RANKS: usize = 8;
/// Blocks a barrier-synchronised kernel may use (rows of the channel table).
pub const MAX_BLOCKS: usize = 128;
/// Largest `max_bytes` of a communicator (1 TiB: more than any GPU holds; the
/// scratch layout's arithmetic stays far from overflow).
pub const MAX_BYTES: usize = 1 << 40;

/// `CollArgs::flags` bits.
pub mod flags {
    /// Every pointer the kernel vectorises over is aligned (8 B for LL kernels,
    /// 16 B for rsag / ag_mesh).
    pub const ALIGNED: i32 = 1;
    /// Copy the input into this rank's scratch first (rsag, ag_mesh).
    pub const COPY_IN: i32 = 2;
    /// Copy the other ranks' result slices from the scratch to the output (rsag).
    pub const COPY_OUT: i32 = 4;
    /// rsag_push: store the input slices into the owners' scratch instead of
    /// copying in.
    pub const PUSH: i32 = 8;
}

/// The argument block of every collective kernel (see the header for what
/// each field means to which kernel). Addresses are device addresses in this
/// process; `peer_*[p]` for `p >= num_ranks` are 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CollArgs {
    pub input: u64,
    pub output: u64,
    pub scratch: u64,
    pub peer_scratch: [u64; MAX_RANKS],
    pub peer_in: [u64; MAX_RANKS],
    pub peer_out: [u64; MAX_RANKS],
    pub channels: u64,
    pub error: u64,
    pub counter: u64,
    pub ticket: u64,
    pub nbytes: u64,
    pub ll_offset: u64,
    pub ll_half_bytes: u64,
    pub data_offset: u64,
    /// Result region: the rsag family's results where the output is not
    /// registered (copy-out reads them after the second barrier).
    pub result_offset: u64,
    /// Bound of every device wait, nanoseconds of GPU time (> 0).
    pub timeout_ns: i64,
    pub rank: i32,
    pub num_ranks: i32,
    pub flags: i32,
    /// Tests only: every rsag block waits this many microseconds before its
    /// copy-out phase (0: never), to widen the window in which peers run ahead.
    pub test_delay_us: i32,
}

// Same numbers as the static_asserts in coll_common.cuh.
const _: () = {
    assert!(size_of::<CollArgs>() == 312);
    assert!(offset_of!(CollArgs, peer_scratch) == 24);
    assert!(offset_of!(CollArgs, peer_in) == 88);
    assert!(offset_of!(CollArgs, peer_out) == 152);
    assert!(offset_of!(CollArgs, channels) == 216);
    assert!(offset_of!(CollArgs, nbytes) == 248);
    assert!(offset_of!(CollArgs, result_offset) == 280);
    assert!(offset_of!(CollArgs, timeout_ns) == 288);
    assert!(offset_of!(CollArgs, rank) == 296);
    assert!(offset_of!(CollArgs, flags) == 304);
};

/// What `coll_layout_probe` must write, in order.
pub fn layout_probe_expected() -> Vec<u64> {
    let mut v = comm::struct_layout![CollArgs {
        input,
        output,
        scratch,
        peer_scratch,
        peer_in,
        peer_out,
        channels,
        error,
        counter,
        ticket,
        nbytes,
        ll_offset,
        ll_half_bytes,
        data_offset,
        result_offset,
        timeout_ns,
        rank,
        num_ranks,
        flags,
        test_delay_us,
    }];
    v.extend([
        size_of::<MemoryChannelDeviceHandle>(),
        MAX_RANKS,
        MAX_BLOCKS,
    ]);
    v.iter().map(|&v| v as u64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_list_matches_the_header_constants() {
        let v = layout_probe_expected();
        assert_eq!(v.len(), 24);
        assert_eq!(v[0], 312);
        assert_eq!(v[21], 80); // MemoryChannelDeviceHandle, as comm asserts
                               // The header's constants, read from its text.
        let h = include_str!("../cuda/coll_common.cuh");
        assert!(h.contains(&format!("constexpr int kMaxRanks = {MAX_RANKS};")));
        assert!(h.contains(&format!("constexpr int kMaxBlocks = {MAX_BLOCKS};")));
        assert!(h.contains(&format!("kFlagAligned = {},", flags::ALIGNED)));
        assert!(h.contains(&format!("kFlagCopyIn = {},", flags::COPY_IN)));
        assert!(h.contains(&format!("kFlagCopyOut = {},", flags::COPY_OUT)));
        assert!(h.contains(&format!("kFlagPush = {},", flags::PUSH)));
    }
}
