//! The virtual node's flags, each also read from the environment, in groups: the upper
//! cluster, the lower cluster, the kubelet API, what travels with pods, and the shared
//! runtime's (clients, leader election, admin endpoint, logging).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use tensile_common::admin::AdminArgs;
use tensile_common::kubeconfig::{self, ClientArgs};
use tensile_common::leader::LeaderArgs;
use tensile_common::telemetry::LogArgs;

use crate::decide::{capacity, tokens};

/// Every flag of the virtual node, in the groups below.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "virtual-node",
    version,
    about = "Registers a lower cluster as one node of the upper cluster"
)]
pub struct Args {
    /// Name of the virtual node in the upper cluster.
    #[arg(long, env = "TENSILE_NODENAME", value_parser = parse_node_name)]
    pub nodename: String,
    /// Do not taint the node with virtual-kubelet.io/provider=tensile:NoSchedule.
    #[arg(long = "disable-taint", env = "TENSILE_DISABLE_TAINT")]
    pub disable_taint: bool,
    /// Extra node labels, `key=value,...`.
    #[arg(long = "node-labels", env = "TENSILE_NODE_LABELS", value_delimiter = ',', value_parser = tensile_common::names::parse_label)]
    pub node_labels: Vec<(String, String)>,
    /// Pod labels kept in the upper cluster only (comma-separated keys).
    #[arg(long = "ignore-labels", env = "TENSILE_IGNORE_LABELS", value_delimiter = ',')]
    pub ignore_labels: Vec<String>,
    /// The webhook's stash keys, each named by its file name (repeat the flag, or separate
    /// with commas; two during a rotation): only stashes signed for their pod with one of
    /// them are applied below. Without any, every stash is trusted, as written.
    #[arg(
        long = "stash-key-file",
        env = "TENSILE_STASH_KEY_FILE",
        value_delimiter = ','
    )]
    pub stash_key_file: Vec<PathBuf>,
    /// This lower cluster's pod overrides (YAML or JSON; docs/virtual-node.md): rules applied
    /// to every pod created below, and a StorageClass name map for claims. The file is
    /// followed; a change that fails its checks is refused, and the rules in force stay.
    #[arg(long = "overrides-file", env = "TENSILE_OVERRIDES_FILE")]
    pub overrides_file: Option<PathBuf>,
    /// Pods reconciled at once. Each reconcile mostly waits on the API, so a burst of
    /// thousands of pods needs many in flight (docs/virtual-node.md has the figures).
    #[arg(long = "pod-sync-workers", env = "TENSILE_POD_SYNC_WORKERS", default_value_t = 128,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub pod_sync_workers: u16,
    /// Threads that run the node's work. One carries about 350 pod arrivals a second and
    /// costs less CPU per pod than two, which hand work to each other and wake each other
    /// (docs/virtual-node.md has the figures); raise it for faster arrivals where the node
    /// has the cores.
    #[arg(long = "worker-threads", env = "TENSILE_WORKER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub worker_threads: u16,
    /// Seconds one reconcile of a pod (or one resync pass of copies or volumes) may take;
    /// past it the worker is freed and the pod retried, or the next pass begins.
    #[arg(long = "reconcile-timeout", env = "TENSILE_RECONCILE_TIMEOUT", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub reconcile_timeout: u64,
    #[command(flatten)]
    pub upper: UpperArgs,
    #[command(flatten)]
    pub lower: LowerArgs,
    #[command(flatten)]
    pub kubelet: KubeletArgs,
    #[command(flatten)]
    pub reflection: ReflectionArgs,
    #[command(flatten)]
    pub tokens: TokenArgs,
    #[command(flatten)]
    pub shape: capacity::ShapeArgs,
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(flatten)]
    pub leader: LeaderArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The upper cluster: where the node, its Lease and the pods' status are written.
