//! fd passing over abstract unix sockets (SCM_RIGHTS): same process, across
//! processes (the test binary re-executes itself), leaks, timeouts, bad replies.
//! CPU only.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use comm::fd_passing::{fetch_fd, FdAddress, FdServer};
use comm::CommError;

mod common;
use common::{fnv1a, pattern, random_seed};

const T: Duration = Duration::from_secs(5);
const CHILD_ROLE: &str = "MOELINK_FDPASS_CHILD";

/// Tests count this process's fds, so they must not overlap.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn random_bytes(len: usize) -> Vec<u8> {
    pattern(random_seed(), len)
}

fn memfd_with(content: &[u8]) -> OwnedFd {
    // SAFETY: the name is a valid C string; the result is checked.
    let raw = unsafe { libc::memfd_create(c"fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(
        raw >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    File::from(fd.try_clone().unwrap())
        .write_all_at(content, 0)
        .unwrap();
    fd
}

/// The whole content, read with pread (a fetched fd shares its file offset with the original).
fn read_all(fd: &OwnedFd) -> Vec<u8> {
    let file = File::from(fd.try_clone().unwrap());
    let mut buf = vec![0u8; file.metadata().unwrap().len() as usize];
    file.read_exact_at(&mut buf, 0).unwrap();
    buf
}

fn pipe() -> (File, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds; the result is checked.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fresh fds owned by nobody else.
    unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

fn assert_no_such_key(result: comm::Result<OwnedFd>, key: u64) {
    match result {
        Err(CommError::InvalidArgument {
            name: "key",
            reason,
        }) => {
            assert!(
                reason.contains(&format!("no fd under key {key}")),
                "{reason}"
            )
        }
        other => panic!("expected unknown-key error for {key}, got {other:?}"),
    }
}

#[test]
fn same_process_memfd_and_pipe() {
    let _serial = serial();
    let server = FdServer::start("fdpass-test").unwrap();
    let content = random_bytes(4096);
    let key = server.offer(memfd_with(&content));
    let fetched = fetch_fd(&server.address(), key, T).unwrap();
    assert_eq!(read_all(&fetched), content);

    let (mut read_end, write_end) = pipe();
    let pipe_key = server.offer(write_end);
    assert_ne!(key, pipe_key);
    let mut writer = File::from(fetch_fd(&server.address(), pipe_key, T).unwrap());
    writer.write_all(b"through the fetched fd").unwrap();
    drop(writer);
    assert!(server.withdraw(pipe_key)); // the server's copy: now the pipe has no writer left
    let mut got = String::new();
    read_end.read_to_string(&mut got).unwrap();
    assert_eq!(got, "through the fetched fd");
    assert!(format!("{server:?}").contains("offered: 1"), "{server:?}");
}

#[test]
fn keys_unknown_withdrawn_and_exhausted() {
    let _serial = serial();
    let server = FdServer::start("fdpass-test").unwrap();
    let addr = server.address();
    let keys: Vec<u64> = (0..5).map(|_| server.offer(memfd_with(b"x"))).collect();
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "keys {keys:?}");
    assert_no_such_key(fetch_fd(&addr, 999_999, T), 999_999);

    assert!(server.withdraw(keys[0]));
    assert!(!server.withdraw(keys[0]));
    assert_no_such_key(fetch_fd(&addr, keys[0], T), keys[0]);
    assert!(fetch_fd(&addr, keys[1], T).is_ok());

    let twice = server.offer_for(memfd_with(b"twice"), 2);
    assert_eq!(read_all(&fetch_fd(&addr, twice, T).unwrap()), b"twice");
    assert_eq!(read_all(&fetch_fd(&addr, twice, T).unwrap()), b"twice");
    assert_no_such_key(fetch_fd(&addr, twice, T), twice);
    assert!(!server.withdraw(twice));

    let never = server.offer_for(memfd_with(b"never"), 0);
    assert_no_such_key(fetch_fd(&addr, never, T), never);
}

#[test]
fn address_bytes_roundtrip_and_validation() {
    let _serial = serial();
    let server = FdServer::start("fdpass-addr").unwrap();
    let addr = server.address();
    assert_eq!(FdAddress::from_bytes(&addr.to_bytes()).unwrap(), addr);
    assert!(addr.to_string().starts_with("@fdpass-addr."), "{addr}");
    for bad in [
        &b""[..],
        &[b'a'; 108],
        b"has space",
        b"nul\0byte",
        "é".as_bytes(),
    ] {
        let err = FdAddress::from_bytes(bad).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument { .. }), "{err}");
    }
    assert!(FdAddress::from_bytes(&[b'a'; 107]).is_ok());
    assert!(FdServer::start("bad prefix").is_err());
    assert!(FdServer::start(&"p".repeat(65)).is_err());
}

