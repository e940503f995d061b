//! The argument types of [`Buffer`](crate::Buffer)'s calls that its checks
//! ([`crate::checks`]) and the CPU reference ([`crate::reference`]) take too:
//! a dispatch's `x` ([`DispatchX`]) and options ([`DispatchArgs`], with the
//! [`Layout`] they come from), a dispatch's [`Handle`] (with its
//! [`InternodeHandle`] where the group spans nodes), a combine's [`Bias`],
//! the low-latency [`LlHandle`], [`LlDispatchOptions`] and
//! [`LlCombineOptions`], and what a dispatch received ([`RecvX`]). They live
//! here, apart from the Buffer, so that `checks` and `reference` never import
//! `buffer` while `buffer` imports them (no file imports one that imports it
//! back). The crate root re-exports each of them.

use ep_core::calls::LlHandle as CoreLlHandle;
use ep_core::internode::XInputs;
use tch::Tensor;

use crate::event::StreamArgs;
use crate::tensor::{meta, ptr};

/// `x` of a dispatch: bf16 `[N, H]`, or fp8 data with its f32 scales
/// `[N, H / 128]` (any strided view; they come back in the same layout).
#[derive(Clone, Copy, Debug)]
pub enum DispatchX<'a> {
    Bf16(&'a Tensor),
    Fp8(&'a Tensor, &'a Tensor),
}

impl<'a> DispatchX<'a> {
    pub(crate) fn parts(self) -> (&'a Tensor, Option<&'a Tensor>) {
        match self {
            DispatchX::Bf16(x) => (x, None),
            DispatchX::Fp8(x, s) => (x, Some(s)),
        }
    }
}

/// What a dispatch received: `recv_x` (and its scales for fp8), as the
/// first element of `Buffer.dispatch`'s tuple.
#[derive(Debug)]
pub struct RecvX {
    pub x: Tensor,
    pub scales: Option<Tensor>,
}

/// `get_dispatch_layout`'s outputs.
#[derive(Debug)]
pub struct Layout {
    /// int32 `[R]`.
    pub num_tokens_per_rank: Tensor,
    /// int32 `[E]`.
    pub num_tokens_per_expert: Tensor,
    /// bool `[N, R]`.
    pub is_token_in_rank: Tensor,
    /// int32 `[nodes]`: tokens with an expert on a rank of each node, where
    /// the group spans nodes; None within one node (as in Python). A
    /// dispatch does not read it (its notify counts again).
    pub num_tokens_per_rdma_rank: Option<Tensor>,
}

/// A dispatch's handle: DeepEP's intranode 6-tuple, plus the entries of its
/// internode 10-tuple where the group spans nodes ([`Handle::internode`]).
/// Pass it to [`Buffer::combine`](crate::Buffer::combine) and to a cached
/// [`Buffer::dispatch_cached`](crate::Buffer::dispatch_cached).
#[derive(Debug)]
pub struct Handle {
    /// int32 `[R, R]`: cumulative tokens from ranks `0..=i` to rank `j`.
    pub rank_prefix_matrix: Tensor,
    /// int32 `[R, 1]` zeros (kept for DeepEP's shape).
    pub channel_prefix_matrix: Tensor,
    /// int32 `[R, 1]` zeros.
    pub recv_channel_prefix_matrix: Tensor,
    /// int32 `[rows]`: each received row's index on its source rank.
    pub recv_src_idx: Tensor,
    /// bool `[N, R]` (the layout's).
    pub is_token_in_rank: Tensor,
    /// int32 `[N, R]` (DeepEP's internode `send_nvl_head` position).
    pub send_head: Tensor,
    /// What an internode dispatch adds (the group spans nodes); None within
    /// one node.
    pub internode: Option<InternodeHandle>,
}

