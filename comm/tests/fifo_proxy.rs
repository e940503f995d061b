//! CPU tests of the trigger FIFO and the proxy, with host threads as the
//! producers (the same algorithm GPU threads run; see fifo_device.cuh).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use comm::device_handles::{trigger_type as tt, ProxyTrigger};
use comm::fifo::Fifo;
use comm::proxy::testing::{fake_host_memory, TestConnection};
use comm::proxy::ProxyService;
use comm::CommError;

/// How long a proxy test waits for any one push or sync.
const T: Duration = Duration::from_secs(5);

fn data(payload: u64) -> ProxyTrigger {
    // size carries the payload: any value round-trips through the ring
    ProxyTrigger::data(tt::DATA, 1, 2, 3, 4, 5, payload & 0xFFFF_FFFF)
}

/// Asserts that the consumer finds no trigger at the ring's tail (`why` it should not).
fn assert_nothing_to_pop(fifo: &Fifo, why: &str) {
    assert!(fifo.consumer().unwrap().poll().is_none(), "{why}");
}

/// Pops everything, in order, from a single consumer thread until `n` triggers,
/// through a [`comm::fifo::FifoConsumer`] (batched tail publication),
/// publishing whenever the ring is empty, as the proxy does.
fn consume(fifo: &Fifo, n: usize, timeout: Duration) -> Vec<ProxyTrigger> {
    let start = Instant::now();
    let mut c = fifo.consumer().unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        assert!(
            start.elapsed() < timeout,
            "consumer got {} of {n}",
            out.len()
        );
        if let Some(t) = c.poll() {
            out.push(t);
            c.pop();
        } else {
            // What the proxy does on an empty ring: producers waiting for room see it.
            c.publish();
            thread::yield_now();
        }
    }
    out
}

/// One producer thread pushes 20 000 triggers through a ring of `size` while
/// this thread consumes them: they must arrive in order and leave the ring
/// empty. `sync`: the producer then waits until its last trigger is published
/// (the consumer publishes once it finds the ring empty).
fn single_producer_keeps_order(size: usize, sync: bool) {
    let fifo = Fifo::new(None, size, 0, 0).unwrap();
    let n = 20_000;
    thread::scope(|s| {
        s.spawn(|| {
            let p = fifo.host_producer().unwrap();
            let mut last = 0;
            for i in 0..n {
                last = p.push(data(i as u64 + 1), Duration::from_secs(10)).unwrap();
            }
            if sync {
                p.sync(last, Duration::from_secs(10)).unwrap();
            }
        });
        let got = consume(&fifo, n, Duration::from_secs(20));
        for (i, t) in got.iter().enumerate() {
            assert_eq!(*t, data(i as u64 + 1), "ring {size}: trigger {i}");
        }
    });
    assert_eq!(fifo.tail(), n as u64);
    assert_nothing_to_pop(&fifo, "ring must be empty after the last pop");
}

#[test]
fn single_producer_order_survives_wraparound() {
    single_producer_keeps_order(8, false);
}

#[test]
fn many_producers_each_keep_their_order() {
    let fifo = Fifo::new(None, 16, 0, 0).unwrap();
    let (producers, per) = (4u64, 5000u64);
    thread::scope(|s| {
        for id in 0..producers {
            let fifo = &fifo;
            s.spawn(move || {
                let p = fifo.host_producer().unwrap();
                for i in 0..per {
                    p.push(data(id << 24 | (i + 1)), Duration::from_secs(10))
                        .unwrap();
                }
            });
        }
        let got = consume(&fifo, (producers * per) as usize, Duration::from_secs(30));
        let mut last = vec![0u64; producers as usize];
        for t in got {
            let payload = t.fst & 0xFFFF_FFFF;
            let (id, seq) = ((payload >> 24) as usize, payload & 0xFF_FFFF);
            assert_eq!(seq, last[id] + 1, "producer {id}: {seq} after {}", last[id]);
            last[id] = seq;
        }
        assert!(last.iter().all(|&l| l == per));
    });
}

