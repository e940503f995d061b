//! `#[repr(C)]` mirrors of the libibverbs structures moelink passes to or
//! reads from the library, written from rdma-core's `libibverbs/verbs.h`
//! (read at rdma-core 65.0; these parts of the ABI have not changed since
//! libibverbs 1.1, and the sizes and offsets were also compared with the
//! header of Debian 12's rdma-core 44 by a C program: docs/ib.md). Every
//! size and every offset the code relies on is asserted below, on x86-64 and
//! aarch64 Linux (LP64: pointers and `size_t` are 8 bytes, `int` and enums 4).
//!
//! Structures the library allocates (`ibv_context`, `ibv_qp`, `ibv_cq`) are
//! mirrored only up to the last field read here; their tails (pthread types)
//! are never touched. `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are
//! static inline functions in verbs.h that call through `context->ops`; they
//! are called the same way here (see [`ContextOps`]).

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};

/// `union ibv_gid` (16 bytes; 8-byte aligned through its `__be64` view).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [u8; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    /// `enum ibv_atomic_cap`: [`ATOMIC_NONE`], HCA, GLOB.
    pub atomic_cap: u32,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `IBV_ATOMIC_NONE` of `enum ibv_atomic_cap`.
pub const ATOMIC_NONE: u32 = 0;

/// `struct ibv_port_attr` (56 bytes at rdma-core 65, 52 before
/// `active_speed_ex`; the exported `ibv_query_port` fills only its first 48
/// bytes, `struct _compat_ibv_port_attr`, and the caller zeroes the rest).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    pub active_speed_ex: u32,
}

/// `IBV_PORT_ACTIVE` of `enum ibv_port_state`.
pub const PORT_ACTIVE: u32 = 4;
/// `IBV_LINK_LAYER_INFINIBAND` / `_ETHERNET` (0: unspecified, reads as IB).
pub const LINK_LAYER_INFINIBAND: u8 = 1;
pub const LINK_LAYER_ETHERNET: u8 = 2;

