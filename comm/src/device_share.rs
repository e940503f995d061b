//! Ranks that share one GPU: how many there are, and how many SMs one rank's
//! grids may use so that every rank's blocks are resident at once.
//!
//! Kernels of different ranks wait on each other (barriers, flags). Under MPS
//! the ranks' kernels run concurrently, but a grid that holds every SM while it
//! waits for a peer whose blocks cannot start deadlocks; without MPS the driver
//! time-slices the contexts, which is correct at any grid size but slow. So a
//! rank's grids never exceed its *share*: the SMs its context may use (MPS sets
//! that with `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read through
//! `cuCtxGetExecAffinity`), and at most the device's SMs, less one per rank
//! (for small kernels such as the proxy's remote atomics), divided by the
//! ranks on the device. Under an
//! MPS thread percentage the driver reports the limited count L as the device's
//! too, so the share is (L - ranks) / ranks: the clients' SM sets may overlap
//! (measured on one H200, 2 ranks at 50 %: grids of 66 one-block-per-SM blocks
//! deadlock, grids of 33 pass, and 66 pass without a limit).
//! `MOELINK_SMS_PER_RANK` lowers the context limit further. [`crate::Communicator`]
//! finds the co-located ranks by exchanging device UUIDs and host ids through
//! the bootstrap.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::error::{CommError, Result};

/// One rank's share of its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceShare {
    /// Ranks of the group on this rank's device (this one included), >= 1.
    pub ranks_on_device: usize,
    /// This rank's index among them (by rank order).
    pub index_on_device: usize,
    /// The device's SMs.
    pub device_sms: u32,
    /// The SMs this rank's context may use, where the driver limits it (MPS)
    /// or `MOELINK_SMS_PER_RANK` does (the smaller).
    pub context_sms: Option<u32>,
    /// Blocks of one SM-wide grid that fit beside every other rank's: the
    /// smaller of `context_sms` and `(device_sms - ranks_on_device) /
    /// ranks_on_device` where ranks share the device (one SM each left free),
    /// at least 0.
    pub sms: u32,
    /// The smallest `sms` of any rank of the group: grids whose size must be
    /// the same on every rank (allreduce's block-to-block channels) use this.
    pub group_sms: u32,
}

impl DeviceShare {
    /// The share of a rank alone on its device with all SMs.
    pub fn whole(device_sms: u32) -> Self {
        Self::new(device_sms, None, 1, 0)
    }

    pub fn new(
        device_sms: u32,
        context_sms: Option<u32>,
        ranks_on_device: usize,
        index_on_device: usize,
    ) -> Self {
        let ranks = ranks_on_device.max(1).min(u32::MAX as usize) as u32;
        // Ranks that share the device leave one SM each free for the small
        // kernels a rank issues while every rank's grid waits: the proxy's
        // remote atomics over CUDA IPC are one-thread kernels of the rank's
        // context. (A forced-proxy low-latency timeout at 4 x 33 blocks once
        // read as evidence for this; it was the ranks' drift against the time
        // bound, and the 8-rank one in docs/one-gpu.md hits 8 x 8 blocks too:
        // neither is a lack of SMs.)
        let reserve = if ranks > 1 { ranks } else { 0 };
        let even = device_sms.saturating_sub(reserve) / ranks;
        let sms = match context_sms {
            Some(c) if c > 0 => c.min(even),
            _ => even,
        };
        Self {
            ranks_on_device: ranks as usize,
            index_on_device,
            device_sms,
            context_sms,
            sms,
            group_sms: sms,
        }
    }

    /// Rank `me`'s share, from every rank's placement (host id, device UUID)
    /// and (device SMs, context SM limit), as exchanged at setup.
    pub fn of_group(
        placement: &[(u64, [u8; 16])],
        sm_counts: &[(u32, Option<u32>)],
        me: usize,
    ) -> Self {
        let share_of = |r: usize| {
            let peers = ranks_on_same_device(placement, r);
            let index = peers.iter().position(|&p| p == r).unwrap_or(0);
            let (sms, ctx) = sm_counts[r];
            Self::new(sms, ctx, peers.len(), index)
        };
        let mut s = share_of(me);
        s.group_sms = (0..placement.len())
            .map(|r| share_of(r).sms)
            .min()
            .unwrap_or(s.sms);
        s
    }

