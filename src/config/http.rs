//! The HTTP edge's flags: where it listens, and how much it takes on at once.
//!
//! They live in the configuration, not in `crate::http`, which sits above it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::flag::{count, usize_in};
use crate::write_loop::DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT;
use crate::write_loop::config::MAX_QUEUED_WRITES_PER_ACCOUNT;

/// How long an answer waits for its client to read any of it, unless configured: longer
/// than a watch stream's own stall limit with the default keep-alive (2 x 15 s), so that
/// one comes first and the stream can still tell its client why it ended.
pub const DEFAULT_WRITE_STALL_SECS: u64 = 60;
/// The largest accepted `--write-stall-secs`.
pub const MAX_WRITE_STALL_SECS: u64 = 3_600;
/// The most requests served at once, unless configured; beyond it a request waits for a slot
/// (up to `--max-queue-wait-ms`). No more than one account's write queue holds: were every
/// request in flight a write to one hot account, none would be refused by the write side's
/// per-account cap at once (a refusal that clients re-sending at once turn into a spin); the
/// excess waits here instead. 64 requests in flight already reach a replica's peak.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT;
/// How long shutdown waits for in-flight requests, unless configured.
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 10;
/// The most bytes of one request's head (request line and headers) read, unless
/// configured; a longer head is answered 414 (its request line alone passes the limit) or 431,
/// in the API's JSON error shape, and its connection closed. Tally's own
/// headers (an Idempotency-Key, a content type) take well under 1 KiB, proxies add a few
/// hundred bytes; 16 KiB leaves room for tracing and auth headers without letting every
/// connection pin hyper's ~400 KB read buffer.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// The accepted range of `--max-header-bytes`: below 1 KiB ordinary requests fail, and
/// above 256 KiB the cap would sit next to hyper's own read-buffer limit (~400 KB).
pub const HEADER_BYTES_RANGE: std::ops::RangeInclusive<usize> = 1024..=256 * 1024;

/// The most client connections open at once, unless configured. At the cap the server stops
/// accepting: further clients wait in the kernel's accept queue, costing neither memory nor
/// CPU here (about 10 KiB per open connection otherwise).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// How long a request over `--max-concurrent-requests` waits for a slot, unless configured:
/// long enough that a burst or a re-sending client waits instead of spinning on refusals,
/// short enough that an admitted request's wait stays far under a second.
pub const DEFAULT_MAX_QUEUE_WAIT_MS: u64 = 250;
/// The gate's floor, unless configured: requests worked on at once that the gate never goes
/// below, and where it starts. Enough to keep two cores busy with room for a batch; on the
/// embedded store with the server pinned to one core and 1,500 connections (wrk), a fixed 4
/// to 32 slots all kept 0.76-0.81 of peak goodput, where 128 kept 0.70.
pub const DEFAULT_MIN_ACTIVE_REQUESTS: usize = 16;
/// The gate's ceiling, unless configured: no more than the in-flight limit behind it, so a
/// request that passed the gate is never the one shed there.
pub const DEFAULT_MAX_ACTIVE_REQUESTS: usize = DEFAULT_MAX_CONCURRENT_REQUESTS;
/// The largest `--max-active-requests` accepted (and `--max-concurrent-requests`): as many
/// as one account's write queue may hold.
pub const MAX_ACTIVE_REQUESTS: usize = MAX_QUEUED_WRITES_PER_ACCOUNT;
/// The longest `--max-queue-wait-ms` accepted (the write deadline's order of magnitude).
pub const MAX_QUEUE_WAIT_MS: u64 = 10_000;
/// The most runtime worker threads `--worker-threads` accepts.
pub const MAX_WORKER_THREADS: usize = 256;
/// The most client connections `--max-connections` accepts: far past what one process's
/// file descriptors allow on any usual system.
pub const MAX_CONNECTIONS: usize = 1 << 20;
/// The most names `--allowed-hosts` takes.
pub const MAX_ALLOWED_HOSTS: usize = 256;
/// The longest `--shutdown-grace-secs` accepted (an hour).
pub const MAX_SHUTDOWN_GRACE_SECS: u64 = 3_600;

/// The most items one `POST /api/batch` carries, unless configured.
pub const DEFAULT_BATCH_MAX_ITEMS: usize = 1_000;
/// The most `--batch-max-items` accepts.
pub const MAX_BATCH_MAX_ITEMS: usize = 10_000;
/// The most bytes one batch's body carries, unless configured: a thousand items of about
/// 200 bytes each, with room to spare.
pub const DEFAULT_BATCH_MAX_BYTES: usize = 1 << 20;
/// The most `--batch-max-bytes` accepts.
pub const MAX_BATCH_MAX_BYTES: usize = 16 << 20;
/// Items of one batch in the write loop at once, unless configured. Each holds a live-write
/// permit as a single request does, so 32 of the 1,024 leave room for singles beside
/// batches.
pub const DEFAULT_BATCH_ITEMS_IN_FLIGHT: usize = 32;
/// The most `--batch-items-in-flight` accepts.
pub const MAX_BATCH_ITEMS_IN_FLIGHT: usize = 1_024;

