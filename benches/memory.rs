//! Memory per resident account, measured exactly with a counting allocator:
//! 1. bytes per resident idle account (folded, no index entries);
//! 2. with the cap at `CAP`, live bytes and RSS while `TOUCHED` distinct accounts are touched
//!    through catch-up, with the real background sweeper doing the evicting.
//!
//! `cargo bench --bench memory` (sizes can be lowered with TALLY_MEM_CAP / TALLY_MEM_TOUCHED).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use tally::account::{AccountId, Identity};
use tally::metrics::Metrics;
use tally::projection::{MonotonicClock, Projection, ProjectionConfig};
use tally::store::memory::MemoryLog;
use uuid::Uuid;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn projection(cap: usize) -> Arc<Projection> {
    Arc::new(Projection::new(
        Arc::new(MemoryLog::new()),
        Identity::default(),
        ProjectionConfig {
            max_resident_accounts: cap,
            ..ProjectionConfig::default()
        },
        Arc::new(MonotonicClock::new()),
        Arc::new(Metrics::new()),
    ))
}

fn account(n: u64) -> AccountId {
    AccountId(Uuid::from_u64_pair(0x7a11_7a11, n))
}

fn main() {
    // Criterion passes flags such as --bench; this harness has none to take.
    let cap = env_usize("TALLY_MEM_CAP", 1_000_000);
    let touched = env_usize("TALLY_MEM_TOUCHED", 5_000_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // 1. Bytes per resident idle account.
        let n = cap.min(1_000_000);
        let p = projection(usize::MAX);
        let before = live();
        for i in 0..n as u64 {
            p.catch_up(account(i)).await.expect("catch-up");
        }
        let per = (live() - before) as f64 / n as f64;
        println!(
            "resident idle accounts: {n}, {per:.1} bytes each (live heap, incl. map slots), resident = {}",
            p.resident_accounts()
        );
        drop(p);

        // 2. Flat memory under the cap while many more accounts are touched.
        let p = projection(cap);
        let sweeper = tokio::spawn(p.clone().run_sweeper(Duration::from_secs(1), std::future::pending()));
        let base = live();
        let started = Instant::now();
        let step = (touched / 10).max(1);
        let mut peak_resident = 0;
        let mut peak_live = 0;
        for i in 0..touched as u64 {
            p.catch_up(account(1_000_000_000 + i)).await.expect("catch-up");
            if (i as usize + 1).is_multiple_of(step) {
                // Let the sweeper run between bursts, as it does between requests.
                tokio::task::yield_now().await;
                let resident = p.resident_accounts();
                let l = live() - base;
                peak_resident = peak_resident.max(resident);
                peak_live = peak_live.max(l);
                println!(
                    "touched {:>9}: resident {:>9}, live heap {:>7.1} MiB, rss {:>7.1} MiB",
                    i + 1,
                    resident,
                    l as f64 / 1048576.0,
                    rss_bytes() as f64 / 1048576.0
                );
            }
        }
        sweeper.abort();
        println!(
            "cap {cap}: {touched} accounts touched in {:.1} s; peak resident {peak_resident}, peak live heap {:.1} MiB ({:.1} bytes per cap slot)",
            started.elapsed().as_secs_f64(),
            peak_live as f64 / 1048576.0,
            peak_live as f64 / cap as f64
        );
    });
}