    /// Whether other ranks of the group use this device too.
    pub fn is_shared(&self) -> bool {
        self.ranks_on_device > 1
    }

    /// Errors unless every rank on the device can run grids of `min_blocks`
    /// (what `what` needs at least) with all ranks' blocks resident together.
    pub fn require(&self, what: &str, min_blocks: u32) -> Result<()> {
        if self.sms >= min_blocks.max(1) {
            return Ok(());
        }
        Err(CommError::invalid(
            "group",
            format!(
                "{} ranks share one GPU of {} SMs{}: each rank may use {} SMs, but {what} needs \
                 grids of at least {} blocks whose blocks are all resident with the other ranks'; \
                 use fewer ranks per GPU",
                self.ranks_on_device,
                self.device_sms,
                match self.context_sms {
                    Some(c) => format!(
                        " (this rank's context is limited to {c} by MPS or MOELINK_SMS_PER_RANK)"
                    ),
                    None => String::new(),
                },
                self.sms,
                min_blocks.max(1)
            ),
        ))
    }

    /// `requested` blocks, capped to the share (at least 1). A cap is logged
    /// once per `what` and process.
    pub fn cap(&self, what: &str, requested: u32) -> u32 {
        let limit = self.sms.max(1);
        if requested <= limit {
            return requested;
        }
        static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let first = LOGGED
            .lock()
            .map(|mut g| g.get_or_insert_with(HashSet::new).insert(what.to_string()))
            .unwrap_or(false);
        if first {
            tracing::warn!(
                "{what}: {requested} SMs asked, capped to {limit}: {} ranks share this GPU of {} \
                 SMs{}, and every rank's blocks must be resident together",
                self.ranks_on_device,
                self.device_sms,
                match self.context_sms {
                    Some(c) => format!(" (MPS or MOELINK_SMS_PER_RANK limits this context to {c})"),
                    None => String::new(),
                }
            );
        }
        limit
    }
}

/// (the device's SMs, the SM limit of this process's context): the driver's
/// (MPS) limit lowered by `MOELINK_SMS_PER_RANK`, None where neither limits
/// it. What every rank exchanges at setup, and what tools outside a
/// Communicator (the main job) start from.
pub fn local_sm_counts(device: crate::cuda::Device) -> Result<(u32, Option<u32>)> {
    let limit = sms_per_rank_from_env()?;
    let ctx = match (device.context_sm_count()?, limit) {
        (Some(c), Some(l)) => Some(c.min(l)),
        (c, l) => c.or(l),
    };
    Ok((device.sm_count()?.max(0) as u32, ctx))
}

/// `MOELINK_SMS_PER_RANK`: at most this many SMs per rank's grids (>= 1):
/// grids that leave SMs to other work, or smaller than a device partition the
/// driver does not report. Taken as part of the context's SM limit.
pub fn sms_per_rank_from_env() -> Result<Option<u32>> {
    Ok(crate::error::env_count("MOELINK_SMS_PER_RANK", "SMs")?
        .map(|n| n.min(u32::MAX as u64) as u32))
}

