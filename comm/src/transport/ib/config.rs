//! What the IB verbs transport reads from the environment, parsed and checked
//! before any device is opened (so a typo fails with the variable's name, on a
//! machine with or without an RDMA device).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `MOELINK_IB_HCA` | which HCAs (and ports) to use, NCCL_IB_HCA's syntax: a comma list of `name[:port]` prefixes; `=` before the list: exact names; `^` before it: every HCA but these | every HCA, port 1 |
//! | `MOELINK_IB_GID_INDEX` | GID table index (RoCE v2 needs the right one) | 0 (InfiniBand: unused) |
//! | `MOELINK_IB_MODE` | `host` (signals and counter adds as RDMA atomics) or `host-no-atomic` (as write-with-immediate, applied by the receiving proxy) | `host` |
//! | `MOELINK_IB_MTU` | path MTU in bytes: 256, 512, 1024, 2048 or 4096 | the port's active MTU |
//! | `MOELINK_IB_SL` | service level, 0..=15 | 0 |
//! | `MOELINK_IB_TC` | traffic class (RoCE v2), 0..=255 | 0 |
//! | `MOELINK_IB_QPS_PER_RANK` | queue pairs per peer, 1..=16 | 1 |
//!
//! Whether peers on other nodes use this transport at all is
//! `MOELINK_TRANSPORT` (`auto`, `ib`, `ethernet`; [`crate::transport::CrossNode`]).

use crate::error::{CommError, Result};

/// One entry of an HCA list: a device name (or prefix) and an optional port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaSpec {
    pub name: String,
    pub port: Option<u8>,
}

/// `MOELINK_IB_HCA`, parsed.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct HcaFilter {
    /// `^`: the listed HCAs are the ones *not* to use.
    pub exclude: bool,
    /// `=`: names match exactly, not as prefixes.
    pub exact: bool,
    /// Empty: every HCA.
    pub specs: Vec<HcaSpec>,
}

impl HcaFilter {
    /// Parses NCCL_IB_HCA's syntax, e.g. `mlx5_0:1,mlx5_1:1`, `=mlx5_0`,
    /// `^mlx5_2`, `^=mlx5_2:1`. `name` is the variable, for errors.
    pub fn parse(name: &'static str, text: &str) -> Result<Self> {
        let mut rest = text.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let mut specs = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (dev, port) = match item.split_once(':') {
                Some((d, p)) => {
                    let port = p.parse::<u8>().ok().filter(|&p| p >= 1).ok_or_else(|| {
                        CommError::invalid(
                            name,
                            format!("{text:?}: port {p:?} of {d:?} is not a number from 1 to 255"),
                        )
                    })?;
                    (d, Some(port))
                }
                None => (item, None),
            };
            if dev.is_empty()
                || !dev
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(CommError::invalid(
                    name,
                    format!("{text:?}: {dev:?} is not an HCA name (letters, digits, '_', '-')"),
                ));
            }
            specs.push(HcaSpec {
                name: dev.to_string(),
                port,
            });
        }
        if specs.is_empty() && (exclude || exact || !text.trim().is_empty()) {
            return Err(CommError::invalid(
                name,
                format!("{text:?}: names no HCA (expected e.g. mlx5_0:1,mlx5_1:1)"),
            ));
        }
        Ok(Self {
            exclude,
            exact,
            specs,
        })
    }

    fn spec_matches(&self, spec: &HcaSpec, device: &str, port: u8) -> bool {
        let name_ok = if self.exact {
            device == spec.name
        } else {
            device.starts_with(&spec.name)
        };
        name_ok && spec.port.is_none_or(|p| p == port)
    }

    /// Whether port `port` of HCA `device` may be used.
    pub fn allows(&self, device: &str, port: u8) -> bool {
        if self.specs.is_empty() {
            return true;
        }
        let listed = self
            .specs
            .iter()
            .any(|s| self.spec_matches(s, device, port));
        listed != self.exclude
    }

    /// The (device, port) pairs to use out of `available` (every active port of
    /// every HCA found), in the order of the list where it names them (so that
    /// every rank of a node pairs its i-th HCA the same way), else as found.
    pub fn select(&self, available: &[(String, u8)]) -> Vec<(String, u8)> {
        if self.specs.is_empty() || self.exclude {
            return available
                .iter()
                .filter(|(d, p)| self.allows(d, *p))
                .cloned()
                .collect();
        }
        let mut out: Vec<(String, u8)> = Vec::new();
        for spec in &self.specs {
            for (d, p) in available {
                if self.spec_matches(spec, d, *p) && !out.iter().any(|(od, op)| od == d && op == p)
                {
                    out.push((d.clone(), *p));
                }
            }
        }
        out
    }
}

