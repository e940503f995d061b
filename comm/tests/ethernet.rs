//! Ethernet transport: between processes (the test binary re-executes itself as
//! the receiving child, which owns the memory and answers questions about it on
//! its stdout), and within one process for shutdown. CPU tests run anywhere; the
//! GPU test is ignored by default (scripts/gpu_run.sh runs it).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use comm::registered_memory::{Location, MemoryInfo, RegisteredMemory};
use comm::transport::ethernet::{EthernetConnection, EthernetReceiver};
use comm::transport::{AtomicWidth, Connection, Transport};
use comm::{CommError, Device, DeviceMemory};

mod common;
use common::{fnv1a, pattern, random_seed};

/// Selects the child's role ("host" or "gpu"); unset in the parent.
const ROLE: &str = "MOELINK_ETH_CHILD";
const T: Duration = Duration::from_secs(20);
const MIB: usize = 1 << 20;

// The child's region A: write targets, then a signal word and its data slots,
// then counters between canaries. Region B is registered until "UNREG_B".
const A_LEN: usize = 16 * MIB;
const DATA_LEN: usize = 12 * MIB;
const SIG: u64 = DATA_LEN as u64;
const SLOTS: u64 = SIG + 4096;
const SLOT: usize = 4096;
const NSLOTS: u64 = 64;
const CTR: u64 = 14 * MIB as u64;
const C64: u64 = CTR + 8;
const C32A: u64 = CTR + 24;
const C32B: u64 = CTR + 28;
const CANARIES: [u64; 3] = [CTR, CTR + 16, CTR + 32];
const CANARY: u64 = 0xC0FF_EE00_DDBA_11AA;
const C64_INIT: u64 = 0xFFFF_FFF0; // 64-bit adds must carry into the high word
const C32A_INIT: u32 = u32::MAX - 100; // 32-bit adds wrap without touching C32B
const C32B_INIT: u32 = 1_000_000;
const B_LEN: usize = 64 << 10;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Rank `rank`'s `len` bytes at `owner_ptr` in `location`, which a receiver
/// at `ethernet` (if any) serves; no CUDA IPC.
fn memory_info(
    rank: u32,
    owner_ptr: u64,
    len: usize,
    location: Location,
    ethernet: Option<String>,
) -> MemoryInfo {
    MemoryInfo {
        rank,
        len: len as u64,
        location,
        host_id: 0,
        owner_ptr,
        ipc: None,
        ethernet,
        ib: None,
    }
}

/// This process's host buffer as a registered write source.
fn host_source(data: Vec<u8>) -> RegisteredMemory {
    let info = memory_info(0, data.as_ptr() as u64, data.len(), Location::Host, None);
    RegisteredMemory::local(info, Some(Arc::new(data)))
}

// ------------------------------------------------------------------- child --

/// The child's memory: a host buffer (only ever accessed through its raw
/// pointer, since the receiver writes it concurrently) or a GPU allocation.
enum ChildMem {
    Host(*mut u64),
    Gpu(DeviceMemory),
}

impl ChildMem {
    fn host(len: usize) -> Self {
        // Leaked: the receiver may write it until the child process exits.
        ChildMem::Host(Vec::leak(vec![0u64; len / 8]).as_mut_ptr())
    }

    fn ptr(&self) -> u64 {
        match self {
            ChildMem::Host(p) => *p as u64,
            ChildMem::Gpu(m) => m.ptr(),
        }
    }

    fn location(&self) -> Location {
        match self {
            ChildMem::Host(_) => Location::Host,
            ChildMem::Gpu(m) => Location::Device(m.device().ordinal),
        }
    }

    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        match self {
            // SAFETY: in range of the buffer; nothing writes it while the parent asks.
            ChildMem::Host(p) => unsafe {
                std::ptr::copy_nonoverlapping(
                    p.cast::<u8>().add(off as usize),
                    out.as_mut_ptr(),
                    len,
                )
            },
            ChildMem::Gpu(m) => m.copy_to_host(off as usize, &mut out).unwrap(),
        }
        out
    }

    fn write(&self, off: u64, bytes: &[u8]) {
        match self {
            // SAFETY: in range of the buffer; called before the receiver starts.
            ChildMem::Host(p) => unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    p.cast::<u8>().add(off as usize),
                    bytes.len(),
                )
            },
            ChildMem::Gpu(m) => m.copy_from_host(off as usize, bytes).unwrap(),
        }
    }

    /// Acquire load of the host u64 at `off` (pairs with the receiver's release store).
    fn load_u64(&self, off: u64) -> u64 {
        match self {
            // SAFETY: an aligned u64 inside the buffer, only accessed atomically meanwhile.
            ChildMem::Host(p) => {
                unsafe { AtomicU64::from_ptr(p.add(off as usize / 8)) }.load(Ordering::Acquire)
            }
            ChildMem::Gpu(_) => u64::from_le_bytes(self.read(off, 8).try_into().unwrap()),
        }
    }
}

