//! Per-lower-cluster overrides end to end: two lower clusters with simulated nodes, each
//! under a virtual node following its own overrides file, and the same workloads spread over
//! both. Every assertion is what kubectl shows in one of the clusters.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tensile_common::names;
use tensile_e2e::check::{apply, eventually, kubectl};
use tensile_e2e::in_process::{self, VirtualNode};
use tensile_e2e::scene;
use tensile_e2e::shared::Shared;
use tensile_e2e::{NodeSimulator, TestCluster};

struct Bed {
    upper: TestCluster,
    lower_a: TestCluster,
    lower_b: TestCluster,
    _sims: (NodeSimulator, NodeSimulator),
}

static BED: Shared<Bed> = Shared::new();

/// The tests of this file one at a time: each registers virtual nodes the other's pods could
/// land on before their taints are in place.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// lower-a: two plain nodes. lower-b: two nodes dedicated to the fleet (`pool=fleet`, taint
/// `dedicated=fleet:NoSchedule`): a pod runs there only with the toleration.
fn bed() -> &'static Bed {
    BED.bed(|| async {
        let [upper, lower_a, lower_b] = scene::clusters("overrides", ["upper", "lower-a", "lower-b"]).await?;
        let sim_a = scene::simulate(&lower_a, scene::nodes("a", 2)).await?;
        let mut dedicated = scene::nodes("b", 2);
        for node in &mut dedicated {
            node.labels.insert("pool".into(), "fleet".into());
            node.taints
                .push(serde_json::json!({"key": "dedicated", "value": "fleet", "effect": "NoSchedule"}));
        }
        let sim_b = scene::simulate(&lower_b, dedicated).await?;
        Ok(Bed {
            upper,
            lower_a,
            lower_b,
            _sims: (sim_a, sim_b),
        })
    })
}

fn up() -> &'static Path {
    bed().upper.kubeconfig()
}

/// A virtual node over `lower` following the overrides file `file`, Ready upstream.
async fn virtual_node(name: &str, lower: &TestCluster, file: &Path) -> VirtualNode {
    scene::ready_virtual_node(&bed().upper, name, lower, |args| {
        args.overrides_file = Some(file.to_owned())
    })
    .await
}

/// Writes `text` to `path` whole (a ConfigMap volume is swapped whole, never half-written).
fn write(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// The value of counter `name` of a virtual node's metrics.
async fn counter(vn: &VirtualNode, name: &str) -> u64 {
    let (_, text) = in_process::admin_get(&vn.admin_addr, "/metrics").await.unwrap();
    let line = format!("tensile_virtual_node_{name}_total ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn until_counted(vn: &VirtualNode, name: &str, want: u64) {
    tensile_e2e::wait::within(&format!("{name} counted {want} times"), 30, || async {
        match counter(vn, name).await {
            n if n >= want => Ok(()),
            n => Err(n.to_string()),
        }
    })
    .await
}

/// `kubectl get -o json` of one object.
async fn json(kubeconfig: &Path, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&kubectl(kubeconfig, &all).await).unwrap_or(Value::Null)
}

/// A bare pod on `node` with image `image`, and `annotations` (YAML flow mapping).
fn pod(name: &str, node: &str, image: &str, annotations: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, labels: {{app: solo}}, annotations: {annotations}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  terminationGracePeriodSeconds: 1
  containers: [{{name: app, image: "{image}"}}]
"#
    )
}

/// The upper pods of `app`, by the virtual node each is bound to.
async fn placed(app: &str, want: usize) -> Vec<(String, String)> {
    tensile_e2e::wait::within(&format!("{want} pods of {app} bound"), 90, || async {
        let list = json(up(), &["-n", "shop", "get", "pods", "-l", &format!("app={app}")]).await;
        let bound: Vec<(String, String)> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| {
                let node = p["spec"]["nodeName"].as_str()?;
                Some((p["metadata"]["name"].as_str()?.to_owned(), node.to_owned()))
            })
            .collect();
        match bound.len() == want {
            true => Ok(bound),
            false => Err(format!("{bound:?}")),
        }
    })
    .await
}

async fn image_below(lower: &Path, pod: &str) -> String {
    scene::pod_field(lower, "shop", pod, "jsonpath={.spec.containers[0].image}")
        .await
        .trim()
        .to_owned()
}

async fn eventually_image(lower: &Path, pod: &str, want: &str) {
    scene::pod_shows(
        lower,
        "shop",
        pod,
        "jsonpath={.spec.containers[0].image}",
        want,
        60,
    )
    .await;
}

