//! The IB verbs transport (docs/ib.md): RDMA write, write with immediate and
//! 64-bit fetch-and-add over reliable-connected queue pairs, for peers on
//! other nodes.
//!
//! | module | what |
//! |---|---|
//! | [`config`] | `MOELINK_IB_*`: HCA list, GID index, signalling mode, MTU, SL / TC, queue pairs per peer |
//! | [`sys`] | `#[repr(C)]` mirrors of verbs.h, layouts asserted |
//! | [`verbs`] | libibverbs loaded at run time (dlopen), device discovery |
//! | [`device`] | the verbs as a Rust interface ([`device::RdmaProvider`], [`device::RdmaDevice`], ...) |
//! | [`native`] | that interface on libibverbs, inline verbs called through the context's ops table |
//! | [`fake`] | that interface on an in-memory loopback NIC, for CPU tests |
//! | [`qp`] | queue-pair endpoints and the RESET -> INIT -> RTR -> RTS attributes |
//! | [`imm`] | signals and adds as (immediate, record): `host-no-atomic`, 32-bit adds |
//! | [`wc`] | completion statuses and the errors they become |
//! | [`context`] | [`context::IbContext`]: device, port, registrations, connections, receiving proxy |
//! | [`connection`] | [`connection::IbConnection`]: the `Connection`: striping, signalling, completions |
//!
//! libibverbs is loaded at run time rather than linked (the `ibverbs` crate
//! links rdma-core at build time, so a wheel built with it would not import
//! where rdma-core is missing): docs/ib.md says why and what never ran
//! against a real NIC (none is available here); every line above [`native`]
//! runs in CPU tests against [`fake`].

pub mod config;
pub mod connection;
pub mod context;
pub mod device;
pub mod fake;
pub mod imm;
pub mod native;
pub mod qp;
pub mod sys;
pub mod verbs;
pub mod wc;

use crate::error::{CommError, Result};

/// `b`, a record rank `peer` sent, if it is `N` bytes long; else an `Rdma`
/// error naming `what` it should have been ("a queue pair endpoint").
fn fixed_record<'a, const N: usize>(b: &'a [u8], peer: usize, what: &str) -> Result<&'a [u8; N]> {
    b.try_into().map_err(|_| CommError::Rdma {
        peer,
        what: format!("{what} of {} bytes, expected {N}", b.len()),
    })
}

/// Why a Communicator without IB verbs cannot make an IB connection:
/// `NoRdma` (no library, no device, none allowed) or, where devices exist,
/// that this Communicator did not open one. Bad `MOELINK_IB_*` values fail
/// first, naming the variable.
pub fn connect_unavailable() -> CommError {
    match crate::transport::usable_rdma_devices() {
        Err(e) => e,
        Ok(devs) => CommError::invalid(
            "transport",
            format!(
                "IB verbs: RDMA devices {devs:?} are present, but this Communicator did not open \
                 one: its ranks are on one node, or MOELINK_TRANSPORT=ethernet, or some rank has \
                 no usable device (see the log)"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connecting_says_why_it_cannot() {
        // The one test here that touches MOELINK_IB_* (tests share a process).
        std::env::set_var("MOELINK_IB_MODE", "sometimes");
        let e = connect_unavailable().to_string();
        assert!(e.contains("MOELINK_IB_MODE"), "{e}");
        std::env::remove_var("MOELINK_IB_MODE");
        match connect_unavailable() {
            CommError::NoRdma { reason } => assert!(!reason.is_empty()),
            CommError::InvalidArgument { reason, .. } => {
                assert!(reason.contains("did not open"), "{reason}")
            }
            e => panic!("unexpected {e:?}"),
        }
    }
}
