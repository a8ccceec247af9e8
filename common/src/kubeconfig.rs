//! Building a [`kube::Client`]: from an explicit kubeconfig file, or from the pod's
//! service account when no file is named.
//!
//! A missing or broken kubeconfig is an error that names the file; there is no silent
//! fallback from a named file to another source. Every client carries a connect timeout and
//! a per-call deadline ([`crate::deadline`]), and, for a daemon that elects a leader, a fence
//! that refuses writes while it does not lead ([`crate::leader::Fence`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::deadline::DeadlineLayer;
use crate::leader::{FenceLayer, Leadership};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("a stream client presents the configured credential, never a node identity")]
    StreamWithIdentity,
    #[error("kubeconfig {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path}: not usable: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path}: cannot build a client: {source}")]
    Client {
        path: PathBuf,
        #[source]
        source: kube::Error,
    },
    #[error(
        "no --kubeconfig given and not running in a pod ({source}): pass --kubeconfig, or run in the cluster with a service account"
    )]
    NoInCluster {
        #[source]
        source: kube::config::InClusterError,
    },
    #[error("in-cluster configuration: cannot build a client: {source}")]
    InClusterClient {
        #[source]
        source: kube::Error,
    },
    #[error("{what}: not a usable kubeconfig: {source}")]
    InMemory {
        what: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("{what}: cannot build a client: {source}")]
    InMemoryClient {
        what: String,
        #[source]
        source: kube::Error,
    },
}

/// How every API client of a daemon talks to its apiserver, flattened into each daemon.
#[derive(Clone, Debug, clap::Args)]
pub struct ClientArgs {
    /// Seconds a TCP and TLS connection to an apiserver may take.
    #[arg(long = "connect-timeout", env = "TENSILE_CONNECT_TIMEOUT", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub connect_timeout: u64,
    /// Seconds an API call (not a watch) may take, answer included; a call past it fails
    /// and is retried, so a half-open connection never holds a worker.
    #[arg(long = "request-timeout", env = "TENSILE_REQUEST_TIMEOUT", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout: u64,
}

impl Default for ClientArgs {
    fn default() -> Self {
        Self {
            connect_timeout: 5,
            request_timeout: 15,
        }
    }
}

/// Client settings applied on top of what the kubeconfig says.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The context to use instead of the kubeconfig's current one.
    pub context: Option<String>,
    pub connect_timeout: Duration,
    /// Deadline of every call that is not a watch or a followed stream.
    pub request_timeout: Duration,
    /// Writes are refused unless this leadership is held (reads always pass).
    pub fence: Option<Leadership>,
    /// Sent as `User-Agent`, so the apiserver's audit log names the process.
    pub user_agent: Option<String>,
    /// Whether the client itself repeats calls answered 429, 503 or 504 (kube's server
    /// retry, within the deadline). Off for a caller that acts on a 429 itself: the
    /// Eviction API answers 429 when a PodDisruptionBudget allows no eviction, and
    /// repeating that only runs into the deadline.
    pub server_retry: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientArgs::default().options()
    }
}

impl ClientArgs {
    /// Options for a client of this daemon (no fence, no user agent).
    pub fn options(&self) -> ClientOptions {
        ClientOptions {
            context: None,
            connect_timeout: Duration::from_secs(self.connect_timeout),
            request_timeout: Duration::from_secs(self.request_timeout),
            fence: None,
            server_retry: true,
            user_agent: None,
        }
    }
}

/// The cluster of `kubeconfig`'s context `context` (its current context when `None`).
pub fn cluster_of<'a>(
    kubeconfig: &'a Kubeconfig,
    context: Option<&str>,
) -> Option<&'a kube::config::Cluster> {
    let context = context
        .map(str::to_owned)
        .or_else(|| kubeconfig.current_context.clone())?;
    let cluster = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == context)?
        .context
        .as_ref()?
        .cluster
        .clone();
    kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == cluster)?
        .cluster
        .as_ref()
}

