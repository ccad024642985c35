//! Enforcement through the real binary: `install-enforcement` (the init
//! container's job) on temporary host directories, and the config's
//! `[enforcement]` checks as `check-config` reports them.

#![cfg(feature = "sim")]

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{BIN, real_shared_object};

fn install(from: &Path, to: &Path) -> Output {
    Command::new(BIN)
        .arg("install-enforcement")
        .arg("--from")
        .arg(from)
        .arg("--to")
        .arg(to)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn install_enforcement_puts_a_checked_library_in_place() {
    let host = tempfile::tempdir().unwrap();
    let to = host.path().join("usr/local/vgpu");
    let out = install(&real_shared_object(), &to);
    assert!(out.status.success(), "{}", stderr(&out));
    let dest = to.join("libvgpu.so");
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(real_shared_object()).unwrap()
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Replaced"));
    let again = install(&real_shared_object(), &to);
    assert!(String::from_utf8_lossy(&again.stdout).contains("Unchanged"));

    // Not a shared object: refused by name and reason, the old copy kept.
    let text = host.path().join("libvgpu.so.txt");
    std::fs::write(&text, "#!/bin/sh\n").unwrap();
    let out = install(&text, &to);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&*text.to_string_lossy()) && err.contains("not an ELF"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(real_shared_object()).unwrap()
    );
    assert_eq!(std::fs::read_dir(&to).unwrap().count(), 1, "a leftover");

    // A host directory that cannot be made: a clear error, nothing written.
    let blocked = host.path().join("blocked");
    std::fs::write(&blocked, "a file").unwrap();
    let out = install(&real_shared_object(), &blocked.join("vgpu"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("blocked"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&blocked).unwrap(), "a file");
}

#[test]
fn check_config_names_a_bad_enforcement_path() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let toml = support::mock_config(
        dir.path(),
        "[enforcement]\nmode = \"hami-core\"\ncontainer_library_path = \"/x/lib vgpu.so\"",
        &[("GPU-a", 1024)],
    );
    std::fs::write(&config, toml).unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("check-config")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("enforcement.container_library_path") && err.contains("ld.so.preload"),
        "{err}"
    );
}
