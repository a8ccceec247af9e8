//! Child processes of the test bed.
//!
//! Every child is started through `setpriv --pdeathsig KILL` from one spawner thread that
//! lives as long as the process, so the kernel kills the children when the process dies,
//! however it dies (panic, SIGKILL, a static that is never dropped). A [`Service`] also
//! kills its child when dropped.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot create log file {path}: {source}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the process spawner thread is gone")]
    SpawnerGone,
}

type Request = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        // This thread never ends before the process does: it is the children's parent
        // thread, and PDEATHSIG fires when the parent thread exits.
        std::thread::Builder::new()
            .name("e2e-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                loop {
                    std::thread::park();
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!("cannot start the spawner thread: {e}"));
        Mutex::new(tx)
    })
}

/// A running child process whose output goes to a log file.
#[derive(Debug)]
pub struct Service {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    program: PathBuf,
    args: Vec<String>,
}

impl Service {
    /// Starts `program args`, appending stdout and stderr to `log`.
    pub fn start(name: &str, program: &Path, args: &[String], log: &Path) -> Result<Self, Error> {
        let mut service = Self {
            name: name.to_owned(),
            child: None,
            log: log.to_owned(),
            program: program.to_owned(),
            args: args.to_vec(),
        };
        service.restart()?;
        Ok(service)
    }

    /// Starts the process again with the same arguments (after [`Service::stop`]).
    pub fn restart(&mut self) -> Result<(), Error> {
        self.stop();
        let log_err = |source| Error::Log {
            path: self.log.clone(),
            source,
        };
        if let Some(dir) = self.log.parent() {
            std::fs::create_dir_all(dir).map_err(log_err)?;
        }
        let out = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(log_err)?;
        let err = out.try_clone().map_err(log_err)?;
        let mut cmd = Command::new("setpriv");
        cmd.arg("--pdeathsig")
            .arg("KILL")
            .arg("--")
            .arg(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .map_err(|_| Error::SpawnerGone)?
            .send((cmd, tx))
            .map_err(|_| Error::SpawnerGone)?;
        let child = rx
            .recv()
            .map_err(|_| Error::SpawnerGone)?
            .map_err(|source| Error::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        self.child = Some(child);
        Ok(())
    }

    /// Kills the process and reaps it. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// `Some(status)` when the process has exited on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// The last `max` bytes of the log, for error messages.
    pub fn log_tail(&self, max: u64) -> String {
        log_tail(&self.log, max)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn log_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Sends `signal` (a name `kill -s` takes: `TERM`, `STOP`, `CONT`, `KILL`) to `pid`.
pub fn signal(pid: u32, signal: &str) -> Result<(), String> {
    let out = Command::new("kill")
        .args(["-s", signal.trim_start_matches("SIG"), &pid.to_string()])
        .output()
        .map_err(|e| format!("cannot run kill: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "kill -s {signal} {pid}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// True while a process with this PID exists (zombies included).
pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The TCP connections process `pid` holds open (established), to port `to` only if given.
pub fn open_connections(pid: u32, to: Option<u16>) -> std::io::Result<usize> {
    let mut inodes = std::collections::HashSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        if let Ok(target) = std::fs::read_link(fd?.path())
            && let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
        {
            inodes.insert(inode.to_owned());
        }
    }
    let to = to.map(|port| format!(":{port:04X}"));
    let mut open = 0;
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        open += text
            .lines()
            .skip(1)
            .filter(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                // Field 2 is the remote address (hex, `ADDR:PORT`), state 01 is ESTABLISHED,
                // field 9 the socket's inode.
                fields.get(3) == Some(&"01")
                    && fields.get(9).is_some_and(|i| inodes.contains(*i))
                    && to
                        .as_ref()
                        .is_none_or(|port| fields.get(2).is_some_and(|r| r.ends_with(port.as_str())))
            })
            .count();
    }
    Ok(open)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_logs_and_dies_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x/sleep.log");
        let svc = Service::start(
            "sh",
            Path::new("/bin/sh"),
            &["-c".into(), "echo hello-from-child; exec sleep 60".into()],
            &log,
        )
        .unwrap();
        let pid = svc.pid().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !svc.log_tail(100).contains("hello-from-child") && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(svc.log_tail(100).contains("hello-from-child"));
        assert!(pid_alive(pid));
        drop(svc);
        assert!(!pid_alive(pid), "child {pid} survived its Service");
    }

    #[test]
    fn a_missing_program_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut svc = Service::start("nope", Path::new("/bin/true"), &[], &dir.path().join("l")).unwrap();
        // setpriv itself starts; the missing program shows as a quick non-zero exit with a log line.
        svc.program = PathBuf::from("/nonexistent/binary");
        svc.restart().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let status = loop {
            if let Some(s) = svc.exited() {
                break s;
            }
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert!(!status.success());
        assert!(
            svc.log_tail(500).contains("/nonexistent/binary"),
            "{}",
            svc.log_tail(500)
        );
    }
}