/// The CA (PEM) `cluster` names, inline (`certificate-authority-data`) or from its file;
/// `None` when it names none.
pub fn ca_pem(cluster: &kube::config::Cluster) -> std::io::Result<Option<Vec<u8>>> {
    use base64::Engine as _;
    if let Some(data) = &cluster.certificate_authority_data {
        return base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("certificate-authority-data: {e}"),
                )
            });
    }
    cluster
        .certificate_authority
        .as_ref()
        .map(std::fs::read)
        .transpose()
}

/// Loads `path` and returns the [`kube::Config`] it describes.
pub async fn config_from_file(path: &Path, options: &ClientOptions) -> Result<kube::Config, Error> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })?;
    config_of(kubeconfig, options)
        .await
        .map_err(|source| Error::Invalid {
            path: path.to_owned(),
            source,
        })
}

/// The configuration `kubeconfig` describes, with the proxy it names (else the
/// environment's) and `options` applied.
async fn config_of(
    kubeconfig: Kubeconfig,
    options: &ClientOptions,
) -> Result<kube::Config, kube::config::KubeconfigError> {
    let opts = KubeConfigOptions {
        context: options.context.clone(),
        ..Default::default()
    };
    let named = named_proxy(&kubeconfig, options.context.as_deref());
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &opts).await?;
    config.proxy_url = named;
    tune(&mut config, options);
    Ok(config)
}

/// The `proxy-url` the kubeconfig names for the cluster of `context` (its current context
/// when `None`). kube's own loading also takes `HTTPS_PROXY`, without client-go's rules for
/// loopback addresses and `NO_PROXY`; [`tune`] applies those to a kubeconfig that names none.
fn named_proxy(kubeconfig: &Kubeconfig, context: Option<&str>) -> Option<http::Uri> {
    cluster_of(kubeconfig, context)?
        .proxy_url
        .as_deref()
        .filter(|p| !p.trim().is_empty())?
        .parse()
        .ok()
}

/// Applies `options`, and the proxy of the environment (by client-go's rules) when the
/// configuration names none.
fn tune(config: &mut kube::Config, options: &ClientOptions) {
    if config.proxy_url.is_none() {
        config.proxy_url = proxy_from_env(&config.cluster_url, |name| std::env::var(name).ok());
    }
    config.default_retry = options.server_retry;
    config.connect_timeout = Some(options.connect_timeout);
    config.write_timeout = Some(options.request_timeout);
    if let Some(agent) = &options.user_agent
        && let Ok(value) = http::HeaderValue::from_str(agent)
    {
        config.headers.push((http::header::USER_AGENT, value));
    }
}

fn build(config: kube::Config, options: &ClientOptions) -> Result<kube::Client, kube::Error> {
    client_of(&config, options, Protocols::Negotiated)
}

/// The proxy a client of `server` goes through when its kubeconfig names none: `HTTPS_PROXY`
/// (or `https_proxy`; `HTTP_PROXY` for a plain-HTTP server) unless the server is
/// `localhost` or a loopback address, or `NO_PROXY` (or `no_proxy`) names it, by client-go's
/// rules: hosts and domains (`example.com`, `.example.com` and `*.example.com` take its
/// subdomains too), IP addresses, IPv4 and IPv6 CIDR ranges, an entry's `:port` compared
/// when given, and `*` for every host.
pub fn proxy_from_env(server: &http::Uri, env: impl Fn(&str) -> Option<String>) -> Option<http::Uri> {
    let get = |upper: &str| {
        env(upper)
            .or_else(|| env(&upper.to_ascii_lowercase()))
            .filter(|v| !v.trim().is_empty())
    };
    let plain = server.scheme_str() == Some("http");
    let proxy = if plain {
        get("HTTP_PROXY")?
    } else {
        get("HTTPS_PROXY")?
    };
    let host = server
        .host()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let port = server.port_u16().unwrap_or(if plain { 80 } else { 443 });
    if host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
        return None;
    }
    if let Some(no_proxy) = get("NO_PROXY")
        && no_proxy
            .split(',')
            .map(str::trim)
            .any(|entry| bypasses(entry, &host, port))
    {
        return None;
    }
    // A proxy given as host:port is an HTTP proxy, as client-go takes it.
    let proxy = if proxy.contains("://") {
        proxy
    } else {
        format!("http://{proxy}")
    };
    proxy.parse().ok()
}