#[derive(Clone, Debug, clap::Args)]
pub struct UpperArgs {
    /// Kubeconfig of the upper cluster; without it, the pod's service account (in-cluster).
    #[arg(long, env = "TENSILE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Sustained writes per second to the upper cluster (0: unlimited).
    #[arg(long = "upper-qps", env = "TENSILE_UPPER_QPS", default_value_t = 500)]
    pub upper_qps: u32,
    /// Burst of writes to the upper cluster.
    #[arg(long = "upper-burst", env = "TENSILE_UPPER_BURST", default_value_t = 1000)]
    pub upper_burst: u32,
    /// Id of the upper cluster in lower ownership marks (default: the upper kube-system
    /// namespace UID).
    #[arg(long = "cluster-id", env = "TENSILE_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// Who the node acts as upstream: `credential` (the kubeconfig's or the pod's
    /// ServiceAccount, authorised by RBAC) or `node` (`system:node:<nodename>`: a kubelet
    /// client certificate asked for with that credential through a CertificateSigningRequest
    /// and renewed at 80 % of its lifetime, confined by the Node authorizer like a kubelet).
    #[arg(long = "upper-identity", env = "TENSILE_UPPER_IDENTITY", value_enum, default_value_t = UpperIdentity::Credential)]
    pub identity: UpperIdentity,
    /// Seconds to wait for the node's client certificate to be issued.
    #[arg(long = "node-certificate-timeout", env = "TENSILE_NODE_CERTIFICATE_TIMEOUT", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub certificate_timeout: u64,
}

/// Who a virtual node acts as in the upper cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UpperIdentity {
    /// The configured credential.
    Credential,
    /// `system:node:<nodename>`, through a client certificate.
    Node,
}

/// The lower cluster: where pods and what travels with them are made.
#[derive(Clone, Debug, clap::Args)]
pub struct LowerArgs {
    /// Kubeconfig of the lower cluster.
    #[arg(long = "client-kubeconfig", env = "TENSILE_CLIENT_KUBECONFIG")]
    pub client_kubeconfig: PathBuf,
    /// Sustained writes per second to the lower cluster (0: unlimited).
    #[arg(long = "client-qps", env = "TENSILE_CLIENT_QPS", default_value_t = 500)]
    pub client_qps: u32,
    /// Burst of writes to the lower cluster.
    #[arg(long = "client-burst", env = "TENSILE_CLIENT_BURST", default_value_t = 1000)]
    pub client_burst: u32,
    /// Serve only these lower namespaces (comma-separated; empty: every namespace). The lower
    /// credential then needs Roles in them alone and nothing cluster-wide: pods of any other
    /// namespace are refused with the reason on the pod, namespaces are never made or
    /// deleted below, and the room shown is what the namespaces' ResourceQuotas leave
    /// (docs/virtual-node.md).
    #[arg(
        long = "lower-namespaces",
        env = "TENSILE_LOWER_NAMESPACES",
        value_delimiter = ','
    )]
    pub namespaces: Vec<String>,
}

impl LowerArgs {
    /// The lower namespaces read and written; an error for a scope that cannot work.
    pub fn scope(&self, gc_namespaces: bool) -> Result<tensile_common::cache::Namespaces, String> {
        let mut served: Vec<String> = self.namespaces.iter().map(|n| n.trim().to_owned()).collect();
        served.retain(|n| !n.is_empty());
        served.sort();
        served.dedup();
        if served.is_empty() {
            return Ok(tensile_common::cache::Namespaces::All);
        }
        if let Some(bad) = served.iter().find(|n| !tensile_common::names::is_dns_label(n)) {
            return Err(format!("--lower-namespaces: {bad:?} is not a namespace name"));
        }
        if gc_namespaces {
            return Err(
                "--gc-namespaces cannot be given with --lower-namespaces: the served namespaces \
                        are the lower admin's, never made or deleted by a virtual node"
                    .into(),
            );
        }
        Ok(tensile_common::cache::Namespaces::Only(served))
    }
}

