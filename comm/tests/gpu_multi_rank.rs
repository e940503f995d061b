//! Multi-rank GPU tests of the transport stack. Run on the GPU machine under
//! torchrun, one process per GPU (scripts/gpu_run.sh does this for 2 and 4
//! ranks):
//!
//!     torchrun --nproc-per-node=4 --no-python gpu_multi_rank --include-ignored --test-threads=1
//!
//! One #[test] runs every scenario in order on all ranks over one bootstrap
//! (scenarios are collective), printing `PASS name` / `FAIL name: error` per
//! scenario and failing if any failed. Without torchrun's environment or a GPU
//! it is ignored by default and, when forced, returns with a printed reason.

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::channel::{MemoryChannel, PortChannel};
use comm::device_handles::layout_probe_expected;
use comm::kernels::testing::{self, PortOp};
use comm::proxy::ProxyService;
use comm::registered_memory::RegisteredMemory;
use comm::transport::Transport;
use comm::{
    Bootstrap, CommError, Communicator, CommunicatorOptions, Device, DeviceMemory, OwnedStream,
    TcpBootstrap,
};

type R<T = ()> = Result<T, CommError>;

/// Bound of every device wait (20 s of GPU time: below `WAIT`, so a hang is
/// reported by the device, naming rank and peer).
const TIMEOUT_NS: i64 = 20_000_000_000;
const WAIT: Duration = Duration::from_secs(60);
/// Slots per signal page of the suite's Communicator: small, so that the
/// scenarios' semaphores span many pages (pages are added as they fill).
const SEMAPHORE_SLOTS: u32 = 8;

struct Ctx {
    rank: usize,
    size: usize,
    device: Device,
    /// The suite's group: `comm` is its shared Communicator, made before any
    /// object (with Ethernet, and small signal pages: see `SEMAPHORE_SLOTS`).
    group: comm::Group,
    comm: Arc<Communicator>,
    stream: OwnedStream,
    /// Registered buffer every scenario uses (64 MiB).
    buf: RegisteredMemory,
}

fn fail(what: impl Into<String>) -> CommError {
    CommError::invalid("test", what.into())
}

/// Deterministic bytes of (seed, index) so any rank can compute another's data.
fn bytes_of(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

impl Ctx {
    fn partner(&self) -> usize {
        self.rank ^ 1
    }

    fn sync(&self, what: &str) -> R {
        self.stream
            .synchronize_bounded(WAIT, self.rank as i64, what)?;
        self.comm.device_error().check()
    }

    fn write(&self, off: u64, data: &[u8]) -> R {
        let mem = DeviceMemoryView(&self.buf);
        mem.write(self.device, off, data)
    }

    fn read(&self, off: u64, n: usize) -> R<Vec<u8>> {
        DeviceMemoryView(&self.buf).read(self.device, off, n)
    }

    fn fill(&self, off: u64, n: usize, v: u8) -> R {
        self.write(off, &vec![v; n])
    }
}

/// Host access to a registered device buffer.
struct DeviceMemoryView<'a>(&'a RegisteredMemory);

impl DeviceMemoryView<'_> {
    fn write(&self, device: Device, off: u64, data: &[u8]) -> R {
        self.0.check_range(off, data.len() as u64, "test write")?;
        device.make_current()?;
        // SAFETY: range checked against the registration, mapped in this process.
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.0.ptr() + off, data) }.map_err(
            |source| CommError::Cuda {
                call: "cuMemcpyHtoD",
                source,
            },
        )?;
        // From pageable memory cuMemcpyHtoD may return once the data is staged,
        // before it lands; a peer reads it after a host barrier, so wait for it.
        device.synchronize()
    }

    fn read(&self, device: Device, off: u64, n: usize) -> R<Vec<u8>> {
        self.0.check_range(off, n as u64, "test read")?;
        device.make_current()?;
        let mut v = vec![0u8; n];
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, self.0.ptr() + off) }.map_err(
            |source| CommError::Cuda {
                call: "cuMemcpyDtoH",
                source,
            },
        )?;
        Ok(v)
    }
}

fn check_eq(what: &str, got: &[u8], want: &[u8]) -> R {
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
    Err(fail(format!(
        "{what}: {bad} of {} bytes differ, first at {first} (got {:#x}, want {:#x})",
        want.len(),
        got[first],
        want[first]
    )))
}

fn layout_probe(c: &Ctx) -> R {
    let got = comm::kernels::layout_probe(c.device)?;
    let want = layout_probe_expected();
    if got[..want.len()] != want[..] || got[want.len()] != u64::MAX {
        return Err(fail(format!(
            "device layout {got:?} != host layout {want:?}"
        )));
    }
    Ok(())
}

fn memory_channels(c: &Ctx) -> R<Vec<Option<MemoryChannel>>> {
    c.comm.memory_channels(&c.buf, None)
}

fn memchan_pingpong(c: &Ctx) -> R {
    let chans = memory_channels(c)?;
    let h = chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error())?;
    let out = DeviceMemory::alloc(c.device, 8)?;
    c.comm.barrier()?;
    // SAFETY: handle from this communicator; out is a device u64.
    unsafe {
        testing::memchan_pingpong(
            c.device,
            c.stream.handle(),
            h,
            testing::Pingpong::Ordered,
            1000,
            c.rank % 2 == 0,
            TIMEOUT_NS,
            out.ptr(),
        )
    }?;
    c.sync("memory-channel ping-pong")?;
    let mut ns = [0u64];
    out.copy_to_host(0, &mut ns)?;
    println!(
        "rank {}: memory-channel ping-pong 1000 round trips: {:.2} us each",
        c.rank,
        ns[0] as f64 / 1000.0 / 1000.0
    );
    c.comm.barrier()
}