#[test]
fn full_ring_applies_back_pressure_then_recovers() {
    let fifo = Fifo::new(None, 4, 3, 9).unwrap();
    let p = fifo.host_producer().unwrap();
    for i in 0..4 {
        p.push(data(i + 1), Duration::from_millis(100)).unwrap();
    }
    let start = Instant::now();
    let err = p.push(data(5), Duration::from_millis(200)).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(200));
    match &err {
        CommError::Timeout { rank, what, .. } => {
            assert_eq!(*rank, 3);
            assert!(
                what.contains("free FIFO slot") && what.contains("FIFO 9"),
                "{what}"
            );
        }
        e => panic!("expected a timeout, got {e}"),
    }
    // The timed-out push still claimed position 4, which is never written: the
    // consumer gets the four earlier triggers and then nothing. A timeout is
    // fatal for a FIFO (documented in fifo_device.cuh); the error says so.
    let got = consume(&fifo, 4, Duration::from_secs(5));
    assert_eq!(got, (1..=4).map(data).collect::<Vec<_>>());
    let pos = p.push(data(6), Duration::from_secs(1)).unwrap();
    assert_eq!(pos, 5);
    thread::sleep(Duration::from_millis(20));
    assert_nothing_to_pop(&fifo, "position 4 was claimed but never written");
}

#[test]
fn sync_waits_until_popped() {
    let fifo = Fifo::new(None, 8, 0, 0).unwrap();
    let p = fifo.host_producer().unwrap();
    let pos = p.push(data(1), Duration::from_secs(1)).unwrap();
    assert!(
        p.sync(pos, Duration::from_millis(50)).is_err(),
        "not popped yet"
    );
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(Duration::from_millis(50));
            consume(&fifo, 1, Duration::from_secs(5));
        });
        p.sync(pos, Duration::from_secs(5)).unwrap();
    });
}

/// A started proxy of rank `rank` with a FIFO of `slots`, two memories of
/// `len` bytes (ids `local`, this rank's, and `remote`, rank 1's) and one
/// channel over `conn` whose signals go to offset `signal_offset` of rank 1's
/// `len` bytes: `(proxy, local, remote, channel)`.
fn started_proxy(
    rank: u32,
    slots: usize,
    len: u64,
    conn: Arc<TestConnection>,
    signal_offset: u64,
) -> (ProxyService, u32, u32, u32) {
    let mut proxy = ProxyService::new(rank as usize, None, slots, 0).unwrap();
    let local = proxy.add_memory(fake_host_memory(rank, len)).unwrap();
    let remote = proxy.add_memory(fake_host_memory(1, len)).unwrap();
    let semaphores = fake_host_memory(1, len);
    let ch = proxy.add_channel(conn, semaphores, signal_offset).unwrap();
    proxy.start().unwrap();
    (proxy, local, remote, ch)
}

/// The error a proxy's (or a pool's) `check` reports, asserted to name each
/// of `parts`.
fn check_error(check: Result<(), CommError>, parts: &[&str]) -> String {
    let err = check.unwrap_err().to_string();
    for part in parts {
        assert!(err.contains(part), "{err}");
    }
    err
}

/// [`started_proxy`] over a connection that records what it is asked to do.
fn recording_proxy(
    rank: u32,
    slots: usize,
    len: u64,
    signal_offset: u64,
) -> (Arc<TestConnection>, ProxyService, u32, u32, u32) {
    let rec = Arc::new(TestConnection::recording());
    let (proxy, local, remote, ch) = started_proxy(rank, slots, len, rec.clone(), signal_offset);
    (rec, proxy, local, remote, ch)
}

#[test]
fn proxy_decodes_and_performs_every_trigger_kind() {
    let (rec, proxy, local, remote, ch) = recording_proxy(0, 8, 1 << 20, 64);
    let p = proxy.fifo().host_producer().unwrap();
    let push = |tr| p.push(tr, T).unwrap();
    push(ProxyTrigger::data(
        tt::DATA,
        ch,
        remote,
        100,
        local,
        200,
        300,
    ));
    push(ProxyTrigger::data(
        tt::DATA | tt::SIGNAL,
        ch,
        remote,
        0,
        local,
        8,
        16,
    ));
    push(ProxyTrigger::data(tt::SIGNAL, ch, remote, 0, local, 0, 0));
    push(ProxyTrigger::atomic(tt::ATOMIC_ADD64, ch, remote, 24, -7));
    push(ProxyTrigger::atomic(tt::ATOMIC_ADD32, ch, remote, 36, 5));
    let last = push(ProxyTrigger::data(
        tt::DATA | tt::SIGNAL | tt::FLUSH,
        ch,
        remote,
        1,
        local,
        2,
        3,
    ));
    p.sync(last, T).unwrap();
    proxy.check().unwrap();
    assert_eq!(
        rec.ops(),
        [
            "write r1 +100 <- r0 +200 x300",
            "write r1 +0 <- r0 +8 x16",
            "signal r1 +64 = 1",
            "signal r1 +64 = 2",
            "atomic r1 +24 -7 U64",
            "atomic r1 +36 5 U32",
            "write r1 +1 <- r0 +2 x3",
            "signal r1 +64 = 3",
            "flush",
        ]
    );
    assert_eq!(proxy.processed(), 6);
    let st = proxy.channel_state(ch).unwrap();
    assert_eq!((st.handled, st.busy), (6, None));
    assert!(st.idle_ms.is_some_and(|ms| ms < 60_000), "{st:?}");
    assert_eq!(proxy.channel_state(ch + 1), None);
}

