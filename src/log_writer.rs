//! Log lines to stdout in batches: a request that logs a line copies it into a buffer, and a
//! thread of its own writes the buffer out every [`FLUSH_INTERVAL`]. A write per line was a
//! system call on nearly every request (BENCHMARKS.md, "Tally's own CPU").
//!
//! Written here rather than with `tracing-appender`'s non-blocking writer, which writes as
//! soon as its queue is empty: on two busy cores that was a write, and a wake of its thread,
//! every line or two. Lines keep their order; the buffer is bounded ([`MAX_BUFFERED_BYTES`]:
//! past it, the line that fills it writes the batch out itself, so a log consumer that cannot
//! keep up slows the service as it did before, and never grows its memory). A line waits at
//! most one interval; what is buffered when the process is killed outright (SIGKILL) is
//! lost, while a clean stop writes it all ([`LogWriterGuard`]).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in the buffer.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(10);
/// The most bytes of lines buffered; the line that passes it writes them out.
pub const MAX_BUFFERED_BYTES: usize = 1 << 20;

/// The sink the log formatter writes its lines to.
pub struct Batched<W: Write + Send + 'static> {
    shared: Arc<Shared<W>>,
}

/// Keeps the writer thread; dropping it stops the thread after a last write.
pub struct LogWriterGuard {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Shared<W> {
    /// Lines not yet written.
    buffer: Mutex<Vec<u8>>,
    /// Where batches go; held while one is taken and written, so they go out in order.
    out: Mutex<W>,
}

impl<W: Write> Shared<W> {
    fn write_out(&self) {
        let mut out = self.out.lock();
        let batch = std::mem::take(&mut *self.buffer.lock());
        if !batch.is_empty() {
            // A log that cannot be written is nothing a request can act on.
            let _ = out.write_all(&batch).and_then(|()| out.flush());
        }
    }
}

/// Batched lines to stdout: the sink, and the guard of its writer thread. `None` when the
/// thread cannot be started (the caller then logs straight to stdout).
pub fn batched_stdout() -> Option<(Batched<std::io::Stdout>, LogWriterGuard)> {
    batched(std::io::stdout())
}

/// Batched lines to `out`.
pub fn batched<W: Write + Send + 'static>(out: W) -> Option<(Batched<W>, LogWriterGuard)> {
    let shared = Arc::new(Shared {
        buffer: Mutex::new(Vec::with_capacity(64 * 1024)),
        out: Mutex::new(out),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (flusher, stopping) = (shared.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("tally-log".into())
        .spawn(move || {
            while !stopping.load(Ordering::Acquire) {
                std::thread::park_timeout(FLUSH_INTERVAL);
                flusher.write_out();
            }
            flusher.write_out();
        })
        .ok()?;
    let guard = LogWriterGuard {
        stop,
        thread: Some(thread),
    };
    Some((Batched { shared }, guard))
}

impl Drop for LogWriterGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

/// One line's writer: borrows the sink, so a line costs no reference count.
pub struct LineSink<'a, W: Write>(&'a Shared<W>);

impl<W: Write> Write for LineSink<'_, W> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let full = {
            let mut buffer = self.0.buffer.lock();
            buffer.extend_from_slice(line);
            buffer.len() >= MAX_BUFFERED_BYTES
        };
        if full {
            self.0.write_out();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + Send + 'static> MakeWriter<'a> for Batched<W> {
    type Writer = LineSink<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        LineSink(&self.shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer the test can read back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(sink: &Batched<Captured>, text: &str) {
        sink.make_writer().write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn lines_go_out_in_order_and_all_of_them_by_a_clean_stop() {
        let out = Captured::default();
        let (sink, guard) = batched(out.clone()).expect("a writer thread");
        let lines: Vec<String> = (0..2_000).map(|i| format!("line {i}\n")).collect();
        for l in &lines {
            line(&sink, l);
        }
        drop(guard);
        assert_eq!(
            String::from_utf8(out.0.lock().clone()).unwrap(),
            lines.concat()
        );
    }

    #[test]
    fn a_line_past_the_bound_writes_the_batch_itself() {
        let out = Captured::default();
        let (sink, guard) = batched(out.clone()).expect("a writer thread");
        // The writer thread is not waited for: the bound alone puts these out.
        let big = "x".repeat(MAX_BUFFERED_BYTES);
        line(&sink, &big);
        assert!(out.0.lock().len() >= MAX_BUFFERED_BYTES);
        assert!(sink.shared.buffer.lock().is_empty());
        drop(guard);
    }
}
