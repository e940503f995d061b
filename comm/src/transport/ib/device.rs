//! The verbs moelink uses, as a small Rust interface: implemented by
//! libibverbs loaded at run time ([`super::native`]) and by an in-memory
//! loopback NIC for tests ([`super::fake`]). Everything above it (queue-pair
//! setup and transitions, striping, both signalling modes, completion polling
//! and error mapping, the receiving proxy) is the same code for both.
//!
//! Keys, addresses and immediates are plain integers here; the immediate is
//! in host byte order (the native side converts to and from the network
//! order of `imm_data`).

use std::sync::Arc;

use crate::error::Result;

use super::qp::{LinkLayer, Transition};

/// What a device can do (from `ibv_query_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// RDMA atomics (`atomic_cap != IBV_ATOMIC_NONE`).
    pub atomics: bool,
    /// Largest work queue.
    pub max_qp_wr: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// Physical ports (numbered from 1).
    pub ports: u8,
}

/// One port (from `ibv_query_port`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    pub active: bool,
    pub lid: u16,
    /// `enum ibv_mtu` (1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    pub link_layer: LinkLayer,
    /// Largest message, bytes.
    pub max_msg_size: u32,
}

/// What a memory registration covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MrSource {
    /// Host memory (`ibv_reg_mr`).
    Host { addr: u64, len: u64 },
    /// GPU memory exported as a dma-buf (`ibv_reg_dmabuf_mr`), addressed by
    /// peers at `iova` (its device pointer). The descriptor is borrowed.
    DmaBuf {
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
    },
    /// GPU memory by device pointer (`ibv_reg_mr`; needs the NVIDIA
    /// peer-memory kernel module).
    DevicePointer { addr: u64, len: u64 },
}

/// A local buffer of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// The remote side of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA write of the local buffer to `remote_addr`.
    Write { remote_addr: u64, rkey: u32 },
    /// RDMA write with immediate: as `Write`, then a receive completion
    /// carrying `imm` at the peer (consuming one posted receive).
    WriteImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    /// 64-bit fetch-and-add at `remote_addr` (8-byte aligned); the old value
    /// lands in the local buffer (8 bytes).
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

/// One send work request (always signalled: every one produces a completion).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub local: Sge,
    pub op: SendOp,
}

/// `enum ibv_wc_opcode` values a completion reports here.
pub mod opcode {
    pub use super::super::sys::WC_RECV_RDMA_WITH_IMM as RECV_RDMA_WITH_IMM;
    pub use super::super::sys::{WC_FETCH_ADD as FETCH_ADD, WC_RDMA_WRITE as RDMA_WRITE};
}

/// One work completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// `enum ibv_wc_status` (0: success; see [`super::wc`]).
    pub status: u32,
    /// `enum ibv_wc_opcode` (valid on success only).
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// The immediate of a write with immediate (host order).
    pub imm: Option<u32>,
    pub qp_num: u32,
}

/// Finds and opens RDMA devices.
pub trait RdmaProvider: Send + Sync + std::fmt::Debug {
    /// Every device's name (`NoRdma` where there is no library or device).
    fn device_names(&self) -> Result<Vec<String>>;
    /// Opens device `name` with one protection domain.
    fn open(&self, name: &str) -> Result<Arc<dyn RdmaDevice>>;
}

/// What a queue pair is created with (the `ibv_qp_init_attr` fields that
/// vary): its completion queues and how many work requests each of its
/// queues holds.
#[derive(Clone, Copy, Debug)]
pub struct QpInit<'a> {
    pub send_cq: &'a Arc<dyn RdmaCq>,
    pub recv_cq: &'a Arc<dyn RdmaCq>,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
}

/// An open device and its protection domain.
pub trait RdmaDevice: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &str;
    fn caps(&self) -> DeviceCaps;
    fn port(&self, port: u8) -> Result<PortAttr>;
    fn gid(&self, port: u8, index: u8) -> Result<[u8; 16]>;
    /// Registers memory with `access` (`qp::access` bits); deregistered when
    /// the returned region is dropped.
    fn register(&self, source: MrSource, access: u32) -> Result<Box<dyn RdmaMr>>;
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn RdmaCq>>;
    /// A reliable-connected queue pair in the RESET state.
    fn create_qp(&self, init: QpInit<'_>) -> Result<Box<dyn RdmaQp>>;
}

/// A registered memory region.
pub trait RdmaMr: Send + Sync + std::fmt::Debug {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

/// A completion queue.
pub trait RdmaCq: Send + Sync + std::fmt::Debug {
    /// Appends up to `max` completions to `out` (none: nothing completed).
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()>;
    /// For the device that made it (a queue pair takes its own kind of CQs).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A queue pair.
pub trait RdmaQp: Send + Sync + std::fmt::Debug {
    fn qp_num(&self) -> u32;
    /// One state transition (`ibv_modify_qp`).
    fn modify(&self, t: &Transition) -> Result<()>;
    fn post_send(&self, wr: &SendWr) -> Result<()>;
    /// Posts receives without buffers (what a write with immediate consumes).
    fn post_recv(&self, wr_ids: &[u64]) -> Result<()>;
}
