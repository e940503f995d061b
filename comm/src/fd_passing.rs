//! Passing file descriptors between processes over a Unix domain socket
//! (`SCM_RIGHTS`), e.g. cuMem allocations exported as POSIX file descriptors.
//!
//! Each process that shares fds runs one [`FdServer`]: it listens on a Linux
//! *abstract* socket (nothing on disk, gone with the process) and hands a
//! duplicate of an offered fd to whoever asks with its key. Peers learn the
//! server's [`FdAddress`] (as bytes) and the key through the bootstrap, then call
//! [`fetch_fd`].
//!
//! Wire protocol, one request per connection: the client sends the key (8 bytes,
//! little endian); the server answers one status byte, with the fd attached as
//! `SCM_RIGHTS` when the status is 0 (found), none when it is 1 (no such key).

use std::collections::hash_map::{Entry, HashMap, RandomState};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read};
use std::mem::{size_of, zeroed};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

/// Longest abstract name: `sun_path` (108 bytes) less the leading NUL.
const MAX_NAME_LEN: usize = 107;
/// Longest prefix accepted by [`FdServer::start`] (the rest is pid and a random suffix).
const MAX_PREFIX_LEN: usize = 64;
/// How long the server waits on one client's request or reply before dropping it.
const SERVE_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between connection attempts while the server is not up yet.
const CONNECT_RETRY: Duration = Duration::from_millis(10);
/// Room for this many fds in a reply, so that a misbehaving peer's extras are seen (and closed).
const MAX_RECV_FDS: usize = 4;
const REPLY_OK: u8 = 0;
const REPLY_NO_SUCH_KEY: u8 = 1;

/// Where an [`FdServer`] listens: a Linux abstract socket name (printable ASCII).
/// Shown as `@name`, as `ss` shows abstract sockets.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct FdAddress {
    name: String,
}

impl FdAddress {
    /// The name, without the leading NUL byte.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.name.as_bytes().to_vec()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() || bytes.len() > MAX_NAME_LEN {
            let reason = format!("{} bytes, must be 1..={MAX_NAME_LEN}", bytes.len());
            return Err(CommError::invalid("fd address", reason));
        }
        if !bytes.iter().all(u8::is_ascii_graphic) {
            let reason = format!(
                "{:?} is not printable ASCII",
                String::from_utf8_lossy(bytes)
            );
            return Err(CommError::invalid("fd address", reason));
        }
        let name = String::from_utf8(bytes.to_vec()).expect("checked ASCII");
        Ok(Self { name })
    }
}

impl fmt::Display for FdAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.name)
    }
}

impl fmt::Debug for FdAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FdAddress(@{})", self.name)
    }
}

struct Offer {
    fd: OwnedFd,
    /// `None`: until withdrawn.
    takers_left: Option<usize>,
}

#[derive(Default)]
struct Registry {
    /// Keys are SipHash values of a counter under this process-random state,
    /// so another local process cannot guess them.
    keys: RandomState,
    counter: u64,
    offers: HashMap<u64, Offer>,
}

type Shared = Arc<Mutex<Registry>>;

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Registry> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves offered fds to other processes from one background thread, one request
/// at a time (a client that stalls holds it up for at most 1 s per read/write).
/// Dropping it stops the thread and closes every fd still offered.
pub struct FdServer {
    address: FdAddress,
    shared: Shared,
    /// Dropping this wakes the thread, which then exits.
    waker: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl FdServer {
    /// Listens on `@{name_prefix}.{pid}.{random}`; `name_prefix` is printable ASCII,
    /// at most 64 bytes.
    pub fn start(name_prefix: &str) -> Result<FdServer> {
        if name_prefix.len() > MAX_PREFIX_LEN || !name_prefix.bytes().all(|b| b.is_ascii_graphic())
        {
            let reason =
                format!("{name_prefix:?}: must be printable ASCII, at most {MAX_PREFIX_LEN} bytes");
            return Err(CommError::invalid("name_prefix", reason));
        }
        let io_err = |context: String| move |source| CommError::Io { context, source };
        let mut attempts = 0;
        let (listener, address) = loop {
            attempts += 1;
            let random = RandomState::new().build_hasher().finish();
            let name = format!("{name_prefix}.{}.{random:016x}", std::process::id());
            let addr = SocketAddr::from_abstract_name(name.as_bytes())
                .map_err(io_err(format!("fd server address @{name}")))?;
            match UnixListener::bind_addr(&addr) {
                Ok(listener) => break (listener, FdAddress { name }),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempts < 8 => continue,
                Err(e) => return Err(io_err(format!("binding fd server @{name}"))(e)),
            }
        };
        listener
            .set_nonblocking(true)
            .map_err(io_err(format!("setting up fd server {address}")))?;
        let (waker, wake_rx) =
            UnixStream::pair().map_err(io_err("creating fd server waker".into()))?;
        let shared = Shared::default();
        let thread = std::thread::Builder::new()
            .name("moelink-fd-server".into())
            .spawn({
                let shared = shared.clone();
                move || serve_loop(listener, wake_rx, shared)
            })
            .map_err(io_err(format!("spawning fd server thread for {address}")))?;
        tracing::debug!("fd server listening on {address}");
        Ok(FdServer {
            address,
            shared,
            waker: Some(waker),
            thread: Some(thread),
        })
    }

    pub fn address(&self) -> FdAddress {
        self.address.clone()
    }

    /// Offers `fd` to any number of takers until [`withdraw`](Self::withdraw)n; returns its key.
    pub fn offer(&self, fd: OwnedFd) -> u64 {
        self.insert(fd, None)
    }

    /// Offers `fd` and closes it once it was handed out `max_takers` times (at once if 0).
    pub fn offer_for(&self, fd: OwnedFd, max_takers: usize) -> u64 {
        self.insert(fd, Some(max_takers))
    }

    /// Closes the offered fd; false if `key` was not (or no longer) offered.
    pub fn withdraw(&self, key: u64) -> bool {
        lock(&self.shared).offers.remove(&key).is_some()
    }

    fn insert(&self, fd: OwnedFd, takers_left: Option<usize>) -> u64 {
        let mut registry = lock(&self.shared);
        let key = loop {
            registry.counter += 1;
            let k = registry.keys.hash_one(registry.counter);
            if k != 0 && !registry.offers.contains_key(&k) {
                break k;
            }
        };
        if takers_left != Some(0) {
            registry.offers.insert(key, Offer { fd, takers_left });
        }
        key
    }
}

impl fmt::Debug for FdServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FdServer")
            .field("address", &self.address)
            .field("offered", &lock(&self.shared).offers.len())
            .finish()
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        drop(self.waker.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("fd server thread of {} panicked", self.address);
            }
        }
        // The registry (and with it every offered fd) goes with the last Arc, here.
    }
}