#[test]
fn proxy_reports_bad_triggers_and_keeps_popping() {
    let (rec, mut proxy, local, _, ch) = recording_proxy(2, 4, 64, 0);
    let p = proxy.fifo().host_producer().unwrap();
    p.push(ProxyTrigger::data(tt::DATA, 77, local, 0, local, 0, 8), T)
        .unwrap(); // unknown channel
    p.push(ProxyTrigger::data(tt::DATA, ch, 9, 0, local, 0, 8), T)
        .unwrap(); // unknown memory
    p.push(ProxyTrigger::data(tt::DATA, ch, local, 60, local, 0, 8), T)
        .unwrap(); // out of range
                   // More triggers than slots: the proxy must keep popping after errors.
    let mut last = 0;
    for _ in 0..10 {
        last = p
            .push(ProxyTrigger::data(tt::SIGNAL, ch, local, 0, local, 0, 0), T)
            .unwrap();
    }
    p.sync(last, T).unwrap();
    check_error(proxy.check(), &["rank 2", "unknown channel 77"]);
    assert_eq!(rec.ops().len(), 10, "the valid signals were all performed");
    // Failed triggers of a known channel count as handled too (unknown memory,
    // out of range), the one naming no channel does not.
    assert_eq!(proxy.channel_state(ch).map(|s| s.handled), Some(12));
    proxy.stop().unwrap();
}

#[test]
fn proxy_drives_issued_operations_to_completion_without_new_triggers() {
    // Its operations stay in flight until it has been asked 1000 times whether
    // they are (like a CUDA stream that only starts work the process drives).
    let conn = Arc::new(TestConnection::in_flight_for(1000));
    let (mut proxy, local, remote, ch) = started_proxy(0, 8, 64, conn.clone(), 0);
    let p = proxy.fifo().host_producer().unwrap();
    let last = p
        .push(
            ProxyTrigger::data(tt::DATA | tt::SIGNAL, ch, remote, 0, local, 0, 8),
            T,
        )
        .unwrap();
    p.sync(last, T).unwrap();
    // No trigger follows: the proxy alone must keep querying until the
    // operations report done, then stop querying.
    let start = Instant::now();
    while conn.polls() <= 1000 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the proxy stopped querying its in-flight channel after {} polls",
            conn.polls()
        );
        thread::yield_now();
    }
    thread::sleep(Duration::from_millis(50));
    let settled = conn.polls();
    thread::sleep(Duration::from_millis(50));
    assert_eq!(
        conn.polls(),
        settled,
        "a drained channel is not queried again"
    );
    proxy.check().unwrap();
    proxy.stop().unwrap();
}

#[test]
fn batched_consumer_keeps_order_through_wraparound_at_every_ring_size() {
    // Rings smaller than, equal to and larger than a publication batch.
    for size in [1, 3, 32, 33, 100] {
        single_producer_keeps_order(size, true);
    }
}

#[test]
fn batched_consumer_publishes_per_batch_and_on_demand() {
    let fifo = Fifo::new(None, 64, 0, 0).unwrap();
    let every = comm::fifo::TAIL_PUBLISH_EVERY;
    let p = fifo.host_producer().unwrap();
    let t = Duration::from_secs(1);
    for i in 0..every + 8 {
        p.push(data(i + 1), t).unwrap();
    }
    let mut c = fifo.consumer().unwrap();
    assert!(fifo.consumer().is_err(), "one consumer at a time");
    for _ in 0..every - 1 {
        assert!(c.poll().is_some());
        c.pop();
    }
    // Popped, not yet published: producers do not see it.
    assert_eq!((fifo.tail(), c.unpublished()), (0, every - 1));
    assert!(p.sync(0, Duration::from_millis(20)).is_err());
    c.pop();
    assert_eq!(fifo.tail(), every, "a full batch publishes");
    p.sync(every - 1, t).unwrap();
    assert_eq!(c.poll(), Some(data(every + 1)));
    c.pop();
    assert!(p.sync(every, Duration::from_millis(20)).is_err());
    c.publish();
    p.sync(every, t).unwrap();
    assert_eq!(c.unpublished(), 0);
    // Dropping publishes; the next consumer goes on where this one stopped.
    assert_eq!(c.poll(), Some(data(every + 2)));
    c.pop();
    drop(c);
    assert_eq!(fifo.tail(), every + 2);
    let mut c = fifo.consumer().unwrap();
    assert_eq!(c.poll(), Some(data(every + 3)));
    c.pop();
}

