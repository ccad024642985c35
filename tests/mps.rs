//! The MPS backend against the stand-in control daemon
//! (`gpu_sim::mps_control`): a shared grant is an MPS client of its GPU's
//! control daemon, a whole GPU is not; a control daemon gone refuses shared
//! grants and makes the daemon unready until it is started again; a reload
//! switches backends. This binary is its own stand-in: run through a link
//! named `nvidia-cuda-mps-control`, it is the control binary.

mod support;

use std::path::{Path, PathBuf};
use std::time::Instant;

const STAND_IN: &str = "nvidia-cuda-mps-control";
const MEMORY: &str = "doslab.io/gpu-memory";
const CORE: &str = "doslab.io/gpu-core";
const COUNT: &str = "doslab.io/gpu-count";
const GPUS: [&str; 2] = ["GPU-a", "GPU-b"];

fn main() {
    let mut args = std::env::args();
    let me = args.next().unwrap_or_default();
    if Path::new(&me).file_name().is_some_and(|n| n == STAND_IN) {
        std::process::exit(gpu_sim::mps_control::main(&args.collect::<Vec<_>>()));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(shared_grants_are_mps_clients_and_fail_closed_without_their_daemon());
    eprintln!("test shared_grants_are_mps_clients_and_fail_closed_without_their_daemon ... ok");
}

/// The host side: the control binary (a link to this test) and the MPS
/// directories.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        let host = Host { dir };
        host.link_binary();
        host
    }

    fn binary(&self) -> PathBuf {
        self.dir.path().join(STAND_IN)
    }

    fn link_binary(&self) {
        let me = std::env::current_exe().unwrap();
        std::os::unix::fs::symlink(me, self.binary()).unwrap();
    }

    fn pipes(&self, gpu: &str) -> PathBuf {
        self.dir.path().join("pipe").join(gpu)
    }

    fn toml(&self, compute: &str) -> String {
        let p = |name: &str| self.dir.path().join(name).display().to_string();
        format!(
            "[health]\npoll_ms = 100\n[enforcement]\ncompute = \"{compute}\"\n\
             [enforcement.mps]\ncontrol_binary = {:?}\npipe_dir = {:?}\nlog_dir = {:?}\n\
             shm_dir = {:?}\n",
            self.binary().display().to_string(),
            p("pipe"),
            p("log"),
            p("shm"),
        )
    }

    /// The pid of `gpu`'s control daemon, from the file it writes.
    fn daemon_pid(&self, gpu: &str) -> Option<i32> {
        let text = std::fs::read_to_string(self.pipes(gpu).join(gpu_sim::mps_control::PID_FILE));
        text.ok()?.trim().parse().ok()
    }

    /// Ends every control daemon started (they detach, as the real ones).
    fn kill_daemons(&self) {
        for gpu in GPUS {
            if let Some(pid) = self.daemon_pid(gpu) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let _ = std::fs::remove_file(self.pipes(gpu).join(gpu_sim::mps_control::PID_FILE));
            }
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill_daemons();
    }
}