/// Signal + wait ping-pong over CUDA IPC port channels (the proxy's signal is a
/// CPU store into the peer's shared host memory), then the same interleaved
/// with puts, so signals alternate between the store and the stream path.
fn portchan_pingpong(c: &Ctx) -> R {
    let p = port_channels(c, &c.comm, &c.buf, Transport::CudaIpc)?;
    let h = p.chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error());
    let out = DeviceMemory::alloc(c.device, 8)?;
    c.comm.barrier()?;
    // SAFETY: handle from this communicator; out is a device u64.
    unsafe {
        testing::portchan_pingpong(
            c.device,
            c.stream.handle(),
            h,
            300,
            c.rank % 2 == 0,
            TIMEOUT_NS,
            out.ptr(),
        )
    }?;
    c.sync("port-channel ping-pong")?;
    let mut ns = [0u64];
    out.copy_to_host(0, &mut ns)?;
    println!(
        "rank {}: port-channel ping-pong 300 round trips: {:.2} us each",
        c.rank,
        ns[0] as f64 / 300.0 / 1000.0
    );
    c.comm.device_error().check()?;
    p.proxy.check()?;
    c.comm.barrier()?;
    // Interleaved: 20 rounds of (put 1 MiB, signal, wait), each checked.
    let view = DeviceMemoryView(&c.buf);
    const SRC: u64 = 4 << 20;
    const DST: u64 = 8 << 20;
    const N: usize = 1 << 20;
    for round in 0..20u64 {
        let seed = |r: usize| (r as u64) << 32 | round | 7 << 56;
        view.write(c.device, SRC, &bytes_of(seed(c.rank), N))?;
        c.comm.barrier()?;
        // SAFETY: ranges inside both ranks' registered buffers.
        unsafe {
            for (op, size) in [
                (PortOp::Put, N as u64),
                (PortOp::Signal, 0),
                (PortOp::Wait, 0),
            ] {
                testing::portchan_op(
                    c.device,
                    c.stream.handle(),
                    h,
                    op,
                    DST,
                    SRC,
                    size,
                    1,
                    TIMEOUT_NS,
                )?;
            }
        }
        c.sync("port-channel put, signal, wait")?;
        c.comm.device_error().check()?;
        p.proxy.check()?;
        check_eq(
            &format!("port put + signal round {round}"),
            &view.read(c.device, DST, N)?,
            &bytes_of(seed(c.partner()), N),
        )?;
        c.comm.barrier()?;
    }
    Ok(())
}

/// Odd sizes and offsets, put and get, over memory channels.
fn memchan_put_get(c: &Ctx) -> R {
    let chans = memory_channels(c)?;
    let h = chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error())?;
    let cases: &[(u64, u64, usize)] = &[
        (0, 0, 1),
        (1, 7, 3),
        (16, 16, 15),
        (33, 5, 17),
        (4096, 1, 4097),
        (1 << 20, 3, (1 << 20) + 5),
    ];
    const SRC: u64 = 0; // source region [0, 16 MiB)
    const DST: u64 = 16 << 20; // destination region [16, 32 MiB)
    for (i, &(dst_off, src_off, n)) in cases.iter().enumerate() {
        for get in [false, true] {
            let seed = |r: usize| (r as u64) << 32 | (i as u64) << 1 | get as u64;
            // Both sides: our data at SRC + src_off, poison in DST.
            c.fill(DST, (2 << 20) + 64, 0xA5)?;
            c.write(SRC + src_off, &bytes_of(seed(c.rank), n))?;
            c.comm.barrier()?;
            // put: we write our data into the partner's DST + dst_off.
            // get: we read the partner's data (its SRC + src_off) into our DST + dst_off.
            // SAFETY: both ranges lie in the 64 MiB buffers of both ranks.
            unsafe {
                if get {
                    testing::memchan_copy(
                        c.device,
                        c.stream.handle(),
                        8,
                        256,
                        h,
                        SRC + src_off,
                        DST + dst_off,
                        n as u64,
                        true,
                        1,
                        false,
                    )
                } else {
                    testing::memchan_copy(
                        c.device,
                        c.stream.handle(),
                        1,
                        512,
                        h,
                        DST + dst_off,
                        SRC + src_off,
                        n as u64,
                        false,
                        1,
                        true,
                    )
                }
            }?;
            if !get {
                // SAFETY: handle from this communicator.
                unsafe { testing::memchan_wait(c.device, c.stream.handle(), h, TIMEOUT_NS) }?;
            }
            c.sync("put/get")?;
            c.comm.barrier()?;
            let got = c.read(DST, dst_off as usize + n + 16)?;
            let mut want = vec![0xA5u8; dst_off as usize];
            want.extend(bytes_of(seed(c.partner()), n));
            want.extend([0xA5u8; 16]);
            check_eq(
                &format!(
                    "{} case {i} ({n} bytes, dst+{dst_off}, src+{src_off})",
                    if get { "get" } else { "put" }
                ),
                &got,
                &want,
            )?;
        }
    }
    Ok(())
}

/// A buffer registered through a legacy CUDA IPC handle (the fallback of
/// alloc_memory): peers map it and a memory-channel put lands.
fn legacy_ipc_put(c: &Ctx) -> R {
    let mem = Arc::new(DeviceMemory::alloc(c.device, 1 << 20)?);
    mem.fill(0xA5)?;
    let reg = c.comm.register_legacy(mem.clone())?;
    let chans = c.comm.memory_channels(&reg, None)?;
    let h = chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error())?;
    let n = 12_345usize;
    let seed = |r: usize| 0x1E6A ^ (r as u64) << 20;
    mem.copy_from_host(0, &bytes_of(seed(c.rank), n))?;
    c.comm.barrier()?;
    // SAFETY: both ranges lie inside the 1 MiB legacy buffers.
    unsafe {
        testing::memchan_copy(
            c.device,
            c.stream.handle(),
            1,
            512,
            h,
            500_001,
            0,
            n as u64,
            false,
            1,
            true,
        )?;
        testing::memchan_wait(c.device, c.stream.handle(), h, TIMEOUT_NS)?;
    }
    c.sync("legacy IPC put")?;
    let mut got = vec![0u8; n + 2];
    mem.copy_to_host(500_000, &mut got)?;
    let mut want = vec![0xA5u8];
    want.extend(bytes_of(seed(c.partner()), n));
    want.push(0xA5);
    check_eq("legacy CUDA IPC put", &got, &want)?;
    c.comm.barrier()
}