#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return; // only runs as the child of another test
    };
    let (mem, device) = match role.as_str() {
        "host" => (ChildMem::host(A_LEN), None),
        "gpu" => {
            let ordinal = if comm::device_count() > 1 { 1 } else { 0 };
            let dev = Device::bind(ordinal).unwrap();
            let m = DeviceMemory::alloc(dev, A_LEN).unwrap();
            m.fill(0).unwrap();
            (ChildMem::Gpu(m), Some(dev))
        }
        other => panic!("unknown role {other}"),
    };
    for c in CANARIES {
        mem.write(c, &CANARY.to_le_bytes());
    }
    mem.write(C64, &C64_INIT.to_le_bytes());
    mem.write(C32A, &C32A_INIT.to_le_bytes());
    mem.write(C32B, &C32B_INIT.to_le_bytes());
    let mut b = vec![0u64; B_LEN / 8];
    let b_ptr = b.as_mut_ptr() as u64;

    let rx = EthernetReceiver::start("127.0.0.1:0".parse().unwrap(), device, 1).unwrap();
    rx.register(mem.ptr(), A_LEN as u64, mem.location());
    rx.register(b_ptr, B_LEN as u64, Location::Host);
    let info =
        |ptr: u64, len: usize, location| memory_info(1, ptr, len, location, Some(rx.address()));
    let mut out = std::io::stdout();
    let a_info = info(mem.ptr(), A_LEN, mem.location()).to_bytes();
    writeln!(out, "@INFO {}", hex(&a_info)).unwrap();
    writeln!(
        out,
        "@INFO {}",
        hex(&info(b_ptr, B_LEN, Location::Host).to_bytes())
    )
    .unwrap();
    out.flush().unwrap();

    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w[i].parse::<u64>().unwrap();
        let reply = match w[0] {
            "HASH" => format!("@HASH {}", fnv1a(&mem.read(num(1), num(2) as usize))),
            "U64" => format!("@U64 {}", mem.load_u64(num(1))),
            "U32" => {
                let v = u32::from_le_bytes(mem.read(num(1), 4).try_into().unwrap());
                format!("@U32 {v}")
            }
            "UNREG_B" => {
                rx.unregister(b_ptr);
                "@OK".into()
            }
            "WATCH" => {
                writeln!(out, "@READY").unwrap();
                out.flush().unwrap();
                format!("@WATCH {}", watch(&mem, num(1)))
            }
            "EXIT" => break,
            other => panic!("unknown command {other}"),
        };
        writeln!(out, "{reply}").unwrap();
        out.flush().unwrap();
    }
    rx.shutdown();
    drop(b);
}

/// Watches the signal word until it reaches NSLOTS: every value seen must be
/// larger than the last, and the slot written before it must already be there.
fn watch(mem: &ChildMem, seed: u64) -> String {
    let start = Instant::now();
    let (mut last, mut seen) = (0, 0);
    while last < NSLOTS {
        let v = mem.load_u64(SIG);
        if v != last {
            if v < last || v > NSLOTS {
                return format!("bad: {v} after {last}");
            }
            let slot = mem.read(SLOTS + (v - 1) * SLOT as u64, SLOT);
            if slot != pattern(seed ^ v, SLOT) {
                return format!("bad: signal {v} arrived before its data");
            }
            (last, seen) = (v, seen + 1);
        }
        if start.elapsed() > T {
            return format!("bad: stuck at {last}");
        }
        std::hint::spin_loop();
    }
    format!("ok {seen}")
}

// ------------------------------------------------------------------ parent --