/// A connection whose flush waits (at most 5 s) until `open` is set, noting
/// each operation like a recording [`TestConnection`].
#[derive(Debug, Default)]
struct GatedFlush {
    open: std::sync::atomic::AtomicBool,
    ops: std::sync::Mutex<Vec<String>>,
}

impl GatedFlush {
    fn note(&self, op: String) {
        self.ops.lock().unwrap().push(op);
    }
}

impl comm::transport::Connection for GatedFlush {
    fn transport(&self) -> comm::transport::Transport {
        comm::transport::Transport::Ethernet
    }
    fn remote_rank(&self) -> usize {
        1
    }
    fn put(&self, p: comm::transport::Put<'_>) -> comm::Result<()> {
        self.note(format!("put {}", p.size));
        Ok(())
    }
    fn set(
        &self,
        _: &comm::registered_memory::RegisteredMemory,
        _: u64,
        v: u64,
    ) -> comm::Result<()> {
        self.note(format!("signal {v}"));
        Ok(())
    }
    fn add(&self, a: comm::transport::AtomicAdd<'_>) -> comm::Result<()> {
        self.note(format!("add {}", a.value));
        Ok(())
    }
    fn flush(&self, _: Duration) -> comm::Result<()> {
        let start = Instant::now();
        while !self.open.load(std::sync::atomic::Ordering::Acquire) {
            if start.elapsed() > Duration::from_secs(5) {
                return Err(comm::CommError::invalid("flush", "gate never opened"));
            }
            thread::yield_now();
        }
        self.note("flush".into());
        Ok(())
    }
}

#[test]
fn proxy_publishes_finished_triggers_before_a_flush_waits() {
    let conn = Arc::new(GatedFlush::default());
    let mut proxy = ProxyService::new(0, None, 64, 0).unwrap();
    let m = proxy.add_memory(fake_host_memory(0, 1 << 20)).unwrap();
    let ch = proxy
        .add_channel(conn.clone(), fake_host_memory(1, 64), 0)
        .unwrap();
    proxy.start().unwrap();
    let p = proxy.fifo().host_producer().unwrap();
    let mut before = 0;
    for i in 1..=3 {
        before = p
            .push(ProxyTrigger::data(tt::DATA, ch, m, 0, m, 0, i), T)
            .unwrap();
    }
    let flush = p
        .push(
            ProxyTrigger::data(tt::SIGNAL | tt::FLUSH, ch, m, 0, m, 0, 0),
            T,
        )
        .unwrap();
    // The flush is blocked; what came before it must be visible as done.
    p.sync(before, Duration::from_secs(2)).unwrap();
    assert!(p.sync(flush, Duration::from_millis(50)).is_err());
    conn.open.store(true, std::sync::atomic::Ordering::Release);
    p.sync(flush, T).unwrap();
    proxy.check().unwrap();
    assert_eq!(
        *conn.ops.lock().unwrap(),
        ["put 1", "put 2", "put 3", "signal 1", "flush"]
    );
    assert_eq!(proxy.processed(), 4);
    proxy.stop().unwrap();
}

#[test]
fn proxy_keeps_order_and_flushes_across_batches() {
    let (rec, mut proxy, local, remote, ch) = recording_proxy(0, 16, 1 << 20, 8);
    let p = proxy.fifo().host_producer().unwrap();
    let mut expected = Vec::new();
    let mut last = 0;
    let mut signals = 0;
    for i in 1..=1000u64 {
        let ty = if i % 7 == 0 {
            tt::DATA | tt::SIGNAL | tt::FLUSH
        } else {
            tt::DATA
        };
        last = p
            .push(ProxyTrigger::data(ty, ch, remote, i, local, 0, i), T)
            .unwrap();
        expected.push(format!("write r1 +{i} <- r0 +0 x{i}"));
        if i % 7 == 0 {
            signals += 1;
            expected.push(format!("signal r1 +8 = {signals}"));
            expected.push("flush".into());
        }
    }
    p.sync(last, T).unwrap();
    proxy.check().unwrap();
    assert_eq!(rec.ops(), expected);
    assert_eq!(proxy.processed(), 1000);
    assert_eq!(proxy.channel_state(ch).unwrap().handled, 1000);
    proxy.stop().unwrap();
}

