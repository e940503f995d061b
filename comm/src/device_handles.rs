//! `#[repr(C)]` mirrors of the device-side structs in `include/comm/*.cuh`.
//!
//! Layout is checked three ways: `const` assertions here, `static_assert`s in
//! the headers (same numbers), and a GPU test that runs `comm_layout_probe`
//! and compares what the device compiler laid out with [`layout_probe_expected`].

use std::mem::{offset_of, size_of};

/// `[size_of::<A>(), offset_of!(A, a1), .., size_of::<B>(), offset_of!(B, b1), ..]`
/// as a `Vec<usize>`: the order in which the layout probes (`comm_layout_probe`,
/// `coll_layout_probe`) write a struct's size and its fields' offsets.
#[macro_export]
macro_rules! struct_layout {
    ($($ty:ty { $($field:ident),* $(,)? }),* $(,)?) => {{
        let mut v: Vec<usize> = Vec::new();
        $(
            v.push(::std::mem::size_of::<$ty>());
            $(v.push(::std::mem::offset_of!($ty, $field));)*
        )*
        v
    }};
}

/// Error codes of [`DeviceError::code`].
pub const ERROR_NONE: u32 = 0;
pub const ERROR_TIMEOUT: u32 = 1;
pub const ERROR_INVALID: u32 = 2;

/// Defines [`WaitKind`] from one table: each kind's value (`kWait*` of
/// `common_device.cuh`) and what a wait of that kind was waiting for
/// ([`WaitKind::describe`]).
macro_rules! wait_kinds {
    ($($kind:ident = $value:literal => $what:expr,)*) => {
        /// What a timed-out device wait was waiting for ([`DeviceError::kind`]).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u32)]
        pub enum WaitKind {
            $($kind = $value,)*
        }

        impl WaitKind {
            pub fn from_u32(v: u32) -> Option<Self> {
                match v {
                    $($value => Some(Self::$kind),)*
                    _ => None,
                }
            }

            pub fn describe(self) -> &'static str {
                match self {
                    $(Self::$kind => $what,)*
                }
            }
        }
    };
}

wait_kinds! {
    Semaphore = 1 => "a signal on semaphore",
    FifoSpace = 2 => "a free FIFO slot (is the proxy running?) in FIFO",
    FifoDrain = 3 => "the proxy to finish a trigger (flush) in FIFO",
    Packet = 4 => "an LL packet (index in `id`) with the expected flag",
    InvalidOffset = 5 => "nothing: an offset/size above 4 GiB was rejected on channel",
    LlDispatch = 6 =>
        "the low-latency dispatch data (buffer parity in `id`; expected: call count)",
    LlCombine = 7 =>
        "the low-latency combine data (buffer parity in `id`; expected: call count)",
    LlOverflow = 8 =>
        "nothing: a local expert got more rows than fit (its R*T slots, or a peer's \
         inbox: a peer out of step) (local expert in `id`; expected: room, observed: rows)",
    InvalidExpertId = 9 =>
        "nothing: an expert id outside [-1, num_experts) (token << 8 | column in `id`; \
         expected: num_experts, observed: the id)",
    IntranodeDispatch = 10 =>
        "an intranode dispatch record (fused kernel; slot in `id`; expected: the \
         call's flag, observed: the record's flag)",
    IntranodeCombine = 11 =>
        "an intranode combine record (fused kernel; slot in `id`; expected: the \
         call's flag, observed: the record's flag)",
    InternodeChunk = 12 =>
        "a chunk of the peer's cross-node stream (port-channel signal; chunk in `id`; \
         expected: chunks, observed: chunks landed)",
    InternodeLocal = 13 =>
        "this rank's own warps to fill a chunk of a cross-node stream (node << 32 | \
         chunk in `id`; expected: records, observed: records written)",
    InternodeForward = 14 =>
        "an internode combine row for the forwarder (source token in `id`; expected: \
         the call's flag, observed: the row's flag)",
    InternodePoisoned = 15 =>
        "an internode combine partial that its forwarder could complete (it timed out \
         waiting for a rank of its node and sent NaN; its own error names that rank) \
         (source node << 32 | slot in `id`; expected: the call's flag, observed: the \
         partial's flag)",
    IntranodeGate = 16 =>
        "this rank's own barrier block of a fused intranode kernel (block 0, which \
         signals and waits for every peer before the other senders write; expected: \
         1, observed: the gate)",
}

