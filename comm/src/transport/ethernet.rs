//! Ethernet transport: any two processes, over TCP.
//!
//! The owner of a buffer runs an [`EthernetReceiver`] and registers the regions
//! peers may touch; its address travels in [`MemoryInfo::ethernet`]. A peer opens
//! an [`EthernetConnection`] to it and sends framed operations, which the
//! receiver applies to its memory in order, one thread per connection:
//!
//! | operation | host memory | GPU memory |
//! |---|---|---|
//! | WRITE | copy into the region | `cuMemcpyHtoDAsync` + bounded stream sync |
//! | SIGNAL | `AtomicU64` store (release) | 8-byte copy, after the preceding writes completed |
//! | ATOMIC | `AtomicU64` / `AtomicU32` `fetch_add` | `kernels::atomic_add` + bounded stream sync |
//! | FLUSH | answered with FLUSH_ACK once everything before it was applied | |
//! | IMM | the (immediate, record) of a signal or add, decoded and applied as IB verbs' receiving proxy does ([`super::ib::imm`]) | |
//!
//! Memory is touched through [`super::inbound::Regions`], the code the IB
//! receiving proxy uses too. A connection in the `host-no-atomic` signalling
//! mode ([`EthernetConnection::with_signal_mode`]) sends its signals and adds
//! as IMM frames, so CPU tests drive that path of IB verbs end to end.
//!
//! An operation that does not fall entirely inside a registered region is
//! rejected: the receiver logs it and sends ERROR back on that connection, and
//! the sender's next [`Connection::flush`] returns it.
//!
//! Wire format (little-endian): every frame starts with a 32-byte header
//! `magic u32 | op u8 | flag u8 | 0u16 | seq u64 | ptr u64 | arg u64`. WRITE is
//! followed by `arg` payload bytes (at most [`CHUNK`]; larger writes are split
//! into several frames), ERROR by `arg` bytes of UTF-8 message, IMM (`arg`: the
//! immediate) by a 32-byte record. `flag` is the width of an ATOMIC (4 or 8)
//! and the kind of an ERROR.
//!
//! [`MemoryInfo::ethernet`]: crate::registered_memory::MemoryInfo::ethernet

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::ib::config::SignalMode;
use super::ib::imm::{self, Action, Record};
use super::inbound::{ApplyError, ApplyStreams, Op, Regions};
use super::{AtomicAdd, AtomicWidth, Connection, Put, Transport};
use crate::cuda::{Device, OwnedStream, RestoreCurrent};
use crate::error::{CommError, CudaResultExt, Result};
use crate::registered_memory::{Location, RegisteredMemory};
use crate::wire::{u32_at, u64_at};

/// Largest payload of one WRITE frame: larger writes are sent as several frames,
/// so neither side ever holds more than this much of a write in memory.
pub const CHUNK: usize = 4 << 20;
/// How long one operation may wait for the socket to take its bytes before the
/// connection is declared broken (a stalled or stopped receiver).
pub const SEND_TIMEOUT: Duration = Duration::from_secs(60);

const MAGIC: u32 = 0x4d4c_4554; // "MLET"
const HEADER: usize = 32;
const MAX_ERROR_MESSAGE: u64 = 64 << 10;
/// Blocking socket calls wake this often to check for shutdown or a deadline.
const POLL: Duration = Duration::from_millis(100);

const OP_HELLO: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_SIGNAL: u8 = 3;
const OP_ATOMIC: u8 = 4;
const OP_FLUSH: u8 = 5;
const OP_FLUSH_ACK: u8 = 6;
const OP_ERROR: u8 = 7;
/// A signal or add as (immediate, record): `arg` the immediate, followed by
/// the [`imm::RECORD_BYTES`]-byte record (the `host-no-atomic` path of IB
/// verbs, which the receiver applies with the same code).
const OP_IMM: u8 = 8;

/// ERROR kinds: the operation was not allowed / applying it failed.
const ERR_REJECTED: u8 = 1;
const ERR_FAILED: u8 = 2;

#[derive(Clone, Copy, Debug, Default)]
struct Header {
    op: u8,
    flag: u8,
    seq: u64,
    ptr: u64,
    arg: u64,
}

impl Header {
    fn new(op: u8, ptr: u64, arg: u64) -> Self {
        Self {
            op,
            ptr,
            arg,
            ..Self::default()
        }
    }

