//! The coordinator's HTTP server under a flood of slow clients (slowloris): it keeps
//! answering others, refuses connections past `--max-connections` at once instead of letting
//! them queue, and closes the slow ones when their request head is overdue.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rootrank_testkit::{Coordinator, Etcd};

/// A client that sends a request head one byte at a time and never finishes it. Returns
/// whether the server closed the connection before `give_up`.
fn slowloris(port: u16, give_up: Duration, started: Arc<AtomicUsize>) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return true;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
    let _ = s.write_all(b"GET /v1/groups HTTP/1.1\r\nHost: x\r\nX-Slow: ");
    started.fetch_add(1, Ordering::SeqCst);
    let end = Instant::now() + give_up;
    let mut buf = [0u8; 64];
    while Instant::now() < end {
        if s.write_all(b"a").is_err() {
            return true;
        }
        match s.read(&mut buf) {
            Ok(0) => return true, // closed by the server
            Ok(_) => return true, // an answer (e.g. 408) ends it too
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true, // reset
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    false
}

/// Whether the server has not closed `s` (nothing to read yet, no end of stream).
fn still_open(s: &TcpStream) -> bool {
    let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 16];
    matches!(
        (&*s).read(&mut buf),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut
    )
}

/// Whether a fresh connection is closed by the server before it answers anything.
fn refused_on_arrival(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return true;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut buf = [0u8; 256];
    !matches!(s.read(&mut buf), Ok(n) if n > 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cannot_starve_the_others() {
    let etcd = Etcd::start().unwrap();
    let coord = Coordinator::start(
        &etcd.endpoint(),
        &["--max-connections", "48", "--header-timeout-ms", "20000"],
    )
    .await
    .unwrap();
    let port = coord.port();

    // 40 slow clients, each given 90 s: the server must close every one of them first (at its
    // 20 s head deadline: long, so the bound is still full when it is checked on a busy machine).
    let started = Arc::new(AtomicUsize::new(0));
    let slow: Vec<_> = (0..40)
        .map(|_| {
            let started = started.clone();
            std::thread::spawn(move || slowloris(port, Duration::from_secs(90), started))
        })
        .collect();
    while started.load(Ordering::SeqCst) < 40 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Meanwhile everyone else is answered, each on a new connection.
    for _ in 0..20 {
        let (status, body) = coord.get("/v1/groups").await.unwrap();
        assert_eq!(status, 200, "{body}");
    }

    // Past the bound (40 slow + 8 held here = 48), a new connection is closed at once rather
    // than queued behind the slow ones. The server notices the closed connections of the
    // requests above a moment later, so a connection opened meanwhile may be refused in their
    // place: hold 8 that the server kept.
    let held = tokio::task::spawn_blocking(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            while held.len() < 8 {
                held.push(TcpStream::connect(("127.0.0.1", port)).unwrap());
            }
            // Kept means still open a while after arriving (a refusal closes it at once).
            std::thread::sleep(Duration::from_millis(200));
            held.retain(still_open);
            if held.len() == 8 {
                break;
            }
        }
        held
    })
    .await
    .unwrap();
    assert_eq!(held.len(), 8, "the server keeps connections up to its bound");
    let refused = tokio::task::spawn_blocking(move || (0..5).filter(|_| refused_on_arrival(port)).count())
        .await
        .unwrap();
    assert_eq!(refused, 5, "connections past --max-connections are closed on arrival");
    drop(held);

    // The slow clients are cut off by the head deadline (not by their own 90 s give-up).
    let closed = slow
        .into_iter()
        .map(|t| t.join())
        .filter(|r| matches!(r, Ok(true)))
        .count();
    assert_eq!(closed, 40, "the server closed every slow client");

    // And the server still answers, with the refusals counted.
    let (status, metrics) = coord.get("/metrics").await.unwrap();
    assert_eq!(status, 200);
    let text = metrics.as_str().unwrap_or_default().to_string();
    let refused_total: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("rootrank_http_connections_refused_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(refused_total >= 5.0, "refusals counted: {refused_total}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_of_any_size_are_taken_not_a_crash() {
    let etcd = Etcd::start().unwrap();
    let huge = u64::MAX.to_string();
    let coord = Coordinator::start(
        &etcd.endpoint(),
        &["--max-connections", &huge, "--max-long-polls", &huge],
    )
    .await
    .unwrap();
    let (status, _) = coord.get("/v1/rooms/1/verdict?wait_ms=10").await.unwrap();
    assert_eq!(status, 200);
}
