//! What runs in a simulated container when someone execs into it: a small command set that
//! makes exec tests meaningful.
//!
//! | command | does |
//! |---|---|
//! | `echo [-n] ARGS…` | prints the arguments |
//! | `cat` | copies stdin to stdout until stdin ends |
//! | `env` | prints `PATH`, `HOSTNAME`, the container's literal `env` entries and, with a tty, `TERM=xterm` |
//! | `hostname` | prints the pod's hostname (`spec.hostname` or its name) |
//! | `sh -c 'exit N'` | exits with N; `sh -c 'CMD ARGS…; CMD ARGS…'` runs commands of this set in turn, `exit N` ending the script |
//! | `sleep N` | waits N seconds (fractions allowed) |
//! | `stty size` | prints the terminal's `rows cols` from the last resize event; with a tty, waits up to 2 s for the first (as a runtime sizes a terminal from the first event), else `0 0` |
//! | `true`, `false` | exit 0, exit 1 |
//!
//! Anything else fails with exit code 127 and `exec: "X": executable file not found in
//! $PATH` on stderr. An exit code other than 0 reaches kubectl through the error channel as
//! the kubelet reports it (`NonZeroExitCode`), so `kubectl exec` exits with it.

use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Output channels, numbered as the remote-command protocols number them.
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;

/// Terminal size (columns, rows) from the last resize event.
pub type Size = Option<(u16, u16)>;

/// What a command runs with.
pub struct Context {
    /// `None` when the caller attached no stdin; ends when the caller closes it.
    pub stdin: Option<mpsc::Receiver<Bytes>>,
    pub out: mpsc::Sender<(u8, Bytes)>,
    pub size: watch::Receiver<Size>,
    pub tty: bool,
    pub env: Vec<(String, String)>,
    pub hostname: String,
    /// Cancelled when the caller is gone.
    pub gone: CancellationToken,
}

impl Context {
    async fn print(&self, channel: u8, text: impl Into<String>) {
        let _ = self.out.send((channel, Bytes::from(text.into()))).await;
    }
}

/// Runs `command` and returns its exit code.
pub async fn run(command: &[String], ctx: &mut Context) -> i32 {
    let Some((name, args)) = command.split_first() else {
        ctx.print(STDERR, "no command\n").await;
        return 127;
    };
    match (name.as_str(), args) {
        ("echo", [flag, rest @ ..]) if flag == "-n" => {
            ctx.print(STDOUT, rest.join(" ")).await;
            0
        }
        ("echo", args) => {
            ctx.print(STDOUT, format!("{}\n", args.join(" "))).await;
            0
        }
        ("cat", []) => {
            if let Some(stdin) = ctx.stdin.as_mut() {
                loop {
                    let chunk = tokio::select! {
                        chunk = stdin.recv() => chunk,
                        _ = ctx.gone.cancelled() => None,
                    };
                    let Some(chunk) = chunk else { break };
                    if ctx.out.send((STDOUT, chunk)).await.is_err() {
                        break;
                    }
                }
            }
            0
        }
        ("env", []) => {
            let mut text = String::new();
            for (k, v) in env_of(ctx) {
                text.push_str(&format!("{k}={v}\n"));
            }
            ctx.print(STDOUT, text).await;
            0
        }
        ("hostname", []) => {
            ctx.print(STDOUT, format!("{}\n", ctx.hostname)).await;
            0
        }
        ("sh", [c, script]) if c == "-c" => {
            let mut code = 0;
            for line in script.split(';').map(str::trim).filter(|l| !l.is_empty()) {
                match script_exit(line) {
                    Some(Ok(exit)) => return exit,
                    Some(Err(e)) => {
                        ctx.print(STDERR, format!("sh: {e}\n")).await;
                        return 2;
                    }
                    None => {
                        let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
                        if words.first().is_some_and(|w| w == "sh") {
                            ctx.print(STDERR, "sh: nested shells are not simulated\n").await;
                            return 2;
                        }
                        code = Box::pin(run(&words, ctx)).await;
                    }
                }
            }
            code
        }
        ("sleep", [secs]) => match secs
            .parse::<f64>()
            .ok()
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
        {
            Some(d) => {
                tokio::select! {
                    _ = tokio::time::sleep(d) => 0,
                    _ = ctx.gone.cancelled() => 137,
                }
            }
            None => {
                ctx.print(STDERR, format!("sleep: invalid time interval '{secs}'\n"))
                    .await;
                1
            }
        },
        ("stty", [size]) if size == "size" => {
            if ctx.tty && ctx.size.borrow().is_none() {
                let first = ctx.size.wait_for(Option::is_some);
                let _ = tokio::time::timeout(Duration::from_secs(2), first).await;
            }
            let (cols, rows) = ctx.size.borrow().unwrap_or((0, 0));
            ctx.print(STDOUT, format!("{rows} {cols}\n")).await;
            0
        }
        ("true", []) => 0,
        ("false", []) => 1,
        (other, _) => {
            ctx.print(
                STDERR,
                format!("exec: \"{other}\": executable file not found in $PATH\n"),
            )
            .await;
            127
        }
    }
}

fn env_of(ctx: &Context) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "PATH".to_owned(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        ),
        ("HOSTNAME".to_owned(), ctx.hostname.clone()),
    ];
    env.extend(ctx.env.iter().cloned());
    if ctx.tty {
        env.push(("TERM".to_owned(), "xterm".to_owned()));
    }
    env
}

/// `Some` when `script` is `exit N` (or `exit`).
fn script_exit(script: &str) -> Option<Result<i32, String>> {
    let mut words = script.split_whitespace();
    if words.next() != Some("exit") {
        return None;
    }
    Some(match (words.next(), words.next()) {
        (None, _) => Ok(0),
        (Some(n), None) => n
            .parse::<i64>()
            .map(|n| (n & 0xff) as i32)
            .map_err(|_| format!("exit: Illegal number: {n}")),
        (Some(_), Some(_)) => Err("exit: too many arguments".to_owned()),
    })
}

