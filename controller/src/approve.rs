//! Approval of virtual nodes' client certificates (`--upper-identity=node`).
//!
//! A virtual node asks, with its own ServiceAccount, for the certificate of
//! `system:node:<name>` ([`tensile_common::node_identity`]). The controller approves a
//! request only when the account that made it is the one it made for a `LowerCluster`, and
//! the request asks for exactly the client certificate of that cluster's node: one account,
//! one node, so a compromised virtual node cannot become another node, and asks for a
//! lifetime of a day at most ([`node_identity::LIFETIME_SECONDS`]): an issued certificate
//! cannot be revoked, so its lifetime is how long it outlives the node's leaving. A request of
//! such an account for anything else, of a cluster that is leaving, or of an account of the
//! controller's naming whose cluster is gone, is denied with the reason; requests of anyone
//! else are left to the cluster's other approvers. When a cluster has left, whatever its
//! account asked that is still unanswered is denied ([`deny_unanswered`]).

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use tensile_common::{names, node_identity};

use crate::plan::{Settings, object_name};
use crate::resource::LowerCluster;

/// What to do with one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Issue it: the node's certificate, asked for by the node's account.
    Approve { node: String },
    /// One of our accounts asked for something else.
    Deny { reason: String },
    /// Answered already, or not asked by one of our accounts.
    Ignore,
}

/// The verdict on `csr` among `clusters`; `existing` is the upper Node of the name asked
/// for, when there is one: a node that is not a virtual node (a real kubelet's) is never
/// given away, and neither is a name two `LowerCluster`s claim.
pub fn decide(
    settings: &Settings,
    clusters: &[LowerCluster],
    csr: &CertificateSigningRequest,
    existing: Option<&Node>,
) -> Verdict {
    if node_identity::answered(csr) {
        return Verdict::Ignore;
    }
    let requester = csr.spec.username.as_deref().unwrap_or_default();
    let Some(cluster) = clusters.iter().find(|c| requester == account(settings, c.name())) else {
        // Every account of this naming is one the controller made for a LowerCluster.
        return if requester.starts_with(&account(settings, "")) {
            Verdict::Deny {
                reason: format!(
                    "{requester} is the account of no LowerCluster: it may ask for no certificate"
                ),
            }
        } else {
            Verdict::Ignore
        };
    };
    if cluster.metadata.deletion_timestamp.is_some() {
        return Verdict::Deny {
            reason: format!(
                "LowerCluster {} is leaving: its node gets no new certificate",
                cluster.name()
            ),
        };
    }
    let own = cluster.node_name();
    let claimed = clusters.iter().filter(|c| c.node_name() == own).count();
    let virtual_node = |n: &Node| {
        n.labels().get(names::VIRTUAL_NODE_TYPE_LABEL).map(String::as_str)
            == Some(names::VIRTUAL_NODE_TYPE_VALUE)
    };
    match node_identity::judge(csr) {
        Ok(node) if node == own && claimed > 1 => Verdict::Deny {
            reason: format!("node {node} is claimed by {claimed} LowerClusters"),
        },
        Ok(node) if node == own && existing.is_some_and(|n| !virtual_node(n)) => Verdict::Deny {
            reason: format!("node {node} exists and is not a virtual node"),
        },
        Ok(node) if node == own => match node_identity::bounded_lifetime(csr) {
            Ok(()) => Verdict::Approve { node },
            Err(refusal) => Verdict::Deny { reason: refusal.0 },
        },
        Ok(node) => Verdict::Deny {
            reason: format!("{requester} may ask for the certificate of node {own} only, not of {node}"),
        },
        Err(refusal) => Verdict::Deny {
            reason: format!("not a node client certificate: {refusal}"),
        },
    }
}

/// The user name of the account the controller makes for LowerCluster `cluster`.
pub fn account(settings: &Settings, cluster: &str) -> String {
    format!(
        "system:serviceaccount:{}:{}",
        settings.namespace,
        object_name(settings, cluster)
    )
}

/// Answers `csr` as `verdict` says (approved or denied with the reason; nothing when ignored).
pub async fn answer(api: &Api<CertificateSigningRequest>, csr: &CertificateSigningRequest, verdict: Verdict) {
    if let Err(e) = write_answer(api, csr, verdict).await {
        tracing::warn!(request = %csr.name_any(), "answering the certificate request: {e}");
    }
}

/// Writes the answer `verdict` to `csr`, guarded by the version that was judged: a request
/// answered meanwhile is never answered again.
async fn write_answer(
    api: &Api<CertificateSigningRequest>,
    csr: &CertificateSigningRequest,
    verdict: Verdict,
) -> Result<(), kube::Error> {
    let name = csr.name_any();
    let (kind, message) = match verdict {
        Verdict::Ignore => return Ok(()),
        Verdict::Approve { node } => (
            "Approved",
            format!("the client certificate of virtual node {node}, asked for by its account"),
        ),
        Verdict::Deny { reason } => ("Denied", reason),
    };
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": csr.metadata.resource_version},
        "status": {"conditions": [{
            "type": kind,
            "status": "True",
            "reason": "TensileNodeIdentity",
            "message": message,
            "lastUpdateTime": now,
        }]}
    });
    api.patch_approval(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    tracing::info!(request = %name, "{kind}: {message}");
    Ok(())
}

