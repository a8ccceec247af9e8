//! The HTTPS server over real TLS on loopback: bad requests get precise statuses, good ones
//! a review, and the admin port shows health and metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed step fails the test

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use tensile_webhook::{Certificates, Options, Running};

async fn start() -> Running {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut options = Options::new(
        "127.0.0.1:0".parse().unwrap(),
        Certificates::SelfSigned {
            names: vec!["127.0.0.1".into()],
        },
    );
    options.admin_address = Some("127.0.0.1:0".parse().unwrap());
    options.max_body_bytes = 64 * 1024;
    tensile_webhook::start(options).await.unwrap()
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// One keep-alive HTTPS connection trusting only `ca_pem`.
async fn connect(addr: SocketAddr, ca_pem: &str) -> Sender {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

async fn send(
    sender: &mut Sender,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (StatusCode, String) {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(ct) = content_type {
        builder = builder.header("content-type", ct);
    }
    let response = sender
        .send_request(builder.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn review(object: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "abc", "operation": "CREATE", "namespace": "default", "userInfo": {},
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": object,
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn bad_requests_get_precise_statuses_and_good_ones_a_review() {
    let running = start().await;
    let ca = running.ca_pem.clone().unwrap();
    let mut c = connect(running.address, &ca).await;
    let json = Some("application/json");

    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"virtual-pod": "true"}},
        "spec": {"containers": [{"name": "c", "image": "x"}], "nodeSelector": {"zone": "a"}}});
    let (status, body) = send(
        &mut c,
        "POST",
        "/mutate",
        Some("application/json; charset=utf-8"),
        review(pod),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["uid"], "abc");
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");

    // The same keep-alive connection keeps answering after every error.
    // method, path, content type, body, expected status, what the answer says
    type Case<'a> = (&'a str, &'a str, Option<&'a str>, Vec<u8>, StatusCode, &'a str);
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/mutate",
            json,
            b"{not json".to_vec(),
            StatusCode::BAD_REQUEST,
            "not JSON",
        ),
        (
            "POST",
            "/mutate",
            Some("text/plain"),
            review(json!({})),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "application/json",
        ),
        (
            "POST",
            "/mutate",
            None,
            review(json!({})),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "got none",
        ),
        (
            "POST",
            "/mutate",
            json,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
            StatusCode::BAD_REQUEST,
            "no request",
        ),
        (
            "POST",
            "/mutate",
            json,
            br#"{"apiVersion":"v1","kind":"Pod"}"#.to_vec(),
            StatusCode::BAD_REQUEST,
            "not an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            "POST",
            "/mutate",
            json,
            vec![b' '; 70 * 1024],
            StatusCode::PAYLOAD_TOO_LARGE,
            "65536 bytes",
        ),
        (
            "GET",
            "/mutate",
            None,
            vec![],
            StatusCode::METHOD_NOT_ALLOWED,
            "only POST",
        ),
        ("GET", "/nope", None, vec![], StatusCode::NOT_FOUND, "/nope"),
        ("GET", "/healthz", None, vec![], StatusCode::OK, "ok"),
        ("GET", "/readyz", None, vec![], StatusCode::OK, "ok"),
    ];
    for (method, path, ct, body, want, says) in cases {
        let (status, text) = send(&mut c, method, path, ct, body).await;
        assert_eq!(status, want, "{method} {path}: {text}");
        assert!(
            text.contains(says),
            "{method} {path}: {text:?} should say {says:?}"
        );
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            // The unread rest of the body ends that connection (the server says so).
            c = connect(running.address, &ca).await;
        }
    }

    // A pod that does not decode is denied in the review, with the uid.
    let broken = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"virtual-pod": "true"}}, "spec": {"containers": [], "tolerations": 7}});
    let (status, body) = send(&mut c, "POST", "/mutate", json, review(broken)).await;
    assert_eq!(status, StatusCode::OK);
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["uid"], "abc");
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("does not decode"),
        "{body}"
    );
    // A non-pod is allowed unchanged with a warning.
    let other = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "d", "operation": "CREATE", "namespace": "default", "userInfo": {},
            "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
            "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
            "object": {"metadata": {"labels": {"virtual-pod": "true"}}}}
    }))
    .unwrap();
    let (_, body) = send(&mut c, "POST", "/mutate", json, other).await;
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    assert!(
        answer["response"]["warnings"][0]
            .as_str()
            .unwrap()
            .contains("apps/v1/Deployment"),
        "{body}"
    );

    // The admin port reports what happened.
    let admin = running.admin_address.unwrap();
    let metrics = tokio::task::spawn_blocking(move || plain_get(admin, "/metrics"))
        .await
        .unwrap();
    for line in [
        "tensile_webhook_reviews_total{result=\"mutated\"} 1",
        "tensile_webhook_reviews_total{result=\"denied\"} 1",
        "tensile_webhook_reviews_total{result=\"unchanged\"} 1",
        "tensile_webhook_mutations_total 1",
        "tensile_webhook_errors_total{reason=\"too_large\"} 1",
        "tensile_webhook_errors_total{reason=\"content_type\"} 2",
        "tensile_webhook_errors_total{reason=\"bad_request\"} 3",
        "tensile_webhook_review_duration_seconds_count 10",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    let health = tokio::task::spawn_blocking(move || plain_get(admin, "/readyz"))
        .await
        .unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    running.stop().await;
}

/// A bare HTTP/1.1 GET on the plain admin port.
fn plain_get(addr: SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[tokio::test]
async fn a_stopped_server_refuses_connections() {
    let running = start().await;
    let addr = running.address;
    running.stop().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
