//! The checks of a Buffer's construction (`moelink.Buffer(...)`, the tch
//! `Buffer::new`) and of the SM count of its intranode calls
//! (`moelink.Config.num_sms`, `Buffer.set_num_sms`, the tch `num_sms`).

use super::{int_in, lim, value_err, ArgResult};
use crate::limits::{MAX_NUM_SMS, MIN_NUM_SMS};

/// What `moelink.Buffer(...)` checks of its arguments (DeepEP's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferArgs {
    /// Bytes of NVLink buffer (the intranode part; 0: none).
    pub num_nvl_bytes: i64,
    /// Bytes of low-latency buffer in `low_latency_mode` (> 0 there), else
    /// of the internode part's cross-node regions (needed where the group
    /// spans nodes, unused within one).
    pub num_rdma_bytes: i64,
    pub low_latency_mode: bool,
    /// DeepEP's RDMA queue pairs per rank: positive, otherwise unused.
    pub num_qps_per_rank: i64,
    /// Needs `low_latency_mode`.
    pub enable_shrink: bool,
}

impl Default for BufferArgs {
    /// DeepEP's defaults: no buffers, normal mode, 24 queue pairs.
    fn default() -> Self {
        BufferArgs {
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            num_qps_per_rank: 24,
            enable_shrink: false,
        }
    }
}

/// The parts a Buffer is made of (what `EpBufferOptions` takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferPlan {
    /// Bytes of the intranode part (0: none).
    pub num_nvl_bytes: u64,
    /// Bytes of the low-latency part (0: none): `num_rdma_bytes` in
    /// `low_latency_mode` (where it is positive).
    pub num_ll_bytes: u64,
    /// Bytes the intranode part adds for the cross-node regions where the
    /// group spans nodes: `num_rdma_bytes` whenever there is an intranode
    /// part (outside `low_latency_mode`, and in it with `num_nvl_bytes > 0`:
    /// one Buffer serving normal and low-latency calls across nodes, as
    /// SGLang's auto mode makes it; the two parts then have `num_rdma_bytes`
    /// each, apart, so that neither's calls disturb the other's memory).
    pub num_internode_bytes: u64,
}

/// Checks a Buffer's arguments, in the order of the Python constructor's:
/// both byte counts `>= 0`, `num_qps_per_rank` positive, the byte counts
/// multiples of 128, `enable_shrink` only with `low_latency_mode`,
/// `num_rdma_bytes > 0` in `low_latency_mode`. `num_rdma_bytes` sizes the
/// low-latency part in `low_latency_mode` and the internode part's
/// cross-node regions wherever there is an intranode part (as DeepEP's RDMA
/// buffer serves both): a `low_latency_mode` Buffer with `num_nvl_bytes > 0`
/// gets both.
pub fn buffer_options(a: &BufferArgs) -> ArgResult<BufferPlan> {
    let nvl = int_in("num_nvl_bytes", a.num_nvl_bytes, 0, i64::MAX)?;
    let rdma = int_in("num_rdma_bytes", a.num_rdma_bytes, 0, i64::MAX)?;
    int_in("num_qps_per_rank", a.num_qps_per_rank, 1, i64::MAX)?;
    for (name, v) in [("num_nvl_bytes", nvl), ("num_rdma_bytes", rdma)] {
        if v % 128 != 0 {
            return value_err(format!("{name} must be a multiple of 128, got {v}"));
        }
    }
    if a.enable_shrink && !a.low_latency_mode {
        return value_err("enable_shrink=True needs low_latency_mode=True".into());
    }
    if a.low_latency_mode && rdma == 0 {
        return value_err(
            "low_latency_mode=True needs num_rdma_bytes > 0 (the low-latency buffer); size it \
             with Buffer.get_low_latency_rdma_size_hint"
                .into(),
        );
    }
    let ll = if a.low_latency_mode { rdma } else { 0 };
    let internode = if !a.low_latency_mode || nvl > 0 {
        rdma
    } else {
        0
    };
    Ok(BufferPlan {
        num_nvl_bytes: nvl as u64,
        num_ll_bytes: ll as u64,
        num_internode_bytes: internode as u64,
    })
}

/// The SMs of intranode dispatch and combine (called `name`: `num_sms` of a
/// `Config`, `new_num_sms` of `Buffer.set_num_sms`): within
/// `1..=MAX_NUM_SMS`, and even, at least `MIN_NUM_SMS` (the kernels run one
/// sender and one receiver block per channel).
pub fn num_sms(name: &str, n: i64) -> ArgResult<i64> {
    let n = int_in(name, n, 1, lim(MAX_NUM_SMS))?;
    if n % 2 != 0 || n < lim(MIN_NUM_SMS) {
        return value_err(format!(
            "{name} must be even (SMs are used in pairs: one sender and one receiver block per \
             channel), got {n}"
        ));
    }
    Ok(n)
}

/// The intranode call whose default SM count [`default_num_sms`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmsCall {
    /// A dispatch, bf16 or fp8, cached or not.
    Dispatch,
    /// A combine whose input `x` the peers receive as records (the default
    /// kernels; with a receive pool, an `x` outside it).
    Combine,
    /// A combine whose `x` lies in the receive pool (`MOELINK_INTRANODE_RECV=direct`):
    /// the peers read it where it lies.
    CombineInPool,
}