/// Where the HTTP edge listens and its limits (admission at the edge). The gate's
/// floor and ceiling are hidden from `--help`: they are for measuring the design
/// (BENCHMARKS.md, "Flags for measuring the design").
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Listening and limits")]
pub struct HttpConfig {
    /// Address to serve HTTP on.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Client connections open at once; beyond it, clients wait to be accepted.
    #[arg(long, env = "TALLY_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = count(MAX_CONNECTIONS))]
    pub max_connections: usize,

    /// Requests served at once; beyond it, a request waits for a slot.
    #[arg(long, env = "TALLY_MAX_CONCURRENT_REQUESTS", default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub max_concurrent_requests: usize,

    /// How long a request waits for a slot before a 503, in ms (0: refuse at once).
    #[arg(long, env = "TALLY_MAX_QUEUE_WAIT_MS", default_value_t = DEFAULT_MAX_QUEUE_WAIT_MS, value_parser = clap::value_parser!(u64).range(0..=MAX_QUEUE_WAIT_MS))]
    pub max_queue_wait_ms: u64,

    /// Most bytes of a request's line and headers; a longer head gets a 414 or 431.
    #[arg(long, env = "TALLY_MAX_HEADER_BYTES", default_value_t = DEFAULT_MAX_HEADER_BYTES, value_parser = usize_in(HEADER_BYTES_RANGE))]
    pub max_header_bytes: usize,

    /// Seconds an answer waits for a client that reads nothing before its connection closes.
    #[arg(long, env = "TALLY_WRITE_STALL_SECS", default_value_t = DEFAULT_WRITE_STALL_SECS, value_parser = clap::value_parser!(u64).range(1..=MAX_WRITE_STALL_SECS))]
    pub write_stall_secs: u64,

    /// How long shutdown waits for in-flight requests, in seconds.
    #[arg(long, env = "TALLY_SHUTDOWN_GRACE_SECS", default_value_t = DEFAULT_SHUTDOWN_GRACE_SECS, value_parser = clap::value_parser!(u64).range(0..=MAX_SHUTDOWN_GRACE_SECS))]
    pub shutdown_grace_secs: u64,

    /// Host names served beyond local ones (`*`: any). Unset: local only, any on `--auth jwt`.
    #[arg(long, env = "TALLY_ALLOWED_HOSTS", value_delimiter = ',', num_args = 1.., value_parser = allowed_host)]
    pub allowed_hosts: Vec<String>,

    /// Most items one `POST /api/batch` carries; a larger batch is refused whole.
    #[arg(long, env = "TALLY_BATCH_MAX_ITEMS", default_value_t = DEFAULT_BATCH_MAX_ITEMS, value_parser = count(MAX_BATCH_MAX_ITEMS))]
    pub batch_max_items: usize,

    /// Most bytes of one batch's body; a larger batch is refused whole (413).
    #[arg(long, env = "TALLY_BATCH_MAX_BYTES", default_value_t = DEFAULT_BATCH_MAX_BYTES, value_parser = count(MAX_BATCH_MAX_BYTES))]
    pub batch_max_bytes: usize,

    /// Items of one batch written at once; each holds a live-write permit as a request does.
    #[arg(long, env = "TALLY_BATCH_ITEMS_IN_FLIGHT", default_value_t = DEFAULT_BATCH_ITEMS_IN_FLIGHT, value_parser = count(MAX_BATCH_ITEMS_IN_FLIGHT))]
    pub batch_items_in_flight: usize,

    /// Runtime worker threads. Default: one per core this process may use.
    #[arg(long, env = "TALLY_WORKER_THREADS", value_parser = count(MAX_WORKER_THREADS))]
    pub worker_threads: Option<usize>,

    /// The gate's floor: requests worked on at once (taken before a request is read) never
    /// drop below it; the gate adapts between this and `--max-active-requests` to how busy
    /// the CPU is.
    #[arg(hide = true, long, env = "TALLY_MIN_ACTIVE_REQUESTS", default_value_t = DEFAULT_MIN_ACTIVE_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub min_active_requests: usize,

    /// The gate's ceiling; equal to `--min-active-requests` it fixes the limit. Connections
    /// over the limit wait with their request unread, in the kernel's socket buffer.
    #[arg(hide = true, long, env = "TALLY_MAX_ACTIVE_REQUESTS", default_value_t = DEFAULT_MAX_ACTIVE_REQUESTS, value_parser = count(MAX_ACTIVE_REQUESTS))]
    pub max_active_requests: usize,
}

/// One `--allowed-hosts` name: `*`, or a host name without port, kept lowercase and
/// without a trailing dot (as a `Host` header's name is compared).
fn allowed_host(value: &str) -> Result<String, String> {
    let name = value.trim().trim_end_matches('.').to_ascii_lowercase();
    let valid = name == "*"
        || (!name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
    if valid {
        Ok(name)
    } else {
        Err(format!(
            "{value:?} is not a host name (letters, digits, '-' and '.'), nor '*'"
        ))
    }
}

impl HttpConfig {
    /// How long an answer may wait for its client to read any of it.
    pub fn write_stall(&self) -> Duration {
        Duration::from_secs(self.write_stall_secs)
    }

    /// How long a request waits for an in-flight slot before it is refused.
    pub fn max_queue_wait(&self) -> Duration {
        Duration::from_millis(self.max_queue_wait_ms)
    }
}