/// `comm::DeviceError`: the first failure of a kernel (host-mapped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct DeviceError {
    pub code: u32,
    pub kind: u32,
    pub rank: i32,
    pub peer: i32,
    pub id: u64,
    pub expected: u64,
    pub observed: u64,
}

/// `comm::SemaphoreDeviceHandle`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct SemaphoreDeviceHandle {
    pub inbound: u64,
    pub expected_inbound: u64,
    /// Unused (formerly the local count of signals sent): 0.
    pub reserved: u64,
    pub remote_inbound: u64,
    pub error: u64,
    pub rank: i32,
    pub peer: i32,
    pub id: u64,
}

/// `comm::ProxyTrigger`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct ProxyTrigger {
    pub fst: u64,
    pub snd: u64,
}

/// `comm::FifoDeviceHandle`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct FifoDeviceHandle {
    pub triggers: u64,
    pub head: u64,
    pub tail: u64,
    pub tail_replica: u64,
    pub error: u64,
    pub size: i32,
    pub rank: i32,
    pub id: u64,
}

/// `comm::PortChannelDeviceHandle`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct PortChannelDeviceHandle {
    pub fifo: FifoDeviceHandle,
    pub semaphore: SemaphoreDeviceHandle,
    pub channel: u32,
    pub dst_mem: u32,
    pub src_mem: u32,
    pub pad_: u32,
}

/// `comm::MemoryChannelDeviceHandle`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct MemoryChannelDeviceHandle {
    pub semaphore: SemaphoreDeviceHandle,
    pub dst: u64,
    pub src: u64,
    pub packets: u64,
}

// Same numbers as the static_asserts in the headers.
const _: () = {
    assert!(size_of::<DeviceError>() == 40);
    assert!(offset_of!(DeviceError, id) == 16);
    assert!(size_of::<SemaphoreDeviceHandle>() == 56);
    assert!(offset_of!(SemaphoreDeviceHandle, reserved) == 16);
    assert!(offset_of!(SemaphoreDeviceHandle, error) == 32);
    assert!(offset_of!(SemaphoreDeviceHandle, id) == 48);
    assert!(size_of::<ProxyTrigger>() == 16);
    assert!(size_of::<FifoDeviceHandle>() == 56);
    assert!(offset_of!(FifoDeviceHandle, size) == 40);
    assert!(size_of::<PortChannelDeviceHandle>() == 128);
    assert!(offset_of!(PortChannelDeviceHandle, semaphore) == 56);
    assert!(offset_of!(PortChannelDeviceHandle, channel) == 112);
    assert!(size_of::<MemoryChannelDeviceHandle>() == 80);
    assert!(offset_of!(MemoryChannelDeviceHandle, dst) == 56);
    assert!(offset_of!(MemoryChannelDeviceHandle, packets) == 72);
};

/// Trigger types (top 4 bits of `snd`).
pub mod trigger_type {
    pub const DATA: u64 = 1;
    pub const SIGNAL: u64 = 2;
    pub const FLUSH: u64 = 4;
    pub const ATOMIC_ADD64: u64 = 8;
    pub const ATOMIC_ADD32: u64 = 9;
}

/// A decoded trigger (see the layout comment in `fifo_device.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TriggerOp {
    /// Any combination of put (`size` bytes), signal and flush.
    Data {
        put: bool,
        signal: bool,
        flush: bool,
        channel: u32,
        dst_mem: u32,
        dst_offset: u64,
        src_mem: u32,
        src_offset: u64,
        size: u64,
    },
    AtomicAdd {
        wide: bool,
        channel: u32,
        dst_mem: u32,
        dst_offset: u64,
        value: i64,
    },
}

impl ProxyTrigger {
    /// The encoder the device uses (`make_data_trigger`), for host-side producers and tests.
    pub fn data(
        ty: u64,
        channel: u32,
        dst_mem: u32,
        dst_offset: u64,
        src_mem: u32,
        src_offset: u64,
        size: u64,
    ) -> Self {
        Self {
            fst: (size & 0xFFFF_FFFF) | ((src_offset & 0xFFFF_FFFF) << 32),
            snd: Self::snd(ty, channel, dst_mem, dst_offset) | (((src_mem & 0xFF) as u64) << 44),
        }
    }

