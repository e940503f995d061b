//! IB verbs scenarios shared by the CPU tests (on the fake NIC, `ib_fake.rs`)
//! and the hardware tests (on libibverbs, `ib_hardware.rs`): the same code
//! drives both, only the provider differs.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use comm::bootstrap::{Bootstrap, TcpBootstrap, UniqueId};
use comm::device_handles::{trigger_type as tt, ProxyTrigger};
use comm::proxy::ProxyService;
use comm::registered_memory::{Location, MemoryInfo, RegisteredMemory};
use comm::transport::ib::config::{IbConfig, SignalMode};
use comm::transport::ib::connection::IbConnection;
use comm::transport::ib::context::IbContext;
use comm::transport::ib::device::RdmaProvider;
use comm::transport::{AtomicWidth, Connection, Transport};
use comm::{CommError, Communicator, CommunicatorOptions};

pub use crate::common::pattern;

pub type R<T = ()> = Result<T, String>;

pub fn err(e: CommError) -> String {
    e.to_string()
}

/// Host memory of one side, registered with its context, as a
/// `RegisteredMemory` (zeroed u64 words; only touched through raw pointers,
/// since the NIC writes it concurrently).
pub struct HostBuf {
    pub mem: RegisteredMemory,
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: the buffer is leaked (never freed) and only accessed through atomics
// or after the writes to it completed.
unsafe impl Send for HostBuf {}
// SAFETY: as above.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    pub fn new(ctx: &IbContext, rank: u32, len: usize) -> R<Self> {
        let ptr = Vec::leak(vec![0u64; len / 8]).as_mut_ptr() as *mut u8;
        let reg = ctx
            .register(ptr as u64, len as u64, Location::Host, true)
            .map_err(err)?;
        let info = MemoryInfo {
            rank,
            len: len as u64,
            location: Location::Host,
            host_id: 0,
            owner_ptr: ptr as u64,
            ipc: None,
            ethernet: None,
            ib: Some(reg.key()),
        };
        let mem = RegisteredMemory::local(info, Some(Arc::new(reg)));
        Ok(Self { mem, ptr, len })
    }

    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in range; the test writes sources before issuing.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }

    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: in range of the leaked buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }

    pub fn u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: aligned, in range, alive for the process.
        unsafe { AtomicU64::from_ptr(self.ptr.add(off).cast()) }
    }

    pub fn u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as above.
        unsafe { AtomicU32::from_ptr(self.ptr.add(off).cast()) }
    }
}

