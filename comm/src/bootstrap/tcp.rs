//! TCP bootstrap: rank discovery through a root listener, then a full mesh of
//! TCP connections carrying small tagged messages.
//!
//! # How a job forms
//!
//! 1. Rank 0 creates a [`UniqueId`] (`UniqueId::new`), which binds the root
//!    listener right away and keeps it open, and publishes the id's bytes
//!    (`to_bytes` / `Display`) to the other ranks by any side channel (a file,
//!    an environment variable, an MPI broadcast, torch.distributed's store...).
//!    [`TcpBootstrap::from_env`] skips this step: every rank derives the same id
//!    from torchrun's environment.
//! 2. Every rank calls [`TcpBootstrap::new`]. Rank 0 takes over the id's
//!    listener (or binds the id's address if it holds none, e.g. because the id
//!    was deserialized). Every other rank connects to the root (retrying until
//!    the deadline: the root may start later), opens its own listener on an
//!    ephemeral port of the interface that reaches the root, and registers
//!    `(rank, size, job nonce, listen address)`.
//! 3. Once all `size` ranks registered, the root sends every rank the address
//!    table. A registration connection stays open as the link between rank 0
//!    and that rank.
//! 4. Every rank `j >= 1` connects to each rank `i` with `1 <= i < j`, and
//!    accepts from every higher rank: one connection per pair, opened by the
//!    higher rank. Each connection starts with a hello (job nonce, rank, size)
//!    that the accepting rank acknowledges or rejects with a reason.
//!
//! After setup one receiver thread per peer connection reads frames and files
//! their payloads into per-(peer, tag) queues, so [`Bootstrap::recv`] may be
//! called for tags in any order. A peer whose connection drops (its process
//! exited or crashed) is marked gone: `recv` from it returns the messages that
//! did arrive and then fails at once with an error naming that rank.
//!
//! # Wire format
//!
//! Every frame is a 24-byte header, little endian — magic `u32`, kind `u32`,
//! tag `u64`, payload length `u64` — followed by the payload. Kinds: user or
//! collective data, goodbye (sent by `Drop`, so peers can tell a clean shutdown
//! from a crash), and the setup messages (register, connect, address table,
//! ack, reject, abort).
//!
//! # Tags
//!
//! User tags must keep the top bit clear (`tag <= TcpBootstrap::MAX_TAG`);
//! tags with the top bit set are reserved for [`Bootstrap::all_gather`] and
//! [`Bootstrap::barrier`], which number their calls so back-to-back
//! collectives never mix. As with NCCL, every rank must call the collectives
//! in the same order.
//!
//! # Timeouts
//!
//! Every blocking step is bounded by the bootstrap's timeout (the whole of
//! `new` by one deadline; each `recv`, `barrier` and `all_gather` by its own;
//! each socket write by the timeout too) and fails with
//! [`CommError::Timeout`] saying exactly what was awaited.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::ops::Range;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Bootstrap;
use crate::error::{CommError, Result};
use crate::wire::{u32_at, u64_at};

/// First bytes of a serialized [`UniqueId`].
const ID_MAGIC: [u8; 4] = *b"MLID";
/// Layout version of a serialized [`UniqueId`].
const ID_VERSION: u8 = 1;
/// First field of every frame header ("MLBF" read as little endian).
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"MLBF");
/// Version of the setup protocol, checked in every hello.
const PROTOCOL_VERSION: u32 = 1;
/// magic u32 + kind u32 + tag u64 + len u64.
const HEADER_LEN: usize = 24;
/// An encoded socket address: family u8 (4 or 6), port u16 BE, ip 16 bytes.
const ADDR_LEN: usize = 19;
/// version u32 + nonce u64 + rank u64 + size u64 + listen address.
const HELLO_PAYLOAD: usize = 4 + 8 + 8 + 8 + ADDR_LEN;
const HELLO_FRAME_LEN: usize = HEADER_LEN + HELLO_PAYLOAD;
/// Upper bound on setup payloads (address table, reject reasons).
const MAX_SETUP_PAYLOAD: u64 = 64 << 20;

/// A message (user or collective).
const KIND_DATA: u32 = 1;
/// The sender is dropping its bootstrap; EOF follows.
const KIND_GOODBYE: u32 = 2;
/// Hello from rank r > 0 to the root.
const KIND_REGISTER: u32 = 3;
/// Hello from rank j to rank i (1 <= i < j).
const KIND_CONNECT: u32 = 4;
/// The root's reply to a registration: every rank's listen address.
const KIND_TABLE: u32 = 5;
/// A rank accepted a CONNECT hello.
const KIND_ACK: u32 = 6;
/// A hello was refused; the payload is the reason (UTF-8).
const KIND_REJECT: u32 = 7;
/// The root gave up before all ranks registered; the payload is why.
const KIND_ABORT: u32 = 8;

/// Tags with this bit set are reserved for collectives.
const INTERNAL_TAG: u64 = 1 << 63;
const OP_ALL_GATHER: u64 = 1;
const OP_BARRIER: u64 = 2;
/// Collective tags: internal bit, op in bits 56..63, call number in bits 0..56.
const SEQ_MASK: u64 = (1 << 56) - 1;

/// Job nonce of [`TcpBootstrap::from_env`] when `TORCHELASTIC_RUN_ID` is unset
/// ("moelink\0").
const ENV_DEFAULT_NONCE: u64 = u64::from_be_bytes(*b"moelink\0");

/// Longest wait between two attempts to connect.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long `Drop` may spend writing its goodbye to one peer.
const GOODBYE_WRITE_TIMEOUT: Duration = Duration::from_millis(100);
/// Messages up to this size go out in one write together with their header.
const COALESCE_LIMIT: usize = 64 << 10;
const READER_STACK: usize = 256 << 10;

// ---------------------------------------------------------------------------
// UniqueId

/// Identifies one bootstrap job: the root's address plus a random 64-bit nonce,
/// so that two jobs on one host never cross-connect (a rank that reaches the
/// root of another job is rejected with an error saying so).
///
/// Created by rank 0 with [`UniqueId::new`], which binds the root listener at
/// once and keeps it open until `TcpBootstrap::new(&id, 0, ..)` takes it over:
/// the port cannot be taken by anyone else meanwhile, and ranks that connect
/// early simply wait in the listen backlog. The other ranks receive the id as
/// bytes ([`to_bytes`](Self::to_bytes), a fixed [`UniqueId::BYTES`] bytes) or
/// as a hex string (`Display` / `FromStr`).
///
/// Clones share the listener. A deserialized id holds no listener; if rank 0
/// uses one, it binds the id's address itself.
#[derive(Clone)]
pub struct UniqueId {
    addr: SocketAddr,
    nonce: u64,
    listener: Option<Arc<Mutex<Option<TcpListener>>>>,
}

impl UniqueId {
    /// Length of [`to_bytes`](Self::to_bytes): magic (4), version (1), address
    /// family (1), port (2), IP (16), nonce (8).
    pub const BYTES: usize = 32;

