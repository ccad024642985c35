//! Test support: the daemon in-process ([`App`]) or, where the process is
//! what a test is about, the real binary as a child process ([`Daemon`]),
//! in a temporary device-plugin directory beside gpu-sim's kubelet
//! stand-in; and waits on the state they serve.

#![allow(dead_code, unused_imports)] // each test file uses its own part of this module

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

mod app;
pub mod kube;

pub use app::{App, Observed, Start, get_until};
pub use gpu_device_plugin::node::app::Reloaded;

pub use gpu_sim::apiserver::PodContainer;
pub use gpu_sim::kubelet::{KubeletSim, ResourceView, plugin_sockets};
use gpu_sim::scheduler::{ExtenderConfig, SchedulerConfig, SchedulerSim};

pub const BIN: &str = env!("CARGO_BIN_EXE_gpu-device-plugin");
pub const WAIT: Duration = Duration::from_secs(20);

/// A mock config of `gpus` (uuid, MiB) in `dir`, as TOML. Pod matching and
/// the config file watch are off unless `extra` sets them: tests that
/// rewrite the file in place and send SIGHUP count one reload each.
pub fn mock_config(dir: &Path, extra: &str, gpus: &[(&str, u64)]) -> String {
    let off = |key: &str| {
        if extra.contains(key) {
            String::new()
        } else {
            format!("{key} = false\n")
        }
    };
    let (matching, watch) = (off("pod_matching"), off("watch_config"));
    let mut toml = format!(
        "device_plugin_dir = {:?}\n{matching}{watch}http_listen = \"127.0.0.1:0\"\n{extra}\n[devices]\nbackend = \"mock\"\n",
        dir.display().to_string()
    );
    for (uuid, mib) in gpus {
        toml.push_str(&format!(
            "[[devices.mock]]\nuuid = \"{uuid}\"\nmemory_mib = {mib}\n"
        ));
    }
    toml
}

/// The `extra` of [`mock_config`] for pod matching on node `node` against
/// the API server `kubeconfig` reaches: what the binary would take from
/// `$KUBECONFIG`, in the config (the environment is the whole test
/// process's). It opens `[matcher]`: more of that section may follow.
pub fn matching(node: &str, kubeconfig: &Path) -> String {
    format!(
        "pod_matching = true\nnode_name = \"{node}\"\n[matcher]\nkubeconfig = {:?}\n",
        kubeconfig.display().to_string()
    )
}

pub struct Daemon {
    pub child: Child,
    pub log: PathBuf,
    pub config: PathBuf,
    /// Config and log live apart from the device-plugin directory, which a
    /// kubelet restart wipes.
    _files: tempfile::TempDir,
}

impl Daemon {
    /// Starts the binary on `toml`.
    pub fn start(toml: &str) -> Daemon {
        Daemon::start_env(toml, &[])
    }

    /// Starts the binary on `toml` with extra environment variables.
    pub fn start_env(toml: &str, env: &[(&str, &std::ffi::OsStr)]) -> Daemon {
        Daemon::start_command(&[], toml, env)
    }

    /// Starts the binary's subcommand `args` (none: the daemon) on `toml`
    /// with extra environment variables.
    pub fn start_command(args: &[&str], toml: &str, env: &[(&str, &std::ffi::OsStr)]) -> Daemon {
        let files = tempfile::tempdir().unwrap();
        let config = files.path().join("config.toml");
        std::fs::write(&config, toml).unwrap();
        Daemon::spawn(args, files, config, env)
    }

    /// Starts the binary on `toml` mounted as the kubelet mounts a
    /// ConfigMap: `config` is the `config.toml` symlink in the volume;
    /// [`gpu_sim::kubelet::swap_configmap`] on its directory
    /// edits it (version 1 is taken).
    pub fn start_configmap(toml: &str, env: &[(&str, &std::ffi::OsStr)]) -> Daemon {
        let files = tempfile::tempdir().unwrap();
        let volume = files.path().join("volume");
        std::fs::create_dir(&volume).unwrap();
        gpu_sim::kubelet::swap_configmap(&volume, 1, toml).unwrap();
        Daemon::spawn(&[], files, volume.join("config.toml"), env)
    }

