//! The algorithm collection: what each algorithm is, which requests it can
//! serve (size, registration) and its default launch geometry.

use crate::args::MAX_BLOCKS;
use crate::module::Family;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduce,
    AllGather,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "allgather",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "allreduce" => Some(Collective::AllReduce),
            "allgather" => Some(Collective::AllGather),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Allreduce: every rank writes its input as LL16 packets to every peer and
    /// reduces all copies locally.
    OneShotLl,
    /// Allreduce: reduce-scatter + all-gather, both with LL16 packets.
    TwoShotLl,
    /// Allreduce: input copied into the registered scratch, read-reduce-scatter
    /// + all-gather over the peers' mapped scratch, results copied out.
    RsAg,
    /// Allreduce: as RsAg on the users' registered tensors (zero copy).
    RsAgZeroCopy,
    /// Allreduce: reduce-scatter by stores (every rank stores slice p of its
    /// input into rank p's scratch), local reduction, then all-gather by
    /// stores into the peers' registered output, or (an unregistered output)
    /// into the peers' scratch, copied out locally. Needs no registration.
    RsAgPush,
    /// Allgather: LL16 packets to every peer.
    AgLl,
    /// Allgather: every rank pulls every peer's chunk from its mapped buffer
    /// (the registered input, or a copy in the scratch).
    AgMesh,
}

/// What a request needs, for applicability checks and geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub world_size: usize,
    /// Largest message (allreduce) / output (allgather) in bytes: `max_bytes`.
    pub max_bytes: u64,
    /// Largest allreduce message of the LL algorithms (the LL region is sized for them).
    pub oneshot_max_bytes: u64,
    pub twoshot_max_bytes: u64,
    /// Largest per-rank input of ag_ll.
    pub allgather_ll_max_bytes: u64,
    /// Blocks a kernel may use: min(MAX_BLOCKS, SMs) (every block must be resident).
    pub max_blocks: u32,
}

/// One call, as the selector sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub collective: Collective,
    /// Allreduce: message bytes (per rank); allgather: input bytes per rank.
    pub nbytes: u64,
    /// The input tensor lies in a registered range (zero copy possible).
    pub registered: bool,
    /// A CUDA graph is being captured on the calling stream.
    pub capturing: bool,
}

impl Algorithm {
    pub const ALL: [Algorithm; 7] = [
        Algorithm::OneShotLl,
        Algorithm::TwoShotLl,
        Algorithm::RsAg,
        Algorithm::RsAgZeroCopy,
        Algorithm::RsAgPush,
        Algorithm::AgLl,
        Algorithm::AgMesh,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneShotLl => "oneshot_ll",
            Algorithm::TwoShotLl => "twoshot_ll",
            Algorithm::RsAg => "rsag",
            Algorithm::RsAgZeroCopy => "rsag_zc",
            Algorithm::RsAgPush => "rsag_push",
            Algorithm::AgLl => "ag_ll",
            Algorithm::AgMesh => "ag_mesh",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }

    pub fn collective(self) -> Collective {
        match self {
            Algorithm::AgLl | Algorithm::AgMesh => Collective::AllGather,
            _ => Collective::AllReduce,
        }
    }

    /// The algorithms of one collective, in the order the tuner tries them.
    pub fn of(c: Collective) -> impl Iterator<Item = Algorithm> {
        Self::ALL.into_iter().filter(move |a| a.collective() == c)
    }

    /// The allreduce kernel family (None for allgather algorithms).
    pub fn family(self) -> Option<Family> {
        match self {
            Algorithm::OneShotLl => Some(Family::OneShotLl),
            Algorithm::TwoShotLl => Some(Family::TwoShotLl),
            Algorithm::RsAg | Algorithm::RsAgZeroCopy | Algorithm::RsAgPush => Some(Family::RsAg),
            Algorithm::AgLl | Algorithm::AgMesh => None,
        }
    }

    /// Uses the LL packet region and the device call counter.
    pub fn is_ll(self) -> bool {
        matches!(
            self,
            Algorithm::OneShotLl | Algorithm::TwoShotLl | Algorithm::AgLl
        )
    }

    /// Synchronises with per-block semaphore barriers (needs the channel table).
    pub fn uses_barriers(self) -> bool {
        matches!(
            self,
            Algorithm::RsAg | Algorithm::RsAgZeroCopy | Algorithm::RsAgPush | Algorithm::AgMesh
        )
    }

