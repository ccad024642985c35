//! The shipped alerts on Prometheus's own rule evaluation: every alert of
//! deploy/monitoring/prometheusrule.yaml, decoded strictly by
//! prometheus-operator's API types, against its unit tests
//! (tests/monitoring/rules.yaml, `promtool test rules`' format), through
//! the `monitoring` peer built from Prometheus's Go module. The dashboard's
//! queries run against a live daemon's scrapes in kube_cluster.

mod support;

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn the_shipped_alerts_fire_as_their_unit_tests_say() {
    let out = Command::new(support::kube::monitoring())
        .args([
            "rules",
            "--rule-file",
            "deploy/monitoring/prometheusrule.yaml",
        ])
        .args(["--tests", "tests/monitoring/rules.yaml"])
        .current_dir(ROOT)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    eprintln!("{report}");
    assert!(out.status.success(), "{report}\n{errors}");
    // One group per alert at least: each is tested (the peer fails an
    // untested one), and none was skipped.
    assert!(
        report.lines().filter(|l| l.ends_with(" ok")).count() >= 5,
        "{report}"
    );
}

/// A rule that does not hold fails: the peer is no rubber stamp.
#[test]
fn an_expectation_the_rules_do_not_meet_fails() {
    let tests = std::fs::read_to_string(Path::new(ROOT).join("tests/monitoring/rules.yaml"))
        .unwrap()
        .replace(
            "exp_labels: {severity: critical, node: n1, gpu: GPU-a}",
            "exp_labels: {severity: critical, node: n1, gpu: GPU-b}",
        );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, tests).unwrap();
    let out = Command::new(support::kube::monitoring())
        .args([
            "rules",
            "--rule-file",
            "deploy/monitoring/prometheusrule.yaml",
            "--tests",
        ])
        .arg(&file)
        .current_dir(ROOT)
        .output()
        .unwrap();
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        errors.contains("want") && errors.contains(r#"gpu="GPU-b""#),
        "{errors}"
    );
}