/// The entries of DeepEP's internode handle (10-tuple) that the intranode
/// [`Handle`] lacks. Those whose meaning does not depend on DeepEP's
/// channels hold DeepEP's values; the others are moelink's own state, kept
/// in the positions Python's 10-tuple keeps them (named below).
#[derive(Debug)]
pub struct InternodeHandle {
    /// int32 `[N, nodes]`: the node heads (10-tuple position 8,
    /// `send_rdma_head`).
    pub node_head: Tensor,
    /// int32 `[2 * nodes]`: the per-node counts (position 1,
    /// `rdma_channel_prefix_matrix`).
    pub xcounts: Tensor,
    /// int32 `[nodes, T, 1 + ranks per node]`: the forwarding records, `T`
    /// the tokens per rank the buffer fits for the dispatch's records
    /// (position 3, `recv_rdma_channel_prefix_matrix`).
    pub fwd_meta: Tensor,
    /// int32 `[nodes]`: DeepEP's `recv_rdma_rank_prefix_sum` (position 4).
    pub recv_rdma_rank_prefix_sum: Tensor,
    /// int32 `[R]`: DeepEP's `recv_gbl_rank_prefix_sum` (position 6), this
    /// rank's column of `rank_prefix_matrix` (a view of it).
    pub recv_gbl_rank_prefix_sum: Tensor,
}

impl InternodeHandle {
    /// The entries the kernels of a cached dispatch or a combine read.
    pub(crate) fn read(&self) -> impl Iterator<Item = &Tensor> {
        [&self.node_head, &self.xcounts, &self.fwd_meta].into_iter()
    }

    /// The entries a fresh dispatch writes.
    pub(crate) fn written(&self) -> impl Iterator<Item = &Tensor> {
        self.read().chain([&self.recv_rdma_rank_prefix_sum])
    }

    /// What the internode kernels read of it in a cached dispatch or a
    /// combine (`recv_rdma_rank_prefix_sum` is written by a fresh dispatch
    /// only, so it is left out).
    pub(crate) fn inputs(&self) -> XInputs {
        XInputs {
            node_head: ptr(Some(&self.node_head)),
            xcounts: ptr(Some(&self.xcounts)),
            fwd_meta: ptr(Some(&self.fwd_meta)),
            meta_slots: self
                .fwd_meta
                .size()
                .get(1)
                .map_or(0, |&s| s.max(0) as usize),
            recv_rdma_rank_prefix_sum: 0,
        }
    }
}

/// The optional arguments of [`Buffer::dispatch`](crate::Buffer::dispatch) (a dispatch without a
/// handle): the layout's tensors (from [`Buffer::get_dispatch_layout`](crate::Buffer::get_dispatch_layout)), the
/// routing, and the scalars, with Python's defaults.
#[derive(Clone, Copy, Debug)]
pub struct DispatchArgs<'a> {
    pub num_tokens_per_rank: Option<&'a Tensor>,
    pub is_token_in_rank: Option<&'a Tensor>,
    pub num_tokens_per_expert: Option<&'a Tensor>,
    pub topk_idx: Option<&'a Tensor>,
    pub topk_weights: Option<&'a Tensor>,
    /// Rounds each per-expert count up to a multiple (default 1).
    pub expert_alignment: i64,
    /// `> 0`: no CPU wait; outputs padded to this many rows (default 0).
    pub num_worst_tokens: i64,
    /// SMs of this call (the Python `config.num_sms`); None: the Buffer's.
    pub num_sms: Option<u32>,
    /// `previous_event`, `async_finish`, `allocate_on_comm_stream` (default:
    /// none of them).
    pub stream: StreamArgs<'a>,
}

impl<'a> DispatchArgs<'a> {
    /// A dispatch of `layout`'s routing with `topk_idx` and `topk_weights`,
    /// Python's defaults otherwise.
    pub fn new(layout: &'a Layout, topk_idx: &'a Tensor, topk_weights: Option<&'a Tensor>) -> Self {
        DispatchArgs {
            num_tokens_per_rank: Some(&layout.num_tokens_per_rank),
            is_token_in_rank: Some(&layout.is_token_in_rank),
            num_tokens_per_expert: Some(&layout.num_tokens_per_expert),
            topk_idx: Some(topk_idx),
            topk_weights,
            expert_alignment: 1,
            num_worst_tokens: 0,
            num_sms: None,
            stream: StreamArgs::default(),
        }
    }
}

