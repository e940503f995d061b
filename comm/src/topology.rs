//! [`Topology`]: where every rank of a group is and how this rank reaches it
//! (the internode path and the IB verbs transport build on it).
//!
//! Nodes are hosts (by host id, numbered in the order of their lowest rank), or,
//! with `MOELINK_RANKS_PER_NODE=n`, emulated nodes of n consecutive ranks inside
//! a host (to test internode paths on one machine, even on one GPU). A peer on
//! this rank's node whose GPU is this one, or one P2P (NVLink / PCIe) reaches,
//! is mapped: reached by memory channel. Any other peer goes through a port
//! channel (the CPU proxy) over the best transport: IB verbs where the caller
//! has them, else CUDA IPC issued by the proxy for a peer on this host (an
//! emulated node), else Ethernet.

use crate::error::{CommError, Result};
use crate::transport::Transport;

/// How this rank reaches one rank of the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// This rank itself.
    Local,
    /// Mapped: loads and stores through a memory channel.
    Memory,
    /// Through a port channel (the proxy) over this transport.
    Port(Transport),
}

/// One rank of the group, seen from this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Node index (0..num_nodes).
    pub node: usize,
    /// Index among the ranks of its node, in rank order.
    pub local_rank: usize,
    /// On this rank's host (an emulated node may be another node on it).
    pub same_host: bool,
    /// Uses this rank's GPU (ranks that share one GPU).
    pub shares_device: bool,
    /// P2P access from this rank's GPU to the peer's (always true when they
    /// share the GPU; false for other hosts). The Communicator asks the driver
    /// (cuDeviceCanAccessPeer) about the GPUs this process sees: a peer's GPU
    /// hidden by CUDA_VISIBLE_DEVICES counts as not reached.
    pub p2p: bool,
    pub reach: Reach,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    rank: usize,
    peers: Vec<Peer>,
    num_nodes: usize,
    /// Ranks of every node, in rank order.
    node_ranks: Vec<Vec<usize>>,
}

/// Where one rank runs: its host id and its GPU's UUID (zeros: no GPU).
pub type Placement = (u64, [u8; 16]);

impl Topology {
    /// The view of rank `rank` from every rank's placement. `p2p(peer)`: whether
    /// this rank's GPU can access that peer's (asked only for peers on this host
    /// with another GPU). `ranks_per_node`: emulated nodes (must divide the group
    /// and keep every node inside one host). `ib`: IB verbs reach other nodes.
    pub fn new(
        rank: usize,
        placement: &[Placement],
        mut p2p: impl FnMut(usize) -> bool,
        ranks_per_node: Option<usize>,
        ib: bool,
    ) -> Result<Self> {
        let size = placement.len();
        if rank >= size {
            return Err(CommError::invalid(
                "rank",
                format!("{rank} is not below the group size {size}"),
            ));
        }
        // Node of every rank.
        let node_of: Vec<usize> = match ranks_per_node {
            Some(n) => {
                if n == 0 || size % n != 0 {
                    return Err(CommError::invalid(
                        "MOELINK_RANKS_PER_NODE",
                        format!("{n} does not divide the group's {size} ranks"),
                    ));
                }
                for node in 0..size / n {
                    let hosts = &placement[node * n..(node + 1) * n];
                    if hosts.iter().any(|p| p.0 != hosts[0].0) {
                        return Err(CommError::invalid(
                            "MOELINK_RANKS_PER_NODE",
                            format!(
                                "emulated node {node} (ranks {}..{}) spans more than one host",
                                node * n,
                                (node + 1) * n
                            ),
                        ));
                    }
                }
                (0..size).map(|r| r / n).collect()
            }
            None => {
                let mut hosts: Vec<u64> = Vec::new();
                placement
                    .iter()
                    .map(|(h, _)| match hosts.iter().position(|x| x == h) {
                        Some(i) => i,
                        None => {
                            hosts.push(*h);
                            hosts.len() - 1
                        }
                    })
                    .collect()
            }
        };
        let num_nodes = node_of.iter().max().map_or(0, |m| m + 1);
        let mut node_ranks = vec![Vec::new(); num_nodes];
        for (r, &n) in node_of.iter().enumerate() {
            node_ranks[n].push(r);
        }
        let me = placement[rank];
        let peers = (0..size)
            .map(|r| {
                let node = node_of[r];
                let local_rank = node_ranks[node].iter().position(|&x| x == r).unwrap_or(0);
                let same_host = placement[r].0 == me.0;
                let shares_device = same_host && placement[r].1 == me.1;
                let p2p = shares_device || (same_host && r != rank && p2p(r));
                let reach = if r == rank {
                    Reach::Local
                } else if node == node_of[rank] && p2p {
                    Reach::Memory
                } else if ib && node != node_of[rank] {
                    Reach::Port(Transport::IbVerbs)
                } else if same_host {
                    Reach::Port(Transport::CudaIpc)
                } else {
                    Reach::Port(Transport::Ethernet)
                };
                Peer {
                    node,
                    local_rank,
                    same_host,
                    shares_device,
                    p2p,
                    reach,
                }
            })
            .collect();
        Ok(Self {
            rank,
            peers,
            num_nodes,
            node_ranks,
        })
    }

