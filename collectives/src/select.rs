//! Picking an algorithm and launch geometry for a call: a user's pin, else a
//! tuned table (winners per power-of-two size, measured on the machine by the
//! Python tuner and agreed across ranks), else size thresholds.
//!
//! Every rank must pick the same algorithm for the same call (the kernels of
//! different algorithms do not talk to each other): the choice depends only
//! on the request (size, registration, capture), the limits and the table,
//! which are the same on every rank.

use std::collections::HashMap;

use comm::{CommError, Result};

use crate::algorithm::{Algorithm, Collective, Limits, Request};

/// An algorithm and its launch geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub algorithm: Algorithm,
    pub num_blocks: u32,
    pub num_threads: u32,
}

/// The power-of-two bucket of a size: `ceil(log2(nbytes))` (0 for 0 and 1).
/// The tuner measures 2^k bytes; sizes in (2^(k-1), 2^k] use its winner.
pub fn bucket(nbytes: u64) -> u32 {
    if nbytes <= 1 {
        0
    } else {
        64 - (nbytes - 1).leading_zeros()
    }
}

/// Key of a tuned entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableKey {
    pub collective: Collective,
    /// Measured inside a CUDA graph (vs eager launches).
    pub graph: bool,
    /// Measured with registered tensors (zero-copy algorithms competing).
    pub registered: bool,
    pub log2_bytes: u32,
}

/// The tuner's winners.
#[derive(Clone, Debug, Default)]
pub struct TunedTable {
    entries: HashMap<TableKey, Choice>,
}

impl TunedTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, key: TableKey, choice: Choice) {
        self.entries.insert(key, choice);
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries sorted by key (collective, graph, registered, size).
    pub fn entries(&self) -> Vec<(TableKey, Choice)> {
        let mut v: Vec<_> = self.entries.iter().map(|(k, c)| (*k, *c)).collect();
        v.sort_by_key(|(k, _)| (k.collective.name(), k.graph, k.registered, k.log2_bytes));
        v
    }

    /// The tuned choice for `req`: the entry measured in the same conditions,
    /// else (for a registered request) the one measured without registration.
    pub fn lookup(&self, req: &Request) -> Option<Choice> {
        let key = |registered| TableKey {
            collective: req.collective,
            graph: req.capturing,
            registered,
            log2_bytes: bucket(req.nbytes),
        };
        self.entries
            .get(&key(req.registered))
            .or_else(|| {
                req.registered
                    .then(|| self.entries.get(&key(false)))
                    .flatten()
            })
            .copied()
    }
}

/// Largest allreduce message (bytes) for which one-shot LL is the default:
/// it moves (R - 1) x 2 x the message per rank, so the crossover to two-shot
/// falls as R grows. Guesses until the tuner has measured the machine.
pub fn oneshot_threshold(world_size: usize) -> u64 {
    match world_size {
        0..=2 => 256 << 10,
        3..=4 => 128 << 10,
        _ => 32 << 10,
    }
}

/// Largest allreduce message for which two-shot LL is the default; above it
/// rsag_push, registered or not. Measured on 4 x H200 (2026-11-28, graphs,
/// two runs): 1 MiB twoshot_ll 16.1 / 17.8 us, rsag_push 14.3 / 14.6
/// (registered 14.8 / 15.5), rsag_zc 17.0 / 17.3; 2 MiB registered rsag_push
/// 17.5 / 19.0, rsag_zc 19.4 / 20.4. (rsag_zc stays for pins and the tuner.)
pub const TWOSHOT_THRESHOLD: u64 = 512 << 10;
/// Largest allgather output (R x input) for which ag_ll is the default.
pub const AG_LL_THRESHOLD: u64 = 256 << 10;

/// The untuned choice: size thresholds.
pub fn heuristic(req: &Request, limits: &Limits) -> Algorithm {
    let n = req.nbytes;
    match req.collective {
        Collective::AllReduce => {
            if n <= oneshot_threshold(limits.world_size).min(limits.oneshot_max_bytes) {
                Algorithm::OneShotLl
            } else if n <= TWOSHOT_THRESHOLD.min(limits.twoshot_max_bytes) {
                Algorithm::TwoShotLl
            } else {
                Algorithm::RsAgPush
            }
        }
        Collective::AllGather => {
            let total = n.saturating_mul(limits.world_size as u64);
            if total <= AG_LL_THRESHOLD && n <= limits.allgather_ll_max_bytes {
                Algorithm::AgLl
            } else {
                Algorithm::AgMesh
            }
        }
    }
}

fn geometry_ok(c: &Choice, limits: &Limits) -> bool {
    (1..=limits.max_blocks).contains(&c.num_blocks)
        && (32..=1024).contains(&c.num_threads)
        && c.num_threads % 32 == 0
}

/// The automatic choice for `req`: the tuned entry if there is one that is
/// applicable here, else [`heuristic`] with its default geometry.
pub fn select(req: &Request, limits: &Limits, table: &TunedTable) -> Choice {
    if let Some(c) = table.lookup(req) {
        if c.algorithm.applicable(req, limits).is_ok() && geometry_ok(&c, limits) {
            return c;
        }
    }
    let algorithm = heuristic(req, limits);
    let (num_blocks, num_threads) = algorithm.default_geometry(req, limits);
    Choice {
        algorithm,
        num_blocks,
        num_threads,
    }
}

