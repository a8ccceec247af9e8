//! Assertions for end-to-end tests, phrased as a user at kubectl would check: each helper
//! panics with what kubectl said when the expectation fails.

use std::path::Path;
use std::time::Duration;

/// Runs kubectl and returns stdout; panics with kubectl's stderr on failure.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let out = crate::kubectl::run(kubeconfig, args).await;
    assert!(out.ok, "kubectl {args:?} failed: {}", out.stderr);
    out.stdout
}

/// `kubectl apply -f` of a manifest given as text.
pub async fn apply(kubeconfig: &Path, manifest: &str) {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("temporary directory: {e}"),
    };
    let path = dir.path().join("manifest.yaml");
    if let Err(e) = std::fs::write(&path, manifest) {
        panic!("writing {}: {e}", path.display());
    }
    kubectl(kubeconfig, &["apply", "-f", &path.display().to_string()]).await;
}

/// A Deployment of `replicas` pods pinned to virtual node `node` (its taint tolerated), with
/// an optional `clusterSelector` stash and extra pod annotations (`key: value, ...`).
pub fn deployment(
    ns: &str,
    name: &str,
    node: &str,
    replicas: u32,
    stash: Option<&str>,
    pod_annotations: &str,
) -> String {
    let stash = stash
        .map(|s| format!("clusterSelector: '{s}'"))
        .unwrap_or_default();
    let sep = if !stash.is_empty() && !pod_annotations.is_empty() {
        ", "
    } else {
        ""
    };
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {ns}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata:
      labels: {{app: {name}}}
      annotations: {{{stash}{sep}{pod_annotations}}}
    spec:
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      terminationGracePeriodSeconds: 5
      containers: [{{name: app, image: nginx}}]
"#
    )
}

/// Waits until `kubectl ARGS` prints exactly `want` (trimmed); panics with the last output.
pub async fn eventually(kubeconfig: &Path, what: &str, secs: u64, args: &[&str], want: &str) {
    crate::wait::must(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(300),
        || async {
            let out = crate::kubectl::run(kubeconfig, args).await;
            let got = out.stdout.trim().to_owned();
            if out.ok && got == want {
                Ok(())
            } else {
                Err(format!("{got:?} {}", out.stderr.trim()))
            }
        },
    )
    .await
}

/// Which namespaces a webhook registration sends pods from.
#[derive(Clone, Copy, Debug)]
pub enum Namespaces<'a> {
    /// Only namespaces labelled `tensile-e2e=<name>`, so tests sharing a cluster do not meet
    /// each other's webhooks.
    Labelled(&'a str),
    /// Every namespace but those labelled `tensile.io/webhook=disabled` (what an operator
    /// writes).
    AllButDisabled,
}

/// The MutatingWebhookConfiguration `name` for the webhook on `127.0.0.1:port`: opted-in
/// pods only, `failurePolicy: Fail`, from `namespaces`. Without `ca_pem` the webhook is
/// expected to fill in the `caBundle` itself.
pub fn webhook_registration(
    name: &str,
    port: u16,
    namespaces: Namespaces<'_>,
    ca_pem: Option<&str>,
) -> String {
    let pods = webhook_entry(
        "pods.tensile.io",
        r#"{operations: [CREATE], apiGroups: [""], apiVersions: [v1], resources: [pods], scope: Namespaced}"#,
        r#"objectSelector: {matchLabels: {virtual-pod: "true"}}"#,
        port,
        namespaces,
        ca_pem,
    );
    format!(
        r#"
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {{name: {name}}}
webhooks:
{pods}"#
    )
}

/// [`webhook_registration`] with the chart's second webhook: Jobs at CREATE whose pod
/// template opted in (the label `virtual-pod=true`, matched by the apiserver itself), so
/// the webhook can give them the disruption rule (`--job-disruption-rule`).
pub fn webhook_registration_with_jobs(
    name: &str,
    port: u16,
    namespaces: Namespaces<'_>,
    ca_pem: Option<&str>,
) -> String {
    let jobs = webhook_entry(
        "jobs.tensile.io",
        "{operations: [CREATE], apiGroups: [batch], apiVersions: [v1], resources: [jobs], scope: Namespaced}",
        r#"matchConditions:
  - name: pod-template-opted-in
    expression: "object.spec.template.metadata.?labels[?'virtual-pod'].orValue('') == 'true'""#,
        port,
        namespaces,
        ca_pem,
    );
    format!("{}{jobs}", webhook_registration(name, port, namespaces, ca_pem))
}

/// One webhook of a registration: `rule`, then `selects` (which objects of it are sent).
fn webhook_entry(
    name: &str,
    rule: &str,
    selects: &str,
    port: u16,
    namespaces: Namespaces<'_>,
    ca_pem: Option<&str>,
) -> String {
    use base64::Engine as _;
    let ca = ca_pem
        .map(|pem| {
            format!(
                ", caBundle: {}",
                base64::engine::general_purpose::STANDARD.encode(pem)
            )
        })
        .unwrap_or_default();
    let selector = match namespaces {
        Namespaces::Labelled(label) => format!("{{key: tensile-e2e, operator: In, values: [{label}]}}"),
        Namespaces::AllButDisabled => {
            "{key: tensile.io/webhook, operator: NotIn, values: [disabled]}".to_owned()
        }
    };
    format!(
        r#"- name: {name}
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: Fail
  reinvocationPolicy: Never
  timeoutSeconds: 5
  clientConfig: {{url: "https://127.0.0.1:{port}/mutate"{ca}}}
  rules: [{rule}]
  {selects}
  namespaceSelector:
    matchExpressions:
    - {selector}
"#
    )
}

/// Every object of the cluster of `kubeconfig`, of every kind it lists (events aside, which
/// outlive what they are about), as `kind namespace/name` (`<none>` for a cluster-wide one),
/// those `keep(kind, namespace, name)` keeps.
pub async fn listing(
    kubeconfig: &Path,
    keep: impl Fn(&str, &str, &str) -> bool,
) -> std::collections::BTreeSet<String> {
    let kinds = kubectl(kubeconfig, &["api-resources", "--verbs=list", "-o", "name"]).await;
    let kinds: Vec<&str> = kinds
        .lines()
        .filter(|k| {
            !k.is_empty() && *k != "events" && *k != "events.events.k8s.io" && *k != "componentstatuses"
        })
        .collect();
    let out = kubectl(
        kubeconfig,
        &[
            "get",
            &kinds.join(","),
            "-A",
            "--no-headers",
            "-o",
            "custom-columns=K:.kind,NS:.metadata.namespace,N:.metadata.name",
        ],
    )
    .await;
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3).then(|| (f[0], f[1], f[2]))
        })
        .filter(|(kind, ns, name)| keep(kind, ns, name))
        .map(|(kind, ns, name)| format!("{kind} {ns}/{name}"))
        .collect()
}

/// Asserts that the apiserver of `kubeconfig` refuses to change the virtual node name of
/// LowerCluster `name` (the definition's rule, once `status.nodeName` is set), saying why.
pub async fn node_name_change_refused(kubeconfig: &Path, name: &str) {
    let refused = crate::kubectl::run(
        kubeconfig,
        &[
            "patch",
            "lowercluster",
            name,
            "--type=merge",
            "-p",
            r#"{"spec":{"nodeName":"elsewhere"}}"#,
        ],
    )
    .await;
    assert!(
        !refused.ok && refused.stderr.contains("cannot change once the node is made"),
        "the virtual node's name is kept for life: {}",
        refused.stderr
    );
}
