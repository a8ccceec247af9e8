//! An HTTP proxy on loopback that only tunnels (`CONNECT`), as a corporate proxy does for
//! HTTPS, counting the tunnels it opened: what tests point `HTTPS_PROXY` or a kubeconfig's
//! `proxy-url` at to see a client go through it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running tunnelling proxy; stops when dropped.
pub struct ConnectProxy {
    port: u16,
    tunnels: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl ConnectProxy {
    /// Listens on 127.0.0.1, on a port of its own.
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let tunnels = Arc::new(AtomicUsize::new(0));
        let counted = tunnels.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let _ = tunnel(client, &counted).await;
                });
            }
        });
        Ok(Self { port, tunnels, task })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Tunnels opened so far.
    pub fn tunnels(&self) -> usize {
        self.tunnels.load(Ordering::SeqCst)
    }
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn tunnel(mut client: TcpStream, counted: &AtomicUsize) -> std::io::Result<()> {
    // The request head, up to its blank line (a CONNECT has no body).
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if client.read(&mut byte).await? == 0 || head.len() > 8192 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.split_whitespace();
    let (Some("CONNECT"), Some(target)) = (words.next(), words.next()) else {
        client
            .write_all(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            .await?;
        return Ok(());
    };
    let mut upstream = match TcpStream::connect(target).await {
        Ok(s) => s,
        Err(_) => {
            client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await?;
            return Ok(());
        }
    };
    counted.fetch_add(1, Ordering::SeqCst);
    client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}
