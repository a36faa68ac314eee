//! Samples the server under test from `/proc` (Linux, same machine): resident memory at the
//! start and end of the measured phase and its sampled peak, and the CPU time it used, so an
//! overload run can show that memory stays flat and what each answer cost.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::task::JoinHandle;

/// How often resident memory is sampled for the peak.
pub const RSS_SAMPLE_INTERVAL: Duration = Duration::from_millis(500);
/// Clock ticks per second in `/proc/PID/stat` (`USER_HZ`, fixed at 100 in Linux's ABI).
const USER_HZ: f64 = 100.0;
/// Fields of `/proc/PID/stat` after the command name: `utime` and `stime` are the 12th and
/// 13th (fields 14 and 15 of the whole line).
const UTIME_AFTER_COMM: usize = 11;

/// True when `/proc` has a process `pid`.
pub fn exists(pid: u32) -> bool {
    pid > 0 && std::path::Path::new(&format!("/proc/{pid}/status")).exists()
}

/// The process's resident set, in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss(&status)
}

/// `VmRSS` from the text of `/proc/PID/status`.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// CPU seconds (user + system, every thread) the process has used.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|ticks| ticks as f64 / USER_HZ)
}

/// `utime + stime` in clock ticks from the text of `/proc/PID/stat`. The command name (in
/// parentheses) may hold spaces, so fields are counted after its closing parenthesis.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(UTIME_AFTER_COMM);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// What the server used over the measured phase.
#[derive(Debug, Clone, Serialize)]
pub struct ServerUsage {
    pub pid: u32,
    pub rss_start_kib: u64,
    pub rss_end_kib: u64,
    /// Highest resident set seen, sampled every [`RSS_SAMPLE_INTERVAL`] and at both ends.
    pub rss_max_kib: u64,
    /// CPU seconds the server used during the measured phase (10 ms resolution).
    pub cpu_secs: f64,
    /// `cpu_secs` per request sent in the measured phase, in microseconds.
    pub cpu_us_per_request: f64,
}

/// A running sample of one process, started with the measured phase.
pub struct Sampler {
    pid: u32,
    rss_start_kib: u64,
    cpu_start: f64,
    peak: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Sampler {
    /// Takes the starting sample and begins sampling the peak; `None` if `pid` is gone.
    pub fn start(pid: u32) -> Option<Self> {
        let rss_start_kib = rss_kib(pid)?;
        let cpu_start = cpu_secs(pid)?;
        let peak = Arc::new(AtomicU64::new(rss_start_kib));
        let task = tokio::spawn({
            let peak = peak.clone();
            async move {
                let mut tick = tokio::time::interval(RSS_SAMPLE_INTERVAL);
                loop {
                    tick.tick().await;
                    match rss_kib(pid) {
                        Some(kib) => peak.fetch_max(kib, Ordering::Relaxed),
                        None => return,
                    };
                }
            }
        });
        Some(Sampler {
            pid,
            rss_start_kib,
            cpu_start,
            peak,
            task,
        })
    }

    /// Takes the closing sample; `None` if the process has gone.
    pub fn finish(self, requests: u64) -> Option<ServerUsage> {
        self.task.abort();
        let rss_end_kib = rss_kib(self.pid)?;
        let cpu_secs = (cpu_secs(self.pid)? - self.cpu_start).max(0.0);
        Some(ServerUsage {
            pid: self.pid,
            rss_start_kib: self.rss_start_kib,
            rss_end_kib,
            rss_max_kib: self.peak.load(Ordering::Relaxed).max(rss_end_kib),
            cpu_secs,
            cpu_us_per_request: if requests > 0 {
                cpu_secs * 1e6 / requests as f64
            } else {
                0.0
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_fields_are_read_past_a_command_with_spaces() {
        let stat = "4242 (tally (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 1234 567 0 0 20 0 5";
        assert_eq!(parse_cpu_ticks(stat), Some(1234 + 567));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        let status = "Name:\ttally\nVmPeak:\t  9000 kB\nVmRSS:\t  5120 kB\nThreads:\t3\n";
        assert_eq!(parse_vm_rss(status), Some(5120));
        assert_eq!(parse_vm_rss("Name:\ttally\n"), None);
    }

    #[tokio::test]
    async fn this_process_can_be_sampled() {
        let me = std::process::id();
        assert!(exists(me));
        assert!(!exists(0));
        let sampler = Sampler::start(me).expect("own /proc entry");
        let usage = sampler.finish(10).expect("still running");
        assert!(usage.rss_start_kib > 0 && usage.rss_max_kib >= usage.rss_end_kib);
        assert!(usage.cpu_secs >= 0.0);
    }
}