fn packets(c: &Ctx) -> R {
    let chans = memory_channels(c)?;
    let h = chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error())?;
    const SRC: u64 = 0;
    const PKT: u64 = 32 << 20;
    const OUT: u64 = 48 << 20;
    for ll16 in [false, true] {
        for (round, n) in [8usize, 4096, 100_000, 1 << 20].into_iter().enumerate() {
            let flag = 1 + round as u32 + if ll16 { 100 } else { 0 };
            let seed = |r: usize| 0xBEEF ^ (r as u64) << 40 ^ flag as u64;
            c.write(SRC, &bytes_of(seed(c.rank), n))?;
            c.fill(OUT, n, 0x5A)?;
            c.comm.barrier()?;
            // SAFETY: packets take 2n bytes at PKT; all ranges inside 64 MiB.
            unsafe {
                testing::packets(
                    c.device,
                    c.stream.handle(),
                    h,
                    ll16,
                    false,
                    PKT,
                    SRC,
                    n as u64,
                    flag,
                    TIMEOUT_NS,
                )?;
                testing::packets(
                    c.device,
                    c.stream.handle(),
                    h,
                    ll16,
                    true,
                    PKT,
                    OUT,
                    n as u64,
                    flag,
                    TIMEOUT_NS,
                )?;
            }
            c.sync("packets")?;
            check_eq(
                &format!(
                    "{} packets, {n} bytes, flag {flag}",
                    if ll16 { "LL16" } else { "LL8" }
                ),
                &c.read(OUT, n)?,
                &bytes_of(seed(c.partner()), n),
            )?;
            c.comm.barrier()?;
        }
    }
    Ok(())
}

struct Ports {
    proxy: ProxyService,
    chans: Vec<Option<PortChannel>>,
}

fn port_channels(
    c: &Ctx,
    comm: &Communicator,
    buf: &RegisteredMemory,
    transport: Transport,
) -> R<Ports> {
    let mut proxy = ProxyService::new(c.rank, Some(c.device), 512, 0)?;
    let chans = comm.port_channels(&proxy, buf, transport)?;
    proxy.start()?;
    Ok(Ports { proxy, chans })
}

fn port_put_signal_flush(
    c: &Ctx,
    comm: &Communicator,
    buf: &RegisteredMemory,
    transport: Transport,
) -> R {
    let p = port_channels(c, comm, buf, transport)?;
    let h = p.chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(comm.device_error());
    let view = DeviceMemoryView(buf);
    const SRC: u64 = 0;
    const DST: u64 = 16 << 20;
    // Put then a separate Signal trigger (no flush): over CUDA IPC the signal
    // is a CPU store only once the puts are known complete, else a stream
    // write behind them; either way the data must be there when the wait returns.
    let ops = [
        (PortOp::PutWithSignal, 1),
        (PortOp::PutWithSignalAndFlush, 1),
        (PortOp::PutThenFlush, 7),
        (PortOp::Put, 3),
    ];
    for (i, &(op, pieces)) in ops.iter().enumerate() {
        for (j, &(n, dst_off, src_off)) in [(1usize, 3u64, 5u64), (4097, 0, 1), (3 << 20, 8, 8)]
            .iter()
            .enumerate()
        {
            let n = n / pieces * pieces; // whole pieces
            let n = n.max(pieces);
            let seed = |r: usize| (r as u64) << 32 | (i * 16 + j) as u64 | 1 << 60;
            view.write(c.device, DST, &vec![0xA5; n + dst_off as usize + 16])?;
            view.write(c.device, SRC + src_off, &bytes_of(seed(c.rank), n))?;
            comm.barrier()?;
            // SAFETY: ranges inside both ranks' registered buffers.
            unsafe {
                testing::portchan_op(
                    c.device,
                    c.stream.handle(),
                    h,
                    op,
                    DST + dst_off,
                    SRC + src_off,
                    n as u64,
                    pieces as i32,
                    TIMEOUT_NS,
                )?;
                if op == PortOp::PutThenFlush || op == PortOp::Put {
                    // PutThenFlush: the flush returned only after the data
                    // landed; Put: the signal must order after the puts. Now signal.
                    testing::portchan_op(
                        c.device,
                        c.stream.handle(),
                        h,
                        PortOp::Signal,
                        0,
                        0,
                        0,
                        1,
                        TIMEOUT_NS,
                    )?;
                }
                testing::portchan_op(
                    c.device,
                    c.stream.handle(),
                    h,
                    PortOp::Wait,
                    0,
                    0,
                    0,
                    1,
                    TIMEOUT_NS,
                )?;
            }
            c.stream
                .synchronize_bounded(WAIT, c.rank as i64, "port channel op")?;
            comm.device_error().check()?;
            p.proxy.check()?;
            let got = view.read(c.device, DST, n + dst_off as usize + 16)?;
            let mut want = vec![0xA5u8; dst_off as usize];
            want.extend(bytes_of(seed(c.partner()), n));
            want.extend([0xA5u8; 16]);
            check_eq(&format!("{transport:?} port {op:?} {n} bytes"), &got, &want)?;
            comm.barrier()?;
        }
    }
    Ok(())
}

/// What [`port_beside_a_spinning_kernel`] queues behind its spinning kernels.
#[derive(Clone, Copy, Debug)]
enum Queued {
    /// Nothing.
    Nothing,
    /// A flush kernel behind the puts on the main stream (it spins until the
    /// proxy performed them).
    FlushBehindPuts,
    /// An empty kernel behind the side stream's waiting one (it can start only
    /// once that wait is over).
    KernelBehindWait,
    /// Puts of 128 KiB (an internode chunk moves ~115 KB) instead of 16 KiB.
    BigPuts,
    /// No side stream: the kernel that pushes the puts then waits for the
    /// partner's signals (the internode kernels stay after pushing theirs).
    PusherWaits,
    /// A 4 KiB device-to-device `cuMemcpyAsync` behind the side stream's
    /// waiting kernel (a copy that can start only once the wait is over).
    CopyBehindWait,
    /// A third stream ordered after the side stream's waiting kernel (an
    /// event), then a 4 KiB copy on it: what a Buffer's caller does when its
    /// compute stream waits for the comm stream and then reads a result.
    CopyAfterWaitElsewhere,
    /// A 256 MiB `cuMemAlloc` between the side stream's waiting kernel and the
    /// puts (what a Buffer's caller did when it allocated a dispatch's outputs
    /// between the internode senders and receivers; the internode stall).
    AllocBeforePuts,
    /// Right after the puts, a 64 MiB upload from pageable host memory on the
    /// legacy stream, ordered after the side stream's waiting kernel (what
    /// the bench did: `tensor.to("cuda")` on the compute stream, which waits
    /// for the dispatch; the internode stall after the senders' deferral).
    PageableUploadAfterIt,
}