/// The kubelet API the upper apiserver calls for `kubectl logs`.
#[derive(Clone, Debug, clap::Args)]
pub struct KubeletArgs {
    /// Port of the kubelet API (published in the node's daemonEndpoints).
    #[arg(long = "kubelet-port", env = "TENSILE_KUBELET_PORT", default_value_t = 10250)]
    pub kubelet_port: u16,
    /// The node's InternalIP: the upper apiserver must reach the kubelet port there.
    #[arg(long = "node-ip", env = "TENSILE_NODE_IP")]
    pub node_ip: IpAddr,
    /// Serving certificate of the kubelet API (PEM); self-signed when absent.
    #[arg(
        long = "tls-cert-file",
        env = "TENSILE_TLS_CERT_FILE",
        requires = "tls_private_key_file"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key of --tls-cert-file (PEM).
    #[arg(
        long = "tls-private-key-file",
        env = "TENSILE_TLS_PRIVATE_KEY_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_private_key_file: Option<PathBuf>,
    /// CA of the client certificates the upper apiserver presents to kubelets.
    #[arg(
        long = "client-verify-ca",
        env = "TENSILE_CLIENT_VERIFY_CA",
        conflicts_with = "no_verify_clients"
    )]
    pub client_verify_ca: Option<PathBuf>,
    /// Serve the kubelet API without authenticating callers.
    #[arg(long = "no-verify-clients", env = "TENSILE_NO_VERIFY_CLIENTS")]
    pub no_verify_clients: bool,
    /// How callers of the kubelet API are authorised: `webhook` (a SubjectAccessReview for
    /// `nodes/proxy` on the upper cluster, as the kubelet does) or `always-allow` (any
    /// authenticated caller).
    #[arg(long = "kubelet-authorization", env = "TENSILE_KUBELET_AUTHORIZATION", value_enum,
          default_value_t = KubeletAuthorization::Webhook)]
    pub authorization: KubeletAuthorization,
    /// Open connections of the kubelet API at most; at the cap the longest-idle one makes
    /// room.
    #[arg(long = "kubelet-max-connections", env = "TENSILE_KUBELET_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Seconds a kubelet API connection may stay open with no request in progress.
    #[arg(long = "kubelet-idle-timeout-seconds", env = "TENSILE_KUBELET_IDLE_TIMEOUT_SECONDS",
          default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_seconds: u64,
    /// Long-lived streams at once at most (exec, attach and port-forward sessions, followed
    /// logs); more are refused (503). Below --kubelet-max-connections, so that streams never
    /// take every connection.
    #[arg(long = "kubelet-max-stream-sessions", env = "TENSILE_KUBELET_MAX_STREAM_SESSIONS",
          default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_stream_sessions: u32,
    /// Of those, what the pods of one namespace may hold at once (at most all of them); more
    /// are refused (503), so one tenant keeps a share for the others.
    #[arg(long = "kubelet-max-stream-sessions-per-namespace", env = "TENSILE_KUBELET_MAX_STREAM_SESSIONS_PER_NAMESPACE",
          default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_stream_sessions_per_namespace: u32,
    /// Seconds an exec, attach or port-forward session may pass without a byte either way
    /// before it is closed (the kubelet's --streaming-connection-idle-timeout, 4 h).
    #[arg(long = "stream-idle-timeout-seconds", env = "TENSILE_STREAM_IDLE_TIMEOUT_SECONDS",
          default_value_t = 14400, value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_idle_timeout_seconds: u64,
}

impl KubeletArgs {
    /// Bounds that hold together: streams below the connections, else streams could take
    /// every one.
    pub fn check(&self) -> Result<(), String> {
        if self.max_stream_sessions >= self.max_connections {
            return Err(format!(
                "--kubelet-max-stream-sessions ({}) must be below --kubelet-max-connections ({}): \
                 streams would otherwise hold every connection of the kubelet API",
                self.max_stream_sessions, self.max_connections
            ));
        }
        Ok(())
    }
}