/// The choice for a call: `pinned` (checked: it must serve `req`) or
/// [`select`]; then `num_blocks` / `num_threads` override the geometry when
/// `num_blocks` capped to `limits.max_blocks` (every block of every rank must
/// be resident together: the GPU's SMs, or a rank's share where ranks share a
/// GPU), logged once per process when it caps.
fn cap_blocks(num_blocks: u32, limits: &Limits) -> u32 {
    if num_blocks <= limits.max_blocks {
        return num_blocks;
    }
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::warn!(
            "allreduce num_blocks {num_blocks} capped to {}: every block of every rank must be \
             resident together (the SMs of this rank's share of its GPU)",
            limits.max_blocks
        )
    });
    limits.max_blocks.max(1)
}

/// non-zero (checked: 1..=max_blocks blocks; 32..=1024 threads, a multiple of 32).
pub fn resolve(
    req: &Request,
    limits: &Limits,
    table: &TunedTable,
    pinned: Option<Algorithm>,
    num_blocks: u32,
    num_threads: u32,
) -> Result<Choice> {
    let mut c = match pinned {
        Some(a) => {
            a.applicable(req, limits)
                .map_err(|why| CommError::invalid("algorithm", why))?;
            let (b, t) = a.default_geometry(req, limits);
            Choice {
                algorithm: a,
                num_blocks: b,
                num_threads: t,
            }
        }
        None => select(req, limits, table),
    };
    if num_blocks != 0 {
        if num_blocks > crate::args::MAX_BLOCKS as u32 {
            return Err(CommError::invalid(
                "num_blocks",
                format!("{num_blocks}: at most {}", crate::args::MAX_BLOCKS),
            ));
        }
        c.num_blocks = cap_blocks(num_blocks, limits);
    }
    if num_threads != 0 {
        if !(32..=1024).contains(&num_threads) || num_threads % 32 != 0 {
            return Err(CommError::invalid(
                "num_threads",
                format!("{num_threads}: need a multiple of 32 from 32 to 1024"),
            ));
        }
        c.num_threads = num_threads;
    }
    Ok(c)
}

