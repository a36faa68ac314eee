//! The watch stream (issue 16): how many events per second one replica streams to 1,000
//! subscribers, and what an idle subscriber costs. Not a criterion bench: each figure is
//! one timed run over real loopback HTTP, printed with its parameters.
//!
//! `cargo bench --bench watch` (release). The subscribers are raw TCP clients in this
//! process that only count the events they read; the writes go straight into the embedded
//! store (a replica's hub sees them through the store's watch exactly as another
//! replica's writes), so what is measured is the hub and the SSE path, not the write path.
//! A writer runs in rounds of `ROUND` versions and waits until every subscriber has read
//! the round, so no subscriber lags and every event is delivered.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use tally::account::{AccountEvent, AccountId, Identity};
use tally::app::App;
use tally::config::Config;
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, Event, SharedLog};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use uuid::Uuid;

/// Live heap bytes, to price an idle subscriber.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const SUBSCRIBERS: usize = 1000;
/// Versions written per round before the writer waits for every subscriber.
const ROUND: u64 = 100;
/// Writes in a throughput run: to one hot account, and spread (20 per account).
const VERSIONS_HOT: u64 = 2000;
const VERSIONS_SPREAD: u64 = 20_000;

struct Replica {
    app: Arc<App>,
    store: Arc<MemoryLog>,
    addr: std::net::SocketAddr,
}

async fn replica() -> Replica {
    let config = Config::parse_from([
        "tally",
        "--seed-demo-accounts",
        "false",
        "--watch-max-subscribers",
        "5000",
        "--watch-max-per-account",
        "5000",
        "--max-connections",
        "10000",
    ]);
    let store = Arc::new(MemoryLog::new());
    let app = App::builder(config)
        .store(store.clone() as SharedLog)
        .build()
        .await
        .expect("app");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(tally::http::serve(
        app.clone(),
        listener,
        std::future::pending(),
    ));
    Replica { app, store, addr }
}

/// Opens a stream and reads up to its snapshot; returns the connection.
async fn open(addr: std::net::SocketAddr, account: Uuid) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!("GET /api/accounts/{account}/events HTTP/1.1\r\nHost: bench\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !contains(&seen, b"event: snapshot") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "stream closed before its snapshot");
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Reads a stream, adding each `event: Deposited` to `count`, until `want` events.
async fn consume(mut s: TcpStream, count: Arc<AtomicU64>, want: u64) {
    let needle = b"event: Deposited";
    let mut buf = vec![0u8; 64 * 1024];
    let mut carry: Vec<u8> = Vec::new();
    let mut got = 0;
    while got < want {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "stream closed after {got} events");
        carry.extend_from_slice(&buf[..n]);
        let mut i = 0;
        let mut last_end = 0;
        while i + needle.len() <= carry.len() {
            if &carry[i..i + needle.len()] == needle {
                got += 1;
                count.fetch_add(1, Ordering::Relaxed);
                i += needle.len();
                last_end = i;
            } else {
                i += 1;
            }
        }
        // Keep a tail that could hold the start of a split needle.
        let keep_from = last_end.max(carry.len().saturating_sub(needle.len()));
        carry.drain(..keep_from);
    }
}

fn deposit(store: &MemoryLog, client: u128, account: Uuid, seq: u64) {
    let event = AccountEvent::Deposited { amount: 1 };
    let key = Identity::default().key(AccountId(account));
    store
        .write_now(
            client,
            vec![AggregateWrite {
                key,
                events: vec![Event {
                    client_seq: seq,
                    event_id: None,
                    event_type: event.event_type(),
                    payload: event.encode(),
                    timestamp_ms: 0,
                }],
                expected_version: None,
                allow_create: true,
                enforce_client_idempotency: false,
            }],
        )
        .unwrap();
}

