//! Test helper: ranks as threads of one process, each with a real TCP bootstrap.

use std::sync::Arc;
use std::time::Duration;

use super::{Bootstrap, TcpBootstrap, UniqueId};

/// `size` ranks as threads, each with a real TCP bootstrap; `f(rank, boot)`,
/// results in rank order.
pub(crate) fn on_ranks<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<dyn Bootstrap>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let id = UniqueId::new(None).unwrap();
    let bytes = id.to_bytes();
    let f = Arc::new(f);
    let mut root = Some(id);
    let threads: Vec<_> = (0..size)
        .map(|r| {
            let id = match r {
                0 => root.take().unwrap(),
                _ => UniqueId::from_bytes(&bytes).unwrap(),
            };
            let f = f.clone();
            std::thread::spawn(move || {
                let boot: Arc<dyn Bootstrap> =
                    Arc::new(TcpBootstrap::new(&id, r, size, timeout).unwrap());
                f(r, boot)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