    /// Binds the root listener on `bind_addr` (default `127.0.0.1:0`: this host
    /// only; port 0 picks a free port) and draws a random nonce.
    ///
    /// For a multi-host job pass the address of an interface the other hosts
    /// reach. An unspecified IP (`0.0.0.0`) listens everywhere but is also what
    /// the id advertises, which only ranks on this host can connect to. IPv6
    /// scope ids do not travel, so link-local IPv6 addresses are not supported.
    pub fn new(bind_addr: Option<SocketAddr>) -> Result<UniqueId> {
        let bind = bind_addr.unwrap_or_else(|| SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        let listener = TcpListener::bind(bind)
            .map_err(|e| io_err(format!("binding the bootstrap root listener on {bind}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("reading the root listener's address", e))?;
        Ok(UniqueId {
            addr,
            nonce: random_nonce(),
            listener: Some(Arc::new(Mutex::new(Some(listener)))),
        })
    }

    /// An id from parts agreed on by other means (e.g. a launcher's fixed port).
    /// Rank 0 binds `addr` itself in [`TcpBootstrap::new`].
    pub fn from_parts(addr: SocketAddr, nonce: u64) -> Result<UniqueId> {
        if addr.port() == 0 {
            return Err(CommError::invalid(
                "addr",
                format!("{addr}: the root address needs a fixed port, not 0"),
            ));
        }
        Ok(UniqueId {
            addr,
            nonce,
            listener: None,
        })
    }

    /// The id [`TcpBootstrap::from_env`] uses: the root at `MASTER_ADDR` and port
    /// `MOELINK_BOOTSTRAP_PORT`, or `MASTER_PORT + 1` when that is unset
    /// (torchrun's own store occupies `MASTER_PORT`). The nonce is a hash of
    /// `TORCHELASTIC_RUN_ID` if set, else the fixed value `"moelink\0"` (as a
    /// big-endian u64): two jobs without a run id must then not share the
    /// address.
    pub fn from_env() -> Result<UniqueId> {
        let host = env_var("MASTER_ADDR")?;
        let port = match crate::env::var_result("MOELINK_BOOTSTRAP_PORT") {
            Ok(p) => parse_port("MOELINK_BOOTSTRAP_PORT", &p)?,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(CommError::invalid(
                    "MOELINK_BOOTSTRAP_PORT",
                    "environment variable MOELINK_BOOTSTRAP_PORT is not valid UTF-8",
                ))
            }
            Err(std::env::VarError::NotPresent) => {
                let master = parse_port("MASTER_PORT", &env_var("MASTER_PORT")?)?;
                master.checked_add(1).ok_or_else(|| {
                    CommError::invalid(
                        "MASTER_PORT",
                        "MASTER_PORT is 65535, so the bootstrap port MASTER_PORT + 1 does not \
                         exist; set MOELINK_BOOTSTRAP_PORT",
                    )
                })?
            }
        };
        let addrs: Vec<SocketAddr> = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| io_err(format!("resolving MASTER_ADDR={host}"), e))?
            .collect();
        let addr = addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or_else(|| addrs.first())
            .copied()
            .ok_or_else(|| {
                CommError::invalid("MASTER_ADDR", format!("{host} resolves to no address"))
            })?;
        let nonce = match std::env::var("TORCHELASTIC_RUN_ID") {
            Ok(run_id) if !run_id.is_empty() => fnv1a(run_id.as_bytes()),
            _ => ENV_DEFAULT_NONCE,
        };
        UniqueId::from_parts(addr, nonce)
    }

    /// The root's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The job nonce.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// Fixed-size serialization ([`UniqueId::BYTES`] bytes); the listener does
    /// not travel.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::BYTES);
        out.extend_from_slice(&ID_MAGIC);
        out.push(ID_VERSION);
        out.extend_from_slice(&encode_addr(&self.addr));
        out.extend_from_slice(&self.nonce.to_le_bytes());
        debug_assert_eq!(out.len(), Self::BYTES);
        out
    }

    /// Parses [`to_bytes`](Self::to_bytes)' output; rejects anything else
    /// (wrong length, magic or version, bad address).
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        if bytes.len() != Self::BYTES {
            return Err(CommError::invalid(
                "id",
                format!(
                    "a bootstrap UniqueId is {} bytes, got {}",
                    Self::BYTES,
                    bytes.len()
                ),
            ));
        }
        if bytes[..4] != ID_MAGIC {
            return Err(CommError::invalid(
                "id",
                "not a moelink bootstrap UniqueId (bad magic)",
            ));
        }
        if bytes[4] != ID_VERSION {
            return Err(CommError::invalid(
                "id",
                format!(
                    "UniqueId layout version {} is not supported (expected {ID_VERSION})",
                    bytes[4]
                ),
            ));
        }
        let addr = decode_addr(&bytes[5..5 + ADDR_LEN])
            .ok_or_else(|| CommError::invalid("id", "the UniqueId holds no valid root address"))?;
        let nonce = u64_at(bytes, 24);
        UniqueId::from_parts(addr, nonce)
            .map_err(|_| CommError::invalid("id", "the UniqueId's root address has port 0"))
    }

    /// The listener bound by [`UniqueId::new`], if this id (or a clone) still
    /// holds it; taken at most once.
    fn take_listener(&self) -> Option<TcpListener> {
        self.listener.as_ref().and_then(|l| lock(l).take())
    }
}

impl PartialEq for UniqueId {
    fn eq(&self, other: &Self) -> bool {
        self.addr == other.addr && self.nonce == other.nonce
    }
}

impl Eq for UniqueId {}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holds = self.listener.as_ref().is_some_and(|l| lock(l).is_some());
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .field("nonce", &format_args!("{:#018x}", self.nonce))
            .field("holds_listener", &holds)
            .finish()
    }
}

/// Lowercase hex of [`UniqueId::to_bytes`] (64 characters).
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.to_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Parses the `Display` form (surrounding whitespace allowed).
impl FromStr for UniqueId {
    type Err = CommError;

    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * Self::BYTES || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(CommError::invalid(
                "id",
                format!(
                    "a bootstrap UniqueId string is {} hex digits, got {:?}",
                    2 * Self::BYTES,
                    truncate(s, 80)
                ),
            ));
        }
        let bytes: Vec<u8> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("checked hex digits"))
            .collect();
        UniqueId::from_bytes(&bytes)
    }
}

// ---------------------------------------------------------------------------
// TcpBootstrap

/// [`Bootstrap`] over TCP: see the module documentation for the protocol.
///
/// `Send + Sync`: sends to one peer are serialized by a per-connection lock,
/// and any number of threads may wait in `recv` at once. Dropping it says
/// goodbye to every peer, closes the connections and joins the receiver
/// threads.
pub struct TcpBootstrap {
    rank: usize,
    size: usize,
    root: SocketAddr,
    timeout_ns: AtomicU64,
    shared: Arc<Shared>,
    /// Indexed by peer; `None` at our own rank.
    links: Vec<Option<Link>>,
    readers: Vec<JoinHandle<()>>,
    gather_seq: AtomicU64,
    barrier_seq: AtomicU64,
}

/// The sending half of one peer connection.
struct Link {
    writer: Mutex<Writer>,
}

struct Writer {
    stream: TcpStream,
    /// Set when a write failed part-way: the stream's framing is lost.
    broken: Option<String>,
}

/// State shared with the receiver threads.
struct Shared {
    inbox: Mutex<Inbox>,
    arrived: Condvar,
    closing: AtomicBool,
}