/// The names of the rules a lower pod records.
fn recorded(pod: &Value) -> Vec<String> {
    let record = pod["metadata"]["annotations"][names::OVERRIDES]
        .as_str()
        .unwrap_or("[]");
    let rules: Vec<Value> = serde_json::from_str(record).unwrap();
    rules
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
        .collect()
}

const MIRROR: &str =
    "rules:\n- name: mirror\n  image: {prefix: {from: docker.io/, to: mirror.a.example/hub/}}\n";

const DEDICATED: &str = r#"
rules:
- name: dedicated
  tolerations: [{key: dedicated, operator: Equal, value: fleet, effect: NoSchedule}]
  nodeSelector: {pool: fleet}
  env: [{name: REGION, value: b}]
  labels: {region: b}
storageClasses: {fast: premium-b}
"#;

const WORKLOADS: &str = r#"
apiVersion: v1
kind: List
items:
- {apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {name: fast},
   provisioner: virtual-node.tensile.io, volumeBindingMode: WaitForFirstConsumer}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: web, namespace: shop}
  spec:
    replicas: 2
    selector: {matchLabels: {app: web}}
    template:
      metadata: {labels: {app: web}}
      spec:
        tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
        affinity: {podAntiAffinity: {requiredDuringSchedulingIgnoredDuringExecution: [
          {labelSelector: {matchLabels: {app: web}}, topologyKey: kubernetes.io/hostname}]}}
        terminationGracePeriodSeconds: 1
        containers: [{name: app, image: "nginx:1.25"}]
- apiVersion: apps/v1
  kind: StatefulSet
  metadata: {name: db, namespace: shop}
  spec:
    serviceName: db
    replicas: 2
    podManagementPolicy: Parallel
    selector: {matchLabels: {app: db}}
    template:
      metadata: {labels: {app: db}}
      spec:
        tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
        affinity: {podAntiAffinity: {requiredDuringSchedulingIgnoredDuringExecution: [
          {labelSelector: {matchLabels: {app: db}}, topologyKey: kubernetes.io/hostname}]}}
        terminationGracePeriodSeconds: 1
        containers: [{name: db, image: "postgres:16", volumeMounts: [{name: data, mountPath: /data}]}]
    volumeClaimTemplates:
    - metadata: {name: data}
      spec: {accessModes: [ReadWriteOnce], storageClassName: fast, resources: {requests: {storage: 100Mi}}}
"#;

/// A class binding at once, and one volume of it, in a lower cluster.
fn lower_storage(class: &str, disk: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: List
items:
- {{apiVersion: storage.k8s.io/v1, kind: StorageClass, metadata: {{name: {class}}},
   provisioner: kubernetes.io/no-provisioner, volumeBindingMode: Immediate}}
- apiVersion: v1
  kind: PersistentVolume
  metadata: {{name: {disk}}}
  spec:
    capacity: {{storage: 1Gi}}
    accessModes: [ReadWriteOnce]
    storageClassName: {class}
    hostPath: {{path: /tmp/{disk}}}
"#
    )
}