/// Runs only when re-executed by a cross-process test (env var set); else a no-op.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(CHILD_ROLE) else {
        return;
    };
    let env = |name: &str| std::env::var(name).unwrap();
    let hex = env("FDPASS_ADDR");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let addr = FdAddress::from_bytes(&bytes).unwrap();
    let key: u64 = env("FDPASS_KEY").parse().unwrap();
    match fetch_fd(&addr, key, T) {
        Ok(fd) => {
            let content = read_all(&fd);
            let sum = fnv1a(&content);
            println!(
                "FDPASS_CHILD_OK role={role} len={} sum={sum:016x}",
                content.len()
            );
            assert_eq!(
                format!("{sum:016x}"),
                env("FDPASS_SUM"),
                "checksum mismatch"
            );
        }
        Err(e) => {
            println!("FDPASS_CHILD_ERR role={role} {e}");
            std::process::exit(3);
        }
    }
}

fn run_child(role: &str, addr: &FdAddress, key: u64, sum: u64) -> (Option<i32>, String) {
    run_child_as(None, role, addr, key, sum)
}

/// As [`run_child`], the child running as user `uid` when given.
fn run_child_as(
    uid: Option<u32>,
    role: &str,
    addr: &FdAddress,
    key: u64,
    sum: u64,
) -> (Option<i32>, String) {
    use std::os::unix::process::CommandExt;
    let hex: String = addr.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    if let Some(uid) = uid {
        cmd.uid(uid);
    }
    let out = cmd
        .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(CHILD_ROLE, role)
        .env("FDPASS_ADDR", hex)
        .env("FDPASS_KEY", key.to_string())
        .env("FDPASS_SUM", format!("{sum:016x}"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

/// A process of another user gets "no such key" even with the right key
/// (SO_PEERCRED). Needs root to start the child as another user.
#[test]
fn other_users_are_refused() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        println!("SKIPPED other_users_are_refused: needs root to run a child as another user");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let _serial = serial();
    let server = FdServer::start("fdpass-uid").unwrap();
    let content = random_bytes(4096);
    let key = server.offer(memfd_with(&content));
    let (code, out) = run_child_as(Some(65534), "other-user", &server.address(), key, 0);
    if out.contains("Permission denied") || code == Some(126) {
        println!(
            "SKIPPED other_users_are_refused: {} not executable by uid 65534",
            exe.display()
        );
        return;
    }
    assert_eq!(code, Some(3), "child must fail:\n{out}");
    assert!(out.contains(&format!("no fd under key {key}")), "{out}");
    // The owner itself still gets it.
    assert_eq!(
        read_all(&fetch_fd(&server.address(), key, T).unwrap()),
        content
    );
}

#[test]
fn cross_process_fetch() {
    let _serial = serial();
    let server = FdServer::start("fdpass-xproc").unwrap();
    let content = random_bytes(64 * 1024 + 17);
    let sum = fnv1a(&content);
    let key = server.offer_for(memfd_with(&content), 1);
    let (code, out) = run_child("fetch", &server.address(), key, sum);
    assert_eq!(code, Some(0), "child failed:\n{out}");
    let expected = format!(
        "FDPASS_CHILD_OK role=fetch len={} sum={sum:016x}",
        content.len()
    );
    assert!(out.contains(&expected), "child did not fetch:\n{out}");
    // The one allowed taker was the child.
    assert_no_such_key(fetch_fd(&server.address(), key, T), key);
}

#[test]
fn cross_process_bad_key() {
    let _serial = serial();
    let server = FdServer::start("fdpass-xproc").unwrap();
    let key = server.offer(memfd_with(b"secret"));
    let (code, out) = run_child("bad_key", &server.address(), key + 1000, 0);
    assert_eq!(code, Some(3), "child should fail:\n{out}");
    let expected = format!(
        "FDPASS_CHILD_ERR role=bad_key invalid argument `key`: fd server {} has no fd under key {}",
        server.address(),
        key + 1000
    );
    assert!(out.contains(&expected), "unexpected child output:\n{out}");
}

#[test]
fn no_fd_leak() {
    let _serial = serial();
    let before = fd_count();
    let server = FdServer::start("fdpass-leak").unwrap();
    let addr = server.address();
    for i in 0..200u64 {
        let content = i.to_le_bytes();
        match i % 4 {
            0 => {
                let key = server.offer_for(memfd_with(&content), 1);
                assert_eq!(read_all(&fetch_fd(&addr, key, T).unwrap()), content);
                assert_no_such_key(fetch_fd(&addr, key, T), key);
            }
            1 => {
                let key = server.offer(memfd_with(&content));
                assert_eq!(read_all(&fetch_fd(&addr, key, T).unwrap()), content);
                assert!(server.withdraw(key));
            }
            2 => assert_no_such_key(fetch_fd(&addr, u64::MAX - i, T), u64::MAX - i),
            _ => {
                let key = server.offer(memfd_with(&content)); // left for Drop to close
                drop(fetch_fd(&addr, key, T).unwrap());
            }
        }
    }
    let started = Instant::now();
    drop(server);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "slow drop: {:?}",
        started.elapsed()
    );
    assert_eq!(fd_count(), before, "fds leaked");
}

fn assert_timeout(result: comm::Result<OwnedFd>, addr: &FdAddress, key: u64, started: Instant) {
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(300),
        "gave up early: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_millis(1000),
        "took too long: {elapsed:?}"
    );
    match result {
        Err(e @ CommError::Timeout { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&addr.to_string()), "{msg}");
            assert!(msg.contains(&format!("key {key}")), "{msg}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn timeout_when_nobody_listens() {
    let _serial = serial();
    let addr =
        FdAddress::from_bytes(format!("fdpass-nobody.{}", std::process::id()).as_bytes()).unwrap();
    let started = Instant::now();
    let result = fetch_fd(&addr, 7, Duration::from_millis(300));
    assert_timeout(result, &addr, 7, started);
}

fn listen_at(name: &str) -> (UnixListener, FdAddress) {
    let sa = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    (
        UnixListener::bind_addr(&sa).unwrap(),
        FdAddress::from_bytes(name.as_bytes()).unwrap(),
    )
}

#[test]
fn timeout_when_server_never_replies() {
    let _serial = serial();
    let (_listener, addr) = listen_at(&format!("fdpass-mute.{}", std::process::id()));
    let started = Instant::now();
    let result = fetch_fd(&addr, 8, Duration::from_millis(300));
    assert_timeout(result, &addr, 8, started);
}

/// Replies to one request with status `status` and `fds` attached (a misbehaving server).
fn reply_with(listener: &UnixListener, status: u8, fds: &[OwnedFd]) {
    let (mut stream, _) = listener.accept().unwrap();
    let mut key = [0u8; 8];
    stream.read_exact(&mut key).unwrap();
    let raw: Vec<i32> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice()) as u32;
    let mut cbuf = vec![0u64; 64];
    let mut iov = libc::iovec {
        iov_base: &status as *const u8 as *mut _,
        iov_len: 1,
    };
    // SAFETY: msghdr is plain data; zeroes are valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: `cbuf` (512 bytes, aligned) holds one header plus up to 16 fds.
    unsafe {
        if raw.is_empty() {
            assert_eq!(libc::sendmsg(stream.as_raw_fd(), &msg, 0), 1);
            return;
        }
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(payload) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
        let data = libc::CMSG_DATA(cmsg).cast::<i32>();
        std::ptr::copy_nonoverlapping(raw.as_ptr(), data, raw.len());
        assert_eq!(libc::sendmsg(stream.as_raw_fd(), &msg, 0), 1);
    }
}

#[test]
fn fetch_waits_for_a_late_server() {
    let _serial = serial();
    let name = format!("fdpass-late.{}", std::process::id());
    let addr = FdAddress::from_bytes(name.as_bytes()).unwrap();
    let server = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        let (listener, _) = listen_at(&name);
        reply_with(&listener, 0, &[memfd_with(b"late")]);
    });
    let fd = fetch_fd(&addr, 1, T).unwrap();
    assert_eq!(read_all(&fd), b"late");
    server.join().unwrap();
}