/// How signals and counter adds cross the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalMode {
    /// RDMA fetch-and-add on the peer's semaphore / counter.
    Host,
    /// Write-with-immediate; the peer's proxy applies the update (NICs or
    /// fabrics without RDMA atomics). Data written before a signal on one
    /// queue pair lands before it.
    HostNoAtomic,
}

impl SignalMode {
    pub fn parse(name: &'static str, text: &str) -> Result<Self> {
        match text.trim() {
            "host" => Ok(Self::Host),
            "host-no-atomic" => Ok(Self::HostNoAtomic),
            other => Err(CommError::invalid(
                name,
                format!("{other:?}: expected \"host\" or \"host-no-atomic\""),
            )),
        }
    }
}

/// Everything the transport takes from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbConfig {
    pub hca: HcaFilter,
    pub gid_index: u8,
    pub mode: SignalMode,
    /// Path MTU in bytes; `None`: the port's active MTU.
    pub mtu: Option<u32>,
    pub service_level: u8,
    pub traffic_class: u8,
    pub qps_per_rank: u32,
}

impl Default for IbConfig {
    fn default() -> Self {
        Self {
            hca: HcaFilter::default(),
            gid_index: 0,
            mode: SignalMode::Host,
            mtu: None,
            service_level: 0,
            traffic_class: 0,
            qps_per_rank: 1,
        }
    }
}

/// `name`'s value as an integer in `range`, else an error naming it.
fn int_in(name: &'static str, text: &str, lo: u64, hi: u64) -> Result<u64> {
    match text.trim().parse::<u64>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(CommError::invalid(
            name,
            format!("{text:?}: expected a whole number from {lo} to {hi}"),
        )),
    }
}