/// A stream of its own, ordered after another by an event.
struct ThirdStream {
    stream: OwnedStream,
    order: comm::cuda::StreamOrder,
}

impl ThirdStream {
    fn new(device: Device) -> R<Self> {
        Ok(Self {
            stream: OwnedStream::new(device)?,
            order: comm::cuda::StreamOrder::new(device)?,
        })
    }

    /// Work issued to this stream from now on waits for `other`'s so far.
    fn after(&self, other: &OwnedStream) -> R {
        self.order.after(self.stream.handle(), other.handle())
    }
}

/// A 4 KiB device-to-device copy inside this rank's buffer (56 MiB -> 60 MiB
/// less 4 KiB: clear of the scenario's data) on `stream`.
fn local_copy(c: &Ctx, stream: comm::StreamHandle) -> R {
    const FROM: u64 = 56 << 20;
    const TO: u64 = (60 << 20) - 4096;
    let base = c.buf.ptr();
    c.device.make_current()?;
    // SAFETY: both ranges lie inside this rank's 64 MiB registration.
    let r =
        unsafe { cudarc::driver::sys::cuMemcpyAsync(base + TO, base + FROM, 4096, stream.raw()) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(CommError::invalid("cuMemcpyAsync", format!("{r:?}")));
    }
    Ok(())
}

/// 64 MiB of pageable host memory and room for it on the GPU, made before
/// the kernels (allocating takes the host milliseconds: the upload must
/// follow the puts at once, while the proxy still copies).
struct PageableUpload {
    host: Vec<u8>,
    dst: DeviceMemory,
    order: comm::cuda::StreamOrder,
}

impl PageableUpload {
    const BYTES: usize = 64 << 20;

    fn new(device: Device) -> R<Self> {
        Ok(Self {
            host: vec![0x3C; Self::BYTES],
            dst: DeviceMemory::alloc(device, Self::BYTES)?,
            order: comm::cuda::StreamOrder::new(device)?,
        })
    }

    /// Uploads it on the legacy stream once everything issued to `side` so
    /// far is done. The call itself may block the host until then (a
    /// pageable source is staged).
    fn after(&self, device: Device, side: &OwnedStream) -> R {
        let legacy = comm::StreamHandle(0);
        self.order.after(legacy, side.handle())?;
        device.make_current()?;
        // SAFETY: `dst` holds BYTES, and so does `host`, which outlives the
        // call (a pageable source is read before it returns).
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                self.dst.ptr(),
                self.host.as_ptr().cast(),
                Self::BYTES,
                legacy.raw(),
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(CommError::invalid("cuMemcpyHtoDAsync", format!("{r:?}")));
        }
        Ok(())
    }
}

/// The internode stall, reduced (docs/design-internode.md, "Status"): the proxy's
/// copies (`transport`: CUDA IPC's puts, or Ethernet's copies out of and into
/// GPU memory) while kernels of this rank spin on two streams, as the
/// internode dispatch's senders and its fused receivers do. On a side stream a
/// kernel waits for the partner's K signals; on the main stream a kernel pushes
/// K puts with signals; `queued` says what else waits in the streams (the
/// variants tell which ingredient a stall needs). Every wait is bounded; the
/// data is checked.
fn port_beside_a_spinning_kernel(c: &Ctx, transport: Transport, queued: Queued) -> R {
    let side = OwnedStream::new(c.device)?;
    let result = beside_a_spinning_kernel(c, &side, transport, queued);
    if result.is_err() {
        // A stall times the kernels out on the GPU: let them end, and clear the
        // record so that the scenarios after this one start clean.
        let _ = side.synchronize_bounded(WAIT, c.rank as i64, "the side stream");
        let _ = c
            .stream
            .synchronize_bounded(WAIT, c.rank as i64, "the main stream");
        c.comm.device_error().reset();
    }
    result
}