    /// Ok if this algorithm can serve `req` under `limits`, else why not.
    pub fn applicable(self, req: &Request, limits: &Limits) -> Result<(), String> {
        if self.collective() != req.collective {
            return Err(format!(
                "{} is an {} algorithm, not {}",
                self.name(),
                self.collective().name(),
                req.collective.name()
            ));
        }
        let n = req.nbytes;
        let too_big = |cap: u64, what: &str| {
            Err(format!(
                "{} handles at most {cap} bytes ({what}), the message has {n}",
                self.name()
            ))
        };
        match self {
            Algorithm::OneShotLl if n > limits.oneshot_max_bytes => {
                too_big(limits.oneshot_max_bytes, "oneshot_max_bytes")
            }
            Algorithm::TwoShotLl if n > limits.twoshot_max_bytes => {
                too_big(limits.twoshot_max_bytes, "twoshot_max_bytes")
            }
            Algorithm::RsAg | Algorithm::RsAgPush if n > limits.max_bytes => {
                too_big(limits.max_bytes, "max_bytes")
            }
            Algorithm::RsAgZeroCopy if !req.registered => Err(
                "rsag_zc needs the input tensor registered (AllReduce.register) on every rank"
                    .into(),
            ),
            Algorithm::AgLl if n > limits.allgather_ll_max_bytes => too_big(
                limits.allgather_ll_max_bytes,
                "allgather_ll_max_bytes per rank",
            ),
            Algorithm::AgMesh if !req.registered && n > limits.max_bytes => {
                too_big(limits.max_bytes, "max_bytes per rank")
            }
            _ => Ok(()),
        }
    }

    /// (blocks, threads) this algorithm launches with by default for `req`.
    pub fn default_geometry(self, req: &Request, limits: &Limits) -> (u32, u32) {
        let nbytes = req.nbytes;
        let r = limits.world_size.max(1) as u64;
        let cap = limits.max_blocks.clamp(1, 64) as u64;
        let ll_capped = |work_packets: u64, cap: u64| {
            // One packet per thread, up to 512 threads per block.
            let threads = work_packets.div_ceil(32).clamp(1, 16) * 32;
            let blocks = work_packets.div_ceil(threads).clamp(1, cap);
            (blocks as u32, threads as u32)
        };
        let ll = |work_packets: u64| ll_capped(work_packets, cap);
        // Barrier kernels: each block streams >= 32 KiB of its slice per phase.
        let streaming = |bytes: u64| {
            let blocks = bytes.div_ceil(32 << 10).clamp(1, cap);
            (blocks as u32, 512)
        };
        match self {
            Algorithm::OneShotLl => ll(nbytes.div_ceil(8)),
            // Up to 128 blocks: benches/allreduce_geometry.py on 4 x H200
            // (2026-11-28), 1 MiB: 128 x 512 16.4 us, 64 x 512 18.6.
            Algorithm::TwoShotLl => ll_capped(
                r * nbytes.div_ceil(r).div_ceil(8),
                limits.max_blocks.clamp(1, 128) as u64,
            ),
            Algorithm::AgLl => ll(r * nbytes.div_ceil(8)),
            Algorithm::RsAg | Algorithm::RsAgZeroCopy => streaming(nbytes.div_ceil(r)),
            // A registered (in place: output) tensor takes the store all-gather,
            // which wants every block the GPU allows: one per 32 KiB of slice,
            // 1024 threads from 16 MiB slices. benches/allreduce_geometry.py on
            // 4 x H200 (2026-11-22), 1 GiB: 128 x 1024 4518 us, 64 x 1024 4667.
            // An unregistered one takes one block per 8 KiB of slice up to every
            // block, 1024 threads from 4 MiB slices. The same bench (2026-11-28,
            // unregistered, then with the all-gather by loads): 2 MiB 64 x 512
            // 19.4 us (128 x 512 19.9); 16 MiB 128 x 1024 88.3 (64 x 512 91.0);
            // 64 MiB 128 x 1024 326.2 (64 x 1024 328.8); 256 MiB 128 x 1024
            // 1244.7 (64 x 1024 1271.6). Beyond 256 MiB no unregistered size was
            // measured with the all-gather by stores; it follows the registered
            // path, which moves the same stores (the load all-gather had wanted
            // 64 blocks at 1 GiB: 4797 us against 5908 at 128).
            Algorithm::RsAgPush => {
                let slice = nbytes.div_ceil(r);
                // (slice bytes per block, slice size from which 1024 threads, most blocks)
                let (block_bytes, wide_from, cap) = if req.registered {
                    (32 << 10, 16 << 20, limits.max_blocks.max(1))
                } else {
                    (8 << 10, 4 << 20, limits.max_blocks.clamp(1, 128))
                };
                let blocks = slice.div_ceil(block_bytes).clamp(1, u64::from(cap));
                let threads = if slice >= wide_from { 1024 } else { 512 };
                (blocks as u32, threads)
            }
            Algorithm::AgMesh => streaming(nbytes),
        }
    }
}

