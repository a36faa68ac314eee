//! `deploy/fleet.sh` as a child process: a fleet of real `tally` replicas behind nginx, on
//! free loopback ports, with the script's output read line by line so a test waits on what
//! the script says (the fleet up, a replica back) instead of sleeping.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long fleet.sh may take to report the fleet up (its own bound per replica is 30 s).
pub const STARTUP_BOUND: Duration = Duration::from_secs(45);
/// How long fleet.sh may take to stop everything after SIGTERM (it drains for up to 15 s,
/// then kills what is left).
pub const STOP_BOUND: Duration = Duration::from_secs(30);
/// Attempts at finding free ports that fleet.sh then accepts.
const PORT_ATTEMPTS: usize = 5;
/// Lines of each log shown when a test fails.
const LOG_TAIL_LINES: usize = 12;

/// The store every replica is started on.
#[derive(Clone, Debug)]
pub enum FleetStore {
    /// A Celeriant server all replicas share.
    Celeriant(String),
    /// The embedded store: each replica has its own.
    Memory,
}

/// Which of fleet.sh's outputs a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A running `deploy/fleet.sh`: its replicas and nginx. Dropping it stops them all.
pub struct Fleet {
    pid: u32,
    exited: Receiver<std::io::Result<ExitStatus>>,
    status: Option<ExitStatus>,
    lines: Receiver<(Stream, String)>,
    /// Lines read while waiting for another that matched none of the waits yet: stdout and
    /// stderr race, so a line a later wait wants may arrive before the one an earlier wait
    /// wanted.
    unmatched: Vec<(Stream, String)>,
    pub stdout: Vec<String>,
    stderr: Vec<String>,
    /// `http://127.0.0.1:PORT` of nginx.
    pub lb: String,
    /// `http://127.0.0.1:PORT` of each replica, in order.
    pub replicas: Vec<String>,
    /// The pid of each replica as fleet.sh last named it (a restart names a new one).
    pub replica_pids: Vec<u32>,
    pub work_dir: Option<PathBuf>,
}

/// How a start attempt ended.
enum Start {
    Up(Box<Fleet>),
    /// fleet.sh refused a port that was free a moment earlier; try others.
    PortTaken,
}

impl Fleet {
    /// Starts `size` replicas on `store` on free loopback ports, with `env` added to
    /// fleet.sh's environment (which the test's own `TALLY_*` and `FLEET_*` never reach),
    /// retrying when another process takes a port first.
    pub fn start(store: &FleetStore, size: u16, env: &[(&str, &str)]) -> Fleet {
        for _ in 0..PORT_ATTEMPTS {
            let (base, lb) = free_ports(size);
            match Fleet::try_start(store, size, base, lb, env) {
                Start::Up(fleet) => return *fleet,
                Start::PortTaken => continue,
            }
        }
        panic!("fleet.sh found its ports taken {PORT_ATTEMPTS} times");
    }

    fn try_start(store: &FleetStore, size: u16, base: u16, lb: u16, env: &[(&str, &str)]) -> Start {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut cmd = Command::new("bash");
        cmd.arg(root.join("deploy/fleet.sh")).current_dir(root);
        for (name, _) in std::env::vars() {
            let ours = name.starts_with("TALLY_") || name.starts_with("FLEET_");
            if ours || name == "RUST_LOG" || name == "CELERIANT_ADDRESS" {
                cmd.env_remove(name);
            }
        }
        match store {
            FleetStore::Celeriant(address) => cmd
                .env("CELERIANT_ADDRESS", address)
                .env("TALLY_STORE", "celeriant"),
            FleetStore::Memory => cmd.env("TALLY_STORE", "memory"),
        };
        cmd.env("TALLY_BIN", env!("CARGO_BIN_EXE_tally"))
            .env("FLEET_SIZE", size.to_string())
            .env("FLEET_BASE_PORT", base.to_string())
            .env("FLEET_LISTEN", format!("127.0.0.1:{lb}"))
            .env("FLEET_KEEP_LOGS", "0")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child: Child = cmd.spawn().expect("bash runs deploy/fleet.sh");
        let pid = child.id();
        let (line_tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        forward_lines(stdout, Stream::Stdout, line_tx.clone());
        forward_lines(stderr, Stream::Stderr, line_tx);
        // One thread owns the child and reaps it; the test keeps only its pid.
        let (exit_tx, exited) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = exit_tx.send(child.wait());
        });

