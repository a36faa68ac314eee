//! The store's liveness as `/readyz` reports it: one ping answers every probe for
//! [`PING_REUSE`], so probes (unauthenticated, ungated) cannot turn into store load.

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::EventLog;

/// How long one ping's answer stands for every probe after it.
pub const PING_REUSE: Duration = Duration::from_secs(1);

/// The last ping and when it ended. Its lock is held across the ping, so probes that
/// arrive meanwhile wait for that one instead of sending their own.
#[derive(Default)]
pub struct SharedPing {
    last: Mutex<Option<(Instant, Result<(), String>)>>,
}

impl SharedPing {
    /// Whether the store answers: the last answer if it is younger than [`PING_REUSE`],
    /// else a fresh ping bounded by `timeout`. `Err` says why not.
    pub async fn ping(&self, log: &dyn EventLog, timeout: Duration) -> Result<(), String> {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < PING_REUSE
        {
            return answer.clone();
        }
        let answer = match tokio::time::timeout(timeout, log.ping()).await {
            Ok(Ok(())) => Ok(()),
            // The class only: a probe is open to anyone, and the client's words carry node
            // addresses and OS errors. The store's health logs them when it is lost.
            Ok(Err(e)) => Err(format!("store not reachable ({})", e.brief())),
            Err(_) => Err("store did not answer in time".into()),
        };
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}
