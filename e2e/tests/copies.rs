//! What travels with a pod: ConfigMaps and Secrets copied into the lower cluster, end to end
//! on an upper cluster and a lower cluster with simulated nodes. Every assertion is what
//! kubectl shows in one of the clusters.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::Path;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};

use tensile_e2e::check::{apply, kubectl};
use tensile_e2e::free_port;
use tensile_e2e::in_process::VirtualNode;
use tensile_e2e::scene::{self, UpperAndLower};
use tensile_e2e::shared::Shared;
use tensile_virtual_node::{Args, Controllers};

static BED: Shared<UpperAndLower> = Shared::new();

fn bed() -> &'static UpperAndLower {
    BED.bed(|| UpperAndLower::start("copies", "lower", scene::nodes("n", 2)))
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

fn low() -> &'static Path {
    bed().lower.kubeconfig()
}

/// A virtual node over the lower cluster, Ready upstream, whose copies go 2 s after their
/// last pod.
async fn virtual_node(name: &str) -> VirtualNode {
    virtual_node_with(name, |_| {}).await
}

/// As [`virtual_node`], with `set` applied to its options.
async fn virtual_node_with(name: &str, set: impl FnOnce(&mut Args)) -> VirtualNode {
    let bed = bed();
    scene::ready_virtual_node(&bed.upper, name, &bed.lower, |args| {
        args.reflection.copy_collection_delay = 2;
        // Several tests make the lower namespace first, as a lower admin would, to put their
        // own objects in it.
        args.reflection.shared_namespaces = vec!["*".into()];
        set(args);
    })
    .await
}

/// A pod placed on `node` whose spec ends with `extra` (YAML at the spec's indentation).
fn pod(ns: &str, name: &str, node: &str, extra: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  terminationGracePeriodSeconds: 1
{extra}
"#
    )
}

/// `kubectl get` in the lower cluster: the output, or `None` when the object is not there.
async fn below(args: &[&str]) -> Option<String> {
    let out = tensile_e2e::kubectl::run(low(), args).await;
    if out.ok {
        Some(out.stdout)
    } else {
        assert!(
            out.stderr.contains("NotFound"),
            "kubectl {args:?}: {}",
            out.stderr
        );
        None
    }
}

async fn gone_below(ns: &str, kind: &str, name: &str, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while below(&["-n", ns, "get", kind, name]).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "{kind} {ns}/{name} still below after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A pod spec tail mounting claim `data` at `/data`.
const USES_DATA: &str = r#"  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
  containers: [{name: app, image: db, volumeMounts: [{name: data, mountPath: /data}]}]"#;

/// Storage for a 500Mi claim `data` in namespace `ns`. Below: class `class`, binding at once,
/// with one `capacity` volume `disk`. Upstream: class `class` for the virtual nodes'
/// provisioner, and the claim. Both classes allow expansion when `expandable`. Returns the
/// upper manifest (class and claim), which a test may apply again.
async fn data_claim(ns: &str, class: &str, disk: &str, capacity: &str, expandable: bool) -> String {
    let expansion = if expandable {
        ", allowVolumeExpansion: true"
    } else {
        ""
    };
    apply(
        low(),
        &format!(
            r#"
apiVersion: v1
kind: List
items:
- {{apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {{name: {class}}},
   provisioner: kubernetes.io/no-provisioner, volumeBindingMode: Immediate{expansion}}}
- apiVersion: v1
  kind: PersistentVolume
  metadata: {{name: {disk}}}
  spec:
    capacity: {{storage: {capacity}}}
    accessModes: [ReadWriteOnce]
    storageClassName: {class}
    hostPath: {{path: /tmp/{disk}}}
"#
        ),
    )
    .await;
    let upper = format!(
        r#"
apiVersion: v1
kind: List
items:
- {{apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {{name: {class}}},
   provisioner: virtual-node.tensile.io, volumeBindingMode: WaitForFirstConsumer{expansion}}}
- apiVersion: v1
  kind: PersistentVolumeClaim
  metadata: {{name: data, namespace: {ns}}}
  spec:
    accessModes: [ReadWriteOnce]
    storageClassName: {class}
    resources: {{requests: {{storage: 500Mi}}}}
"#
    );
    apply(up(), &upper).await;
    upper
}

/// A pod spec tail mounting ConfigMap `name`.
fn mounts_config_map(name: &str) -> String {
    format!(
        r#"  volumes: [{{name: config, configMap: {{name: {name}}}}}]
  containers: [{{name: app, image: web, volumeMounts: [{{name: config, mountPath: /etc/app}}]}}]"#
    )
}

const SYNCED: &str = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].reason}"#;

async fn events(ns: &str) -> String {
    kubectl(
        up(),
        &[
            "-n",
            ns,
            "get",
            "events",
            "-o",
            "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
        ],
    )
    .await
}

