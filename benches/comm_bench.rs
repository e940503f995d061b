//! `comm_bench`: latency and bandwidth of comm's communication primitives
//! between two GPUs of one host (targets: `docs/performance.md`, "Communication
//! primitives (2 GPUs)").
//!
//! Run one process per GPU under torchrun (`LOCAL_RANK` picks the device):
//!
//! ```text
//! torchrun --nproc-per-node=2 --no-python target/release/comm_bench [--out results.json] [--quick]
//! ```
//!
//! Ranks 0 and 1 take part in the timed loops; further ranks only join the
//! synchronisation points. Rank 0 prints one summary table and writes JSON.
//!
//! Method:
//! - Setup: [`comm::TcpBootstrap::from_env`], a [`Communicator`] on the GPU, one
//!   registered buffer of 256 MiB + slack per rank, memory channels over it, and
//!   port channels over CUDA IPC driven by a started [`ProxyService`].
//! - Correctness first: rank 0 puts 1 MiB + 3 bytes of seeded random data at odd
//!   offsets into rank 1's poisoned buffer, once through the memory channel
//!   (put + signal, rank 1 waits) and once through the port channel
//!   (put_with_signal, rank 1 waits); rank 1 copies the range and its guard
//!   bands back and compares byte by byte. Any mismatch aborts every rank before
//!   a number is printed.
//! - Signal + wait round trips (memory and port channel): the responder (rank 1)
//!   launches its ping-pong kernel first, all ranks meet, then the initiator
//!   (rank 0) launches, so the initiator's clock (`%globaltimer` inside the
//!   kernel) never includes the other side's launch skew. RTT = elapsed / iters
//!   of the initiator. One untimed warm-up launch, then `reps` timed launches;
//!   median, min and max over launches. Memory channel: one `red.release.sys`
//!   add on the peer's counter per signal. Port channel: a signal trigger
//!   through the FIFO, which the proxy performs as a CPU store into the peer's
//!   shared-host-memory inbound counter (nothing of the connection is in
//!   flight in this loop), polled by the peer's GPU.
//! - FIFO round trip: rank 0 pushes a no-op trigger and waits until its proxy
//!   popped it, `iters` times in one kernel; per-op = elapsed / iters. The
//!   push checks for room against the GPU tail replica; the wait polls the
//!   host tail.
//! - Put bandwidth: only rank 0 sends into rank 1's buffer (rank 1 waits at the
//!   next synchronisation point). Memory channel: the `memchan_copy` kernel on
//!   `clamp(bytes / 64 KiB, 1, SMs)` blocks of 1024 threads, repeating the same
//!   put `iters` times in one launch. Port channel: `portchan_op` with
//!   `PutThenFlush` (the proxy copies with the copy engine, the GPU waits for
//!   the flush), `iters` consecutive pieces per launch. Each launch is timed
//!   with CUDA events; GB/s = bytes x iters / time (1e9 bytes per GB).
//!   Sources hold non-zero data; L2 is not flushed (the writes cross NVLink to
//!   the peer, which bounds the copy, and repeated sources are what a put loop
//!   sees too).
//! - After every measurement each rank checks its communicator's and proxy's
//!   device-error records and the proxy's first error; every rank exchanges its
//!   status through the bootstrap, so a failure on any rank stops all of them
//!   with the failing rank's message. Every host wait is bounded (60 s), every
//!   device wait by 30 s of GPU time.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use comm::channel::{MemoryChannel, PortChannel};
use comm::device_handles::{MemoryChannelDeviceHandle, PortChannelDeviceHandle};
use comm::kernels::testing::{self, PortOp};
use comm::proxy::ProxyService;
use comm::registered_memory::RegisteredMemory;
use comm::transport::Transport;
use comm::{
    Bootstrap, Communicator, CommunicatorOptions, Device, DeviceMemory, OwnedStream, TcpBootstrap,
};
use cudarc::driver::{result, sys};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Largest message of the bandwidth sweep; the buffer holds it plus slack.
const MAX_BYTES: usize = 256 * MIB;
const BUF_BYTES: usize = MAX_BYTES + 2 * MIB;
/// Bound of every host-side wait for GPU work.
const WAIT: Duration = Duration::from_secs(60);
/// Bound of every bootstrap call (above `WAIT`: a peer may sit in a GPU wait).
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(150);
/// Bound of every device-side wait, ns of GPU time (below `WAIT`, so a hang is
/// reported by the device, naming rank and peer).
const DEVICE_TIMEOUT_NS: i64 = comm::error::DEFAULT_DEVICE_TIMEOUT_NS;
const FIFO_SLOTS: usize = 1024;
const THREADS: u32 = 1024;
/// Bytes per block of the memory-channel put before another block is added.
const BYTES_PER_BLOCK: usize = 64 * KIB;
/// Bytes one memory-channel bandwidth launch moves at least (in `iters` puts).
const MEM_BYTES_PER_LAUNCH: usize = 512 * MIB;
const MEM_MAX_ITERS: usize = 1000;
/// Most put + flush operations in one port-channel bandwidth launch.
const PORT_MAX_ITERS: usize = 50;
/// Bandwidth target, at this size only.
const TARGET_BYTES: usize = 128 * MIB;

/// Correctness check geometry: odd length and offsets. Source and destination
/// share their misalignment (mod 16) for the memory channel, so the put runs
/// its vectorised body between unaligned head and tail bytes.
const CHECK_BYTES: usize = MIB + 3;
const GUARD: usize = 4 * KIB;
const MEM_CHECK_SRC: usize = 8 * MIB + 5;
const MEM_CHECK_DST: usize = 64 * KIB + 5;
const PORT_CHECK_SRC: usize = 24 * MIB + 7;
const PORT_CHECK_DST: usize = 16 * MIB + 3;
const POISON: u8 = 0xA5;
/// Byte the bandwidth source is filled with (never time on all-zero data).
const FILL: u8 = 0x5A;

const USAGE: &str = "\
usage: torchrun --nproc-per-node=2 --no-python comm_bench [--out PATH] [--quick]

  --out PATH   JSON results written by rank 0 (default comm_bench.json)
  --quick      smoke run: 5 repetitions, 5 sizes
  -h, --help   this text

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun), LOCAL_RANK
(GPU ordinal), MOELINK_GIT_COMMIT (recorded in the JSON).";

struct Args {
    out: String,
    quick: bool,
}

fn parse_args() -> Result<Option<Args>> {
    let mut args = Args {
        out: "comm_bench.json".into(),
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => args.quick = true,
            "--out" => args.out = it.next().context("--out needs a path")?,
            "-h" | "--help" => return Ok(None),
            _ => match a.strip_prefix("--out=") {
                Some(p) => args.out = p.to_string(),
                None => bail!("unknown argument {a:?}\n{USAGE}"),
            },
        }
    }
    Ok(Some(args))
}

