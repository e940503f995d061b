//! Launchers of the internode dispatch/combine kernels (`cuda/internode.cu`,
//! whose header comment has the design; namespace `moelink::internode`). The
//! receive side of a dispatch is intranode's fused receive half, run by a
//! receive-only launch of the same kernel as the send side
//! (`moelink::internode::dispatch`, [`internode_dispatch_recv`]): forwarded
//! records land in the same fixed slots as same-node ones. The host side is
//! `ep_core::internode`.

use comm::error::{CommError, Result};
use comm::StreamHandle;

use crate::intranode::{
    self as intra, CombineRecvArgs, CombineRecvParams, CombineSendArgs, CombineSendParams,
    DispatchFusedParams, DispatchSendParams, FusedGrid, FusedHalves, FusedState, IntranodeCtx,
    NotifyCommon, RecordLayout, RecvArgs, SendArgs,
};
use crate::module::{DeviceKernels, KernelId};

/// Most nodes a group may span (one coordinator warp per node and stream).
pub const MAX_NODES: usize = 16;
/// Most records per port-channel put (one polling lane per record).
pub const MAX_CHUNK: usize = 32;
/// Bytes of the notify staging rows (two halves, after the control region).
pub const STAGE_BYTES: u64 = intra::CTRL_BYTES;
/// Bytes of the `landed` words (`[2][MAX_NODES]` u64).
pub const LANDED_BYTES: u64 = 2 * MAX_NODES as u64 * 8;

/// `moelink::internode::XCtx`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct XCtx {
    /// The intranode context over the region (memory channels to this node's
    /// ranks only).
    pub c: IntranodeCtx,
    /// Device array of `R` `PortChannelDeviceHandle`s (zeroed for this node's ranks).
    pub ports: u64,
    /// `LANDED_BYTES` of device memory.
    pub landed: u64,
    pub stage_offset: u64,
    pub xsend_offset: u64,
    pub xrecv_offset: u64,
    pub fwd_offset: u64,
    pub psend_offset: u64,
    pub precv_offset: u64,
    /// Tokens per rank of the x regions.
    pub xslots: i64,
    /// Second dimension of `fwd_meta` (the dispatch's tokens per rank).
    pub meta_slots: i64,
    pub ranks_per_node: i32,
    pub num_nodes: i32,
    /// Records per port-channel put.
    pub chunk: i32,
    pub pad: i32,
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct XNotifyParams {
    x: XCtx,
    is_token_in_rank: u64,
    num_tokens_per_expert: u64,
    rank_prefix_matrix: u64,
    send_head: u64,
    node_head: u64,
    xcounts: u64,
    recv_rdma_rank_prefix_sum: u64,
    common: NotifyCommon,
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct XDispatchParams {
    x: XCtx,
    send: DispatchSendParams,
    xrec: RecordLayout,
    node_head: u64,
    xcounts: u64,
    fwd_meta: u64,
    calls: u64,
    error: u64,
    xslots_offset: i32,
    num_send_blocks: i32,
}

/// `moelink::internode::XDispatchLaunch`: the one parameter of the dispatch
/// kernel, whose two launches per call play one role each.
#[derive(Clone, Copy)]
#[repr(C)]
struct XDispatchLaunch {
    /// [`ROLE_SEND_SIDE`] or [`ROLE_RECV_HALF`].
    role: i32,
    pad: i32,
    args: XDispatchRoleArgs,
}

/// The argument block of the launch's role.
#[derive(Clone, Copy)]
#[repr(C)]
union XDispatchRoleArgs {
    send: XDispatchParams,
    recv: DispatchFusedParams,
}

/// `kDispatchSendSide`: senders, coordinator and forwarders.
const ROLE_SEND_SIDE: i32 = 0;
/// `kDispatchRecvHalf`: the fused dispatch's receive half alone.
const ROLE_RECV_HALF: i32 = 1;

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct XCombineParams {
    x: XCtx,
    send: CombineSendParams,
    recv: CombineRecvParams,
    recv_src_idx: u64,
    node_head: u64,
    xcounts: u64,
    fwd_meta: u64,
    calls: u64,
    error: u64,
    num_send_blocks: i32,
    num_fwd_blocks: i32,
}

param_layout!(
    PARAM_LAYOUT = {
        XCtx: 176 { xslots: 144 },
        XNotifyParams: 288 { recv_rdma_rank_prefix_sum: 224, num_tokens in common: 272 },
        XDispatchParams: 432 { send: 176, num_send_blocks: 428 },
        XDispatchLaunch: 440 { args: 8 },
        XCombineParams: 504 { recv: 304, num_send_blocks: 496 },
    }
);

/// A cross-node dispatch record: the NVL record's fields with global top-k
/// ids, then the `L` slots of the destination node's ranks, then the flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XRecordLayout {
    /// The cross-node record (its `bytes` include the slots and the flag).
    pub rec: RecordLayout,
    /// The NVL record it becomes at the forwarder.
    pub nvl: RecordLayout,
    /// Byte offset of the `L` int32 slots.
    pub slots_offset: i32,
}

