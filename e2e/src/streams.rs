//! kubectl's stream commands (`exec`, `attach`, `port-forward`) over either transport, and
//! clients for the simulated container's ports: shared by the exec tests and the `streams`
//! benchmark.
//!
//! A pod made by [`pod_manifest`] declares ports 8080 and 9090; the simulated kubelet answers
//! an HTTP request on either with `<namespace>/<pod> port <port>` and echoes anything else.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};

/// Which transport kubectl uses: its default (WebSocket first) or SPDY only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    WebSocket,
    Spdy,
}

impl Via {
    /// Both, WebSocket first.
    pub const BOTH: [Via; 2] = [Via::WebSocket, Via::Spdy];

    /// `websocket` or `spdy`.
    pub fn name(self) -> &'static str {
        match self {
            Via::WebSocket => "websocket",
            Via::Spdy => "spdy",
        }
    }

    /// The value of `KUBECTL_REMOTE_COMMAND_WEBSOCKETS` and `KUBECTL_PORT_FORWARD_WEBSOCKETS`.
    pub fn websockets_env(self) -> &'static str {
        match self {
            Via::WebSocket => "true",
            Via::Spdy => "false",
        }
    }
}

/// A pod on `node` with ports 8080 and 9090 and one literal env entry (YAML).
pub fn pod_manifest(ns: &str, name: &str, node: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: app
    image: busybox
    env: [{{name: GREETING, value: hello-from-below}}]
    ports: [{{containerPort: 8080}}, {{containerPort: 9090}}]
"#
    )
}

/// `kubectl --kubeconfig KUBECONFIG ARGS…` speaking `via` for exec, attach and port-forward;
/// killed when dropped.
pub fn kubectl_command(kubeconfig: &Path, via: Via, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(crate::kubectl::binary_for(kubeconfig));
    cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
    cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", via.websockets_env())
        .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", via.websockets_env())
        .kill_on_drop(true);
    cmd
}

