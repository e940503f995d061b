//! `comm`: the transport stack of moelink.
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | driver | [`cuda`] | loads libcuda at run time, binds threads to a device's primary context, streams |
//! | kernels | [`module`], [`kernels`] | embedded fatbins loaded once per device; comm's own kernels |
//! | bootstrap | [`bootstrap`] | rank discovery and small messages over TCP ([`Bootstrap`], [`TcpBootstrap`]) |
//! | group | [`group`] | [`Group`]: one bootstrap and one [`Communicator`] shared by every object of a process group; [`Member`]: what each object keeps for itself |
//! | memory | [`memory`], [`vmm`], [`host_memory`], [`fd_passing`] | device allocations (legacy IPC, cuMem POSIX fd), host-mapped memory, fd passing over unix sockets |
//! | registration | [`registered_memory`], [`wire`] | buffers + how to reach them, serializable |
//! | transports | [`transport`] | [`transport::Connection`]s: CUDA IPC, Ethernet, IB verbs (libibverbs loaded at run time; docs/ib.md) |
//! | sharing | [`device_share`] | ranks on one GPU: each rank's SM share, so all ranks' blocks are resident together |
//! | signalling | [`semaphore`], [`fifo`], [`proxy`], [`proxy_pool`], [`device_error`] | semaphores, trigger FIFO, CPU proxy (one thread per FIFO; a pool of them per buffer), device error records |
//! | channels | [`channel`], [`device_handles`] | memory and port channels, `#[repr(C)]` device handles |
//! | errors | [`error`] | [`CommError`]: which call, which argument, which rank waited for what |
//!
//! Device-side API: CUDA headers under `include/comm/` (one per host type),
//! published to dependants as `DEP_MOELINK_COMM_INCLUDE`.

pub mod bootstrap;
pub mod channel;
pub mod communicator;
pub mod cuda;
pub mod device_error;
pub mod device_handles;
pub mod device_share;
pub mod env;
pub mod error;
pub mod fd_passing;
pub mod fifo;
pub mod group;
pub mod host_memory;
pub mod kernels;
pub mod memory;
pub mod module;
pub mod proxy;
pub mod proxy_pool;
pub mod registered_memory;
pub mod semaphore;
pub mod symmetric;
pub mod topology;
pub mod transport;
pub mod vmm;
pub mod wire;

pub use bootstrap::{Bootstrap, TcpBootstrap, UniqueId};
pub use communicator::{Communicator, CommunicatorOptions};
pub use cuda::{device_count, init_driver, Device, OwnedStream, StreamHandle};
pub use device_share::DeviceShare;
pub use error::{CommError, Result};
pub use group::{Group, Member};
pub use memory::{DeviceMemory, IpcHandle, PeerMemory};
pub use symmetric::{device_table, SymmetricRegion};
pub use topology::Topology;

/// Directory of the device-side headers (`#include <comm/...>`).
pub const INCLUDE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
