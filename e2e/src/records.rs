//! The exclusion records benchmark (`bench --bench exclusions`): moves per second and the
//! latency of one record's write with many live records, through the suite's one writer
//! ([`tensile_common::exclusion::store::Writer`]), against the old store, one ConfigMap
//! replaced whole on every change.
//!
//! A move here is what the descheduler does for one pod: write the workload's record, wait
//! until its own watch shows it, evict the pod. The descheduler's fixed 250 ms settle after
//! each write is left out: it is a wait, not a cost of the store.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ObjectMeta, PostParams};
use tensile_common::exclusion::{self, ExclusionRecord, Location, Record};

use crate::stats::Samples;
use crate::{ClusterOptions, TestCluster};

const NAMESPACE: &str = "bench";

fn record(i: usize, until: jiff::Timestamp) -> (String, Record) {
    let key = format!("{i:08x}-0000-4000-8000-{i:012x}");
    let record = Record {
        namespace: NAMESPACE.to_owned(),
        kind: "ReplicaSet".into(),
        name: format!("workload-{i}-5d8c7f9b6"),
        nodes: [("vn-a".to_owned(), until)].into(),
        moves: 1,
        expires: until,
        exhausted: None,
    };
    (key, record)
}

fn summary(ms: &[f64]) -> serde_json::Value {
    let s: Samples = ms.iter().copied().collect();
    serde_json::json!({
        "p50": crate::benches::round3(s.percentile(0.50)),
        "p99": crate::benches::round3(s.percentile(0.99)),
        "max": crate::benches::round3(s.max()),
    })
}

/// `live` records, then `moves` moves through the writer; then the old ConfigMap store with
/// the same records (and with `old_live` of them, which one ConfigMap can hold).
pub async fn exclusions(live: usize, moves: usize, old_live: usize) -> anyhow::Result<serde_json::Value> {
    let mut options = ClusterOptions::new("bench", "exclusions");
    options.scheduler = false; // the moved pods stay Pending, as refused pods do
    let cluster = TestCluster::start(options).await?;
    crate::chart::install_exclusion_records(cluster.kubeconfig()).await?;
    cluster.create_namespace(NAMESPACE).await?;
    let client = cluster.client().await?;
    let until = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(1);

    // The live records, created directly.
    let records: Api<ExclusionRecord> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    futures::stream::iter(0..live)
        .map(|i| {
            let records = records.clone();
            async move {
                let (key, r) = record(i, until);
                let object = exclusion::encode(NAMESPACE, &key, &r, None, "bench")?;
                records.create(&PostParams::default(), &object).await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await?;
    let create_secs = started.elapsed().as_secs_f64();

    // The pods to move.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    futures::stream::iter(0..moves)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("moved-{i}")},
                    "spec": {"containers": [{"name": "c", "image": "x"}]},
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await?;

    // A reader and the writer, as the descheduler runs them.
    let location = Location {
        namespace: NAMESPACE.to_owned(),
        name: "exclusions".to_owned(),
    };
    let started = Instant::now();
    let (synced, seen, feed) = exclusion::follow(Api::namespaced(client.clone(), NAMESPACE), &location.name);
    let feed = tokio::spawn(feed);
    tokio::time::timeout(Duration::from_secs(120), synced.synced()).await?;
    let sync_secs = started.elapsed().as_secs_f64();
    let listed = seen.borrow().records.len();
    let writer = exclusion::store::Writer::new(client.clone(), location, seen.clone(), "bench");

    let mut write_ms = Vec::with_capacity(moves);
    let mut move_ms = Vec::with_capacity(moves);
    let started = Instant::now();
    for i in 0..moves {
        let t0 = Instant::now();
        let (key, r) = record(live + i, until);
        writer.put(&key, &r, None).await?;
        write_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        let body = serde_json::json!({
            "metadata": {"name": format!("moved-{i}"), "namespace": NAMESPACE},
        });
        pods.create_subresource::<_, serde_json::Value>(
            "eviction",
            &format!("moved-{i}"),
            &PostParams::default(),
            &body,
        )
        .await?;
        move_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    let moves_secs = started.elapsed().as_secs_f64();
    let seen_at_end = seen.borrow().records.len();
    feed.abort();

    // The old store: one ConfigMap holding every record, replaced whole on each change.
    let old_at_live = old_store(&client, live, until, 1).await;
    let old_fit = old_store(&client, old_live, until, moves.min(50)).await;

    Ok(serde_json::json!({
        "benchmark": "exclusion records: moves per second and one record's write with many live records",
        "kubernetes": cluster.version(),
        "live_records": live,
        "records_created_per_sec": crate::benches::round3(live as f64 / create_secs),
        "reader_first_list_secs": crate::benches::round3(sync_secs),
        "reader_listed": listed,
        "reader_saw_at_end": seen_at_end,
        "moves": moves,
        "moves_per_sec": crate::benches::round3(moves as f64 / moves_secs),
        "move_ms": summary(&move_ms),
        "record_write_ms": summary(&write_ms),
        "note": "record_write_ms: one object written and shown by the writer's own watch; move_ms adds the eviction; the descheduler adds a fixed 250 ms settle per move",
        "old_configmap_store": {
            "at_live_records": old_at_live,
            "at_records_it_can_hold": old_fit,
        },
    }))
}

/// The old store with `n` records: the ConfigMap's size, and `writes` whole replaces (each
/// changing one record) timed; or the apiserver's refusal.
async fn old_store(
    client: &kube::Client,
    n: usize,
    until: jiff::Timestamp,
    writes: usize,
) -> serde_json::Value {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    let name = format!("old-exclusions-{n}");
    let mut data: BTreeMap<String, String> = BTreeMap::new();
    for i in 0..n {
        let (key, r) = record(i, until);
        data.insert(key, serde_json::to_string(&r).unwrap_or_default());
    }
    let bytes: usize = data.iter().map(|(k, v)| k.len() + v.len()).sum();
    let mut cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    };
    let created = match api.create(&PostParams::default(), &cm).await {
        Ok(c) => c,
        Err(e) => {
            return serde_json::json!({"records": n, "bytes": bytes, "refused": tensile_common::api::message(&e)});
        }
    };
    cm.metadata.resource_version = created.metadata.resource_version;
    let mut ms = Vec::new();
    for w in 0..writes {
        let (key, mut r) = record(w, until);
        r.moves = 2 + w as u32;
        if let (Some(d), Ok(text)) = (cm.data.as_mut(), serde_json::to_string(&r)) {
            d.insert(key, text);
        }
        let t0 = Instant::now();
        match api.replace(&name, &PostParams::default(), &cm).await {
            Ok(written) => cm.metadata.resource_version = written.metadata.resource_version,
            Err(e) => {
                return serde_json::json!({"records": n, "bytes": bytes, "refused": tensile_common::api::message(&e)});
            }
        }
        ms.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    serde_json::json!({"records": n, "bytes": bytes, "writes": writes, "write_ms": summary(&ms)})
}