#[tokio::test]
async fn every_referenced_object_is_below_before_the_pod_and_no_other_secret_is() {
    let bed = bed();
    let _vn = virtual_node("vn-refs").await;
    bed.upper.create_namespace("refs").await.unwrap();
    apply(
        up(),
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: ConfigMap, metadata: {name: cfg, namespace: refs, labels: {app: web}}, data: {a.conf: "one"}}
- {apiVersion: v1, kind: ConfigMap, metadata: {name: proj-cm, namespace: refs}, data: {p: "1"}}
- {apiVersion: v1, kind: Secret, metadata: {name: env-secret, namespace: refs}, stringData: {password: s3cret}}
- {apiVersion: v1, kind: Secret, metadata: {name: from-secret, namespace: refs}, stringData: {USER: admin}}
- {apiVersion: v1, kind: Secret, metadata: {name: proj-secret, namespace: refs}, stringData: {k: v}}
- {apiVersion: v1, kind: Secret, metadata: {name: pull, namespace: refs}, type: kubernetes.io/dockerconfigjson,
   stringData: {.dockerconfigjson: '{"auths":{}}'}}
- {apiVersion: v1, kind: Secret, metadata: {name: unused, namespace: refs}, stringData: {never: below}}
"#,
    )
    .await;
    apply(
        up(),
        &pod(
            "refs",
            "app",
            "vn-refs",
            r#"  imagePullSecrets: [{name: pull}]
  volumes:
  - {name: config, configMap: {name: cfg}}
  - {name: proj, projected: {sources: [{configMap: {name: proj-cm}}, {secret: {name: proj-secret}}]}}
  - {name: maybe, configMap: {name: not-there, optional: true}}
  containers:
  - name: app
    image: web
    env: [{name: PASSWORD, valueFrom: {secretKeyRef: {name: env-secret, key: password}}}]
    envFrom: [{secretRef: {name: from-secret}}]
    volumeMounts: [{name: config, mountPath: /etc/app}, {name: proj, mountPath: /etc/proj}]"#,
        ),
    )
    .await;
    scene::pod_running(low(), "refs", "app", 60).await;
    scene::pod_running(up(), "refs", "app", 30).await;

    let pod_created = scene::pod_field(low(), "refs", "app", "jsonpath={.metadata.creationTimestamp}").await;
    for (kind, name) in [
        ("configmap", "cfg"),
        ("configmap", "proj-cm"),
        ("secret", "env-secret"),
        ("secret", "from-secret"),
        ("secret", "proj-secret"),
        ("secret", "pull"),
    ] {
        let fields = r#"jsonpath={.metadata.creationTimestamp} {.metadata.labels.tensile\.io/upper-cluster} {.type} {.data}"#;
        let copy = below(&["-n", "refs", "get", kind, name, "-o", fields])
            .await
            .unwrap_or_else(|| panic!("{kind} {name} is not below"));
        let upper = kubectl(
            up(),
            &["-n", "refs", "get", kind, name, "-o", "jsonpath={.type} {.data}"],
        )
        .await;
        let (created, rest) = copy.split_once(' ').unwrap();
        let (mark, content) = rest.split_once(' ').unwrap();
        assert!(!mark.is_empty(), "{kind} {name} carries the upper cluster's mark");
        assert_eq!(
            content.trim(),
            upper.trim(),
            "{kind} {name} has the upper content"
        );
        assert!(
            created <= pod_created.as_str(),
            "{kind} {name} was below before the pod"
        );
    }
    let labels = scene::field(low(), "refs", "configmap/cfg", "jsonpath={.metadata.labels.app}").await;
    assert_eq!(labels, "web", "labels travel with the copy");
    assert_eq!(
        below(&["-n", "refs", "get", "secret", "unused"]).await,
        None,
        "a Secret no pod references never reaches the lower cluster"
    );
    let copied = kubectl(
        low(),
        &[
            "-n",
            "refs",
            "get",
            "secrets",
            "-l",
            "tensile.io/upper-cluster",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
    )
    .await;
    let mut copied: Vec<&str> = copied.split_whitespace().collect();
    copied.sort();
    assert_eq!(
        copied,
        ["env-secret", "from-secret", "proj-secret", "pull"],
        "exactly the referenced Secrets, never the upper service-account token"
    );

    // A required reference missing upstream keeps the pod from starting below, and says so.
    apply(up(), &pod("refs", "late", "vn-refs", &mounts_config_map("later"))).await;
    scene::pod_shows(up(), "refs", "late", SYNCED, "ReferenceMissing", 30).await;
    let message = scene::pod_field(
        up(),
        "refs",
        "late",
        r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].message}"#,
    )
    .await;
    assert!(
        message.contains("ConfigMap refs/later (volume \"config\") does not exist in the upper cluster"),
        "{message}"
    );
    assert!(
        events("refs")
            .await
            .contains("ReferenceMissing: ConfigMap refs/later")
    );
    assert_eq!(below(&["-n", "refs", "get", "pod", "late"]).await, None);
    kubectl(
        up(),
        &["-n", "refs", "create", "configmap", "later", "--from-literal=x=y"],
    )
    .await;
    scene::pod_running(low(), "refs", "late", 60).await;
}

