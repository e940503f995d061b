//! [`NormalPart`]: the normal-mode half of an [`EpBuffer`] (layout, dispatch,
//! combine), whichever part serves it: the intranode part within one node, the
//! internode part where the group spans nodes. A front end calls these
//! methods and never picks the part itself; the internode part's extra inputs
//! (the internode handle's tensors, [`XInputs`]) are passed where a call has
//! them, and a call without them is refused on a group that spans nodes.

use comm::error::{CommError, Result};
use comm::StreamHandle;

use crate::ep_buffer::EpBuffer;
use crate::internode::{InternodeBuffer, XInputs};
use crate::intranode::{
    CombineArgs, DispatchInputs, DispatchOutputs, DispatchShape, IntranodeBuffer, LayoutCall,
};

/// The part of an [`EpBuffer`] that serves normal-mode calls.
pub enum NormalPart<'a> {
    Intranode(&'a mut IntranodeBuffer),
    Internode(&'a mut InternodeBuffer),
}

impl EpBuffer {
    /// The normal-mode part: the internode part where the group spans nodes,
    /// else the intranode part; None without either (a low-latency-only or
    /// destroyed Buffer).
    pub fn normal(&mut self) -> Option<NormalPart<'_>> {
        if self.internode().is_some() {
            return self.internode_mut().map(NormalPart::Internode);
        }
        self.intranode_mut().map(NormalPart::Intranode)
    }
}

/// The internode handle's tensors, which a group that spans nodes needs.
fn xnode(xi: Option<&XInputs>) -> Result<&XInputs> {
    xi.ok_or_else(|| {
        CommError::invalid(
            "handle",
            "a Buffer whose group spans nodes needs the internode handle tensors",
        )
    })
}

impl NormalPart<'_> {
    /// The layout kernel; `num_tokens_per_node` (internode only) is the
    /// per-node counts' device address.
    pub fn layout(
        &self,
        stream: StreamHandle,
        c: &LayoutCall,
        num_tokens_per_node: u64,
    ) -> Result<()> {
        match self {
            Self::Internode(b) => b.layout(stream, c, num_tokens_per_node),
            Self::Intranode(b) => b.layout(stream, c),
        }
    }

    /// Notify and the send half of a dispatch (`cached`: the handle's counts,
    /// no notify). Returns the epoch whose counts `wait_counts` waits for (0
    /// for a cached dispatch).
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch_send(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        xi: Option<&XInputs>,
        cached: bool,
        expert_alignment: usize,
        num_sms: u32,
    ) -> Result<u64> {
        match self {
            Self::Internode(b) if cached => {
                b.cached_dispatch_send(stream, shape, inp, xnode(xi)?, num_sms)?;
                Ok(0)
            }
            Self::Internode(b) => {
                b.dispatch_send(stream, shape, inp, xnode(xi)?, expert_alignment, num_sms)
            }
            Self::Intranode(b) if cached => {
                b.cached_dispatch_send(stream, shape, inp, num_sms)?;
                Ok(0)
            }
            Self::Intranode(b) => b.dispatch_send(stream, shape, inp, expert_alignment, num_sms),
        }
    }

    /// A whole combine; `recv_src_idx` (internode only) is the handle's.
    pub fn combine(
        &mut self,
        stream: StreamHandle,
        a: &CombineArgs,
        xi: Option<&XInputs>,
        recv_src_idx: u64,
        num_sms: u32,
    ) -> Result<()> {
        match self {
            Self::Internode(b) => b.combine(stream, a, xnode(xi)?, recv_src_idx, num_sms),
            Self::Intranode(b) => b.combine(stream, a, num_sms),
        }
    }
}

/// Methods that both parts have with the same arguments: each passes the call
/// to the part that serves.
macro_rules! either_part {
    ($(#[$doc:meta])* pub fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        impl NormalPart<'_> {
            $(#[$doc])*
            pub fn $name(&self $(, $arg: $ty)*) -> $ret {
                either_part!(@call self.$name($($arg),*))
            }
        }
        either_part!($($rest)*);
    };
    ($(#[$doc:meta])* pub fn $name:ident(&mut self $(, $arg:ident: $ty:ty)*) -> $ret:ty; $($rest:tt)*) => {
        impl NormalPart<'_> {
            $(#[$doc])*
            pub fn $name(&mut self $(, $arg: $ty)*) -> $ret {
                either_part!(@call self.$name($($arg),*))
            }
        }
        either_part!($($rest)*);
    };
    (@call $part:ident.$name:ident($($arg:ident),*)) => {
        match $part {
            Self::Internode(b) => b.$name($($arg),*),
            Self::Intranode(b) => b.$name($($arg),*),
        }
    };
    () => {};
}

either_part! {
    /// Bounded CPU wait for the counts of dispatch `epoch`: (received tokens,
    /// per-local-expert counts).
    pub fn wait_counts(&self, epoch: u64, num_experts: usize) -> Result<(usize, Vec<i32>)>;

    /// The receive half of a dispatch into `out`.
    pub fn dispatch_recv(
        &mut self, stream: StreamHandle, shape: &DispatchShape, rank_prefix_matrix: u64,
        out: &DispatchOutputs, num_sms: u32
    ) -> Result<()>;

    /// The SMs a dispatch or combine asked for `num_sms` holds.
    pub fn launch_sms(&self, num_sms: u32) -> u32;
}
