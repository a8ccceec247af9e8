//! docs/deploy.md's install, join and leave commands, run as written, in order, with the
//! real helm, tensilectl and kubectl, against an upper and a lower cluster of the test bed.
//! Only what a site supplies is the bed's: `values.yaml` (the webhook and descheduler off,
//! the bed runs no images), `lower-a.kubeconfig` (the lower admin's), kubectl's current
//! context (the upper admin's); and once `helm install` has run, the cluster controller and
//! its virtual nodes are started as the cluster's kubelets would start their pods.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::Path;
use std::time::Duration;

use tensile_e2e::chart;
use tensile_e2e::runner::VirtualNodeRunner;
use tensile_e2e::scene::{self, UpperAndLower};
use tensile_e2e::shared::Shared;

static BED: Shared<UpperAndLower> = Shared::new();

fn bed() -> &'static UpperAndLower {
    BED.bed(|| UpperAndLower::start("deploy-docs", "lower-a", scene::nodes("a", 1)))
}

/// The commands of the block that follows the marker comment, one per line (comments and
/// blank lines dropped).
fn documented_commands() -> Vec<String> {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy.md")).unwrap();
    let marker = "<!-- The commands below are run, in this order, by e2e/tests/deploy_docs.rs. -->";
    let after = docs.split_once(marker).expect("the marker in docs/deploy.md").1;
    let block = after
        .trim_start()
        .strip_prefix("```sh\n")
        .expect("a sh block right after the marker");
    let block = block.split_once("```").expect("the block's end").0;
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_documented_commands_install_join_show_and_leave_a_lower_cluster() {
    let bed = bed();
    let (up, low) = (&bed.upper, &bed.lower);
    let commands = documented_commands();
    assert!(
        commands.iter().any(|c| c.starts_with("tensilectl join"))
            && commands.iter().any(|c| c.starts_with("tensilectl leave")),
        "{commands:?}"
    );

    // The site's files, in a directory of its own, with the chart where the docs name it.
    let site = up.dir().join("site");
    let _ = std::fs::remove_dir_all(&site);
    std::fs::create_dir_all(&site).unwrap();
    std::os::unix::fs::symlink(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy"),
        site.join("deploy"),
    )
    .unwrap();
    std::fs::copy(low.kubeconfig(), site.join("lower-a.kubeconfig")).unwrap();
    std::fs::write(
        site.join("values.yaml"),
        "webhook: {enabled: false}\ndescheduler: {enabled: false}\n",
    )
    .unwrap();
    let helm = chart::helm_binary().unwrap();
    let tensilectl = tensile_e2e::bins::suite_binary("tensilectl").unwrap();
    // The commands' `kubectl` is the one of the upper cluster's version.
    let kubectl = tensile_e2e::kubectl::binary_for(up.kubeconfig());
    let path = format!(
        "{}:{}:{}:{}",
        kubectl.parent().unwrap().display(),
        helm.parent().unwrap().display(),
        tensilectl.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let helm_home = up.dir().join("helm");

    let before = tensile_e2e::kubectl::run(low.kubeconfig(), &["get", "namespaces", "-o", "name"]).await;
    let mut controller = None;
    let mut runner = None;
    for command in &commands {
        let out = tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", command])
            .current_dir(&site)
            .env("PATH", &path)
            .env("KUBECONFIG", up.kubeconfig())
            .env("HELM_CACHE_HOME", helm_home.join("cache"))
            .env("HELM_CONFIG_HOME", helm_home.join("config"))
            .env("HELM_DATA_HOME", helm_home.join("data"))
            .output()
            .await
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "`{command}` failed:\n{said}");
        eprintln!("$ {command}\n{said}");
        if command.starts_with("helm install") {
            // What the cluster's kubelets would now start: the controller, then the virtual
            // nodes it makes.
            controller = Some(
                chart::run_cluster_controller(up, "tensile", "tensile", &[])
                    .await
                    .unwrap(),
            );
            runner = Some(VirtualNodeRunner::start(up, "tensile").unwrap());
        }
        if command.starts_with("tensilectl join") {
            assert!(
                said.contains(&format!(
                    "lower-a node=lower-a ready=True version={} nodes=1",
                    low.version()
                )),
                "{said}"
            );
        }
        if command.starts_with("kubectl get lowerclusters") {
            let row: Vec<&str> = said
                .lines()
                .nth(1)
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            assert_eq!(
                &row[..5],
                ["lower-a", "lower-a", "True", low.version(), "1"],
                "{said}"
            );
        }
        if command.starts_with("tensilectl leave") {
            assert!(said.contains("lower-a has left"), "{said}");
        }
    }
    // Nothing of lower-a is left upstream, and its namespaces below are as they were.
    let node = up.kubectl(&["get", "node", "lower-a"]).await;
    assert!(!node.ok && node.stderr.contains("NotFound"), "{}", node.stdout);
    let left = up.kubectl(&["get", "lowerclusters", "-o", "name"]).await;
    assert!(left.ok && left.stdout.trim().is_empty(), "{}", left.stdout);
    tensile_e2e::wait::must(
        "lower-a's namespaces as before",
        Duration::from_secs(60),
        Duration::from_secs(1),
        || async {
            let now = tensile_e2e::kubectl::run(low.kubeconfig(), &["get", "namespaces", "-o", "name"]).await;
            if now.stdout == before.stdout {
                Ok(())
            } else {
                Err(now.stdout)
            }
        },
    )
    .await;
    if let Some(runner) = runner {
        runner.shutdown().await;
    }
    let mut controller = controller.expect("helm install ran");
    assert!(controller.exited().is_none(), "{}", controller.log_tail(3000));
}
