//! One GPU's MPS control daemon, through `nvidia-cuda-mps-control`: `-d`
//! starts it (it detaches, so it outlives a restart of this daemon and its
//! clients keep their server), and the same binary without arguments is
//! its client, reading commands on stdin and answering on stdout. Each is
//! run with the GPU's own `CUDA_MPS_PIPE_DIRECTORY` (where the daemon and
//! its clients meet) and `CUDA_MPS_LOG_DIRECTORY`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::node::enforcement::MpsConfig;
use crate::node::enforcement::plan::gpu_dir;

/// How long one command may take; a control daemon that does not answer
/// within it is as good as gone.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
/// The command asked for health: harmless, and answered by the control
/// daemon itself (no server needed).
pub(crate) const HEALTH_COMMAND: &str = "get_default_active_thread_percentage";

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("cannot run {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot make MPS directory {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("MPS control daemon of {uuid} ({pipe_dir}): {command:?} {reason}")]
    Answer {
        uuid: String,
        pipe_dir: PathBuf,
        command: String,
        reason: String,
    },
}

/// One GPU's control daemon: its binary and directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Control {
    binary: PathBuf,
    uuid: String,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
}

impl Control {
    pub(crate) fn new(config: &MpsConfig, uuid: &str) -> Control {
        Control {
            binary: config.control_binary.clone(),
            uuid: uuid.to_owned(),
            pipe_dir: gpu_dir(&config.pipe_dir, uuid),
            log_dir: gpu_dir(&config.log_dir, uuid),
        }
    }

    pub(crate) fn uuid(&self) -> &str {
        &self.uuid
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn refused(&self, command: &str, reason: String) -> MpsError {
        MpsError::Answer {
            uuid: self.uuid.clone(),
            pipe_dir: self.pipe_dir.clone(),
            command: command.to_owned(),
            reason,
        }
    }

    /// Starts the control daemon (`-d`) for this GPU alone: it and the
    /// servers it starts see only this GPU (`CUDA_VISIBLE_DEVICES` by
    /// UUID, as NVIDIA advises over indices).
    pub(crate) fn start(&self) -> Result<(), MpsError> {
        for dir in [&self.pipe_dir, &self.log_dir] {
            make_dir(dir)?;
        }
        let mut c = self.command();
        c.arg("-d")
            .env("CUDA_VISIBLE_DEVICES", &self.uuid)
            .stdin(Stdio::null());
        self.run(c, "-d", None).map(drop)
    }

    /// Sends one command; its answer, trimmed.
    pub(crate) fn ask(&self, command: &str) -> Result<String, MpsError> {
        let mut c = self.command();
        c.stdin(Stdio::piped());
        self.run(c, command, Some(command))
    }

    /// Whether the control daemon answers, and answers as one does.
    pub(crate) fn ping(&self) -> Result<(), MpsError> {
        let answer = self.ask(HEALTH_COMMAND)?;
        match answer.parse::<f64>() {
            Ok(p) if (0.0..=100.0).contains(&p) => Ok(()),
            _ => Err(self.refused(HEALTH_COMMAND, format!("answered {answer:?}"))),
        }
    }

    /// Runs `c` (with `input` on stdin) to its end within the timeout.
    fn run(&self, mut c: Command, what: &str, input: Option<&str>) -> Result<String, MpsError> {
        let mut child = c.spawn().map_err(|source| MpsError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            // A daemon gone mid-write shows in the exit status below.
            let _ = stdin.write_all(format!("{input}\n").as_bytes());
        }
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let ms = ANSWER_TIMEOUT.as_millis();
                    return Err(self.refused(what, format!("got no answer within {ms} ms")));
                }
                Err(e) => return Err(self.refused(what, format!("cannot wait: {e}"))),
            }
        };
        let output = child
            .wait_with_output()
            .map_err(|e| self.refused(what, format!("cannot read its output: {e}")))?;
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_owned();
        if !status.success() {
            let said = [text(&output.stdout), text(&output.stderr)].join(" ");
            return Err(self.refused(what, format!("failed ({status}): {}", said.trim())));
        }
        Ok(text(&output.stdout))
    }
}

fn make_dir(path: &Path) -> Result<(), MpsError> {
    std::fs::create_dir_all(path).map_err(|source| MpsError::Dir {
        path: path.to_owned(),
        source,
    })
}