/// What one kubectl run gave.
pub struct Run {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Run {
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Runs kubectl with `stdin` fed to it; fails when it does not finish within 60 s.
pub async fn kubectl_run(
    kubeconfig: &Path,
    via: Via,
    args: &[&str],
    stdin: Option<Vec<u8>>,
) -> anyhow::Result<Run> {
    let mut cmd = kubectl_command(kubeconfig, via, args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().context("starting kubectl")?;
    if let Some(data) = stdin
        && let Some(mut pipe) = child.stdin.take()
    {
        tokio::spawn(async move {
            let _ = pipe.write_all(&data).await;
            drop(pipe);
        });
    }
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("kubectl {args:?} did not finish in 60 s"))?
        .context("waiting for kubectl")?;
    Ok(Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// `kubectl exec -i POD -- cat` kept open: each [`Cat::round_trip`] writes one line and reads
/// it back.
pub struct Cat {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: BufReader<tokio::process::ChildStdout>,
    line: Vec<u8>,
}

impl Cat {
    pub async fn start(kubeconfig: &Path, via: Via, ns: &str, pod: &str) -> anyhow::Result<Cat> {
        let mut cmd = kubectl_command(kubeconfig, via, &["-n", ns, "exec", "-i", pod, "--", "cat"]);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().context("starting kubectl exec")?;
        let stdin = child.stdin.take().context("kubectl's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("kubectl's stdout")?);
        let mut cat = Cat {
            child,
            stdin,
            stdout,
            line: Vec::new(),
        };
        // The first line also waits for the session to be up.
        cat.round_trip(b"hello\n", Duration::from_secs(30))
            .await
            .with_context(|| format!("{via:?}: exec -i {ns}/{pod} -- cat"))?;
        Ok(cat)
    }

    /// Writes `line` (ending in a newline), reads it back within `within` and checks it is
    /// the same; the time from the write to the last byte back.
    pub async fn round_trip(&mut self, line: &[u8], within: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        self.stdin.write_all(line).await.context("writing to kubectl")?;
        self.stdin.flush().await.context("writing to kubectl")?;
        self.line.clear();
        tokio::time::timeout(within, self.stdout.read_until(b'\n', &mut self.line))
            .await
            .map_err(|_| anyhow::anyhow!("no echo within {within:?}"))?
            .context("reading from kubectl")?;
        let took = started.elapsed();
        anyhow::ensure!(
            self.line == line,
            "sent {:?}, got {:?}",
            String::from_utf8_lossy(line),
            String::from_utf8_lossy(&self.line)
        );
        Ok(took)
    }
}

impl Cat {
    /// Waits up to `within` for kubectl to end (its session closed); `None` while it runs.
    pub async fn ended_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }
}

impl Drop for Cat {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// `kubectl port-forward` in the background until dropped.
pub struct Forward {
    child: tokio::process::Child,
}

impl Forward {
    /// Starts `kubectl -n NS port-forward POD MAPPINGS…` and waits until it forwards every
    /// mapping (30 s at most).
    pub async fn start(
        kubeconfig: &Path,
        via: Via,
        ns: &str,
        pod: &str,
        mappings: &[String],
    ) -> anyhow::Result<Forward> {
        let mut args = vec!["-n", ns, "port-forward", pod];
        args.extend(mappings.iter().map(String::as_str));
        let mut cmd = kubectl_command(kubeconfig, via, &args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl port-forward")?;
        let mut stdout = child.stdout.take().context("kubectl's stdout")?;
        let mut seen = String::new();
        let mut buf = [0u8; 1024];
        let want = mappings.len();
        while seen.matches("Forwarding from 127.0.0.1:").count() < want {
            match tokio::time::timeout(Duration::from_secs(30), stdout.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
                _ => {
                    let mut err = String::new();
                    let _ = child.kill().await;
                    if let Some(mut stderr) = child.stderr.take() {
                        let _ = stderr.read_to_string(&mut err).await;
                    }
                    anyhow::bail!("{via:?}: port-forward said {seen:?}; stderr {err}");
                }
            }
        }
        // Keep draining what it prints ("Handling connection for …").
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            while let Ok(n) = stdout.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        });
        Ok(Forward { child })
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// `GET /` on 127.0.0.1:`port` with `Connection: close`: the whole answer, within 20 s.
pub async fn http_get(port: u16) -> anyhow::Result<String> {
    let io = async {
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        tcp.write_all(b"GET / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
            .await?;
        let mut out = String::new();
        tcp.read_to_string(&mut out).await?;
        anyhow::Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(20), io)
        .await
        .map_err(|_| anyhow::anyhow!("GET on port {port}: no answer in 20 s"))?
        .with_context(|| format!("GET on port {port}"))
}

/// Sends `data` to 127.0.0.1:`port` and reads as many bytes back, within 20 s.
pub async fn echo(port: u16, data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .with_context(|| format!("connecting to port {port}"))?;
    tcp.write_all(data).await.context("writing the echo")?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(20), tcp.read_exact(&mut back))
        .await
        .map_err(|_| anyhow::anyhow!("echo on port {port}: not all back in 20 s"))?
        .context("reading the echo")?;
    Ok(back)
}

/// Pushes `bytes` through the echo on 127.0.0.1:`port`, writing and reading at once on one
/// connection, and checks that every byte comes back as sent; the time from the first write
/// to the last byte back (within `within`).
pub async fn echo_throughput(port: u16, bytes: u64, within: Duration) -> anyhow::Result<Duration> {
    const CHUNK: usize = 64 * 1024;
    // Byte i of the stream is i % 251: any chunk is a slice of this table.
    let table: std::sync::Arc<Vec<u8>> =
        std::sync::Arc::new((0..CHUNK + 251).map(|i| (i % 251) as u8).collect());
    let at = |offset: u64| (offset % 251) as usize;
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .with_context(|| format!("connecting to port {port}"))?;
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    let (mut read, mut write) = tcp.into_split();
    let started = Instant::now();
    let sent_table = table.clone();
    let writer = async move {
        let mut sent = 0u64;
        while sent < bytes {
            let n = (bytes - sent).min(CHUNK as u64) as usize;
            let from = at(sent);
            write
                .write_all(&sent_table[from..from + n])
                .await
                .context("writing the echo")?;
            sent += n as u64;
        }
        // Keep the write half open: the echo ends when this side closes the connection.
        anyhow::Ok(write)
    };
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        let mut got = 0u64;
        while got < bytes {
            let n = read.read(&mut buf).await.context("reading the echo")?;
            anyhow::ensure!(n > 0, "the echo ended after {got} of {bytes} bytes");
            let from = at(got);
            anyhow::ensure!(
                buf[..n] == table[from..from + n],
                "bytes {got}..{} came back different",
                got + n as u64
            );
            got += n as u64;
        }
        anyhow::Ok(())
    };
    let (written, read) = tokio::time::timeout(within, async { tokio::join!(writer, reader) })
        .await
        .map_err(|_| anyhow::anyhow!("{bytes} bytes not echoed on port {port} within {within:?}"))?;
    read?;
    let took = started.elapsed();
    drop(written?);
    Ok(took)
}

/// The interpreter of the venv with the official Kubernetes Python client, which
/// `scripts/python-client.sh` makes once into the user's cache.
pub fn python_client_interpreter() -> anyhow::Result<&'static Path> {
    static PYTHON: std::sync::OnceLock<Result<std::path::PathBuf, String>> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| crate::run_script("python-client.sh", &[]).map(Into::into))
        .as_ref()
        .map(std::path::PathBuf::as_path)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Runs `e2e/python/client_streams.py` (the official Python client's exec and port-forward on
/// pod `ns/pod`, through `kubeconfig`'s apiserver) and returns the JSON it prints; fails when
/// it does not finish within 120 s or prints no JSON.
pub async fn python_client_streams(
    kubeconfig: &Path,
    ns: &str,
    pod: &str,
    port: u16,
) -> anyhow::Result<serde_json::Value> {
    let python = tokio::task::spawn_blocking(python_client_interpreter)
        .await
        .context("installing the Python client")??;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/client_streams.py");
    let out = tokio::process::Command::new(python)
        .arg(&script)
        .arg(kubeconfig)
        .args([ns, pod, &port.to_string()])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .map_err(|_| anyhow::anyhow!("{} did not finish in 120 s", script.display()))?
        .with_context(|| format!("running {}", script.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "{} {ns}/{pod}: {}; stderr {stderr}",
        script.display(),
        out.status
    );
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "{} printed no JSON: {}; stderr {stderr}",
            script.display(),
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