/// Waits (bounded) until `f` holds; `what` names it in the error.
pub fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) -> R {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > timeout {
            return Err(format!("timed out after {timeout:?} waiting for {what}"));
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Two contexts of `provider` (ranks 0 and 1 on one device: a loopback
/// through one HCA) connected both ways, with a buffer each.
pub struct Pair {
    pub a: Arc<IbContext>,
    pub b: Arc<IbContext>,
    pub ab: IbConnection,
    pub ba: IbConnection,
    pub buf_a: HostBuf,
    pub buf_b: HostBuf,
}

pub fn open(
    provider: &dyn RdmaProvider,
    rank: usize,
    cfg: &IbConfig,
    t: Duration,
) -> R<Arc<IbContext>> {
    IbContext::open(rank, provider, cfg.clone(), 0, None, t).map_err(err)
}

/// Connects `a` (rank 0) and `b` (rank 1) concurrently, exchanging through channels.
pub fn connect_pair(
    a: &Arc<IbContext>,
    b: &Arc<IbContext>,
) -> Result<(IbConnection, IbConnection), CommError> {
    let (to_b, from_a) = mpsc::channel::<Vec<u8>>();
    let (to_a, from_b) = mpsc::channel::<Vec<u8>>();
    let t = Duration::from_secs(20);
    let recv = |rx: &mpsc::Receiver<Vec<u8>>| {
        rx.recv_timeout(t)
            .map_err(|_| CommError::invalid("test", "no exchange from the other side"))
    };
    std::thread::scope(|s| {
        let hb = s.spawn(move || {
            let mut ex = |mine: &[u8]| {
                to_a.send(mine.to_vec()).unwrap();
                recv(&from_a)
            };
            b.connect(0, &mut ex)
        });
        let mut ex = |mine: &[u8]| {
            to_b.send(mine.to_vec()).unwrap();
            recv(&from_b)
        };
        let ab = a.connect(1, &mut ex);
        let ba = hb.join().unwrap();
        Ok((ab?, ba?))
    })
}

pub fn pair(
    provider: &dyn RdmaProvider,
    cfg_a: &IbConfig,
    cfg_b: &IbConfig,
    t: Duration,
) -> R<Pair> {
    let a = open(provider, 0, cfg_a, t)?;
    let b = open(provider, 1, cfg_b, t)?;
    let (ab, ba) = connect_pair(&a, &b).map_err(err)?;
    let buf_a = HostBuf::new(&a, 0, 8 << 20)?;
    let buf_b = HostBuf::new(&b, 1, 8 << 20)?;
    Ok(Pair {
        a,
        b,
        ab,
        ba,
        buf_a,
        buf_b,
    })
}

/// Offsets in the receiver's buffer used by the scenarios.
pub const SEM: usize = 7 << 20;
pub const C64: usize = SEM + 64;
pub const C32A: usize = SEM + 128;
pub const C32B: usize = SEM + 132;
/// The semaphore of `data_before_signal`.
pub const SEM2: usize = SEM + 256;

/// Writes (several sizes and offsets), a signal, 64- and 32-bit adds from a
/// to b; checks the data, the semaphore and that the 32-bit add left its
/// neighbour alone.
pub fn put_signal_adds(p: &Pair) -> R {
    let (src, dst) = (&p.buf_a, &p.buf_b);
    dst.u64(C64).store(0xFFFF_FFF0, Ordering::SeqCst);
    dst.u32(C32A).store(u32::MAX - 1, Ordering::SeqCst);
    dst.u32(C32B).store(1000, Ordering::SeqCst);
    let data = pattern(0x5eed, 3 << 20);
    src.write(0, &data);
    for (off, len) in [
        (0usize, 1usize),
        (1, 4095),
        (4096, (1 << 20) - 4096),
        (1 << 20, 2 << 20),
    ] {
        p.ab.write(&dst.mem, off as u64, &src.mem, off as u64, len as u64)
            .map_err(err)?;
    }
    p.ab.update_and_sync(&dst.mem, SEM as u64, 5).map_err(err)?;
    p.ab.atomic_add(&dst.mem, C64 as u64, 0x20, AtomicWidth::U64)
        .map_err(err)?;
    p.ab.atomic_add(&dst.mem, C32A as u64, 3, AtomicWidth::U32)
        .map_err(err)?;
    p.ab.update_and_sync(&dst.mem, SEM as u64, 9).map_err(err)?;
    p.ab.flush(Duration::from_secs(10)).map_err(err)?;
    let t = Duration::from_secs(10);
    wait_until("the semaphore to read 9", t, || {
        dst.u64(SEM).load(Ordering::Acquire) == 9
    })?;
    // Adds issued before the last signal have landed with it.
    let (c64, c32a, c32b) = (
        dst.u64(C64).load(Ordering::Acquire),
        dst.u32(C32A).load(Ordering::Acquire),
        dst.u32(C32B).load(Ordering::Acquire),
    );
    if (c64, c32a, c32b) != (0x1_0000_0010, 1, 1000) {
        return Err(format!(
            "counters {c64:#x} {c32a} {c32b}, expected 0x100000010 1 1000"
        ));
    }
    if dst.read(0, data.len()) != data {
        return Err("the written data differs".into());
    }
    p.a.check().map_err(err)?;
    p.b.check().map_err(err)
}

/// `n` rounds of (write slot i, signal i) from a to b while b watches: once
/// the semaphore reads i, slot i must hold its data (data before signal).
/// More rounds than record slots, so credits must come back.
pub fn data_before_signal(p: &Pair, n: u64) -> R {
    const SLOT: usize = 256;
    let (src, dst) = (&p.buf_a, &p.buf_b);
    let violations = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let start = Instant::now();
            let mut seen = 0;
            while seen < n && start.elapsed() < Duration::from_secs(30) {
                let v = dst.u64(SEM2).load(Ordering::Acquire);
                for i in seen + 1..=v {
                    let off = (i as usize % 1024) * SLOT;
                    let got = dst.u64(off).load(Ordering::Acquire);
                    // Slot i % 1024 may hold a later round's data already.
                    if got < i {
                        violations.lock().unwrap().push((i, got));
                    }
                }
                seen = v;
            }
            seen
        });
        for i in 1..=n {
            let off = (i as usize % 1024) * SLOT;
            src.u64(off).store(i, Ordering::SeqCst);
            p.ab.write(&dst.mem, off as u64, &src.mem, off as u64, 8)
                .map_err(err)?;
            p.ab.update_and_sync(&dst.mem, SEM2 as u64, i)
                .map_err(err)?;
            if i % 64 == 0 {
                p.ab.flush(Duration::from_secs(10)).map_err(err)?;
            }
        }
        p.ab.flush(Duration::from_secs(10)).map_err(err)?;
        let seen = watcher.join().unwrap();
        if seen != n {
            return Err(format!("the receiver saw signal {seen} of {n}"));
        }
        let v = violations.lock().unwrap();
        if !v.is_empty() {
            return Err(format!(
                "signals before their data: {:?}",
                &v[..v.len().min(5)]
            ));
        }
        Ok(())
    })
}

