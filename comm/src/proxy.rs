//! `ProxyService`: a CPU thread that pops triggers from a FIFO and performs
//! them on connections (port channels).
//!
//! The thread binds its GPU's context before its first CUDA call, so nothing a
//! proxy does ever lands on another device. Memories and channels are
//! registered (before or while running) and addressed by small ids carried in
//! the triggers. A failing operation does not stop the thread (GPU producers
//! would then hang on a full FIFO): the first error is kept and reported by
//! [`ProxyService::check`], and later triggers are still popped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cuda::Device;
use crate::device_handles::{FifoDeviceHandle, ProxyTrigger, TriggerOp};
use crate::error::{CommError, Result};
use crate::fifo::Fifo;
use crate::registered_memory::RegisteredMemory;
use crate::transport::{AtomicWidth, Connection};

/// Upper bounds set by the trigger encoding.
pub const MAX_MEMORIES: usize = 256;
pub const MAX_CHANNELS: usize = 4096;

/// What the proxy needs for one port channel.
#[derive(Debug)]
struct ChannelState {
    connection: Arc<dyn Connection>,
    /// The memory holding the peer's inbound counter for us and its offset:
    /// the peer's signal page, or (CUDA IPC) its shared host inbound block.
    remote_semaphore: RegisteredMemory,
    remote_offset: u64,
    /// Signals sent so far (the value the next signal writes is this + 1).
    outbound: AtomicU64,
    /// Triggers of this channel performed so far (a failed one included).
    handled: AtomicU64,
    /// When the latest of them was performed: ms since the UNIX epoch (0: none).
    last_ms: AtomicU64,
    /// The longest time its operations stayed in flight (issued until the
    /// proxy saw them complete), in ms.
    max_flight_ms: AtomicU64,
    /// Whether the proxy thread holds it in its list of channels in flight
    /// (only that thread reads or writes it).
    in_flight: AtomicBool,
}

/// How far a channel's proxy got (see [`ProxyService::channel_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelProgress {
    /// Triggers performed so far (failed ones included).
    pub handled: u64,
    /// Whether operations it issued are still in flight (None: its transport
    /// cannot tell).
    pub busy: Option<bool>,
    /// Milliseconds since it performed its latest trigger (None: none yet).
    pub idle_ms: Option<u64>,
    /// The longest time its operations stayed in flight (issued until the
    /// proxy saw them complete), in ms; 0 where the transport cannot tell.
    pub max_flight_ms: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Default)]
struct Shared {
    memories: RwLock<Vec<Arc<RegisteredMemory>>>,
    channels: RwLock<Vec<Arc<ChannelState>>>,
    first_error: Mutex<Option<CommError>>,
    stop: AtomicBool,
}