fn beside_a_spinning_kernel(
    c: &Ctx,
    side: &OwnedStream,
    transport: Transport,
    queued: Queued,
) -> R {
    let p = port_channels(c, &c.comm, &c.buf, transport)?;
    let h = p.chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error());
    let view = DeviceMemoryView(&c.buf);
    const SRC: u64 = 0;
    const DST: u64 = 32 << 20;
    let (k, piece) = match queued {
        Queued::BigPuts => (256usize, 128usize << 10),
        _ => (512, 16 << 10),
    };
    let n = k * piece;
    let third = ThirdStream::new(c.device)?;
    let mut allocated = None;
    let upload = match queued {
        Queued::PageableUploadAfterIt => Some(PageableUpload::new(c.device)?),
        _ => None,
    };
    // A stall shows in seconds: 8 MiB of CUDA IPC copies take milliseconds.
    const SPIN_TIMEOUT_NS: i64 = 5_000_000_000;
    let seed = |r: usize| (r as u64) << 32 | 0x5717 | 1 << 61;
    view.write(c.device, DST, &vec![0xA5; n])?;
    view.write(c.device, SRC, &bytes_of(seed(c.rank), n))?;
    c.comm.barrier()?;
    // One thread's port operation, `iters` times (0: an empty kernel), on `stream`.
    let op = |stream: &OwnedStream, op, dst, src, size, iters| {
        // SAFETY: ranges inside both ranks' registered buffers.
        unsafe {
            testing::portchan_op(
                c.device,
                stream.handle(),
                h,
                op,
                dst,
                src,
                size,
                iters,
                SPIN_TIMEOUT_NS,
            )
        }
    };
    if let Queued::PusherWaits = queued {
        op(
            &c.stream,
            PortOp::PutWithSignalThenWait,
            DST,
            SRC,
            n as u64,
            k as i32,
        )?;
    } else {
        op(side, PortOp::Wait, 0, 0, 0, k as i32)?;
        match queued {
            Queued::KernelBehindWait => op(side, PortOp::Put, 0, 0, 0, 0)?,
            Queued::CopyBehindWait => local_copy(c, side.handle())?,
            Queued::CopyAfterWaitElsewhere => {
                third.after(side)?;
                local_copy(c, third.stream.handle())?;
            }
            Queued::AllocBeforePuts => allocated = Some(DeviceMemory::alloc(c.device, 256 << 20)?),
            _ => {}
        }
        op(
            &c.stream,
            PortOp::PutWithSignal,
            DST,
            SRC,
            n as u64,
            k as i32,
        )?;
    }
    if let Queued::FlushBehindPuts = queued {
        op(&c.stream, PortOp::Flush, 0, 0, 0, 1)?;
    }
    if let Some(u) = &upload {
        u.after(c.device, side)?;
    }
    side.synchronize_bounded(
        Duration::from_secs(15),
        c.rank as i64,
        &format!("the side stream's wait for the partner's signals ({queued:?} queued)"),
    )?;
    c.sync(&format!("the puts ({queued:?} queued)"))?;
    drop(allocated);
    drop(upload);
    p.proxy.check()?;
    check_eq(
        &format!("puts beside a spinning kernel ({queued:?} queued)"),
        &view.read(c.device, DST, n)?,
        &bytes_of(seed(c.partner()), n),
    )?;
    c.comm.barrier()
}

/// Every rank but 0 hammers rank 0's counters with 64- and 32-bit atomic adds
/// from many GPU threads through its proxy; rank 0 checks exact totals and
/// that the neighbouring words are untouched.
fn port_atomics(c: &Ctx, comm: &Communicator, buf: &RegisteredMemory, transport: Transport) -> R {
    let p = port_channels(c, comm, buf, transport)?;
    const BASE: u64 = 60 << 20;
    // layout: canary u64 | counter u64 | canary u32 | counter u32 | canary u32 | pad
    let canary = 0x0123_4567_89AB_CDEFu64;
    let mut init = Vec::new();
    init.extend(canary.to_le_bytes());
    init.extend(1000u64.to_le_bytes());
    init.extend(0xCAFE_F00Du32.to_le_bytes());
    init.extend(7u32.to_le_bytes());
    init.extend(0xDEAD_BEEFu32.to_le_bytes());
    init.extend([0u8; 4]);
    let view = DeviceMemoryView(buf);
    view.write(c.device, BASE, &init)?;
    comm.barrier()?;
    let (blocks, threads, per) = (4u32, 64u32, 8i32);
    if c.rank != 0 {
        let h = p.chans[0]
            .as_ref()
            .unwrap()
            .device_handle(comm.device_error());
        // SAFETY: aligned counters inside rank 0's buffer.
        unsafe {
            testing::portchan_atomics(
                c.device,
                c.stream.handle(),
                blocks,
                threads,
                h,
                BASE + 8,
                BASE + 20,
                per,
                3,
                -2,
            )?;
            testing::portchan_op(
                c.device,
                c.stream.handle(),
                h,
                PortOp::Flush,
                0,
                0,
                0,
                1,
                TIMEOUT_NS,
            )?;
        }
        c.stream
            .synchronize_bounded(WAIT, c.rank as i64, "atomics")?;
        comm.device_error().check()?;
        p.proxy.check()?;
    }
    comm.barrier()?;
    if c.rank == 0 {
        let b = view.read(c.device, BASE, 32)?;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let adds = (c.size as u64 - 1) * (blocks * threads) as u64 * per as u64;
        let want64 = 1000 + 3 * adds;
        let want32 = 7u32.wrapping_sub(2 * adds as u32);
        if u64_at(0) != canary || u32_at(16) != 0xCAFE_F00D || u32_at(24) != 0xDEAD_BEEF {
            return Err(fail(format!(
                "{transport:?} atomics touched a neighbour: {b:02x?}"
            )));
        }
        if u64_at(8) != want64 || u32_at(20) != want32 {
            return Err(fail(format!(
                "{transport:?} atomics: u64 {} (want {want64}), u32 {} (want {want32})",
                u64_at(8),
                u32_at(20)
            )));
        }
    }
    comm.barrier()
}

/// A wait nobody answers must end with an error naming the rank and the peer,
/// not hang, and not before its time bound (ranks that share a GPU and are
/// time-sliced poll less often, but the bound is GPU time, not polls).
fn timeout_is_reported(c: &Ctx) -> R {
    const BOUND: Duration = Duration::from_millis(100);
    let chans = memory_channels(c)?;
    let h = chans[c.partner()]
        .as_ref()
        .unwrap()
        .device_handle(c.comm.device_error())?;
    c.comm.device_error().reset();
    let start = Instant::now();
    // SAFETY: handle from this communicator.
    unsafe { testing::memchan_wait(c.device, c.stream.handle(), h, BOUND.as_nanos() as i64) }?;
    c.stream
        .synchronize_bounded(WAIT, c.rank as i64, "timed-out wait")?;
    let took = start.elapsed();
    if took < BOUND {
        return Err(fail(format!(
            "a wait bounded by {BOUND:?} gave up after {took:?}"
        )));
    }
    let r = c.comm.device_error().check();
    c.comm.device_error().reset();
    match r {
        Err(CommError::Timeout { rank, what, .. })
            if rank == c.rank as i64 && what.contains(&format!("from rank {}", c.partner())) =>
        {
            println!(
                "rank {}: reported as expected: {}",
                c.rank,
                CommError::Timeout {
                    rank,
                    what,
                    waited_ms: 0
                }
            );
            c.comm.barrier()
        }
        other => Err(fail(format!(
            "expected a timeout naming rank {} and peer {}, got {other:?}",
            c.rank,
            c.partner()
        ))),
    }
}