#[test]
fn malformed_replies_close_every_fd() {
    let _serial = serial();
    let before = fd_count();
    for (i, (status, n_fds)) in [(0u8, 2usize), (0, 9), (1, 1), (0, 0), (7, 1)]
        .into_iter()
        .enumerate()
    {
        let (listener, addr) = listen_at(&format!("fdpass-bad.{}.{i}", std::process::id()));
        let server = std::thread::spawn(move || {
            let fds: Vec<OwnedFd> = (0..n_fds).map(|_| memfd_with(b"junk")).collect();
            reply_with(&listener, status, &fds);
        });
        let err = fetch_fd(&addr, 1, T).unwrap_err();
        assert!(
            matches!(err, CommError::Io { .. }),
            "status {status}, {n_fds} fds: {err}"
        );
        assert!(err.to_string().contains("malformed reply"), "{err}");
        server.join().unwrap();
    }
    assert_eq!(fd_count(), before, "fds leaked");
}

/// A dma-buf descriptor of cuMem memory (what an RDMA NIC registers): the
/// kernel knows it as a file of the range's size; a range that is not whole
/// pages is refused before the driver is asked.
#[test]
#[ignore = "needs a CUDA GPU; run by scripts/gpu_run.sh"]
fn gpu_memory_exports_as_dmabuf() {
    use comm::vmm::VmmMemory;
    use comm::Device;
    let dev = Device::bind(0).unwrap();
    let len = 2 << 20;
    let mem = VmmMemory::alloc(dev, len).unwrap();
    let e = dev.dmabuf_fd(mem.ptr() + 1, 4096).unwrap_err();
    assert!(e.to_string().contains("whole"), "{e}");
    match dev.dmabuf_fd(mem.ptr(), len) {
        Ok(fd) => {
            // SAFETY: a plain fstat on a descriptor we own.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
            assert_eq!(st.st_size as usize, len, "dma-buf size");
        }
        Err(e) if e.to_string().contains("cannot export dma-buf") => {
            println!("SKIPPED: {e}");
        }
        Err(e) => panic!("dma-buf export failed: {e}"),
    }
}