/// Parses an algorithm name for `collective` (a clear error otherwise).
pub fn parse_algorithm(name: &str, collective: Collective) -> Result<Algorithm> {
    let known: Vec<&str> = Algorithm::of(collective).map(|a| a.name()).collect();
    match Algorithm::parse(name) {
        Some(a) if a.collective() == collective => Ok(a),
        Some(a) => Err(CommError::invalid(
            "algorithm",
            format!(
                "{name:?} is an {} algorithm; {} algorithms: {}",
                a.collective().name(),
                collective.name(),
                known.join(", ")
            ),
        )),
        None => Err(CommError::invalid(
            "algorithm",
            format!(
                "unknown {} algorithm {name:?}; known: {}",
                collective.name(),
                known.join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(r: usize) -> Limits {
        Limits {
            world_size: r,
            max_bytes: 256 << 20,
            oneshot_max_bytes: 512 << 10,
            twoshot_max_bytes: 8 << 20,
            allgather_ll_max_bytes: 512 << 10,
            max_blocks: 128,
        }
    }

    fn choice(algorithm: Algorithm, num_blocks: u32, num_threads: u32) -> Choice {
        Choice {
            algorithm,
            num_blocks,
            num_threads,
        }
    }

    fn ar(n: u64) -> Request {
        Request {
            collective: Collective::AllReduce,
            nbytes: n,
            registered: false,
            capturing: false,
        }
    }

    #[test]
    fn buckets() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 0);
        assert_eq!(bucket(2), 1);
        assert_eq!(bucket(3), 2);
        assert_eq!(bucket(1024), 10);
        assert_eq!(bucket(1025), 11);
        assert_eq!(bucket(1 << 30), 30);
    }

    #[test]
    fn heuristic_follows_size() {
        let l = limits(4);
        let t = TunedTable::new();
        let alg = |n: u64| select(&ar(n), &l, &t).algorithm;
        assert_eq!(alg(2), Algorithm::OneShotLl);
        assert_eq!(alg(128 << 10), Algorithm::OneShotLl);
        assert_eq!(alg((128 << 10) + 2), Algorithm::TwoShotLl);
        assert_eq!(alg(512 << 10), Algorithm::TwoShotLl);
        assert_eq!(alg((512 << 10) + 2), Algorithm::RsAgPush);
        assert_eq!(alg(256 << 20), Algorithm::RsAgPush);
        let mut r = ar(1 << 20);
        r.registered = true;
        assert_eq!(select(&r, &l, &t).algorithm, Algorithm::RsAgPush);
        // Eight ranks: one-shot stops earlier.
        assert_eq!(
            select(&ar(64 << 10), &limits(8), &t).algorithm,
            Algorithm::TwoShotLl
        );
        // Small LL limits move the crossovers.
        let mut small = limits(4);
        small.oneshot_max_bytes = 4096;
        small.twoshot_max_bytes = 0;
        assert_eq!(select(&ar(8192), &small, &t).algorithm, Algorithm::RsAgPush);
    }

    #[test]
    fn allgather_heuristic() {
        let l = limits(4);
        let t = TunedTable::new();
        let ag = |n: u64| Request {
            collective: Collective::AllGather,
            nbytes: n,
            registered: false,
            capturing: false,
        };
        assert_eq!(select(&ag(64 << 10), &l, &t).algorithm, Algorithm::AgLl);
        assert_eq!(
            select(&ag((64 << 10) + 1), &l, &t).algorithm,
            Algorithm::AgMesh
        );
    }

    #[test]
    fn tuned_entries_win_when_applicable() {
        let l = limits(4);
        let mut t = TunedTable::new();
        let key = |graph, registered, log2_bytes| TableKey {
            collective: Collective::AllReduce,
            graph,
            registered,
            log2_bytes,
        };
        let rsag = choice(Algorithm::RsAg, 4, 256);
        t.insert(key(false, false, 10), rsag);
        assert_eq!(select(&ar(1024), &l, &t), rsag);
        assert_eq!(select(&ar(513), &l, &t), rsag); // same bucket
        assert_eq!(select(&ar(512), &l, &t).algorithm, Algorithm::OneShotLl);
        // Graph capture has its own entries.
        let mut g = ar(1024);
        g.capturing = true;
        assert_eq!(select(&g, &l, &t).algorithm, Algorithm::OneShotLl);
        // A registered request falls back to the unregistered entry.
        let mut reg = ar(1024);
        reg.registered = true;
        assert_eq!(select(&reg, &l, &t), rsag);
        // An entry that does not apply here (size over a limit, or too many
        // blocks for this GPU) is ignored.
        let os = choice(Algorithm::OneShotLl, 8, 512);
        t.insert(key(false, false, 22), os);
        assert_eq!(select(&ar(4 << 20), &l, &t).algorithm, Algorithm::RsAgPush);
        let mut few = limits(4);
        few.max_blocks = 2;
        assert_eq!(select(&ar(1024), &few, &t).algorithm, Algorithm::OneShotLl);
        let zc = choice(Algorithm::RsAgZeroCopy, 8, 512);
        t.insert(key(false, false, 24), zc);
        assert_eq!(select(&ar(16 << 20), &l, &t).algorithm, Algorithm::RsAgPush);
        assert_eq!(t.entries().len(), 3);
    }

    #[test]
    fn pins_and_overrides_are_checked() {
        let l = limits(4);
        let t = TunedTable::new();
        let c = resolve(&ar(64 << 10), &l, &t, Some(Algorithm::OneShotLl), 3, 96).unwrap();
        assert_eq!(c, choice(Algorithm::OneShotLl, 3, 96));
        let e = resolve(&ar(1 << 20), &l, &t, Some(Algorithm::RsAgZeroCopy), 0, 0);
        assert!(e.unwrap_err().to_string().contains("register"));
        let e = resolve(&ar(1 << 20), &l, &t, Some(Algorithm::OneShotLl), 0, 0);
        assert!(e.is_err()); // 1 MiB > oneshot_max_bytes (512 KiB)
        assert!(resolve(&ar(64), &l, &t, None, 129, 0).is_err());
        // Above this rank's share of a shared GPU (but within MAX_BLOCKS): capped.
        let mut shared = limits(4);
        shared.max_blocks = 16;
        let c = resolve(
            &ar(64 << 10),
            &shared,
            &t,
            Some(Algorithm::OneShotLl),
            100,
            0,
        )
        .unwrap();
        assert_eq!(c.num_blocks, 16);
        assert!(resolve(&ar(64), &l, &t, None, 0, 100).is_err());
        assert!(resolve(&ar(64), &l, &t, None, 0, 2048).is_err());
        assert!(resolve(&ar(64), &l, &t, None, 0, 16).is_err());
        assert!(parse_algorithm("ag_ll", Collective::AllReduce).is_err());
        assert!(parse_algorithm("nope", Collective::AllGather).is_err());
        assert_eq!(
            parse_algorithm("rsag_zc", Collective::AllReduce).unwrap(),
            Algorithm::RsAgZeroCopy
        );
    }

    #[test]
    fn every_request_gets_an_applicable_choice() {
        let t = TunedTable::new();
        for r in [1, 2, 3, 4, 8] {
            let l = limits(r);
            for k in 0..=28 {
                for n in [(1u64 << k) - 1, 1 << k, (1 << k) + 1] {
                    if n == 0 || n > l.max_bytes {
                        continue;
                    }
                    for c in [Collective::AllReduce, Collective::AllGather] {
                        for registered in [false, true] {
                            let req = Request {
                                collective: c,
                                nbytes: if c == Collective::AllGather {
                                    n / r as u64
                                } else {
                                    n
                                },
                                registered,
                                capturing: false,
                            };
                            let ch = select(&req, &l, &t);
                            assert!(
                                ch.algorithm.applicable(&req, &l).is_ok(),
                                "{req:?} -> {ch:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