/// No CUDA context on any device but ours: nothing (proxy thread included)
/// allocated or ran on another GPU.
/// The communicator's topology on one host: one node, ranks round-robin on the
/// GPUs (sharing where they outnumber them), every peer mapped where the GPUs
/// reach each other. Then a second communicator of the group with
/// MOELINK_RANKS_PER_NODE = size / 2: two emulated nodes, the other node's
/// ranks through the proxy over CUDA IPC.
fn topology(c: &Ctx) -> R {
    use comm::topology::Reach;
    let ndev = comm::device_count();
    let t = c.comm.topology();
    let want = |ok: bool, what: String| if ok { Ok(()) } else { Err(fail(what)) };
    want(
        t.num_nodes() == 1
            && t.local_rank() == c.rank
            && t.all_mapped() == t.peers().iter().all(|p| p.p2p),
        format!("rank {}: one host, got {t:?}", c.rank),
    )?;
    for (r, p) in t.peers().iter().enumerate() {
        let shares = r % ndev == c.rank % ndev;
        want(
            p.same_host && p.shares_device == shares && (!shares || p.p2p),
            format!("rank {}: peer {r}: {p:?} (shares GPU: {shares})", c.rank),
        )?;
    }
    let scoped = c.group.scope("emulated nodes")?;
    // The topology is read when the communicator is made.
    std::env::set_var("MOELINK_RANKS_PER_NODE", (c.size / 2).to_string());
    let two = Communicator::new(Arc::new(scoped), Some(c.device), Default::default());
    std::env::remove_var("MOELINK_RANKS_PER_NODE");
    let two = two?;
    let t2 = two.topology();
    let half = c.size / 2;
    want(
        t2.num_nodes() == 2 && t2.node() == c.rank / half && t2.local_rank() == c.rank % half,
        format!("rank {}: two emulated nodes, got {t2:?}", c.rank),
    )?;
    for (r, p) in t2.peers().iter().enumerate() {
        let ok = match p.reach {
            Reach::Local => r == c.rank,
            Reach::Memory => r / half == c.rank / half && p.p2p,
            Reach::Port(Transport::CudaIpc) => r / half != c.rank / half || !p.p2p,
            Reach::Port(_) => false,
        };
        want(
            ok,
            format!("rank {}: peer {r} in emulated nodes: {p:?}", c.rank),
        )?;
    }
    drop(two);
    c.comm.barrier()
}

/// SymmetricRegion: its prefix reads zero although the allocator hands out
/// dirty memory, every rank's copy is mapped here and holds what its owner
/// wrote, and the channel table has one handle per rank (ours zeroed).
fn symmetric_region(c: &Ctx) -> R {
    use comm::device_handles::MemoryChannelDeviceHandle;
    use comm::SymmetricRegion;
    let (bytes, zeroed, n) = (1usize << 20, 4096usize, 256usize);
    {
        // Dirty memory for the allocator to recycle.
        let m = c.comm.alloc_memory(bytes)?;
        DeviceMemoryView(&m).write(c.device, 0, &vec![0xAB; bytes])?;
    }
    let region = SymmetricRegion::new(&c.comm, bytes, zeroed)?;
    let prefix = DeviceMemoryView(region.local()).read(c.device, 0, zeroed)?;
    check_eq("zeroed prefix", &prefix, &vec![0; zeroed])?;
    let seed = 0x5EED_0000 + c.rank as u64;
    DeviceMemoryView(region.local()).write(c.device, zeroed as u64, &bytes_of(seed, n))?;
    c.comm.barrier()?;
    if region.bases().iter().any(|b| b.is_none()) || !region.all_mapped() {
        return Err(fail(format!(
            "rank {}: unmapped copies on one host: {region:?}",
            c.rank
        )));
    }
    for (p, m) in region.peers().iter().enumerate() {
        let got = DeviceMemoryView(m).read(c.device, zeroed as u64, n)?;
        check_eq(
            &format!("rank {p}'s copy"),
            &got,
            &bytes_of(0x5EED_0000 + p as u64, n),
        )?;
    }
    let (channels, table) = region.memory_channel_table(&c.comm, 1, c.comm.device_error())?;
    let channels = &channels[0];
    let h = std::mem::size_of::<MemoryChannelDeviceHandle>();
    if table.len() != c.size * h || channels.len() != c.size || channels[c.rank].is_some() {
        return Err(fail(format!(
            "rank {}: table of {} bytes for {} ranks",
            c.rank,
            table.len(),
            c.size
        )));
    }
    let mut raw = vec![0u8; table.len()];
    table.copy_to_host(0, &mut raw)?;
    for (p, e) in raw.chunks(h).enumerate() {
        let zero = e.iter().all(|&b| b == 0);
        if zero != (p == c.rank) {
            return Err(fail(format!(
                "rank {}: table entry {p} zero: {zero}",
                c.rank
            )));
        }
    }
    c.comm.barrier()
}

/// One object made on the suite's group: its region, channel table and the
/// channels behind it.
struct RegionObject {
    member: comm::Member,
    region: comm::SymmetricRegion,
    channels: Vec<Vec<Option<MemoryChannel>>>,
    _table: DeviceMemory,
}

fn region_object(c: &Ctx, kind: &str, rows: usize) -> R<RegionObject> {
    use comm::SymmetricRegion;
    // Asks for no Ethernet and the default page size: the group's
    // Communicator (made with both by the suite) serves it as it is.
    let mut member = c
        .group
        .join(kind, Some(c.device), &CommunicatorOptions::default())?;
    let region = SymmetricRegion::new(member.comm(), 1 << 20, 0)?;
    let (channels, table) =
        region.memory_channel_table(member.comm(), rows, member.device_error())?;
    member.ready()?;
    Ok(RegionObject {
        member,
        region,
        channels,
        _table: table,
    })
}