/// `MAX_BLOCKS` as a u32 (blocks a kernel may use before the SM limit).
pub const MAX_BLOCKS_U32: u32 = MAX_BLOCKS as u32;

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn limits(r: usize) -> Limits {
        Limits {
            world_size: r,
            max_bytes: 64 << 20,
            oneshot_max_bytes: 512 << 10,
            twoshot_max_bytes: 8 << 20,
            allgather_ll_max_bytes: 512 << 10,
            max_blocks: 128,
        }
    }

    fn req(c: Collective, n: u64, registered: bool) -> Request {
        Request {
            collective: c,
            nbytes: n,
            registered,
            capturing: false,
        }
    }

    #[test]
    fn names_round_trip_and_collectives() {
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::parse(a.name()), Some(a));
        }
        assert_eq!(Algorithm::parse("ring"), None);
        assert_eq!(Algorithm::of(Collective::AllReduce).count(), 5);
        assert_eq!(Algorithm::of(Collective::AllGather).count(), 2);
    }

    #[test]
    fn applicability() {
        let l = limits(4);
        use Algorithm::*;
        use Collective::{AllGather as Ag, AllReduce as Ar};
        // (algorithm, collective, bytes, registered, applicable)
        let cases = [
            (OneShotLl, Ar, 512 << 10, false, true),
            (OneShotLl, Ar, (512 << 10) + 2, false, false),
            (TwoShotLl, Ar, 8 << 20, false, true),
            (TwoShotLl, Ar, (8 << 20) + 1, false, false),
            (RsAg, Ar, 64 << 20, false, true),
            (RsAg, Ar, (64 << 20) + 4, false, false),
            (RsAgPush, Ar, 64 << 20, false, true),
            (RsAgPush, Ar, (64 << 20) + 4, true, false),
            (RsAgZeroCopy, Ar, 1 << 20, true, true),
            (AgLl, Ag, 512 << 10, false, true),
            (AgLl, Ag, (512 << 10) + 1, false, false),
            (AgMesh, Ag, 64 << 20, false, true),
            (AgMesh, Ag, (64 << 20) + 1, false, false),
            (AgMesh, Ag, (64 << 20) + 1, true, true),
        ];
        for (a, c, n, registered, ok) in cases {
            let got = a.applicable(&req(c, n, registered), &l);
            assert_eq!(
                got.is_ok(),
                ok,
                "{a:?} {n} bytes, registered {registered}: {got:?}"
            );
        }
        let e = RsAgZeroCopy
            .applicable(&req(Ar, 1 << 20, false), &l)
            .unwrap_err();
        assert!(e.contains("register"), "{e}");
        let e = AgLl.applicable(&req(Ar, 1024, false), &l).unwrap_err();
        assert!(e.contains("allgather algorithm"), "{e}");
    }

    #[test]
    fn default_geometry_is_in_range() {
        for r in [1, 2, 4, 8] {
            let mut l = limits(r);
            for max_blocks in [1, 16, 128] {
                l.max_blocks = max_blocks;
                for a in Algorithm::ALL {
                    for n in [1u64, 2, 17, 1 << 10, 1 << 16, 1 << 20, 1 << 26, 1 << 30] {
                        for registered in [false, true] {
                            let q = req(a.collective(), n, registered);
                            let (b, t) = a.default_geometry(&q, &l);
                            assert!(b >= 1 && b <= max_blocks, "{a:?} {n}: {b} blocks");
                            assert!(t % 32 == 0 && (32..=1024).contains(&t), "{a:?} {n}: {t}");
                        }
                    }
                }
            }
        }
        use Algorithm::{OneShotLl, RsAgPush, TwoShotLl};
        let cases = [
            // Small LL messages use one small block.
            (OneShotLl, 1024, false, (1, 128)),
            // rsag_push: every block, registered or not.
            (RsAgPush, 1 << 30, true, (128, 1024)),
            (RsAgPush, 1 << 30, false, (128, 1024)),
            (RsAgPush, 256 << 20, false, (128, 1024)),
            (RsAgPush, 2 << 20, false, (64, 512)),
            // twoshot_ll: up to 128 blocks.
            (TwoShotLl, 1 << 20, false, (128, 512)),
            (RsAgPush, 16 << 20, true, (128, 512)),
        ];
        for (a, n, registered, want) in cases {
            let q = req(Collective::AllReduce, n, registered);
            let got = a.default_geometry(&q, &limits(4));
            assert_eq!(got, want, "{a:?} {n} bytes, registered {registered}");
        }
    }
}
