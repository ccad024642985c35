//! Both HTTP servers (the daemon's `/metrics` endpoint and the scheduler
//! extender) against clients that open connections and never finish a
//! request: the real binary's resident memory stays bounded while they are
//! open, `/healthz` still answers, and the open connections stay under the
//! cap. `HTTP_BOUNDS_CONNECTIONS` sets how many (2,000 by default; the
//! README's figure is 10,000); the figures are printed (`--nocapture`).

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gpu_sim::apiserver::ApiServerSim;
use support::*;

fn connections() -> usize {
    std::env::var("HTTP_BOUNDS_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// `n` connections to `addr`: every other one sends part of a request
/// head (4 KiB of a header that never ends), the rest send nothing.
fn flood(addr: &str, n: usize) -> Vec<TcpStream> {
    let partial = format!(
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nX-Slow: {}",
        "a".repeat(4096)
    );
    (0..n)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            if i % 2 == 0 {
                // The server may already have closed it (over the cap).
                let _ = s.write_all(partial.as_bytes());
            }
            s
        })
        .collect()
}

/// Floods `addr` (served by `pid`, capped at `cap` connections), checks
/// memory, descriptors and `/healthz`, and prints the figures.
fn holds_under_flood(name: &str, pid: u32, addr: &str, cap: usize) {
    let n = connections();
    // Warm up: the first requests allocate what every later one reuses.
    for _ in 0..20 {
        assert_eq!(http_get(addr, "/healthz").0, 200);
    }
    let before = rss_kib(pid);
    let (fds_before, _) = fds_and_threads(pid);
    let open = flood(addr, n);
    // Within the header timeout, once the server has taken every one off
    // its accept queue: the last ones are still open.
    let deadline = Instant::now() + WAIT;
    let accepted = poll_sync(deadline, || {
        listening_socket(pid).is_some_and(|(_, q)| q == 0)
    });
    assert!(accepted, "{name}: connections still queued");
    let with = rss_kib(pid);
    let (fds_with, _) = fds_and_threads(pid);
    // A new connection takes the place of an idle one: the probe answers.
    let t = Instant::now();
    let (code, body) = http_get(addr, "/healthz");
    let probe = t.elapsed();
    assert_eq!((code, body.as_str()), (200, "ok\n"), "{name}");
    drop(open);
    // The server sees them closed and closes its ends.
    let closed = poll_sync(Instant::now() + WAIT, || {
        fds_and_threads(pid).0 <= fds_before
    });
    assert!(closed, "{name}: {:?} descriptors", fds_and_threads(pid));
    let after = rss_kib(pid);
    let (fds_after, _) = fds_and_threads(pid);
    assert_eq!(http_get(addr, "/healthz").0, 200, "{name}");
    println!(
        "{name}: {n} slow-header/idle connections: RSS {} MiB before, {} MiB with them open, \
         {} MiB after; descriptors {fds_before} / {fds_with} / {fds_after}; \
         /healthz answered in {probe:?} while they were open",
        before / 1024,
        with / 1024,
        after / 1024,
    );
    assert!(
        with < 100 * 1024,
        "{name}: {with} KiB resident with {n} connections open"
    );
    // The cap holds: the server keeps at most `cap` of them.
    assert!(
        fds_with <= fds_before + cap + 8,
        "{name}: {fds_with} descriptors open (cap {cap}, {fds_before} before)"
    );
}

/// A connection that sends nothing, or stops halfway through its headers,
/// is closed once the header timeout passes.
fn closes_a_stalled_connection(addr: &str, timeout: Duration) {
    for partial in ["", "GET /healthz HTTP/1.1\r\nHost: x\r\n"] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(partial.as_bytes()).unwrap();
        s.set_read_timeout(Some(timeout * 10)).unwrap();
        let t = Instant::now();
        let mut rest = Vec::new();
        // EOF (or a reset) ends the read; a timeout error would mean the
        // server kept it open.
        match s.read_to_end(&mut rest) {
            Ok(_) => {}
            Err(e) => assert_eq!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset,
                "{partial:?}: {e}"
            ),
        }
        assert!(
            t.elapsed() < timeout * 10,
            "{partial:?}: still open after {:?}",
            t.elapsed()
        );
    }
}

#[test]
fn the_metrics_endpoint_holds_under_slow_and_idle_connections() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(
        dir.path(),
        "[http]\nheader_timeout_ms = 2000\nmax_connections = 32\n",
        &[("GPU-aaaaaaaa-0000-4000-8000-000000000001", 4096)],
    );
    let daemon = Daemon::start(&toml);
    let addr = http_addr(&daemon);
    holds_under_flood("daemon", daemon.child.id(), &addr, 32);
    closes_a_stalled_connection(&addr, Duration::from_millis(2000));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_extender_holds_under_slow_and_idle_connections() {
    let sim = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig).unwrap();
    let (extender, url) = start_extender_with(
        &kubeconfig,
        "[extender.http]\nheader_timeout_ms = 2000\nmax_connections = 32\n\
         max_body_bytes = 65536\n",
    );
    let addr = url.trim_start_matches("http://").to_owned();
    let pid = extender.child.id();
    let a = addr.clone();
    tokio::task::spawn_blocking(move || {
        holds_under_flood("extender", pid, &a, 32);
        closes_a_stalled_connection(&a, Duration::from_millis(2000));
        // A filter body over max_body_bytes is refused before decoding.
        let mut s = TcpStream::connect(&a).unwrap();
        let body = format!(
            "{{\"Pod\":null,\"NodeNames\":[\"{}\"]}}",
            "n".repeat(70_000)
        );
        write!(
            s,
            "POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    })
    .await
    .unwrap();
}