    /// Every rank on one GPU of one host (no GPU information: one device).
    pub fn single(rank: usize, size: usize) -> Self {
        Self::new(rank, &vec![(0, [0; 16]); size], |_| true, None, false).expect("rank below size")
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.peers.len()
    }

    pub fn peer(&self, r: usize) -> &Peer {
        &self.peers[r]
    }

    pub fn peers(&self) -> &[Peer] {
        &self.peers
    }

    pub fn num_nodes(&self) -> usize {
        self.num_nodes
    }

    pub fn node(&self) -> usize {
        self.peers[self.rank].node
    }

    pub fn local_rank(&self) -> usize {
        self.peers[self.rank].local_rank
    }

    /// Ranks of node `n`, in rank order.
    pub fn node_ranks(&self, n: usize) -> &[usize] {
        &self.node_ranks[n]
    }

    /// Ranks per node where every node has the same number of consecutive
    /// ranks (rank = node x n + local rank, as DeepEP's internode kernels
    /// assume); `None` otherwise.
    pub fn uniform_ranks_per_node(&self) -> Option<usize> {
        let n = self.node_ranks.first()?.len();
        let regular =
            self.node_ranks.iter().enumerate().all(|(i, rs)| {
                rs.len() == n && rs.iter().enumerate().all(|(j, &r)| r == i * n + j)
            });
        regular.then_some(n)
    }

    /// Whether every other rank is mapped (the intranode kernels' condition).
    pub fn all_mapped(&self) -> bool {
        self.peers
            .iter()
            .all(|p| matches!(p.reach, Reach::Local | Reach::Memory))
    }
}