impl XRecordLayout {
    /// The NVL record (what the receivers read).
    pub fn rec_nvl(&self) -> RecordLayout {
        self.nvl
    }

    pub fn new(nvl: &RecordLayout, ranks_per_node: usize) -> Result<Self> {
        let slots = nvl.src_offset as i64 + 4;
        let bytes = (slots + 4 * ranks_per_node as i64 + intra::FLAG_BYTES + 15) / 16 * 16;
        Ok(Self {
            rec: RecordLayout { bytes, ..*nvl },
            nvl: *nvl,
            slots_offset: i32::try_from(slots)
                .map_err(|_| CommError::invalid("hidden_bytes", "too large"))?,
        })
    }
}

fn check_x(x: &XCtx) -> Result<()> {
    intra::check_ctx(&x.c)?;
    let (r, l, n) = (
        x.c.num_ranks as usize,
        x.ranks_per_node as usize,
        x.num_nodes as usize,
    );
    if l == 0 || n == 0 || l * n != r || n > MAX_NODES {
        return Err(CommError::invalid(
            "ranks_per_node",
            format!("{n} nodes of {l} ranks for {r} ranks (at most {MAX_NODES} nodes)"),
        ));
    }
    if x.chunk < 1 || x.chunk as usize > MAX_CHUNK {
        return Err(CommError::invalid(
            "chunk",
            format!("{} records per put; 1 to {MAX_CHUNK}", x.chunk),
        ));
    }
    if x.ports == 0 || x.landed == 0 {
        return Err(CommError::invalid(
            "ports",
            "the port channels and the landed words are required",
        ));
    }
    Ok(())
}

/// The checks of a data kernel's launch: the context, the call counter and
/// the device error record it needs, and its `num_tokens` within the x
/// regions' slots (else `name` is refused: "... do not fit the buffer's N
/// `slots`").
fn check_data(
    x: &XCtx,
    calls: u64,
    error: u64,
    num_tokens: i32,
    name: &'static str,
    slots: &str,
) -> Result<()> {
    check_x(x)?;
    if calls == 0 || error == 0 {
        return Err(CommError::invalid(
            "calls",
            "the call counter and the device error record are required",
        ));
    }
    if num_tokens as i64 > x.xslots {
        return Err(CommError::invalid(
            name,
            format!(
                "{num_tokens} tokens do not fit the buffer's {} {slots}",
                x.xslots
            ),
        ));
    }
    Ok(())
}

/// Inputs and outputs of [`internode_notify`] (`intra::NotifyArgs` plus the
/// node heads and counts).
#[derive(Clone, Copy, Debug)]
pub struct XNotifyArgs {
    pub n: intra::NotifyArgs,
    /// Out: `[N_tok, nodes]` int32.
    pub node_head: u64,
    /// Out: `[2 * nodes]` int32.
    pub xcounts: u64,
    /// Out: `[nodes]` int32, or 0 (not written): entry m is the inclusive
    /// prefix sum over source nodes m' <= m of the tokens rank
    /// (m', this local rank) sends to this rank's node (`xcounts[nodes + m']`;
    /// for m' = this node, this rank's own tokens to its node). DeepEP's
    /// `recv_rdma_rank_prefix_sum`.
    pub recv_rdma_rank_prefix_sum: u64,
}

/// Launches `moelink::internode::notify`.
///
/// # Safety
/// As [`intra::dispatch_notify`]; `node_head`, `xcounts` and
/// `recv_rdma_rank_prefix_sum` (if not 0) valid for their sizes.
pub unsafe fn internode_notify(
    k: &DeviceKernels,
    stream: StreamHandle,
    x: XCtx,
    a: XNotifyArgs,
) -> Result<()> {
    check_x(&x)?;
    let n = &a.n;
    intra::check_notify(n, x.c.num_ranks, x.c.num_ranks + x.num_nodes)?;
    let p = XNotifyParams {
        x,
        is_token_in_rank: n.is_token_in_rank,
        num_tokens_per_expert: n.num_tokens_per_expert,
        rank_prefix_matrix: n.rank_prefix_matrix,
        send_head: n.send_head,
        node_head: a.node_head,
        xcounts: a.xcounts,
        recv_rdma_rank_prefix_sum: a.recv_rdma_rank_prefix_sum,
        common: intra::notify_common(n),
    };
    // SAFETY: XNotifyParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe { k.launch_params(KernelId::InternodeNotify, (1, 1), 1024, 0, stream, p) }
}