struct Inbox {
    queues: HashMap<(usize, u64), VecDeque<Vec<u8>>>,
    /// Why each peer's connection ended, once it did.
    gone: Vec<Option<(ErrorKind, String)>>,
}

impl Inbox {
    fn pop(&mut self, key: (usize, u64)) -> Option<Vec<u8>> {
        let queue = self.queues.get_mut(&key)?;
        let msg = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(&key);
        }
        msg
    }
}

impl Shared {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inbox)
    }

    fn deliver(&self, peer: usize, tag: u64, payload: Vec<u8>) {
        self.inbox()
            .queues
            .entry((peer, tag))
            .or_default()
            .push_back(payload);
        self.arrived.notify_all();
    }

    fn mark_gone(&self, peer: usize, kind: ErrorKind, reason: String) {
        self.inbox().gone[peer].get_or_insert((kind, reason));
        self.arrived.notify_all();
    }
}

impl TcpBootstrap {
    /// Largest user tag: tags with the top bit set are reserved for collectives.
    pub const MAX_TAG: u64 = INTERNAL_TAG - 1;
    /// Largest message `send` accepts (the bootstrap is meant for small data).
    pub const MAX_MESSAGE_BYTES: usize = 1 << 30;

    /// Joins the job `id` as `rank` of `size`; returns once this rank is
    /// connected to every other rank. All of it is bounded by `timeout`, which
    /// also bounds every later blocking call (see [`set_timeout`](Self::set_timeout)).
    ///
    /// Rank 0 serves as the root: it takes over the listener held by `id` or
    /// binds `id.addr()`.
    pub fn new(id: &UniqueId, rank: usize, size: usize, timeout: Duration) -> Result<TcpBootstrap> {
        if size == 0 {
            return Err(CommError::invalid("size", "a job has at least one rank"));
        }
        if rank >= size {
            return Err(CommError::invalid(
                "rank",
                format!("rank {rank} is out of range for a job of {size} ranks"),
            ));
        }
        if timeout.is_zero() {
            return Err(CommError::invalid("timeout", "must be positive"));
        }
        let start = Instant::now();
        let setup = Setup {
            rank,
            size,
            id,
            start,
            deadline: start + timeout,
        };
        let streams = if rank == 0 {
            setup.as_root()?
        } else {
            setup.as_member()?
        };
        tracing::debug!(
            rank,
            size,
            root = %id.addr,
            ms = setup.start.elapsed().as_millis() as u64,
            "bootstrap connected"
        );
        Self::start(rank, size, id.addr, timeout, streams)
    }

    /// Joins a job launched by torchrun (or anything setting the same
    /// variables): rank from `RANK`, size from `WORLD_SIZE`, and the id from
    /// [`UniqueId::from_env`] (`MASTER_ADDR`, `MOELINK_BOOTSTRAP_PORT` or
    /// `MASTER_PORT + 1`, `TORCHELASTIC_RUN_ID`). Rank 0 binds the root
    /// listener on that address (or on all interfaces if `MASTER_ADDR` is not
    /// an address of this host).
    pub fn from_env(timeout: Duration) -> Result<TcpBootstrap> {
        let rank = parse_usize("RANK", &env_var("RANK")?)?;
        let size = parse_usize("WORLD_SIZE", &env_var("WORLD_SIZE")?)?;
        if rank >= size {
            return Err(CommError::invalid(
                "RANK",
                format!("RANK={rank} is out of range for WORLD_SIZE={size}"),
            ));
        }
        let id = UniqueId::from_env()?;
        Self::new(&id, rank, size, timeout)
    }