fn serve_loop(listener: UnixListener, wake_rx: UnixStream, shared: Shared) {
    let pollfd = |fd: BorrowedFd<'_>| libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        let mut polled = [pollfd(listener.as_fd()), pollfd(wake_rx.as_fd())];
        // SAFETY: `polled` is a valid array of 2 pollfds whose fds outlive the call.
        if unsafe { libc::poll(polled.as_mut_ptr(), 2, -1) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("fd server poll failed, stopping: {e}");
            return;
        }
        if polled[1].revents != 0 {
            return; // the FdServer was dropped
        }
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = serve(&stream, &shared) {
                    tracing::debug!("fd server: dropped a request: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::warn!("fd server accept failed: {e}");
                std::thread::sleep(CONNECT_RETRY); // e.g. out of fds: do not spin
            }
        }
    }
}

/// Whether the connected peer runs as this process's user (SO_PEERCRED).
fn peer_is_same_user(stream: &UnixStream) -> io::Result<bool> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred/len describe a writable ucred; the fd is a connected unix socket.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: getuid has no preconditions.
    Ok(cred.uid == unsafe { libc::getuid() })
}

fn serve(stream: &UnixStream, shared: &Shared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(SERVE_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVE_TIMEOUT))?;
    let mut key = [0u8; 8];
    (&*stream).read_exact(&mut key)?;
    let key = u64::from_le_bytes(key);
    // Checked after reading the request, so the refused client gets the normal
    // "no such key" reply rather than a broken pipe while it is still sending.
    if !peer_is_same_user(stream)? {
        tracing::warn!("fd server: refused a request from another user");
        return send_msg(stream, &[REPLY_NO_SUCH_KEY], None);
    }
    let dup = lock(shared)
        .offers
        .get(&key)
        .map(|offer| offer.fd.try_clone())
        .transpose()?;
    let Some(dup) = dup else {
        return send_msg(stream, &[REPLY_NO_SUCH_KEY], None);
    };
    send_msg(stream, &[REPLY_OK], Some(dup.as_fd()))?;
    // Count the take only once it was sent; withdraw may have raced us.
    if let Entry::Occupied(mut offer) = lock(shared).offers.entry(key) {
        if let Some(left) = &mut offer.get_mut().takers_left {
            *left -= 1;
            if *left == 0 {
                offer.remove();
            }
        }
    }
    Ok(())
}