/// See [`KubeletArgs::authorization`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KubeletAuthorization {
    Webhook,
    AlwaysAllow,
}

/// What travels with pods, and what is collected below.
#[derive(Clone, Debug, clap::Args)]
pub struct ReflectionArgs {
    /// Seconds a ConfigMap or Secret copy stays below after the last pod referencing it
    /// went (absorbs rolling updates).
    #[arg(
        long = "copy-collection-delay",
        env = "TENSILE_COPY_COLLECTION_DELAY",
        default_value_t = 10
    )]
    pub copy_collection_delay: u64,
    /// Reads per second of the upper ConfigMaps and Secrets that pods bound here reference:
    /// each is read by name (nothing lists them), and re-read once a second while there are
    /// at most this many, less often in proportion beyond (docs/virtual-node.md).
    #[arg(
        long = "upper-reads-per-second",
        env = "TENSILE_UPPER_READS_PER_SECOND",
        default_value_t = 20,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub upper_reads_per_second: u32,
    /// Optional reflections, comma-separated: `ServiceControllers` copies the Services (and
    /// their Endpoints) of namespaces where this node runs pods into the lower cluster.
    #[arg(
        long = "enable-controllers",
        env = "TENSILE_ENABLE_CONTROLLERS",
        value_delimiter = ','
    )]
    pub enable_controllers: Vec<Controllers>,
    /// With ServiceControllers: also reflect kube-system's Services and `default/kubernetes`.
    #[arg(long = "reflect-system-services", env = "TENSILE_REFLECT_SYSTEM_SERVICES")]
    pub reflect_system_services: bool,
    /// Delete lower namespaces this node created once nothing is left in them.
    #[arg(long = "gc-namespaces", env = "TENSILE_GC_NAMESPACES")]
    pub gc_namespaces: bool,
    /// Lower namespaces that pods may share with what the lower cluster already has there,
    /// comma-separated (`*`: any). A namespace not listed that exists below without this
    /// upper cluster's mark is refused, with the reason on the pod.
    #[arg(
        long = "shared-namespaces",
        env = "TENSILE_SHARED_NAMESPACES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub shared_namespaces: Vec<String>,
    /// Run DaemonSet pods bound to the virtual node in the lower cluster.
    #[arg(long = "run-daemonset-pods", env = "TENSILE_RUN_DAEMONSET_PODS")]
    pub run_daemonset_pods: bool,
}

/// Upper service-account tokens for pods below ([`tokens`]).
#[derive(Clone, Debug, clap::Args)]
pub struct TokenArgs {
    /// Give a pod that mounts its service-account token upstream, below, tokens of the upper
    /// cluster for its upper ServiceAccount, bound to the upper pod and renewed at 80 % of
    /// their lifetime, and point its in-cluster clients at --upper-api-endpoint. Off: pods
    /// below get no token (docs/virtual-node.md, "Upper service-account tokens").
    #[arg(
        long = "upper-service-account-tokens",
        env = "TENSILE_UPPER_SERVICE_ACCOUNT_TOKENS",
        requires = "upper_api_endpoint"
    )]
    pub upper_tokens: bool,
    /// The upper apiserver as pods of the lower cluster reach it (`https://host[:port]`):
    /// their KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT.
    #[arg(long = "upper-api-endpoint", env = "TENSILE_UPPER_API_ENDPOINT")]
    pub upper_api_endpoint: Option<String>,
    /// The CA bundle (PEM) that endpoint's certificate verifies with, mounted as `ca.crt`
    /// (default: the upper kubeconfig's CA, or the in-cluster one).
    #[arg(long = "upper-api-ca-file", env = "TENSILE_UPPER_API_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Only pods of these namespaces get upper tokens (comma-separated; empty: every one but
    /// the --shared-namespaces, where others below could read the tokens).
    #[arg(
        long = "upper-token-namespaces",
        env = "TENSILE_UPPER_TOKEN_NAMESPACES",
        value_delimiter = ','
    )]
    pub token_namespaces: Vec<String>,
    /// Share of a token's lifetime after which it is renewed (tests shorten it).
    #[arg(
        long = "upper-token-renew-at",
        env = "TENSILE_UPPER_TOKEN_RENEW_AT",
        default_value_t = 0.8,
        hide = true
    )]
    pub renew_at: f64,
}