/// The error-channel status for an exit code, as the kubelet writes it (v4 and later).
pub fn status(command: &[String], code: i32) -> serde_json::Value {
    if code == 0 {
        return json!({"metadata": {}, "status": "Success"});
    }
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!(
            "command terminated with non-zero exit code: error executing command {command:?}, exit code {code}"
        ),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
    })
}

/// A resize event: `{"Width":…,"Height":…}`.
pub fn parse_resize(json: &[u8]) -> Option<(u16, u16)> {
    let v: serde_json::Value = serde_json::from_slice(json).ok()?;
    let w = u16::try_from(v.get("Width")?.as_u64()?).ok()?;
    let h = u16::try_from(v.get("Height")?.as_u64()?).ok()?;
    Some((w, h))
}

/// Turns `\n` into `\r\n`, as a terminal in cooked mode does with output.
pub fn onlcr(data: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 8);
    let mut prev = 0u8;
    for &b in data {
        if b == b'\n' && prev != b'\r' {
            out.push(b'\r');
        }
        out.push(b);
        prev = b;
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|s| s.to_string()).collect()
    }

    async fn exec(words: &[&str], stdin: Option<&[u8]>, tty: bool) -> (i32, String, String) {
        let (out_tx, mut out_rx) = mpsc::channel(64);
        let stdin = stdin.map(|bytes| {
            let (tx, rx) = mpsc::channel(4);
            let bytes = Bytes::copy_from_slice(bytes);
            tokio::spawn(async move {
                let _ = tx.send(bytes).await;
            });
            rx
        });
        let (_size_tx, size) = watch::channel(Some((80, 24)));
        let mut ctx = Context {
            stdin,
            out: out_tx,
            size,
            tty,
            env: vec![("GREETING".into(), "hi".into())],
            hostname: "pod-1".into(),
            gone: CancellationToken::new(),
        };
        let code = run(&strings(words), &mut ctx).await;
        drop(ctx);
        let (mut out, mut err) = (String::new(), String::new());
        while let Some((ch, b)) = out_rx.recv().await {
            let s = String::from_utf8_lossy(&b).into_owned();
            if ch == STDOUT {
                out.push_str(&s)
            } else {
                err.push_str(&s)
            }
        }
        (code, out, err)
    }

    #[tokio::test]
    async fn the_command_set_behaves_as_documented() {
        assert_eq!(
            exec(&["echo", "hi", "there"], None, false).await,
            (0, "hi there\n".into(), "".into())
        );
        assert_eq!(exec(&["echo", "-n", "x"], None, false).await.1, "x");
        assert_eq!(exec(&["cat"], Some(b"abc"), false).await.1, "abc");
        assert_eq!(exec(&["hostname"], None, false).await.1, "pod-1\n");
        let env = exec(&["env"], None, true).await.1;
        assert!(
            env.contains("HOSTNAME=pod-1\n") && env.contains("GREETING=hi\n") && env.contains("TERM=xterm")
        );
        assert!(!exec(&["env"], None, false).await.1.contains("TERM="));
        assert_eq!(exec(&["sh", "-c", "exit 3"], None, false).await.0, 3);
        assert_eq!(exec(&["sh", "-c", "exit"], None, false).await.0, 0);
        assert_eq!(exec(&["sh", "-c", "echo a b"], None, false).await.1, "a b\n");
        assert_eq!(exec(&["sh", "-c", "exit x"], None, false).await.0, 2);
        assert_eq!(
            exec(&["sh", "-c", "echo a; false; echo b"], None, false).await,
            (0, "a\nb\n".into(), "".into())
        );
        assert_eq!(
            exec(&["sh", "-c", "echo a; exit 4; echo b"], None, false).await,
            (4, "a\n".into(), "".into())
        );
        assert_eq!(exec(&["sleep", "0.01"], None, false).await.0, 0);
        assert_eq!(exec(&["stty", "size"], None, true).await.1, "24 80\n");
        let (code, _, err) = exec(&["ls"], None, false).await;
        assert_eq!(code, 127);
        assert!(err.contains("\"ls\": executable file not found"));
        assert_eq!(exec(&["false"], None, false).await.0, 1);
    }

    #[tokio::test]
    async fn stty_size_under_a_tty_waits_for_the_first_resize() {
        let (out, mut printed) = mpsc::channel(4);
        let (sized, size) = watch::channel(None);
        let mut ctx = Context {
            stdin: None,
            out,
            size,
            tty: true,
            env: Vec::new(),
            hostname: "pod-1".into(),
            gone: CancellationToken::new(),
        };
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = sized.send(Some((132, 43)));
        });
        assert_eq!(run(&strings(&["stty", "size"]), &mut ctx).await, 0);
        assert_eq!(
            printed.recv().await.map(|(_, b)| b),
            Some(Bytes::from("43 132\n"))
        );
    }

    #[test]
    fn statuses_and_resizes_read_as_the_kubelet_writes_them() {
        assert_eq!(status(&[], 0)["status"], "Success");
        let failed = status(&strings(&["sh", "-c", "exit 3"]), 3);
        assert_eq!(failed["reason"], "NonZeroExitCode");
        assert_eq!(failed["details"]["causes"][0]["message"], "3");
        assert_eq!(parse_resize(br#"{"Width":120,"Height":40}"#), Some((120, 40)));
        assert_eq!(parse_resize(b"nonsense"), None);
        assert_eq!(&onlcr(b"a\nb\r\n")[..], b"a\r\nb\r\n");
    }
}