#[tokio::test]
async fn each_lower_cluster_runs_the_same_workloads_as_its_own_rules_say_and_an_edit_reaches_new_pods_only() {
    let _alone = ALONE.lock().await;
    let bed = bed();
    let (low_a, low_b) = (bed.lower_a.kubeconfig(), bed.lower_b.kubeconfig());
    let file_a: PathBuf = bed.upper.dir().join("overrides-a.yaml");
    let file_b: PathBuf = bed.upper.dir().join("overrides-b.yaml");
    write(&file_a, MIRROR);
    write(&file_b, DEDICATED);
    // lower-a has class fast; lower-b names its class premium-b and has no fast at all.
    apply(low_a, &lower_storage("fast", "disk-a")).await;
    apply(low_b, &lower_storage("premium-b", "disk-b")).await;
    let vn_a = virtual_node("vn-a", &bed.lower_a, &file_a).await;
    let vn_b = virtual_node("vn-b", &bed.lower_b, &file_b).await;
    bed.upper.create_namespace("shop").await.unwrap();
    apply(up(), &pod("solo", "vn-a", "nginx:1.25", "{}")).await;
    apply(up(), WORKLOADS).await;

    // The Deployment: one pod on each virtual node.
    let web = placed("web", 2).await;
    let on = |pods: &[(String, String)], node: &str| {
        pods.iter()
            .find(|(_, n)| n == node)
            .map(|(p, _)| p.clone())
            .unwrap_or_else(|| panic!("no pod on {node}: {pods:?}"))
    };
    let (web_a, web_b) = (on(&web, "vn-a"), on(&web, "vn-b"));
    scene::pod_running(low_a, "shop", &web_a, 90).await;
    scene::pod_running(low_b, "shop", &web_b, 90).await;
    // lower-a: the image from its mirror; upstream, what the user wrote.
    assert_eq!(
        image_below(low_a, &web_a).await,
        "mirror.a.example/hub/library/nginx:1.25"
    );
    let upper_a = json(up(), &["-n", "shop", "get", "pod", &web_a]).await;
    assert_eq!(upper_a["spec"]["containers"][0]["image"], "nginx:1.25");
    assert!(upper_a["metadata"]["annotations"][names::OVERRIDES].is_null());
    let lower_a = json(low_a, &["-n", "shop", "get", "pod", &web_a]).await;
    assert_eq!(recorded(&lower_a), ["mirror"]);
    let selector = format!("involvedObject.name={web_a},reason=LowerPodCreated");
    tensile_e2e::wait::within("the event naming the rules", 30, || async {
        let said = kubectl(
            up(),
            &[
                "-n",
                "shop",
                "get",
                "events",
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={.items[0].message}",
            ],
        )
        .await;
        match said.trim().ends_with(" with override rules mirror") {
            true => Ok(()),
            false => Err(said),
        }
    })
    .await;
    // lower-b: its image as written, on a dedicated node (the toleration and nodeSelector
    // took it there), with its region.
    let lower_b = json(low_b, &["-n", "shop", "get", "pod", &web_b]).await;
    assert_eq!(lower_b["spec"]["containers"][0]["image"], "nginx:1.25");
    assert_eq!(recorded(&lower_b), ["dedicated"]);
    assert!(
        lower_b["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "dedicated" && t["value"] == "fleet"),
        "{}",
        lower_b["spec"]
    );
    assert_eq!(lower_b["spec"]["nodeSelector"]["pool"], "fleet");
    assert!(lower_b["spec"]["nodeName"].as_str().unwrap().starts_with("b-"));
    assert_eq!(
        lower_b["spec"]["containers"][0]["env"],
        serde_json::json!([{"name": "REGION", "value": "b"}])
    );
    assert_eq!(lower_b["metadata"]["labels"]["region"], "b");
    let upper_b = json(up(), &["-n", "shop", "get", "pod", &web_b]).await;
    assert!(
        upper_b["spec"]["containers"][0]["env"].is_null(),
        "the upper pod is untouched"
    );
    assert!(upper_b["metadata"]["labels"]["region"].is_null());

    // The StatefulSet's claims: each cluster's class below, Bound on both sides.
    let db = placed("db", 2).await;
    for (lower, node, class) in [(low_a, "vn-a", "fast"), (low_b, "vn-b", "premium-b")] {
        let claim = format!("data-{}", on(&db, node));
        for (cluster, want) in [(lower, format!("{class} Bound")), (up(), "fast Bound".to_owned())] {
            eventually(
                cluster,
                &format!("{claim} {want}"),
                90,
                &[
                    "-n",
                    "shop",
                    "get",
                    "pvc",
                    &claim,
                    "-o",
                    "jsonpath={.spec.storageClassName} {.status.phase}",
                ],
                &want,
            )
            .await;
        }
        scene::pod_running(lower, "shop", &on(&db, node), 90).await;
    }

    // The rule is edited while pods run: another mirror.
    scene::pod_running(low_a, "shop", "solo", 90).await;
    assert_eq!(
        image_below(low_a, "solo").await,
        "mirror.a.example/hub/library/nginx:1.25"
    );
    write(
        &file_a,
        "rules:\n- name: mirror\n  image: {prefix: {from: docker.io/, to: mirror2.a.example/}}\n",
    );
    until_counted(&vn_a, "overrides_loaded", 1).await;
    // A running pod's new image goes through the rules it was made with.
    kubectl(
        up(),
        &["-n", "shop", "set", "image", "pod/solo", "app=nginx:1.27"],
    )
    .await;
    eventually_image(low_a, "solo", "mirror.a.example/hub/library/nginx:1.27").await;
    // A new pod gets the edited rule; the pods that ran keep theirs.
    apply(up(), &pod("late", "vn-a", "nginx:1.25", "{}")).await;
    eventually_image(low_a, "late", "mirror2.a.example/library/nginx:1.25").await;
    assert_eq!(
        image_below(low_a, &web_a).await,
        "mirror.a.example/hub/library/nginx:1.25"
    );

    // A malformed edit is refused; the rules in force stay.
    write(
        &file_a,
        "rules:\n- name: mirror\n  image: {regex: {pattern: '(', replacement: x}}\n",
    );
    until_counted(&vn_a, "overrides_refused", 1).await;
    apply(up(), &pod("later", "vn-a", "busybox:1", "{}")).await;
    eventually_image(low_a, "later", "mirror2.a.example/library/busybox:1").await;

    // A rule is judged by what it can produce: a `test` on a label the sample pod lacks hides
    // no hostNetwork, and allowPrivileged does not let a rule that names no namespace weaken
    // isolation. Refused at load; the rules in force stay.
    write(
        &file_a,
        "allowPrivileged: true\nrules:\n- name: gated\n  patch:\n  \
         - {op: test, path: /metadata/labels/fast, value: 'yes'}\n  \
         - {op: add, path: /spec/hostNetwork, value: true}\n",
    );
    until_counted(&vn_a, "overrides_refused", 2).await;
    // What the sample pod cannot show (a second container) is checked on each pod.
    write(
        &file_a,
        "allowPrivileged: true\nrules:\n- name: sidecar\n  patch:\n  \
         - {op: test, path: /spec/containers/1/name, value: side}\n  \
         - {op: add, path: /spec/containers/1/securityContext, value: {privileged: true}}\n",
    );
    until_counted(&vn_a, "overrides_loaded", 2).await;
    apply(
        up(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: sided, namespace: shop}
spec:
  nodeSelector: {kubernetes.io/hostname: vn-a}
  tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
  terminationGracePeriodSeconds: 1
  containers: [{name: app, image: nginx}, {name: side, image: busybox}]
"#,
    )
    .await;
    scene::pod_shows(
        up(),
        "shop",
        "sided",
        r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].message}"#,
        "override rule \"sidecar\" of this lower cluster: it would add a privileged container side, \
         which allowPrivileged allows only to rules that name their namespaces",
        30,
    )
    .await;
    let below = tensile_e2e::kubectl::run(low_a, &["-n", "shop", "get", "pod", "sided"]).await;
    assert!(
        !below.ok && below.stderr.contains("NotFound"),
        "nothing below: {}",
        below.stdout
    );

    // A rule that cannot apply to one pod refuses that pod, with the reason; the others run.
    apply(
        up(),
        &pod(
            "zoned",
            "vn-b",
            "nginx:1.25",
            r#"{clusterSelector: '{"nodeSelector":{"pool":"gpu"}}'}"#,
        ),
    )
    .await;
    let message = r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].message}"#;
    let refused = "override rule \"dedicated\" of this lower cluster: nodeSelector pool=fleet contradicts the pod's pool=gpu";
    scene::pod_shows(up(), "shop", "zoned", message, refused, 30).await;
    let reason = scene::pod_field(
        up(),
        "shop",
        "zoned",
        r#"jsonpath={.status.conditions[?(@.type=="tensile.io/LowerPodSynced")].reason}"#,
    )
    .await;
    assert_eq!(reason.trim(), "OverrideFailed");
    let events = kubectl(
        up(),
        &[
            "-n",
            "shop",
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=zoned,reason=OverrideFailed",
            "-o",
            "name",
        ],
    )
    .await;
    assert!(!events.trim().is_empty(), "an OverrideFailed event");
    let below = tensile_e2e::kubectl::run(low_b, &["-n", "shop", "get", "pod", "zoned"]).await;
    assert!(
        !below.ok && below.stderr.contains("NotFound"),
        "nothing below: {}",
        below.stdout
    );
    scene::pod_running(low_b, "shop", &web_b, 90).await;
    assert_eq!(counter(&vn_b, "overrides_refused").await, 0);
    drop((vn_a, vn_b));
}