    /// The bound on every blocking call.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Changes the bound on later blocking calls (e.g. a generous one for
    /// setup, a short one afterwards).
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(CommError::invalid("timeout", "must be positive"));
        }
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        self.timeout_ns.store(ns, Ordering::Relaxed);
        for link in self.links.iter().flatten() {
            let writer = lock(&link.writer);
            writer
                .stream
                .set_write_timeout(Some(timeout))
                .map_err(|e| io_err("setting a bootstrap socket's write timeout", e))?;
        }
        Ok(())
    }

    /// The root's address (the job's [`UniqueId::addr`]).
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    /// Wraps the connected streams and starts one receiver thread per peer.
    fn start(
        rank: usize,
        size: usize,
        root: SocketAddr,
        timeout: Duration,
        streams: Vec<Option<TcpStream>>,
    ) -> Result<TcpBootstrap> {
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                queues: HashMap::new(),
                gone: vec![None; size],
            }),
            arrived: Condvar::new(),
            closing: AtomicBool::new(false),
        });
        let mut boot = TcpBootstrap {
            rank,
            size,
            root,
            timeout_ns: AtomicU64::new(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX)),
            shared,
            links: Vec::with_capacity(size),
            readers: Vec::with_capacity(size.saturating_sub(1)),
            gather_seq: AtomicU64::new(0),
            barrier_seq: AtomicU64::new(0),
        };
        // On an error below, dropping `boot` shuts down what was started.
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                boot.links.push(None);
                continue;
            };
            let ctx = || format!("rank {rank} preparing its connection to rank {peer}");
            stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_read_timeout(None))
                .and_then(|()| stream.set_write_timeout(Some(timeout)))
                .and_then(|()| stream.set_nodelay(true))
                .map_err(|e| io_err(ctx(), e))?;
            let reader = stream.try_clone().map_err(|e| io_err(ctx(), e))?;
            boot.links.push(Some(Link {
                writer: Mutex::new(Writer {
                    stream,
                    broken: None,
                }),
            }));
            let shared = Arc::clone(&boot.shared);
            let handle = std::thread::Builder::new()
                .name(format!("moelink-bs{rank}<{peer}"))
                .stack_size(READER_STACK)
                .spawn(move || receive_loop(&shared, rank, peer, reader))
                .map_err(|e| io_err(format!("rank {rank} starting a receiver thread"), e))?;
            boot.readers.push(handle);
        }
        Ok(boot)
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(CommError::invalid(
                "peer",
                format!(
                    "rank {peer} is out of range for a job of {} ranks",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    fn check_tag(tag: u64) -> Result<()> {
        if tag & INTERNAL_TAG != 0 {
            return Err(CommError::invalid(
                "tag",
                format!(
                    "tag {tag:#x} has the top bit set, which is reserved for the bootstrap's \
                     collectives (user tags are at most {:#x})",
                    Self::MAX_TAG
                ),
            ));
        }
        Ok(())
    }

    /// Sends one frame to `peer` (or files it in our own inbox), any tag.
    fn send_frame(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        if data.len() > Self::MAX_MESSAGE_BYTES {
            return Err(CommError::invalid(
                "data",
                format!(
                    "{} bytes is more than the bootstrap's limit of {} bytes per message",
                    data.len(),
                    Self::MAX_MESSAGE_BYTES
                ),
            ));
        }
        if peer == self.rank {
            self.shared.deliver(peer, tag, data.to_vec());
            return Ok(());
        }
        let context = || {
            format!(
                "rank {} sending {} bytes with tag {} to rank {peer}",
                self.rank,
                data.len(),
                tag_name(tag)
            )
        };
        if let Some((kind, reason)) = self.shared.inbox().gone[peer].clone() {
            return Err(io_err(context(), io::Error::new(kind, reason)));
        }
        let link = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        let mut writer = lock(&link.writer);
        if let Some(reason) = &writer.broken {
            return Err(io_err(
                context(),
                io::Error::new(ErrorKind::BrokenPipe, reason.clone()),
            ));
        }
        let header = encode_header(KIND_DATA, tag, data.len() as u64);
        let written = if data.len() <= COALESCE_LIMIT {
            let mut frame = Vec::with_capacity(HEADER_LEN + data.len());
            frame.extend_from_slice(&header);
            frame.extend_from_slice(data);
            writer.stream.write_all(&frame)
        } else {
            writer
                .stream
                .write_all(&header)
                .and_then(|()| writer.stream.write_all(data))
        };
        match written {
            Ok(()) => Ok(()),
            Err(e) => {
                writer.broken = Some(format!(
                    "an earlier send to rank {peer} failed part-way ({e}), so the connection is \
                     unusable"
                ));
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                    let waited = self.timeout();
                    Err(CommError::Timeout {
                        rank: self.rank as i64,
                        what: format!(
                            "rank {peer} to take {} bytes (tag {}) off its connection (is its \
                             process stalled?)",
                            data.len(),
                            tag_name(tag)
                        ),
                        waited_ms: (waited.as_millis() as u64).max(1),
                    })
                } else {
                    Err(io_err(context(), e))
                }
            }
        }
    }

    /// Waits until one message for each `(peer, tag)` in `keys` arrived, any of
    /// the awaited peers is gone, or the deadline passes. `what` describes what
    /// is awaited given the peers still missing. On failure, messages already
    /// taken go back to their queues.
    fn wait_messages(
        &self,
        keys: &[(usize, u64)],
        start: Instant,
        deadline: Instant,
        what: &dyn Fn(&[usize]) -> String,
    ) -> Result<Vec<Vec<u8>>> {
        let mut got: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        let mut left = keys.len();
        let mut inbox = self.shared.inbox();
        loop {
            for (slot, &key) in got.iter_mut().zip(keys) {
                if slot.is_none() {
                    if let Some(msg) = inbox.pop(key) {
                        *slot = Some(msg);
                        left -= 1;
                    }
                }
            }
            if left == 0 {
                return Ok(got.into_iter().flatten().collect());
            }
            let missing: Vec<usize> = keys
                .iter()
                .zip(&got)
                .filter(|(_, slot)| slot.is_none())
                .map(|(&(peer, _), _)| peer)
                .collect();
            let now = Instant::now();
            let failure =
                if let Some((kind, reason)) = missing.iter().find_map(|&p| inbox.gone[p].clone()) {
                    Some(io_err(
                        format!("rank {} waiting for {}", self.rank, what(&missing)),
                        io::Error::new(kind, reason),
                    ))
                } else if now >= deadline {
                    Some(CommError::Timeout {
                        rank: self.rank as i64,
                        what: what(&missing),
                        waited_ms: elapsed_ms(start),
                    })
                } else {
                    None
                };
            if let Some(err) = failure {
                for (slot, &key) in got.into_iter().zip(keys) {
                    if let Some(msg) = slot {
                        inbox.queues.entry(key).or_default().push_front(msg);
                    }
                }
                return Err(err);
            }
            inbox = self
                .shared
                .arrived
                .wait_timeout(inbox, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Sends `data` to every other rank under a fresh collective tag and
    /// gathers theirs. `what(missing, seq)` describes the wait.
    fn exchange(
        &self,
        op: u64,
        seq: u64,
        data: &[u8],
        what: &dyn Fn(&[usize]) -> String,
    ) -> Result<Vec<Vec<u8>>> {
        let start = Instant::now();
        let deadline = start + self.timeout();
        let tag = INTERNAL_TAG | (op << 56) | (seq & SEQ_MASK);
        // Start with the next rank so that not every rank hits rank 0 first.
        for k in 1..self.size {
            self.send_frame((self.rank + k) % self.size, tag, data)?;
        }
        let keys: Vec<(usize, u64)> = (0..self.size)
            .filter(|&p| p != self.rank)
            .map(|p| (p, tag))
            .collect();
        let mut theirs = self
            .wait_messages(&keys, start, deadline, what)?
            .into_iter();
        Ok((0..self.size)
            .map(|p| {
                if p == self.rank {
                    data.to_vec()
                } else {
                    theirs.next().expect("one message per peer")
                }
            })
            .collect())
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    /// Queues `data` on the connection to `peer` (into our own queue when
    /// `peer` is our rank). Fails at once if `peer` is known to be gone.
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        Self::check_tag(tag)?;
        self.send_frame(peer, tag, data)
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        Self::check_tag(tag)?;
        let start = Instant::now();
        let what = |_: &[usize]| {
            if peer == self.rank {
                format!("a message from rank {peer} (itself) with tag {tag}")
            } else {
                format!("a message from rank {peer} with tag {tag}")
            }
        };
        let mut msgs = self.wait_messages(&[(peer, tag)], start, start + self.timeout(), &what)?;
        Ok(msgs.pop().expect("one message"))
    }

    /// Every rank sends its data to every other rank directly (one message per
    /// pair), so a timeout names exactly the ranks whose data is missing.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.gather_seq.fetch_add(1, Ordering::Relaxed);
        let size = self.size;
        self.exchange(OP_ALL_GATHER, seq, data, &|missing| {
            format!(
                "the contributions of {} to all_gather #{seq} ({} of {size} ranks' data arrived)",
                describe_ranks(missing),
                size - missing.len()
            )
        })
    }

    /// Every rank signals every other rank, so a timeout names exactly the
    /// ranks that have not entered; `size - 1` tiny messages per rank.
    fn barrier(&self) -> Result<()> {
        let seq = self.barrier_seq.fetch_add(1, Ordering::Relaxed);
        let size = self.size;
        self.exchange(OP_BARRIER, seq, &[], &|missing| {
            format!(
                "{} to enter barrier #{seq} ({} of {size} ranks entered)",
                describe_ranks(missing),
                size - missing.len()
            )
        })
        .map(drop)
    }
}

impl fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gone: Vec<usize> = self
            .shared
            .inbox()
            .gone
            .iter()
            .enumerate()
            .filter_map(|(p, g)| g.as_ref().map(|_| p))
            .collect();
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("root", &self.root)
            .field("timeout", &self.timeout())
            .field("gone_peers", &gone)
            .finish()
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        let goodbye = encode_header(KIND_GOODBYE, 0, 0);
        for link in self.links.iter().flatten() {
            let mut writer = lock(&link.writer);
            if writer.broken.is_none() {
                let _ = writer.stream.set_write_timeout(Some(GOODBYE_WRITE_TIMEOUT));
                let _ = writer.stream.write_all(&goodbye);
            }
            // Sends FIN after the queued data and wakes our receiver thread.
            let _ = writer.stream.shutdown(Shutdown::Both);
        }
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

/// Body of a receiver thread: files every data frame from `peer` into the
/// inbox until the connection ends, then records why it ended.
fn receive_loop(shared: &Shared, rank: usize, peer: usize, mut stream: TcpStream) {
    let mut said_goodbye = false;
    let (kind, reason) = loop {
        let mut header = [0u8; HEADER_LEN];
        match read_frame_start(&mut stream, &mut header) {
            Ok(true) => {}
            Ok(false) if said_goodbye => {
                break (
                    ErrorKind::NotConnected,
                    format!("rank {peer} shut down its bootstrap"),
                )
            }
            Ok(false) => {
                break (
                    ErrorKind::UnexpectedEof,
                    format!(
                        "rank {peer} closed its connection without shutting down its bootstrap \
                         (did its process exit or crash?)"
                    ),
                )
            }
            Err(e) => break vanished(peer, &e),
        }
        let header = match decode_header(&header) {
            Ok(h) => h,
            Err(msg) => break malformed(peer, &msg),
        };
        match header.kind {
            KIND_DATA => {
                if header.len > TcpBootstrap::MAX_MESSAGE_BYTES as u64 {
                    break malformed(peer, &format!("a {}-byte message", header.len));
                }
                let mut payload = vec![0u8; header.len as usize];
                if let Err(e) = stream.read_exact(&mut payload) {
                    break vanished(peer, &e);
                }
                shared.deliver(peer, header.tag, payload);
            }
            KIND_GOODBYE => said_goodbye = true,
            other => break malformed(peer, &format!("frame kind {other} after setup")),
        }
    };
    if !shared.closing.load(Ordering::Relaxed) {
        tracing::debug!(rank, peer, %reason, "bootstrap connection ended");
    }
    shared.mark_gone(peer, kind, reason);
}

fn vanished(peer: usize, e: &io::Error) -> (ErrorKind, String) {
    (
        e.kind(),
        format!("the connection to rank {peer} broke ({e}); did its process exit or crash?"),
    )
}

fn malformed(peer: usize, what: &str) -> (ErrorKind, String) {
    (
        ErrorKind::InvalidData,
        format!("rank {peer} sent a malformed frame ({what}); the connection was dropped"),
    )
}

/// Reads a frame header; `Ok(false)` on a clean EOF before its first byte.
fn read_frame_start(stream: &mut TcpStream, header: &mut [u8; HEADER_LEN]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < HEADER_LEN {
        match stream.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame",
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

// ---------------------------------------------------------------------------
// Setup

/// One rank's side of forming the job, all bounded by `deadline`.
struct Setup<'a> {
    rank: usize,
    size: usize,
    id: &'a UniqueId,
    start: Instant,
    deadline: Instant,
}

/// Which hellos an accepting rank waits for.
struct HelloSpec {
    me: usize,
    size: usize,
    nonce: u64,
    kind: u32,
    /// Ranks expected to connect.
    from: Range<usize>,
    /// Acknowledge accepted hellos (CONNECT); the root answers REGISTER with
    /// the table later instead.
    ack: bool,
}

/// A rank's accepted connection and the listen address its hello announced.
type Accepted = Option<(TcpStream, Option<SocketAddr>)>;

/// A checked hello.
struct Hello {
    rank: usize,
    addr: Option<SocketAddr>,
}

/// An accepted connection whose hello is still arriving.
struct PendingHello {
    stream: TcpStream,
    from: SocketAddr,
    buf: [u8; HELLO_FRAME_LEN],
    filled: usize,
}

enum HelloProgress {
    Waiting,
    Complete,
    Dropped(String),
}

impl PendingHello {
    /// Reads what has arrived (the stream is non-blocking).
    fn poll(&mut self) -> HelloProgress {
        while self.filled < HELLO_FRAME_LEN {
            match self.stream.read(&mut self.buf[self.filled..]) {
                Ok(0) => return HelloProgress::Dropped("closed before its hello".into()),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return HelloProgress::Waiting,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return HelloProgress::Dropped(e.to_string()),
            }
            if self.filled >= 4 && self.buf[..4] != FRAME_MAGIC.to_le_bytes() {
                return HelloProgress::Dropped("not a moelink bootstrap peer".into());
            }
        }
        HelloProgress::Complete
    }
}

impl HelloSpec {
    /// `Ok` for an expected hello; `Err((reply, reason))` otherwise, where
    /// `reply` says whether to send the connecting side the reason.
    fn check(
        &self,
        buf: &[u8; HELLO_FRAME_LEN],
        got: &[Accepted],
    ) -> std::result::Result<Hello, (bool, String)> {
        let header =
            decode_header(buf[..HEADER_LEN].try_into().expect("header")).map_err(|e| (false, e))?;
        if header.len != HELLO_PAYLOAD as u64 {
            return Err((false, format!("a hello of {} bytes", header.len)));
        }
        let p = &buf[HEADER_LEN..];
        let version = u32_at(p, 0);
        let nonce = u64_at(p, 4);
        let rank = u64_at(p, 12);
        let size = u64_at(p, 20);
        let addr = decode_addr(&p[28..28 + ADDR_LEN]);
        let me = self.me;
        if version != PROTOCOL_VERSION {
            return Err((
                true,
                format!(
                    "rank {me} speaks bootstrap protocol version {PROTOCOL_VERSION}, the \
                     connecting rank {version}"
                ),
            ));
        }
        if nonce != self.nonce {
            return Err((
                true,
                format!(
                    "rank {me} at this address belongs to a different job (job nonce {:#018x}, \
                     the connecting rank's {nonce:#018x}); are two jobs sharing one root \
                     address?",
                    self.nonce
                ),
            ));
        }
        if size != self.size as u64 {
            return Err((
                true,
                format!(
                    "the connecting rank {rank} was started with size {size}, but rank {me} with \
                     size {}",
                    self.size
                ),
            ));
        }
        if header.kind != self.kind {
            return Err((
                true,
                format!(
                    "rank {me} expected a {} hello, got kind {}",
                    kind_name(self.kind),
                    header.kind
                ),
            ));
        }
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        if !self.from.contains(&rank) {
            return Err((
                true,
                format!(
                    "rank {me} expects connections from ranks {}..{} only, not rank {rank}",
                    self.from.start, self.from.end
                ),
            ));
        }
        if got[rank].is_some() {
            return Err((
                true,
                format!("rank {rank} already joined; is the same rank started twice?"),
            ));
        }
        if self.kind == KIND_REGISTER && addr.is_none() {
            return Err((true, format!("rank {rank}'s listen address is invalid")));
        }
        Ok(Hello { rank, addr })
    }
}

impl Setup<'_> {
    /// Rank 0: collects every registration, then answers each with the table.
    fn as_root(&self) -> Result<Vec<Option<TcpStream>>> {
        let listener = match self.id.take_listener() {
            Some(l) => l,
            None => bind_root(self.id.addr)?,
        };
        let mut streams: Vec<Option<TcpStream>> = (0..self.size).map(|_| None).collect();
        if self.size == 1 {
            return Ok(streams);
        }
        let spec = HelloSpec {
            me: 0,
            size: self.size,
            nonce: self.id.nonce,
            kind: KIND_REGISTER,
            from: 1..self.size,
            ack: false,
        };
        let mut got = accept_hellos(&listener, &spec, self.deadline, None)?;
        drop(listener);
        let missing: Vec<usize> = (1..self.size).filter(|&r| got[r].is_none()).collect();
        if !missing.is_empty() {
            let what = format!(
                "{} to join ({} of {} ranks registered)",
                describe_ranks(&missing),
                self.size - missing.len(),
                self.size
            );
            let abort = format!("the root gave up waiting for {what}");
            for (stream, _) in got.iter_mut().flatten() {
                let _ = stream.set_write_timeout(Some(GOODBYE_WRITE_TIMEOUT));
                let _ = write_frame(stream, KIND_ABORT, abort.as_bytes());
            }
            return Err(CommError::Timeout {
                rank: 0,
                what,
                waited_ms: elapsed_ms(self.start),
            });
        }
        let mut table = Vec::with_capacity(self.size * ADDR_LEN);
        table.extend_from_slice(&encode_addr(&self.id.addr));
        for entry in &got[1..] {
            let addr = entry.as_ref().and_then(|(_, a)| *a).expect("checked");
            table.extend_from_slice(&encode_addr(&addr));
        }
        for (r, entry) in got.into_iter().enumerate().skip(1) {
            let (mut stream, _) = entry.expect("all registered");
            let sent = remaining(self.deadline)
                .ok_or_else(|| io::Error::new(ErrorKind::TimedOut, "setup deadline passed"))
                .and_then(|left| stream.set_write_timeout(Some(left)))
                .and_then(|()| write_frame(&mut stream, KIND_TABLE, &table));
            sent.map_err(|e| io_err(format!("rank 0 sending the address table to rank {r}"), e))?;
            streams[r] = Some(stream);
        }
        Ok(streams)
    }

    /// Rank r > 0: registers with the root, then builds its part of the mesh.
    fn as_member(&self) -> Result<Vec<Option<TcpStream>>> {
        let (rank, size, root) = (self.rank, self.size, self.id.addr);
        let mut root_stream = connect_retry(root, self.deadline, None).map_err(|last| {
            self.timeout(format!(
                "the root (rank 0) at {root} to accept registration (last attempt: {last})"
            ))
        })?;
        let local_ip = root_stream
            .local_addr()
            .map_err(|e| {
                io_err(
                    format!("rank {rank} reading its address toward the root"),
                    e,
                )
            })?
            .ip();
        let listener = TcpListener::bind((local_ip, 0))
            .map_err(|e| io_err(format!("rank {rank} binding its listener on {local_ip}"), e))?;
        let my_addr = listener
            .local_addr()
            .map_err(|e| io_err(format!("rank {rank} reading its listener's address"), e))?;
        let register = encode_hello(KIND_REGISTER, self.id.nonce, rank, size, &my_addr);
        self.write_by_deadline(&mut root_stream, &register)
            .map_err(|e| {
                io_err(
                    format!("rank {rank} registering with the root at {root}"),
                    e,
                )
            })?;

        let table_what = || {
            format!(
                "the address table from the root (rank 0) at {root}, sent once all {size} ranks \
                 have registered"
            )
        };
        let (kind, payload) = match read_frame_by(&mut root_stream, self.deadline) {
            Ok(frame) => frame,
            Err(ReadFail::Timeout) => return Err(self.timeout(table_what())),
            Err(ReadFail::Io(e)) => {
                return Err(io_err(
                    format!(
                        "rank {rank} waiting for the address table from the root (rank 0) at \
                         {root} (did the root exit?)"
                    ),
                    e,
                ))
            }
            Err(ReadFail::Protocol(msg)) => {
                return Err(io_err(
                    format!("rank {rank} registering with the root at {root}"),
                    io::Error::new(ErrorKind::InvalidData, msg),
                ))
            }
        };
        let table = match kind {
            KIND_TABLE if payload.len() == size * ADDR_LEN => payload
                .chunks_exact(ADDR_LEN)
                .map(decode_addr)
                .collect::<Option<Vec<SocketAddr>>>(),
            KIND_REJECT => {
                return Err(CommError::invalid(
                    "id",
                    format!(
                        "the bootstrap root at {root} rejected rank {rank}: {}",
                        String::from_utf8_lossy(&payload)
                    ),
                ))
            }
            KIND_ABORT => {
                return Err(self.timeout(format!(
                    "the address table from the root (rank 0) at {root}: {}",
                    String::from_utf8_lossy(&payload)
                )))
            }
            _ => None,
        }
        .ok_or_else(|| {
            io_err(
                format!("rank {rank} registering with the root at {root}"),
                io::Error::new(
                    ErrorKind::InvalidData,
                    format!(
                        "unexpected reply (kind {kind}, {} bytes) instead of the address table",
                        payload.len()
                    ),
                ),
            )
        })?;

        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        streams[0] = Some(root_stream);
        let stop = AtomicBool::new(false);
        let spec = HelloSpec {
            me: rank,
            size,
            nonce: self.id.nonce,
            kind: KIND_CONNECT,
            from: rank + 1..size,
            ack: true,
        };
        let (lower, higher) = std::thread::scope(|s| {
            let connector = s.spawn(|| {
                let res = self.connect_lower(&table, &my_addr, &stop);
                if res.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                res
            });
            let accepted = accept_hellos(&listener, &spec, self.deadline, Some(&stop));
            if !matches!(&accepted, Ok(got) if got[spec.from.clone()].iter().all(Option::is_some)) {
                stop.store(true, Ordering::Relaxed);
            }
            let connected = connector.join().unwrap_or_else(|_| {
                Err(Some(io_err(
                    format!("rank {rank} connecting to lower ranks"),
                    io::Error::other("the connecting thread panicked"),
                )))
            });
            (connected, accepted)
        });
        // A connect error is the cause unless it is only the echo of `stop`.
        let lower = match lower {
            Ok(lower) => lower,
            Err(Some(e)) => return Err(e),
            Err(None) => Vec::new(),
        };
        let higher = higher?;
        let missing: Vec<usize> = spec.from.clone().filter(|&r| higher[r].is_none()).collect();
        if !missing.is_empty() {
            return Err(self.timeout(format!(
                "{} to connect to rank {rank}'s listener at {my_addr} (mesh setup; {} of {} \
                 higher ranks connected)",
                describe_ranks(&missing),
                spec.from.len() - missing.len(),
                spec.from.len()
            )));
        }
        for (peer, stream) in lower {
            streams[peer] = Some(stream);
        }
        for (peer, entry) in higher.into_iter().enumerate() {
            if let Some((stream, _)) = entry {
                streams[peer] = Some(stream);
            }
        }
        let unlinked: Vec<usize> = (0..size)
            .filter(|&p| p != rank && streams[p].is_none())
            .collect();
        if !unlinked.is_empty() {
            return Err(self.timeout(format!(
                "connections with {} (mesh setup)",
                describe_ranks(&unlinked)
            )));
        }
        Ok(streams)
    }

    /// Connects to ranks 1..rank, sending each a hello and awaiting its ack.
    /// `Err(None)` when stopped because the accepting side failed.
    fn connect_lower(
        &self,
        table: &[SocketAddr],
        my_addr: &SocketAddr,
        stop: &AtomicBool,
    ) -> std::result::Result<Vec<(usize, TcpStream)>, Option<CommError>> {
        let rank = self.rank;
        let hello = encode_hello(KIND_CONNECT, self.id.nonce, rank, self.size, my_addr);
        let mut out = Vec::with_capacity(rank.saturating_sub(1));
        for (peer, &addr) in table.iter().enumerate().take(rank).skip(1) {
            let mut stream = match connect_retry(addr, self.deadline, Some(stop)) {
                Ok(s) => s,
                Err(_) if stop.load(Ordering::Relaxed) => return Err(None),
                Err(last) => {
                    return Err(Some(self.timeout(format!(
                        "rank {peer} at {addr} to accept rank {rank}'s connection (last \
                         attempt: {last})"
                    ))))
                }
            };
            let ctx = || format!("rank {rank} connecting to rank {peer} at {addr}");
            self.write_by_deadline(&mut stream, &hello)
                .map_err(|e| Some(io_err(ctx(), e)))?;
            match read_frame_by(&mut stream, self.deadline) {
                Ok((KIND_ACK, _)) => out.push((peer, stream)),
                Ok((KIND_REJECT, reason)) => {
                    return Err(Some(CommError::invalid(
                        "id",
                        format!(
                            "rank {peer} at {addr} rejected rank {rank}'s connection: {}",
                            String::from_utf8_lossy(&reason)
                        ),
                    )))
                }
                Ok((kind, _)) => {
                    return Err(Some(io_err(
                        ctx(),
                        io::Error::new(
                            ErrorKind::InvalidData,
                            format!("unexpected frame kind {kind} instead of an ack"),
                        ),
                    )))
                }
                Err(_) if stop.load(Ordering::Relaxed) => return Err(None),
                Err(ReadFail::Timeout) => {
                    return Err(Some(self.timeout(format!(
                        "rank {peer} at {addr} to acknowledge rank {rank}'s connection"
                    ))))
                }
                Err(ReadFail::Io(e)) => return Err(Some(io_err(ctx(), e))),
                Err(ReadFail::Protocol(msg)) => {
                    return Err(Some(io_err(
                        ctx(),
                        io::Error::new(ErrorKind::InvalidData, msg),
                    )))
                }
            }
        }
        Ok(out)
    }

    fn write_by_deadline(&self, stream: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
        let left = remaining(self.deadline)
            .ok_or_else(|| io::Error::new(ErrorKind::TimedOut, "setup deadline passed"))?;
        stream.set_write_timeout(Some(left))?;
        stream.write_all(bytes)
    }

    fn timeout(&self, what: String) -> CommError {
        CommError::Timeout {
            rank: self.rank as i64,
            what,
            waited_ms: elapsed_ms(self.start),
        }
    }
}

/// Binds the root listener on `addr`, or on all interfaces with `addr`'s port
/// if `addr` is not an address of this host (e.g. `MASTER_ADDR` names a
/// service address that forwards here).
fn bind_root(addr: SocketAddr) -> Result<TcpListener> {
    match TcpListener::bind(addr) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == ErrorKind::AddrNotAvailable && !addr.ip().is_unspecified() => {
            let any: IpAddr = if addr.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                Ipv6Addr::UNSPECIFIED.into()
            };
            tracing::info!(%addr, "root address is not local; listening on all interfaces");
            TcpListener::bind((any, addr.port())).map_err(|e| {
                io_err(
                    format!(
                        "rank 0 binding the bootstrap root listener on {any}:{}",
                        addr.port()
                    ),
                    e,
                )
            })
        }
        Err(e) => Err(io_err(
            format!(
                "rank 0 binding the bootstrap root listener on {addr} (if the port is in use, \
                 another job may hold it; choose another, e.g. with MOELINK_BOOTSTRAP_PORT)"
            ),
            e,
        )),
    }
}

/// Accepts connections until every rank in `spec.from` sent an acceptable
/// hello, the deadline passes or `stop` is set. Returns the accepted streams
/// (blocking again) indexed by rank; the caller checks which are missing.
fn accept_hellos(
    listener: &TcpListener,
    spec: &HelloSpec,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<Vec<Accepted>> {
    let me = spec.me;
    listener
        .set_nonblocking(true)
        .map_err(|e| io_err(format!("rank {me} preparing its listener"), e))?;
    let mut got: Vec<Accepted> = (0..spec.size).map(|_| None).collect();
    let mut missing = spec.from.len();
    let mut pending: Vec<PendingHello> = Vec::new();
    while missing > 0
        && Instant::now() < deadline
        && !stop.is_some_and(|s| s.load(Ordering::Relaxed))
    {
        let mut progressed = false;
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    progressed = true;
                    if stream.set_nonblocking(true).is_ok() {
                        pending.push(PendingHello {
                            stream,
                            from,
                            buf: [0; HELLO_FRAME_LEN],
                            filled: 0,
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted
                            | ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    return Err(io_err(
                        format!("rank {me} accepting bootstrap connections"),
                        e,
                    ))
                }
            }
        }
        let mut i = 0;
        while i < pending.len() {
            match pending[i].poll() {
                HelloProgress::Waiting => i += 1,
                HelloProgress::Dropped(why) => {
                    progressed = true;
                    let p = pending.swap_remove(i);
                    tracing::debug!(rank = me, from = %p.from, %why, "dropped a bootstrap connection");
                }
                HelloProgress::Complete => {
                    progressed = true;
                    let mut p = pending.swap_remove(i);
                    match spec.check(&p.buf, &got) {
                        Ok(hello) => {
                            let ready = p.stream.set_nonblocking(false).and_then(|()| {
                                if spec.ack {
                                    p.stream.set_write_timeout(Some(GOODBYE_WRITE_TIMEOUT))?;
                                    write_frame(&mut p.stream, KIND_ACK, &[])
                                } else {
                                    Ok(())
                                }
                            });
                            match ready {
                                Ok(()) => {
                                    got[hello.rank] = Some((p.stream, hello.addr));
                                    missing -= 1;
                                }
                                Err(e) => tracing::debug!(
                                    rank = me,
                                    peer = hello.rank,
                                    error = %e,
                                    "a bootstrap connection failed during its handshake"
                                ),
                            }
                        }
                        Err((reply, reason)) => {
                            tracing::warn!(
                                rank = me,
                                from = %p.from,
                                %reason,
                                "rejected a bootstrap connection"
                            );
                            if reply {
                                let _ = p.stream.set_nonblocking(false);
                                let _ = p.stream.set_write_timeout(Some(GOODBYE_WRITE_TIMEOUT));
                                let _ = write_frame(&mut p.stream, KIND_REJECT, reason.as_bytes());
                            }
                        }
                    }
                }
            }
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(got)
}

/// Connects to `addr`, retrying with backoff until `deadline` (or `stop`).
/// The error is the last attempt's.
fn connect_retry(
    addr: SocketAddr,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> std::result::Result<TcpStream, io::Error> {
    let mut backoff = Duration::from_millis(5);
    let mut last = io::Error::new(ErrorKind::TimedOut, "no attempt before the deadline");
    loop {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Err(last);
        }
        let Some(left) = remaining(deadline) else {
            return Err(last);
        };
        match TcpStream::connect_timeout(&addr, left) {
            // Nothing listened yet at a port of the ephemeral range, and the
            // kernel gave this socket that very port: a TCP simultaneous open
            // with itself (seen with 8 ranks starting at once: a rank read its
            // own registration back). Not the peer: retry.
            Ok(stream) if is_self_connection(&stream) => {
                last = io::Error::new(
                    ErrorKind::ConnectionRefused,
                    format!("connected to itself at {addr} (nothing listening there yet)"),
                );
            }
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) => last = e,
        }
        let Some(left) = remaining(deadline) else {
            return Err(last);
        };
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Whether `stream` is connected to its own address (a TCP self-connection).
fn is_self_connection(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(l), Ok(p)) if l == p)
}

// ---------------------------------------------------------------------------
// Frames

struct Header {
    kind: u32,
    tag: u64,
    len: u64,
}

fn encode_header(kind: u32, tag: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&tag.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

fn decode_header(h: &[u8; HEADER_LEN]) -> std::result::Result<Header, String> {
    let magic = u32_at(h, 0);
    if magic != FRAME_MAGIC {
        return Err(format!("bad frame magic {magic:#010x}"));
    }
    Ok(Header {
        kind: u32_at(h, 4),
        tag: u64_at(h, 8),
        len: u64_at(h, 16),
    })
}

fn write_frame(stream: &mut TcpStream, kind: u32, payload: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&encode_header(kind, 0, payload.len() as u64));
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

fn encode_hello(kind: u32, nonce: u64, rank: usize, size: usize, addr: &SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_FRAME_LEN);
    out.extend_from_slice(&encode_header(kind, 0, HELLO_PAYLOAD as u64));
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&nonce.to_le_bytes());
    out.extend_from_slice(&(rank as u64).to_le_bytes());
    out.extend_from_slice(&(size as u64).to_le_bytes());
    out.extend_from_slice(&encode_addr(addr));
    debug_assert_eq!(out.len(), HELLO_FRAME_LEN);
    out
}

enum ReadFail {
    Timeout,
    Io(io::Error),
    Protocol(String),
}

/// Reads one setup frame (header and payload) from a blocking stream by
/// `deadline`.
fn read_frame_by(
    stream: &mut TcpStream,
    deadline: Instant,
) -> std::result::Result<(u32, Vec<u8>), ReadFail> {
    let mut header = [0u8; HEADER_LEN];
    read_exact_by(stream, &mut header, deadline)?;
    let h = decode_header(&header).map_err(ReadFail::Protocol)?;
    if h.len > MAX_SETUP_PAYLOAD {
        return Err(ReadFail::Protocol(format!(
            "a {}-byte setup message (kind {})",
            h.len, h.kind
        )));
    }
    let mut payload = vec![0u8; h.len as usize];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((h.kind, payload))
}

fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::result::Result<(), ReadFail> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = remaining(deadline).ok_or(ReadFail::Timeout)?;
        stream.set_read_timeout(Some(left)).map_err(ReadFail::Io)?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(ReadFail::Io(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the connection was closed",
                )))
            }
            Ok(n) => filled += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(ReadFail::Io(e)),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Helpers