/// The SM count of an intranode call where neither the call nor
/// `set_num_sms` names one: the smallest count that reached 95 % of the best
/// in the SM sweeps on 4 x H200 (`peer_bench.py`, 4096 tokens per rank, hidden
/// 7168, top-8 of 256; dispatch: the larger of the bf16 and fp8 counts). Two
/// ranks: 4 to 132 SMs on two of its GPUs (2026-11-28, before the row-once
/// senders). Four ranks: 8 to 96 SMs on all four, with the row-once senders
/// and the wide combine receivers (2026-11-28, later the same day). A group of
/// 3 or more ranks takes the 4-rank counts (8 ranks on one host were not
/// measured), 1 or 2 ranks the 2-rank ones.
pub fn default_num_sms(call: SmsCall, num_ranks: i64) -> i64 {
    let two = num_ranks <= 2;
    match call {
        // 2 ranks: bf16 reached 95 % at 48, fp8 at 64; 4 ranks: 24 and 48
        // (fp8: 345.5 GB/s at 32, 354.9 at 48, best 373.3 at 96).
        SmsCall::Dispatch if two => 64,
        SmsCall::Dispatch => 48,
        SmsCall::Combine if two => 48,
        // 4 ranks: 374.7 at 32, 395.3 at 48, best 396.1 at 64.
        SmsCall::Combine => 48,
        SmsCall::CombineInPool if two => 32,
        SmsCall::CombineInPool => 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::test_util::value;

    #[test]
    fn default_sms_are_valid_counts() {
        for call in [SmsCall::Dispatch, SmsCall::Combine, SmsCall::CombineInPool] {
            for ranks in 1..=32 {
                let n = default_num_sms(call, ranks);
                assert_eq!(num_sms("num_sms", n), Ok(n), "{call:?} at {ranks} ranks");
            }
        }
        // Reading x where it lies needs fewer SMs than receiving it as records.
        for ranks in [2, 4, 8] {
            assert!(
                default_num_sms(SmsCall::CombineInPool, ranks)
                    < default_num_sms(SmsCall::Combine, ranks)
            );
        }
    }

    fn args(change: impl FnOnce(&mut BufferArgs)) -> ArgResult<BufferPlan> {
        let mut a = BufferArgs::default();
        change(&mut a);
        buffer_options(&a)
    }

    #[test]
    fn buffer_options_accept_the_parts() {
        let none = BufferPlan {
            num_nvl_bytes: 0,
            num_ll_bytes: 0,
            num_internode_bytes: 0,
        };
        assert_eq!(buffer_options(&BufferArgs::default()), Ok(none));
        let both = args(|a| {
            a.num_nvl_bytes = 1 << 20;
            a.num_rdma_bytes = 1 << 30;
            a.low_latency_mode = true;
            a.enable_shrink = true;
        });
        assert_eq!(
            both,
            Ok(BufferPlan {
                num_nvl_bytes: 1 << 20,
                num_ll_bytes: 1 << 30,
                num_internode_bytes: 1 << 30,
            })
        );
        // Low-latency mode alone: no intranode part, so no cross-node regions.
        let ll_only = args(|a| {
            a.num_rdma_bytes = 1 << 30;
            a.low_latency_mode = true;
        });
        assert_eq!(
            ll_only,
            Ok(BufferPlan {
                num_nvl_bytes: 0,
                num_ll_bytes: 1 << 30,
                num_internode_bytes: 0,
            })
        );
    }

    #[test]
    fn buffer_options_name_the_argument() {
        // Each change to the default arguments, and the error it gives.
        type Change = fn(&mut BufferArgs);
        let refused: [(Change, &str); 6] = [
            (
                |a| a.num_nvl_bytes = -128,
                "num_nvl_bytes must be >= 0, got -128",
            ),
            (
                |a| a.num_rdma_bytes = -1,
                "num_rdma_bytes must be >= 0, got -1",
            ),
            (
                |a| a.num_qps_per_rank = 0,
                "num_qps_per_rank must be positive, got 0",
            ),
            (
                |a| a.num_nvl_bytes = 100,
                "num_nvl_bytes must be a multiple of 128, got 100",
            ),
            (
                |a| {
                    a.num_rdma_bytes = 129;
                    a.low_latency_mode = true;
                },
                "num_rdma_bytes must be a multiple of 128, got 129",
            ),
            (
                |a| a.enable_shrink = true,
                "enable_shrink=True needs low_latency_mode=True",
            ),
        ];
        for (change, message) in refused {
            value(args(change), message);
        }
        let e = args(|a| a.low_latency_mode = true).unwrap_err();
        assert!(
            e.message
                .starts_with("low_latency_mode=True needs num_rdma_bytes > 0"),
            "{e}"
        );
        // Outside low-latency mode num_rdma_bytes sizes the internode part.
        let p = args(|a| a.num_rdma_bytes = 128).unwrap();
        assert_eq!((p.num_ll_bytes, p.num_internode_bytes), (0, 128));
    }

    #[test]
    fn num_sms_is_even_and_within_the_limit() {
        assert_eq!(num_sms("num_sms", 2), Ok(2));
        assert_eq!(num_sms("num_sms", 1024), Ok(1024));
        value(num_sms("num_sms", 0), "num_sms must be positive, got 0");
        value(
            num_sms("num_sms", 1026),
            "num_sms must be <= 1024, got 1026",
        );
        value(
            num_sms("new_num_sms", 7),
            "new_num_sms must be even (SMs are used in pairs: one sender and one receiver \
             block per channel), got 7",
        );
        value(
            num_sms("num_sms", 1),
            "num_sms must be even (SMs are used in pairs: one sender and one receiver block \
             per channel), got 1",
        );
    }
}
