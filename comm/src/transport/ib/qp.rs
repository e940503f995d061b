//! Reliable-connected queue pairs, short of the NIC: what each side sends the
//! other through the bootstrap ([`QpEndpoint`]), and the attributes of the
//! RESET -> INIT -> RTR -> RTS transitions built from both sides and the
//! configuration ([`transitions`]), with the `ibv_qp_attr_mask` bits and the
//! values verbs.h defines, which [`super::device::RdmaQp::modify`] applies
//! (`ibv_modify_qp` natively; the fake NIC checks each transition's mask).

use crate::error::{CommError, Result};
use crate::wire::u32_at;

use super::config::IbConfig;
use super::fixed_record;

/// `enum ibv_qp_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
}

/// `enum ibv_qp_attr_mask` bits used here (values checked against
/// rdma-core's libibverbs/verbs.h).
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const AV: u32 = 1 << 7;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// `enum ibv_access_flags` bits used here.
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
    pub const REMOTE_READ: u32 = 4;
    pub const REMOTE_ATOMIC: u32 = 8;
}

/// A port's link layer (`IBV_LINK_LAYER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// Addressed by LID; a GRH only across subnets.
    InfiniBand,
    /// RoCE: every packet carries a GRH addressed by GID.
    Ethernet,
}

/// One side of a queue pair, as the other side needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    pub lid: u16,
    pub qp_num: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    pub gid: [u8; 16],
    /// The port's active MTU (`enum ibv_mtu`, 1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    pub link_layer: LinkLayer,
}

/// Bytes of a serialized [`QpEndpoint`].
pub const ENDPOINT_BYTES: usize = 32;
const PSN_MASK: u32 = 0x00FF_FFFF;