/// One signal to and one wait for every peer (memory channels in the node,
/// port channels across): `moelink::internode::cached_notify`, before a
/// cached dispatch and before a combine that follows a combine.
///
/// # Safety
/// The context's channels must be live.
pub unsafe fn internode_barrier(k: &DeviceKernels, stream: StreamHandle, x: XCtx) -> Result<()> {
    check_x(&x)?;
    // SAFETY: the kernel takes the XCtx by value.
    unsafe { k.launch_params(KernelId::InternodeCachedNotify, (1, 1), 32, 0, stream, x) }
}

/// The send side's grid: `send` blocks of senders, one coordinating block,
/// `fwd` blocks of forwarders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendGrid {
    pub send: u32,
    pub fwd: u32,
}

impl SendGrid {
    /// `blocks` (at least 2) split between senders and forwarders: the
    /// forwarders get the share of the cross-node records, (N - 1) / N.
    pub fn new(blocks: u32, num_nodes: u32) -> Self {
        let blocks = blocks.max(2);
        let fwd = (blocks as u64 * (num_nodes.max(1) as u64 - 1) / num_nodes.max(1) as u64) as u32;
        let fwd = fwd.clamp(1, blocks - 1);
        Self {
            send: blocks - fwd,
            fwd,
        }
    }
}

/// Arguments of [`internode_dispatch`].
#[derive(Clone, Copy, Debug)]
pub struct XDispatchArgs {
    pub send: SendArgs,
    pub xrec: XRecordLayout,
    /// `[N_tok, nodes]` int32.
    pub node_head: u64,
    /// `[2 * nodes]` int32.
    pub xcounts: u64,
    /// Out: `[nodes][xslots][1 + L]` int32.
    pub fwd_meta: u64,
    /// u64 call counter of the dispatch's send side (the receive half,
    /// [`internode_dispatch_recv`], has its own).
    pub calls: u64,
    pub error: u64,
    pub grid: SendGrid,
}

/// Launches the send side of a dispatch: senders, coordinators and forwarders
/// (`moelink::internode::dispatch` in its send role).
///
/// # Safety
/// As [`intra::DataKernel::DispatchSend`]; the x regions of every peer must be free
/// (after notify or a barrier) and the port channels' proxy running.
pub unsafe fn internode_dispatch(
    k: &DeviceKernels,
    stream: StreamHandle,
    x: XCtx,
    a: XDispatchArgs,
) -> Result<()> {
    let slots = "cross-node slots per node";
    check_data(&x, a.calls, a.error, a.send.num_tokens, "x", slots)?;
    let send = XDispatchParams {
        x,
        send: intra::send_params(x.c, &a.send)?,
        xrec: a.xrec.rec,
        node_head: a.node_head,
        xcounts: a.xcounts,
        fwd_meta: a.fwd_meta,
        calls: a.calls,
        error: a.error,
        xslots_offset: a.xrec.slots_offset,
        num_send_blocks: a.grid.send as i32,
    };
    let blocks = a.grid.send + 1 + a.grid.fwd;
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        launch_dispatch(
            k,
            stream,
            blocks,
            ROLE_SEND_SIDE,
            XDispatchRoleArgs { send },
        )
    }
}

/// Launches `moelink::internode::dispatch` on `blocks` blocks in `role`,
/// whose argument block is `args`' member of that role.
///
/// # Safety
/// `args` holds the member `role` names, checked, with pointers valid for
/// what that role's code does.
unsafe fn launch_dispatch(
    k: &DeviceKernels,
    stream: StreamHandle,
    blocks: u32,
    role: i32,
    args: XDispatchRoleArgs,
) -> Result<()> {
    let p = XDispatchLaunch { role, pad: 0, args };
    // SAFETY: XDispatchLaunch mirrors the kernel's parameter (its role says
    // which member the kernel reads); pointers are the caller's contract.
    unsafe { intra::launch_blocks(k, stream, KernelId::InternodeDispatch, blocks, p) }
}

/// Launches the receive half of a dispatch: `moelink::internode::dispatch`
/// in its receive role, which runs intranode's fused receive half alone on the
/// grid's receiving blocks (what a receive-only launch of
/// [`intra::dispatch_fused`] runs), usually on a side stream while the send
/// side runs.
///
/// # Safety
/// As [`intra::dispatch_fused`] with [`FusedHalves::Recv`].
pub unsafe fn internode_dispatch_recv(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    recv: RecvArgs,
    state: FusedState,
    grid: FusedGrid,
) -> Result<()> {
    let (blocks, recv) = intra::dispatch_fused_params(ctx, FusedHalves::Recv(recv), state, grid)?;
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        launch_dispatch(
            k,
            stream,
            blocks,
            ROLE_RECV_HALF,
            XDispatchRoleArgs { recv },
        )
    }
}