    /// The encoder of `make_atomic_trigger`.
    pub fn atomic(ty: u64, channel: u32, dst_mem: u32, dst_offset: u64, value: i64) -> Self {
        Self {
            fst: value as u64,
            snd: Self::snd(ty, channel, dst_mem, dst_offset),
        }
    }

    fn snd(ty: u64, channel: u32, dst_mem: u32, dst_offset: u64) -> u64 {
        (dst_offset & 0xFFFF_FFFF)
            | (((channel & 0xFFF) as u64) << 32)
            | (((dst_mem & 0xFF) as u64) << 52)
            | (ty << 60)
    }

    pub fn decode(self) -> Option<TriggerOp> {
        let ty = self.snd >> 60;
        let channel = ((self.snd >> 32) & 0xFFF) as u32;
        let dst_mem = ((self.snd >> 52) & 0xFF) as u32;
        let dst_offset = self.snd & 0xFFFF_FFFF;
        match ty {
            1..=7 => Some(TriggerOp::Data {
                put: ty & trigger_type::DATA != 0,
                signal: ty & trigger_type::SIGNAL != 0,
                flush: ty & trigger_type::FLUSH != 0,
                channel,
                dst_mem,
                dst_offset,
                src_mem: ((self.snd >> 44) & 0xFF) as u32,
                src_offset: self.fst >> 32,
                size: self.fst & 0xFFFF_FFFF,
            }),
            8 | 9 => Some(TriggerOp::AtomicAdd {
                wide: ty == trigger_type::ATOMIC_ADD64,
                channel,
                dst_mem,
                dst_offset,
                value: self.fst as i64,
            }),
            _ => None,
        }
    }
}

/// What `comm_layout_probe` must write, in order (sizes, offsets, encoded triggers).
pub fn layout_probe_expected() -> Vec<u64> {
    let t = ProxyTrigger::data(
        trigger_type::DATA | trigger_type::SIGNAL,
        0xABC,
        0x12,
        0x89AB_CDEF,
        0x34,
        0x7654_3210,
        0xFEDC_BA98,
    );
    let a = ProxyTrigger::atomic(trigger_type::ATOMIC_ADD32, 7, 9, 0x1000, -5);
    let mut v = struct_layout![
        DeviceError {
            kind,
            rank,
            peer,
            id,
            expected,
            observed
        },
        SemaphoreDeviceHandle {
            expected_inbound,
            reserved,
            remote_inbound,
            error,
            rank,
            peer,
            id
        },
        ProxyTrigger {},
        FifoDeviceHandle {
            head,
            tail,
            tail_replica,
            error,
            size,
            rank,
            id
        },
        PortChannelDeviceHandle {
            semaphore,
            channel,
            dst_mem,
            src_mem
        },
        MemoryChannelDeviceHandle { dst, src, packets },
    ];
    v.extend([
        8,  // LL8Packet
        16, // LL16Packet
    ]);
    let mut out: Vec<u64> = v.iter().map(|&x| x as u64).collect();
    out.extend([t.fst, t.snd, a.fst, a.snd]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_round_trips() {
        let t = ProxyTrigger::data(7, 4095, 255, 0xFFFF_FFFF, 200, 0x1234_5678, 77);
        assert_eq!(
            t.decode(),
            Some(TriggerOp::Data {
                put: true,
                signal: true,
                flush: true,
                channel: 4095,
                dst_mem: 255,
                dst_offset: 0xFFFF_FFFF,
                src_mem: 200,
                src_offset: 0x1234_5678,
                size: 77
            })
        );
        let a = ProxyTrigger::atomic(trigger_type::ATOMIC_ADD64, 3, 5, 64, i64::MIN + 1);
        assert_eq!(
            a.decode(),
            Some(TriggerOp::AtomicAdd {
                wide: true,
                channel: 3,
                dst_mem: 5,
                dst_offset: 64,
                value: i64::MIN + 1
            })
        );
        assert!(ProxyTrigger::default().decode().is_none());
        // Every valid trigger has a non-zero snd (the "slot is full" marker).
        assert_ne!(
            ProxyTrigger::data(trigger_type::SIGNAL, 0, 0, 0, 0, 0, 0).snd,
            0
        );
    }
}