/// `SUBSCRIBERS` streams spread evenly over `accounts` accounts, and `versions` writes in
/// all, round-robin over the accounts.
async fn throughput(accounts: usize, versions: u64) {
    let r = replica().await;
    let ids: Vec<Uuid> = (0..accounts).map(|_| Uuid::new_v4()).collect();
    let per_account = (SUBSCRIBERS / accounts) as u64;
    let count = Arc::new(AtomicU64::new(0));
    let mut consumers = Vec::new();
    for i in 0..SUBSCRIBERS {
        let s = open(r.addr, ids[i % accounts]).await;
        let want = versions / accounts as u64;
        consumers.push(tokio::spawn(consume(s, count.clone(), want)));
    }
    let client = Uuid::new_v4().as_u128();
    let started = Instant::now();
    let mut written = 0u64;
    while written < versions {
        for _ in 0..ROUND {
            deposit(
                &r.store,
                client,
                ids[(written as usize) % accounts],
                written + 1,
            );
            written += 1;
        }
        // Every subscriber of every account written in this round has its events.
        let expect = written * per_account;
        while count.load(Ordering::Relaxed) < expect {
            tokio::task::yield_now().await;
        }
    }
    for c in consumers {
        c.await.unwrap();
    }
    let elapsed = started.elapsed();
    let delivered = count.load(Ordering::Relaxed);
    println!(
        "throughput: {SUBSCRIBERS} subscribers over {accounts} account(s), {versions} writes: \
         {delivered} events delivered in {:.2} s = {:.0} events/s ({:.0} writes/s)",
        elapsed.as_secs_f64(),
        delivered as f64 / elapsed.as_secs_f64(),
        versions as f64 / elapsed.as_secs_f64(),
    );
    assert_eq!(
        delivered,
        versions * per_account,
        "every event delivered once"
    );
    assert_eq!(
        r.app
            .metrics
            .watch_dropped
            .with_label_values(&["lagged"])
            .get(),
        0,
        "no subscriber lagged"
    );
}

/// Heap per idle stream: live bytes with `SUBSCRIBERS` idle streams open, minus the same
/// number of bare client connections to a listener that only accepts (the client's share).
async fn idle_cost(accounts: usize) {
    let r = replica().await;
    let ids: Vec<Uuid> = (0..accounts).map(|_| Uuid::new_v4()).collect();
    // Warm up allocations that happen once (first stream, first channel of each kind).
    let warm = open(r.addr, Uuid::new_v4()).await;
    drop(warm);
    while r.app.watch.subscribers() > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = LIVE.load(Ordering::SeqCst);
    let mut streams = Vec::new();
    for i in 0..SUBSCRIBERS {
        streams.push(open(r.addr, ids[i % accounts]).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let with_streams = LIVE.load(Ordering::SeqCst) - before;

    let bare = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bare_addr = bare.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = bare.accept().await {
            conns.push(c);
        }
    });
    let before_bare = LIVE.load(Ordering::SeqCst);
    let mut clients = Vec::new();
    for _ in 0..SUBSCRIBERS {
        clients.push(TcpStream::connect(bare_addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bare_cost = LIVE.load(Ordering::SeqCst) - before_bare;
    held.abort();
    drop(clients);
    // An idle keep-alive HTTP connection after one request: hyper's share.
    let before_http = LIVE.load(Ordering::SeqCst);
    let mut idle_http = Vec::new();
    for _ in 0..SUBSCRIBERS {
        let mut s = TcpStream::connect(r.addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let mut seen = Vec::new();
        while !contains(&seen, b"\"ok\"") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            seen.extend_from_slice(&buf[..n]);
        }
        idle_http.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let http_cost = LIVE.load(Ordering::SeqCst) - before_http;
    println!(
        "idle: {SUBSCRIBERS} idle keep-alive HTTP connections (no stream): {:.0} bytes each",
        (http_cost - bare_cost) as f64 / SUBSCRIBERS as f64
    );
    drop(idle_http);
    let per = (with_streams - bare_cost) as f64 / SUBSCRIBERS as f64;
    println!(
        "idle: {SUBSCRIBERS} idle streams over {accounts} account(s): {with_streams} heap bytes \
         with both ends, {bare_cost} for bare connections; {per:.0} bytes per idle stream \
         (server side: hyper connection, task, buffers, hub slot{})",
        if accounts > 1 {
            ", one hub channel each"
        } else {
            ""
        }
    );
    drop(streams);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    if std::env::args().any(|a| a == "idle") {
        idle_cost(1).await;
        return;
    }
    throughput(1, VERSIONS_HOT).await;
    throughput(SUBSCRIBERS, VERSIONS_SPREAD).await;
    idle_cost(1).await;
    idle_cost(SUBSCRIBERS).await;
}