fn encode_addr(addr: &SocketAddr) -> [u8; ADDR_LEN] {
    let mut out = [0u8; ADDR_LEN];
    match addr.ip() {
        IpAddr::V4(ip) => {
            out[0] = 4;
            out[3..7].copy_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out[0] = 6;
            out[3..19].copy_from_slice(&ip.octets());
        }
    }
    out[1..3].copy_from_slice(&addr.port().to_be_bytes());
    out
}

/// `None` for an unknown family or non-zero padding.
fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    let port = u16::from_be_bytes([b[1], b[2]]);
    let ip: IpAddr = match b[0] {
        4 if b[7..19].iter().all(|&x| x == 0) => {
            Ipv4Addr::from(<[u8; 4]>::try_from(&b[3..7]).ok()?).into()
        }
        6 => Ipv6Addr::from(<[u8; 16]>::try_from(&b[3..19]).ok()?).into(),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn io_err(context: impl Into<String>, source: io::Error) -> CommError {
    CommError::Io {
        context: context.into(),
        source,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Time left before `deadline`; `None` once under a millisecond.
fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| *d >= Duration::from_millis(1))
}

/// Milliseconds since `start`, at least 1 (0 in `Timeout` marks a device wait,
/// bounded by GPU time, not a host one).
fn elapsed_ms(start: Instant) -> u64 {
    (start.elapsed().as_millis() as u64).max(1)
}

/// "rank 3", "ranks 2, 5" or "ranks 0, 1, ... and 12 more".
fn describe_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 8;
    let list: Vec<String> = ranks.iter().take(SHOWN).map(|r| r.to_string()).collect();
    let mut s = format!(
        "{} {}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        list.join(", ")
    );
    if ranks.len() > SHOWN {
        s.push_str(&format!(" and {} more", ranks.len() - SHOWN));
    }
    s
}

