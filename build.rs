//! Stamps the build with its git revision (`GIT_REVISION`, "unknown"
//! outside a git checkout) and compiles the kubelet's v1beta1 device-plugin API with protox (pure Rust),
//! so a fresh machine needs no system `protoc`.
//!
//! Two passes over the same file:
//! - `wire/`: every message, both clients and servers. The kubelet side (the
//!   simulator, `inspect`, tests) and the plugin's registration client use it.
//! - `plugin/`: only the DevicePlugin server, with every message taken from
//!   the first pass except the two that carry every device ID: the
//!   `ListAndWatchResponse` is the plugin's own lazily encoded device list,
//!   and the `PreferredAllocationRequest` is decoded into one buffer. Either
//!   would otherwise be 160,000 heap strings on a node of two 80 GB GPUs.
//!   The `AllocateRequest` is decoded the same way, within bounds, so a
//!   flood of tiny container requests cannot cost memory before it is
//!   refused.
use std::path::{Path, PathBuf};
use std::process::Command;

/// `git <args>`'s output, None when git or the repository is missing.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The short revision of HEAD. Rebuilt when HEAD moves (a checkout) or the
/// branch it names moves (a commit); in a worktree both live outside `.git`.
fn git_revision() -> String {
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
        watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    }
    // A path that does not exist would make cargo rebuild every time.
    for path in watched.into_iter().flatten() {
        if Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/api.proto");
    println!("cargo:rustc-env=GIT_REVISION={}", git_revision());
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let fds = protox::compile(["proto/api.proto"], ["proto"])?;

    let wire = out.join("wire");
    std::fs::create_dir_all(&wire)?;
    tonic_prost_build::configure()
        .out_dir(&wire)
        .compile_fds(fds.clone())?;

    let plugin = out.join("plugin");
    std::fs::create_dir_all(&plugin)?;
    tonic_prost_build::configure()
        .out_dir(&plugin)
        .build_client(false)
        .extern_path(
            ".v1beta1.ListAndWatchResponse",
            "crate::plugin::codec::DeviceListMessage",
        )
        .extern_path(
            ".v1beta1.PreferredAllocationRequest",
            "crate::plugin::codec::PreferredRequest",
        )
        .extern_path(
            ".v1beta1.AllocateRequest",
            "crate::plugin::codec::AllocateIdsRequest",
        )
        .extern_path(".v1beta1", "crate::api")
        .compile_fds(fds)?;
    Ok(())
}