/// `MOELINK_RANKS_PER_NODE`: split each host's ranks into emulated nodes of this
/// many consecutive ranks (>= 1); unset: nodes are hosts.
pub fn ranks_per_node_from_env() -> Result<Option<usize>> {
    Ok(crate::error::env_count("MOELINK_RANKS_PER_NODE", "ranks")?.map(|n| n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u8) -> [u8; 16] {
        [i + 1; 16]
    }

    /// `hosts` hosts of `per_host` ranks, one GPU per rank.
    fn cluster(hosts: usize, per_host: usize) -> Vec<Placement> {
        (0..hosts * per_host)
            .map(|r| ((r / per_host) as u64 + 100, gpu((r % per_host) as u8)))
            .collect()
    }

    #[test]
    fn two_hosts_of_four_gpus_with_nvlink() {
        let p = cluster(2, 4);
        for ib in [false, true] {
            let t = Topology::new(5, &p, |_| true, None, ib).unwrap();
            assert_eq!((t.num_nodes(), t.node(), t.local_rank()), (2, 1, 1));
            assert_eq!(t.node_ranks(0), &[0, 1, 2, 3]);
            assert_eq!(t.uniform_ranks_per_node(), Some(4));
            assert!(!t.all_mapped());
            assert_eq!(t.peer(5).reach, Reach::Local);
            assert_eq!(t.peer(4).reach, Reach::Memory);
            let far = t.peer(1);
            assert_eq!(
                (far.node, far.local_rank, far.same_host, far.p2p),
                (0, 1, false, false)
            );
            let want = if ib {
                Transport::IbVerbs
            } else {
                Transport::Ethernet
            };
            assert_eq!(far.reach, Reach::Port(want));
        }
    }

    #[test]
    fn one_host_without_p2p_goes_through_the_proxy() {
        let p = cluster(1, 4);
        let t = Topology::new(0, &p, |peer| peer == 1, None, true).unwrap();
        assert_eq!(t.num_nodes(), 1);
        assert_eq!(t.peer(1).reach, Reach::Memory);
        assert_eq!(t.peer(2).reach, Reach::Port(Transport::CudaIpc));
        assert!(!t.peer(2).p2p && t.peer(2).same_host);
        assert!(!t.all_mapped());
    }

    #[test]
    fn emulated_nodes_on_one_shared_gpu() {
        // 4 ranks on one GPU, 2 emulated nodes of 2: the other node goes
        // through the proxy (CUDA IPC), without IB (one host) or with it.
        let p = vec![(7, gpu(0)); 4];
        let asked = std::cell::Cell::new(0);
        let t = Topology::new(
            1,
            &p,
            |_| {
                asked.set(asked.get() + 1);
                true
            },
            Some(2),
            false,
        )
        .unwrap();
        assert_eq!(asked.get(), 0, "no P2P question for ranks on this GPU");
        assert_eq!((t.num_nodes(), t.node(), t.local_rank()), (2, 0, 1));
        assert_eq!(t.peer(0).reach, Reach::Memory);
        assert!(t.peer(0).shares_device);
        assert_eq!(t.peer(2).reach, Reach::Port(Transport::CudaIpc));
        assert_eq!((t.peer(3).node, t.peer(3).local_rank), (1, 1));
        assert_eq!(t.uniform_ranks_per_node(), Some(2));
        let t = Topology::new(1, &p, |_| true, Some(2), true).unwrap();
        assert_eq!(t.peer(2).reach, Reach::Port(Transport::IbVerbs));
    }

    #[test]
    fn bad_emulated_nodes_are_refused_naming_the_variable() {
        let p = cluster(2, 2);
        for (n, what) in [(3, "does not divide"), (0, "does not divide"), (4, "spans")] {
            let e = Topology::new(0, &p, |_| true, Some(n), false).unwrap_err();
            let s = e.to_string();
            assert!(
                s.contains("MOELINK_RANKS_PER_NODE") && s.contains(what),
                "{n}: {s}"
            );
        }
        assert!(Topology::new(4, &p, |_| true, None, false).is_err());
    }

    #[test]
    fn interleaved_hosts_are_not_uniform() {
        // Ranks alternate between two hosts: nodes exist, but rank != node x n + i.
        let p: Vec<Placement> = (0..4).map(|r| ((r % 2) as u64, gpu(r as u8 / 2))).collect();
        let t = Topology::new(0, &p, |_| true, None, false).unwrap();
        assert_eq!(t.num_nodes(), 2);
        assert_eq!(t.node_ranks(0), &[0, 2]);
        assert_eq!(t.peer(2).local_rank, 1);
        assert_eq!(t.uniform_ranks_per_node(), None);
    }

    #[test]
    fn single_is_all_mapped() {
        let t = Topology::single(2, 4);
        assert!(t.all_mapped());
        assert_eq!(t.num_nodes(), 1);
        assert!(t.peer(0).shares_device);
    }

    #[test]
    fn ranks_per_node_env_is_checked() {
        // One test touches the variable (tests run in threads of one process).
        std::env::remove_var("MOELINK_RANKS_PER_NODE");
        assert_eq!(ranks_per_node_from_env().unwrap(), None);
        std::env::set_var("MOELINK_RANKS_PER_NODE", " 4 ");
        assert_eq!(ranks_per_node_from_env().unwrap(), Some(4));
        for bad in ["0", "two", "-1"] {
            std::env::set_var("MOELINK_RANKS_PER_NODE", bad);
            let e = ranks_per_node_from_env().unwrap_err().to_string();
            assert!(e.contains("MOELINK_RANKS_PER_NODE"), "{e}");
        }
        std::env::remove_var("MOELINK_RANKS_PER_NODE");
    }
}