/// A child process owning regions A and B, asked questions over its stdin.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    a: RegisteredMemory,
    b: RegisteredMemory,
}

impl Peer {
    fn spawn(role: &str) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(|l| l.ok()) {
                // libtest's "test child_process ... " may precede the first answer.
                if let Some(at) = line.find('@') {
                    if tx.send(line[at..].to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        let stdin = child.stdin.take();
        let mut peer = Peer {
            child,
            stdin,
            lines,
            a: host_source(vec![0]),
            b: host_source(vec![0]),
        };
        let import = |line: String| {
            let info =
                MemoryInfo::from_bytes(&unhex(line.strip_prefix("@INFO ").unwrap())).unwrap();
            RegisteredMemory::import(info, None, 0).unwrap()
        };
        peer.a = import(peer.expect("@INFO"));
        peer.b = import(peer.expect("@INFO"));
        peer
    }

    fn expect(&self, tag: &str) -> String {
        let line = self
            .lines
            .recv_timeout(T)
            .unwrap_or_else(|e| panic!("child gave no {tag}: {e}"));
        assert!(line.starts_with(tag), "expected {tag}, got {line}");
        line
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }

    fn ask(&mut self, cmd: &str, tag: &str) -> u64 {
        self.send(cmd);
        let line = self.expect(tag);
        line[tag.len()..].trim().parse().unwrap()
    }

    fn hash(&mut self, off: u64, len: usize) -> u64 {
        self.ask(&format!("HASH {off} {len}"), "@HASH")
    }

    fn u64_at(&mut self, off: u64) -> u64 {
        self.ask(&format!("U64 {off}"), "@U64")
    }

    fn u32_at(&mut self, off: u64) -> u32 {
        self.ask(&format!("U32 {off}"), "@U32") as u32
    }

    fn connect(&self, device: Option<Device>) -> EthernetConnection {
        let addr = self.a.info().ethernet.clone().unwrap();
        EthernetConnection::connect(0, 1, &addr, device, T).unwrap()
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signals our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// SIGSTOP, then waits until every thread of the child is stopped (the
    /// signal only starts that).
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.child.id());
        let start = Instant::now();
        while !std::fs::read_dir(&tasks).unwrap().all(|task| {
            let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap();
            let state = stat[stat.rfind(')').unwrap() + 1..].trim_start();
            state.starts_with('T') || state.starts_with('t')
        }) {
            assert!(start.elapsed() < T, "child did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Asks the child to exit and checks that it did so cleanly.
    fn finish(mut self) {
        self.send("EXIT");
        drop(self.stdin.take());
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "child failed: {status}");
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "child did not exit"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `info` with another address and length: memory the receiver never registered.
fn fake(of: &RegisteredMemory, owner_ptr: u64, len: u64) -> RegisteredMemory {
    let info = MemoryInfo {
        owner_ptr,
        len,
        ..of.info().clone()
    };
    RegisteredMemory::import(info, None, 0).unwrap()
}

fn expect_rejected(result: comm::Result<()>, needle: &str) -> String {
    match result {
        Err(CommError::InvalidArgument { reason, .. }) => {
            assert!(reason.contains(needle), "{reason}");
            reason
        }
        other => panic!("expected a rejection mentioning {needle:?}, got {other:?}"),
    }
}

/// `threads` threads, each with its own connection (from `device`), add to the
/// child's counters `iters` times each and flush: C64 alternately +1_000_003
/// and -999_999, C32A +7, C32B -3.
fn add_from_threads(peer: &Peer, device: Option<Device>, threads: u64, iters: u64) {
    std::thread::scope(|s| {
        for _ in 0..threads {
            let conn = peer.connect(device);
            let a = &peer.a;
            s.spawn(move || {
                for i in 0..iters {
                    let v = if i % 2 == 0 { 1_000_003 } else { -999_999 };
                    conn.atomic_add(a, C64, v, AtomicWidth::U64).unwrap();
                    conn.atomic_add(a, C32A, 7, AtomicWidth::U32).unwrap();
                    conn.atomic_add(a, C32B, -3, AtomicWidth::U32).unwrap();
                }
                conn.flush(T).unwrap();
            });
        }
    });
}

/// Checks the child's counters after `adds` rounds of [`add_from_threads`]
/// (threads x iterations), and that the canaries around them are intact.
fn check_counters(peer: &mut Peer, adds: u64) {
    assert_eq!(peer.u64_at(C64), C64_INIT + adds / 2 * 4);
    assert_eq!(peer.u32_at(C32A), C32A_INIT.wrapping_add((adds * 7) as u32));
    assert_eq!(peer.u32_at(C32B), C32B_INIT - (adds * 3) as u32);
    for c in CANARIES {
        assert_eq!(peer.u64_at(c), CANARY, "canary at {c:#x}");
    }
}

/// Runs `test` against a host-memory child with a connection to it, then
/// closes the connection and checks that the child exits cleanly.
fn with_host_peer(test: impl FnOnce(&mut Peer, &EthernetConnection)) {
    let mut peer = Peer::spawn("host");
    let conn = peer.connect(None);
    test(&mut peer, &conn);
    drop(conn);
    peer.finish();
}

/// Odd sizes at odd offsets: (dst offset, src offset, size).
const CASES: [(u64, u64, u64); 4] = [
    (1, 0, 1),
    (5, 1, 3),
    (4099, 3, 4097),
    (1_000_003, 7, 9 * MIB as u64),
];

/// Writes CASES from `src` (holding `data`) and checks the owner's data area.
fn write_cases_and_verify(
    peer: &mut Peer,
    conn: &EthernetConnection,
    src: &RegisteredMemory,
    data: &[u8],
) {
    let mut image = vec![0u8; DATA_LEN];
    for (dst_off, src_off, size) in CASES {
        conn.write(&peer.a, dst_off, src, src_off, size).unwrap();
        let (d, s, n) = (dst_off as usize, src_off as usize, size as usize);
        image[d..d + n].copy_from_slice(&data[s..s + n]);
    }
    conn.write(&peer.a, 0, src, 0, 0).unwrap();
    conn.flush(T).unwrap();
    for (dst_off, _, size) in CASES {
        let range = &image[dst_off as usize..(dst_off + size) as usize];
        assert_eq!(
            peer.hash(dst_off, size as usize),
            fnv1a(range),
            "write of {size} bytes at {dst_off}"
        );
    }
    assert_eq!(
        peer.hash(0, DATA_LEN),
        fnv1a(&image),
        "bytes outside the writes changed"
    );
}

#[test]
fn writes_at_odd_sizes_and_offsets() {
    with_host_peer(|peer, conn| {
        assert_eq!(conn.transport(), Transport::Ethernet);
        assert_eq!(conn.remote_rank(), 1);
        let seed = random_seed();
        let data = pattern(seed, 9 * MIB + 64);
        let src = host_source(data.clone());
        write_cases_and_verify(peer, conn, &src, &data);
    });
}

#[test]
fn flush_makes_all_earlier_writes_visible() {
    with_host_peer(|peer, conn| {
        const N: usize = 200;
        const LEN: usize = 1000;
        for round in 0..3u64 {
            let data = pattern(random_seed() ^ round, N * LEN);
            let src = host_source(data.clone());
            for i in 0..N as u64 {
                let off = i * LEN as u64;
                conn.write(&peer.a, off, &src, off, LEN as u64).unwrap();
            }
            conn.flush(T).unwrap();
            assert_eq!(peer.hash(0, N * LEN), fnv1a(&data), "round {round}");
        }
    });
}

#[test]
fn signals_arrive_in_order_after_their_data() {
    with_host_peer(|peer, conn| {
        let seed = random_seed();
        let slots: Vec<u8> = (1..=NSLOTS).flat_map(|v| pattern(seed ^ v, SLOT)).collect();
        let src = host_source(slots);
        peer.send(&format!("WATCH {seed}"));
        peer.expect("@READY");
        for v in 1..=NSLOTS {
            let off = (v - 1) * SLOT as u64;
            conn.write(&peer.a, SLOTS + off, &src, off, SLOT as u64)
                .unwrap();
            conn.update_and_sync(&peer.a, SIG, v).unwrap();
        }
        conn.flush(T).unwrap();
        let verdict = peer.expect("@WATCH");
        assert!(verdict.starts_with("@WATCH ok"), "{verdict}");
        assert_eq!(peer.u64_at(SIG), NSLOTS);
    });
}

#[test]
fn concurrent_atomic_adds_are_exact() {
    const THREADS: u64 = 4;
    const ITERS: u64 = 1500;
    let mut peer = Peer::spawn("host");
    add_from_threads(&peer, None, THREADS, ITERS);
    check_counters(&mut peer, THREADS * ITERS);
    peer.finish();
}

#[test]
fn invalid_operations_are_rejected_before_sending() {
    with_host_peer(|peer, conn| {
        let src = host_source(vec![0xAB; 64]);
        // A 64-bit add on a word that is only 4-byte aligned (it would straddle C32B).
        let r = conn.atomic_add(&peer.a, C32B, 1, AtomicWidth::U64);
        expect_rejected(r, "not aligned to 8 bytes");
        expect_rejected(conn.write(&peer.a, A_LEN as u64 - 2, &src, 0, 4), "exceed");
        expect_rejected(conn.write(&peer.a, 0, &src, 60, 8), "exceed");
        expect_rejected(
            conn.update_and_sync(&peer.a, C32B, 1),
            "not aligned to 8 bytes",
        );
        expect_rejected(
            conn.atomic_add(&peer.a, A_LEN as u64, 1, AtomicWidth::U32),
            "exceed",
        );
        // Memory of a rank this connection does not reach.
        let other = RegisteredMemory::import(
            MemoryInfo {
                rank: 5,
                ..peer.a.info().clone()
            },
            None,
            0,
        )
        .unwrap();
        expect_rejected(conn.write(&other, 0, &src, 0, 8), "not reachable");
        conn.flush(T).unwrap(); // nothing was sent, so nothing to report
        assert_eq!(peer.u32_at(C32B), C32B_INIT);
        assert_eq!(peer.u64_at(CANARIES[2]), CANARY);
        assert_eq!(peer.hash(A_LEN as u64 - 8, 8), fnv1a(&[0; 8]));
    });
}

#[test]
fn receiver_rejects_unregistered_targets_and_flush_reports_them() {
    with_host_peer(|peer, conn| {
        let src = host_source(vec![0xCD; 4096]);

        // Nothing is registered at a low address.
        conn.write(&fake(&peer.a, 4096, 4096), 0, &src, 0, 64)
            .unwrap();
        let reason = expect_rejected(conn.flush(T), "not inside a region registered");
        assert!(reason.contains("rank 1"), "{reason}");
        conn.flush(T).unwrap(); // reported once

        // Straddling the end of region A: nothing of it lands.
        let longer = fake(&peer.a, peer.a.info().owner_ptr, A_LEN as u64 + 4096);
        conn.write(&longer, A_LEN as u64 - 8, &src, 0, 16).unwrap();
        expect_rejected(conn.flush(T), "not inside");
        assert_eq!(peer.hash(A_LEN as u64 - 8, 8), fnv1a(&[0; 8]));

        // Region B works until the owner unregisters it.
        conn.write(&peer.b, 0, &src, 0, 8).unwrap();
        conn.flush(T).unwrap();
        peer.send("UNREG_B");
        peer.expect("@OK");
        conn.write(&peer.b, 8, &src, 0, 8).unwrap();
        conn.update_and_sync(&peer.b, 16, 1).unwrap();
        conn.atomic_add(&peer.b, 24, 1, AtomicWidth::U64).unwrap();
        let reason = expect_rejected(conn.flush(T), "and 2 more failed operations");
        assert!(reason.contains("write of 8 bytes"), "{reason}");

        // The connection still works afterwards.
        conn.write(&peer.a, 0, &src, 0, 4096).unwrap();
        conn.flush(T).unwrap();
        assert_eq!(peer.hash(0, 4096), fnv1a(&[0xCD; 4096]));
    });
}

/// A TCP port bound on 127.0.0.1 but not listening (and without SO_REUSEADDR,
/// so no other socket can take it): connecting there is refused.
fn bound_not_listening() -> (std::os::fd::OwnedFd, String) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a fresh fd with properly sized addresses;
    // every result is checked.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let sap = (&mut sa as *mut libc::sockaddr_in).cast::<libc::sockaddr>();
        assert_eq!(
            libc::bind(raw, sap, len),
            0,
            "bind: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::getsockname(raw, sap, &mut len), 0);
        (fd, format!("127.0.0.1:{}", u16::from_be(sa.sin_port)))
    }
}

#[test]
fn connect_to_nobody_times_out() {
    let (_reserved, addr) = bound_not_listening();
    let start = Instant::now();
    let r = EthernetConnection::connect(0, 7, &addr, None, Duration::from_millis(300));
    let waited = start.elapsed();
    match r {
        Err(CommError::Timeout { rank: 0, what, .. }) => {
            assert!(what.contains("rank 7") && what.contains(&addr), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[test]
fn flush_to_a_stopped_receiver_times_out() {
    with_host_peer(|peer, conn| {
        let src = host_source(vec![0x5A; 256]);
        conn.write(&peer.a, 0, &src, 0, 128).unwrap();
        conn.flush(T).unwrap();

        peer.stop();
        conn.write(&peer.a, 128, &src, 0, 128).unwrap();
        let start = Instant::now();
        match conn.flush(Duration::from_millis(300)) {
            Err(e @ CommError::Timeout { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("rank 1") && msg.contains("flush"), "{msg}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );

        peer.signal(libc::SIGCONT);
        conn.flush(T).unwrap();
        assert_eq!(peer.hash(0, 256), fnv1a(&[0x5A; 256]));
    });
}

#[test]
fn in_process_receiver_shuts_down_promptly() {
    let mut target = vec![0u64; 512];
    let ptr = target.as_mut_ptr() as u64;
    let rx = EthernetReceiver::start("127.0.0.1:0".parse().unwrap(), None, 1).unwrap();
    rx.register(ptr, 4096, Location::Host);
    let info = memory_info(1, ptr, 4096, Location::Host, Some(rx.address()));
    let dst = RegisteredMemory::import(info, None, 0).unwrap();
    let conn = EthernetConnection::connect(0, 1, &rx.address(), None, T).unwrap();
    let src = host_source(pattern(3, 4096));
    conn.write(&dst, 0, &src, 0, 4000).unwrap();
    conn.update_and_sync(&dst, 4000, 77).unwrap();
    conn.atomic_add(&dst, 4008, -5, AtomicWidth::U64).unwrap();
    conn.flush(T).unwrap();

    let start = Instant::now();
    rx.shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "shutdown took {:?}",
        start.elapsed()
    );
    // SAFETY: the receiver's threads are gone; nothing else touches `target`.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, 4096) };
    assert_eq!(&bytes[..4000], &pattern(3, 4000)[..]);
    assert_eq!(target[500], 77);
    assert_eq!(target[501], 5u64.wrapping_neg());

    // The connection learns that the receiver is gone instead of waiting out the timeout.
    let start = Instant::now();
    let r = conn.write(&dst, 0, &src, 0, 8).and_then(|()| conn.flush(T));
    assert!(r.is_err(), "flush to a closed receiver succeeded");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    drop(rx);
    let r = EthernetConnection::connect(
        0,
        1,
        &dst.info().ethernet.clone().unwrap(),
        None,
        Duration::from_millis(200),
    );
    assert!(matches!(r, Err(CommError::Timeout { .. })), "{r:?}");
}

#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn gpu_write_signal_and_atomics_between_processes() {
    if comm::device_count() == 0 {
        println!("skipped: no CUDA device");
        return;
    }
    let dev = Device::bind(0).unwrap();
    let mut peer = Peer::spawn("gpu");
    assert!(matches!(peer.a.info().location, Location::Device(_)));
    let data = pattern(random_seed(), 9 * MIB + 64);
    let mem = DeviceMemory::alloc(dev, data.len()).unwrap();
    mem.copy_from_host(0, &data).unwrap();
    let info = memory_info(0, mem.ptr(), data.len(), Location::Device(0), None);
    let src = RegisteredMemory::local(info, Some(Arc::new(mem)));
    let conn = peer.connect(Some(dev));
    write_cases_and_verify(&mut peer, &conn, &src, &data);

    conn.update_and_sync(&peer.a, SIG, 0x1234_5678_9abc)
        .unwrap();
    const ITERS: u64 = 200;
    add_from_threads(&peer, Some(dev), 2, ITERS);
    conn.flush(T).unwrap();
    assert_eq!(peer.u64_at(SIG), 0x1234_5678_9abc);
    check_counters(&mut peer, 2 * ITERS);
    drop(conn);
    peer.finish();
}
