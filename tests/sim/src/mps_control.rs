//! A stand-in `nvidia-cuda-mps-control` for machines without a GPU: the
//! same command line (`-d` starts a control daemon that detaches, `-f` one
//! in the foreground, no argument is a client reading commands on stdin),
//! the same environment (`CUDA_MPS_PIPE_DIRECTORY`,
//! `CUDA_MPS_LOG_DIRECTORY`, with NVIDIA's defaults), and as strict as the
//! real one for what the daemon uses: a second daemon on a pipe directory
//! is refused, a client finding no daemon fails, an unknown command or an
//! out-of-range percentage is refused. Its pipe protocol is its own (the
//! real one is NVIDIA's, and only the binary speaks it): one Unix socket,
//! `control`, in the pipe directory, one command per connection, answered
//! `ok` or `err` on the first line and the text after.
//!
//! A test runs it by calling [`main`] from a binary named
//! `nvidia-cuda-mps-control`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The socket's name in the pipe directory.
const SOCKET: &str = "control";
/// The pid file the real daemon writes in the pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

fn dir(env: &str, default: &str) -> PathBuf {
    std::env::var_os(env).map_or_else(|| default.into(), PathBuf::from)
}

fn pipe_dir() -> PathBuf {
    dir("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
}

fn log_dir() -> PathBuf {
    dir("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
}

/// Runs the stand-in with `args` (without the program name); its exit code.
pub fn main(args: &[String]) -> i32 {
    let pipes = pipe_dir();
    match args {
        [] => client(&pipes),
        [d] if d == "-d" => start(&pipes),
        [f] if f == "-f" => serve(&pipes),
        _ => {
            eprintln!("usage: nvidia-cuda-mps-control [-d | -f]");
            1
        }
    }
}

/// Sends `command` to the daemon on `pipes`: (refused, answer).
fn send(pipes: &Path, command: &str) -> std::io::Result<(bool, String)> {
    let mut s = UnixStream::connect(pipes.join(SOCKET))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    writeln!(s, "{command}")?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let (status, text) = answer.split_once('\n').unwrap_or((&answer, ""));
    Ok((status != "ok", text.to_owned()))
}

fn client(pipes: &Path) -> i32 {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { return 1 };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        match send(pipes, command) {
            Err(_) => {
                eprintln!("Cannot find MPS control daemon process");
                return 1;
            }
            Ok((refused, text)) => {
                if !text.is_empty() {
                    println!("{text}");
                }
                if refused {
                    return 1;
                }
            }
        }
    }
    0
}

/// Both directories must exist: the daemon makes them before `-d`.
fn check_dirs(pipes: &Path) -> Result<(), String> {
    for d in [pipes, &log_dir()] {
        if !d.is_dir() {
            return Err(format!("{} is not a directory", d.display()));
        }
    }
    Ok(())
}

fn start(pipes: &Path) -> i32 {
    if let Err(e) = check_dirs(pipes) {
        eprintln!("{e}");
        return 1;
    }
    if send(pipes, "get_default_active_thread_percentage").is_ok() {
        eprintln!("An instance of this daemon is already running");
        return 1;
    }
    let me = std::env::current_exe().expect("own path");
    let spawned = Command::new(me)
        .arg0("nvidia-cuda-mps-control")
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    if let Err(e) = spawned {
        eprintln!("cannot start the daemon: {e}");
        return 1;
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if send(pipes, "get_default_active_thread_percentage").is_ok() {
            return 0;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("the daemon did not come up");
    1
}

fn serve(pipes: &Path) -> i32 {
    if let Err(e) = check_dirs(pipes) {
        eprintln!("{e}");
        return 1;
    }
    let socket = pipes.join(SOCKET);
    let _ = std::fs::remove_file(&socket);
    let Ok(listener) = UnixListener::bind(&socket) else {
        return 1;
    };
    let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let _ = std::fs::write(pipes.join(PID_FILE), std::process::id().to_string());
    let _ = std::fs::write(
        log_dir().join("control.log"),
        format!("started for devices {devices}\n"),
    );
    let mut percentage = 100.0_f64;
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let (ok, text) = match words.as_slice() {
            ["get_default_active_thread_percentage"] => (true, format!("{percentage:.1}")),
            ["set_default_active_thread_percentage", p] => match p.parse::<f64>() {
                Ok(p) if p > 0.0 && p <= 100.0 => {
                    percentage = p;
                    (true, format!("{p:.1}"))
                }
                _ => (false, format!("Invalid percentage {p}")),
            },
            // No GPU, so no server was ever started.
            ["get_server_list"] => (true, String::new()),
            ["quit"] => {
                let _ = stream.write_all(b"ok\n");
                let _ = std::fs::remove_file(&socket);
                let _ = std::fs::remove_file(pipes.join(PID_FILE));
                return 0;
            }
            _ => (false, format!("Unrecognized command: {}", line.trim())),
        };
        let status = if ok { "ok" } else { "err" };
        let _ = write!(stream, "{status}\n{text}");
    }
    0
}