impl IbConfig {
    /// From a lookup of variable names (the environment, or a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut c = Self::default();
        if let Some(v) = get("MOELINK_IB_HCA") {
            c.hca = HcaFilter::parse("MOELINK_IB_HCA", &v)?;
        }
        if let Some(v) = get("MOELINK_IB_GID_INDEX") {
            c.gid_index = int_in("MOELINK_IB_GID_INDEX", &v, 0, 255)? as u8;
        }
        if let Some(v) = get("MOELINK_IB_MODE") {
            c.mode = SignalMode::parse("MOELINK_IB_MODE", &v)?;
        }
        if let Some(v) = get("MOELINK_IB_MTU") {
            let mtu = int_in("MOELINK_IB_MTU", &v, 256, 4096)? as u32;
            if !mtu.is_power_of_two() {
                return Err(CommError::invalid(
                    "MOELINK_IB_MTU",
                    format!("{v:?}: expected 256, 512, 1024, 2048 or 4096"),
                ));
            }
            c.mtu = Some(mtu);
        }
        if let Some(v) = get("MOELINK_IB_SL") {
            c.service_level = int_in("MOELINK_IB_SL", &v, 0, 15)? as u8;
        }
        if let Some(v) = get("MOELINK_IB_TC") {
            c.traffic_class = int_in("MOELINK_IB_TC", &v, 0, 255)? as u8;
        }
        if let Some(v) = get("MOELINK_IB_QPS_PER_RANK") {
            c.qps_per_rank = int_in("MOELINK_IB_QPS_PER_RANK", &v, 1, 16)? as u32;
        }
        Ok(c)
    }

    pub fn from_env() -> Result<Self> {
        Self::from_lookup(crate::env::var)
    }

    /// The verbs encoding of the path MTU (`enum ibv_mtu`: 1 = 256 .. 5 = 4096).
    pub fn mtu_enum(mtu: u32) -> Option<u32> {
        match mtu {
            256 => Some(1),
            512 => Some(2),
            1024 => Some(3),
            2048 => Some(4),
            4096 => Some(5),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn avail() -> Vec<(String, u8)> {
        ["mlx5_0", "mlx5_1", "mlx5_10", "irdma0"]
            .iter()
            .flat_map(|d| [(d.to_string(), 1u8), (d.to_string(), 2u8)])
            .collect()
    }

    fn names(v: &[(String, u8)]) -> Vec<String> {
        v.iter().map(|(d, p)| format!("{d}:{p}")).collect()
    }

    #[test]
    fn nccl_hca_syntax() {
        let f = HcaFilter::parse("V", "mlx5_1:1,mlx5_0:1").unwrap();
        assert!(!f.exclude && !f.exact);
        // The list's order, prefixes: mlx5_1 also matches mlx5_10.
        assert_eq!(
            names(&f.select(&avail())),
            ["mlx5_1:1", "mlx5_10:1", "mlx5_0:1"]
        );
        let f = HcaFilter::parse("V", "=mlx5_1").unwrap();
        assert!(f.exact);
        assert_eq!(names(&f.select(&avail())), ["mlx5_1:1", "mlx5_1:2"]);
        let f = HcaFilter::parse("V", "^mlx5").unwrap();
        assert_eq!(names(&f.select(&avail())), ["irdma0:1", "irdma0:2"]);
        let f = HcaFilter::parse("V", "^=mlx5_1:2").unwrap();
        assert!(f.exclude && f.exact);
        assert_eq!(f.select(&avail()).len(), 7);
        assert!(!f.allows("mlx5_1", 2) && f.allows("mlx5_10", 2));
        let all = HcaFilter::parse("V", "").unwrap();
        assert_eq!(all.select(&avail()), avail());
        assert_eq!(HcaFilter::default().select(&avail()), avail());
    }

    #[test]
    fn bad_hca_lists_name_the_variable() {
        for bad in [
            "mlx5_0:0", "mlx5_0:x", "mlx5 0", "^", "=", ",", "mlx5_0:", ":1",
        ] {
            let e = HcaFilter::parse("MOELINK_IB_HCA", bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("MOELINK_IB_HCA"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn config_from_the_environment() {
        let env: HashMap<&str, &str> = [
            ("MOELINK_IB_HCA", "=mlx5_0:1"),
            ("MOELINK_IB_GID_INDEX", "3"),
            ("MOELINK_IB_MODE", "host-no-atomic"),
            ("MOELINK_IB_MTU", "4096"),
            ("MOELINK_IB_SL", "2"),
            ("MOELINK_IB_TC", "106"),
            ("MOELINK_IB_QPS_PER_RANK", "4"),
        ]
        .into();
        let c = IbConfig::from_lookup(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(c.gid_index, 3);
        assert_eq!(c.mode, SignalMode::HostNoAtomic);
        assert_eq!(
            (c.mtu, c.service_level, c.traffic_class),
            (Some(4096), 2, 106)
        );
        assert_eq!(c.qps_per_rank, 4);
        assert_eq!(
            IbConfig::from_lookup(|_| None).unwrap(),
            IbConfig::default()
        );
        assert_eq!(IbConfig::mtu_enum(4096), Some(5));
        assert_eq!(IbConfig::mtu_enum(1000), None);
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (k, v) in [
            ("MOELINK_IB_GID_INDEX", "256"),
            ("MOELINK_IB_MODE", "device"),
            ("MOELINK_IB_MTU", "1500"),
            ("MOELINK_IB_MTU", "8192"),
            ("MOELINK_IB_SL", "16"),
            ("MOELINK_IB_TC", "-1"),
            ("MOELINK_IB_QPS_PER_RANK", "0"),
            ("MOELINK_IB_HCA", "^"),
        ] {
            let e = IbConfig::from_lookup(|q| (q == k).then(|| v.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
    }
}