/// A user tag as a number; collective tags by what they carry.
fn tag_name(tag: u64) -> String {
    if tag & INTERNAL_TAG == 0 {
        return tag.to_string();
    }
    let op = match (tag >> 56) & 0x7f {
        OP_ALL_GATHER => "all_gather",
        OP_BARRIER => "barrier",
        _ => "collective",
    };
    format!("{op} #{}", tag & SEQ_MASK)
}

fn kind_name(kind: u32) -> &'static str {
    match kind {
        KIND_REGISTER => "registration",
        KIND_CONNECT => "connection",
        _ => "setup",
    }
}

fn env_var(name: &'static str) -> Result<String> {
    std::env::var(name).map_err(|e| {
        CommError::invalid(
            name,
            match e {
                std::env::VarError::NotPresent => format!(
                    "environment variable {name} is not set (the environment bootstrap reads \
                     RANK, WORLD_SIZE, MASTER_ADDR and MOELINK_BOOTSTRAP_PORT or MASTER_PORT, as \
                     set by torchrun)"
                ),
                std::env::VarError::NotUnicode(_) => {
                    format!("environment variable {name} is not valid UTF-8")
                }
            },
        )
    })
}

fn parse_usize(name: &'static str, value: &str) -> Result<usize> {
    value.trim().parse().map_err(|_| {
        CommError::invalid(
            name,
            format!("{name}={value:?} is not a non-negative integer"),
        )
    })
}