        let mut fleet = Fleet {
            pid,
            exited,
            status: None,
            lines,
            unmatched: Vec::new(),
            stdout: Vec::new(),
            stderr: Vec::new(),
            lb: format!("http://127.0.0.1:{lb}"),
            replicas: (0..size)
                .map(|i| format!("http://127.0.0.1:{}", base + i))
                .collect(),
            replica_pids: vec![0; usize::from(size)],
            work_dir: None,
        };
        // The banner's last line: by then it has named the work dir.
        let up = fleet.wait_line(STARTUP_BOUND, |stream, line| {
            stream == Stream::Stdout && line.starts_with("Ctrl-C stops everything")
        });
        if up.is_none() {
            let status = fleet.wait_exit(STOP_BOUND);
            let err = fleet.stderr();
            if status.and_then(|s| s.code()) == Some(2) && err.contains("already in use") {
                return Start::PortTaken;
            }
            panic!(
                "fleet.sh did not report the fleet up within {STARTUP_BOUND:?} ({status:?})\nstdout:\n{}\nstderr:\n{err}",
                fleet.stdout.join("\n")
            );
        }
        assert!(
            fleet
                .stdout
                .iter()
                .any(|l| l.starts_with("Tally fleet up:")),
            "fleet.sh reports the fleet up: {:?}",
            fleet.stdout
        );
        assert!(
            fleet.replica_pids.iter().all(|&p| p != 0),
            "fleet.sh names one pid per replica: {:?}",
            fleet.stdout
        );
        Start::Up(Box::new(fleet))
    }

    /// The first line of fleet.sh's output that matches `wanted` (returned) among those read
    /// but not yet matched, else reads until one does, the output ends, or `bound` passes
    /// (`None` either way). Every line read is kept.
    pub fn wait_line(
        &mut self,
        bound: Duration,
        mut wanted: impl FnMut(Stream, &str) -> bool,
    ) -> Option<String> {
        if let Some(at) = self.unmatched.iter().position(|(s, l)| wanted(*s, l)) {
            return Some(self.unmatched.remove(at).1);
        }
        let deadline = Instant::now() + bound;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((stream, line)) => {
                    self.note(stream, &line);
                    if wanted(stream, &line) {
                        return Some(line);
                    }
                    self.unmatched.push((stream, line));
                }
                Err(RecvTimeoutError::Disconnected | RecvTimeoutError::Timeout) => return None,
            }
        }
    }

    /// Keeps a line and picks out the replica pids (`replica I: pid N ...`) and the work dir.
    fn note(&mut self, stream: Stream, line: &str) {
        if stream == Stream::Stderr {
            self.stderr.push(line.to_owned());
            return;
        }
        self.stdout.push(line.to_owned());
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("replica ")
            && let Some((index, after)) = rest.split_once(": pid ")
            && let Ok(index) = index.parse::<usize>()
            && let Some(pid) = after.split(' ').next().and_then(|p| p.parse().ok())
            && let Some(slot) = self.replica_pids.get_mut(index)
        {
            *slot = pid;
        }
        if let Some(dir) = trimmed.strip_prefix("logs ") {
            self.work_dir = Some(PathBuf::from(dir.trim()));
        }
    }

    /// What fleet.sh wrote to stderr so far (as read by the last wait).
    pub fn stderr(&self) -> String {
        self.stderr.join("\n")
    }

    /// Whether fleet.sh (and so the replicas and nginx it watches) is still running.
    pub fn running(&mut self) -> bool {
        if self.status.is_some() {
            return false;
        }
        match self.exited.try_recv() {
            Ok(status) => {
                self.status = status.ok();
                false
            }
            Err(mpsc::TryRecvError::Empty) => true,
            Err(mpsc::TryRecvError::Disconnected) => false,
        }
    }

    /// Waits up to `bound` for fleet.sh to exit; its status, or `None` if it is still running.
    pub fn wait_exit(&mut self, bound: Duration) -> Option<ExitStatus> {
        if self.status.is_none()
            && let Ok(status) = self.exited.recv_timeout(bound)
        {
            self.status = status.ok();
        }
        // What it said last (the lines end with its output).
        while let Ok((stream, line)) = self.lines.recv_timeout(Duration::from_millis(100)) {
            self.note(stream, &line);
        }
        self.status
    }

    /// SIGTERM to fleet.sh, which stops nginx and drains the replicas; waits for it. Kills
    /// fleet.sh, its replicas and nginx by pid only if it does not stop within the bound.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if self.running() {
            signal("TERM", self.pid);
        }
        if let Some(status) = self.wait_exit(STOP_BOUND) {
            return Some(status);
        }
        eprintln!("fleet.sh did not stop within {STOP_BOUND:?}; killing it and its processes");
        signal("KILL", self.pid);
        let nginx = self
            .work_dir
            .as_ref()
            .and_then(|d| std::fs::read_to_string(d.join("nginx.pid")).ok())
            .and_then(|p| p.trim().parse().ok());
        for pid in self.replica_pids.iter().copied().chain(nginx) {
            signal("KILL", pid);
        }
        self.wait_exit(STOP_BOUND)
    }

    /// The last lines of every replica's log, for a failure report.
    pub fn log_tails(&self) -> String {
        let Some(dir) = &self.work_dir else {
            return String::from("(fleet.sh named no work dir)");
        };
        let mut out = String::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        names.sort();
        for path in names {
            if path.extension().is_some_and(|e| e == "log") {
                let text = strip_ansi(&std::fs::read_to_string(&path).unwrap_or_default());
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
                out.push_str(&format!("--- {}\n{}\n", path.display(), tail.join("\n")));
            }
        }
        out
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "fleet.sh stdout:\n{}\nfleet.sh stderr:\n{}\n{}",
                self.stdout.join("\n"),
                self.stderr(),
                self.log_tails()
            );
        }
        self.stop();
    }
}

/// Sends each line of `from` to `to`, tagged with its stream, until either end closes.
fn forward_lines(
    from: impl std::io::Read + Send + 'static,
    stream: Stream,
    to: mpsc::Sender<(Stream, String)>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if to.send((stream, line)).is_err() {
                break;
            }
        }
    });
}

/// Drops terminal colour sequences (`ESC [ ... letter`) from a log.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// Sends a signal to one process the test started (or fleet.sh started for it), by its id.
pub fn signal(name: &str, pid: u32) {
    let _ = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// A base port with `size` free ports from it, and a free port for nginx above them, all
/// below the ephemeral range so that outgoing connections do not take them meanwhile.
fn free_ports(size: u16) -> (u16, u16) {
    let free = |port: u16| TcpListener::bind(("127.0.0.1", port)).is_ok();
    for _ in 0..200 {
        let base = 20_000 + (rand::random::<u16>() % 12_000);
        let lb = base + size;
        if (base..=lb).all(free) {
            return (base, lb);
        }
    }
    panic!("no free run of loopback ports found");
}