/// Whether the `NO_PROXY` entry `entry` names `host` (at `port`).
fn bypasses(entry: &str, host: &str, port: u16) -> bool {
    let entry = entry.to_ascii_lowercase();
    if entry.is_empty() {
        return false;
    }
    if entry == "*" {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>()
        && let Some((net, bits)) = entry.split_once('/')
    {
        let (Ok(net), Ok(bits)) = (net.parse::<std::net::IpAddr>(), bits.parse::<u32>()) else {
            return false;
        };
        return in_range(ip, net, bits);
    }
    let (name, entry_port) = split_port(&entry);
    if entry_port.is_some_and(|p| p != port) {
        return false;
    }
    if let (Ok(ip), Ok(named)) = (host.parse::<std::net::IpAddr>(), name.parse::<std::net::IpAddr>()) {
        return ip == named;
    }
    let domain = name.trim_start_matches('*').trim_start_matches('.');
    !domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}")))
}

/// An entry's name and port: `name`, `name:port`, `[v6]`, `[v6]:port` (a bare IPv6
/// address has no port).
fn split_port(entry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = entry.strip_prefix('[')
        && let Some((address, after)) = rest.split_once(']')
    {
        return (address, after.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match entry.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => (name, port.parse().ok()),
        _ => (entry, None),
    }
}

fn in_range(ip: std::net::IpAddr, net: std::net::IpAddr, bits: u32) -> bool {
    use std::net::IpAddr;
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) if bits <= 32 => {
            let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) if bits <= 128 => {
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// Which HTTP versions a client's connections may speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocols {
    /// HTTP/2 when the apiserver offers it in the TLS handshake (ALPN), else HTTP/1.1.
    /// Every call and watch of the client then shares one connection per apiserver.
    Negotiated,
    /// HTTP/1.1 only: an upgrade (exec, attach, port-forward) takes a connection of its own.
    Http1,
}

/// How long an HTTP/2 connection may bring nothing before the client pings the apiserver,
/// and how long it then waits for the answer before it closes the connection with every
/// call and watch on it (which then fail, and are retried or restarted on a new one). A
/// connection a partition left half-open is so found dead within their sum; HTTP/1.1 has no
/// such check, and a watch on a dead HTTP/1.1 connection waits for the kernel.
pub const PING_AFTER_IDLE: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// The flow-control windows an HTTP/2 client offers: a watch whose reader falls behind holds
/// at most its stream's window of the connection's, so a few slow readers never stall the
/// other calls on the connection (client-go offers 4 MiB a stream too).
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;

/// A client of `config` with `options`: through the proxy the configuration names (HTTP,
/// or HTTPS to the proxy), connections that send every write at once (`TCP_NODELAY`: a
/// small write is not held for the peer's delayed acknowledgement), the connect timeout,
/// kube's server retry when `options` ask for it (not for upgrades), the per-call deadline,
/// the fence, and its connections as lanes ([`crate::lanes`]).
fn client_of(
    config: &kube::Config,
    options: &ClientOptions,
    protocols: Protocols,
) -> Result<kube::Client, kube::Error> {
    use hyper_util::client::legacy::connect::proxy::Tunnel;
    use kube::client::ConfigExt as _;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    match config.proxy_url.as_ref() {
        Some(proxy) if proxy.scheme_str() == Some("http") => {
            let tunnel = with_proxy_authorization(proxy, Tunnel::new(proxy.clone(), http));
            client_over(config, options, protocols, tunnel)
        }
        Some(proxy) if proxy.scheme_str() == Some("https") => {
            let to_proxy = config.rustls_https_connector_with_connector(http)?;
            let tunnel = with_proxy_authorization(proxy, Tunnel::new(proxy.clone(), to_proxy));
            client_over(config, options, protocols, tunnel)
        }
        Some(proxy) => Err(kube::Error::ProxyProtocolUnsupported {
            proxy_url: Box::new(proxy.clone()),
        }),
        None => client_over(config, options, protocols, http),
    }
}

/// `tunnel` presenting the credentials the proxy's address carries, if any.
fn with_proxy_authorization<C>(
    proxy: &http::Uri,
    tunnel: hyper_util::client::legacy::connect::proxy::Tunnel<C>,
) -> hyper_util::client::legacy::connect::proxy::Tunnel<C> {
    match proxy_authorization(proxy) {
        Some(header) => tunnel.with_auth(header),
        None => tunnel,
    }
}

/// The `Proxy-Authorization` (`Basic`) of the credentials a proxy's address carries
/// (`http://user:password@host:port`, percent-escaped), `None` when it carries none.
fn proxy_authorization(proxy: &http::Uri) -> Option<http::HeaderValue> {
    use base64::Engine as _;
    let (userinfo, _) = proxy.authority()?.as_str().split_once('@')?;
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let decoded = |part: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8_lossy()
            .into_owned()
    };
    let plain = format!("{}:{}", decoded(user), decoded(password));
    let value = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(plain)
    );
    http::HeaderValue::from_str(&value).ok()
}

