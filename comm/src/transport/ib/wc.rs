//! Work completions: the names of `enum ibv_wc_status` (rdma-core's verbs.h,
//! a stable ABI) and the error a failed completion becomes.

use crate::error::CommError;

/// `enum ibv_wc_status`, in order (IBV_WC_SUCCESS = 0).
const STATUS: [&str; 24] = [
    "success",
    "local length error",
    "local QP operation error",
    "local EE context operation error",
    "local protection error",
    "work request flushed (the queue pair is in the error state)",
    "memory window bind error",
    "bad response",
    "local access error",
    "remote invalid request",
    "remote access error (bad key, address or permission)",
    "remote operation error",
    "transport retry counter exceeded (the peer does not answer)",
    "RNR retry counter exceeded (the peer posted no receive)",
    "local RDD violation",
    "remote invalid RD request",
    "remote aborted",
    "invalid EE context number",
    "invalid EE context state",
    "fatal error",
    "response timeout",
    "general error",
    "tag matching error",
    "tag matching rendezvous incomplete",
];

/// The name of completion status `status`.
pub fn status_name(status: u32) -> String {
    STATUS
        .get(status as usize)
        .map(|s| s.to_string())
        .unwrap_or_else(|| format!("unknown status {status}"))
}

/// What a work request was, for the error of its failed completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkKind {
    Write,
    WriteWithImm,
    FetchAdd,
    Recv,
    /// The receiving proxy's RDMA write returning credits to the sender.
    Credit,
}

impl WorkKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkKind::Write => "RDMA write",
            WorkKind::WriteWithImm => "RDMA write with immediate",
            WorkKind::FetchAdd => "fetch-and-add",
            WorkKind::Recv => "receive",
            WorkKind::Credit => "credit return (RDMA write)",
        }
    }
}

/// The error of a completion with status `status` (non-zero): names the peer,
/// the work request (`detail`: its size, target, queue pair) and the NIC's
/// vendor code.
pub fn completion_error(
    peer: usize,
    kind: WorkKind,
    wr_id: u64,
    detail: &str,
    status: u32,
    vendor_err: u32,
) -> CommError {
    CommError::Rdma {
        peer,
        what: format!(
            "{} (work request {wr_id:#x}{}{detail}) completed with {} ({status}), vendor error \
             {vendor_err:#x}",
            kind.name(),
            if detail.is_empty() { "" } else { ": " },
            status_name(status)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_have_their_verbs_names() {
        assert_eq!(status_name(0), "success");
        assert!(status_name(5).contains("flushed"));
        assert!(status_name(10).starts_with("remote access error"));
        assert!(status_name(12).contains("retry counter exceeded"));
        assert_eq!(status_name(23), "tag matching rendezvous incomplete");
        assert_eq!(status_name(99), "unknown status 99");
    }

    #[test]
    fn a_failed_completion_names_peer_request_and_status() {
        let e = completion_error(3, WorkKind::FetchAdd, 0x2a, "8 bytes at 0x40", 10, 0x88);
        let e = e.to_string();
        assert!(
            e.starts_with(
                "RDMA to rank 3 failed: fetch-and-add (work request 0x2a: 8 bytes at 0x40)"
            ),
            "{e}"
        );
        assert!(
            e.contains("remote access error") && e.contains("(10)") && e.contains("0x88"),
            "{e}"
        );
    }
}