/// Denies every unanswered request that `account` made, of any signer and labelled or not,
/// saying that LowerCluster `cluster` left; how many there were.
pub async fn deny_unanswered(
    api: &Api<CertificateSigningRequest>,
    account: &str,
    cluster: &str,
) -> Result<usize, kube::Error> {
    let mut denied = 0;
    for csr in api.list(&kube::api::ListParams::default()).await?.items {
        if csr.spec.username.as_deref() != Some(account) || node_identity::answered(&csr) {
            continue;
        }
        let reason = format!("LowerCluster {cluster} left: its account may ask for no certificate");
        match write_answer(api, &csr, Verdict::Deny { reason }).await {
            Ok(()) => denied += 1,
            // Deleted meanwhile.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(denied)
}

/// Deletes every certificate request `account` made (once its node is stopped and the account
/// gone, none is read again: a node stopped while it waited leaves its request behind).
/// Deleting a request revokes nothing: a certificate issued ends with its lifetime.
pub async fn delete_requests(
    api: &Api<CertificateSigningRequest>,
    account: &str,
) -> Result<usize, kube::Error> {
    let mut deleted = 0;
    for csr in api.list(&kube::api::ListParams::default()).await?.items {
        if csr.spec.username.as_deref() != Some(account) {
            continue;
        }
        let only_that = kube::api::DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: csr.metadata.uid.clone(),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api
            .delete(csr.metadata.name.as_deref().unwrap_or_default(), &only_that)
            .await
        {
            Ok(_) => deleted += 1,
            // Deleted meanwhile.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}

/// Answers the certificate requests of virtual nodes as they come, for ever.
pub async fn run(upper: kube::Client, settings: Settings) {
    let api: Api<CertificateSigningRequest> = Api::all(upper.clone());
    let clusters: Api<LowerCluster> = Api::all(upper.clone());
    let nodes: Api<Node> = Api::all(upper);
    let ours = format!(
        "{}={}",
        tensile_common::names::CONTROLLER_NAMESPACE,
        settings.namespace
    );
    // Requests carry the node label; who made one is judged from the request itself.
    let requests = watcher(
        api.clone(),
        watcher::Config::default().labels(node_identity::NODE_LABEL),
    )
    .default_backoff()
    .applied_objects();
    futures::pin_mut!(requests);
    while let Some(next) = requests.next().await {
        let csr = match next {
            Ok(csr) => csr,
            Err(e) => {
                tracing::warn!("watching certificate requests: {e}");
                continue;
            }
        };
        if node_identity::answered(&csr) {
            continue;
        }
        let known = match clusters
            .list(&kube::api::ListParams::default().labels(&ours))
            .await
        {
            Ok(list) => list.items,
            Err(e) => {
                tracing::warn!("listing LowerClusters to judge a certificate request: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let asked = node_identity::judge(&csr).ok();
        let existing = match asked {
            Some(node) => match nodes.get_opt(&node).await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!("reading node {node} to judge a certificate request: {e}");
                    continue;
                }
            },
            None => None,
        };
        answer(&api, &csr, decide(&settings, &known, &csr, existing.as_ref())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::{cluster, settings};
    use k8s_openapi::ByteString;
    use k8s_openapi::api::certificates::v1::{
        CertificateSigningRequestSpec, CertificateSigningRequestStatus,
    };

    fn request(node: &str, by: &str) -> CertificateSigningRequest {
        let (pem, _) = node_identity::certificate_request(node).unwrap_or_else(|e| panic!("{e}"));
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                request: ByteString(pem.into_bytes()),
                signer_name: node_identity::SIGNER.into(),
                usages: Some(node_identity::USAGES.iter().map(|u| (*u).to_owned()).collect()),
                username: Some(by.into()),
                expiration_seconds: Some(node_identity::LIFETIME_SECONDS),
                ..CertificateSigningRequestSpec::default()
            },
            ..CertificateSigningRequest::default()
        }
    }

    #[test]
    fn a_nodes_account_gets_its_nodes_certificate_and_no_other() {
        let settings = settings();
        let (a, b) = (cluster("lower-a"), cluster("lower-b"));
        let clusters = [a.clone(), b.clone()];
        let by_a = account(&settings, "lower-a");
        assert_eq!(
            decide(&settings, &clusters, &request(a.node_name(), &by_a), None),
            Verdict::Approve {
                node: a.node_name().to_owned()
            }
        );
        let Verdict::Deny { reason } = decide(&settings, &clusters, &request(b.node_name(), &by_a), None)
        else {
            panic!("another node's certificate must be denied");
        };
        assert!(reason.contains(b.node_name()), "{reason}");
        let mut server = request(a.node_name(), &by_a);
        server.spec.usages = Some(vec!["digital signature".into(), "server auth".into()]);
        assert!(matches!(
            decide(&settings, &clusters, &server, None),
            Verdict::Deny { .. }
        ));
    }

    #[test]
    fn a_real_nodes_name_or_one_two_clusters_claim_is_never_given_away() {
        let settings = settings();
        let a = cluster("lower-a");
        let by_a = account(&settings, "lower-a");
        let csr = request(a.node_name(), &by_a);
        let kubelet: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": a.node_name()}}))
            .unwrap_or_else(|e| panic!("{e}"));
        let Verdict::Deny { reason } = decide(&settings, std::slice::from_ref(&a), &csr, Some(&kubelet))
        else {
            panic!("a real node's certificate must be denied");
        };
        assert!(reason.contains("not a virtual node"), "{reason}");
        let ours: Node = serde_json::from_value(serde_json::json!({"metadata": {
            "name": a.node_name(), "labels": {names::VIRTUAL_NODE_TYPE_LABEL: names::VIRTUAL_NODE_TYPE_VALUE}}}))
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            decide(&settings, std::slice::from_ref(&a), &csr, Some(&ours)),
            Verdict::Approve { .. }
        ));
        let mut rival = cluster("lower-b");
        rival.spec.node_name = Some(a.node_name().to_owned());
        let Verdict::Deny { reason } = decide(&settings, &[a.clone(), rival], &csr, None) else {
            panic!("a name two clusters claim must be denied");
        };
        assert!(reason.contains("claimed by 2"), "{reason}");
    }

    #[test]
    fn a_certificate_is_issued_for_the_lifetime_a_node_asks_at_most() {
        let settings = settings();
        let a = cluster("lower-a");
        let clusters = [a.clone()];
        let by_a = account(&settings, "lower-a");
        let mut csr = request(a.node_name(), &by_a);
        assert_eq!(
            decide(&settings, &clusters, &csr, None),
            Verdict::Approve {
                node: a.node_name().to_owned()
            },
            "exactly the lifetime a node asks for"
        );
        csr.spec.expiration_seconds = Some(600);
        assert!(
            matches!(decide(&settings, &clusters, &csr, None), Verdict::Approve { .. }),
            "shorter is fine"
        );
        // Without one, the signer issues for its own maximum (a year by default).
        csr.spec.expiration_seconds = None;
        let Verdict::Deny { reason } = decide(&settings, &clusters, &csr, None) else {
            panic!("a request without a lifetime must be denied");
        };
        assert_eq!(
            reason,
            "spec.expirationSeconds is not set, so the signer would issue for its own maximum: a node's \
             certificate is issued for 86400 s at most"
        );
        csr.spec.expiration_seconds = Some(10 * 365 * 24 * 3600);
        let Verdict::Deny { reason } = decide(&settings, &clusters, &csr, None) else {
            panic!("a request for ten years must be denied");
        };
        assert_eq!(
            reason,
            "spec.expirationSeconds 315360000 is longer than the 86400 s a node's certificate is issued for"
        );
        csr.spec.expiration_seconds = Some(node_identity::LIFETIME_SECONDS + 1);
        assert!(matches!(
            decide(&settings, &clusters, &csr, None),
            Verdict::Deny { .. }
        ));
    }

    #[test]
    fn a_leaving_or_gone_clusters_account_gets_no_certificate() {
        let settings = settings();
        let mut a = cluster("lower-a");
        a.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::now(),
        ));
        let csr = request(a.node_name(), &account(&settings, "lower-a"));
        assert_eq!(
            decide(&settings, std::slice::from_ref(&a), &csr, None),
            Verdict::Deny {
                reason: "LowerCluster lower-a is leaving: its node gets no new certificate".into()
            }
        );
        // An account of the controller's naming whose LowerCluster is gone asks for nothing.
        let gone = request(a.node_name(), &account(&settings, "lower-gone"));
        assert_eq!(
            decide(&settings, &[cluster("lower-a")], &gone, None),
            Verdict::Deny {
                reason:
                    "system:serviceaccount:tensile:tensile-vn-lower-gone is the account of no LowerCluster: \
                         it may ask for no certificate"
                        .into()
            }
        );
    }

    #[test]
    fn requests_of_anyone_else_or_already_answered_are_left_alone() {
        let settings = settings();
        let a = cluster("lower-a");
        let clusters = [a.clone()];
        let kubelet = request(a.node_name(), "system:node:real-node");
        assert_eq!(decide(&settings, &clusters, &kubelet, None), Verdict::Ignore);
        let elsewhere = request(a.node_name(), "system:serviceaccount:other:tensile-vn-lower-a");
        assert_eq!(decide(&settings, &clusters, &elsewhere, None), Verdict::Ignore);
        let mut answered = request(a.node_name(), &account(&settings, "lower-a"));
        answered.status = Some(CertificateSigningRequestStatus {
            certificate: Some(ByteString(b"issued".to_vec())),
            ..CertificateSigningRequestStatus::default()
        });
        assert_eq!(decide(&settings, &clusters, &answered, None), Verdict::Ignore);
    }
}