fn client_over<C>(
    config: &kube::Config,
    options: &ClientOptions,
    protocols: Protocols,
    connector: C,
) -> Result<kube::Client, kube::Error>
where
    C: tower::Service<http::Uri> + Clone + Send + Sync + 'static,
    C::Response:
        hyper::rt::Read + hyper::rt::Write + hyper_util::client::legacy::connect::Connection + Send + Unpin,
    C::Future: Send + 'static,
    C::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt as _;
    let tls = config.rustls_client_config()?;
    let mut https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls::pki_types::ServerName::try_from(name.clone())
            .map_err(|e| kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e)))?;
        https = https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let https = match protocols {
        Protocols::Negotiated => https.enable_all_versions().wrap_connector(connector),
        Protocols::Http1 => https.enable_http1().wrap_connector(connector),
    };
    let mut lane = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    lane.timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .http2_keep_alive_interval(PING_AFTER_IDLE)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .http2_initial_stream_window_size(STREAM_WINDOW)
        .http2_initial_connection_window_size(CONNECTION_WINDOW);
    let lanes = crate::lanes::Lanes::new(move || lane.build(https.clone()));
    // An upgrade is not repeated: its caller (a user's exec, attach or port-forward) sees
    // the refusal.
    let retry = (config.default_retry && protocols == Protocols::Negotiated)
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = tower::ServiceBuilder::new()
        .option_layer(options.fence.clone().map(|leadership| FenceLayer { leadership }))
        .layer(DeadlineLayer {
            deadline: options.request_timeout,
        })
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(lanes);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
}

/// A client for `kubeconfig`, a kubeconfig held in memory (read from a Secret, say) that
/// errors name as `what`.
pub async fn client_from_kubeconfig(
    kubeconfig: Kubeconfig,
    what: &str,
    options: &ClientOptions,
) -> Result<kube::Client, Error> {
    let config = config_of(kubeconfig, options)
        .await
        .map_err(|source| Error::InMemory {
            what: what.to_owned(),
            source,
        })?;
    build(config, options).map_err(|source| Error::InMemoryClient {
        what: what.to_owned(),
        source,
    })
}

/// Loads `path` and builds a client for it.
pub async fn client_from_file(path: &Path, options: &ClientOptions) -> Result<kube::Client, Error> {
    client(Some(path), options).await
}

/// A client from `path`, or from the pod's service account when `path` is `None`.
pub async fn client(path: Option<&Path>, options: &ClientOptions) -> Result<kube::Client, Error> {
    ClientSource::new(path, options).await?.client()
}

