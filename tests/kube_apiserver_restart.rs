//! After the real kube-apiserver restarts (tests/kube: a new one on the
//! same port and etcd), the daemon's pod cache and the extender's index
//! re-list promptly: both say not ready while their view is stale, both are
//! ready again within the 5 s of the API server answering, and a
//! GPU pod created right then is bound, admitted and runs with its grant.
//! The API server restarts ten times in a row first (about half a minute
//! down, with moments up between), as in a crash loop: long enough for
//! kube-runtime's default watch backoff, which only an arriving event
//! resets, to grow past the target, and long enough for a resumed watch to
//! meet `410 Expired`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::kube::*;

const NS: &str = "tenant";
const GPU: &str = "GPU-00000000-0000-4000-8000-000000000000";
/// The target: Allocate, filter and readiness right again within
/// this long of the API server answering. Asserted, as the target.
const RECOVERY: Duration = Duration::from_secs(5);
/// API server restarts in a row, the last one measured.
const RESTARTS: usize = 10;

/// `/readyz` of one component, sampled from a thread every 50 ms until
/// dropped.
struct ReadyzPoll {
    samples: Arc<std::sync::Mutex<Vec<(Instant, u16, String)>>>,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ReadyzPoll {
    fn start(addr: String) -> ReadyzPoll {
        let samples = Arc::<std::sync::Mutex<Vec<_>>>::default();
        let (stop, halt) = std::sync::mpsc::channel::<()>();
        let s = samples.clone();
        let thread = std::thread::spawn(move || {
            // A sample, then the next one 50 ms on, until told to stop.
            let every = Duration::from_millis(50);
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = {
                let (code, body) = support::http_get(&addr, "/readyz");
                s.lock().unwrap().push((Instant::now(), code, body));
                halt.recv_timeout(every)
            } {}
        });
        ReadyzPoll {
            samples,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Waits until the last sample is 200.
    async fn wait_ready(&self, what: &str) {
        let last = || self.samples.lock().unwrap().last().cloned();
        support::poll_for(
            Instant::now() + START,
            async || matches!(last(), Some((_, 200, _))).then_some(()),
            || format!("{what} never ready: {:?}", last()),
        )
        .await;
    }

    /// After `since`: the first not-ready sample (its body), and when the
    /// component was ready for good (the first 200 after the last other
    /// answer).
    fn outage(&self, since: Instant) -> (Option<String>, Option<Instant>) {
        let samples = self.samples.lock().unwrap();
        let after: Vec<_> = samples.iter().filter(|(t, ..)| *t >= since).collect();
        let first_down = after.iter().find(|(_, c, _)| *c != 200);
        let last_down = after.iter().rposition(|(_, c, _)| *c != 200);
        let back = last_down.and_then(|i| after.get(i + 1)).map(|(t, ..)| *t);
        (first_down.map(|(_, c, b)| format!("{c} {b}")), back)
    }
}

impl Drop for ReadyzPoll {
    fn drop(&mut self) {
        // The sender gone, the sampler's wait ends.
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn allocate_filter_and_readiness_recover_within_5s_of_an_apiserver_restart() {
    let cp = ControlPlane::start();
    let node = KubeNode::start(&cp, "node-0", &[(GPU, 16384)], "memory_unit_mib = 1024").await;
    namespace(&cp, NS);
    // Restarts back to back keep the API server down most of their span,
    // past the lease's renew deadline: an elected scheduler would exit,
    // for its Deployment to restart it, and nothing restarts it here.
    let sched = Scheduler::start_unelected(&cp);
    let client = cp.admin_client().await;
    let logs = || {
        format!(
            "--- daemon\n{}\n--- extender\n{}\n--- scheduler\n{}\n--- kubelet\n{}",
            node.daemon.log_text(),
            sched.extender.log_text(),
            sched.proc.log_text(),
            node.kubelet.log_text()
        )
    };
    let running =
        |p: &k8s_openapi::api::core::v1::Pod| phase(p) == "Running" || phase(p) == "Failed";

    create(&client, &gpu_pod(NS, "before", &[("main", [4, 20, 0])])).await;
    let p = wait_pod(&client, NS, "before", Duration::from_secs(60), running)
        .await
        .unwrap_or_else(|p| panic!("before never ran: {p:#?}\n{}", logs()));
    assert_eq!(phase(&p), "Running", "{p:#?}\n{}", logs());

    let daemon_addr = support::http_addr(&node.daemon);
    let daemon = ReadyzPoll::start(daemon_addr.clone());
    let extender = ReadyzPoll::start(sched.url.trim_start_matches("http://").to_owned());
    daemon.wait_ready("the daemon").await;
    extender.wait_ready("the extender").await;

    let killed = Instant::now();
    let mut answered = killed;
    for _ in 0..RESTARTS {
        answered = cp.restart_apiserver().await;
    }
    let binds = Bindings::watch(&client, NS);
    let created = create(&client, &gpu_pod(NS, "after", &[("main", [6, 30, 0])])).await;
    let ran = wait_pod(&client, NS, "after", Duration::from_secs(120), running)
        .await
        .unwrap_or_else(|p| panic!("after never ran: {p:#?}\n{}", logs()));
    let ran_at = Instant::now();
    assert_eq!(phase(&ran), "Running", "{ran:#?}\n{}", logs());
    let record = node.record(NS, "after").expect("the kubelet admitted it");
    let env = &container_envs(&record)["main"];
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], GPU, "{record:#}");
    assert_eq!(env["CUDA_DEVICE_MEMORY_LIMIT_0"], "6144m", "{record:#}");
    assert_eq!(env["CUDA_DEVICE_SM_LIMIT"], "30", "{record:#}");
    // The Allocate was answered right the first time: a cache current by
    // the time the kubelet asked, no Allocate refused. (When it asked
    // depends on the kubelet's own watch recovering; the figures below
    // show it.)
    let bound_at = binds.at("after").expect("the binding was seen");
    let (_, metrics) = support::http_get(&daemon_addr, "/metrics");
    let refused: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("gpu_device_plugin_rpc_failures_total{"))
        .filter(|l| l.contains("rpc=\"allocate\"") && !l.ends_with(" 0"))
        .collect();
    assert!(refused.is_empty(), "refused: {refused:#?}\n{}", logs());
    let log = node.daemon.log_text();

    // Settle, so a late flap would show as a later not-ready sample.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let secs = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    eprintln!(
        "{RESTARTS} API server restarts in {} (first kill → last answer); \
         create → bound {} (kube-scheduler's own recovery included), bound → Running {} \
         (the kubelet's)",
        secs(answered - killed),
        secs(bound_at - created),
        secs(ran_at.saturating_duration_since(bound_at))
    );
    for (what, poll) in [("daemon", &daemon), ("extender", &extender)] {
        let (down, back) = poll.outage(killed);
        let down = down.unwrap_or_else(|| panic!("the {what} never said not ready\n{}", logs()));
        let back = back.unwrap_or_else(|| panic!("the {what} never ready again\n{}", logs()));
        let late = back.saturating_duration_since(answered);
        // Ready again may come before the fixture saw the API server's own
        // /readyz answer: then it is "before".
        let when = match answered.checked_duration_since(back) {
            Some(early) => format!("{} before", secs(early)),
            None => format!("{} after", secs(late)),
        };
        eprintln!(
            "{what}: not ready ({}) until {when} the API server answered",
            down.trim()
        );
        assert!(
            late <= RECOVERY,
            "the {what} ready {late:?} after\n{}",
            logs()
        );
    }
    // Which errors the watches saw, by HTTP status (None: no answer); a
    // resumed watch on an expired resourceVersion gets 410.
    for (what, log) in [("daemon", log), ("extender", sched.extender.log_text())] {
        let mut codes = std::collections::BTreeMap::<&str, usize>::new();
        for l in log
            .lines()
            .filter(|l| l.contains("watch failed; listing again"))
        {
            let code = l.split(" code=").nth(1).and_then(|c| c.split(' ').next());
            *codes.entry(code.unwrap_or("?")).or_default() += 1;
        }
        eprintln!("{what} watch errors by status: {codes:?}");
    }
}
