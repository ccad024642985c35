//! Stamps the build with its git revision (`GIT_REVISION`, "unknown"
//! outside a git checkout) and compiles the kubelet's APIs with protox (pure
//! Rust), so a fresh machine needs no system `protoc`: the v1beta1
//! device-plugin API, and for DRA the plugin registration API, the DRA
//! plugin API v1 and v1beta1 and the device health API v1 and v1alpha1.
//!
//! The DRA protos are compiled once, clients and servers (`wire/`), except
//! v1beta1's service (`dra_v1beta1/`): it is built over v1's messages, which
//! are v1beta1's plus `Device.share_id` (field 5, which a v1beta1 kubelet
//! skips as unknown), so one implementation serves both versions. The
//! health API likewise: v1 into `health/`, v1alpha1's service (its file
//! holds only the service, over v1's messages) into `health_v1alpha1/`.
//!
//! Two passes over the device-plugin file:
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

/// Every proto file under `proto/`.
const PROTOS: [&str; 6] = [
    "api.proto",
    "pluginregistration.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "dra_health_v1.proto",
    "dra_health_v1alpha1.proto",
];

/// The DRA protos: everything into `wire/`, v1beta1's service over v1's
/// messages into `dra_v1beta1/`.
fn dra(out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let wire = out.join("wire");
    std::fs::create_dir_all(&wire)?;
    let fds = protox::compile(
        [
            "pluginregistration.proto",
            "dra_v1.proto",
            "dra_v1beta1.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .out_dir(&wire)
        .compile_fds(fds)?;
    let beta = out.join("dra_v1beta1");
    std::fs::create_dir_all(&beta)?;
    tonic_prost_build::configure()
        .out_dir(&beta)
        .build_client(false)
        .extern_path(
            ".k8s.io.kubelet.pkg.apis.dra.v1beta1",
            "crate::node::dra::proto::v1",
        )
        .compile_fds(protox::compile(["dra_v1beta1.proto"], ["proto"])?)?;
    let health = out.join("health");
    std::fs::create_dir_all(&health)?;
    tonic_prost_build::configure()
        .out_dir(&health)
        .compile_fds(protox::compile(["dra_health_v1.proto"], ["proto"])?)?;
    let alpha = out.join("health_v1alpha1");
    std::fs::create_dir_all(&alpha)?;
    tonic_prost_build::configure()
        .out_dir(&alpha)
        .build_client(false)
        .extern_path(".v1", "crate::node::dra::proto::health::v1")
        .compile_fds(protox::compile(["dra_health_v1alpha1.proto"], ["proto"])?)?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed=proto/{proto}");
    }
    println!("cargo:rustc-env=GIT_REVISION={}", git_revision());
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    dra(&out)?;
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
            "crate::node::plugin::codec::DeviceListMessage",
        )
        .extern_path(
            ".v1beta1.PreferredAllocationRequest",
            "crate::node::plugin::codec::PreferredRequest",
        )
        .extern_path(
            ".v1beta1.AllocateRequest",
            "crate::node::plugin::codec::AllocateIdsRequest",
        )
        .extern_path(".v1beta1", "crate::api")
        .compile_fds(fds)?;
    Ok(())
}