impl Shared {
    fn record(&self, e: CommError) {
        tracing::error!("proxy: {e}");
        let mut slot = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

#[derive(Debug)]
pub struct ProxyService {
    rank: usize,
    device: Option<Device>,
    fifo_handle: FifoDeviceHandle,
    fifo: Arc<Fifo>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Bound of each flush the proxy performs.
    flush_timeout: Duration,
}

impl ProxyService {
    /// A proxy for GPU producers on `device` (None: host producers, for tests)
    /// with a FIFO of `fifo_size` slots.
    pub fn new(rank: usize, device: Option<Device>, fifo_size: usize, id: u64) -> Result<Self> {
        let fifo = Fifo::new(device, fifo_size, rank as i32, id)?;
        Ok(Self {
            rank,
            device,
            fifo_handle: fifo.device_handle(),
            fifo: Arc::new(fifo),
            shared: Arc::new(Shared::default()),
            thread: None,
            flush_timeout: Duration::from_secs(30),
        })
    }

    pub fn set_flush_timeout(&mut self, t: Duration) {
        self.flush_timeout = t;
    }

    pub fn fifo_handle(&self) -> FifoDeviceHandle {
        self.fifo_handle
    }

    /// The FIFO itself: host producers push through it, and its error record
    /// holds what GPU producers reported.
    pub fn fifo(&self) -> &Fifo {
        &self.fifo
    }

    /// Registers memory triggers can name; returns its id.
    pub fn add_memory(&self, m: RegisteredMemory) -> Result<u32> {
        let memories = &self.shared.memories;
        add_entry(memories, MAX_MEMORIES, "memory", "memories", || m)
    }

    /// Registers a port channel: triggers naming its id go to `connection`, and
    /// its signals update the peer's inbound counter at `remote_semaphore` +
    /// `remote_offset`. Returns the channel id.
    pub fn add_channel(
        &self,
        connection: Arc<dyn Connection>,
        remote_semaphore: RegisteredMemory,
        remote_offset: u64,
    ) -> Result<u32> {
        let channels = &self.shared.channels;
        add_entry(channels, MAX_CHANNELS, "channel", "channels", || {
            ChannelState {
                connection,
                remote_semaphore,
                remote_offset,
                outbound: AtomicU64::new(0),
                handled: AtomicU64::new(0),
                last_ms: AtomicU64::new(0),
                max_flight_ms: AtomicU64::new(0),
                in_flight: AtomicBool::new(false),
            }
        })
    }

    /// Starts the proxy thread.
    pub fn start(&mut self) -> Result<()> {
        if self.thread.is_some() {
            return Err(CommError::invalid("proxy", "already started"));
        }
        let fifo = self.fifo.clone();
        let shared = self.shared.clone();
        let device = self.device;
        let flush_timeout = self.flush_timeout;
        let rank = self.rank;
        let thread = std::thread::Builder::new()
            .name(format!("moelink-proxy-r{rank}"))
            .spawn(move || {
                // Bind before anything else: no CUDA call of this thread may
                // create or use a context on another device.
                if let Some(d) = device {
                    if let Err(e) = d.bind_library_thread("proxy thread") {
                        shared.record(e);
                    }
                }
                run(&fifo, &shared, flush_timeout);
            })
            .map_err(|source| CommError::Io {
                context: "spawning the proxy thread".into(),
                source,
            })?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Stops the thread (after it finishes the trigger in hand). Triggers
    /// still queued are not performed; `start` may be called again.
    pub fn stop(&mut self) -> Result<()> {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                return Err(CommError::invalid("proxy", "the proxy thread panicked"));
            }
        }
        self.shared.stop.store(false, Ordering::Release);
        Ok(())
    }

    /// Triggers performed so far: the FIFO's tail as producers see it (the
    /// proxy publishes it in batches, and whenever the FIFO is empty).
    pub fn processed(&self) -> u64 {
        self.fifo.tail()
    }

    /// How far channel `channel` got (None: no such channel): with the FIFO's
    /// tail, what a hang report shows of the proxy.
    pub fn channel_state(&self, channel: u32) -> Option<ChannelProgress> {
        let ch = entry(&self.shared.channels, channel)?;
        let last = ch.last_ms.load(Ordering::Acquire);
        Some(ChannelProgress {
            handled: ch.handled.load(Ordering::Acquire),
            busy: ch.connection.busy(),
            idle_ms: (last != 0).then(|| now_ms().saturating_sub(last)),
            max_flight_ms: ch.max_flight_ms.load(Ordering::Acquire),
        })
    }

    /// The first error the proxy hit, if any (it is kept: later calls report it too).
    pub fn check(&self) -> Result<()> {
        let e = self
            .shared
            .first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match &*e {
            None => Ok(()),
            Some(e) => Err(CommError::invalid(
                "proxy",
                format!("rank {}: {e}", self.rank),
            )),
        }
    }
}

/// Appends `make()` to a proxy's table (memories or channels) unless it holds
/// `max` entries already; returns its id, the index triggers name it by.
/// `name` / `plural`: what the table holds, for the error.
fn add_entry<T>(
    table: &RwLock<Vec<Arc<T>>>,
    max: usize,
    name: &'static str,
    plural: &str,
    make: impl FnOnce() -> T,
) -> Result<u32> {
    let mut v = table.write().unwrap_or_else(|p| p.into_inner());
    if v.len() >= max {
        return Err(CommError::invalid(
            name,
            format!("a proxy holds at most {max} {plural}"),
        ));
    }
    v.push(Arc::new(make()));
    Ok(v.len() as u32 - 1)
}

/// Entry `id` of a proxy's table (memories or channels), if there is one.
fn entry<T>(table: &RwLock<Vec<Arc<T>>>, id: u32) -> Option<Arc<T>> {
    let v = table.read().unwrap_or_else(|p| p.into_inner());
    v.get(id as usize).cloned()
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Triggers handled between two polls of the channels in flight (and two
/// readings of the clock) while the FIFO stays busy.
const POLL_EVERY: u32 = 32;

/// The proxy thread's own copies of the memory and channel tables: entries
/// are only ever appended, so a copy stays valid and is refreshed (under the
/// lock) only when a trigger names an id beyond it. The hot path takes no
/// lock and clones no `Arc`.
#[derive(Default)]
struct Tables {
    memories: Vec<Arc<RegisteredMemory>>,
    channels: Vec<Arc<ChannelState>>,
}

impl Tables {
    fn channel(&mut self, shared: &Shared, id: u32) -> Option<&Arc<ChannelState>> {
        if id as usize >= self.channels.len() {
            self.channels = snapshot(&shared.channels);
        }
        self.channels.get(id as usize)
    }
}

/// Memories `ids` of the proxy thread's copy `memories` (refreshed on a
/// miss); an error names the first unknown one.
fn lookup<'m, const N: usize>(
    memories: &'m mut Vec<Arc<RegisteredMemory>>,
    shared: &Shared,
    ids: [u32; N],
) -> Result<[&'m RegisteredMemory; N]> {
    if ids.iter().any(|&id| id as usize >= memories.len()) {
        *memories = snapshot(&shared.memories);
    }
    if let Some(id) = ids.iter().find(|&&id| id as usize >= memories.len()) {
        return Err(CommError::invalid(
            "trigger",
            format!("unknown memory id {id}"),
        ));
    }
    let memories: &'m Vec<Arc<RegisteredMemory>> = memories;
    Ok(ids.map(|id| &*memories[id as usize]))
}

fn snapshot<T>(table: &RwLock<Vec<Arc<T>>>) -> Vec<Arc<T>> {
    table.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// A channel with operations issued and not yet seen complete, and when the
/// oldest of them was issued.
struct InFlight {
    channel: Arc<ChannelState>,
    since: Instant,
}

fn run(fifo: &Fifo, shared: &Shared, flush_timeout: Duration) {
    let mut fifo = match fifo.consumer() {
        Ok(c) => c,
        Err(e) => return shared.record(e),
    };
    let mut tables = Tables::default();
    // Channels with operations issued and not yet seen complete. The proxy
    // queries them until they drain: the longest flight per channel goes
    // into hang reports, and the queries keep driving a stream after a
    // rank's last call, when nothing else would (a guard: with ranks sharing
    // a GPU under MPS, copies were measured to stay in flight while a peer's
    // low-latency kernel spun, queried or not; see docs/one-gpu.md, known
    // defects).
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut idle = 0u32;
    let mut since_poll = 0u32;
    // ms since the epoch, read once per POLL_EVERY triggers, after a flush
    // and when the FIFO turns busy (what `last_ms` records).
    let mut now = now_ms();
    while !shared.stop.load(Ordering::Acquire) {
        let Some(t) = fifo.poll() else {
            // Nothing to do: producers see everything performed so far.
            fifo.publish();
            poll_in_flight(&mut in_flight, shared);
            idle += 1;
            if idle > 4096 {
                std::thread::yield_now();
            }
            continue;
        };
        if idle > 0 {
            idle = 0;
            now = now_ms();
        }
        let flush = matches!(t.decode(), Some(TriggerOp::Data { flush: true, .. }));
        if flush {
            // A flush may wait (bounded): what is finished is published first.
            fifo.publish();
        }
        let (ch, result) = handle(t, &mut tables, shared, flush_timeout);
        if let Err(e) = result {
            shared.record(e);
        }
        if flush {
            now = now_ms();
        }
        if let Some(ch) = ch {
            ch.last_ms.store(now, Ordering::Relaxed);
            let handled = ch.handled.load(Ordering::Relaxed);
            ch.handled.store(handled + 1, Ordering::Release);
            if !ch.in_flight.load(Ordering::Relaxed) {
                ch.in_flight.store(true, Ordering::Relaxed);
                in_flight.push(InFlight {
                    channel: ch.clone(),
                    since: Instant::now(),
                });
            }
        }
        fifo.pop();
        since_poll += 1;
        if since_poll >= POLL_EVERY {
            since_poll = 0;
            now = now_ms();
            poll_in_flight(&mut in_flight, shared);
        }
    }
    // Dropping the consumer publishes the tail.
}

/// Queries every channel in flight once (this drives its stream, or polls
/// its completions); forgets the ones that drained (or whose transport
/// cannot tell), keeping how long the drained ones were in flight. An error
/// the transport found meanwhile (a failed RDMA completion) is recorded.
fn poll_in_flight(in_flight: &mut Vec<InFlight>, shared: &Shared) {
    in_flight.retain(|f| {
        let ch = &f.channel;
        let keep = match ch.connection.progress() {
            Ok(Some(true)) => true,
            Ok(Some(false)) => {
                let ms = f.since.elapsed().as_millis() as u64;
                ch.max_flight_ms.fetch_max(ms, Ordering::AcqRel);
                false
            }
            Ok(None) => false,
            Err(e) => {
                shared.record(e);
                false
            }
        };
        if !keep {
            ch.in_flight.store(false, Ordering::Relaxed);
        }
        keep
    });
}

/// Performs one trigger; returns its channel (None: it named none) and the
/// outcome.
fn handle<'t>(
    t: ProxyTrigger,
    tables: &'t mut Tables,
    shared: &Shared,
    flush_timeout: Duration,
) -> (Option<&'t Arc<ChannelState>>, Result<()>) {
    let Some(op) = t.decode() else {
        return (
            None,
            Err(CommError::invalid("trigger", format!("undecodable {t:?}"))),
        );
    };
    let channel_id = match op {
        TriggerOp::Data { channel, .. } | TriggerOp::AtomicAdd { channel, .. } => channel,
    };
    if tables.channel(shared, channel_id).is_none() {
        return (
            None,
            Err(CommError::invalid(
                "trigger",
                format!("unknown channel {channel_id}"),
            )),
        );
    }
    let result = perform(op, channel_id as usize, tables, shared, flush_timeout);
    (tables.channels.get(channel_id as usize), result)
}

fn perform(
    op: TriggerOp,
    channel: usize,
    tables: &mut Tables,
    shared: &Shared,
    flush_timeout: Duration,
) -> Result<()> {
    match op {
        TriggerOp::Data {
            put,
            signal,
            flush,
            dst_mem,
            dst_offset,
            src_mem,
            src_offset,
            size,
            ..
        } => {
            let ch = &tables.channels[channel];
            if put {
                let [dst, src] = lookup(&mut tables.memories, shared, [dst_mem, src_mem])?;
                ch.connection
                    .write(dst, dst_offset, src, src_offset, size)?;
            }
            if signal {
                // Only this thread writes `outbound`.
                let v = ch.outbound.load(Ordering::Relaxed) + 1;
                ch.outbound.store(v, Ordering::Relaxed);
                ch.connection
                    .update_and_sync(&ch.remote_semaphore, ch.remote_offset, v)?;
            }
            if flush {
                ch.connection.flush(flush_timeout)?;
            }
        }
        TriggerOp::AtomicAdd {
            wide,
            dst_mem,
            dst_offset,
            value,
            ..
        } => {
            let width = if wide {
                AtomicWidth::U64
            } else {
                AtomicWidth::U32
            };
            let [dst] = lookup(&mut tables.memories, shared, [dst_mem])?;
            tables.channels[channel]
                .connection
                .atomic_add(dst, dst_offset, value, width)?;
        }
    }
    Ok(())
}

/// Stand-ins for running a proxy without a GPU or a transport (comm's CPU
/// tests and the proxy CPU benchmark): a connection that performs nothing, and
/// memory descriptions with nothing behind them.
pub mod testing {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, PoisonError};
    use std::time::Duration;

    use crate::error::Result;
    use crate::registered_memory::{Location, MemoryInfo, RegisteredMemory};
    use crate::transport::{AtomicWidth, Connection, Transport};

    /// A connection to rank 1 that performs nothing. By default it accepts
    /// every operation and does no work at all, so that what a proxy costs is
    /// the proxy's own work; [`recording`](Self::recording) checks and notes
    /// what it was asked, [`in_flight_for`](Self::in_flight_for) makes its
    /// operations look in flight for a while.
    #[derive(Debug, Default)]
    pub struct TestConnection {
        /// Whether operations are range-checked and noted in `ops`.
        recording: bool,
        ops: Mutex<Vec<String>>,
        /// Answers of `busy` that say "in flight" (None: `busy` cannot tell).
        in_flight_polls: Option<u64>,
        polls: AtomicU64,
    }

    impl TestConnection {
        /// One that checks each write's ranges against the registrations and
        /// notes each operation as text (see [`ops`](Self::ops)).
        pub fn recording() -> Self {
            Self {
                recording: true,
                ..Self::default()
            }
        }

        /// One whose operations look in flight until [`Connection::busy`] was
        /// asked `polls` times (like a CUDA stream that only starts the work
        /// the process drives). A default one's `busy` cannot tell.
        pub fn in_flight_for(polls: u64) -> Self {
            Self {
                in_flight_polls: Some(polls),
                ..Self::default()
            }
        }

        /// The operations a [`recording`](Self::recording) connection was
        /// asked for, in order: `write r1 +DST <- r0 +SRC xSIZE`,
        /// `signal r1 +OFFSET = VALUE`, `atomic r1 +OFFSET VALUE U64`, `flush`.
        pub fn ops(&self) -> Vec<String> {
            self.ops
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        }

        /// How often `busy` was asked so far (counted by
        /// [`in_flight_for`](Self::in_flight_for) connections only).
        pub fn polls(&self) -> u64 {
            self.polls.load(Ordering::SeqCst)
        }

        fn note(&self, op: impl FnOnce() -> String) {
            if self.recording {
                let mut ops = self.ops.lock().unwrap_or_else(PoisonError::into_inner);
                ops.push(op());
            }
        }
    }

    impl Connection for TestConnection {
        fn transport(&self) -> Transport {
            Transport::Ethernet
        }

        fn remote_rank(&self) -> usize {
            1
        }

        fn write(
            &self,
            dst: &RegisteredMemory,
            d: u64,
            src: &RegisteredMemory,
            s: u64,
            n: u64,
        ) -> Result<()> {
            if self.recording {
                dst.check_range(d, n, "dst")?;
                src.check_range(s, n, "src")?;
            }
            self.note(|| format!("write r{} +{d} <- r{} +{s} x{n}", dst.rank(), src.rank()));
            Ok(())
        }

        fn put(&self, p: crate::transport::Put<'_>) -> Result<()> {
            self.write(p.dst, p.dst_offset, p.src, p.src_offset, p.size)
        }

        fn update_and_sync(&self, dst: &RegisteredMemory, d: u64, v: u64) -> Result<()> {
            self.note(|| format!("signal r{} +{d} = {v}", dst.rank()));
            Ok(())
        }

        fn atomic_add(&self, dst: &RegisteredMemory, d: u64, v: i64, w: AtomicWidth) -> Result<()> {
            self.note(|| format!("atomic r{} +{d} {v} {w:?}", dst.rank()));
            Ok(())
        }

        fn set(&self, dst: &RegisteredMemory, d: u64, v: u64) -> Result<()> {
            self.update_and_sync(dst, d, v)
        }

        fn add(&self, a: crate::transport::AtomicAdd<'_>) -> Result<()> {
            self.atomic_add(a.dst, a.dst_offset, a.value, a.width)
        }

        fn flush(&self, _: Duration) -> Result<()> {
            self.note(|| "flush".into());
            Ok(())
        }

        fn busy(&self) -> Option<bool> {
            let in_flight = self.in_flight_polls?;
            Some(self.polls.fetch_add(1, Ordering::SeqCst) < in_flight)
        }
    }

    /// Rank `rank`'s host memory of `len` bytes as a proxy sees it: a
    /// description at a made-up address (0x1000) with nothing behind it, for
    /// connections that never touch memory.
    pub fn fake_host_memory(rank: u32, len: u64) -> RegisteredMemory {
        let info = MemoryInfo {
            rank,
            len,
            location: Location::Host,
            host_id: 0,
            owner_ptr: 0x1000,
            ipc: None,
            ethernet: None,
            ib: None,
        };
        RegisteredMemory::local(info, None)
    }
}