/// The documented "dedicated nodes behind a taint" rule: lower-b's nodes are tainted
/// `dedicated=fleet:NoSchedule`, and its rule tolerates the taint for every pod it creates
/// there. The fit predicate must judge that lower pod, not the stash alone, or the
/// multi-scheduler filters the node out for every pod (and the descheduler never moves a
/// pod there). Here the standalone multi-scheduler is given a node over lower-b alone.
#[tokio::test]
async fn the_multi_scheduler_places_pods_on_a_cluster_whose_rule_tolerates_its_dedicated_taint() {
    let _alone = ALONE.lock().await;
    let bed = bed();
    tensile_e2e::chart::install_exclusion_records(up()).await.unwrap();
    let file: PathBuf = bed.upper.dir().join("overrides-fleet.yaml");
    write(&file, DEDICATED);
    let _vn = scene::virtual_node(&bed.upper, "vn-fleet", &bed.lower_b, |args| {
        args.overrides_file = Some(file);
        args.node_labels = vec![("fleet-test".into(), "yes".into())];
    })
    .unwrap();
    // The published shape and rules: the group's taint, and the rule that tolerates it.
    let overrides = r#"jsonpath={.metadata.annotations.tensile\.io/placement-overrides}"#;
    let published = r#"{"v":1,"rules":[{"name":"dedicated","tolerations":[{"effect":"NoSchedule","key":"dedicated","operator":"Equal","value":"fleet"}],"nodeSelector":{"pool":"fleet"}}]}"#;
    scene::node_shows(up(), "vn-fleet", overrides, published, 60).await;
    let shape = scene::node_field(
        up(),
        "vn-fleet",
        r#"jsonpath={.metadata.annotations.tensile\.io/capacity-shape}"#,
    )
    .await;
    assert!(
        shape.contains("dedicated"),
        "the lower nodes' taint is in the shape: {shape}"
    );
    // Only this test's pods go to vn-fleet.
    kubectl(
        up(),
        &[
            "taint",
            "node",
            "vn-fleet",
            "fleet-test=yes:NoSchedule",
            "--overwrite",
        ],
    )
    .await;
    bed.upper.create_namespace("fleet").await.unwrap();

    let scheduler = tensile_e2e::multi_scheduler::StandaloneProcess::start(
        &bed.upper,
        up(),
        "fleet-scheduler",
        &[
            "--node-selector=type=virtual-kubelet,fleet-test=yes".to_owned(),
            "--exclusions-configmap=kube-system/fleet-exclusions".to_owned(),
        ],
        "fleet",
    )
    .unwrap();
    scheduler.wait_ready(Duration::from_secs(30)).await.unwrap();
    apply(
        up(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: worker, namespace: fleet}
spec:
  schedulerName: fleet-scheduler
  tolerations:
  - {key: virtual-kubelet.io/provider, operator: Exists}
  - {key: fleet-test, operator: Exists}
  terminationGracePeriodSeconds: 1
  containers: [{name: app, image: "nginx:1.25", resources: {requests: {cpu: 100m}}}]
"#,
    )
    .await;
    scene::pod_shows(
        up(),
        "fleet",
        "worker",
        "jsonpath={.spec.nodeName}",
        "vn-fleet",
        60,
    )
    .await;
    let low_b = bed.lower_b.kubeconfig();
    scene::pod_running(low_b, "fleet", "worker", 90).await;
    let below = json(low_b, &["-n", "fleet", "get", "pod", "worker"]).await;
    assert!(
        below["spec"]["nodeName"]
            .as_str()
            .is_some_and(|n| n.starts_with("b-")),
        "on a dedicated node: {}",
        below["spec"]["nodeName"]
    );
    assert_eq!(recorded(&below), vec!["dedicated".to_owned()]);

    // A pod whose own nodeSelector the rule contradicts is refused by the virtual node, so
    // the multi-scheduler keeps it off vn-fleet and says why.
    apply(
        up(),
        r#"
apiVersion: v1
kind: Pod
metadata: {name: elsewhere, namespace: fleet, annotations: {clusterSelector: '{"nodeSelector":{"pool":"batch"}}'}}
spec:
  schedulerName: fleet-scheduler
  tolerations:
  - {key: virtual-kubelet.io/provider, operator: Exists}
  - {key: fleet-test, operator: Exists}
  containers: [{name: app, image: "nginx:1.25"}]
"#,
    )
    .await;
    scene::pod_shows(
        up(),
        "fleet",
        "elsewhere",
        r#"jsonpath={.status.conditions[?(@.type=="PodScheduled")].reason}"#,
        "Unschedulable",
        60,
    )
    .await;
    let message = scene::pod_field(
        up(),
        "fleet",
        "elsewhere",
        r#"jsonpath={.status.conditions[?(@.type=="PodScheduled")].message}"#,
    )
    .await;
    assert!(
        message.contains("dedicated") && message.contains("contradicts"),
        "the message names the rule: {message}"
    );
}