impl QpEndpoint {
    pub fn to_bytes(&self) -> [u8; ENDPOINT_BYTES] {
        let mut b = [0u8; ENDPOINT_BYTES];
        b[0..2].copy_from_slice(&self.lid.to_le_bytes());
        b[2] = self.active_mtu as u8;
        b[3] = match self.link_layer {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        };
        b[4..8].copy_from_slice(&self.qp_num.to_le_bytes());
        b[8..12].copy_from_slice(&self.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    /// `peer`: the rank it came from (named in errors).
    pub fn from_bytes(b: &[u8], peer: usize) -> Result<Self> {
        let b: &[u8; ENDPOINT_BYTES] = fixed_record(b, peer, "a queue pair endpoint")?;
        let bad = |what: String| CommError::Rdma { peer, what };
        let link_layer = match b[3] {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            x => return Err(bad(format!("a queue pair endpoint with link layer {x}"))),
        };
        let active_mtu = b[2] as u32;
        if !(1..=5).contains(&active_mtu) {
            return Err(bad(format!(
                "a queue pair endpoint with MTU code {active_mtu}"
            )));
        }
        let psn = u32_at(b, 8);
        if psn > PSN_MASK {
            return Err(bad(format!(
                "a packet sequence number {psn:#x} above 24 bits"
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Ok(Self {
            lid: u16::from_le_bytes([b[0], b[1]]),
            qp_num: u32_at(b, 4),
            psn,
            gid,
            active_mtu,
            link_layer,
        })
    }
}

/// The address of the remote side (`struct ibv_ah_attr`, the fields used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressVector {
    pub dlid: u16,
    pub sl: u8,
    pub port_num: u8,
    /// With a GRH (RoCE always): destination GID, our GID index, traffic class.
    pub grh: Option<Grh>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// One `ibv_modify_qp` call: the attributes set and their mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    pub state: QpState,
    pub mask: u32,
    pub port_num: u8,
    pub pkey_index: u16,
    pub access_flags: u32,
    pub path_mtu: u32,
    pub dest_qp_num: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub max_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub av: Option<AddressVector>,
}

impl Transition {
    fn new(state: QpState) -> Self {
        Self {
            state,
            mask: mask::STATE,
            port_num: 0,
            pkey_index: 0,
            access_flags: 0,
            path_mtu: 0,
            dest_qp_num: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_dest_rd_atomic: 0,
            max_rd_atomic: 0,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            av: None,
        }
    }
}

/// Outstanding RDMA reads / atomics per queue pair (both directions).
pub const RD_ATOMIC: u8 = 16;
/// Local ACK timeout exponent: 4.096 us x 2^14 ~ 67 ms per try.
pub const ACK_TIMEOUT: u8 = 14;
/// Transport retries before a completion fails with "retry counter exceeded".
pub const RETRY_COUNT: u8 = 7;
/// RNR retries; 7 means "retry forever" to the NIC, which would hang, so 6.
pub const RNR_RETRY: u8 = 6;
/// Minimal RNR NAK timer code 12 (0.64 ms).
pub const MIN_RNR_TIMER: u8 = 12;

/// The three transitions of a queue pair on port `port` towards `remote`: INIT
/// (port, access for remote writes and atomics), RTR (the remote's address and
/// QP number, path MTU = the smaller active MTU unless `MOELINK_IB_MTU` asks for
/// less), RTS (timeouts and retries). RoCE addresses by GID (a GRH with the
/// configured GID index and traffic class); InfiniBand by LID.
pub fn transitions(
    port: u8,
    local: &QpEndpoint,
    remote: &QpEndpoint,
    config: &IbConfig,
) -> Result<[Transition; 3]> {
    if local.link_layer != remote.link_layer {
        return Err(CommError::invalid(
            "transport",
            format!(
                "queue pair between a {:?} port and a {:?} port",
                local.link_layer, remote.link_layer
            ),
        ));
    }
    let mut init = Transition::new(QpState::Init);
    init.mask |= mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
    init.port_num = port;
    init.access_flags =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

    let mut path_mtu = local.active_mtu.min(remote.active_mtu);
    if let Some(m) = config.mtu.and_then(IbConfig::mtu_enum) {
        path_mtu = path_mtu.min(m);
    }
    let grh = (local.link_layer == LinkLayer::Ethernet).then_some(Grh {
        dgid: remote.gid,
        sgid_index: config.gid_index,
        hop_limit: 255,
        traffic_class: config.traffic_class,
    });
    let mut rtr = Transition::new(QpState::Rtr);
    rtr.mask |= mask::AV
        | mask::PATH_MTU
        | mask::DEST_QPN
        | mask::RQ_PSN
        | mask::MAX_DEST_RD_ATOMIC
        | mask::MIN_RNR_TIMER;
    rtr.path_mtu = path_mtu;
    rtr.dest_qp_num = remote.qp_num;
    rtr.rq_psn = remote.psn & PSN_MASK;
    rtr.max_dest_rd_atomic = RD_ATOMIC;
    rtr.min_rnr_timer = MIN_RNR_TIMER;
    rtr.av = Some(AddressVector {
        dlid: remote.lid,
        sl: config.service_level,
        port_num: port,
        grh,
    });

    let mut rts = Transition::new(QpState::Rts);
    rts.mask |=
        mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::SQ_PSN | mask::MAX_QP_RD_ATOMIC;
    rts.sq_psn = local.psn & PSN_MASK;
    rts.timeout = ACK_TIMEOUT;
    rts.retry_cnt = RETRY_COUNT;
    rts.rnr_retry = RNR_RETRY;
    rts.max_rd_atomic = RD_ATOMIC;
    Ok([init, rtr, rts])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(qp: u32, mtu: u32, ll: LinkLayer) -> QpEndpoint {
        QpEndpoint {
            lid: 0x10 + qp as u16,
            qp_num: qp,
            psn: 0x00AB_CDEF ^ qp,
            gid: [qp as u8; 16],
            active_mtu: mtu,
            link_layer: ll,
        }
    }

    #[test]
    fn mask_bits_are_verbs_h_values() {
        // The ones easy to mix up: PATH_MTU is bit 8 (bit 18 is PATH_MIG_STATE).
        assert_eq!(mask::PATH_MTU, 0x100);
        assert_eq!(mask::DEST_QPN, 0x10_0000);
        assert_eq!(mask::MAX_DEST_RD_ATOMIC, 0x2_0000);
        let all = [
            mask::STATE,
            mask::ACCESS_FLAGS,
            mask::PKEY_INDEX,
            mask::PORT,
            mask::AV,
            mask::PATH_MTU,
            mask::TIMEOUT,
            mask::RETRY_CNT,
            mask::RNR_RETRY,
            mask::RQ_PSN,
            mask::MAX_QP_RD_ATOMIC,
            mask::MIN_RNR_TIMER,
            mask::SQ_PSN,
            mask::MAX_DEST_RD_ATOMIC,
            mask::DEST_QPN,
        ];
        assert_eq!(
            all.iter().fold(0, |a, b| a | b).count_ones() as usize,
            all.len()
        );
    }

    #[test]
    fn endpoints_round_trip_and_are_checked() {
        let e = ep(77, 5, LinkLayer::Ethernet);
        assert_eq!(QpEndpoint::from_bytes(&e.to_bytes(), 1).unwrap(), e);
        let mut bad = e.to_bytes();
        bad[3] = 9;
        assert!(QpEndpoint::from_bytes(&bad, 1)
            .unwrap_err()
            .to_string()
            .contains("rank 1"));
        let mut bad = e.to_bytes();
        bad[2] = 6;
        assert!(QpEndpoint::from_bytes(&bad, 1).is_err());
        let mut bad = e.to_bytes();
        bad[11] = 1; // psn above 24 bits
        assert!(QpEndpoint::from_bytes(&bad, 1).is_err());
        assert!(QpEndpoint::from_bytes(&[0; 31], 1).is_err());
    }

    #[test]
    fn roce_transitions_address_by_gid_with_the_configured_class() {
        let cfg = IbConfig {
            gid_index: 3,
            traffic_class: 106,
            service_level: 2,
            ..IbConfig::default()
        };
        let (l, r) = (ep(1, 5, LinkLayer::Ethernet), ep(2, 3, LinkLayer::Ethernet));
        let [init, rtr, rts] = transitions(1, &l, &r, &cfg).unwrap();
        assert_eq!((init.state, init.port_num), (QpState::Init, 1));
        assert_eq!(
            init.mask,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS
        );
        assert_ne!(init.access_flags & access::REMOTE_ATOMIC, 0);
        assert_eq!(rtr.state, QpState::Rtr);
        assert_eq!(rtr.path_mtu, 3, "the smaller active MTU");
        assert_eq!((rtr.dest_qp_num, rtr.rq_psn), (2, r.psn));
        let av = rtr.av.unwrap();
        assert_eq!((av.sl, av.port_num), (2, 1));
        let grh = av.grh.unwrap();
        assert_eq!(
            (grh.dgid, grh.sgid_index, grh.traffic_class),
            ([2; 16], 3, 106)
        );
        assert_ne!(rtr.mask & mask::AV, 0);
        assert_eq!(rts.state, QpState::Rts);
        assert_eq!(rts.sq_psn, l.psn);
        assert!(rts.rnr_retry < 7, "7 would retry forever");
        assert_ne!(rts.mask & mask::SQ_PSN, 0);
    }

    #[test]
    fn infiniband_addresses_by_lid_and_the_mtu_setting_caps_the_path() {
        let cfg = IbConfig {
            mtu: Some(1024),
            ..IbConfig::default()
        };
        let (l, r) = (
            ep(5, 5, LinkLayer::InfiniBand),
            ep(6, 5, LinkLayer::InfiniBand),
        );
        let [_, rtr, _] = transitions(2, &l, &r, &cfg).unwrap();
        assert_eq!(rtr.path_mtu, 3);
        let av = rtr.av.unwrap();
        assert_eq!((av.dlid, av.grh), (r.lid, None));
        let e = transitions(1, &l, &ep(7, 5, LinkLayer::Ethernet), &cfg).unwrap_err();
        assert!(e.to_string().contains("queue pair between"), "{e}");
    }
}