/// The CA bundle (PEM) of the upper cluster as its kubeconfig `kubeconfig` names it (the
/// in-cluster one without).
fn upper_ca(kubeconfig: Option<&Path>) -> Result<String, String> {
    const IN_CLUSTER: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
    let Some(path) = kubeconfig else {
        return std::fs::read_to_string(IN_CLUSTER).map_err(|e| format!("{IN_CLUSTER}: {e}"));
    };
    let config = kube::config::Kubeconfig::read_from(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let cluster =
        kubeconfig::cluster_of(&config, None).ok_or_else(|| format!("{}: no cluster", path.display()))?;
    let pem = kubeconfig::ca_pem(cluster)
        .map_err(|e| format!("{}: the cluster's CA: {e}", path.display()))?
        .ok_or_else(|| {
            format!(
                "{}: the cluster names no CA; give --upper-api-ca-file",
                path.display()
            )
        })?;
    String::from_utf8(pem).map_err(|e| format!("{}: the cluster's CA: {e}", path.display()))
}

impl TokenArgs {
    /// The mode's settings (`None`: off), or why they cannot be used.
    /// `shared`: the lower namespaces shared with others (`--shared-namespaces`); under a
    /// namespace scope (`scope`) the served namespaces are too: they are the lower cluster's
    /// users', who can read the Secrets there.
    pub fn settings(
        &self,
        upper_kubeconfig: Option<&Path>,
        shared: &[String],
        scope: &tensile_common::cache::Namespaces,
    ) -> Result<Option<tokens::Settings>, String> {
        if !self.upper_tokens {
            return Ok(None);
        }
        let endpoint = self
            .upper_api_endpoint
            .as_deref()
            .ok_or("--upper-service-account-tokens needs --upper-api-endpoint")?;
        let ca = match &self.ca_file {
            Some(file) => std::fs::read_to_string(file)
                .map_err(|e| format!("--upper-api-ca-file {}: {e}", file.display()))?,
            None => upper_ca(upper_kubeconfig)?,
        };
        let mut shared = shared.to_vec();
        if let tensile_common::cache::Namespaces::Only(served) = scope {
            shared.extend(served.iter().cloned());
        }
        tokens::Settings::new(endpoint, ca, self.token_namespaces.clone(), shared, self.renew_at).map(Some)
    }
}

/// Optional reflections (tensile-kube's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Controllers {
    /// Services and their Endpoints.
    #[value(name = "ServiceControllers")]
    Services,
}

impl Args {
    /// Every flag at its default (environment variables applied, as on the command line)
    /// for virtual node `nodename` at `node_ip`, of the upper cluster of `upper` (in-cluster
    /// when `None`) over the lower cluster of `lower`; the fields are then set as typed
    /// values.
    pub fn new(
        nodename: &str,
        node_ip: IpAddr,
        upper: Option<&Path>,
        lower: &Path,
    ) -> Result<Args, clap::Error> {
        let mut argv = vec![
            "virtual-node".into(),
            format!("--nodename={nodename}"),
            format!("--node-ip={node_ip}"),
            format!("--client-kubeconfig={}", lower.display()),
        ];
        argv.extend(upper.map(|u| format!("--kubeconfig={}", u.display())));
        <Args as clap::Parser>::try_parse_from(argv)
    }
}