#[test]
fn proxy_sees_memories_and_channels_added_while_running() {
    let (rec, mut proxy, local, remote, ch) = recording_proxy(0, 8, 1 << 20, 0);
    let p = proxy.fifo().host_producer().unwrap();
    // Memory 2 and channel 1 do not exist yet: errors, and popping goes on.
    p.push(ProxyTrigger::data(tt::DATA, ch, 2, 0, local, 0, 4), T)
        .unwrap();
    let pos = p
        .push(ProxyTrigger::data(tt::DATA, 1, remote, 0, local, 0, 4), T)
        .unwrap();
    p.sync(pos, T).unwrap();
    let err = check_error(proxy.check(), &["unknown memory id 2"]);
    let m2 = proxy.add_memory(fake_host_memory(1, 1 << 20)).unwrap();
    let rec2 = Arc::new(TestConnection::recording());
    let ch2 = proxy
        .add_channel(rec2.clone(), fake_host_memory(1, 64), 16)
        .unwrap();
    assert_eq!((m2, ch2), (2, 1));
    p.push(ProxyTrigger::data(tt::DATA, ch, m2, 8, local, 0, 4), T)
        .unwrap();
    p.push(ProxyTrigger::atomic(tt::ATOMIC_ADD64, ch2, m2, 16, 3), T)
        .unwrap();
    let pos = p
        .push(ProxyTrigger::data(tt::SIGNAL, ch2, m2, 0, local, 0, 0), T)
        .unwrap();
    p.sync(pos, T).unwrap();
    assert_eq!(rec.ops(), ["write r1 +8 <- r0 +0 x4"]);
    assert_eq!(rec2.ops(), ["atomic r1 +16 3 U64", "signal r1 +16 = 1"]);
    // The first error is kept.
    let again = proxy.check().unwrap_err().to_string();
    assert_eq!(again, err);
    proxy.stop().unwrap();
}

#[test]
fn pool_shards_channels_by_peer_and_keeps_each_channels_order() {
    use comm::proxy_pool::{Placement, PooledChannel, ProxyPool};
    let threads = 3;
    let mut pool = ProxyPool::new(0, None, threads, 16, 10, Placement::ByPeer).unwrap();
    let mems: Vec<(u32, u32)> = (0..threads)
        .map(|s| {
            let local = pool.add_memory(s, fake_host_memory(0, 1 << 20)).unwrap();
            let remote = pool.add_memory(s, fake_host_memory(1, 1 << 20)).unwrap();
            (local, remote)
        })
        .collect();
    let peers = 7;
    let conns: Vec<Arc<TestConnection>> = (0..peers)
        .map(|_| Arc::new(TestConnection::recording()))
        .collect();
    let chans: Vec<PooledChannel> = conns
        .iter()
        .enumerate()
        .map(|(peer, c)| {
            pool.add_channel(peer, c.clone(), fake_host_memory(1, 64), 0)
                .unwrap()
        })
        .collect();
    for (peer, c) in chans.iter().enumerate() {
        assert_eq!(c.service, peer % threads);
    }
    for s in 0..threads {
        assert_eq!(pool.fifo_handle(s).unwrap().id, 10 + s as u64);
    }
    pool.start().unwrap();
    let per = 300u64;
    let t = Duration::from_secs(10);
    // One producer per service, interleaving that service's channels.
    thread::scope(|scope| {
        for s in 0..threads {
            let (pool, chans, mems) = (&pool, &chans, &mems);
            scope.spawn(move || {
                let p = pool.service(s).fifo().host_producer().unwrap();
                let (local, remote) = mems[s];
                let mut last = 0;
                for i in 1..=per {
                    for c in chans.iter().filter(|c| c.service == s) {
                        let tr = ProxyTrigger::data(tt::DATA, c.channel, remote, i, local, 0, 1);
                        last = p.push(tr, t).unwrap();
                    }
                }
                p.sync(last, t).unwrap();
            });
        }
    });
    pool.check().unwrap();
    assert_eq!(pool.processed(), per * peers as u64);
    for (c, conn) in chans.iter().zip(&conns) {
        let expected: Vec<String> = (1..=per)
            .map(|i| format!("write r1 +{i} <- r0 +0 x1"))
            .collect();
        assert_eq!(conn.ops(), expected, "{c:?}");
        assert_eq!(pool.channel_state(*c).unwrap().handled, per);
    }
    // An error on one service is reported naming it.
    let p = pool.service(2).fifo().host_producer().unwrap();
    let pos = p
        .push(ProxyTrigger::data(tt::DATA, 99, 0, 0, 0, 0, 1), t)
        .unwrap();
    p.sync(pos, t).unwrap();
    check_error(pool.check(), &["service 2 of 3", "unknown channel 99"]);
    pool.stop().unwrap();
}
