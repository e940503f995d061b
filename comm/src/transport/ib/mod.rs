//! The IB verbs transport (issue 18), in progress: what exists is everything
//! short of a NIC, CPU-tested: the environment ([`config`]), libibverbs loaded
//! at run time with device discovery ([`verbs`]), the completion errors
//! ([`wc`]), queue-pair endpoints and transition attributes ([`qp`]) and the
//! write-with-immediate encoding of the `host-no-atomic`
//! signalling mode ([`imm`]). Queue pairs, memory registration and the
//! connection itself come next; until then `Communicator::connect` with
//! `Transport::IbVerbs` fails with `NoRdma` or says that they are missing.
//! No line here has run against a real RDMA device (none is available).

pub mod config;
pub mod imm;
pub mod qp;
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

/// Why an IB verbs connection cannot be made here: `NoRdma` (no library, no
/// device, none allowed) or, where devices exist, that queue pairs are not
/// built yet. Bad `MOELINK_IB_*` values fail first, naming the variable.
pub fn connect_unavailable() -> CommError {
    match crate::transport::usable_rdma_devices() {
        Err(e) => e,
        Ok(devs) => CommError::invalid(
            "transport",
            format!(
                "IB verbs: RDMA devices {devs:?} are present, but this moelink does not build \
                 queue pairs yet (issue 18 in progress); use the Ethernet transport"
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
                assert!(reason.contains("queue pairs"), "{reason}")
            }
            e => panic!("unexpected {e:?}"),
        }
    }
}