#[tokio::test]
async fn upper_edits_reach_the_copy_within_2s_and_copies_go_with_their_last_pod() {
    let bed = bed();
    let _vn = virtual_node("vn-edit").await;
    bed.upper.create_namespace("edit").await.unwrap();
    kubectl(
        up(),
        &[
            "-n",
            "edit",
            "create",
            "configmap",
            "shared",
            "--from-literal=v=one",
        ],
    )
    .await;
    kubectl(
        up(),
        &[
            "-n",
            "edit",
            "create",
            "configmap",
            "solo",
            "--from-literal=v=solo",
        ],
    )
    .await;
    let uses = |cm: &str| {
        format!(r#"  containers: [{{name: app, image: web, envFrom: [{{configMapRef: {{name: {cm}}}}}]}}]"#)
    };
    for (name, cm) in [("p1", "shared"), ("p2", "shared"), ("p3", "solo")] {
        apply(up(), &pod("edit", name, "vn-edit", &uses(cm))).await;
    }
    for name in ["p1", "p2", "p3"] {
        scene::pod_running(low(), "edit", name, 60).await;
    }

    // An upstream edit reaches the copy within 2 s.
    kubectl(
        up(),
        &[
            "-n",
            "edit",
            "patch",
            "configmap",
            "shared",
            "-p",
            r#"{"data":{"v":"two"}}"#,
        ],
    )
    .await;
    let edited = Instant::now();
    loop {
        let v = below(&[
            "-n",
            "edit",
            "get",
            "configmap",
            "shared",
            "-o",
            "jsonpath={.data.v}",
        ])
        .await;
        if v.as_deref() == Some("two") {
            break;
        }
        assert!(
            edited.elapsed() < Duration::from_secs(2),
            "the copy still shows {v:?} 2 s after the upstream edit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("upstream edit visible below after {:?}", edited.elapsed());

    // Two pods share the copy: it stays while either runs, and goes after the last.
    kubectl(up(), &["-n", "edit", "delete", "pod", "p1", "--wait=true"]).await;
    gone_below("edit", "pod", "p1", 30).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        below(&["-n", "edit", "get", "configmap", "shared"])
            .await
            .is_some(),
        "p2 still uses the copy"
    );
    kubectl(up(), &["-n", "edit", "delete", "pod", "p2", "--wait=true"]).await;
    gone_below("edit", "configmap", "shared", 20).await;

    // Deleting the upstream object deletes the copy, even while a pod uses it.
    kubectl(up(), &["-n", "edit", "delete", "configmap", "solo"]).await;
    gone_below("edit", "configmap", "solo", 5).await;
    assert_eq!(
        below(&["-n", "edit", "get", "pod", "p3", "-o", "jsonpath={.status.phase}"])
            .await
            .as_deref(),
        Some("Running")
    );
}

/// An optional reference to a Secret that does not exist upstream never reaches the lower
/// pod, so it cannot resolve to a same-named lower Secret of somebody else: the volume is an
/// empty directory, the env var and envFrom entry and the image pull secret are left out, as
/// a kubelet treats a missing optional object.
#[tokio::test]
async fn an_optional_reference_that_did_not_travel_never_reaches_a_lower_secret() {
    let bed = bed();
    let _vn = virtual_node("vn-optional").await;
    bed.upper.create_namespace("optional").await.unwrap();
    bed.lower.create_namespace("optional").await.unwrap();
    kubectl(
        low(),
        &[
            "-n",
            "optional",
            "create",
            "secret",
            "generic",
            "other-tenant",
            "--from-literal=token=theirs",
        ],
    )
    .await;
    let extra = r#"  imagePullSecrets: [{name: other-tenant}]
  volumes: [{name: creds, secret: {secretName: other-tenant, optional: true}}]
  containers:
  - name: app
    image: busybox
    volumeMounts: [{name: creds, mountPath: /creds}]
    env: [{name: TOKEN, valueFrom: {secretKeyRef: {name: other-tenant, key: token, optional: true}}}]
    envFrom: [{secretRef: {name: other-tenant, optional: true}}]"#;
    apply(up(), &pod("optional", "reader", "vn-optional", extra)).await;
    scene::pod_running(low(), "optional", "reader", 60).await;
    let spec = scene::pod_field(low(), "optional", "reader", "jsonpath={.spec}").await;
    assert!(
        !spec.contains("other-tenant"),
        "the lower pod names the lower Secret: {spec}"
    );
    let volume = scene::pod_field(
        low(),
        "optional",
        "reader",
        "jsonpath={.spec.volumes[0].name}/{.spec.volumes[0].emptyDir}",
    )
    .await;
    assert_eq!(volume, "creds/{}");
}

#[tokio::test]
async fn a_foreign_same_named_config_map_below_is_reported_and_left_untouched() {
    let bed = bed();
    let _vn = virtual_node("vn-clash").await;
    bed.upper.create_namespace("clash").await.unwrap();
    bed.lower.create_namespace("clash").await.unwrap();
    kubectl(
        low(),
        &[
            "-n",
            "clash",
            "create",
            "configmap",
            "theirs",
            "--from-literal=owner=them",
        ],
    )
    .await;
    let fields = "jsonpath={.metadata.uid} {.metadata.resourceVersion} {.data.owner} {.metadata.labels}";
    let before = scene::field(low(), "clash", "configmap/theirs", fields).await;
    kubectl(
        up(),
        &[
            "-n",
            "clash",
            "create",
            "configmap",
            "theirs",
            "--from-literal=owner=us",
        ],
    )
    .await;
    apply(
        up(),
        &pod("clash", "app", "vn-clash", &mounts_config_map("theirs")),
    )
    .await;
    scene::pod_shows(up(), "clash", "app", SYNCED, "Conflict", 30).await;
    assert!(
        events("clash").await.contains("LowerCopyConflict"),
        "a Warning event names the conflict"
    );
    // Give the resync several passes to (wrongly) touch it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = scene::field(low(), "clash", "configmap/theirs", fields).await;
    assert_eq!(before, after, "the foreign ConfigMap is left untouched");
    assert_eq!(
        below(&["-n", "clash", "get", "pod", "app"]).await,
        None,
        "the pod is not started with someone else's data"
    );
    let phase = scene::pod_field(up(), "clash", "app", scene::PHASE).await;
    assert_eq!(phase, "Pending");
}

#[tokio::test]
async fn copies_edited_or_deleted_below_are_repaired_and_a_restart_changes_nothing() {
    let bed = bed();
    let port = free_port().unwrap();
    let services = |args: &mut Args| {
        args.reflection.enable_controllers = vec![Controllers::Services];
        args.kubelet.kubelet_port = port;
    };
    let vn = virtual_node_with("vn-repair", services).await;
    bed.upper.create_namespace("repair").await.unwrap();
    bed.lower.create_namespace("repair").await.unwrap();
    // A Service and a claim too, so the restart below meets every kind of object.
    apply(
        low(),
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {name: repair-class},
   provisioner: kubernetes.io/no-provisioner, volumeBindingMode: Immediate}
- apiVersion: v1
  kind: PersistentVolume
  metadata: {name: repair-disk}
  spec: {capacity: {storage: 1Gi}, accessModes: [ReadWriteOnce], storageClassName: repair-class,
         hostPath: {path: /tmp/repair-disk}}
"#,
    )
    .await;
    apply(
        up(),
        r#"
apiVersion: v1
kind: List
items:
- {apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {name: repair-class},
   provisioner: virtual-node.tensile.io, volumeBindingMode: WaitForFirstConsumer}
- apiVersion: v1
  kind: PersistentVolumeClaim
  metadata: {name: vol, namespace: repair}
  spec: {accessModes: [ReadWriteOnce], storageClassName: repair-class, resources: {requests: {storage: 1Gi}}}
- apiVersion: v1
  kind: Service
  metadata: {name: api, namespace: repair}
  spec: {selector: {app: repair}, ports: [{port: 80}]}
"#,
    )
    .await;
    kubectl(
        up(),
        &[
            "-n",
            "repair",
            "create",
            "configmap",
            "cfg",
            "--from-literal=v=upper",
        ],
    )
    .await;
    kubectl(
        up(),
        &[
            "-n",
            "repair",
            "create",
            "secret",
            "generic",
            "sec",
            "--from-literal=token=upper",
        ],
    )
    .await;
    apply(
        up(),
        &pod(
            "repair",
            "app",
            "vn-repair",
            r#"  volumes: [{name: config, configMap: {name: cfg}}, {name: vol, persistentVolumeClaim: {claimName: vol}}]
  containers:
  - name: app
    image: web
    env: [{name: TOKEN, valueFrom: {secretKeyRef: {name: sec, key: token}}}]
    volumeMounts: [{name: config, mountPath: /etc/app}, {name: vol, mountPath: /data}]"#,
        ),
    )
    .await;
    scene::pod_running(low(), "repair", "app", 60).await;

    kubectl(low(), &["-n", "repair", "delete", "configmap", "cfg"]).await;
    scene::shows(
        low(),
        "repair",
        "configmap/cfg",
        "jsonpath={.data.v}",
        "upper",
        10,
    )
    .await;
    kubectl(
        low(),
        &[
            "-n",
            "repair",
            "patch",
            "secret",
            "sec",
            "-p",
            r#"{"data":{"token":"ZWRpdGVk"}}"#,
        ],
    )
    .await;
    scene::shows(
        low(),
        "repair",
        "secret/sec",
        "jsonpath={.data.token}",
        "dXBwZXI=",
        10,
    )
    .await;

    // A crash and a restart leave every object below as it was.
    let snapshot = || async {
        kubectl(
            low(),
            &[
                "-n",
                "repair",
                "get",
                "configmaps,secrets,services,endpoints,persistentvolumeclaims,pods",
                "-l",
                "tensile.io/upper-cluster",
                "-o",
                r#"jsonpath={range .items[*]}{.kind}/{.metadata.name} {.metadata.uid}{"\n"}{end}"#,
            ],
        )
        .await
    };
    let versions = || async {
        kubectl(
            low(),
            &[
                "-n",
                "repair",
                "get",
                "configmaps,secrets,services,endpoints,persistentvolumeclaims",
                "-l",
                "tensile.io/upper-cluster",
                "-o",
                r#"jsonpath={range .items[*]}{.metadata.name}={.metadata.resourceVersion} {end}"#,
            ],
        )
        .await
    };
    let (objects, rvs) = (snapshot().await, versions().await);
    assert_eq!(objects.lines().count(), 6, "{objects}");
    let upper_volume = || async {
        kubectl(
            up(),
            &["get", "pv", "-l", "tensile.io/virtual-node=vn-repair", "-o", r#"jsonpath={range .items[*]}{.metadata.name} {.metadata.uid} {.metadata.resourceVersion}{end}"#],
        )
        .await
    };
    let volume = upper_volume().await;
    assert!(volume.starts_with("pvc-"), "{volume}");
    drop(vn);
    let _vn = virtual_node_with("vn-repair", services).await;
    // Longer than the collection delay and several resync passes.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        snapshot().await,
        objects,
        "no object below was replaced or removed"
    );
    assert_eq!(versions().await, rvs, "no copy was written");
    assert_eq!(upper_volume().await, volume, "the upper volume was not touched");
}

#[tokio::test]
async fn services_and_their_endpoints_follow_the_upper_cluster_when_enabled() {
    let bed = bed();
    let vn = scene::ready_virtual_node(&bed.upper, "vn-svc", &bed.lower, |args| {
        args.reflection.enable_controllers = vec![Controllers::Services];
        args.reflection.copy_collection_delay = 2;
    })
    .await;
    bed.upper.create_namespace("svc").await.unwrap();
    apply(
        up(),
        r#"
apiVersion: v1
kind: List
items:
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: web, namespace: svc}
  spec:
    replicas: 2
    selector: {matchLabels: {app: web}}
    template:
      metadata: {labels: {app: web}}
      spec:
        nodeSelector: {kubernetes.io/hostname: vn-svc}
        tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
        terminationGracePeriodSeconds: 1
        containers: [{name: web, image: web}]
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: svc, labels: {tier: front}}
  spec:
    selector: {app: web}
    ports: [{name: http, port: 80, targetPort: 8080}]
- apiVersion: v1
  kind: Service
  metadata: {name: web-headless, namespace: svc}
  spec:
    clusterIP: None
    selector: {app: web}
    ports: [{name: http, port: 80}]
"#,
    )
    .await;
    let addresses = |kubeconfig: &'static Path| async move {
        let ips = scene::field(
            kubeconfig,
            "svc",
            "endpoints/web",
            "jsonpath={.subsets[*].addresses[*].ip}",
        )
        .await;
        let mut ips: Vec<String> = ips.split_whitespace().map(str::to_owned).collect();
        ips.sort();
        ips
    };
    let wait_addresses = |kubeconfig: &'static Path, n: usize| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = tensile_e2e::kubectl::run(
                kubeconfig,
                &[
                    "-n",
                    "svc",
                    "get",
                    "endpoints",
                    "web",
                    "-o",
                    "jsonpath={.subsets[*].addresses[*].ip}",
                ],
            )
            .await;
            if out.ok && out.stdout.split_whitespace().count() == n {
                return Instant::now();
            }
            assert!(Instant::now() < deadline, "{n} endpoint addresses: {out:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    wait_addresses(up(), 2).await;
    wait_addresses(low(), 2).await;
    assert_eq!(
        addresses(low()).await,
        addresses(up()).await,
        "the lower endpoints are the upper ones"
    );

    let fields = r#"jsonpath={.spec.selector} {.spec.clusterIP} {.metadata.annotations.tensile\.io/service-selector} {.metadata.labels.tier} {.spec.ports[0].port}/{.spec.ports[0].targetPort}"#;
    let svc = scene::field(low(), "svc", "service/web", fields).await;
    let parts: Vec<&str> = svc.split(' ').collect();
    assert_eq!(parts[0], "", "the copy has no selector: {svc}");
    assert!(
        parts[1].contains('.'),
        "the lower cluster gave it a cluster IP: {svc}"
    );
    assert_eq!(parts[2], r#"{"app":"web"}"#, "{svc}");
    assert_eq!(&parts[3..], ["front", "80/8080"], "{svc}");
    let headless = scene::field(low(), "svc", "service/web-headless", "jsonpath={.spec.clusterIP}").await;
    assert_eq!(headless, "None", "a headless Service stays headless");

    // Scaling upstream changes the lower endpoints within 2 s of the upper ones.
    kubectl(up(), &["-n", "svc", "scale", "deployment", "web", "--replicas=3"]).await;
    let upper_changed = wait_addresses(up(), 3).await;
    let lower_changed = wait_addresses(low(), 3).await;
    let lag = lower_changed.saturating_duration_since(upper_changed);
    eprintln!("endpoints change reached the lower cluster after {lag:?}");
    assert!(
        lag < Duration::from_secs(2),
        "the lower endpoints followed after {lag:?}"
    );
    assert_eq!(addresses(low()).await, addresses(up()).await);

    kubectl(up(), &["-n", "svc", "delete", "service", "web"]).await;
    gone_below("svc", "service", "web", 10).await;
    gone_below("svc", "endpoints", "web", 10).await;
    drop(vn);
}

#[tokio::test]
async fn with_gc_namespaces_an_empty_namespace_we_created_goes_and_one_with_foreign_objects_stays() {
    let bed = bed();
    let _vn = scene::virtual_node(&bed.upper, "vn-ns", &bed.lower, |args| {
        args.reflection.gc_namespaces = true;
        args.reflection.copy_collection_delay = 2;
    })
    .unwrap();
    for ns in ["gc-a", "gc-b", "gc-c"] {
        bed.upper.create_namespace(ns).await.unwrap();
        kubectl(
            up(),
            &["-n", ns, "create", "configmap", "cfg", "--from-literal=k=v"],
        )
        .await;
        apply(
            up(),
            &pod(
                ns,
                "app",
                "vn-ns",
                "  containers: [{name: app, image: web, envFrom: [{configMapRef: {name: cfg}}]}]",
            ),
        )
        .await;
    }
    for ns in ["gc-a", "gc-b", "gc-c"] {
        scene::pod_running(low(), ns, "app", 60).await;
        let marks = kubectl(
            low(),
            &[
                "get",
                "namespace",
                ns,
                "-o",
                r#"jsonpath={.metadata.labels.tensile\.io/virtual-node}"#,
            ],
        )
        .await;
        assert_eq!(marks, "vn-ns", "a namespace created below is marked");
    }
    kubectl(
        low(),
        &[
            "-n",
            "gc-b",
            "create",
            "configmap",
            "theirs",
            "--from-literal=k=v",
        ],
    )
    .await;
    // Not a kind the virtual node ever makes: only discovery finds it.
    kubectl(
        low(),
        &[
            "-n",
            "gc-c",
            "create",
            "role",
            "reader",
            "--verb=get",
            "--resource=pods",
        ],
    )
    .await;
    for ns in ["gc-a", "gc-b", "gc-c"] {
        kubectl(up(), &["-n", ns, "delete", "pod", "app", "--wait=true"]).await;
    }
    let gone = "gc-a no longer Active below";
    tensile_e2e::wait::must(
        gone,
        Duration::from_secs(40),
        Duration::from_millis(500),
        || async {
            match below(&["get", "namespace", "gc-a", "-o", "jsonpath={.status.phase}"]).await {
                Some(phase) if phase == "Active" => Err(phase),
                _ => Ok(()),
            }
        },
    )
    .await;
    let kept = scene::field(low(), "gc-b", "configmap/theirs", "jsonpath={.data.k}").await;
    assert_eq!(kept, "v", "a namespace holding someone else's object is kept");
    let phase = kubectl(
        low(),
        &["get", "namespace", "gc-b", "-o", "jsonpath={.status.phase}"],
    )
    .await;
    assert_eq!(phase, "Active");
    let role = scene::field(low(), "gc-c", "role/reader", "jsonpath={.metadata.name}").await;
    assert_eq!(role, "reader", "a namespace holding a lower admin's Role is kept");
}

/// An upper volume set to `Retain` keeps its data below: deleting the upper claim leaves the
/// lower claim (recorded as retained) and the upper volume, and a new upper claim of the
/// same name never adopts the old lower claim: its pod waits.
#[tokio::test]
async fn a_retained_volume_keeps_its_lower_claim_and_a_new_claim_of_the_name_never_adopts_it() {
    let bed = bed();
    let _vn = virtual_node("vn-retain").await;
    bed.upper.create_namespace("retain").await.unwrap();
    bed.lower.create_namespace("retain").await.unwrap();
    let claim = data_claim("retain", "keep", "retain-disk", "1Gi", false).await;
    apply(up(), &pod("retain", "first", "vn-retain", USES_DATA)).await;
    scene::pod_running(low(), "retain", "first", 60).await;
    let claim_of = |what: &'static str| async move { scene::field(up(), "retain", "pvc/data", what).await };
    scene::shows(
        up(),
        "retain",
        "pvc/data",
        "jsonpath={.status.phase}",
        "Bound",
        30,
    )
    .await;
    let volume = claim_of("jsonpath={.spec.volumeName}").await;
    kubectl(
        up(),
        &[
            "patch",
            "pv",
            &volume,
            "-p",
            r#"{"spec":{"persistentVolumeReclaimPolicy":"Retain"}}"#,
        ],
    )
    .await;
    scene::shows(
        low(),
        "retain",
        "pvc/data",
        r#"jsonpath={.metadata.annotations.tensile\.io/reclaim-policy}"#,
        "Retain",
        30,
    )
    .await;
    let lower_uid = scene::field(low(), "retain", "pvc/data", "jsonpath={.metadata.uid}").await;
    kubectl(up(), &["-n", "retain", "delete", "pod", "first", "--wait=true"]).await;
    kubectl(up(), &["-n", "retain", "delete", "pvc", "data", "--wait=true"]).await;
    // Several resync passes (at least one a second) later, both are still there.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let kept = scene::field(low(), "retain", "pvc/data", "jsonpath={.metadata.uid}").await;
    assert_eq!(kept, lower_uid, "the retained lower claim (and its data) stays");
    let released = kubectl(up(), &["get", "pv", &volume, "-o", "jsonpath={.status.phase}"]).await;
    assert_eq!(
        released, "Released",
        "the upper volume stays, as Kubernetes retains it"
    );

    apply(up(), &claim).await;
    apply(up(), &pod("retain", "second", "vn-retain", USES_DATA)).await;
    // The new claim gets no volume from the old lower claim, so the upper scheduler keeps
    // waiting for its volume: the pod stays unbound and nothing starts below.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let waiting = claim_of("jsonpath={.status.phase}").await;
    assert_eq!(waiting, "Pending", "the new claim is not bound to the old volume");
    let unbound = scene::pod_field(
        up(),
        "retain",
        "second",
        "jsonpath={.status.phase}/{.spec.nodeName}",
    )
    .await;
    assert_eq!(unbound, "Pending/");
    assert!(below(&["-n", "retain", "get", "pod", "second"]).await.is_none());
    let still = scene::field(low(), "retain", "pvc/data", "jsonpath={.metadata.uid}").await;
    assert_eq!(still, lower_uid, "the old lower claim is not adopted or replaced");
}

/// An upper claim expanded while its pod runs asks the same size below.
#[tokio::test]
async fn an_upper_claim_expansion_reaches_the_lower_claim() {
    let bed = bed();
    let _vn = virtual_node("vn-grow").await;
    bed.upper.create_namespace("grow").await.unwrap();
    bed.lower.create_namespace("grow").await.unwrap();
    data_claim("grow", "grow", "grow-disk", "5Gi", true).await;
    apply(up(), &pod("grow", "db", "vn-grow", USES_DATA)).await;
    scene::pod_running(low(), "grow", "db", 60).await;
    scene::shows(up(), "grow", "pvc/data", "jsonpath={.status.phase}", "Bound", 30).await;
    kubectl(
        up(),
        &[
            "-n",
            "grow",
            "patch",
            "pvc",
            "data",
            "-p",
            r#"{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}"#,
        ],
    )
    .await;
    scene::shows(
        low(),
        "grow",
        "pvc/data",
        "jsonpath={.spec.resources.requests.storage}",
        "2Gi",
        30,
    )
    .await;
}

#[tokio::test]
async fn a_claim_is_made_below_its_volume_shows_upstream_and_keeps_later_pods_on_the_node() {
    let bed = bed();
    let _vn = virtual_node("vn-pv").await;
    let _other = virtual_node("vn-pv-2").await;
    bed.upper.create_namespace("pv").await.unwrap();
    bed.lower.create_namespace("pv").await.unwrap();
    data_claim("pv", "standard", "lower-disk", "1Gi", false).await;
    apply(up(), &pod("pv", "writer", "vn-pv", USES_DATA)).await;
    scene::pod_running(low(), "pv", "writer", 60).await;

    let claim = r#"jsonpath={.status.phase} {.spec.volumeName} {.metadata.labels.tensile\.io/virtual-node} {.spec.resources.requests.storage}"#;
    let lower_claim = scene::field(low(), "pv", "pvc/data", claim).await;
    assert_eq!(
        lower_claim, "Bound lower-disk vn-pv 500Mi",
        "the claim below, bound there"
    );
    scene::shows(
        up(),
        "pv",
        "pvc/data",
        "jsonpath={.status.phase} {.status.capacity.storage}",
        "Bound 1Gi",
        30,
    )
    .await;
    let volume = scene::field(up(), "pv", "pvc/data", "jsonpath={.spec.volumeName}").await;
    let affinity = kubectl(
        up(),
        &[
            "get",
            "pv",
            &volume,
            "-o",
            "jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
        ],
    )
    .await;
    assert_eq!(
        affinity, "vn-pv",
        "the upper volume is pinned to the virtual node"
    );

    // A later pod of the claim, free to land on any virtual node, lands on this one.
    apply(
        up(),
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: reader, namespace: pv}}
spec:
  nodeSelector: {{type: virtual-kubelet}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  terminationGracePeriodSeconds: 1
{USES_DATA}
"#
        ),
    )
    .await;
    scene::pod_running(low(), "pv", "reader", 60).await;
    let node = scene::pod_field(up(), "pv", "reader", "jsonpath={.spec.nodeName}").await;
    assert_eq!(node, "vn-pv");

    // The claim goes upstream: the lower claim and the upper volume follow once unused.
    kubectl(
        up(),
        &["-n", "pv", "delete", "pod", "writer", "reader", "--wait=true"],
    )
    .await;
    kubectl(up(), &["-n", "pv", "delete", "pvc", "data", "--wait=true"]).await;
    gone_below("pv", "pvc", "data", 30).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while tensile_e2e::kubectl::run(up(), &["get", "pv", &volume]).await.ok {
        assert!(Instant::now() < deadline, "upper volume {volume} is still there");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A copy made immutable below (a lower admin's edit) is replaced by delete and create, as
/// immutable content changes; a pod that needs it goes below only after the new copy exists:
/// the copy's creation precedes the pod's in the lower apiserver's own order of writes.
#[tokio::test]
async fn a_replaced_immutable_copy_exists_again_before_the_pod_that_needs_it() {
    let bed = bed();
    // Copies outlive their last pod by a minute here: the edited copy is left to the pod path.
    let _vn = virtual_node_with("vn-immutable", |a| a.reflection.copy_collection_delay = 60).await;
    let ns = "immutable";
    bed.upper.create_namespace(ns).await.unwrap();
    apply(
        up(),
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: frozen, namespace: {ns}}}\ndata: {{v: one}}\n"
        ),
    )
    .await;
    let uses_frozen = r#"  volumes: [{name: cfg, configMap: {name: frozen}}]
  containers: [{name: app, image: web, volumeMounts: [{name: cfg, mountPath: /cfg}]}]"#;
    apply(up(), &pod(ns, "first", "vn-immutable", uses_frozen)).await;
    scene::pod_running(low(), ns, "first", 60).await;
    // The first pod goes; its copy stays, unneeded, and a lower admin freezes it with other
    // content.
    kubectl(up(), &["-n", ns, "delete", "pod", "first", "--wait=true"]).await;
    gone_below(ns, "pod", "first", 30).await;
    kubectl(
        low(),
        &[
            "-n",
            ns,
            "patch",
            "configmap",
            "frozen",
            "--type=merge",
            "-p",
            r#"{"immutable": true, "data": {"v": "edited below"}}"#,
        ],
    )
    .await;
    // The lower pod's first version is seen by a watch started before it exists: resource
    // versions of one apiserver order all its writes, across kinds.
    let lower_pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(bed.lower.client().await.unwrap(), ns);
    let mut events = kube::runtime::watcher(
        lower_pods,
        kube::runtime::watcher::Config::default().fields("metadata.name=second"),
    )
    .boxed();
    while !matches!(
        events.try_next().await.unwrap(),
        Some(kube::runtime::watcher::Event::InitDone)
    ) {}
    apply(up(), &pod(ns, "second", "vn-immutable", uses_frozen)).await;
    let pod = loop {
        if let Some(kube::runtime::watcher::Event::Apply(p)) = events.try_next().await.unwrap() {
            break p.metadata.resource_version.unwrap().parse::<u64>().unwrap();
        }
    };
    scene::pod_running(low(), ns, "second", 60).await;
    let copy = below(&[
        "-n",
        ns,
        "get",
        "configmap",
        "frozen",
        "-o",
        "jsonpath={.data.v} {.metadata.resourceVersion}",
    ])
    .await
    .unwrap();
    let (content, copy) = copy.split_once(' ').unwrap();
    assert_eq!(content, "one", "the copy holds the upper content again");
    // An immutable copy is never updated: its resourceVersion is its creation's.
    let copy: u64 = copy.trim().parse().unwrap();
    assert!(
        copy < pod,
        "the replaced copy (resourceVersion {copy}) exists before the pod (resourceVersion {pod})"
    );
}