/// Two objects on one group share the group's one Communicator (the suite's),
/// the second one's semaphores spill onto new signal pages, memory channels
/// of both (first and last rows) carry a put, and a device wait that times
/// out on one object's channel is reported by that object only.
fn shared_communicator(c: &Ctx) -> R {
    let pages_before = c.comm.signal_pages();
    let per_page = c.comm.semaphores_per_page() as usize;
    let a = region_object(c, "shared region a", 1)?;
    // More rows than a page holds: at least one page is added meanwhile.
    let rows = per_page + 1;
    let b = region_object(c, "shared region b", rows)?;
    let pages_after = c.comm.signal_pages();
    if !Arc::ptr_eq(a.member.comm(), &c.comm) || !Arc::ptr_eq(b.member.comm(), &c.comm) {
        return Err(fail(format!(
            "rank {}: an object on the group got a Communicator of its own",
            c.rank
        )));
    }
    if pages_after <= pages_before {
        return Err(fail(format!(
            "rank {}: {rows} rows of semaphores ({per_page} per page) added no signal page \
             ({pages_before} before, {pages_after} after)",
            c.rank
        )));
    }
    let n = 40_000usize;
    const DST: u64 = 512 << 10;
    let cases = [(&a, 0usize, 1u64), (&b, 0, 2), (&b, rows - 1, 3)];
    for (obj, row, tag) in cases {
        let h = obj.channels[row][c.partner()]
            .as_ref()
            .ok_or_else(|| fail("no channel to the partner"))?
            .device_handle(obj.member.device_error())?;
        let seed = |r: usize| (tag << 40) | (r as u64) << 8 | 0x5A;
        let view = DeviceMemoryView(obj.region.local());
        view.write(c.device, 0, &bytes_of(seed(c.rank), n))?;
        view.write(c.device, DST, &vec![0xA5; n + 16])?;
        obj.member.barrier()?;
        // SAFETY: [0, n) and [DST, DST + n) lie inside both ranks' 1 MiB regions.
        unsafe {
            testing::memchan_copy(
                c.device,
                c.stream.handle(),
                1,
                512,
                h,
                DST,
                0,
                n as u64,
                false,
                1,
                true,
            )?;
            testing::memchan_wait(c.device, c.stream.handle(), h, TIMEOUT_NS)?;
        }
        c.stream
            .synchronize_bounded(WAIT, c.rank as i64, "put on a shared communicator")?;
        obj.member.check_device()?;
        let mut want = bytes_of(seed(c.partner()), n);
        want.extend([0xA5u8; 16]);
        check_eq(
            &format!(
                "{} row {row}: put from rank {}",
                obj.member.kind(),
                c.partner()
            ),
            &view.read(c.device, DST, n + 16)?,
            &want,
        )?;
        obj.member.barrier()?;
    }
    // Nobody signals a's channel now: its wait times out into a's record only.
    let h = a.channels[0][c.partner()]
        .as_ref()
        .ok_or_else(|| fail("no channel to the partner"))?
        .device_handle(a.member.device_error())?;
    // SAFETY: handle of a live channel of a.
    unsafe { testing::memchan_wait(c.device, c.stream.handle(), h, 50_000_000) }?;
    c.stream
        .synchronize_bounded(WAIT, c.rank as i64, "timed-out wait")?;
    let got_a = a.member.check_device_timeout();
    let (got_b, got_comm) = (b.member.check_device(), c.comm.device_error().check());
    a.member.device_error().reset();
    match (got_a, got_b, got_comm) {
        (Err(CommError::Timeout { rank, .. }), Ok(()), Ok(())) if rank == c.rank as i64 => {}
        other => {
            return Err(fail(format!(
                "rank {}: expected a timeout in object a's record only, got {other:?}",
                c.rank
            )))
        }
    }
    c.comm.barrier()
}

fn nothing_on_other_devices(c: &Ctx) -> R {
    for d in 0..comm::device_count() as i32 {
        if d == c.device.ordinal {
            continue;
        }
        let dev = cudarc::driver::result::device::get(d).map_err(|source| CommError::Cuda {
            call: "cuDeviceGet",
            source,
        })?;
        let (mut flags, mut active) = (0u32, 0i32);
        // SAFETY: dev is a valid device; outputs are plain integers.
        unsafe { cudarc::driver::sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) }
            .result()
            .map_err(|source| CommError::Cuda {
                call: "cuDevicePrimaryCtxGetState",
                source,
            })?;
        if active != 0 {
            return Err(fail(format!(
                "rank {} (GPU {}) has an active context on GPU {d}",
                c.rank, c.device.ordinal
            )));
        }
    }
    Ok(())
}

/// Free device memory read while no rank allocates or frees (ranks that share
/// the GPU move its free memory too): meet, read, meet again.
fn quiesced_free_memory(c: &Ctx) -> R<usize> {
    c.device.synchronize()?;
    c.comm.barrier()?;
    let (free, _) = c.device.mem_info()?;
    c.comm.barrier()?;
    Ok(free)
}

/// 500 x (allocate 1 GiB, register, every peer maps it, drop everything):
/// device memory use must come back to where it started.
fn create_destroy_500(c: &Ctx) -> R {
    let free_before = quiesced_free_memory(c)?;
    let start = Instant::now();
    for i in 0..500 {
        let m = c.comm.alloc_memory(1 << 30)?;
        let all = c.comm.exchange_memory(&m)?;
        if all
            .iter()
            .enumerate()
            .any(|(r, x)| r != c.rank && !x.is_mapped())
        {
            return Err(fail(format!(
                "iteration {i}: a peer's buffer was not mapped"
            )));
        }
        drop(all);
        drop(m);
        c.comm.barrier()?;
    }
    let free_after = quiesced_free_memory(c)?;
    let grew = free_before as i64 - free_after as i64;
    println!(
        "rank {}: 500 x 1 GiB create/map/destroy in {:.1} s, free memory change {} MiB",
        c.rank,
        start.elapsed().as_secs_f64(),
        grew / (1 << 20)
    );
    if grew > 64 << 20 {
        return Err(fail(format!(
            "device memory grew by {} MiB over 500 registrations",
            grew >> 20
        )));
    }
    Ok(())
}