fn parse_node_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part.len() <= 63
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a valid node name (a lowercase DNS subdomain)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_upper_tokens_go_to_no_namespace_others_share_below_and_under_a_scope_to_none() {
        use tensile_common::cache::Namespaces;
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let tokens = |listed: &[&str]| TokenArgs {
            upper_tokens: true,
            upper_api_endpoint: Some("https://upper.example:6443".into()),
            ca_file: Some(ca.clone()),
            token_namespaces: listed.iter().map(|s| (*s).to_owned()).collect(),
            renew_at: 0.8,
        };
        let shared = ["default".to_owned()];
        let all = tokens(&[])
            .settings(None, &shared, &Namespaces::All)
            .unwrap()
            .unwrap();
        assert!(all.applies("shop") && !all.applies("default"));
        // The served namespaces are the lower cluster's users': shared, so no token by default.
        let scope = Namespaces::Only(vec!["team-a".into(), "team-b".into()]);
        let scoped = tokens(&[]).settings(None, &shared, &scope).unwrap().unwrap();
        assert!(!scoped.applies("team-a") && !scoped.applies("team-b"));
        // An operator who lists a namespace means it.
        let listed = tokens(&["team-a"])
            .settings(None, &shared, &scope)
            .unwrap()
            .unwrap();
        assert!(listed.applies("team-a") && !listed.applies("team-b"));
    }

    #[test]
    fn a_namespace_scope_is_a_list_of_namespace_names_and_excludes_namespace_collection() {
        let lower = |list: &[&str]| LowerArgs {
            client_kubeconfig: "k".into(),
            client_qps: 1,
            client_burst: 1,
            namespaces: list.iter().map(|s| (*s).to_owned()).collect(),
        };
        assert_eq!(lower(&[]).scope(true), Ok(tensile_common::cache::Namespaces::All));
        assert_eq!(
            lower(&[" "]).scope(false),
            Ok(tensile_common::cache::Namespaces::All)
        );
        assert_eq!(
            lower(&["b", "a", "b"]).scope(false),
            Ok(tensile_common::cache::Namespaces::Only(vec![
                "a".into(),
                "b".into()
            ]))
        );
        for bad in ["Team", "a.b", "-a", "a_b"] {
            let e = lower(&[bad]).scope(false).unwrap_err();
            assert!(e.contains("is not a namespace name"), "{bad}: {e}");
        }
        let e = lower(&["a"]).scope(true).unwrap_err();
        assert!(
            e.contains("--gc-namespaces cannot be given with --lower-namespaces"),
            "{e}"
        );
    }
    use clap::Parser;

    #[test]
    fn flags_parse_and_bad_ones_are_named() {
        let args = Args::try_parse_from([
            "virtual-node",
            "--kubeconfig=/u",
            "--client-kubeconfig=/l",
            "--nodename=vn-a",
            "--node-ip=127.0.0.1",
            "--node-labels=zone=a,tier=x",
            "--ignore-labels=team,env",
            "--no-verify-clients",
        ])
        .unwrap();
        assert_eq!(args.nodename, "vn-a");
        assert_eq!(
            args.node_labels,
            vec![("zone".into(), "a".into()), ("tier".into(), "x".into())]
        );
        assert_eq!(args.ignore_labels, vec!["team", "env"]);
        for (bad, needle) in [
            (vec!["--nodename=Bad_Name"], "not a valid node name"),
            (vec!["--nodename=ok", "--node-ip=nope"], "nope"),
            (
                vec!["--nodename=ok", "--node-ip=127.0.0.1", "--node-labels=x"],
                "not key=value",
            ),
            (
                vec!["--nodename=ok", "--node-ip=127.0.0.1", "--pod-sync-workers=0"],
                "pod-sync-workers",
            ),
            (
                vec![
                    "--nodename=ok",
                    "--node-ip=127.0.0.1",
                    "--upper-service-account-tokens",
                ],
                "--upper-api-endpoint",
            ),
        ] {
            let mut argv = vec!["virtual-node", "--kubeconfig=/u", "--client-kubeconfig=/l"];
            argv.extend(bad);
            let err = Args::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
