//! TCP bootstrap tests, CPU only: UniqueId serialization, argument checks,
//! in-process jobs (threads) and multi-process jobs of 2 to 8 processes.
//!
//! Multi-process tests re-execute this test binary: `child_entry` runs the
//! scenario named by `MOELINK_BOOTSTRAP_CHILD` (and returns at once when it is
//! unset, as in a normal test run). Rank 0 creates the UniqueId and publishes it
//! through a file; the parent then starts the other ranks with the id in their
//! environment, collects exit codes and output, and asserts. Children check
//! their own results and exit non-zero, with a message, when a check fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use comm::bootstrap::{Bootstrap, TcpBootstrap, UniqueId};
use comm::CommError;

mod common;
use common::pattern;

const CHILD_ENV: &str = "MOELINK_BOOTSTRAP_CHILD";
const RANK_ENV: &str = "MOELINK_BS_TEST_RANK";
const SIZE_ENV: &str = "MOELINK_BS_TEST_SIZE";
const ID_ENV: &str = "MOELINK_BS_TEST_ID";
const ID_FILE_ENV: &str = "MOELINK_BS_TEST_ID_FILE";
const TIMEOUT_ENV: &str = "MOELINK_BS_TEST_TIMEOUT_MS";
const EXPECT_ENV: &str = "MOELINK_BS_TEST_EXPECT";
/// Every variable `TcpBootstrap::from_env` reads.
const TORCHRUN_VARS: [&str; 7] = [
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MOELINK_BOOTSTRAP_PORT",
    "TORCHELASTIC_RUN_ID",
    "LOCAL_RANK",
];

/// Timeout of the scenarios that should succeed: generous, for loaded CI.
const GENEROUS_MS: u64 = 15_000;
/// How long the parent lets a job run before killing it.
const JOB_LIMIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Parent side