/// What a client is built from, kept so that a fresh client (with fresh connections) can be
/// built after a failure. A call that outlived its deadline may have met a dead connection:
/// over HTTP/2 every call of the client shares it until its ping goes unanswered (up to
/// [`PING_AFTER_IDLE`] and [`PING_TIMEOUT`]), over HTTP/1.1 the pool may hold more dead ones
/// (after a partition, every idle connection is). A fresh client is how a heartbeat stops
/// waiting on them, as the kubelet closes all its connections when a heartbeat fails.
#[derive(Clone)]
pub struct ClientSource {
    path: Option<PathBuf>,
    config: kube::Config,
    options: ClientOptions,
    /// The client certificate its clients present instead of the configured credential,
    /// renewed in place ([`NodeCredential`]).
    identity: Option<NodeCredential>,
}

/// A client certificate that is replaced while clients built with it run: each client
/// checks on every call whether it is still current and, if not, builds its connections
/// anew with the current one (calls in flight finish on the old connections).
#[derive(Clone)]
pub struct NodeCredential {
    current: Arc<RwLock<(u64, crate::node_identity::Issued)>>,
}

impl NodeCredential {
    pub fn new(issued: crate::node_identity::Issued) -> Self {
        Self {
            current: Arc::new(RwLock::new((0, issued))),
        }
    }

    /// The certificate in use, and its generation.
    pub fn current(&self) -> (u64, crate::node_identity::Issued) {
        match self.current.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Puts `issued` in use for every client's next call.
    pub fn replace(&self, issued: crate::node_identity::Issued) {
        let mut current = match self.current.write() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        *current = (current.0 + 1, issued);
    }
}

/// `config` presenting `issued` as its only credential.
fn with_certificate(config: &kube::Config, issued: &crate::node_identity::Issued) -> kube::Config {
    use base64::Engine as _;
    let engine = base64::engine::general_purpose::STANDARD;
    let mut config = config.clone();
    config.auth_info = kube::config::AuthInfo {
        client_certificate_data: Some(engine.encode(&issued.cert_pem)),
        client_key_data: Some(engine.encode(&issued.key_pem).into()),
        ..kube::config::AuthInfo::default()
    };
    config
}

/// The service under a client of a [`NodeCredential`]: a client built with the current
/// certificate, built again once the certificate changed.
#[derive(Clone)]
struct Rotating {
    config: kube::Config,
    options: ClientOptions,
    credential: NodeCredential,
    built: Arc<Mutex<Option<(u64, kube::Client)>>>,
}

impl Rotating {
    fn client(&self) -> Result<kube::Client, kube::Error> {
        let (generation, issued) = self.credential.current();
        let mut built = match self.built.lock() {
            Ok(b) => b,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some((at, client)) = built.as_ref()
            && *at == generation
        {
            return Ok(client.clone());
        }
        let client = build(with_certificate(&self.config, &issued), &self.options)?;
        *built = Some((generation, client.clone()));
        Ok(client)
    }
}

impl tower::Service<http::Request<kube::client::Body>> for Rotating {
    type Response = http::Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, kube::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), kube::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let client = self.client();
        Box::pin(async move { client?.send(request).await })
    }
}

impl ClientSource {
    /// Reads `path`, or the pod's service account when `path` is `None`.
    pub async fn new(path: Option<&Path>, options: &ClientOptions) -> Result<Self, Error> {
        let config = match path {
            Some(path) => config_from_file(path, options).await?,
            None => {
                let mut config = kube::Config::incluster().map_err(|source| Error::NoInCluster { source })?;
                config.proxy_url = None;
                tune(&mut config, options);
                config
            }
        };
        Ok(Self {
            path: path.map(Path::to_owned),
            config,
            options: options.clone(),
            identity: None,
        })
    }

    /// The same source, its clients presenting `credential` (a node's client certificate)
    /// instead of the configured credential, which then only asks for it.
    pub fn with_identity(&self, credential: NodeCredential) -> Self {
        let mut source = self.clone();
        source.identity = Some(credential);
        source
    }

