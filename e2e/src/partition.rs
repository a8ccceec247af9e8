//! A TCP relay on loopback that can lose its connections the way a network partition does:
//! [`Partition::cut`] stops relaying on every open connection without closing it (the client
//! sees a half-open connection, as after a dropped NAT entry or a dead load balancer), and
//! connections made meanwhile hang; [`Partition::heal`] lets new connections through, while
//! the cut ones stay dead forever. Pausing the apiserver (SIGSTOP) is not the same: the
//! kernel keeps buffering, and every request is answered at the resume.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running relay; dropping it stops accepting (open connections end with their tasks).
pub struct Partition {
    pub port: u16,
    state: Arc<State>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct State {
    /// Connections of an earlier generation were cut and never relay again.
    generation: AtomicU64,
    cut: AtomicBool,
}

impl State {
    /// Returns once a connection of generation `born` may relay; never, if it was cut.
    async fn wait_open(&self, born: u64) {
        loop {
            if self.generation.load(Ordering::SeqCst) != born {
                // Lost: both sockets stay open and nothing is relayed, forever.
                std::future::pending::<()>().await;
            }
            if !self.cut.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

impl Partition {
    /// Relays `127.0.0.1:<port>` to `target`.
    pub async fn start(target: std::net::SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State::default());
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let state = shared.clone();
                let born = state.generation.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(relay(cr, sw, &state, born), relay(sr, cw, &state, born));
                });
            }
        });
        Ok(Self { port, state, accept })
    }

    /// Every open connection stops relaying for good; new ones hang until [`Self::heal`].
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        self.state.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Connections made after the cut relay again; the cut ones stay dead.
    pub fn heal(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: &State,
    born: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        state.wait_open(born).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