    fn seq(self, seq: u64) -> Self {
        Self { seq, ..self }
    }

    fn flag(self, flag: u8) -> Self {
        Self { flag, ..self }
    }

    fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.flag;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.ptr.to_le_bytes());
        b[24..32].copy_from_slice(&self.arg.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER]) -> std::result::Result<Self, String> {
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(format!(
                "bad frame magic {magic:#010x} (not a moelink Ethernet peer)"
            ));
        }
        Ok(Self {
            op: b[4],
            flag: b[5],
            seq: u64_at(b, 8),
            ptr: u64_at(b, 16),
            arg: u64_at(b, 24),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn io_error(context: String, source: io::Error) -> CommError {
    CommError::Io { context, source }
}

fn is_retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Fills `buf` from a socket with a read timeout of [`POLL`], checking `stop`
/// at every timeout. `Ok(false)`: the peer closed before the first byte, or
/// `stop` was raised.
fn read_full(sock: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match sock.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if is_retry(&e) => {
                if stop.load(Ordering::Acquire) {
                    return Ok(false);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes all of `buf` to a socket with a write timeout of [`POLL`], giving up
/// (TimedOut) when `give_up` says so at a timeout.
fn send_all(sock: &mut TcpStream, mut buf: &[u8], give_up: impl Fn() -> bool) -> io::Result<()> {
    while !buf.is_empty() {
        match sock.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if is_retry(&e) => {
                if give_up() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- receiver --

#[derive(Debug)]
struct Shared {
    rank: usize,
    /// What peers may touch, and how their operations are applied.
    regions: Regions,
    stop: AtomicBool,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// The owner side of the Ethernet transport: accepts connections from peers and
/// applies their operations to this process's registered memory (host or GPU).
/// Its threads stop on [`EthernetReceiver::shutdown`] or when it is dropped.
pub struct EthernetReceiver {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for EthernetReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EthernetReceiver")
            .field("rank", &self.shared.rank)
            .field("address", &self.addr)
            .field("regions", &self.shared.regions.len())
            .finish()
    }
}

impl EthernetReceiver {
    /// Listens on `bind` (port 0: an ephemeral port) and starts accepting. GPU
    /// regions can only be registered with a receiver given `device`, the device
    /// they live on. `rank` is this process's rank, for messages.
    pub fn start(bind: SocketAddr, device: Option<Device>, rank: usize) -> Result<Arc<Self>> {
        let fail = |e| {
            io_error(
                format!("starting rank {rank}'s Ethernet receiver on {bind}"),
                e,
            )
        };
        let listener = TcpListener::bind(bind).map_err(fail)?;
        listener.set_nonblocking(true).map_err(fail)?;
        let addr = listener.local_addr().map_err(fail)?;
        let shared = Arc::new(Shared {
            rank,
            regions: Regions::new(rank, device),
            stop: AtomicBool::new(false),
            workers: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name(format!("eth-accept-{rank}"))
            .spawn(move || accept_loop(&s, listener))
            .map_err(fail)?;
        tracing::debug!("rank {rank}: Ethernet receiver listening on {addr}");
        Ok(Arc::new(Self {
            shared,
            addr,
            accept: Mutex::new(Some(accept)),
        }))
    }

    /// The "ip:port" peers connect to (what goes into `MemoryInfo::ethernet`).
    /// A receiver bound to an unspecified address (0.0.0.0) reports it as such,
    /// which only peers on this host can use.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Lets peers write, signal and add into `[ptr, ptr + len)` of `location`
    /// (replacing any registration starting at `ptr`). The caller keeps that
    /// memory valid until [`unregister`](Self::unregister) returns or the
    /// receiver is shut down.
    pub fn register(&self, ptr: u64, len: u64, location: Location) {
        self.shared.regions.register(ptr, len, location);
    }

    /// [`register`](Self::register) for a cuMem allocation (mapped
    /// process-wide): peers' operations on it go on the proxies' own context
    /// ([`super::inbound`]).
    pub fn register_process_wide(&self, ptr: u64, len: u64, location: Location) {
        self.shared
            .regions
            .register_process_wide(ptr, len, location);
    }

    /// Removes the registration starting at `ptr`. Once this returns, no
    /// operation touches that memory; later ones are rejected.
    pub fn unregister(&self, ptr: u64) {
        self.shared.regions.unregister(ptr);
    }

    /// Stops accepting, closes every connection and waits for the receiver's
    /// threads (each notices within 100 ms, or once its GPU operation finished).
    /// Idempotent; also done on drop.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.accept).take() {
            let _ = h.join();
        }
        let workers = std::mem::take(&mut *lock(&self.shared.workers));
        for h in workers {
            let _ = h.join();
        }
    }
}

impl Drop for EthernetReceiver {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((sock, peer)) => spawn_worker(shared, sock, peer),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let mut pfd = libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, alive for the duration of the call.
                unsafe { libc::poll(&mut pfd, 1, POLL.as_millis() as i32) };
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("rank {}: Ethernet receiver accept failed: {e}", shared.rank);
                std::thread::sleep(POLL);
            }
        }
    }
}

fn spawn_worker(shared: &Arc<Shared>, sock: TcpStream, peer: SocketAddr) {
    let setup = sock
        .set_nonblocking(false)
        .and_then(|()| sock.set_nodelay(true))
        .and_then(|()| sock.set_read_timeout(Some(POLL)))
        .and_then(|()| sock.set_write_timeout(Some(POLL)));
    if let Err(e) = setup {
        tracing::warn!(
            "rank {}: dropping Ethernet connection from {peer}: {e}",
            shared.rank
        );
        return;
    }
    let s = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("eth-recv-{}", shared.rank))
        .spawn(move || serve(&s, sock, peer.to_string()));
    match spawned {
        Ok(h) => {
            let mut workers = lock(&shared.workers);
            workers.retain(|w| !w.is_finished());
            workers.push(h);
        }
        Err(e) => tracing::warn!("rank {}: cannot serve {peer}: {e}", shared.rank),
    }
}

/// Why one operation was not applied: ERROR kind and message.
struct OpError(u8, String);

/// Applies one connection's frames, in order, until it closes or the receiver stops.
fn serve(shared: &Shared, mut sock: TcpStream, mut peer: String) {
    if let Some(dev) = shared.regions.device() {
        if let Err(e) = dev.bind_library_thread("Ethernet receiver") {
            tracing::warn!(
                "rank {}: Ethernet receiver cannot bind device: {e}",
                shared.rank
            );
        }
    }
    let rank = shared.rank;
    let mut payload = Vec::new();
    let mut stream = ApplyStreams::default();
    // The sender's rank (from HELLO) and the IMM records applied so far.
    let (mut peer_rank, mut imms) = (usize::MAX, 0u64);
    let reply = |sock: &mut TcpStream, h: Header, msg: &[u8]| {
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(msg);
        let sent = send_all(sock, &frame, || shared.stop.load(Ordering::Acquire));
        sent.map_err(|e| tracing::debug!("rank {rank}: Ethernet reply failed: {e}"))
            .is_ok()
    };
    while !shared.stop.load(Ordering::Acquire) {
        let mut raw = [0u8; HEADER];
        match read_full(&mut sock, &mut raw, &shared.stop) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => return tracing::debug!("rank {rank}: Ethernet connection closed: {e}"),
        }
        let h = match Header::decode(&raw) {
            Ok(h) if h.op == OP_WRITE && h.arg > CHUNK as u64 => Err(format!(
                "a WRITE frame of {} bytes exceeds the {CHUNK}-byte limit",
                h.arg
            )),
            Ok(h) if !(OP_HELLO..=OP_FLUSH).contains(&h.op) && h.op != OP_IMM => {
                Err(format!("unknown operation {}", h.op))
            }
            other => other,
        };
        let h = match h {
            Ok(h) => h,
            Err(msg) => {
                tracing::warn!("rank {rank}: protocol error on an Ethernet connection: {msg}");
                reply(
                    &mut sock,
                    Header::new(OP_ERROR, 0, msg.len() as u64),
                    msg.as_bytes(),
                );
                return;
            }
        };
        let len = match h.op {
            OP_WRITE => h.arg as usize,
            OP_IMM => imm::RECORD_BYTES,
            _ => 0,
        };
        let result = match h.op {
            OP_HELLO => {
                peer = format!("rank {} ({peer})", h.ptr);
                peer_rank = h.ptr as usize;
                continue;
            }
            OP_FLUSH => {
                if !reply(&mut sock, Header::new(OP_FLUSH_ACK, 0, 0).seq(h.seq), &[]) {
                    return;
                }
                continue;
            }
            _ => {
                if payload.len() < len {
                    payload.resize(len, 0);
                }
                if !matches!(
                    read_full(&mut sock, &mut payload[..len], &shared.stop),
                    Ok(true)
                ) {
                    return;
                }
                let body = &payload[..len];
                apply(shared, &h, body, &mut imms, peer_rank, &mut stream)
            }
        };
        if let Err(OpError(kind, msg)) = result {
            tracing::warn!(
                "rank {rank}: rejected operation #{} from {peer}: {msg}",
                h.seq
            );
            let err = Header::new(OP_ERROR, 0, msg.len() as u64)
                .seq(h.seq)
                .flag(kind);
            if !reply(&mut sock, err, msg.as_bytes()) {
                return;
            }
        }
    }
}

/// Applies one WRITE / SIGNAL / ATOMIC / IMM frame through the receiver's
/// regions; `imms`: IMM frames applied so far on this connection (the
/// sequence the next record must carry).
fn apply(
    shared: &Shared,
    h: &Header,
    payload: &[u8],
    imms: &mut u64,
    peer: usize,
    stream: &mut ApplyStreams,
) -> std::result::Result<(), OpError> {
    let op = match (h.op, h.flag) {
        (OP_WRITE, _) => Op::Write {
            ptr: h.ptr,
            data: payload,
        },
        (OP_SIGNAL, _) => Op::Set {
            ptr: h.ptr,
            value: h.arg,
        },
        (OP_ATOMIC, w @ (4 | 8)) => Op::Add {
            ptr: h.ptr,
            value: h.arg as i64,
            width: if w == 8 {
                AtomicWidth::U64
            } else {
                AtomicWidth::U32
            },
        },
        (OP_IMM, _) => {
            let op = imm::decode(h.arg as u32, payload, *imms, peer)
                .map_err(|e| OpError(ERR_REJECTED, e.to_string()))?;
            *imms += 1;
            op
        }
        (_, w) => return Err(OpError(ERR_REJECTED, format!("bad atomic width {w}"))),
    };
    shared.regions.apply(&op, stream).map_err(|e| match e {
        ApplyError::Rejected(m) => OpError(ERR_REJECTED, m),
        ApplyError::Failed(m) => OpError(ERR_FAILED, m),
    })
}

// ------------------------------------------------------------------ sender --

#[derive(Debug)]
struct SendState {
    sock: TcpStream,
    /// Frame under construction: header + up to [`CHUNK`] bytes of payload.
    staging: Vec<u8>,
    next_seq: u64,
    /// Set when a frame could not be sent whole: the stream is out of step.
    broken: Option<String>,
}

#[derive(Debug)]
struct RemoteError {
    seq: u64,
    kind: u8,
    message: String,
}

#[derive(Debug, Default)]
struct ReplyState {
    acked: u64,
    errors: Vec<RemoteError>,
    closed: Option<String>,
}

#[derive(Debug, Default)]
struct Replies {
    state: Mutex<ReplyState>,
    cond: Condvar,
    stop: AtomicBool,
}

/// A connection to a peer's [`EthernetReceiver`]. Operations are sent as they
/// are issued (TCP_NODELAY) and applied by the peer in order; only
/// [`flush`](Connection::flush) waits, and it reports what the peer rejected.
/// Dropping it without a flush may lose operations still in flight.
pub struct EthernetConnection {
    rank: usize,
    remote_rank: usize,
    remote_addr: String,
    device: Option<Device>,
    send: Mutex<SendState>,
    replies: Arc<Replies>,
    reader: Option<JoinHandle<()>>,
    /// `HostNoAtomic`: signals and adds travel as IMM frames.
    mode: SignalMode,
    /// IMM records sent so far (held while one is sent, so records go out
    /// in sequence).
    imms: Mutex<u64>,
    /// Per source device and context (the primary one or the proxies' own,
    /// see [`Device::proxy_context_or_primary`]), the non-blocking stream its
    /// device-to-host copies go on. (A synchronous `cuMemcpyDtoH` runs on the
    /// legacy default stream, so it waited for every kernel the caller queued
    /// there, e.g. an internode dispatch spinning until this very copy's data
    /// landed.)
    copy_streams: Mutex<Vec<(Device, Arc<OwnedStream>)>>,
}

impl std::fmt::Debug for EthernetConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EthernetConnection")
            .field("rank", &self.rank)
            .field("remote_rank", &self.remote_rank)
            .field("remote_addr", &self.remote_addr)
            .finish()
    }
}

impl EthernetConnection {
    /// The non-blocking stream of `dev`'s device-to-host copies in `dev`'s
    /// context (created on first use).
    fn copy_stream(&self, dev: Device) -> Result<Arc<OwnedStream>> {
        let mut streams = self
            .copy_streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, s)) = streams.iter().find(|(d, _)| d.ctx == dev.ctx) {
            return Ok(s.clone());
        }
        let s = Arc::new(OwnedStream::new(dev)?);
        streams.push((dev, s.clone()));
        Ok(s)
    }

    /// Connects to rank `remote_rank`'s receiver at `remote_addr` ("host:port"),
    /// retrying until `timeout` has passed. `device` is the GPU whose memory
    /// this rank writes from (any device memory source also works without it).
    pub fn connect(
        rank: usize,
        remote_rank: usize,
        remote_addr: &str,
        device: Option<Device>,
        timeout: Duration,
    ) -> Result<Self> {
        let start = Instant::now();
        let deadline = start + timeout;
        let sock = loop {
            let err = match try_connect(remote_addr, deadline) {
                Ok(sock) => break sock,
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: rank as i64,
                    what: format!(
                        "an Ethernet connection to rank {remote_rank} at {remote_addr} \
                         (last error: {err})"
                    ),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(50).min(deadline - now));
        };
        let setup = |e| {
            io_error(
                format!("connecting to rank {remote_rank} at {remote_addr}"),
                e,
            )
        };
        sock.set_nodelay(true)
            .and_then(|()| sock.set_read_timeout(Some(POLL)))
            .and_then(|()| sock.set_write_timeout(Some(POLL)))
            .map_err(setup)?;
        let reader_sock = sock.try_clone().map_err(setup)?;
        let replies = Arc::new(Replies::default());
        let r = Arc::clone(&replies);
        let reader = std::thread::Builder::new()
            .name(format!("eth-send-{rank}-{remote_rank}"))
            .spawn(move || read_replies(reader_sock, &r))
            .map_err(setup)?;
        let conn = Self {
            rank,
            remote_rank,
            remote_addr: remote_addr.to_string(),
            device,
            send: Mutex::new(SendState {
                sock,
                staging: vec![0; HEADER],
                next_seq: 0,
                broken: None,
            }),
            replies,
            reader: Some(reader),
            mode: SignalMode::Host,
            imms: Mutex::new(0),
            copy_streams: Mutex::new(Vec::new()),
        };
        conn.send_header(Header::new(OP_HELLO, rank as u64, 0), deadline)?;
        Ok(conn)
    }

    /// This connection with signals and adds sent as `mode` says: `Host`
    /// (the default) as SIGNAL / ATOMIC frames, `HostNoAtomic` as IMM frames
    /// (what IB verbs sends as write-with-immediate), applied by the
    /// receiver through the same decoding as the IB receiving proxy.
    pub fn with_signal_mode(mut self, mode: SignalMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sends one IMM frame: `action` with `value` at the receiver's `target`.
    fn send_imm(&self, action: Action, target: u64, value: u64) -> Result<()> {
        let mut seq = lock(&self.imms);
        let record = Record {
            seq: *seq,
            target,
            value,
            action,
        };
        let h = Header::new(OP_IMM, 0, record.imm() as u64);
        self.send_frame(h, imm::RECORD_BYTES, Instant::now() + SEND_TIMEOUT, |b| {
            b.copy_from_slice(&record.to_bytes());
            Ok(())
        })?;
        *seq += 1;
        Ok(())
    }

    /// "rank R at ADDR", for messages.
    fn peer(&self) -> String {
        format!("rank {} at {}", self.remote_rank, self.remote_addr)
    }

    /// The receiver address this connection was opened to.
    pub fn remote_addr(&self) -> &str {
        &self.remote_addr
    }

    /// The owner's address of `dst`, checking that this connection reaches it.
    fn target(&self, dst: &RegisteredMemory, what: &'static str) -> Result<u64> {
        if dst.info().ethernet.is_none() || dst.rank() != self.remote_rank {
            return Err(CommError::invalid(
                what,
                format!(
                    "rank {}'s memory is not reachable over the Ethernet connection to rank {}",
                    dst.rank(),
                    self.remote_rank
                ),
            ));
        }
        Ok(dst.info().owner_ptr)
    }

    /// Sends one frame: `h` with the next sequence number, and `len` payload
    /// bytes that `fill` writes. Returns the sequence number.
    fn send_frame(
        &self,
        mut h: Header,
        len: usize,
        deadline: Instant,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let start = Instant::now();
        let mut st = lock(&self.send);
        let st = &mut *st;
        if let Some(why) = &st.broken {
            let why = io::Error::new(io::ErrorKind::BrokenPipe, format!("broken earlier: {why}"));
            return Err(io_error(
                format!("the Ethernet connection to {}", self.peer()),
                why,
            ));
        }
        if st.staging.len() < HEADER + len {
            st.staging.resize(HEADER + len, 0);
        }
        fill(&mut st.staging[HEADER..HEADER + len])?;
        st.next_seq += 1;
        h.seq = st.next_seq;
        st.staging[..HEADER].copy_from_slice(&h.encode());
        let sent = send_all(&mut st.sock, &st.staging[..HEADER + len], || {
            Instant::now() >= deadline
        });
        let Err(e) = sent else { return Ok(h.seq) };
        st.broken = Some(e.to_string());
        let _ = st.sock.shutdown(Shutdown::Both);
        Err(if e.kind() == io::ErrorKind::TimedOut {
            CommError::Timeout {
                rank: self.rank as i64,
                what: format!("{} to take Ethernet data", self.peer()),
                waited_ms: start.elapsed().as_millis() as u64,
            }
        } else {
            io_error(format!("sending to {}", self.peer()), e)
        })
    }

    /// Sends a frame without payload.
    fn send_header(&self, h: Header, deadline: Instant) -> Result<u64> {
        self.send_frame(h, 0, deadline, |_| Ok(()))
    }

    /// Turns what the receiver reported into the error `flush` returns.
    fn remote_error(&self, errors: &[RemoteError]) -> Result<()> {
        let Some(first) = errors.first() else {
            return Ok(());
        };
        let mut reason = format!(
            "rank {} reported operation #{}: {}",
            self.remote_rank, first.seq, first.message
        );
        if errors.len() > 1 {
            reason += &format!(" (and {} more failed operations)", errors.len() - 1);
        }
        Err(match first.kind {
            ERR_REJECTED => CommError::invalid("Ethernet operation", reason),
            _ => io_error(
                format!("an Ethernet operation at rank {}", self.remote_rank),
                io::Error::other(reason),
            ),
        })
    }
}