#[test]
#[ignore = "needs torchrun and >= 2 CUDA GPUs; run by scripts/gpu_run.sh"]
fn multi_rank_suite() {
    let (Ok(_), Ok(local)) = (std::env::var("RANK"), std::env::var("LOCAL_RANK")) else {
        println!("SKIPPED: not started by torchrun (RANK / LOCAL_RANK unset)");
        return;
    };
    if comm::device_count() == 0 {
        println!("SKIPPED: no CUDA device");
        return;
    }
    let boot: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::from_env(WAIT).expect("bootstrap"));
    let (rank, size) = (boot.rank(), boot.size());
    assert!(
        size >= 2 && size % 2 == 0,
        "needs an even number of ranks >= 2, got {size}"
    );
    // Ranks map to GPUs round-robin; several ranks may share one GPU.
    let ordinal = local.parse::<usize>().unwrap() % comm::device_count();
    let device = Device::bind(ordinal as i32).expect("bind device");
    let opts = CommunicatorOptions {
        ethernet: Some("127.0.0.1:0".parse().unwrap()),
        semaphore_slots: SEMAPHORE_SLOTS,
        ..Default::default()
    };
    let group = comm::Group::new(boot).expect("group");
    // The group's Communicator, made before any object: every object the
    // scenarios make on the group shares it.
    let comm = group
        .communicator(Some(device), &opts)
        .expect("communicator");
    let buf = comm.alloc_memory(64 << 20).expect("alloc");
    let stream = OwnedStream::new(device).expect("stream");
    let c = Ctx {
        rank,
        size,
        device,
        group,
        comm,
        stream,
        buf,
    };

    type Scenario = fn(&Ctx) -> R;
    let scenarios: &[(&str, Scenario)] = &[
        ("layout_probe", layout_probe),
        ("memchan_pingpong", memchan_pingpong),
        ("memchan_put_get_odd_sizes", memchan_put_get),
        ("packets_ll8_ll16", packets),
        ("portchan_pingpong_cuda_ipc", portchan_pingpong),
        ("port_cuda_ipc_put_signal_flush", |c| {
            port_put_signal_flush(c, &c.comm, &c.buf, Transport::CudaIpc)
        }),
        ("port_cuda_ipc_atomics", |c| {
            port_atomics(c, &c.comm, &c.buf, Transport::CudaIpc)
        }),
        ("port_cuda_ipc_beside_a_spinning_kernel", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::Nothing)
        }),
        ("port_cuda_ipc_beside_a_spinning_kernel_flush_queued", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::FlushBehindPuts)
        }),
        (
            "port_cuda_ipc_beside_a_spinning_kernel_kernel_queued",
            |c| port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::KernelBehindWait),
        ),
        ("port_cuda_ipc_beside_a_spinning_kernel_big_puts", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::BigPuts)
        }),
        ("port_cuda_ipc_pusher_waits", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::PusherWaits)
        }),
        ("port_cuda_ipc_beside_a_spinning_kernel_copy_queued", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::CopyBehindWait)
        }),
        (
            "port_cuda_ipc_beside_a_spinning_kernel_copy_after_it",
            |c| {
                port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::CopyAfterWaitElsewhere)
            },
        ),
        ("port_cuda_ipc_beside_a_spinning_kernel_alloc", |c| {
            port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::AllocBeforePuts)
        }),
        (
            "port_cuda_ipc_beside_a_spinning_kernel_pageable_upload",
            |c| port_beside_a_spinning_kernel(c, Transport::CudaIpc, Queued::PageableUploadAfterIt),
        ),
        ("port_ethernet_beside_a_spinning_kernel", |c| {
            port_beside_a_spinning_kernel(c, Transport::Ethernet, Queued::Nothing)
        }),
        (
            "port_ethernet_beside_a_spinning_kernel_pageable_upload",
            |c| {
                port_beside_a_spinning_kernel(c, Transport::Ethernet, Queued::PageableUploadAfterIt)
            },
        ),
        ("port_ethernet_put_signal_flush", |c| {
            port_put_signal_flush(c, &c.comm, &c.buf, Transport::Ethernet)
        }),
        ("port_ethernet_atomics", |c| {
            port_atomics(c, &c.comm, &c.buf, Transport::Ethernet)
        }),
        ("timeout_is_reported", timeout_is_reported),
        ("topology", topology),
        ("symmetric_region", symmetric_region),
        ("shared_communicator", shared_communicator),
        ("nothing_on_other_devices", nothing_on_other_devices),
        ("create_destroy_500x1GiB", create_destroy_500),
        // Last: opening legacy IPC handles may make the driver create contexts
        // on the peers' devices, which nothing_on_other_devices rules out for
        // the default (cuMem) path.
        ("legacy_ipc_put", legacy_ipc_put),
    ];
    // MOELINK_TEST_SKIP: comma-separated scenario names to leave out (e.g. the
    // 500 x 1 GiB loop under compute-sanitizer).
    let skip = std::env::var("MOELINK_TEST_SKIP").unwrap_or_default();
    let skip: Vec<&str> = skip.split(',').filter(|s| !s.is_empty()).collect();
    // MOELINK_TEST_ONLY: comma-separated scenario names to run alone (unset: all).
    let only = std::env::var("MOELINK_TEST_ONLY").unwrap_or_default();
    let only: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
    let mut failed = Vec::new();
    for (name, f) in scenarios {
        if skip.contains(name) || !(only.is_empty() || only.contains(name)) {
            println!("SKIPPED {name} (MOELINK_TEST_SKIP / MOELINK_TEST_ONLY)");
            continue;
        }
        let t = Instant::now();
        match f(&c) {
            Ok(()) => println!(
                "PASS {name} (rank {rank}/{size}, {:.2} s)",
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                println!("FAIL {name} (rank {rank}/{size}): {e}");
                failed.push(*name);
                // Re-align the ranks before the next scenario (bounded).
                let _ = c.comm.barrier();
            }
        }
    }
    assert!(
        failed.is_empty(),
        "rank {rank}: failed scenarios: {failed:?}"
    );
}