/// The combine's grid: senders, forward reducers, one coordinating block,
/// receivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineGrid {
    pub send: u32,
    pub fwd: u32,
    pub recv: u32,
}

impl CombineGrid {
    /// `blocks` (at least 3) with `recv_percent` % receiving; of the rest,
    /// the share (N - 1) / N reduces for forwarding.
    pub fn new(blocks: u32, recv_percent: u32, num_nodes: u32) -> Self {
        let blocks = blocks.max(3);
        let recv = (blocks * recv_percent.min(100) / 100).clamp(1, blocks - 2);
        let rest = SendGrid::new(blocks - recv, num_nodes);
        Self {
            send: rest.send,
            fwd: rest.fwd,
            recv,
        }
    }
}

/// Arguments of [`internode_combine`].
#[derive(Clone, Copy, Debug)]
pub struct XCombineArgs {
    pub send: CombineSendArgs,
    pub recv: CombineRecvArgs,
    /// `[rows]` int32.
    pub recv_src_idx: u64,
    pub node_head: u64,
    pub xcounts: u64,
    pub fwd_meta: u64,
    /// u64 combine call counter.
    pub calls: u64,
    pub error: u64,
    pub grid: CombineGrid,
}

/// Launches a whole combine (`moelink::internode::combine`).
///
/// # Safety
/// As [`intra::combine_fused`]; the combine regions of every peer must be
/// free and the port channels' proxy running.
pub unsafe fn internode_combine(
    k: &DeviceKernels,
    stream: StreamHandle,
    x: XCtx,
    a: XCombineArgs,
) -> Result<()> {
    let slots = "cross-node slots";
    check_data(&x, a.calls, a.error, a.recv.num_tokens, "handle", slots)?;
    let p = XCombineParams {
        x,
        send: intra::combine_send_params(x.c, &a.send),
        recv: intra::combine_recv_params(x.c, &a.recv)?,
        recv_src_idx: a.recv_src_idx,
        node_head: a.node_head,
        xcounts: a.xcounts,
        fwd_meta: a.fwd_meta,
        calls: a.calls,
        error: a.error,
        num_send_blocks: a.grid.send as i32,
        num_fwd_blocks: a.grid.fwd as i32,
    };
    let blocks = a.grid.send + a.grid.fwd + 1 + a.grid.recv;
    // SAFETY: XCombineParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe { intra::launch_blocks(k, stream, KernelId::InternodeCombine, blocks, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_blocks_match_the_kernels_static_asserts() {
        let cu = include_str!("../cuda/internode.cu");
        crate::check_static_asserts("internode.cu", cu, PARAM_LAYOUT);
        for line in [
            format!("constexpr int32_t kDispatchSendSide = {ROLE_SEND_SIDE};"),
            format!("constexpr int32_t kDispatchRecvHalf = {ROLE_RECV_HALF};"),
        ] {
            assert!(cu.contains(&line), "internode.cu lacks `{line}`");
        }
    }

    #[test]
    fn cross_node_records_end_in_slots_and_a_flag() {
        let nvl = RecordLayout::dispatch(14336, 0, 8).unwrap();
        let x = XRecordLayout::new(&nvl, 4).unwrap();
        assert_eq!(x.slots_offset, nvl.src_offset + 4);
        assert!(x.slots_offset as i64 + 16 + intra::FLAG_BYTES <= x.rec.bytes);
        assert_eq!(x.rec.bytes % 16, 0);
        assert_eq!(x.rec.idx_offset, nvl.idx_offset);
    }

    #[test]
    fn grids_split_by_node_share() {
        assert_eq!(SendGrid::new(12, 2), SendGrid { send: 6, fwd: 6 });
        assert_eq!(SendGrid::new(12, 4), SendGrid { send: 3, fwd: 9 });
        assert_eq!(SendGrid::new(2, 2), SendGrid { send: 1, fwd: 1 });
        assert_eq!(SendGrid::new(1, 2), SendGrid { send: 1, fwd: 1 });
        let g = CombineGrid::new(24, 50, 2);
        assert_eq!(g.recv, 12);
        assert_eq!(g.send + g.fwd, 12);
        let g = CombineGrid::new(3, 50, 2);
        assert_eq!((g.send, g.fwd, g.recv), (1, 1, 1));
    }
}