fn try_connect(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(
        io::ErrorKind::InvalidInput,
        "the address resolves to nothing",
    );
    for a in addr.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The sender's reader thread: records FLUSH_ACKs and ERRORs until the
/// connection closes or the connection is dropped.
fn read_replies(mut sock: TcpStream, replies: &Replies) {
    let why = loop {
        let mut raw = [0u8; HEADER];
        match read_full(&mut sock, &mut raw, &replies.stop) {
            Ok(true) => {}
            Ok(false) => break "the receiver closed the connection".to_string(),
            Err(e) => break format!("reading from the receiver failed: {e}"),
        }
        let h = match Header::decode(&raw) {
            Ok(h) => h,
            Err(e) => break e,
        };
        match h.op {
            OP_FLUSH_ACK => {
                let mut st = lock(&replies.state);
                st.acked = st.acked.max(h.seq);
                replies.cond.notify_all();
            }
            OP_ERROR if h.arg <= MAX_ERROR_MESSAGE => {
                let mut msg = vec![0u8; h.arg as usize];
                if !matches!(read_full(&mut sock, &mut msg, &replies.stop), Ok(true)) {
                    break "the receiver closed the connection".to_string();
                }
                let message = String::from_utf8_lossy(&msg).into_owned();
                let err = RemoteError {
                    seq: h.seq,
                    kind: h.flag,
                    message,
                };
                lock(&replies.state).errors.push(err);
            }
            op => break format!("unexpected reply (operation {op}, {} bytes)", h.arg),
        }
    };
    lock(&replies.state).closed = Some(why);
    replies.cond.notify_all();
}

impl Drop for EthernetConnection {
    fn drop(&mut self) {
        self.replies.stop.store(true, Ordering::Release);
        let _ = lock(&self.send).sock.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

impl Connection for EthernetConnection {
    fn transport(&self) -> Transport {
        Transport::Ethernet
    }

    fn remote_rank(&self) -> usize {
        self.remote_rank
    }

    fn put(&self, p: Put<'_>) -> Result<()> {
        let (dst, dst_offset, src, src_offset, size) =
            (p.dst, p.dst_offset, p.src, p.src_offset, p.size);
        let base = self.target(dst, "write destination")? + dst_offset;
        if size == 0 {
            return Ok(());
        }
        if !src.is_mapped() {
            return Err(CommError::invalid(
                "write source",
                format!(
                    "rank {}'s memory is not addressable in this process",
                    src.rank()
                ),
            ));
        }
        let device = match src.info().location {
            Location::Host => None,
            Location::Device(d) => {
                let dev = match self.device {
                    Some(dev) if dev.ordinal == d => dev,
                    _ => Device::get(d)?,
                };
                // The proxies' own context for memory mapped process-wide, as
                // CUDA IPC's puts (in the primary context a CUDA call of the
                // process that waits on the GPU can hold the copy back: the
                // internode stall).
                Some(dev.proxy_context_or_primary(
                    src.info().process_wide(),
                    "Ethernet copies out of GPU memory",
                ))
            }
        };
        // The own context never stays current on a caller's thread.
        let _restore = device.map(|_| RestoreCurrent::new()).transpose()?;
        let mut done = 0;
        while done < size {
            let n = (size - done).min(CHUNK as u64) as usize;
            let from = src.ptr() + src_offset + done;
            let h = Header::new(OP_WRITE, base + done, n as u64);
            self.send_frame(h, n, Instant::now() + SEND_TIMEOUT, |buf| match device {
                // SAFETY: [from, from + n) lies inside the local source
                // registration (range checked above).
                None => unsafe {
                    std::ptr::copy_nonoverlapping(from as *const u8, buf.as_mut_ptr(), n);
                    Ok(())
                },
                Some(dev) => {
                    let stream = self.copy_stream(dev)?;
                    dev.make_current()?;
                    // SAFETY: as above, in device memory of `dev`, whose
                    // context is current; `buf` holds n bytes and outlives the
                    // bounded synchronisation below.
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            buf.as_mut_ptr().cast(),
                            from,
                            n,
                            stream.handle().raw(),
                        )
                    }
                    .result()
                    .call("cuMemcpyDtoHAsync")?;
                    stream.synchronize_bounded(
                        SEND_TIMEOUT,
                        self.rank as i64,
                        &format!(
                            "the copy of a write to rank {} out of GPU memory",
                            self.remote_rank
                        ),
                    )
                }
            })?;
            done += n as u64;
        }
        Ok(())
    }

    fn set(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()> {
        let ptr = self.target(dst, "signal destination")? + dst_offset;
        if self.mode == SignalMode::HostNoAtomic {
            return self.send_imm(Action::Set, ptr, value);
        }
        let h = Header::new(OP_SIGNAL, ptr, value);
        self.send_header(h, Instant::now() + SEND_TIMEOUT).map(drop)
    }

    fn add(&self, a: AtomicAdd<'_>) -> Result<()> {
        let ptr = self.target(a.dst, "atomic_add destination")? + a.dst_offset;
        if self.mode == SignalMode::HostNoAtomic {
            return self.send_imm(Action::Add(a.width), ptr, a.value as u64);
        }
        let h = Header::new(OP_ATOMIC, ptr, a.value as u64).flag(a.width.bytes() as u8);
        self.send_header(h, Instant::now() + SEND_TIMEOUT).map(drop)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start + timeout;
        let seq = self.send_header(Header::new(OP_FLUSH, 0, 0), deadline)?;
        let mut st = lock(&self.replies.state);
        while st.acked < seq {
            if let Some(why) = &st.closed {
                if !st.errors.is_empty() {
                    let errors = std::mem::take(&mut st.errors);
                    return self.remote_error(&errors);
                }
                let why = io::Error::new(io::ErrorKind::ConnectionAborted, why.clone());
                return Err(io_error(format!("flushing to {}", self.peer()), why));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Timeout {
                    rank: self.rank as i64,
                    what: format!("{} to acknowledge an Ethernet flush", self.peer()),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            st = self
                .replies
                .cond
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        // Errors of operations issued before this flush (a concurrent flush's
        // later operations stay for that one).
        let (mine, later) = std::mem::take(&mut st.errors)
            .into_iter()
            .partition(|e| e.seq < seq);
        st.errors = later;
        drop(st);
        self.remote_error(&mine)
    }
}