/// `bias` of [`Buffer::combine`](crate::Buffer::combine): none, one bf16 `[N, H]` tensor, or a pair.
#[derive(Clone, Copy, Debug, Default)]
pub enum Bias<'a> {
    #[default]
    None,
    One(&'a Tensor),
    Pair(Option<&'a Tensor>, Option<&'a Tensor>),
}

impl<'a> Bias<'a> {
    /// `bias` as a pair (None, None for no bias).
    pub(crate) fn pair(self) -> (Option<&'a Tensor>, Option<&'a Tensor>) {
        match self {
            Bias::None => (None, None),
            Bias::One(b) => (Some(b), None),
            Bias::Pair(b0, b1) => (b0, b1),
        }
    }
}

/// A low-latency handle (`(src_info, layout_range, T, H, E)` in Python).
#[derive(Debug)]
pub struct LlHandle {
    /// int32 `[E_local, R*T]`: each received row's token index on its source.
    pub src_info: Tensor,
    /// int64 `[E_local, R]`: `(begin << 32) | count` of each source's block.
    pub layout_range: Tensor,
    pub num_max_dispatch_tokens_per_rank: i64,
    pub hidden: i64,
    pub num_experts: i64,
}

impl LlHandle {
    pub(crate) fn metas(&self) -> CoreLlHandle {
        CoreLlHandle {
            src_info: meta(&self.src_info),
            layout_range: meta(&self.layout_range),
            num_max_dispatch_tokens_per_rank: self.num_max_dispatch_tokens_per_rank,
            hidden: self.hidden,
            num_experts: self.num_experts,
        }
    }
}

/// The options of [`Buffer::low_latency_dispatch`](crate::Buffer::low_latency_dispatch) (Python's defaults:
/// fp8 with f32 scales).
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchOptions<'a> {
    /// int32 `[E_local]`, accumulates received tokens per local expert.
    pub cumulative_local_expert_recv_stats: Option<&'a Tensor>,
    /// int64 `[R]`, accumulates wait cycles per source rank.
    pub dispatch_wait_recv_cost_stats: Option<&'a Tensor>,
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
    /// Only issue the sends; the returned [`RecvHook`](crate::RecvHook) runs the receive half.
    pub return_recv_hook: bool,
    /// Run on the communication stream (after the current one) and return
    /// an event instead of ordering the current stream after the call; not
    /// with `return_recv_hook`.
    pub async_finish: bool,
}

impl Default for LlDispatchOptions<'_> {
    fn default() -> Self {
        Self {
            cumulative_local_expert_recv_stats: None,
            dispatch_wait_recv_cost_stats: None,
            use_fp8: true,
            round_scale: false,
            use_ue8m0: false,
            return_recv_hook: false,
            async_finish: false,
        }
    }
}

/// The options of [`Buffer::low_latency_combine`](crate::Buffer::low_latency_combine).
#[derive(Debug, Default)]
pub struct LlCombineOptions<'a> {
    /// The caller wrote `x` into the combine buffer
    /// ([`Buffer::get_next_low_latency_combine_buffer`](crate::Buffer::get_next_low_latency_combine_buffer)); `x` is not read.
    pub zero_copy: bool,
    /// Not supported by moelink (bf16 combine only): refused.
    pub use_logfmt: bool,
    /// bf16 `[N, H]` to write the result into.
    pub out: Option<&'a Tensor>,
    /// int64 `[R]`, accumulates wait cycles per source rank.
    pub combine_wait_recv_cost_stats: Option<&'a Tensor>,
    pub return_recv_hook: bool,
    /// As [`LlDispatchOptions::async_finish`].
    pub async_finish: bool,
}