/// `struct ibv_mr` (allocated by the library; read for the keys).
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut c_void,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_context_ops`: 32 function pointers; the three called are
/// typed, the rest kept as opaque slots so the offsets stay right.
#[repr(C)]
pub struct ContextOps {
    /// `_compat_query_device` .. `_compat_create_cq` (11 slots).
    pub _before_poll_cq: [*const c_void; 11],
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    /// `req_notify_cq` .. `_compat_destroy_qp` (13 slots).
    pub _before_post_send: [*const c_void; 13],
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    /// `_compat_create_ah` .. `_compat_async_event` (5 slots).
    pub _after: [*const c_void; 5],
}

/// `struct ibv_context`, up to its ops table (allocated by the library).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut c_void,
    pub ops: ContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

/// `struct ibv_cq`, its first field (allocated by the library).
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
}

/// `struct ibv_qp`, up to `qp_type` (allocated by the library).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `IBV_QPT_RC` of `enum ibv_qp_type`.
pub const QPT_RC: u32 = 2;

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `rdma` and `atomic` members of `ibv_send_wr`'s `wr` union, as one
/// struct: `rdma` is `remote_addr` at 0 and `rkey` at 8; `atomic` is
/// `remote_addr` at 0, `compare_add` at 8, `swap` at 16, `rkey` at 24. The
/// union is 32 bytes (its largest member, `atomic`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct WrUnion {
    pub remote_addr: u64,
    /// `rdma.rkey` (low half) for writes; `atomic.compare_add` for atomics.
    pub word1: u64,
    pub swap: u64,
    /// `atomic.rkey`.
    pub atomic_rkey: u32,
    pub _pad: u32,
}

/// `struct ibv_send_wr` (128 bytes; the `qp_type` and `bind_mw` / `tso`
/// unions after `wr` are unused by RC writes and atomics and stay zero).
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// `imm_data`, network byte order.
    pub imm_data: u32,
    pub wr: WrUnion,
    pub _qp_type: u32,
    pub _pad: u32,
    pub _bind_mw_or_tso: [u64; 6],
}

/// `enum ibv_wr_opcode` values used.
pub const WR_RDMA_WRITE: u32 = 0;
pub const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const WR_ATOMIC_FETCH_AND_ADD: u32 = 6;
/// `IBV_SEND_SIGNALED` of `enum ibv_send_flags`.
pub const SEND_SIGNALED: u32 = 1 << 1;

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network byte order) where `wc_flags` has [`WC_WITH_IMM`].
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `IBV_WC_WITH_IMM` of `enum ibv_wc_flags`.
pub const WC_WITH_IMM: u32 = 1 << 1;
/// `enum ibv_wc_opcode` values used.
pub const WC_RDMA_WRITE: u32 = 1;
pub const WC_FETCH_ADD: u32 = 4;
pub const WC_RECV_RDMA_WITH_IMM: u32 = (1 << 7) + 1;

/// Layout checks (LP64 Linux, little-endian: `WrUnion::word1` holds
/// `rdma.rkey` in its low half), against the offsets of verbs.h.
#[cfg(not(target_endian = "little"))]
compile_error!("the verbs mirrors assume a little-endian target");
const _: () = {
    assert!(size_of::<ibv_gid>() == 16);
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(offset_of!(ibv_device_attr, max_qp_wr) == 112);
    assert!(offset_of!(ibv_device_attr, max_cqe) == 132);
    assert!(offset_of!(ibv_device_attr, atomic_cap) == 164);
    assert!(offset_of!(ibv_device_attr, phys_port_cnt) == 227);
    assert!(size_of::<ibv_port_attr>() == 56);
    assert!(offset_of!(ibv_port_attr, active_mtu) == 8);
    assert!(offset_of!(ibv_port_attr, max_msg_sz) == 20);
    assert!(offset_of!(ibv_port_attr, lid) == 34);
    assert!(offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(offset_of!(ibv_port_attr, active_speed_ex) == 52);
    assert!(size_of::<ibv_mr>() == 48);
    assert!(offset_of!(ibv_mr, lkey) == 36);
    assert!(offset_of!(ibv_mr, rkey) == 40);
    assert!(size_of::<ContextOps>() == 32 * 8);
    assert!(offset_of!(ContextOps, poll_cq) == 11 * 8);
    assert!(offset_of!(ContextOps, post_send) == 25 * 8);
    assert!(offset_of!(ContextOps, post_recv) == 26 * 8);
    assert!(offset_of!(ibv_context, ops) == 8);
    assert!(offset_of!(ibv_context, cmd_fd) == 264);
    assert!(offset_of!(ibv_qp, context) == 0);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(offset_of!(ibv_qp, state) == 56);
    assert!(offset_of!(ibv_cq, context) == 0);
    assert!(size_of::<ibv_qp_cap>() == 20);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr, cap) == 32);
    assert!(offset_of!(ibv_qp_init_attr, qp_type) == 52);
    assert!(offset_of!(ibv_qp_init_attr, sq_sig_all) == 56);
    assert!(size_of::<ibv_global_route>() == 24);
    assert!(offset_of!(ibv_global_route, sgid_index) == 20);
    assert!(offset_of!(ibv_global_route, traffic_class) == 22);
    assert!(size_of::<ibv_ah_attr>() == 32);
    assert!(offset_of!(ibv_ah_attr, dlid) == 24);
    assert!(offset_of!(ibv_ah_attr, is_global) == 29);
    assert!(offset_of!(ibv_ah_attr, port_num) == 30);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(offset_of!(ibv_qp_attr, path_mtu) == 8);
    assert!(offset_of!(ibv_qp_attr, rq_psn) == 20);
    assert!(offset_of!(ibv_qp_attr, sq_psn) == 24);
    assert!(offset_of!(ibv_qp_attr, dest_qp_num) == 28);
    assert!(offset_of!(ibv_qp_attr, qp_access_flags) == 32);
    assert!(offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(offset_of!(ibv_qp_attr, pkey_index) == 120);
    assert!(offset_of!(ibv_qp_attr, max_rd_atomic) == 126);
    assert!(offset_of!(ibv_qp_attr, max_dest_rd_atomic) == 127);
    assert!(offset_of!(ibv_qp_attr, min_rnr_timer) == 128);
    assert!(offset_of!(ibv_qp_attr, port_num) == 129);
    assert!(offset_of!(ibv_qp_attr, timeout) == 130);
    assert!(offset_of!(ibv_qp_attr, retry_cnt) == 131);
    assert!(offset_of!(ibv_qp_attr, rnr_retry) == 132);
    assert!(offset_of!(ibv_qp_attr, rate_limit) == 136);
    assert!(size_of::<ibv_sge>() == 16);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(offset_of!(ibv_send_wr, num_sge) == 24);
    assert!(offset_of!(ibv_send_wr, opcode) == 28);
    assert!(offset_of!(ibv_send_wr, send_flags) == 32);
    assert!(offset_of!(ibv_send_wr, imm_data) == 36);
    assert!(offset_of!(ibv_send_wr, wr) == 40);
    assert!(size_of::<WrUnion>() == 32);
    assert!(offset_of!(WrUnion, atomic_rkey) == 24);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(offset_of!(ibv_recv_wr, num_sge) == 24);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(offset_of!(ibv_wc, status) == 8);
    assert!(offset_of!(ibv_wc, opcode) == 12);
    assert!(offset_of!(ibv_wc, vendor_err) == 16);
    assert!(offset_of!(ibv_wc, byte_len) == 20);
    assert!(offset_of!(ibv_wc, imm_data) == 24);
    assert!(offset_of!(ibv_wc, qp_num) == 28);
    assert!(offset_of!(ibv_wc, wc_flags) == 36);
};