    fn spawn(
        args: &[&str],
        files: tempfile::TempDir,
        config: PathBuf,
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Daemon {
        let log = files.path().join("daemon.log");
        let child = Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "info,gpu_device_plugin=debug")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Daemon {
            child,
            log,
            config,
            _files: files,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// Waits for the process to exit, killing it after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let mut status = None;
        let child = &mut self.child;
        if !poll_sync(Instant::now() + timeout, || {
            status = child.try_wait().unwrap();
            status.is_some()
        }) {
            let _ = self.child.kill();
        }
        status
    }

    /// The address the process listens on for TCP: its HTTP endpoint (the
    /// daemon) or the extender's, read from the kernel's socket table once
    /// it is bound.
    pub fn listening(&self) -> String {
        let pid = self.child.id();
        let mut found = None;
        let bound = poll_sync(Instant::now() + WAIT, || {
            found = listening_addr(pid);
            found.is_some()
        });
        assert!(
            bound,
            "pid {pid} listens on no TCP port:\n{}",
            self.log_text()
        );
        found.unwrap().to_string()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the binary to completion with `args`; returns (status, stdout, stderr).
pub fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// True when every name in `names` is registered, streaming and listing
/// `devices[i]` healthy devices.
pub fn all_listed<'a>(
    names: &'a [(&'a str, usize)],
) -> impl Fn(&std::collections::BTreeMap<String, ResourceView>) -> bool + 'a {
    move |s| {
        names.iter().all(|(n, count)| {
            s.get(*n)
                .is_some_and(|v| v.stream_open && v.devices == *count && v.healthy == *count)
        })
    }
}

/// The daemon in-process on `toml` beside a kubelet stand-in in `dir`.
pub async fn start_with_kubelet(dir: &Path, toml: &str) -> (App, KubeletSim) {
    let daemon = App::start(toml).await;
    let kubelet = KubeletSim::start(dir).unwrap();
    (daemon, kubelet)
}

/// [`start_with_kubelet`], once the kubelet lists every (resource,
/// devices) of `listed` healthy.
pub async fn start_listed(dir: &Path, toml: &str, listed: &[(&str, usize)]) -> (App, KubeletSim) {
    let (daemon, kubelet) = start_with_kubelet(dir, toml).await;
    expect_kubelet(&kubelet, &daemon, &listed, all_listed(listed)).await;
    (daemon, kubelet)
}

/// Waits until the kubelet's view satisfies `done`; fails showing `want`,
/// that view and the daemon.
pub async fn expect_kubelet(
    kubelet: &KubeletSim,
    daemon: &impl Observed,
    want: &dyn std::fmt::Debug,
    done: impl Fn(&std::collections::BTreeMap<String, ResourceView>) -> bool,
) {
    let ok = kubelet.wait_until(WAIT, done).await;
    assert!(
        ok,
        "want {want:?}\nkubelet: {:#?}\n{}",
        kubelet.snapshot(),
        daemon.shown()
    );
}

/// Resident memory of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Open file descriptors and threads of a process.
pub fn fds_and_threads(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    (fds, threads)
}

/// True when every `(name, registrations, healthy)` holds, streams open.
pub fn registered_times<'a>(
    want: &'a [(&'a str, u32, usize)],
) -> impl Fn(&std::collections::BTreeMap<String, ResourceView>) -> bool + 'a {
    move |s| {
        want.iter().all(|(n, regs, healthy)| {
            s.get(*n).is_some_and(|v| {
                v.stream_open
                    && v.registrations == *regs
                    && v.healthy == *healthy
                    && v.devices == *healthy
            })
        })
    }
}

/// The HTTP endpoint's address of `daemon`.
pub fn http_addr(daemon: &impl Observed) -> String {
    daemon.http_addr()
}

/// The IPv4 or IPv6 address a TCP socket of process `pid` listens on.
pub fn listening_addr(pid: u32) -> Option<std::net::SocketAddr> {
    listening_socket(pid).map(|(addr, _)| addr)
}

/// A TCP socket process `pid` listens on, from /proc (the sockets among
/// its descriptors, looked up in the kernel's table of its network
/// namespace): its address, and the connections waiting in its accept
/// queue.
pub fn listening_socket(pid: u32) -> Option<(std::net::SocketAddr, u64)> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    ["tcp", "tcp6"].iter().find_map(|table| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).ok()?;
        text.lines().skip(1).find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address st tx_queue:rx_queue ... inode; 0A: LISTEN,
            // whose rx_queue is its accept queue.
            if f.len() <= 9 || f[3] != "0A" || !inodes.contains(f[9]) {
                return None;
            }
            let queued = u64::from_str_radix(f[4].split_once(':')?.1, 16).ok()?;
            Some((proc_addr(f[1])?, queued))
        })
    })
}

