//! The descheduler's rounds against a real apiserver: a record write never overwrites a
//! change it did not see, and the eviction caps bound evictions per interval.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use kube::api::Api;
use tensile_common::exclusion::{self, ExclusionRecord, Location, Record};
use tensile_e2e::check::kubectl;
use tensile_e2e::{ClusterOptions, TestCluster};

const NAMESPACE: &str = "records";
const KEY: &str = "6d1c5e1e-0000-4000-8000-00000000000a";

fn record(moves: u32, exhausted: Option<Timestamp>) -> Record {
    let until = Timestamp::now() + SignedDuration::from_mins(10);
    Record {
        namespace: "shop".into(),
        kind: "ReplicaSet".into(),
        name: "web-7d4b9".into(),
        nodes: [("vn-a".to_owned(), until)].into(),
        moves,
        expires: until,
        exhausted,
    }
}

/// The record as the apiserver holds it.
async fn stored(kubeconfig: &std::path::Path) -> Record {
    let out = kubectl(
        kubeconfig,
        &[
            "-n",
            NAMESPACE,
            "get",
            "exclusionrecords",
            &exclusion::object_name(KEY),
            "-o",
            "json",
        ],
    )
    .await;
    let object: ExclusionRecord = serde_json::from_str(&out).expect("an ExclusionRecord");
    exclusion::decode(&object).expect("a record").1
}

/// The descheduler computed a move from the record at one version; meanwhile another writer
/// (a leader that had not stopped yet, an operator's edit) gave the workload up. The write
/// must not reset what it did not see: nothing is written, the caller is told, and the
/// record it then reads is the newer one.
#[tokio::test]
async fn a_record_write_computed_from_an_older_record_overwrites_nothing() {
    let mut options = ClusterOptions::new("rounds-records", "upper");
    options.scheduler = false;
    let cluster = TestCluster::start(options).await.expect("the upper cluster");
    let kubeconfig = cluster.kubeconfig().to_path_buf();
    tensile_e2e::chart::install_exclusion_records(&kubeconfig)
        .await
        .expect("the ExclusionRecord definition");
    cluster.create_namespace(NAMESPACE).await.expect("the namespace");
    let client = cluster.client().await.expect("a client");
    let location = Location {
        namespace: NAMESPACE.into(),
        name: "exclusions".into(),
    };
    let (synced, seen, feed) = exclusion::follow(Api::namespaced(client.clone(), NAMESPACE), &location.name);
    let feed = tokio::spawn(feed);
    tokio::time::timeout(Duration::from_secs(60), synced.synced())
        .await
        .expect("the records listed");
    let writer = exclusion::store::Writer::new(client, location, seen.clone(), "tensile-descheduler");

    // One move recorded: the base of the next computation.
    let base = writer
        .put(KEY, &record(1, None), None)
        .await
        .expect("the first write");
    assert_eq!(stored(&kubeconfig).await.moves, 1);

    // Someone else writes the record: three moves, given up.
    let mut newer = record(3, Some(Timestamp::now()));
    newer.nodes.insert("vn-b".into(), newer.expires);
    let object = exclusion::encode(NAMESPACE, KEY, &newer, Some(base.clone()), "operator").expect("encoded");
    let file = cluster.dir().join("newer-record.json");
    std::fs::write(&file, serde_json::to_vec(&object).unwrap()).unwrap();
    kubectl(&kubeconfig, &["replace", "-f", file.to_str().unwrap()]).await;

    // The descheduler's second move, computed from the first record.
    let stale = record(2, None);
    let written = writer.put(KEY, &stale, Some(&base)).await;
    assert!(
        matches!(written, Err(exclusion::store::Error::Changed(_))),
        "a write computed from an older record is refused: {written:?}"
    );
    let now = stored(&kubeconfig).await;
    assert_eq!(now.moves, 3, "the newer record's moves survive: {now:?}");
    assert!(now.exhausted.is_some(), "the give-up survives: {now:?}");
    assert!(
        now.nodes.contains_key("vn-b"),
        "the newer exclusion survives: {now:?}"
    );
    let shown = seen.borrow().clone();
    assert_eq!(
        shown.records.get(KEY).map(|r| r.moves),
        Some(3),
        "the writer's watch shows the newer record when the refusal returns"
    );

    // Computed from what the watch shows now, the write goes through.
    let version = shown.versions.get(KEY).cloned();
    let mut next = shown.records.get(KEY).cloned().unwrap();
    next.moves += 1;
    writer
        .put(KEY, &next, version.as_deref())
        .await
        .expect("a write from the current record");
    assert_eq!(stored(&kubeconfig).await.moves, 4);

    // A record deleted meanwhile (swept) is created afresh: nothing of it is left to lose.
    let current = seen.borrow().versions.get(KEY).cloned();
    kubectl(
        &kubeconfig,
        &[
            "-n",
            NAMESPACE,
            "delete",
            "exclusionrecords",
            &exclusion::object_name(KEY),
        ],
    )
    .await;
    writer
        .put(KEY, &record(1, None), current.as_deref())
        .await
        .expect("a write over a deleted record");
    assert_eq!(stored(&kubeconfig).await.moves, 1);
    feed.abort();
}
