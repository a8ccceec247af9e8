//! The `virtual-node` binary at its edge: bad input is a precise message and a non-zero exit.
//! (This test also makes `cargo test --workspace` build the binary the demo runs.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::process::{Command, Output};

fn virtual_node(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .args(args)
        .env_remove("TENSILE_KUBECONFIG")
        .env_remove("TENSILE_CLIENT_KUBECONFIG")
        .output()
        .unwrap()
}

#[test]
fn an_invalid_flag_is_named_and_exits_2() {
    let out = virtual_node(&[
        "--kubeconfig=/u",
        "--client-kubeconfig=/l",
        "--nodename=Not_A_Node",
        "--node-ip=127.0.0.1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--nodename") && stderr.contains("not a valid node name"),
        "{stderr}"
    );
}

#[test]
fn a_missing_kubeconfig_is_named_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("upper.kubeconfig");
    let out = virtual_node(&[
        &format!("--kubeconfig={}", missing.display()),
        "--client-kubeconfig=/nonexistent/lower.kubeconfig",
        "--nodename=lower-a",
        "--node-ip=127.0.0.1",
        "--no-verify-clients",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&missing.display().to_string()), "{stderr}");
}