/// Ranks whose (host id, device UUID) equals `all[me]`'s, in rank order.
pub fn ranks_on_same_device(all: &[(u64, [u8; 16])], me: usize) -> Vec<usize> {
    all.iter()
        .enumerate()
        .filter(|(_, k)| **k == all[me])
        .map(|(r, _)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_is_the_even_split_or_the_mps_limit_whichever_is_smaller() {
        assert_eq!(DeviceShare::whole(132).sms, 132);
        // One SM per rank stays free where ranks share the device.
        assert_eq!(DeviceShare::new(132, None, 2, 0).sms, 65);
        assert_eq!(DeviceShare::new(132, None, 4, 0).sms, 32);
        assert_eq!(DeviceShare::new(132, None, 8, 3).sms, 15);
        // MPS at 25 %: 33 SMs; the split agrees.
        assert_eq!(DeviceShare::new(132, Some(33), 4, 0).sms, 32);
        // MPS limit above the split (oversubscribed percentages): the split wins.
        assert_eq!(DeviceShare::new(132, Some(66), 4, 0).sms, 32);
        // MPS limit below the split: the limit wins.
        assert_eq!(DeviceShare::new(132, Some(20), 2, 0).sms, 20);
        // A context that reports 0 (no affinity set) is ignored.
        assert_eq!(DeviceShare::new(132, Some(0), 2, 1).sms, 65);
        // More ranks than SMs: nothing fits.
        assert_eq!(DeviceShare::new(4, None, 8, 0).sms, 0);
        assert!(DeviceShare::new(132, None, 2, 0).is_shared());
        assert!(!DeviceShare::whole(132).is_shared());
    }

    #[test]
    fn require_names_the_group_and_the_numbers() {
        let s = DeviceShare::new(24, None, 8, 0);
        assert!(s.require("low-latency", 2).is_ok());
        let e = s.require("intranode", 4).unwrap_err().to_string();
        assert!(e.contains("8 ranks share one GPU of 24 SMs"), "{e}");
        assert!(e.contains("intranode"), "{e}");
        assert!(DeviceShare::new(4, None, 8, 0).require("x", 1).is_err());
    }

    #[test]
    fn cap_limits_to_the_share_and_never_to_zero() {
        let s = DeviceShare::new(132, None, 4, 0);
        assert_eq!(s.cap("t1", 20), 20);
        assert_eq!(s.cap("t1", 48), 32);
        assert_eq!(s.cap("t1", 48), 32);
        assert_eq!(DeviceShare::new(4, None, 8, 0).cap("t2", 5), 1);
    }

    #[test]
    fn group_share_is_the_smallest_of_any_rank() {
        // 3 ranks on 2 GPUs: ranks 0 and 2 share GPU a, rank 1 is alone on b.
        let a = (1u64, [1u8; 16]);
        let b = (1u64, [2u8; 16]);
        let placement = [a, b, a];
        let sms = [(132, None), (132, None), (132, None)];
        let s1 = DeviceShare::of_group(&placement, &sms, 1);
        assert_eq!((s1.sms, s1.group_sms, s1.ranks_on_device), (132, 65, 1));
        let s2 = DeviceShare::of_group(&placement, &sms, 2);
        assert_eq!((s2.sms, s2.group_sms, s2.index_on_device), (65, 65, 1));
        // An MPS limit on one rank lowers everybody's group share.
        let sms = [(132, Some(20)), (132, None), (132, None)];
        assert_eq!(DeviceShare::of_group(&placement, &sms, 1).group_sms, 20);
    }

    #[test]
    fn an_mps_limit_is_divided_by_the_ranks_too() {
        // Under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 an H200 client sees 66 SMs
        // as the device's and as its context's. The clients' SM sets may
        // overlap: measured, two 66-block grids (one block per SM) deadlock,
        // 33-block grids pass. So the share is (the limit - ranks) / the ranks.
        assert_eq!(DeviceShare::new(66, Some(66), 2, 0).sms, 32);
        // Without a limit (MPS at 100 %, or time-slicing): (SMs - ranks) / ranks.
        assert_eq!(DeviceShare::new(132, Some(132), 2, 1).sms, 65);
        // A limit of one rank (MPS or MOELINK_SMS_PER_RANK, as exchanged)
        // lowers its share and every rank's group share.
        let placement = [(1u64, [1u8; 16]), (1u64, [1u8; 16])];
        let sms = [(132, Some(20)), (132, None)];
        let s0 = DeviceShare::of_group(&placement, &sms, 0);
        let s1 = DeviceShare::of_group(&placement, &sms, 1);
        assert_eq!((s0.sms, s0.group_sms), (20, 20));
        assert_eq!((s1.sms, s1.group_sms), (65, 20));
    }

    #[test]
    fn co_located_ranks_match_host_and_uuid() {
        let a = (1u64, [1u8; 16]);
        let b = (1u64, [2u8; 16]);
        let c = (2u64, [1u8; 16]);
        let all = [a, b, a, c, a];
        assert_eq!(ranks_on_same_device(&all, 0), vec![0, 2, 4]);
        assert_eq!(ranks_on_same_device(&all, 1), vec![1]);
        assert_eq!(ranks_on_same_device(&all, 3), vec![3]);
    }
}