/// Repetitions and sizes of one run.
struct Config {
    reps: usize,
    pingpong_iters: i32,
    pingpong_warmup: i32,
    fifo_iters: i32,
    fifo_warmup: i32,
    sizes: Vec<usize>,
}

impl Config {
    fn new(quick: bool) -> Self {
        let sizes = if quick {
            vec![KIB, 64 * KIB, MIB, 16 * MIB, 128 * MIB]
        } else {
            // Powers of 4 from 1 KiB to 256 MiB, plus 128 MiB (the target size).
            let mut v: Vec<usize> = (0..10).map(|i| KIB << (2 * i)).collect();
            v.push(128 * MIB);
            v.sort_unstable();
            v
        };
        Self {
            reps: if quick { 5 } else { 20 },
            pingpong_iters: 1000,
            pingpong_warmup: 100,
            fifo_iters: 10_000,
            fifo_warmup: 1000,
            sizes,
        }
    }
}

/// What this rank does in the timed loops.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Initiator,
    Responder,
    Idle,
}

#[derive(Clone, Copy)]
enum Chan {
    Memory,
    Port,
}

impl Chan {
    fn name(self) -> &'static str {
        match self {
            Chan::Memory => "memory channel",
            Chan::Port => "port channel",
        }
    }
}

// ---------------------------------------------------------------------------
// Results

#[derive(Clone, Copy)]
enum TargetKind {
    /// The median must not exceed the target (latencies).
    Max,
    /// The median must reach the target (bandwidths).
    Min,
}

struct Target {
    value: f64,
    kind: TargetKind,
    reference: &'static str,
}

impl Target {
    fn met(&self, median: f64) -> bool {
        match self.kind {
            TargetKind::Max => median <= self.value,
            TargetKind::Min => median >= self.value,
        }
    }
}

struct Stats {
    median: f64,
    min: f64,
    max: f64,
    samples: Vec<f64>,
}

impl Stats {
    fn of(samples: Vec<f64>) -> Result<Self> {
        if samples.is_empty() || samples.iter().any(|v| !v.is_finite()) {
            bail!("no or non-finite samples: {samples:?}");
        }
        let mut s = samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Ok(Self {
            median,
            min: s[0],
            max: s[n - 1],
            samples,
        })
    }
}

/// Further JSON fields of a metric (geometry, iterations, ...).
type Extra = Vec<(&'static str, Json)>;

struct Metric {
    name: &'static str,
    unit: &'static str,
    bytes: Option<usize>,
    stats: Stats,
    target: Option<Target>,
    /// How it was measured, for the table (iterations, geometry).
    note: String,
    extra: Extra,
}

// ---------------------------------------------------------------------------
// A small JSON writer (the workspace pins no serde).

#[derive(Clone)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Int(u64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn obj(fields: Vec<(&str, Json)>) -> Json {
        Json::Obj(
            fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }

    fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    fn write(&self, out: &mut String, indent: usize) {
        let pad = |out: &mut String, n: usize| out.extend(std::iter::repeat_n(' ', n));
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Num(v) if v.is_finite() => {
                let _ = write!(out, "{v}");
            }
            Json::Num(_) => out.push_str("null"),
            Json::Int(v) => {
                let _ = write!(out, "{v}");
            }
            Json::Str(s) => write_json_string(out, s),
            Json::Arr(items) if items.iter().all(Json::is_scalar) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.write(out, indent);
                }
                out.push(']');
            }
            Json::Arr(items) => {
                out.push_str("[\n");
                for (i, v) in items.iter().enumerate() {
                    pad(out, indent + 2);
                    v.write(out, indent + 2);
                    out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push(']');
            }
            Json::Obj(fields) => {
                out.push_str("{\n");
                for (i, (k, v)) in fields.iter().enumerate() {
                    pad(out, indent + 2);
                    write_json_string(out, k);
                    out.push_str(": ");
                    v.write(out, indent + 2);
                    out.push_str(if i + 1 < fields.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push('}');
            }
        }
    }

    fn is_scalar(&self) -> bool {
        !matches!(self, Json::Arr(_) | Json::Obj(_))
    }
}

fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------
// CUDA helpers

/// A pair of timing events, destroyed on drop.
struct Events {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Events {
    fn new() -> Result<Self> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = result::event::create(flags).context("cuEventCreate")?;
        let end = match result::event::create(flags) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { result::event::destroy(start) };
                return Err(e).context("cuEventCreate");
            }
        };
        Ok(Self { start, end })
    }

    /// Runs `launch` between two events on `stream`, waits (bounded) and
    /// returns the elapsed milliseconds.
    fn time(
        &self,
        stream: &OwnedStream,
        rank: usize,
        what: &str,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<f64> {
        let raw = stream.handle().raw();
        // SAFETY: both events and the stream are live and belong to the current context.
        unsafe { result::event::record(self.start, raw) }.context("cuEventRecord")?;
        launch()?;
        // SAFETY: as above.
        unsafe { result::event::record(self.end, raw) }.context("cuEventRecord")?;
        stream.synchronize_bounded(WAIT, rank as i64, what)?;
        // SAFETY: both events were recorded on one stream, which has completed.
        let ms = unsafe { result::event::elapsed(self.start, self.end) }
            .context("cuEventElapsedTime")?;
        Ok(ms as f64)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once here.
        unsafe {
            let _ = result::event::destroy(self.start);
            let _ = result::event::destroy(self.end);
        }
    }
}

/// Deterministic bytes from a seed (splitmix64), shared by sender and checker.
fn seeded_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        v.extend_from_slice(&next().to_le_bytes());
    }
    v.truncate(n);
    v
}

fn fmt_bytes(b: usize) -> String {
    if b >= MIB && b % MIB == 0 {
        format!("{} MiB", b / MIB)
    } else if b >= KIB && b % KIB == 0 {
        format!("{} KiB", b / KIB)
    } else {
        format!("{b} B")
    }
}

