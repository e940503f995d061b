//! [`Group`]: the ranks a Buffer or AllReduce is made among, and their
//! shared core (`comm::Group`: one bootstrap and one Communicator under every
//! object made on it), as `moelink._group.native_group` makes it for a torch
//! process group in Python. Without torch.distributed, the bootstrap comes
//! from torchrun's environment ([`Group::from_env`]) or from a unique id that
//! rank 0 makes and the caller shares ([`Group::new`]).

use std::sync::Arc;
use std::time::Duration;

use comm::{Device as CoreDevice, TcpBootstrap, UniqueId};
use tch::Device;

use crate::error::{Error, Result};

/// Bound of the bootstrap's waits where `MOELINK_TIMEOUT_S` does not set one
/// (the Python API's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// `MOELINK_TIMEOUT_S` (seconds, positive), else [`DEFAULT_TIMEOUT`]: the
/// bound of host waits, as the Python API reads it.
pub fn env_timeout() -> Result<Duration> {
    match comm::env::var("MOELINK_TIMEOUT_S") {
        None => Ok(DEFAULT_TIMEOUT),
        Some(raw) => match raw.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(Error::value(format!(
                "MOELINK_TIMEOUT_S must be a positive number of seconds, got {raw:?}"
            ))),
        },
    }
}

/// `timeout` where given, else [`env_timeout`].
pub(crate) fn timeout_or_env(timeout: Option<Duration>) -> Result<Duration> {
    timeout.map_or_else(env_timeout, Ok)
}

/// The CUDA device of an object made on a [`Group`]: torch's [`Device`], its
/// index, and the core's device whose primary context is bound to the thread
/// that made the object.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CudaDevice {
    pub device: Device,
    pub index: i32,
    pub core: CoreDevice,
}

impl CudaDevice {
    /// Binds `device`'s primary context to this thread; a device that is not
    /// CUDA is refused naming `what`, the object that needs it.
    pub(crate) fn bind(device: Device, what: &str) -> Result<Self> {
        let Device::Cuda(index) = device else {
            return Err(Error::state(format!(
                "{what} needs a CUDA device, got {device:?}"
            )));
        };
        let index = index as i32;
        Ok(Self {
            device,
            index,
            core: CoreDevice::bind(index)?,
        })
    }
}

/// The ranks of one job on one host and their shared core. Cheap to clone;
/// every Buffer and AllReduce made on it (in the same order on every rank)
/// shares one bootstrap and one Communicator.
#[derive(Clone, Debug)]
pub struct Group {
    inner: Arc<comm::Group>,
}

impl Group {
    /// *Collective.* Joins a job launched by torchrun or
    /// `python -m moelink.launch` (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, and
    /// the bootstrap port `MOELINK_BOOTSTRAP_PORT` or `MASTER_PORT + 1`:
    /// torchrun's own store holds `MASTER_PORT`). Every wait is bounded by
    /// `timeout`.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        let boot = TcpBootstrap::from_env(timeout)?;
        Self::with_bootstrap(boot, timeout)
    }

    /// *Collective.* Connects `size` ranks through `id`, which rank 0 made
    /// with [`Group::unique_id`] and the caller shared (MPI, a file, a torch
    /// store: `UniqueId::to_bytes` / `from_bytes`, or its string form).
    pub fn new(id: &UniqueId, rank: usize, size: usize, timeout: Duration) -> Result<Self> {
        let boot = TcpBootstrap::new(id, rank, size, timeout)?;
        Self::with_bootstrap(boot, timeout)
    }

    /// A fresh bootstrap id (rank 0 makes it). Its root listens on 127.0.0.1:
    /// ranks of one host only, as every moelink object needs.
    pub fn unique_id() -> Result<UniqueId> {
        Ok(UniqueId::new(None)?)
    }

    fn with_bootstrap(boot: TcpBootstrap, timeout: Duration) -> Result<Self> {
        let inner = comm::Group::with_timeout(Arc::new(boot), timeout)?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    pub fn rank(&self) -> usize {
        self.inner.rank()
    }

    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Objects (Buffer parts, AllReduce) made on this group so far.
    pub fn objects(&self) -> u64 {
        self.inner.objects()
    }

    /// The core group, for objects of the Rust crates themselves.
    pub fn core(&self) -> &comm::Group {
        &self.inner
    }
}

/// The CUDA device of this rank in a job of one host: `LOCAL_RANK` modulo the
/// visible devices (ranks map to GPUs round-robin, several per GPU where they
/// outnumber them), as `moelink.launch` assigns them. Device 0 where
/// `LOCAL_RANK` is unset.
pub fn local_device() -> Result<tch::Device> {
    let local = match std::env::var("LOCAL_RANK") {
        Err(_) => 0,
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| Error::value(format!("LOCAL_RANK must be a rank number, got {v:?}")))?,
    };
    let n = comm::device_count();
    if n == 0 {
        return Err(Error::state(
            "no CUDA device is visible (moelink's Buffer and AllReduce need one per rank)",
        ));
    }
    Ok(tch::Device::Cuda(local % n))
}