/// `/proc/net/tcp{,6}`'s `HEX-IP:HEX-PORT`, the IP in the kernel's words.
fn proc_addr(field: &str) -> Option<std::net::SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(&ip[8 * i..8 * i + 8], 16).map(u32::from_be))
        .collect::<Result<_, _>>()
        .ok()?;
    let ip: std::net::IpAddr = match words[..] {
        [a] => std::net::Ipv4Addr::from(a.to_be_bytes()).into(),
        [a, b, c, d] => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].iter().enumerate() {
                bytes[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
            }
            std::net::Ipv6Addr::from(bytes).into()
        }
        _ => return None,
    };
    Some((ip, port).into())
}

/// The scheduler extender in-process on the API server `kubeconfig`
/// reaches, and its URL. It serves until the test's runtime ends; the
/// value returned holds its reflectors.
pub async fn start_extender(kubeconfig: &Path) -> (gpu_device_plugin::extender::Started, String) {
    let toml = extender_toml(kubeconfig, "127.0.0.1:0", "");
    let config: gpu_device_plugin::extender::ExtenderConfig =
        gpu_device_plugin::extender::ExtenderConfig::from_toml(&toml).unwrap();
    let started = gpu_device_plugin::extender::launch(&config).await.unwrap();
    let url = format!("http://{}", started.addr);
    (started, url)
}

/// The scheduler extender (the binary's subcommand), `extra` added to its
/// config, on the API server `kubeconfig` reaches, and its URL.
pub fn start_extender_with(kubeconfig: &Path, extra: &str) -> (Daemon, String) {
    start_extender_at(kubeconfig, "127.0.0.1:0", extra)
}

/// [`start_extender_with`] listening on `listen` (a restart takes the
/// address its scheduler already calls).
pub fn start_extender_at(kubeconfig: &Path, listen: &str, extra: &str) -> (Daemon, String) {
    let extender = Daemon::start_command(
        &["scheduler-extender"],
        &extender_toml(kubeconfig, listen, extra),
        &[],
    );
    let addr = extender.listening();
    (extender, format!("http://{addr}"))
}

fn extender_toml(kubeconfig: &Path, listen: &str, extra: &str) -> String {
    format!(
        "[extender]\nlisten = {listen:?}\nkubeconfig = {:?}\n{extra}",
        kubeconfig.display().to_string()
    )
}

/// The kube-scheduler stand-in calling the extender at `extender_url`,
/// retrying unschedulable pods quickly.
pub async fn start_scheduler(kubeconfig: &Path, extender_url: &str, seed: u64) -> SchedulerSim {
    let mut config = SchedulerConfig::shipped(extender_url);
    config.seed = Some(seed);
    config.initial_backoff = Duration::from_millis(100);
    config.max_backoff = Duration::from_secs(1);
    SchedulerSim::start(kubeconfig, config).await.unwrap()
}

/// A stand-in pod's container asking `wants` devices of gpu-memory,
/// gpu-core and gpu-count.
pub fn container(name: &str, init: bool, wants: [u64; 3]) -> PodContainer {
    PodContainer {
        name: name.into(),
        init,
        restartable: false,
        wants,
    }
}

/// A stand-in pod's sidecar: an init container with `restartPolicy:
/// Always`, asking `wants` devices.
pub fn sidecar(name: &str, wants: [u64; 3]) -> PodContainer {
    PodContainer {
        restartable: true,
        ..container(name, true, wants)
    }
}

/// A plain HTTP/1.1 GET; returns (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    try_http_get(addr, path).unwrap()
}