/// Compares what arrived (`got`: guard, payload, guard) with `want`.
fn verify(got: &[u8], want: &[u8]) -> std::result::Result<(), String> {
    let (before, rest) = got.split_at(GUARD);
    let (payload, after) = rest.split_at(want.len());
    let mut problems = Vec::new();
    let diffs: Vec<usize> = (0..want.len()).filter(|&i| payload[i] != want[i]).collect();
    if let Some(&first) = diffs.first() {
        problems.push(format!(
            "{} of {} bytes differ, first at byte {first} (got {:#04x}, want {:#04x}), last at byte {}",
            diffs.len(),
            want.len(),
            payload[first],
            want[first],
            diffs[diffs.len() - 1]
        ));
    }
    if let Some(i) = before.iter().rposition(|&b| b != POISON) {
        problems.push(format!(
            "wrote {} bytes before the destination range",
            GUARD - i
        ));
    }
    if let Some(i) = after.iter().position(|&b| b != POISON) {
        problems.push(format!(
            "wrote past the destination range (from {i} bytes after its end)"
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

// ---------------------------------------------------------------------------
// The benchmark

struct Bench {
    // Field order is drop order: stop the proxy and drain the stream before
    // the channels, buffers and communicator go away.
    proxy: ProxyService,
    stream: OwnedStream,
    events: Events,
    mem: Option<MemoryChannelDeviceHandle>,
    port: Option<PortChannelDeviceHandle>,
    _mem_channels: Vec<Option<MemoryChannel>>,
    _port_channels: Vec<Option<PortChannel>>,
    buf: RegisteredMemory,
    out_ns: DeviceMemory,
    device: Device,
    rank: usize,
    role: Role,
    comm: Communicator,
}

impl Bench {
    fn setup(device: Device) -> Result<Self> {
        let bootstrap: Arc<dyn Bootstrap> =
            Arc::new(TcpBootstrap::from_env(BOOTSTRAP_TIMEOUT).context(
                "joining the job (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
            )?);
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        if size < 2 {
            bail!("comm_bench needs at least 2 ranks (WORLD_SIZE={size})");
        }
        let comm = Communicator::new(bootstrap, Some(device), CommunicatorOptions::default())
            .context("creating the communicator")?;
        let buf = comm
            .alloc_memory(BUF_BYTES)
            .context("allocating the buffer")?;
        let mut proxy = ProxyService::new(rank, Some(device), FIFO_SLOTS, rank as u64)
            .context("creating the proxy")?;
        // Collective, in the same order on every rank.
        let mem_channels = comm
            .memory_channels(&buf, None)
            .context("building memory channels")?;
        let port_channels = comm
            .port_channels(&proxy, &buf, Transport::CudaIpc)
            .context("building port channels")?;
        proxy.start().context("starting the proxy")?;
        let role = match rank {
            0 => Role::Initiator,
            1 => Role::Responder,
            _ => Role::Idle,
        };
        let (mem, port) = if role == Role::Idle {
            (None, None)
        } else {
            let peer = 1 - rank;
            let m = mem_channels[peer]
                .as_ref()
                .with_context(|| format!("no memory channel to rank {peer}"))?
                .device_handle(comm.device_error())
                .with_context(|| format!("memory channel to rank {peer} (same host, NVLink?)"))?;
            let p = port_channels[peer]
                .as_ref()
                .with_context(|| format!("no port channel to rank {peer}"))?
                .device_handle(comm.device_error());
            (Some(m), Some(p))
        };
        let stream = OwnedStream::new(device).context("creating a stream")?;
        let out_ns = DeviceMemory::alloc(device, 8).context("allocating the timer word")?;
        let bench = Self {
            proxy,
            stream,
            events: Events::new()?,
            mem,
            port,
            _mem_channels: mem_channels,
            _port_channels: port_channels,
            buf,
            out_ns,
            device,
            rank,
            role,
            comm,
        };
        bench.agree("setup", Ok(()))?;
        Ok(bench)
    }

    fn mem(&self) -> Result<MemoryChannelDeviceHandle> {
        self.mem
            .ok_or_else(|| anyhow!("rank {} has no memory channel", self.rank))
    }

    fn port(&self) -> Result<PortChannelDeviceHandle> {
        self.port
            .ok_or_else(|| anyhow!("rank {} has no port channel", self.rank))
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.stream
            .synchronize_bounded(WAIT, self.rank as i64, what)
            .with_context(|| format!("rank {}: {what}", self.rank))
    }

    /// Every error a device wait, a FIFO operation or the proxy recorded on this rank.
    fn health(&self) -> Result<()> {
        self.comm
            .device_error()
            .check()
            .context("communicator device-error record")?;
        self.proxy
            .fifo()
            .error()
            .check()
            .context("proxy FIFO device-error record")?;
        self.proxy.check().context("proxy")?;
        Ok(())
    }

    /// *Collective.* Exchanges every rank's status of `what` (and checks this
    /// rank's error records); fails on every rank if any rank failed.
    fn agree(&self, what: &str, local: Result<()>) -> Result<()> {
        let local = local.and_then(|()| self.health());
        let msg = match &local {
            Ok(()) => Vec::new(),
            Err(e) => format!("{e:#}").into_bytes(),
        };
        let all = self
            .comm
            .bootstrap()
            .all_gather(&msg)
            .with_context(|| format!("rank {}: exchanging the status of {what}", self.rank))?;
        let failures: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.is_empty())
            .map(|(r, m)| format!("rank {r}: {}", String::from_utf8_lossy(m)))
            .collect();
        if !failures.is_empty() {
            bail!("{what} failed: {}", failures.join("; "));
        }
        Ok(())
    }

    /// *Collective.* Rank 0's value, on every rank.
    fn share_u64(&self, v: u64) -> Result<u64> {
        let all = self.comm.bootstrap().all_gather(&v.to_le_bytes())?;
        let b: [u8; 8] = all[0]
            .as_slice()
            .try_into()
            .map_err(|_| anyhow!("bad seed message from rank 0"))?;
        Ok(u64::from_le_bytes(b))
    }

    fn memset(&self, offset: usize, value: u8, len: usize) -> Result<()> {
        // SAFETY: the range lies inside our registered buffer (callers stay below BUF_BYTES).
        unsafe {
            result::memset_d8_async(
                self.buf.ptr() + offset as u64,
                value,
                len,
                self.stream.handle().raw(),
            )
        }
        .context("cuMemsetD8Async")?;
        self.sync("memset of the buffer")
    }

    fn upload(&self, offset: usize, data: &[u8]) -> Result<()> {
        // SAFETY: the range lies inside our buffer; `data` outlives the bounded sync below.
        unsafe {
            result::memcpy_htod_async(
                self.buf.ptr() + offset as u64,
                data,
                self.stream.handle().raw(),
            )
        }
        .context("cuMemcpyHtoDAsync")?;
        self.sync("copy to the buffer")
    }

    fn download(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        // SAFETY: the range lies inside our buffer; `v` outlives the bounded sync below.
        unsafe {
            result::memcpy_dtoh_async(
                &mut v,
                self.buf.ptr() + offset as u64,
                self.stream.handle().raw(),
            )
        }
        .context("cuMemcpyDtoHAsync")?;
        self.sync("copy from the buffer")?;
        Ok(v)
    }

    /// Poisons the timer word so an unwritten result is caught.
    fn poison_timer(&self) -> Result<()> {
        // SAFETY: out_ns is an 8-byte allocation of this device.
        unsafe { result::memset_d8_async(self.out_ns.ptr(), 0xFF, 8, self.stream.handle().raw()) }
            .context("cuMemsetD8Async")
    }

    fn read_timer(&self, what: &str) -> Result<u64> {
        let mut ns = [0u64; 1];
        self.out_ns.copy_to_host(0, &mut ns)?;
        if ns[0] == u64::MAX {
            bail!("{what}: the kernel did not write its elapsed time");
        }
        Ok(ns[0])
    }

    // -- correctness ---------------------------------------------------------

    /// *Collective.* One put of `CHECK_BYTES` seeded random bytes from rank 0
    /// into rank 1's poisoned buffer at odd offsets, with a signal rank 1 waits
    /// for; rank 1 compares what arrived (and the guard bands around it).
    fn check_put(&self, chan: Chan, seed: u64) -> Result<Json> {
        let (src, dst) = match chan {
            Chan::Memory => (MEM_CHECK_SRC, MEM_CHECK_DST),
            Chan::Port => (PORT_CHECK_SRC, PORT_CHECK_DST),
        };
        let what = format!("{} put correctness", chan.name());
        let want = seeded_bytes(seed, CHECK_BYTES);
        let prepared = match self.role {
            Role::Initiator => self.upload(src, &want),
            Role::Responder => self.memset(dst - GUARD, POISON, CHECK_BYTES + 2 * GUARD),
            Role::Idle => Ok(()),
        };
        self.agree(&format!("{what} (setup)"), prepared)?;
        let sent = match (self.role, chan) {
            (Role::Initiator, Chan::Memory) => self.mem().and_then(|h| {
                // SAFETY: both ranges lie inside the buffers; one block, as the signal requires.
                unsafe {
                    testing::memchan_copy(
                        self.device,
                        self.stream.handle(),
                        1,
                        THREADS,
                        h,
                        dst as u64,
                        src as u64,
                        CHECK_BYTES as u64,
                        false,
                        1,
                        true,
                    )
                }?;
                self.sync(&what)
            }),
            (Role::Initiator, Chan::Port) => self.port().and_then(|h| {
                // SAFETY: both ranges lie inside the proxy's registered memories.
                unsafe {
                    testing::portchan_op(
                        self.device,
                        self.stream.handle(),
                        h,
                        PortOp::PutWithSignal,
                        dst as u64,
                        src as u64,
                        CHECK_BYTES as u64,
                        1,
                        DEVICE_TIMEOUT_NS,
                    )
                }?;
                self.sync(&what)
            }),
            (Role::Responder, _) => self.receive_and_verify(chan, dst, &want, &what),
            (Role::Idle, _) => Ok(()),
        };
        self.agree(&what, sent)?;
        Ok(Json::obj(vec![
            (
                "name",
                Json::str(format!("{}_put_with_signal", short(chan))),
            ),
            ("bytes", Json::Int(CHECK_BYTES as u64)),
            ("src_offset", Json::Int(src as u64)),
            ("dst_offset", Json::Int(dst as u64)),
            ("guard_bytes", Json::Int(GUARD as u64)),
            ("seed", Json::str(format!("{seed:#x}"))),
            ("result", Json::str("ok")),
        ]))
    }

    fn receive_and_verify(&self, chan: Chan, dst: usize, want: &[u8], what: &str) -> Result<()> {
        match chan {
            Chan::Memory => {
                let h = self.mem()?;
                // SAFETY: the handle's pointers are valid for this device.
                unsafe {
                    testing::memchan_wait(self.device, self.stream.handle(), h, DEVICE_TIMEOUT_NS)
                }?;
            }
            Chan::Port => {
                let h = self.port()?;
                // SAFETY: a wait touches no data range.
                unsafe {
                    testing::portchan_op(
                        self.device,
                        self.stream.handle(),
                        h,
                        PortOp::Wait,
                        0,
                        0,
                        0,
                        1,
                        DEVICE_TIMEOUT_NS,
                    )
                }?;
            }
        }
        self.sync(what)?;
        // A timed-out wait is reported here rather than as a data mismatch.
        self.health()?;
        let got = self.download(dst - GUARD, CHECK_BYTES + 2 * GUARD)?;
        verify(&got, want).map_err(|e| {
            anyhow!(
                "{what}: DATA MISMATCH from rank 0 ({} bytes at offset {dst}): {e}",
                CHECK_BYTES
            )
        })
    }

    // -- latency -------------------------------------------------------------

    /// *Collective.* Signal + wait ping-pong between ranks 0 and 1: one
    /// untimed launch of `warmup` iterations, then `reps` launches of `iters`;
    /// round trip in microseconds as the initiator measured it. `floor`
    /// (memory channel only): the relaxed variant, no release or acquire
    /// (`memchan_pingpong_floor`: what the link and the polling cost alone).
    fn pingpong(&self, chan: Chan, floor: bool, cfg: &Config) -> Result<Option<Stats>> {
        let mut samples = Vec::with_capacity(cfg.reps);
        for rep in 0..=cfg.reps {
            let iters = if rep == 0 {
                cfg.pingpong_warmup
            } else {
                cfg.pingpong_iters
            };
            let what = format!("{} ping-pong {rep}/{}", chan.name(), cfg.reps);
            // The responder starts first, so the initiator's clock never runs
            // while the other kernel is still being launched.
            let launched = match self.role {
                Role::Responder => self.launch_pingpong(chan, floor, iters, false),
                _ => Ok(()),
            };
            self.agree(&format!("{what} (responder launch)"), launched)?;
            let done = match self.role {
                Role::Initiator => self
                    .launch_pingpong(chan, floor, iters, true)
                    .and_then(|()| self.sync(&what))
                    .and_then(|()| self.read_timer(&what))
                    .map(|ns| {
                        if rep > 0 {
                            samples.push(ns as f64 / iters as f64 / 1e3);
                        }
                    }),
                Role::Responder => self.sync(&what),
                Role::Idle => Ok(()),
            };
            self.agree(&what, done)?;
        }
        if self.role == Role::Initiator {
            Ok(Some(Stats::of(samples)?))
        } else {
            Ok(None)
        }
    }

    fn launch_pingpong(&self, chan: Chan, floor: bool, iters: i32, initiator: bool) -> Result<()> {
        self.poison_timer()?;
        let (dev, s, t) = (self.device, self.stream.handle(), self.out_ns.ptr());
        match chan {
            // SAFETY: the handles are valid for this device; out_ns is a device u64.
            Chan::Memory => unsafe {
                testing::memchan_pingpong(
                    dev,
                    s,
                    self.mem()?,
                    if floor {
                        testing::Pingpong::RelaxedFloor
                    } else {
                        testing::Pingpong::Ordered
                    },
                    iters,
                    initiator,
                    DEVICE_TIMEOUT_NS,
                    t,
                )
            },
            // SAFETY: as above.
            Chan::Port => unsafe {
                testing::portchan_pingpong(
                    dev,
                    s,
                    self.port()?,
                    iters,
                    initiator,
                    DEVICE_TIMEOUT_NS,
                    t,
                )
            },
        }
        .context("launching the ping-pong kernel")
    }

    /// Poisons the timer word, runs `launch` (a kernel that writes its elapsed
    /// nanoseconds there), waits for it and returns the nanoseconds.
    fn timed_launch(&self, what: &str, launch: impl FnOnce() -> comm::Result<()>) -> Result<u64> {
        self.poison_timer()?;
        launch()?;
        self.sync(what)?;
        let ns = self.read_timer(what)?;
        self.health()?;
        Ok(ns)
    }

    /// One timed launch of `kernel` (a FIFO test kernel of `kernels::testing`)
    /// on rank 0's port channel, `iters` operations: microseconds per operation.
    fn fifo_kernel_us(&self, what: &str, kernel: testing::FifoTest, iters: i32) -> Result<f64> {
        let port = self.port()?;
        // SAFETY: the handle is valid for this device; out_ns is a device u64.
        let ns = self.timed_launch(what, || unsafe {
            testing::fifo(
                self.device,
                self.stream.handle(),
                kernel,
                port,
                iters,
                DEVICE_TIMEOUT_NS,
                self.out_ns.ptr(),
            )
        })?;
        Ok(ns as f64 / iters as f64 / 1e3)
    }

    /// *Collective.* FIFO push -> proxy pop round trip on rank 0's port
    /// channel, microseconds per operation.
    fn fifo_roundtrip(&self, cfg: &Config) -> Result<Option<Stats>> {
        let mut samples = Vec::with_capacity(cfg.reps);
        let result = if self.role == Role::Initiator {
            (0..=cfg.reps).try_for_each(|rep| {
                let iters = if rep == 0 {
                    cfg.fifo_warmup
                } else {
                    cfg.fifo_iters
                };
                let what = format!("FIFO round trip {rep}/{}", cfg.reps);
                let us = self.fifo_kernel_us(&what, testing::FifoTest::RoundTrip, iters)?;
                if rep > 0 {
                    samples.push(us);
                }
                Ok(())
            })
        } else {
            Ok(())
        };
        self.agree("FIFO round trip", result)?;
        if self.role == Role::Initiator {
            Ok(Some(Stats::of(samples)?))
        } else {
            Ok(None)
        }
    }

    /// *Collective.* Latency breakdown on rank 0 (no targets; they explain the
    /// round trips): the slower of the GPU push and the proxy's service per
    /// trigger (back-to-back pushes), and a `cuStreamWriteValue64` from enqueue
    /// on the host to the value being visible in host memory (what a CUDA IPC
    /// signal costs when it must go behind puts still in flight; an idle
    /// connection signals with a CPU store into the peer's shared host memory
    /// instead, see `comm::transport::cuda_ipc`).
    fn breakdown(&self, cfg: &Config) -> Result<Vec<(&'static str, Stats, String)>> {
        let mut out = Vec::new();
        let result = if self.role == Role::Initiator {
            (|| -> Result<()> {
                let iters = cfg.fifo_iters;
                let mut push = Vec::new();
                for rep in 0..=cfg.reps {
                    let us =
                        self.fifo_kernel_us("FIFO push-only", testing::FifoTest::PushOnly, iters)?;
                    if rep > 0 {
                        push.push(us);
                    }
                }
                out.push((
                    "fifo_proxy_service_us",
                    Stats::of(push)?,
                    format!("{iters} back-to-back no-op pushes per launch"),
                ));
                // The internode path: the same FIFO and proxy fed by several producers,
                // or by one thread in batches (push_batch: one atomic, one
                // room check and one system fence per batch); per trigger,
                // the slower of the pushes and the proxy (target: <= 0.5 us,
                // 2 M triggers/s per proxy thread).
                let variants: [(&'static str, u32, u32, u32); 6] = [
                    ("fifo_push_warps4_us", 4, 1, 1),
                    ("fifo_push_warps16_us", 16, 1, 1),
                    ("fifo_push_lanes32_us", 1, 32, 1),
                    ("fifo_push_batch4_us", 1, 1, 4),
                    ("fifo_push_batch16_us", 1, 1, 16),
                    ("fifo_push_warps4_batch16_us", 4, 1, 16),
                ];
                for (name, warps, lanes, batch) in variants {
                    let test = testing::FifoTest::PushMany {
                        warps,
                        lanes,
                        batch,
                    };
                    let mut us = Vec::new();
                    for rep in 0..=cfg.reps {
                        let v = self.fifo_kernel_us(name, test, iters)?;
                        if rep > 0 {
                            us.push(v);
                        }
                    }
                    out.push((
                        name,
                        Stats::of(us)?,
                        format!(
                            "{iters} no-op triggers per launch from {warps} warp(s) x {lanes} lane(s), batches of {batch}"
                        ),
                    ));
                }
                let host = comm::host_memory::HostMemory::pinned(self.device, 64)?;
                // Stream memory op latency, host enqueue -> value visible.
                let word = host.atomic_u64(0);
                let mut wv = Vec::new();
                for i in 1..=1000u64 {
                    let t0 = std::time::Instant::now();
                    // SAFETY: an aligned u64 of device-mapped pinned memory; the stream is ours.
                    unsafe {
                        cudarc::driver::sys::cuStreamWriteValue64_v2(
                            self.stream.handle().raw(),
                            host.device_ptr(),
                            i,
                            0,
                        )
                    }
                    .result()
                    .context("cuStreamWriteValue64")?;
                    while word.load(std::sync::atomic::Ordering::Acquire) != i {
                        if t0.elapsed() > WAIT {
                            bail!("cuStreamWriteValue64 of {i} never became visible");
                        }
                        std::hint::spin_loop();
                    }
                    if i > 100 {
                        wv.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                }
                out.push((
                    "stream_write_value_us",
                    Stats::of(wv)?,
                    "host enqueue -> visible in host memory, 900 samples".to_string(),
                ));
                Ok(())
            })()
        } else {
            Ok(())
        };
        self.agree("latency breakdown", result)?;
        Ok(out)
    }

    // -- bandwidth -----------------------------------------------------------

    /// *Collective.* Put bandwidth of `bytes` from rank 0 into rank 1's buffer:
    /// GB/s per launch, and the launch geometry.
    fn put_bandwidth(
        &self,
        chan: Chan,
        bytes: usize,
        cfg: &Config,
    ) -> Result<Option<(Stats, String, Extra)>> {
        let (blocks, iters) = match chan {
            Chan::Memory => (
                (bytes / BYTES_PER_BLOCK).clamp(1, self.sm_count()?),
                (MEM_BYTES_PER_LAUNCH / bytes).clamp(1, MEM_MAX_ITERS),
            ),
            // Consecutive pieces of one launch must fit the buffer.
            Chan::Port => (1, (MAX_BYTES / bytes).clamp(1, PORT_MAX_ITERS)),
        };
        let what = format!("{} put of {}", chan.name(), fmt_bytes(bytes));
        let mut samples = Vec::with_capacity(cfg.reps);
        let result = if self.role == Role::Initiator {
            (0..=cfg.reps).try_for_each(|rep| {
                let ms = self.events.time(&self.stream, self.rank, &what, || {
                    self.launch_put(chan, bytes, blocks as u32, iters)
                })?;
                self.health()?;
                if rep > 0 {
                    samples.push((bytes * iters) as f64 / (ms * 1e-3) / 1e9);
                }
                Ok(())
            })
        } else {
            Ok(())
        };
        self.agree(&what, result)?;
        if self.role != Role::Initiator {
            return Ok(None);
        }
        let stats = Stats::of(samples)?;
        let us_per_op = bytes as f64 / (stats.median * 1e9) * 1e6;
        let note = match chan {
            Chan::Memory => format!("{blocks}x{THREADS} threads, {iters} puts per launch"),
            Chan::Port => format!("put + flush, {iters} per launch"),
        };
        let extra = match chan {
            Chan::Memory => vec![
                ("blocks", Json::Int(blocks as u64)),
                ("threads", Json::Int(THREADS as u64)),
                ("iters_per_launch", Json::Int(iters as u64)),
                ("median_us_per_op", Json::Num(us_per_op)),
                ("engine", Json::str("SM stores over NVLink (memchan_copy)")),
            ],
            Chan::Port => vec![
                ("blocks", Json::Int(1)),
                ("threads", Json::Int(32)),
                ("iters_per_launch", Json::Int(iters as u64)),
                ("median_us_per_op", Json::Num(us_per_op)),
                (
                    "engine",
                    Json::str("proxy cuMemcpyAsync (copy engine), put + flush per op"),
                ),
            ],
        };
        Ok(Some((stats, note, extra)))
    }

    fn launch_put(&self, chan: Chan, bytes: usize, blocks: u32, iters: usize) -> Result<()> {
        match chan {
            // SAFETY: [0, bytes) lies inside both buffers.
            Chan::Memory => unsafe {
                testing::memchan_copy(
                    self.device,
                    self.stream.handle(),
                    blocks,
                    THREADS,
                    self.mem()?,
                    0,
                    0,
                    bytes as u64,
                    false,
                    iters as i32,
                    false,
                )
            },
            // SAFETY: [0, bytes * iters) lies inside both registered buffers (iters was
            // chosen so); the kernel puts piece i at i * bytes.
            Chan::Port => unsafe {
                testing::portchan_op(
                    self.device,
                    self.stream.handle(),
                    self.port()?,
                    PortOp::PutThenFlush,
                    0,
                    0,
                    (bytes * iters) as u64,
                    iters as i32,
                    DEVICE_TIMEOUT_NS,
                )
            },
        }
        .context("launching the put kernel")
    }

    fn sm_count(&self) -> Result<usize> {
        Ok(self.device.sm_count()?.max(1) as usize)
    }
}

fn short(chan: Chan) -> &'static str {
    match chan {
        Chan::Memory => "memchan",
        Chan::Port => "portchan",
    }
}

fn latency_metric(name: &'static str, stats: Stats, iters: i32, target: Target) -> Metric {
    Metric {
        name,
        unit: "us",
        bytes: None,
        stats,
        target: Some(target),
        note: format!("{iters} round trips per launch"),
        extra: vec![("iters_per_sample", Json::Int(iters as u64))],
    }
}

fn metric_json(m: &Metric) -> Json {
    let mut f: Vec<(&str, Json)> = vec![("metric", Json::str(m.name)), ("unit", Json::str(m.unit))];
    if let Some(b) = m.bytes {
        f.push(("bytes", Json::Int(b as u64)));
    }
    f.push(("median", Json::Num(m.stats.median)));
    f.push(("min", Json::Num(m.stats.min)));
    f.push(("max", Json::Num(m.stats.max)));
    f.push((
        "samples",
        Json::Arr(m.stats.samples.iter().map(|&v| Json::Num(v)).collect()),
    ));
    match &m.target {
        Some(t) => {
            f.push(("target", Json::Num(t.value)));
            let kind = match t.kind {
                TargetKind::Max => "max",
                TargetKind::Min => "min",
            };
            f.push(("target_kind", Json::str(kind)));
            f.push(("reference", Json::str(t.reference)));
            f.push(("pass", Json::Bool(t.met(m.stats.median))));
        }
        None => f.push(("target", Json::Null)),
    }
    for (k, v) in &m.extra {
        f.push((k, v.clone()));
    }
    Json::obj(f)
}

fn summary_table(metrics: &[Metric]) -> String {
    let header = [
        "metric", "size", "median", "min", "max", "unit", "target", "result", "how",
    ];
    let rows: Vec<[String; 9]> = metrics
        .iter()
        .map(|m| {
            let (target, verdict) = match &m.target {
                Some(t) => {
                    let op = match t.kind {
                        TargetKind::Max => "<=",
                        TargetKind::Min => ">=",
                    };
                    let v = if t.met(m.stats.median) {
                        "pass"
                    } else {
                        "MISS"
                    };
                    (format!("{op} {}", t.value), v.to_string())
                }
                None => ("-".into(), "-".into()),
            };
            [
                m.name.to_string(),
                m.bytes.map(fmt_bytes).unwrap_or_else(|| "-".into()),
                format!("{:.2}", m.stats.median),
                format!("{:.2}", m.stats.min),
                format!("{:.2}", m.stats.max),
                m.unit.to_string(),
                target,
                verdict,
                m.note.clone(),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            // Names left-aligned, numbers right-aligned.
            if !(2..5).contains(&i) {
                let _ = write!(out, "{c:<w$}  ");
            } else {
                let _ = write!(out, "{c:>w$}  ");
            }
        }
        let trimmed = out.trim_end().len();
        out.truncate(trimmed);
        out.push('\n');
    };
    line(&mut out, &header);
    let rule: Vec<String> = width.iter().map(|&w| "-".repeat(w)).collect();
    line(
        &mut out,
        &rule.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    for r in &rows {
        line(&mut out, &r.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out
}

fn utc_date() -> String {
    let from_cmd = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty());
    from_cmd.unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("@{secs} (unix seconds)")
    })
}

/// `MOELINK_GIT_COMMIT`, else the commit `scripts/gpu_build.sh` recorded in
/// `.gpu/BUILD_INFO` (when run from the repository root), else "unknown".
fn git_commit() -> String {
    if let Ok(c) = std::env::var("MOELINK_GIT_COMMIT") {
        if !c.trim().is_empty() {
            return c.trim().to_string();
        }
    }
    let info = std::fs::read_to_string(".gpu/BUILD_INFO").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
    };
    match (field("commit="), field("dirty=")) {
        (Some(c), Some(d)) if d == "yes" => format!("{c} (dirty)"),
        (Some(c), _) => c,
        _ => "unknown".into(),
    }
}

fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ ((std::process::id() as u64) << 32) ^ 0xD1B5_4A32_D192_ED03
}

/// This rank's GPU: `LOCAL_RANK` (else `RANK`) modulo the visible GPUs, so ranks
/// share GPUs where they outnumber them (as `python -m moelink.launch` places them).
fn device_ordinal() -> Result<i32> {
    let (name, v) = match std::env::var("LOCAL_RANK") {
        Ok(v) => ("LOCAL_RANK", v),
        Err(_) => (
            "RANK",
            std::env::var("RANK").context("LOCAL_RANK is not set")?,
        ),
    };
    let local: i32 = v
        .trim()
        .parse()
        .with_context(|| format!("{name}={v:?} is not a GPU ordinal"))?;
    let visible = comm::cuda::device_count().max(1) as i32;
    Ok(local % visible)
}

fn run(args: &Args) -> Result<()> {
    let cfg = Config::new(args.quick);
    let device = Device::bind(device_ordinal()?).context("binding the GPU")?;
    let b = Bench::setup(device)?;
    let rank0 = b.rank == 0;
    let log = |msg: &str| {
        if rank0 {
            eprintln!("comm_bench: {msg}");
        }
    };
    let device_desc = format!(
        "rank {}: {} (ordinal {}, {} SMs)",
        b.rank,
        device.name().unwrap_or_else(|e| format!("? ({e})")),
        device.ordinal,
        device.sm_count().unwrap_or(0)
    );
    let devices = b.comm.bootstrap().all_gather(device_desc.as_bytes())?;
    log(&format!(
        "{} ranks; {}",
        b.comm.size(),
        devices
            .iter()
            .map(|d| String::from_utf8_lossy(d).into_owned())
            .collect::<Vec<_>>()
            .join("; ")
    ));

    // 1. Correctness, before any number.
    let seed = b.share_u64(fresh_seed())?;
    log(&format!("correctness checks (seed {seed:#x})"));
    let checks = vec![
        b.check_put(Chan::Memory, seed)?,
        b.check_put(Chan::Port, seed ^ 0x5EED_F00D_FACE)?,
    ];
    log("correctness checks passed");

    // 2. Latencies.
    let mut metrics = Vec::new();
    log("memory-channel signal + wait round trip");
    if let Some(s) = b.pingpong(Chan::Memory, false, &cfg)? {
        metrics.push(latency_metric(
            "memchan_signal_wait_rtt_us",
            s,
            cfg.pingpong_iters,
            Target {
                value: 2.3,
                kind: TargetKind::Max,
                reference: "MSCCL++ 2.35 us (H100)",
            },
        ));
    }
    log("port-channel signal + wait round trip");
    if let Some(s) = b.pingpong(Chan::Port, false, &cfg)? {
        metrics.push(latency_metric(
            "portchan_signal_wait_rtt_us",
            s,
            cfg.pingpong_iters,
            Target {
                value: 10.0,
                kind: TargetKind::Max,
                reference: "MSCCL++ ~19 us (H200)",
            },
        ));
    }
    log("FIFO push -> proxy pop round trip");
    if let Some(s) = b.fifo_roundtrip(&cfg)? {
        metrics.push(latency_metric(
            "fifo_push_pop_rtt_us",
            s,
            cfg.fifo_iters,
            Target {
                value: 2.0,
                kind: TargetKind::Max,
                reference: "MSCCL++ 1.97 us (H200)",
            },
        ));
    }

    // The memory-channel round trip's floor on the same counters
    // (relaxed reduction, relaxed polling): what of the round trip is the link.
    log("memory-channel round trip, relaxed floor");
    if let Some(stats) = b.pingpong(Chan::Memory, true, &cfg)? {
        metrics.push(Metric {
            name: "memchan_relaxed_floor_rtt_us",
            unit: "us",
            bytes: None,
            stats,
            target: None,
            note: format!(
                "{} round trips per launch, relaxed red.add + relaxed polling (no release/acquire)",
                cfg.pingpong_iters
            ),
            extra: vec![],
        });
    }
    log("latency breakdown (proxy service, stream write)");
    for (name, stats, note) in b.breakdown(&cfg)? {
        metrics.push(Metric {
            name,
            unit: "us",
            bytes: None,
            stats,
            target: None,
            note,
            extra: vec![],
        });
    }

    // 3. Bandwidth (rank 0 -> rank 1).
    let fill = match b.role {
        Role::Initiator => b.memset(0, FILL, BUF_BYTES),
        _ => Ok(()),
    };
    b.agree("filling the source buffer", fill)?;
    for chan in [Chan::Memory, Chan::Port] {
        for &bytes in &cfg.sizes {
            log(&format!("{} put, {}", chan.name(), fmt_bytes(bytes)));
            if let Some((stats, note, extra)) = b.put_bandwidth(chan, bytes, &cfg)? {
                let (name, reference) = match chan {
                    Chan::Memory => ("memchan_put_GBps", "copy ceiling ~386 GB/s"),
                    Chan::Port => ("portchan_put_GBps", "MSCCL++ 367 GB/s (tutorial)"),
                };
                metrics.push(Metric {
                    name,
                    unit: "GB/s",
                    bytes: Some(bytes),
                    stats,
                    target: (bytes == TARGET_BYTES).then_some(Target {
                        value: 360.0,
                        kind: TargetKind::Min,
                        reference,
                    }),
                    note,
                    extra,
                });
            }
        }
    }
    b.agree("benchmark", Ok(()))?;

    if rank0 {
        print!("{}", summary_table(&metrics));
        let with_target: Vec<&Metric> = metrics.iter().filter(|m| m.target.is_some()).collect();
        let met = with_target
            .iter()
            .filter(|m| m.target.as_ref().is_some_and(|t| t.met(m.stats.median)))
            .count();
        println!("targets met: {met} of {}", with_target.len());
        let (cc_major, cc_minor) = device.compute_capability().unwrap_or((0, 0));
        let machine = Json::obj(vec![
            ("gpu", Json::str(device.name().unwrap_or_default())),
            ("sm_count", Json::Int(b.sm_count()? as u64)),
            (
                "compute_capability",
                Json::str(format!("{cc_major}.{cc_minor}")),
            ),
            (
                "memory_bytes",
                Json::Int(device.mem_info().map(|(_, t)| t as u64).unwrap_or(0)),
            ),
            ("visible_gpus", Json::Int(comm::device_count() as u64)),
            (
                "hostname",
                Json::str(
                    std::fs::read_to_string("/etc/hostname")
                        .map(|s| s.trim().to_string())
                        .unwrap_or_default(),
                ),
            ),
            (
                "devices",
                Json::Arr(
                    devices
                        .iter()
                        .map(|d| Json::str(String::from_utf8_lossy(d)))
                        .collect(),
                ),
            ),
        ]);
        let config = Json::obj(vec![
            ("quick", Json::Bool(args.quick)),
            ("reps", Json::Int(cfg.reps as u64)),
            ("pingpong_iters", Json::Int(cfg.pingpong_iters as u64)),
            (
                "pingpong_warmup_iters",
                Json::Int(cfg.pingpong_warmup as u64),
            ),
            ("fifo_iters", Json::Int(cfg.fifo_iters as u64)),
            ("fifo_warmup_iters", Json::Int(cfg.fifo_warmup as u64)),
            (
                "sizes",
                Json::Arr(cfg.sizes.iter().map(|&s| Json::Int(s as u64)).collect()),
            ),
            ("buffer_bytes", Json::Int(BUF_BYTES as u64)),
            ("port_transport", Json::str("CUDA IPC")),
        ]);
        let doc = Json::obj(vec![
            ("benchmark", Json::str("comm_bench")),
            ("machine", machine),
            ("world_size", Json::Int(b.comm.size() as u64)),
            ("git_commit", Json::str(git_commit())),
            ("date", Json::str(utc_date())),
            (
                "command",
                Json::str(std::env::args().collect::<Vec<_>>().join(" ")),
            ),
            ("config", config),
            ("checks", Json::Arr(checks)),
            (
                "results",
                Json::Arr(metrics.iter().map(metric_json).collect()),
            ),
        ]);
        let mut text = String::new();
        doc.write(&mut text, 0);
        text.push('\n');
        std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out))?;
        eprintln!("comm_bench: wrote {}", args.out);
    }
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("comm_bench: {e:#}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
        eprintln!("comm_bench (rank {rank}): FAILED: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_median_min_max() {
        let s = Stats::of(vec![3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(s.samples, vec![3.0, 1.0, 2.0]);
        let s = Stats::of(vec![4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!(Stats::of(vec![]).is_err());
        assert!(Stats::of(vec![1.0, f64::NAN]).is_err());
    }

    #[test]
    fn seeded_bytes_are_deterministic_and_not_trivial() {
        let a = seeded_bytes(42, CHECK_BYTES);
        assert_eq!(a.len(), CHECK_BYTES);
        assert_eq!(a, seeded_bytes(42, CHECK_BYTES));
        assert_ne!(a, seeded_bytes(43, CHECK_BYTES));
        assert!(a.iter().filter(|&&b| b == 0).count() < CHECK_BYTES / 64);
    }

    fn received(want: &[u8]) -> Vec<u8> {
        let mut v = vec![POISON; GUARD];
        v.extend_from_slice(want);
        v.extend(std::iter::repeat_n(POISON, GUARD));
        v
    }

    #[test]
    fn verify_catches_mismatches_and_overruns() {
        let want = seeded_bytes(7, 1000);
        assert!(verify(&received(&want), &want).is_ok());

        let mut got = received(&want);
        got[GUARD + 17] ^= 0xFF;
        let e = verify(&got, &want).unwrap_err();
        assert!(
            e.contains("1 of 1000 bytes differ, first at byte 17"),
            "{e}"
        );

        let mut got = received(&want);
        got[GUARD - 3] = 0;
        assert!(verify(&got, &want).unwrap_err().contains("3 bytes before"));

        let mut got = received(&want);
        got[GUARD + 1000 + 2] = 0;
        assert!(verify(&got, &want)
            .unwrap_err()
            .contains("past the destination"));
    }

    #[test]
    fn odd_check_offsets_keep_guards_inside_the_buffer() {
        for (src, dst) in [
            (MEM_CHECK_SRC, MEM_CHECK_DST),
            (PORT_CHECK_SRC, PORT_CHECK_DST),
        ] {
            assert_eq!(src % 2, 1);
            assert_eq!(dst % 2, 1);
            assert!(dst >= GUARD && dst + CHECK_BYTES + GUARD <= BUF_BYTES);
            assert!(src + CHECK_BYTES <= BUF_BYTES);
        }
        assert_eq!(MEM_CHECK_SRC % 16, MEM_CHECK_DST % 16);
    }

    #[test]
    fn sizes_cover_the_sweep() {
        let full = Config::new(false).sizes;
        assert_eq!(full.first(), Some(&KIB));
        assert_eq!(full.last(), Some(&MAX_BYTES));
        assert!(full.contains(&TARGET_BYTES));
        assert_eq!(full.len(), 11);
        assert!(full.windows(2).all(|w| w[0] < w[1]));
        assert!(Config::new(true).sizes.contains(&TARGET_BYTES));
        // Port-channel launches put `iters` consecutive pieces: they must fit.
        for &b in &full {
            assert!(b * (MAX_BYTES / b).clamp(1, PORT_MAX_ITERS) <= MAX_BYTES);
        }
    }

    #[test]
    fn json_is_escaped_and_well_formed() {
        let m = Metric {
            name: "memchan_put_GBps",
            unit: "GB/s",
            bytes: Some(TARGET_BYTES),
            stats: Stats::of(vec![370.5, 365.0, 372.25]).unwrap(),
            target: Some(Target {
                value: 360.0,
                kind: TargetKind::Min,
                reference: "copy \"ceiling\"\n",
            }),
            note: String::new(),
            extra: vec![("blocks", Json::Int(132)), ("x", Json::Num(f64::NAN))],
        };
        let mut out = String::new();
        Json::obj(vec![("results", Json::Arr(vec![metric_json(&m)]))]).write(&mut out, 0);
        for needle in [
            "\"metric\": \"memchan_put_GBps\"",
            "\"bytes\": 134217728",
            "\"median\": 370.5",
            "\"samples\": [370.5, 365, 372.25]",
            "\"target\": 360",
            "\"target_kind\": \"min\"",
            "\"reference\": \"copy \\\"ceiling\\\"\\n\"",
            "\"pass\": true",
            "\"blocks\": 132",
            "\"x\": null",
        ] {
            assert!(out.contains(needle), "{needle} not in {out}");
        }
        let opens = out.matches(['{', '[']).count();
        assert_eq!(opens, out.matches(['}', ']']).count());
    }

    #[test]
    fn table_marks_misses() {
        let lat = latency_metric(
            "memchan_signal_wait_rtt_us",
            Stats::of(vec![2.5, 2.6]).unwrap(),
            1000,
            Target {
                value: 2.3,
                kind: TargetKind::Max,
                reference: "",
            },
        );
        let t = summary_table(&[lat]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("metric"));
        assert!(
            lines[2].contains("<= 2.3") && lines[2].contains("MISS"),
            "{t}"
        );
    }
}