async fn shared_grants_are_mps_clients_and_fail_closed_without_their_daemon() {
    let host = Host::new();
    let dir = tempfile::tempdir().unwrap();
    let gpus: Vec<(&str, u64)> = GPUS.iter().map(|g| (*g, 1024)).collect();
    let toml = |compute| support::mock_config(dir.path(), &host.toml(compute), &gpus);
    let kubelet = support::KubeletSim::start(dir.path()).unwrap();
    let started = Instant::now();
    let daemon = support::App::start(&toml("mps")).await;
    let listed = support::all_listed(&[(MEMORY, 2048), (CORE, 200), (COUNT, 2)]);
    assert!(
        kubelet.wait_until(support::WAIT, listed).await,
        "{}",
        daemon.state()
    );
    daemon.ready().await;
    eprintln!(
        "both control daemons answering {:?} after the start",
        started.elapsed()
    );
    // One control daemon per GPU, each seeing its GPU alone.
    for gpu in GPUS {
        assert!(host.daemon_pid(gpu).is_some(), "{gpu}: no control daemon");
        let log = host.dir.path().join("log").join(gpu).join("control.log");
        assert_eq!(
            std::fs::read_to_string(log).unwrap(),
            format!("started for devices {gpu}\n")
        );
    }

    // A container asking 30 % and 4 MiB: one MPS client, capped by the
    // driver's envs, its GPU's pipe directory mounted.
    let grants = kubelet.admit(&[(CORE, 30), (MEMORY, 4)]).await.unwrap();
    let (core, memory) = (&grants[0].response, &grants[1].response);
    let gpu = core.envs["NVIDIA_VISIBLE_DEVICES"].clone();
    assert_eq!(core.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    assert_eq!(
        memory.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("{gpu}=4M")
    );
    for r in [core, memory] {
        assert_eq!(r.envs["CUDA_MPS_PIPE_DIRECTORY"], "/var/run/nvidia-mps");
        let pipe = r
            .mounts
            .iter()
            .find(|m| m.container_path == "/var/run/nvidia-mps");
        assert_eq!(
            pipe.map(|m| PathBuf::from(&m.host_path)),
            Some(host.pipes(&gpu))
        );
        assert!(r.mounts.iter().any(|m| m.container_path == "/dev/shm"));
    }
    // The control daemons die and cannot be started again (their binary
    // is gone): shared grants are refused with the reason, /readyz names
    // the part, the GPU granted whole stays served.
    std::fs::remove_file(host.binary()).unwrap();
    host.kill_daemons();
    let err = kubelet.admit(&[(CORE, 10)]).await.unwrap_err();
    assert!(err.contains(STAND_IN), "{err}");
    let (_, body) = daemon
        .readyz_until(|c, b| c == 503 && b.contains("mps control daemons"))
        .await;
    assert!(body.contains("GPU-"), "{body}");
    // /metrics says which: the control daemon of each GPU is down, and
    // the GPUs' backend is MPS.
    for gpu in GPUS {
        let up = format!("gpu_device_plugin_mps_control_daemon_up{{gpu=\"{gpu}\"}}");
        let backend =
            format!("gpu_device_plugin_gpu_backend_info{{gpu=\"{gpu}\",backend=\"mps\"}}");
        assert_eq!(daemon.metric(&up), Some(0.0), "{up}");
        assert_eq!(daemon.metric(&backend), Some(1.0), "{backend}");
    }
    // A whole GPU is its container's alone: no MPS client, so served.
    let whole = kubelet.admit(&[(COUNT, 1)]).await.unwrap();
    let r = &whole[0].response;
    assert!(r.mounts.is_empty(), "{r:?}");
    assert!(!r.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"));

    // The binary is back: the supervisor's next restart starts them again.
    host.link_binary();
    let back = Instant::now();
    daemon.ready().await;
    eprintln!(
        "control daemons restarted {:?} after the binary came back",
        back.elapsed()
    );
    assert!(GPUS.iter().all(|g| host.daemon_pid(g).is_some()));
    let up = format!(
        "gpu_device_plugin_mps_control_daemon_up{{gpu=\"{}\"}}",
        GPUS[0]
    );
    assert_eq!(daemon.metric(&up), Some(1.0), "{up}");
    let grants = kubelet.admit(&[(CORE, 10)]).await.unwrap();
    assert_eq!(
        grants[0].response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
        "10"
    );

    // Reload to no compute limit, then back: the envs follow the backend.
    for (n, (compute, mps)) in [("none", false), ("mps", true)].into_iter().enumerate() {
        daemon.rewrite(&toml(compute));
        let env = admit_after_reload(&kubelet, &daemon, n + 1).await;
        assert_eq!(env.as_deref(), mps.then_some("1"), "{compute}");
    }
}

/// After the daemon's `reloads`th reload: a 1 % grant's
/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (retried while its plugin comes
/// back; a refused grant takes nothing).
async fn admit_after_reload(
    kubelet: &support::KubeletSim,
    daemon: &support::App,
    reloads: usize,
) -> Option<String> {
    daemon
        .wait_for_sample(support::RELOADS_APPLIED, reloads as f64)
        .await;
    let granted = support::poll_for(
        Instant::now() + support::WAIT,
        async || kubelet.admit(&[(CORE, 1)]).await.ok(),
        || daemon.state(),
    )
    .await;
    granted[0]
        .response
        .envs
        .get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .cloned()
}