struct Outcome {
    rank: usize,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

struct Running {
    rank: usize,
    child: Child,
    out: JoinHandle<String>,
    err: JoinHandle<String>,
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

fn spawn_child(scenario: &str, rank: usize, env: &[(&str, String)]) -> Running {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, scenario)
        .env(RANK_ENV, rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in TORCHRUN_VARS {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn a child test process");
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    Running {
        rank,
        child,
        out,
        err,
    }
}

/// Waits for every child (killing those still running after `JOB_LIMIT`).
/// The children's output is printed (libtest shows it for failed tests).
fn finish(running: Vec<Running>) -> Vec<Outcome> {
    let limit = Instant::now() + JOB_LIMIT;
    let outcomes: Vec<Outcome> = running
        .into_iter()
        .map(|mut r| {
            let code = loop {
                match r.child.try_wait().expect("wait for a child") {
                    Some(status) => break status.code(),
                    None if Instant::now() > limit => {
                        let _ = r.child.kill();
                        let _ = r.child.wait();
                        break None;
                    }
                    None => std::thread::sleep(Duration::from_millis(5)),
                }
            };
            Outcome {
                rank: r.rank,
                code,
                stdout: r.out.join().unwrap(),
                stderr: r.err.join().unwrap(),
            }
        })
        .collect();
    println!("{}", report(&outcomes));
    outcomes
}

fn scratch_path(what: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "moelink-bs-test-{}-{}-{what}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Starts `ranks` (a subset of `0..size`, rank 0 first) of a job running
/// `scenario`: rank 0 creates the id and publishes it in a file, the others
/// are started once it exists.
fn run_job(scenario: &str, size: usize, ranks: &[usize], timeout_ms: u64) -> Vec<Outcome> {
    assert_eq!(ranks.first(), Some(&0), "rank 0 publishes the id");
    let id_file = scratch_path("id");
    let common = [
        (SIZE_ENV, size.to_string()),
        (TIMEOUT_ENV, timeout_ms.to_string()),
    ];
    let mut env0 = common.to_vec();
    env0.push((ID_FILE_ENV, id_file.display().to_string()));
    let mut running = vec![spawn_child(scenario, 0, &env0)];

    let wait_until = Instant::now() + Duration::from_secs(15);
    let id = loop {
        if let Ok(s) = std::fs::read_to_string(&id_file) {
            break s;
        }
        let rank0_exited = running[0].child.try_wait().unwrap().is_some();
        if rank0_exited || Instant::now() > wait_until {
            let outcomes = finish(running);
            panic!(
                "rank 0 published no id (exited: {rank0_exited})\n{}",
                report(&outcomes)
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let _ = std::fs::remove_file(&id_file);
    for &rank in &ranks[1..] {
        let mut env = common.to_vec();
        env.push((ID_ENV, id.clone()));
        running.push(spawn_child(scenario, rank, &env));
    }
    finish(running)
}

/// Starts ranks `0..size` of a torchrun-style job (no id file: every rank
/// reads the same environment).
fn run_env_job(scenario: &str, size: usize, env: &[(&str, String)]) -> Vec<Outcome> {
    let running = (0..size)
        .map(|rank| {
            let mut env = env.to_vec();
            env.push(("RANK", rank.to_string()));
            env.push(("WORLD_SIZE", size.to_string()));
            env.push(("LOCAL_RANK", rank.to_string()));
            env.push((SIZE_ENV, size.to_string()));
            env.push((TIMEOUT_ENV, GENEROUS_MS.to_string()));
            spawn_child(scenario, rank, &env)
        })
        .collect();
    finish(running)
}

fn report(outcomes: &[Outcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            format!(
                "--- rank {} exit {:?}\nstdout:\n{}\nstderr:\n{}",
                o.rank, o.code, o.stdout, o.stderr
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Asserts each rank's exit code (`codes[i]` for `outcomes[i]`).
fn expect_codes(outcomes: &[Outcome], codes: &[i32]) {
    let got: Vec<Option<i32>> = outcomes.iter().map(|o| o.code).collect();
    let want: Vec<Option<i32>> = codes.iter().map(|&c| Some(c)).collect();
    assert_eq!(got, want, "exit codes\n{}", report(outcomes));
}

fn expect_all_ok(outcomes: &[Outcome]) {
    expect_codes(outcomes, &vec![0; outcomes.len()]);
    for o in outcomes {
        assert!(
            o.stdout.contains("CHILD-OK"),
            "rank {} did not report success\n{}",
            o.rank,
            report(outcomes)
        );
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ---------------------------------------------------------------------------
// Child side

/// Not a test of its own: the entry point of child processes.
#[test]
fn child_entry() {
    let Ok(scenario) = std::env::var(CHILD_ENV) else {
        return;
    };
    let code = match std::panic::catch_unwind(|| run_child(&scenario)) {
        Ok(Ok(code)) => {
            if code == 0 {
                println!("CHILD-OK");
            }
            code
        }
        Ok(Err(msg)) => {
            eprintln!("CHILD-FAILED: {msg}");
            1
        }
        Err(_) => 2,
    };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(code);
}

type Check<T = ()> = Result<T, String>;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn env_usize(name: &str) -> usize {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} unset"))
        .parse()
        .unwrap()
}

struct ChildEnv {
    rank: usize,
    size: usize,
    timeout: Duration,
}

fn child_env() -> ChildEnv {
    ChildEnv {
        rank: env_usize(RANK_ENV),
        size: env_usize(SIZE_ENV),
        timeout: Duration::from_millis(env_usize(TIMEOUT_ENV) as u64),
    }
}

/// Joins the job: rank 0 creates and publishes the id, the others read it.
fn join(env: &ChildEnv) -> comm::Result<TcpBootstrap> {
    let id = match std::env::var(ID_FILE_ENV) {
        Ok(path) => {
            let id = UniqueId::new(None)?;
            let tmp = format!("{path}.tmp");
            std::fs::write(&tmp, id.to_string()).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
            id
        }
        Err(_) => std::env::var(ID_ENV).unwrap().parse::<UniqueId>()?,
    };
    TcpBootstrap::new(&id, env.rank, env.size, env.timeout)
}

fn run_child(scenario: &str) -> Check<i32> {
    let env = child_env();
    let started = |e: CommError| format!("joining the job: {e}");
    match scenario {
        "all_gather" => child_all_gather(&join(&env).map_err(started)?).map(|()| 0),
        "barrier" => child_barrier(&join(&env).map_err(started)?).map(|()| 0),
        "ring" => child_ring(&join(&env).map_err(started)?).map(|()| 0),
        "large" => child_large(&join(&env).map_err(started)?).map(|()| 0),
        "from_env" => child_from_env(&env).map(|()| 0),
        "env_missing" => child_env_missing(&env).map(|()| 0),
        "join_timeout" => child_join_timeout(&env).map(|()| 0),
        "recv_timeout" => child_recv_timeout(join(&env).map_err(started)?).map(|()| 0),
        "peer_death" => child_peer_death(join(&env).map_err(started)?),
        other => Err(format!("unknown scenario {other:?}")),
    }
}

/// Rank `r`'s contribution to round `round`: a distinct length (rank 0 sends
/// nothing in round 0) and content.
fn contribution(r: usize, round: usize) -> Vec<u8> {
    let len = r * 100 + round * 7;
    (0..len).map(|i| (r * 31 + round * 7 + i) as u8).collect()
}

fn child_all_gather(b: &TcpBootstrap) -> Check {
    let (rank, size) = (b.rank(), b.size());
    for round in 0..6 {
        let all = b
            .all_gather(&contribution(rank, round))
            .map_err(|e| e.to_string())?;
        ensure!(all.len() == size, "round {round}: {} entries", all.len());
        for (r, data) in all.iter().enumerate() {
            ensure!(
                *data == contribution(r, round),
                "round {round}: rank {r}'s data is wrong ({} bytes)",
                data.len()
            );
        }
    }
    // A collective in between user messages with colliding-looking tags.
    b.send((rank + 1) % size, 0, b"after")
        .map_err(|e| e.to_string())?;
    let all = b.all_gather(&[rank as u8]).map_err(|e| e.to_string())?;
    ensure!(
        all == (0..size).map(|r| vec![r as u8]).collect::<Vec<_>>(),
        "last round: {all:?}"
    );
    let got = b
        .recv((rank + size - 1) % size, 0)
        .map_err(|e| e.to_string())?;
    ensure!(got == b"after", "user message: {got:?}");
    Ok(())
}

fn child_barrier(b: &TcpBootstrap) -> Check {
    let (rank, size) = (b.rank(), b.size());
    let last = size - 1;
    b.barrier().map_err(|e| e.to_string())?;
    // The last rank enters late: nobody may leave before it entered (one host,
    // so the wall clocks agree).
    let entered = if rank == last {
        std::thread::sleep(Duration::from_millis(300));
        wall_ns()
    } else {
        0
    };
    b.barrier().map_err(|e| e.to_string())?;
    let left = wall_ns();
    let stamps = b
        .all_gather(&[entered.to_le_bytes(), left.to_le_bytes()].concat())
        .map_err(|e| e.to_string())?;
    let stamp =
        |r: usize, i: usize| u64::from_le_bytes(stamps[r][8 * i..8 * i + 8].try_into().unwrap());
    for r in 0..size {
        ensure!(
            stamp(r, 1) >= stamp(last, 0),
            "rank {r} left the barrier {} us before rank {last} entered it",
            (stamp(last, 0) - stamp(r, 1)) / 1000
        );
    }
    for i in 0..200u32 {
        b.barrier().map_err(|e| format!("barrier {i}: {e}"))?;
        if i % 50 == 49 {
            let all = b.all_gather(&i.to_le_bytes()).map_err(|e| e.to_string())?;
            ensure!(
                all.iter().all(|d| d[..] == i.to_le_bytes()),
                "ranks disagree on the iteration: {all:?}"
            );
        }
    }
    Ok(())
}

fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn ring_msg(from: usize, tag: u64, k: usize) -> Vec<u8> {
    format!("from {from} tag {tag} #{k}").into_bytes()
}

fn child_ring(b: &TcpBootstrap) -> Check {
    let (rank, size) = (b.rank(), b.size());
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let tags = [3u64, 1, 4, 10, 5];
    let back_tag = TcpBootstrap::MAX_TAG;
    let e = |e: CommError| e.to_string();
    // Interleave tags and directions; receive them in another order.
    for k in 0..3 {
        for &tag in &tags {
            b.send(next, tag, &ring_msg(rank, tag, k)).map_err(e)?;
        }
        b.send(prev, back_tag, &ring_msg(rank, back_tag, k))
            .map_err(e)?;
        b.send(rank, 7, &ring_msg(rank, 7, k)).map_err(e)?;
    }
    for k in 0..3 {
        let got = b.recv(next, back_tag).map_err(e)?;
        ensure!(got == ring_msg(next, back_tag, k), "backward #{k}: {got:?}");
    }
    for &tag in tags.iter().rev() {
        for k in 0..3 {
            let got = b.recv(prev, tag).map_err(e)?;
            ensure!(
                got == ring_msg(prev, tag, k),
                "tag {tag} #{k}: {:?}",
                String::from_utf8_lossy(&got)
            );
        }
    }
    for k in 0..3 {
        let got = b.recv(rank, 7).map_err(e)?;
        ensure!(got == ring_msg(rank, 7, k), "self #{k}: {got:?}");
    }
    b.barrier().map_err(e)?;
    Ok(())
}

fn child_large(b: &TcpBootstrap) -> Check {
    const LEN: usize = 8 << 20;
    let e = |e: CommError| e.to_string();
    let peer = 1 - b.rank();
    let t = Instant::now();
    // Both directions at once; then rank 1 echoes rank 0's buffer.
    b.send(peer, 1, &pattern(b.rank() as u64, LEN)).map_err(e)?;
    let got = b.recv(peer, 1).map_err(e)?;
    ensure!(got.len() == LEN, "got {} bytes", got.len());
    ensure!(got == pattern(peer as u64, LEN), "8 MiB payload corrupted");
    if b.rank() == 1 {
        b.send(0, 2, &got).map_err(e)?;
    } else {
        let echo = b.recv(1, 2).map_err(e)?;
        ensure!(echo == pattern(0, LEN), "8 MiB echo corrupted");
    }
    b.barrier().map_err(e)?;
    println!("8 MiB exchange and echo took {:?}", t.elapsed());
    Ok(())
}

fn child_from_env(env: &ChildEnv) -> Check {
    let b = TcpBootstrap::from_env(env.timeout).map_err(|e| format!("from_env: {e}"))?;
    ensure!(
        b.rank() == env.rank && b.size() == env.size,
        "rank/size {}/{}",
        b.rank(),
        b.size()
    );
    let all = b
        .all_gather(format!("rank {}", b.rank()).as_bytes())
        .map_err(|e| e.to_string())?;
    for (r, d) in all.iter().enumerate() {
        ensure!(*d == format!("rank {r}").into_bytes(), "entry {r}: {d:?}");
    }
    b.barrier().map_err(|e| e.to_string())?;
    println!("{b:?}");
    Ok(())
}

/// Expects `from_env` to fail at once, naming the variable in `EXPECT_ENV`.
fn child_env_missing(env: &ChildEnv) -> Check {
    let expect = std::env::var(EXPECT_ENV).unwrap();
    let t = Instant::now();
    match TcpBootstrap::from_env(env.timeout) {
        Ok(_) => Err("from_env succeeded".into()),
        Err(err @ CommError::InvalidArgument { .. }) => {
            let msg = err.to_string();
            println!("{msg}");
            ensure!(msg.contains(&expect), "error does not name {expect}: {msg}");
            ensure!(
                t.elapsed() < Duration::from_secs(2),
                "took {:?}",
                t.elapsed()
            );
            Ok(())
        }
        Err(err) => Err(format!("expected InvalidArgument, got {err}")),
    }
}

/// A job of 3 where rank 2 never starts.
fn child_join_timeout(env: &ChildEnv) -> Check {
    let t = Instant::now();
    let err = match join(env) {
        Ok(b) => return Err(format!("joined without rank 2: {b:?}")),
        Err(e) => e,
    };
    let waited = t.elapsed();
    let msg = err.to_string();
    println!("{msg}");
    let CommError::Timeout { rank, what, .. } = &err else {
        return Err(format!("expected a Timeout, got {msg}"));
    };
    ensure!(*rank == env.rank as i64, "wrong rank in {msg}");
    if env.rank == 0 {
        ensure!(
            what.contains("rank 2 to join (2 of 3 ranks registered)"),
            "root's message: {msg}"
        );
    } else {
        ensure!(
            what.contains("rank 2") || what.contains("root (rank 0)"),
            "rank 1's message: {msg}"
        );
    }
    // Rank 1 started later than the root and may hear of the root's deadline
    // first, so only the root's wait has a lower bound.
    ensure!(
        (env.rank != 0 || waited >= env.timeout) && waited < env.timeout + Duration::from_secs(3),
        "failed after {waited:?} with a timeout of {:?}",
        env.timeout
    );
    Ok(())
}

fn child_recv_timeout(b: TcpBootstrap) -> Check {
    let short = Duration::from_millis(800);
    if b.rank() == 0 {
        b.set_timeout(short).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let err = b.recv(1, 42).err().ok_or("recv got a message")?;
        let waited = t.elapsed();
        println!("{err}");
        ensure!(
            matches!(&err, CommError::Timeout { rank: 0, what, .. }
                if what == "a message from rank 1 with tag 42"),
            "unexpected error: {err}"
        );
        ensure!(
            waited >= short && waited < short + Duration::from_secs(3),
            "recv gave up after {waited:?}"
        );
        // Rank 1 is blocked in recv, so it never enters the barrier.
        let err = b.barrier().err().ok_or("barrier passed alone")?;
        println!("{err}");
        ensure!(
            err.to_string()
                .contains("rank 1 to enter barrier #0 (1 of 2 ranks entered)"),
            "unexpected error: {err}"
        );
        b.send(1, 43, b"go").map_err(|e| e.to_string())?;
        // Dropping says goodbye.
    } else {
        let got = b.recv(0, 43).map_err(|e| e.to_string())?;
        ensure!(got == b"go", "got {got:?}");
        let t = Instant::now();
        let err = b
            .recv(0, 44)
            .err()
            .ok_or("recv from a closed rank succeeded")?;
        println!("{err}");
        ensure!(
            err.to_string().contains("rank 0 shut down its bootstrap"),
            "unexpected error: {err}"
        );
        ensure!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
    }
    Ok(())
}

/// Rank 1 dies (exits without dropping its bootstrap), rank 2 shuts down
/// cleanly; rank 0 must learn both promptly.
fn child_peer_death(b: TcpBootstrap) -> Check<i32> {
    let e = |e: CommError| e.to_string();
    match b.rank() {
        1 => {
            b.send(0, 4, b"last words").map_err(e)?;
            std::thread::sleep(Duration::from_millis(200));
            let _ = std::io::stdout().flush();
            std::process::exit(7);
        }
        2 => {
            b.send(0, 4, b"bye").map_err(e)?;
            drop(b);
            Ok(0)
        }
        _ => {
            let t = Instant::now();
            // Messages sent before the death still arrive.
            ensure!(
                b.recv(1, 4).map_err(e)? == b"last words",
                "rank 1's message"
            );
            let err = b
                .recv(1, 5)
                .err()
                .ok_or("recv from a dead rank succeeded")?;
            let waited = t.elapsed();
            println!("{err} (after {waited:?})");
            ensure!(
                matches!(err, CommError::Io { .. }),
                "expected an I/O error, got {err}"
            );
            let msg = err.to_string();
            ensure!(
                msg.contains("a message from rank 1 with tag 5")
                    && msg.contains("rank 1 closed its connection"),
                "message: {msg}"
            );
            ensure!(
                waited < Duration::from_secs(5),
                "noticed the death after {waited:?}"
            );
            ensure!(b.recv(2, 4).map_err(e)? == b"bye", "rank 2's message");
            let err = b
                .recv(2, 5)
                .err()
                .ok_or("recv from a closed rank succeeded")?;
            println!("{err}");
            ensure!(
                err.to_string().contains("rank 2 shut down its bootstrap"),
                "message: {err}"
            );
            let err = b
                .send(1, 6, b"anyone?")
                .err()
                .ok_or("send to a dead rank")?;
            println!("{err}");
            ensure!(err.to_string().contains("rank 1"), "message: {err}");
            let t = Instant::now();
            let err = b.all_gather(b"x").err().ok_or("all_gather without peers")?;
            println!("{err}");
            ensure!(
                t.elapsed() < Duration::from_secs(5),
                "all_gather failed after {:?}",
                t.elapsed()
            );
            ensure!(err.to_string().contains("rank 1"), "message: {err}");
            Ok(0)
        }
    }
}

// ---------------------------------------------------------------------------
// Multi-process tests

/// Runs `scenario` as a job of each of `sizes` processes (every rank started)
/// and expects every rank to pass.
fn expect_jobs_ok(scenario: &str, sizes: &[usize]) {
    for &size in sizes {
        let ranks: Vec<usize> = (0..size).collect();
        expect_all_ok(&run_job(scenario, size, &ranks, GENEROUS_MS));
    }
}

#[test]
fn all_gather_2_4_8_processes() {
    expect_jobs_ok("all_gather", &[2, 4, 8]);
}

#[test]
fn barrier_repeated_4_and_8_processes() {
    expect_jobs_ok("barrier", &[4, 8]);
}

#[test]
fn send_recv_ring_out_of_order_tags_2_4_8_processes() {
    expect_jobs_ok("ring", &[2, 4, 8]);
}

#[test]
fn large_message_round_trip() {
    expect_all_ok(&run_job("large", 2, &[0, 1], GENEROUS_MS));
}

#[test]
fn from_env_master_port_plus_one_with_run_id() {
    let port = free_port();
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", (port - 1).to_string()),
        (
            "TORCHELASTIC_RUN_ID",
            format!("test-{}", std::process::id()),
        ),
    ];
    expect_all_ok(&run_env_job("from_env", 2, &env));
}

#[test]
fn from_env_bootstrap_port_and_hostname() {
    let port = free_port();
    let env = [
        ("MASTER_ADDR", "localhost".to_string()),
        // Must not be read when MOELINK_BOOTSTRAP_PORT is set.
        ("MASTER_PORT", "not-a-port".to_string()),
        ("MOELINK_BOOTSTRAP_PORT", port.to_string()),
    ];
    expect_all_ok(&run_env_job("from_env", 4, &env));
}

#[test]
fn from_env_names_missing_or_bad_variables() {
    let full = |skip: &str| -> Vec<(&'static str, String)> {
        [
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]
        .into_iter()
        .filter(|(k, _)| *k != skip)
        .map(|(k, v)| (k, v.to_string()))
        .collect()
    };
    let mut cases: Vec<(Vec<(&str, String)>, String)> =
        ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
            .into_iter()
            .map(|var| (full(var), format!("environment variable {var} is not set")))
            .collect();
    let mut bad_rank = full("RANK");
    bad_rank.push(("RANK", "-1".into()));
    cases.push((bad_rank, "RANK=\"-1\" is not a non-negative integer".into()));
    let mut rank_too_big = full("RANK");
    rank_too_big.push(("RANK", "1".into()));
    cases.push((
        rank_too_big,
        "RANK=1 is out of range for WORLD_SIZE=1".into(),
    ));
    let mut last_port = full("MASTER_PORT");
    last_port.push(("MASTER_PORT", "65535".into()));
    cases.push((last_port, "set MOELINK_BOOTSTRAP_PORT".into()));
    let running: Vec<Running> = cases
        .iter()
        .enumerate()
        .map(|(i, (vars, expect))| {
            let mut env = vars.clone();
            env.push((EXPECT_ENV, expect.clone()));
            env.push((SIZE_ENV, "1".into()));
            env.push((TIMEOUT_ENV, "1000".into()));
            spawn_child("env_missing", i, &env)
        })
        .collect();
    expect_all_ok(&finish(running));
}

#[test]
fn join_times_out_naming_the_missing_rank() {
    let outcomes = run_job("join_timeout", 3, &[0, 1], 1500);
    expect_all_ok(&outcomes);
    assert!(
        outcomes[0].stdout.contains("rank 2 to join"),
        "{}",
        report(&outcomes)
    );
}

#[test]
fn recv_and_barrier_time_out_naming_peer_and_tag() {
    let outcomes = run_job("recv_timeout", 2, &[0, 1], GENEROUS_MS);
    expect_all_ok(&outcomes);
    assert!(
        outcomes[0]
            .stdout
            .contains("waiting for a message from rank 1 with tag 42"),
        "{}",
        report(&outcomes)
    );
}

#[test]
fn peer_death_fails_recv_promptly() {
    let outcomes = run_job("peer_death", 3, &[0, 1, 2], GENEROUS_MS);
    expect_codes(&outcomes, &[0, 7, 0]);
    assert!(
        outcomes[0].stdout.contains("CHILD-OK"),
        "{}",
        report(&outcomes)
    );
}

// ---------------------------------------------------------------------------
// In-process tests

/// Runs `f(rank)` for every rank of an in-process job on its own thread.
fn threads<T: Send + 'static>(
    size: usize,
    f: impl Fn(usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..size)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || f(r))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn in_process_job_and_prompt_drop() {
    let id = UniqueId::new(None).unwrap();
    let results = threads(3, move |rank| {
        let b = TcpBootstrap::new(&id, rank, 3, Duration::from_secs(10)).unwrap();
        let all = b.all_gather(&[rank as u8; 3]).unwrap();
        assert_eq!(all, vec![vec![0; 3], vec![1; 3], vec![2; 3]]);
        b.send((rank + 1) % 3, 11, &[rank as u8]).unwrap();
        assert_eq!(
            b.recv((rank + 2) % 3, 11).unwrap(),
            vec![((rank + 2) % 3) as u8]
        );
        b.barrier().unwrap();
        assert!(format!("{b:?}").contains(&format!("rank: {rank}")));
        let t = Instant::now();
        drop(b);
        t.elapsed()
    });
    for took in results {
        assert!(took < Duration::from_secs(1), "drop took {took:?}");
    }
}

#[test]
fn single_rank_job() {
    let id = UniqueId::new(None).unwrap();
    let b = TcpBootstrap::new(&id, 0, 1, Duration::from_millis(300)).unwrap();
    assert_eq!((b.rank(), b.size()), (0, 1));
    assert_eq!(b.all_gather(b"solo").unwrap(), vec![b"solo".to_vec()]);
    b.barrier().unwrap();
    b.send(0, 5, b"me").unwrap();
    assert_eq!(b.recv(0, 5).unwrap(), b"me");
    let err = b.recv(0, 5).unwrap_err();
    assert!(
        err.to_string()
            .contains("a message from rank 0 (itself) with tag 5"),
        "{err}"
    );
    assert_eq!(b.timeout(), Duration::from_millis(300));
    assert_eq!(b.root_addr(), id.addr());
}

#[test]
fn invalid_arguments_are_rejected() {
    let id = UniqueId::new(None).unwrap();
    let t = Duration::from_secs(1);
    let invalid = |r: comm::Result<TcpBootstrap>, name: &str| match r {
        Err(CommError::InvalidArgument { name: n, .. }) => assert_eq!(n, name),
        other => panic!("expected InvalidArgument({name}), got {other:?}"),
    };
    invalid(TcpBootstrap::new(&id, 0, 0, t), "size");
    invalid(TcpBootstrap::new(&id, 2, 2, t), "rank");
    invalid(TcpBootstrap::new(&id, 0, 1, Duration::ZERO), "timeout");

    let b = TcpBootstrap::new(&id, 0, 1, t).unwrap();
    let is_invalid = |r: comm::Result<()>, name: &str| {
        assert!(
            matches!(&r, Err(CommError::InvalidArgument { name: n, .. }) if *n == name),
            "{r:?}"
        )
    };
    is_invalid(b.send(1, 0, b""), "peer");
    is_invalid(b.recv(1, 0).map(drop), "peer");
    is_invalid(b.send(0, 1 << 63, b""), "tag");
    is_invalid(b.recv(0, u64::MAX).map(drop), "tag");
    is_invalid(b.set_timeout(Duration::ZERO), "timeout");
    b.send(0, TcpBootstrap::MAX_TAG, b"ok").unwrap();
    assert_eq!(b.recv(0, TcpBootstrap::MAX_TAG).unwrap(), b"ok");
}

#[test]
fn other_jobs_and_wrong_sizes_are_rejected() {
    let id = UniqueId::new(None).unwrap();
    let root_id = id.clone();
    let root = std::thread::spawn(move || {
        TcpBootstrap::new(&root_id, 0, 2, Duration::from_millis(1500)).unwrap_err()
    });
    let t = Instant::now();
    let impostor = UniqueId::from_parts(id.addr(), id.nonce() ^ 1).unwrap();
    let err = TcpBootstrap::new(&impostor, 1, 2, Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(&err, CommError::InvalidArgument { reason, .. } if reason.contains("different job")),
        "{err}"
    );
    let err = TcpBootstrap::new(&id, 1, 3, Duration::from_secs(10)).unwrap_err();
    assert!(
        err.to_string().contains("started with size 3") && err.to_string().contains("with size 2"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "rejections took {:?}",
        t.elapsed()
    );
    let err = root.join().unwrap();
    assert!(
        matches!(&err, CommError::Timeout { rank: 0, what, .. }
            if what == "rank 1 to join (1 of 2 ranks registered)"),
        "{err}"
    );
}

#[test]
fn member_times_out_when_no_root_listens() {
    let port = free_port();
    let id = UniqueId::from_parts(SocketAddr::from(([127, 0, 0, 1], port)), 1).unwrap();
    let t = Instant::now();
    let err = TcpBootstrap::new(&id, 1, 2, Duration::from_millis(400)).unwrap_err();
    assert!(
        t.elapsed() >= Duration::from_millis(390),
        "{:?}",
        t.elapsed()
    );
    let want = format!("the root (rank 0) at 127.0.0.1:{port} to accept registration");
    assert!(
        matches!(&err, CommError::Timeout { rank: 1, what, .. } if what.starts_with(&want)),
        "{err}"
    );
}

// ---------------------------------------------------------------------------
// UniqueId

#[test]
fn unique_id_round_trips() {
    let id = UniqueId::new(None).unwrap();
    let bytes = id.to_bytes();
    assert_eq!(bytes.len(), UniqueId::BYTES);
    let back = UniqueId::from_bytes(&bytes).unwrap();
    assert_eq!(back, id);
    assert_eq!((back.addr(), back.nonce()), (id.addr(), id.nonce()));
    assert!(id.addr().ip().is_loopback() && id.addr().port() != 0);

    let hex = id.to_string();
    assert_eq!(hex.len(), 2 * UniqueId::BYTES);
    assert_eq!(hex.parse::<UniqueId>().unwrap(), id);
    assert_eq!(format!(" {hex}\n").parse::<UniqueId>().unwrap(), id);

    let v6: SocketAddr = "[fe80::1:2:3]:4242".parse().unwrap();
    let id6 = UniqueId::from_parts(v6, u64::MAX).unwrap();
    assert_eq!(UniqueId::from_bytes(&id6.to_bytes()).unwrap(), id6);
    assert_eq!(id6.to_string().parse::<UniqueId>().unwrap(), id6);

    assert_ne!(UniqueId::new(None).unwrap().nonce(), id.nonce());
}

#[test]
fn unique_id_holds_its_port_until_rank_0_takes_it() {
    let id = UniqueId::new(None).unwrap();
    assert!(format!("{id:?}").contains("holds_listener: true"), "{id:?}");
    assert!(TcpListener::bind(id.addr()).is_err(), "the port is free");
    let copy = UniqueId::from_bytes(&id.to_bytes()).unwrap();
    assert!(format!("{copy:?}").contains("holds_listener: false"));
    let b = TcpBootstrap::new(&id, 0, 1, Duration::from_secs(1)).unwrap();
    assert!(
        format!("{id:?}").contains("holds_listener: false"),
        "{id:?}"
    );
    drop(b);
}

#[test]
fn unique_id_rejects_garbage() {
    let good = UniqueId::new(None).unwrap().to_bytes();
    let invalid = |bytes: &[u8], what: &str| match UniqueId::from_bytes(bytes) {
        Err(CommError::InvalidArgument { name: "id", reason }) => {
            assert!(reason.contains(what), "{reason:?} lacks {what:?}")
        }
        other => panic!("{bytes:?}: expected InvalidArgument(id), got {other:?}"),
    };
    invalid(&[], "got 0");
    invalid(&good[..31], "got 31");
    invalid(&[good.clone(), vec![0]].concat(), "got 33");
    invalid(&[0xa5; 32], "bad magic");
    let mut bad = good.clone();
    bad[4] = 99;
    invalid(&bad, "version 99");
    let mut bad = good.clone();
    bad[5] = 5; // address family
    invalid(&bad, "address");
    let mut bad = good.clone();
    bad[6..8].copy_from_slice(&[0, 0]); // port 0
    invalid(&bad, "port 0");
    let mut bad = good.clone();
    bad[20] = 1; // padding after an IPv4 address
    invalid(&bad, "address");

    for s in ["", "zz", &"0".repeat(63), &"g".repeat(64), &"0".repeat(66)] {
        assert!(
            matches!(
                s.parse::<UniqueId>(),
                Err(CommError::InvalidArgument { name: "id", .. })
            ),
            "{s:?} parsed"
        );
    }
    assert!(UniqueId::from_parts(SocketAddr::from(([127, 0, 0, 1], 0)), 1).is_err());
}

#[test]
fn types_are_send_sync_and_object_safe() {
    fn is<T: Send + Sync>() {}
    is::<TcpBootstrap>();
    is::<UniqueId>();
    let b: Box<dyn Bootstrap> = Box::new(
        TcpBootstrap::new(&UniqueId::new(None).unwrap(), 0, 1, Duration::from_secs(1)).unwrap(),
    );
    assert_eq!(b.size(), 1);
}
