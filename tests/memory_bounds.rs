//! What one client can make the server hold in memory, counted by a global allocator of
//! this binary's own (so no other suite's allocations count; the tests here take turns).
//! Unbounded, a 64 KiB body in 1-byte chunks would hold about 2.4 MiB, and a client
//! pipelining requests would grow its connection's read buffer to hyper's ~400 KB for good.

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser;
use tally::app::App;
use tally::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bytes allocated now, and the most since the last [`reset_peak`].
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: every call goes to `System` unchanged; only the counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The tests take turns: each measures the whole process.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long any one exchange may take before the test fails instead of hanging.
const BOUND: Duration = Duration::from_secs(60);

fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

/// One instance on its own embedded store, on a loopback port.
async fn start() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let config = Config::parse_from(["tally", "--listen", "127.0.0.1:0"]);
    config.validate().expect("valid config");
    let app: Arc<App> = App::builder(config).build().await.expect("app builds");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tally::http::serve(app, listener, async {
        let _ = stopped.await;
    }));
    (addr, stop)
}

/// One ordinary deposit, answered, so what the server builds once (its first account, the
/// runtime's and the allocator's own structures) is not counted against the measurement.
async fn warm_up(addr: SocketAddr) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let body = r#"{"amountCents":1}"#;
    let request = format!(
        "POST /api/accounts/{}/deposit HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        uuid::Uuid::new_v4(),
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("sent");
    read_answers(&mut stream, 1, "HTTP/1.1 200").await;
}

/// Reads from `stream` until `answers` complete answers (counted by their status lines and
/// short bodies) have arrived; returns the bytes.
async fn read_answers(stream: &mut TcpStream, answers: usize, status: &str) -> String {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    tokio::time::timeout(BOUND, async {
        while String::from_utf8_lossy(&got).matches(status).count() < answers {
            let n = stream.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed after {} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("answered within the bound");
    String::from_utf8_lossy(&got).into_owned()
}

/// Rule: a body costs the server about its own size however it is framed: 60,000 bytes
/// sent as 60,000 one-byte chunks are read into one buffer, not held frame by frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_in_one_byte_chunks_costs_about_its_own_size() {
    let _turn = TURN.lock().await;
    let (addr, _stop) = start().await;
    warm_up(addr).await;
    const BODY_BYTES: usize = 60_000;
    let json = br#"{"amountCents":1}"#;
    let mut body = json.to_vec();
    body.resize(BODY_BYTES, b' ');
    let account = uuid::Uuid::new_v4();
    let mut wire = format!(
        "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nIdempotency-Key: chunky\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for b in &body {
        wire.extend_from_slice(b"1\r\n");
        wire.push(*b);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let before = reset_peak();
    stream.write_all(&wire).await.expect("sent");
    let answer = read_answers(&mut stream, 1, "HTTP/1.1 ").await;
    let peak = PEAK.load(Ordering::Relaxed) - before;
    eprintln!("peak heap growth for a {BODY_BYTES}-byte body in 1-byte chunks: {peak} bytes");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Before: about 32 bytes of frame bookkeeping per chunk plus the wire bytes the frames
    // pinned, some 2.3 MB. Now: the body once, hyper's capped read buffer, and the write.
    assert!(
        peak < 8 * BODY_BYTES,
        "peak heap growth {peak} bytes for a {BODY_BYTES}-byte body"
    );
}

/// Rule: a connection's read buffer stays small however many requests its client pipelines
/// (hyper grew it to ~400 KB and never gave it back): after the answers, 8 such connections
/// still open hold well under 64 KiB each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelining_client_leaves_its_connection_no_large_buffer() {
    let _turn = TURN.lock().await;
    let (addr, _stop) = start().await;
    warm_up(addr).await;
    const CONNECTIONS: usize = 8;
    const REQUESTS: usize = 6_000;
    let request = "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let burst = request.repeat(REQUESTS);
    let before = LIVE.load(Ordering::Relaxed);
    let mut open = Vec::new();
    for _ in 0..CONNECTIONS {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut rx, mut tx) = stream.into_split();
        let burst = burst.clone();
        // Written by its own task while this one reads: the server stops reading when its
        // answers are not taken.
        let writer = tokio::spawn(async move {
            tx.write_all(burst.as_bytes()).await.expect("sent");
            tx
        });
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        // The last bytes read, too short to hold a whole status line: one cut in two by a
        // read is counted once, when it completes.
        let mut carry: Vec<u8> = Vec::new();
        let status = b"HTTP/1.1 200";
        tokio::time::timeout(BOUND, async {
            while got < REQUESTS {
                let n = rx.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed after {got} answers");
                carry.extend_from_slice(&buf[..n]);
                got += carry.windows(status.len()).filter(|w| w == status).count();
                carry.drain(..carry.len().saturating_sub(status.len() - 1));
            }
        })
        .await
        .expect("answered within the bound");
        let tx = writer.await.expect("writer");
        open.push(rx.reunite(tx).expect("one stream"));
    }
    let held = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    eprintln!("{CONNECTIONS} pipelining connections, open after their answers: {held} bytes");
    assert!(
        held < CONNECTIONS * 64 * 1024,
        "{CONNECTIONS} connections that pipelined {REQUESTS} requests each hold {held} bytes"
    );
    drop(open);
}