/// Rank `rank`'s share of a two-rank Communicator suite over `Transport::IbVerbs`:
/// port channels on host memory driven by a host-fed proxy: put + signal
/// both ways, then 64- and 32-bit adds, checked on the receiving side.
pub fn port_channel_suite(
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    rdma: Option<Arc<dyn RdmaProvider>>,
) -> R {
    const LEN: usize = 4 << 20;
    let opts = CommunicatorOptions {
        rdma,
        timeout: Duration::from_secs(30),
        ..CommunicatorOptions::default()
    };
    let comm = Communicator::new(boot, None, opts).map_err(err)?;
    let peer = 1 - rank;
    let reach = comm.topology().peer(peer).reach;
    if reach != comm::topology::Reach::Port(Transport::IbVerbs) {
        return Err(format!(
            "rank {rank} reaches rank {peer} by {reach:?}, not IB verbs"
        ));
    }
    let words = Vec::leak(vec![0u64; LEN / 8]);
    let base = words.as_mut_ptr() as u64;
    let buf = |off: usize| base + off as u64;
    let local = comm
        .register_external(base, LEN as u64, Location::Host)
        .map_err(err)?;
    if local.info().ib.is_none() {
        return Err("the buffer has no IB key".into());
    }
    let mut proxy = ProxyService::new(rank, None, 64, 0).map_err(err)?;
    let chans = comm
        .port_channels(&proxy, &local, Transport::IbVerbs)
        .map_err(err)?;
    proxy.start().map_err(err)?;
    let ch = chans[peer].as_ref().ok_or("no channel to the peer")?;
    // Our half of the buffer holds what we send; the peer receives it into
    // its other half.
    let half = LEN / 2;
    let mine = pattern(0x1000 + rank as u64, half - 4096);
    // SAFETY: our own buffer, written before the proxy reads it.
    unsafe {
        std::ptr::copy_nonoverlapping(mine.as_ptr(), buf(rank * half) as *mut u8, mine.len())
    };
    let producer = proxy.fifo().host_producer().map_err(err)?;
    let t = Duration::from_secs(20);
    let push = |tr| producer.push(tr, t).map(drop).map_err(err);
    let (dst_off, src_off) = ((rank * half) as u64, (rank * half) as u64);
    push(ProxyTrigger::data(
        tt::DATA | tt::SIGNAL,
        ch.channel,
        ch.dst_mem,
        dst_off,
        ch.src_mem,
        src_off,
        mine.len() as u64,
    ))?;
    // Counters at the end of the peer's half of the buffer.
    let ctr = (peer * half + half - 64) as u64;
    push(ProxyTrigger::atomic(
        tt::ATOMIC_ADD64,
        ch.channel,
        ch.dst_mem,
        ctr,
        41,
    ))?;
    push(ProxyTrigger::atomic(
        tt::ATOMIC_ADD32,
        ch.channel,
        ch.dst_mem,
        ctr + 8,
        -2,
    ))?;
    push(ProxyTrigger::atomic(
        tt::ATOMIC_ADD32,
        ch.channel,
        ch.dst_mem,
        ctr + 12,
        7,
    ))?;
    push(ProxyTrigger::data(
        tt::SIGNAL | tt::FLUSH,
        ch.channel,
        ch.dst_mem,
        0,
        ch.src_mem,
        0,
        0,
    ))?;
    // SAFETY: the semaphore's inbound counter in our host signal page.
    let inbound = unsafe { AtomicU64::from_ptr(ch.semaphore.local_inbound as *mut u64) };
    wait_until(
        &format!("rank {rank}'s semaphore from rank {peer} to read 2"),
        t,
        || inbound.load(Ordering::Acquire) >= 2,
    )
    .map_err(|e| match proxy.check() {
        Err(p) => format!("{e}; proxy: {p}"),
        Ok(()) => e,
    })?;
    let theirs = pattern(0x1000 + peer as u64, half - 4096);
    let at = peer * half;
    // SAFETY: our buffer, written by the peer before its signal.
    let got = unsafe { std::slice::from_raw_parts(buf(at) as *const u8, theirs.len()) };
    if got != &theirs[..] {
        return Err(format!("rank {rank}: the data from rank {peer} differs"));
    }
    let my_ctr = rank * half + half - 64;
    let w = |i: usize| {
        // SAFETY: aligned words of our buffer.
        unsafe { AtomicU64::from_ptr(buf(my_ctr + 8 * i) as *mut u64) }.load(Ordering::Acquire)
    };
    let (c64, c32) = (w(0), w(1));
    let want32 = (7u64 << 32) | (u32::MAX - 1) as u64;
    if (c64, c32) != (41, want32) {
        return Err(format!(
            "rank {rank}: counters {c64} {c32:#x}, expected 41 {want32:#x}"
        ));
    }
    proxy.check().map_err(err)?;
    if let Some(ctx) = comm.ib_context() {
        ctx.check().map_err(err)?;
    }
    comm.barrier().map_err(err)?;
    proxy.stop().map_err(err)?;
    drop(chans);
    Ok(())
}

/// `size` ranks as threads with TCP bootstraps, each running `f`.
pub fn on_ranks(size: usize, f: impl Fn(usize, Arc<dyn Bootstrap>) -> R + Send + Sync) -> Vec<R> {
    let id = UniqueId::new(None).unwrap();
    let bytes = id.to_bytes();
    let mut root = Some(id);
    let ids: Vec<UniqueId> = (0..size)
        .map(|r| match r {
            0 => root.take().unwrap(),
            _ => UniqueId::from_bytes(&bytes).unwrap(),
        })
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .into_iter()
            .enumerate()
            .map(|(r, id)| {
                let f = &f;
                s.spawn(move || {
                    let boot: Arc<dyn Bootstrap> = Arc::new(
                        TcpBootstrap::new(&id, r, size, Duration::from_secs(30)).map_err(err)?,
                    );
                    f(r, boot)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The config of one side: `mode`, `qps` queue pairs per peer.
pub fn config(mode: SignalMode, qps: u32) -> IbConfig {
    IbConfig {
        mode,
        qps_per_rank: qps,
        ..IbConfig::default()
    }
}