/// Fetches the fd offered under `key` by the [`FdServer`] at `addr`, waiting for
/// the server to come up if needed. Everything is bounded by `timeout`: on expiry
/// `CommError::Timeout` (rank -1: the rank is not known here) names the server and key.
/// An unknown key (never offered, withdrawn, or exhausted) is `InvalidArgument`.
pub fn fetch_fd(addr: &FdAddress, key: u64, timeout: Duration) -> Result<OwnedFd> {
    let start = Instant::now();
    let what = format!("fd under key {key} from fd server {addr}");
    let timed_out = |detail: String| CommError::Timeout {
        rank: -1,
        what: format!("{what} ({detail})"),
        waited_ms: (start.elapsed().as_millis() as u64).max(1),
    };
    let io_err = |step: &str, source| CommError::Io {
        context: format!("{step} {what}"),
        source,
    };
    let remaining = || {
        timeout
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1))
    };
    let stream = loop {
        match connect(&addr.name) {
            Ok(fd) => break UnixStream::from(fd),
            Err(e) if is_not_up(&e) => {
                if start.elapsed() >= timeout {
                    return Err(timed_out(format!("connect: {e}")));
                }
                std::thread::sleep(CONNECT_RETRY.min(remaining()));
            }
            Err(e) => return Err(io_err("connecting for", e)),
        }
    };
    let is_timeout = |e: &io::Error| e.kind() == io::ErrorKind::WouldBlock;
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(remaining())));
    setup.map_err(|e| io_err("setting up socket for", e))?;
    match send_msg(&stream, &key.to_le_bytes(), None) {
        Err(e) if is_timeout(&e) => return Err(timed_out("sending the key".into())),
        Err(e) => return Err(io_err("sending the request for", e)),
        Ok(()) => {}
    }
    stream
        .set_read_timeout(Some(remaining()))
        .map_err(|e| io_err("setting up socket for", e))?;
    let (len, status, mut fds, truncated) = match recv_reply(&stream) {
        Err(e) if is_timeout(&e) => return Err(timed_out("awaiting the reply".into())),
        Err(e) => return Err(io_err("receiving", e)),
        Ok(reply) => reply,
    };
    // Every early return below closes whatever fds arrived.
    let bad_reply = |reason: String| {
        let source = io::Error::new(io::ErrorKind::InvalidData, reason);
        io_err("malformed reply for", source)
    };
    match (len, status) {
        (0, _) => Err(bad_reply(
            "server closed the connection without a reply".into(),
        )),
        (_, REPLY_NO_SUCH_KEY) if fds.is_empty() => {
            let why = "never offered, withdrawn or exhausted";
            let reason = format!("fd server {addr} has no fd under key {key} ({why})");
            Err(CommError::invalid("key", reason))
        }
        (_, REPLY_OK) if fds.len() == 1 && !truncated => Ok(fds.pop().expect("one fd")),
        _ => Err(bad_reply(format!(
            "status {status}, {} fd(s){}",
            fds.len(),
            if truncated {
                ", control data truncated"
            } else {
                ""
            }
        ))),
    }
}

fn is_not_up(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED | libc::ENOENT | libc::EAGAIN)
    )
}

/// One nonblocking connect to the abstract socket `@name` (a full backlog is `EAGAIN`,
/// not a wait).
fn connect(name: &str) -> io::Result<OwnedFd> {
    let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
    // SAFETY: plain socket(2) call; the result is checked.
    let raw = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_un is plain data; all zeroes is valid.
    let mut sa: libc::sockaddr_un = unsafe { zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays NUL: abstract namespace. Names are at most 107 bytes (validated).
    for (dst, &b) in sa.sun_path[1..].iter_mut().zip(name.as_bytes()) {
        *dst = b as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    let sa_ptr = (&sa as *const libc::sockaddr_un).cast::<libc::sockaddr>();
    // SAFETY: `sa` is a valid sockaddr_un of which `len` bytes are meaningful.
    if unsafe { libc::connect(fd.as_raw_fd(), sa_ptr, len as libc::socklen_t) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Control buffer, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Sends all of `data`, with `fd` attached to the first byte(s); never raises SIGPIPE.
fn send_msg(
    stream: &UnixStream,
    mut data: &[u8],
    mut fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    while !data.is_empty() {
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut _,
            iov_len: data.len(),
        };
        let mut cbuf = CmsgBuf([0; 64]);
        // SAFETY: msghdr is plain data; all zeroes is valid (no name, no control).
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            let fd_len = size_of::<libc::c_int>() as u32;
            // SAFETY: CMSG_* only compute on `msg`, whose control buffer `cbuf` is aligned and
            // large enough for one header plus one int; the fd is written unaligned-safe.
            unsafe {
                msg.msg_control = cbuf.0.as_mut_ptr().cast();
                msg.msg_controllen = libc::CMSG_SPACE(fd_len) as _;
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast(), fd.as_raw_fd());
            }
        }
        // SAFETY: `msg` points at `iov` and `cbuf`, both alive for the call.
        let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        data = &data[sent as usize..];
        fd = None;
    }
    Ok(())
}

/// Receives the one-byte reply: (bytes read, status, every fd that arrived, control truncated).
fn recv_reply(stream: &UnixStream) -> io::Result<(usize, u8, Vec<OwnedFd>, bool)> {
    let mut status = 0u8;
    let mut iov = libc::iovec {
        iov_base: (&mut status as *mut u8).cast(),
        iov_len: 1,
    };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: msghdr is plain data; all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size; 4 ints fit the 64-byte buffer.
    msg.msg_controllen =
        unsafe { libc::CMSG_SPACE((MAX_RECV_FDS * size_of::<libc::c_int>()) as u32) } as _;
    let len = loop {
        // SAFETY: `msg` points at `iov` (1 byte: `status`) and `cbuf`, alive for the call.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg`'s control buffer; CMSG_FIRSTHDR/NXTHDR stay within
    // msg_controllen, and each SCM_RIGHTS payload holds fds now installed in this process,
    // owned by nobody else, which become OwnedFds at once (and are closed on every path).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let payload =
                    ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..payload / size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((len, status, fds, msg.msg_flags & libc::MSG_CTRUNC != 0))
}