/// [`http_get`], an error where the server closed the connection without
/// an answer (as one at its connection cap does) or could not be reached.
pub fn try_http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Error, Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Error::other(format!("no HTTP status in {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

/// The value of one sample line in a Prometheus text body.
pub fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}

/// The value of `series` on `/metrics` at `addr` now.
pub fn metric(addr: &str, series: &str) -> Option<f64> {
    sample(&http_get(addr, "/metrics").1, series)
}

/// The pods the daemon's pod cache holds.
pub const POD_CACHE: &str = "gpu_device_plugin_pod_cache_pods";

/// Config reloads the daemon applied, and those it refused.
pub const RELOADS_APPLIED: &str = "gpu_device_plugin_config_reloads_total{result=\"applied\"}";
pub const RELOADS_REFUSED: &str = "gpu_device_plugin_config_reloads_total{result=\"refused\"}";

/// The SHA-256 of the config file serving now, from `/metrics`.
pub fn config_sha(addr: &str) -> String {
    let (_, m) = http_get(addr, "/metrics");
    let line = m
        .lines()
        .find(|l| l.starts_with("gpu_device_plugin_config_info{"))
        .unwrap_or_else(|| panic!("no config_info:\n{m}"));
    line.split('"').nth(1).unwrap().to_owned()
}

/// Polls `/metrics` until `series` reads `value`.
pub async fn wait_for_sample(addr: &str, series: &str, value: f64) {
    let m = std::cell::RefCell::new(String::new());
    poll_until(
        Instant::now() + WAIT,
        || {
            *m.borrow_mut() = http_get(addr, "/metrics").1;
            sample(&m.borrow(), series) == Some(value)
        },
        || format!("{series} never read {value}:\n{}", m.borrow()),
    )
    .await;
}

/// Polls `done` (blocking the thread) until it holds or `deadline`
/// passes; whether it held.
pub fn poll_sync(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Polls `done` until it holds; once `deadline` passes, panics with
/// `why()` (several waits of one test can share a deadline).
pub async fn poll_until(
    deadline: Instant,
    mut done: impl FnMut() -> bool,
    why: impl Fn() -> String,
) {
    poll_for(deadline, async || done().then_some(()), why).await
}

/// Polls `probe` until it answers Some, and returns that; once `deadline`
/// passes, panics with `why()`.
pub async fn poll_for<T>(
    deadline: Instant,
    probe: impl AsyncFnMut() -> Option<T>,
    why: impl Fn() -> String,
) -> T {
    match poll_within(deadline, probe).await {
        Some(found) => found,
        None => panic!("{}", why()),
    }
}

/// Polls `probe` until it answers Some, and returns that; None once
/// `deadline` passes. The one place async waits pause between looks.
pub async fn poll_within<T>(
    deadline: Instant,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    loop {
        if let Some(found) = probe().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real shared object for this host (for the enforcement library's ELF
/// check): the C library this process maps, wherever the distribution
/// keeps it.
pub fn real_shared_object() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
        .map(PathBuf::from)
        .expect("no libc mapped")
}

/// A small deterministic generator (no rand crate for the tests).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// DRA mode as an operator deploys it with kustomize, following the
/// README: an overlay of their own naming `deploy/` and the Component
/// `deploy/dra`. It cannot live in `deploy/` (kustomize refuses an overlay
/// inside the tree it takes) and the repository's top level is fixed, so
/// the tests write it under `target/`; the directory.
pub fn dra_overlay() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/dra-overlay");
    std::fs::create_dir_all(&dir).unwrap();
    let text = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
                resources: [../../deploy]\ncomponents: [../../deploy/dra]\n";
    // Test binaries run side by side: each writes the same text aside and
    // renames it into place.
    let file = tempfile::NamedTempFile::new_in(&dir).unwrap();
    std::fs::write(file.path(), text).unwrap();
    file.persist(dir.join("kustomization.yaml")).unwrap();
    dir
}

/// An IPv4 address of this host's own interfaces that is not loopback nor
/// link-local: what the API server's pod proxy agrees to dial. Panics when
/// there is none (a machine with no network interface up).
pub fn host_ip() -> std::net::IpAddr {
    let mut found = None;
    // SAFETY: getifaddrs fills a list that freeifaddrs frees; each entry
    // and its address are read while the list lives.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        assert_eq!(libc::getifaddrs(&mut list), 0, "getifaddrs failed");
        let mut at = list;
        while !at.is_null() && found.is_none() {
            let addr = (*at).ifa_addr;
            if !addr.is_null() && i32::from((*addr).sa_family) == libc::AF_INET {
                let v4 = &*(addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
                if !ip.is_loopback() && !ip.is_link_local() && !ip.is_unspecified() {
                    found = Some(ip);
                }
            }
            at = (*at).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    std::net::IpAddr::V4(found.expect("no IPv4 address other than loopback on this host"))
}