/// A claim the upper scheduler (or its owner, by annotation) picked the virtual node for goes
/// below only where the virtual node's pods may go: never into a lower namespace someone else
/// made, where it would spend their quota.
#[tokio::test]
async fn a_claim_picked_for_the_node_never_goes_into_a_foreign_lower_namespace() {
    let bed = bed();
    let node = "vn-pv-foreign";
    let _vn = virtual_node_with(node, |args| {
        args.reflection.shared_namespaces = vec!["default".into()];
    })
    .await;
    // `pvforeign` below is another tenant's.
    for ns in ["pvforeign", "pvfree"] {
        bed.upper.create_namespace(ns).await.unwrap();
    }
    bed.lower.create_namespace("pvforeign").await.unwrap();
    // A pod of the node makes `pvfree` below, marked as this upper cluster's.
    apply(
        up(),
        &pod(
            "pvfree",
            "first",
            node,
            "  containers: [{name: app, image: busybox}]",
        ),
    )
    .await;
    scene::pod_running(low(), "pvfree", "first", 60).await;
    let claim = |ns: &str, name: &str, size: &str| {
        format!(
            r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {name}
  namespace: {ns}
  annotations: {{volume.kubernetes.io/selected-node: {node}}}
spec:
  accessModes: [ReadWriteOnce]
  selector: {{matchLabels: {{disk: someone-elses}}}}
  resources: {{requests: {{storage: {size}}}}}
"#
        )
    };
    apply(up(), &claim("pvforeign", "huge", "10Ti")).await;
    apply(up(), &claim("pvfree", "small", "1Gi")).await;
    // The claim in the node's own namespace is made below: the pass has run.
    scene::shows(
        low(),
        "pvfree",
        "pvc/small",
        "jsonpath={.metadata.name}",
        "small",
        60,
    )
    .await;
    let foreign = kubectl(low(), &["-n", "pvforeign", "get", "pvc", "-o", "name"]).await;
    assert_eq!(foreign, "", "nothing in the foreign namespace");
    let selector = scene::field(low(), "pvfree", "pvc/small", "jsonpath={.spec.selector}").await;
    assert_eq!(selector, "", "an upper selector names no lower volume");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let foreign = kubectl(low(), &["-n", "pvforeign", "get", "pvc", "-o", "name"]).await;
    assert_eq!(foreign, "", "nothing in the foreign namespace later either");
    kubectl(up(), &["-n", "pvfree", "delete", "pod", "first", "--wait=true"]).await;
    for ns in ["pvforeign", "pvfree"] {
        kubectl(up(), &["-n", ns, "delete", "pvc", "--all", "--wait=false"]).await;
    }
}