    /// The same source, its clients refusing writes unless `leadership` is held.
    pub fn fenced(&self, leadership: Leadership) -> Self {
        let mut source = self.clone();
        source.options.fence = Some(leadership);
        source
    }

    /// A client that could not be built, named by where its configuration came from.
    fn client_error(&self, source: kube::Error) -> Error {
        match &self.path {
            Some(path) => Error::Client {
                path: path.clone(),
                source,
            },
            None => Error::InClusterClient { source },
        }
    }

    /// A new client for interactive streams (exec, attach, port-forward, followed logs),
    /// sharing no connection with any other. Its connections send every write at once
    /// (`TCP_NODELAY`): kube's own connector leaves Nagle's algorithm on, and a stream that
    /// relays a small write while the previous one is unacknowledged then waits for the
    /// peer's delayed acknowledgement (40 ms on Linux) on every request-and-answer. It has
    /// the connect timeout and the per-call deadline (until the answer's head, or the `101`
    /// of an upgrade), and no retries.
    pub fn stream_client(&self) -> Result<kube::Client, Error> {
        if self.identity.is_some() {
            return Err(Error::StreamWithIdentity);
        }
        client_of(&self.config, &self.options, Protocols::Http1).map_err(|source| self.client_error(source))
    }

    /// A new client, sharing no connection with any other.
    pub fn client(&self) -> Result<kube::Client, Error> {
        match &self.identity {
            Some(credential) => {
                let service = Rotating {
                    config: self.config.clone(),
                    options: self.options.clone(),
                    credential: credential.clone(),
                    built: Arc::default(),
                };
                service.client().map_err(|source| self.client_error(source))?;
                Ok(kube::Client::new(service, self.config.default_namespace.clone()))
            }
            None => build(self.config.clone(), &self.options).map_err(|source| self.client_error(source)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn a_proxy_address_with_credentials_is_answered_with_basic_authorization() {
        let proxy: http::Uri = "http://alice:p%40ss%3Aword@proxy:3128".parse().unwrap();
        // base64 of "alice:p@ss:word"
        assert_eq!(proxy_authorization(&proxy).unwrap(), "Basic YWxpY2U6cEBzczp3b3Jk");
        let bare: http::Uri = "http://bob@proxy:3128".parse().unwrap();
        assert_eq!(proxy_authorization(&bare).unwrap(), "Basic Ym9iOg==");
        let none: http::Uri = "http://proxy:3128".parse().unwrap();
        assert_eq!(proxy_authorization(&none), None);
    }

    #[test]
    fn a_stray_percent_sign_in_proxy_credentials_is_kept_as_written() {
        // base64 of "a%2:%zzA%"
        let proxy: http::Uri = "http://a%2:%zz%41%@proxy:3128".parse().unwrap();
        assert_eq!(proxy_authorization(&proxy).unwrap(), "Basic YSUyOiV6ekEl");
    }

    #[test]
    fn the_proxy_a_kubeconfig_names_is_its_current_clusters() {
        let text = "apiVersion: v1\nkind: Config\ncurrent-context: b\n\
                    clusters:\n- name: a\n  cluster: {server: 'https://a:6443', proxy-url: 'http://pa:3128'}\n\
                    - name: b\n  cluster: {server: 'https://b:6443', proxy-url: 'http://pb:3128'}\n\
                    - name: c\n  cluster: {server: 'https://c:6443'}\n\
                    contexts:\n- name: a\n  context: {cluster: a, user: u}\n- name: b\n  context: {cluster: b, user: u}\n\
                    - name: c\n  context: {cluster: c, user: u}\n\
                    users:\n- name: u\n  user: {token: t}\n";
        let kubeconfig = Kubeconfig::from_yaml(text).unwrap();
        let named = |context: Option<&str>| named_proxy(&kubeconfig, context).map(|u| u.to_string());
        assert_eq!(named(None).as_deref(), Some("http://pb:3128/"));
        assert_eq!(named(Some("a")).as_deref(), Some("http://pa:3128/"));
        assert_eq!(
            named(Some("c")),
            None,
            "none named: the environment decides, by client-go's rules"
        );
        assert_eq!(named(Some("missing")), None);
    }

    #[test]
    fn https_proxy_is_taken_unless_no_proxy_names_the_host() {
        let server: http::Uri = "https://lower-a.example.com:6443".parse().unwrap();
        let proxy = |vars: &[(&str, &str)]| proxy_from_env(&server, env(vars)).map(|u| u.to_string());
        assert_eq!(proxy(&[]), None);
        assert_eq!(
            proxy(&[("HTTPS_PROXY", "http://proxy:3128")]).as_deref(),
            Some("http://proxy:3128/")
        );
        assert_eq!(
            proxy(&[("https_proxy", "proxy:3128")]).as_deref(),
            Some("http://proxy:3128/"),
            "host:port is HTTP"
        );
        assert_eq!(
            proxy(&[("HTTP_PROXY", "http://proxy:3128")]),
            None,
            "an HTTPS server takes HTTPS_PROXY"
        );
        for no in [
            "example.com",
            ".example.com",
            "lower-a.example.com",
            "*",
            "other, example.com:6443",
        ] {
            assert_eq!(
                proxy(&[("HTTPS_PROXY", "http://proxy:3128"), ("NO_PROXY", no)]),
                None,
                "{no}"
            );
        }
        for no in [
            "ample.com",
            "lower-b.example.com",
            "10.0.0.0/8",
            "",
            "example.com:443",
        ] {
            assert!(
                proxy(&[("HTTPS_PROXY", "http://proxy:3128"), ("no_proxy", no)]).is_some(),
                "{no}"
            );
        }
        let by_ip: http::Uri = "https://10.1.2.3:6443".parse().unwrap();
        let via = |no: &str| proxy_from_env(&by_ip, env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", no)]));
        assert!(via("10.0.0.0/8").is_none() && via("10.1.2.3").is_none());
        assert!(via("10.1.2.4").is_some() && via("192.168.0.0/16").is_some() && via("10.0.0.0/33").is_some());
        let v6: http::Uri = "https://[fd00::5]:6443".parse().unwrap();
        assert!(
            proxy_from_env(
                &v6,
                env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "fd00::/8")])
            )
            .is_none()
        );
    }

    #[test]
    fn the_clients_own_retry_of_429_is_on_by_default_and_off_when_the_caller_acts_on_it() {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        tune(&mut config, &ClientOptions::default());
        assert!(config.default_retry);
        let options = ClientOptions {
            server_retry: false,
            ..ClientOptions::default()
        };
        tune(&mut config, &options);
        assert!(!config.default_retry);
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.kubeconfig");
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        let msg = err.to_string();
        assert!(msg.contains("nope.kubeconfig"), "{msg}");
        assert!(msg.contains("cannot read"), "{msg}");
    }

    #[tokio::test]
    async fn a_malformed_kubeconfig_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.kubeconfig");
        std::fs::write(&path, "clusters: [this is not: a kubeconfig").unwrap();
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        assert!(err.to_string().contains("bad.kubeconfig"), "{err}");
    }

    #[tokio::test]
    async fn a_kubeconfig_without_a_context_is_not_usable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.kubeconfig");
        std::fs::write(&path, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        let err = client_from_file(&path, &ClientOptions::default())
            .await
            .err()
            .expect("the kubeconfig is rejected");
        let msg = err.to_string();
        assert!(
            msg.contains("empty.kubeconfig") && msg.contains("not usable"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn without_a_kubeconfig_outside_a_pod_the_error_says_what_to_pass() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return;
        }
        let err = client(None, &ClientOptions::default())
            .await
            .err()
            .expect("no configuration is found");
        assert!(err.to_string().contains("pass --kubeconfig"), "{err}");
    }
}