fn parse_port(name: &'static str, value: &str) -> Result<u16> {
    match value.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(CommError::invalid(
            name,
            format!("{name}={value:?} is not a TCP port (1..=65535)"),
        )),
    }
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// 64-bit FNV-1a: stable across builds, so every rank derives the same nonce.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A nonce from the OS's randomness (via `/dev/urandom` and std's randomly
/// keyed hasher), mixed with time, pid and a counter.
fn random_nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let mut b = [0u8; 8];
        if f.read_exact(&mut b).is_ok() {
            h.write(&b);
        }
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::os::fd::FromRawFd;

    /// A socket bound to 127.0.0.1:P and connected to 127.0.0.1:P: what
    /// `connect` can produce when nothing listens at an ephemeral port P.
    fn self_connected() -> TcpStream {
        // SAFETY: plain socket calls on a fresh descriptor with valid,
        // correctly sized sockaddr_in structures; the fd is owned by the
        // returned TcpStream.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let mut a: libc::sockaddr_in = std::mem::zeroed();
            a.sin_family = libc::AF_INET as libc::sa_family_t;
            a.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&raw const a).cast(), len), 0);
            let mut got = len;
            assert_eq!(libc::getsockname(fd, (&raw mut a).cast(), &mut got), 0);
            assert_eq!(libc::connect(fd, (&raw const a).cast(), len), 0);
            TcpStream::from_raw_fd(fd)
        }
    }

    #[test]
    fn a_self_connection_is_recognised_and_a_real_one_is_not() {
        assert!(is_self_connection(&self_connected()));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!is_self_connection(&c));
    }
}
